"""One rank of a 2-process FSDP2 job (``torchrun --nproc_per_node 2``, gloo,
CPU), run by test_trl_ranks.Fsdp2HeadTest. accelerate runs no FSDP on the
CPU, so the model is sharded here with torch's own ``fully_shard`` on a
CPU mesh, every ``Linear`` and decoder layer its own unit: the
``lm_head.weight`` TRL's fused forward (``add_fused_lm_head``) reads is a
``Shard(0)`` DTensor, which TRL gathers per call. ``use_service`` gets what
it reads of a trainer (``ShardedTrainer``).

Two policy versions (step 0; step 1 after an SGD step through TRL's kernel
with gradients), each scored by a no-gradient call of the policy and one
of the reference model; every answer is checked against float64 on the
call's inputs. Then logprob_client.verl's ``push`` of the trained
``Shard(0)`` weight (a seam module of its own: no verl needed), and of
other bytes under that name (rank 0's error, raised on every rank).
Last a model whose ``lm_head`` is in the root's unit (FSDP2 unshards it
for the forward: TRL's call gets the whole parameter, which rank 0
pushes), and a backward after that push (FSDP2 frees the whole
parameter's storage then). Writes
``OUT/rank<R>.json``: the routed calls, pushes, run id, the checks'
outcomes, and (rank 0) the sha256 of the whole policy weight at each push
and the server's sha256 of the head's version then.

Usage: fsdp2_ranks.py OUT_DIR SERVER_ADDRESS
"""

import json
import os
import sys
import types

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard
from trl.trainer.utils import add_fused_lm_head

from logprob_client import LogprobClient, LogprobError, fused_head
from logprob_client.trl import use_service
from logprob_client.verl import use_service as use_verl_service
from reference import fused_head_reference, within_spec
from support import hashed_head
import tiny_models

OUTPUTS = ("log_probs", "entropy")


class ShardedTrainer:
    """What ``use_service`` reads of a trainer: the models, ``args``,
    ``state.global_step``, callbacks."""

    def __init__(self, model, ref_model):
        self.model, self.ref_model = model, ref_model
        self.args = types.SimpleNamespace()
        self.state = types.SimpleNamespace(global_step=0)
        self.callbacks = []

    def add_callback(self, callback):
        self.callbacks.append(callback)

    def remove_callback(self, callback):
        self.callbacks.remove(callback)


def sharded_model(seed, mesh, head_unit=True):
    """The tiny Qwen2 model with TRL's fused head, its decoder layers (and,
    with ``head_unit``, every Linear) ``fully_shard`` units, then the root."""
    model = tiny_models.make_model("qwen2", seed)
    add_fused_lm_head(model, outputs=OUTPUTS)
    for module in reversed(list(model.modules())):  # children before their parents
        if (head_unit and isinstance(module, torch.nn.Linear)) or type(module).__name__ == "Qwen2DecoderLayer":
            fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def check(model, ids, out):
    """'' when the fused call's answer is within spec of float64 on its inputs."""
    with torch.no_grad():
        hidden = model.model(input_ids=ids).last_hidden_state[:, :-1].reshape(-1, tiny_models.HIDDEN)
        weight = model.lm_head.weight.full_tensor()
    want = fused_head_reference(hidden.double().numpy(), weight.double().numpy(), ids[:, 1:].reshape(-1).numpy())
    return "; ".join(filter(None, (within_spec(want[n], getattr(out, n).reshape(-1).double().numpy())
                                   for n in OUTPUTS)))


def main():
    out_dir, address = sys.argv[1:3]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    policy, ref = sharded_model(0, mesh), sharded_model(0, mesh)
    head = policy.lm_head.weight
    assert isinstance(head, DTensor) and tuple(head.placements) == (Shard(0),), head
    trainer = ShardedTrainer(policy, ref)
    ids = torch.randint(3, tiny_models.VOCAB, (2, 12), generator=torch.Generator().manual_seed(10 + rank))
    optimizer = torch.optim.SGD(policy.parameters(), lr=0.5)
    result = {"rank": rank, "local_rows": int(head.to_local().shape[0]), "checks": [], "sha256": [],
              "server_sha256": []}

    def hashes():
        whole = policy.lm_head.weight.full_tensor()  # a collective: on every rank
        if rank == 0:
            result["sha256"].append(fused_head.weight_sha256(whole, torch.float32))
            result["server_sha256"].append(hashed_head(client, "policy").sha256)

    with LogprobClient(address, timeout=120) as client:
        adapter = use_service(trainer, client)
        for step in range(2):
            trainer.state.global_step = step
            with torch.no_grad():
                for model in (policy, ref):
                    result["checks"].append(check(model, ids, model(input_ids=ids, labels=ids, fused_lm_head=True)))
            hashes()
            # A training step through TRL's kernel (with gradients: not routed).
            loss = -policy(input_ids=ids, labels=ids, fused_lm_head=True).log_probs.mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            for callback in trainer.callbacks:
                callback.on_step_end(None, trainer.state, None)
        result.update(calls=[[c.head, c.version, c.tokens] for c in adapter.calls], routed=dict(adapter.routed),
                      pushes=adapter.pushes, run=adapter.run, reference_version=adapter.reference_version,
                      fallbacks=adapter.fallbacks)
        adapter.remove()
        # verl's service: the trained weight, pushed by its shards.
        seam = types.SimpleNamespace(FusedLinearForPPO=type("FusedLinearForPPO", (), {}))
        verl = use_verl_service(client, module=seam)
        verl.add_head(policy.lm_head, "policy")
        result["verl"] = {"run": verl.run, "version": verl.push(policy.lm_head.weight, step=7),
                          "pushes": verl.pushes}
        # Other bytes under that name: rank 0's push fails, every rank raises its error.
        try:
            verl.push(torch.zeros(tiny_models.VOCAB, tiny_models.HIDDEN), step=7)
        except LogprobError as e:
            result["verl"]["error"] = [e.code.name, e.message]
        hashes()
        # The lm_head in the root's unit: unsharded by FSDP2 for the forward,
        # so TRL's call gets the whole parameter; rank 0 pushes it.
        root = sharded_model(2, mesh, head_unit=False)
        adapter = use_service(ShardedTrainer(root, None), client)
        with torch.no_grad():
            root(input_ids=ids, labels=ids, fused_lm_head=True)
        # A backward after that push: FSDP2 frees the unsharded weight it
        # pushed (resize_(0) of its storage, which a numpy() view of it
        # would have made not resizable).
        loss = -root(input_ids=ids, labels=ids, fused_lm_head=True).log_probs.mean()
        loss.backward()
        result["root_head"] = {"calls": [[c.head, c.version] for c in adapter.calls], "pushes": adapter.pushes,
                               "run": adapter.run, "resharded": fused_head.is_dtensor(root.lm_head.weight)}
        if rank == 0:  # its weight: the model's as made (seeded), untrained
            result["sha256"].append(fused_head.weight_sha256(tiny_models.make_model("qwen2", 2).lm_head.weight))
            result["server_sha256"].append(hashed_head(client, "policy").sha256)
        adapter.remove()
    with open(os.path.join(out_dir, "rank%d.json" % rank), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
