"""One rank of a 2-process GRPO job (``torchrun --nproc_per_node 2``, gloo,
CPU), run by test_trl_ranks.GrpoDdpTest and GrpoFsdp2Test: GRPO
(test_trl.run_grpo: 3 steps, num_iterations 2, beta 0.1) with the service,
then the same without it; writes ``OUT/rank<R>.json``: each run's logged
loss and KL, the routed calls (head, version, tokens), pushes, run id, the
no-gradient calls that reached TRL's kernel, the trainer's model (its
class, and its ``lm_head.weight``: DTensor or not, placements, local rows)
and the line use_service logged.

``fsdp2``: the policy is FSDP2 as transformers makes it at load time
(``fsdp2_model``: ``from_pretrained(..., distributed_config=
DistributedConfig(fsdp_size=2, ...))``, ``fully_shard`` on a CPU mesh of
the ranks, gloo), made before GRPOTrainer, which takes it as its model;
transformers' Trainer leaves such a model unwrapped (no DDP: FSDP2
reduces the gradients) and ``generate`` keeps the ranks' steps in step.
Its plan's ``lm_head`` rule is ``free_full_weight`` (Qwen2's own,
``keep_full_weight``, keeps the weight whole after generation, so TRL's
calls would get the whole weight, pushed by rank 0 as under DDP): the
``lm_head.weight`` TRL reads without calling the module is a ``Shard(0)``
DTensor at every call. TRL's reference model, made from the checkpoint,
is a plain (whole) model on every rank. (accelerate runs no FSDP on the
CPU: its FSDP plugin applies to GPU-type setups only.)

Usage: trl_ranks.py OUT_DIR MODEL_DIR SERVER_ADDRESS [fsdp2]
"""

import json
import logging
import os
import sys

from logprob_client import LogprobClient

import test_trl
import torch.distributed as dist


class Lines(logging.Handler):
    """Keeps the messages logged."""

    def __init__(self):
        super().__init__()
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def fsdp2_model(model_dir):
    """The checkpoint's model, FSDP2 over every rank as transformers shards
    it at load time, its ``lm_head`` a unit resharded after each forward
    (module docstring)."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    config = DistributedConfig(fsdp_size=int(os.environ["WORLD_SIZE"]), fsdp_plan={"lm_head": "free_full_weight"})
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, distributed_config=config)


def head_layout(trainer):
    """The trainer's model class and its ``lm_head.weight``'s layout."""
    from logprob_client import fused_head

    weight = trainer.model.get_output_embeddings().weight
    dtensor = fused_head.is_dtensor(weight)
    return {"wrapped": type(trainer.model_wrapped).__name__, "dtensor": dtensor,
            "placements": [repr(p) for p in weight.placements] if dtensor else [],
            "local_rows": int((weight.to_local() if dtensor else weight).shape[0])}


def summary(trainer, log, adapter):
    return {
        "steps": [{"loss": h["loss"], "kl": h["kl"]} for h in test_trl.step_logs(trainer)],
        "no_grad_in_trl": sum(1 for r in log.records if r["no_grad"] and r["reached_trl"]),
        "no_grad": sum(1 for r in log.records if r["no_grad"]),
        "calls": [] if adapter is None else [[c.head, c.version, c.tokens] for c in adapter.calls],
        "routed": {} if adapter is None else dict(adapter.routed),
        "pushes": None if adapter is None else adapter.pushes,
        "run": None if adapter is None else adapter.run,
        "policy_version": None if adapter is None else adapter.policy_version,
        "model": head_layout(trainer),
    }


def gradient_summary(service, plain):
    """With gradients=True: the adapter's counters, and per parameter the
    largest |service - plain| after the steps and the largest |plain|."""
    adapter = service[2]
    plain_params = dict(plain[0].model.named_parameters())
    diffs = {}
    for name, p in service[0].model.named_parameters():
        q = plain_params[name].detach().double()
        diffs[name] = [float((p.detach().double() - q).abs().max()), float(q.abs().max())]
    return {"backward_calls": adapter.backward_calls, "gradient_steps": adapter.gradient_steps, "diffs": diffs,
            "wrapped": type(service[0].model_wrapped).__name__}


def main():
    out_dir, model_dir, address = sys.argv[1:4]
    fsdp2 = sys.argv[4:] == ["fsdp2"]
    gradients = sys.argv[4:] == ["gradients"]
    rank = int(os.environ["RANK"])
    policy = (lambda: fsdp2_model(model_dir)) if fsdp2 else (lambda: model_dir)
    lines = Lines()
    logging.getLogger("logprob_client.trl").addHandler(lines)
    logging.getLogger("logprob_client.trl").setLevel(logging.INFO)
    with LogprobClient(address, timeout=120) as client:
        kwargs = {"gradients": True} if gradients else {}
        service = test_trl.run_grpo(policy(), os.path.join(out_dir, "service"), False, client, **kwargs)
    plain = test_trl.run_grpo(policy(), os.path.join(out_dir, "plain"), True)
    out = {"rank": rank, "world": int(os.environ["WORLD_SIZE"]), "logged": lines.messages,
           "service": summary(*service[:3]), "plain": summary(*plain[:3])}
    if gradients:
        out["gradients"] = gradient_summary(service, plain)
    with open(os.path.join(out_dir, "rank%d.json" % rank), "w") as f:
        json.dump(out, f)
    # The gloo process group accelerate made, ended before the interpreter
    # exits: left to the exit, its threads can outlive their owner, and a
    # busy machine then saw "terminate called without an active exception".
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
