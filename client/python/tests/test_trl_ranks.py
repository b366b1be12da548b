"""The adapters in jobs of several training processes (2 processes under
``torchrun --nproc_per_node 2``, gloo, CPU) against live 2-worker CPU
servers, and DeepSpeed ZeRO-3 parameters (stand-ins: DeepSpeed is not in
the test environment).

- ``GrpoDdpTest``: TRL's GRPOTrainer (DDP over gloo, test_trl's 3 steps,
  num_iterations 2, beta 0.1) with the service and then without it, in the
  same 2 processes (``trl_ranks.py``): loss and KL within test_trl.TOL
  (1 + |value|) of the unpatched run; every rank's no-gradient calls
  answered by the service (none reached TRL's kernel), on the same
  versions; rank 0 alone pushed (one Begin and one upload per version, at
  the server) and the scored tokens at the server are the ranks' sum.
- ``GrpoFsdp2Test``: the same GRPOTrainer runs with an FSDP2 policy: the
  model sharded with torch's ``fully_shard`` on a CPU mesh (gloo) before
  GRPOTrainer is made, its ``lm_head.weight`` a ``Shard(0)`` DTensor
  throughout (``trl_ranks.fsdp2_model``; accelerate, which runs no FSDP
  on the CPU, leaves it unwrapped): loss and KL within test_trl.TOL
  (1 + |value|) of an unpatched FSDP2 run of the same seed; every rank's
  no-gradient calls answered by the service, on the same versions; each
  policy version pushed by every rank, its own rows (one Begin, a put per
  rank, at the server), never gathered.
- ``Fsdp2HeadTest``: a model sharded with ``fully_shard`` on a CPU mesh, its
  ``lm_head.weight`` a ``Shard(0)`` DTensor that TRL's fused forward gathers
  per call (``fsdp2_ranks.py``): the calls recognised and routed, answers
  within spec of float64, every rank putting its own rows (two puts per
  version), the server's sha256 of each version the whole weight's; then
  logprob_client.verl pushing the trained DTensor the same way; a head in
  the root's unit (whole during the forward) pushed by rank 0, then a
  backward (FSDP2 frees the pushed weight's storage: a ``numpy()`` view
  of it made that fail).
- ``Zero3Test``: a ZeRO-3 parameter (``ds_id``, ``ds_status``,
  ``ds_shape``) is pushed as is once gathered, gathered with
  ``deepspeed.zero.GatheredParameters`` when it is not (a stand-in
  module), refused with a clear error when deepspeed cannot be imported.

No sleeps: the ranks agree by collectives (broadcasts, barriers of
torch.distributed); the test waits on the processes' exit.
"""

import enum
import json
import os
import shutil
import subprocess
import sys
import types
import unittest

from support import Server, free_port, hashed_head, temp_dir
from test_trl import TOL  # the untied Qwen2 model's tolerance
import tiny_models

import torch  # the TRL environment's

from logprob_client import LogprobClient, fused_head
from logprob_client.verl import use_service as use_verl_service

HERE = os.path.dirname(os.path.abspath(__file__))
RANKS = 2
HEAD_BYTES = tiny_models.VOCAB * tiny_models.HIDDEN * 4  # an f32 head


def torchrun(script, *args, timeout=300):
    """Runs ``script`` in RANKS processes (torch.distributed.run, a free
    port); returns each rank's ``OUT/rank<R>.json`` (``args[0]``: OUT)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(RANKS), "--master_addr",
           "127.0.0.1", "--master_port", str(free_port()), os.path.join(HERE, script)] + list(args)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout,
                          env=env, cwd=HERE)
    if proc.returncode != 0:
        raise AssertionError("%s failed (%d):\n%s" % (script, proc.returncode, proc.stdout[-6000:]))
    out = []
    for rank in range(RANKS):
        with open(os.path.join(args[0], "rank%d.json" % rank)) as f:
            out.append(json.load(f))
    return out


def requests(server, method):
    return server.metric("logprob_requests_total", method=method, code="OK")


class RanksTest(unittest.TestCase):
    """A server with heads `policy` and `reference` from a tiny model's
    checkpoint (seed `seed`, updates on, `retain` versions) and the outputs
    of `script` run by torchrun on every rank against it, once per class."""

    @classmethod
    def start(cls, name, seed, retain, script, model_arg, extra=()):
        cls.dir = temp_dir(name)
        model_dir = os.path.join(cls.dir, "model")
        tiny_models.save_model("qwen2", model_dir, seed=seed)
        cls.server = Server(workers=2, extra=["--lm-head", "policy=" + model_dir, "--lm-head",
                                              "reference=" + model_dir, "--allow-lm-head-updates",
                                              "--lm-head-retain", str(retain)], metrics=True)
        cls.client = LogprobClient(cls.server.address, timeout=60)
        try:
            args = [cls.dir] + ([model_dir] if model_arg else []) + [cls.server.address] + list(extra)
            cls.ranks = torchrun(script, *args)
        except BaseException:
            cls.tearDownClass()
            raise

    @classmethod
    def tearDownClass(cls):
        cls.client.close()
        cls.server.close()
        shutil.rmtree(cls.dir, ignore_errors=True)


class _GrpoRanks:
    """GRPO in 2 processes with the service vs without (module docstring;
    mixin: SCRIPT_ARGS, WRAPPED, the head's layout and its pushes at the
    server differ)."""

    SCRIPT_ARGS = ()
    WRAPPED = None  # the class of the trainer's model_wrapped

    @classmethod
    def setUpClass(cls):
        cls.start("py_trl_" + cls.__name__, seed=0, retain=2, script="trl_ranks.py", model_arg=True,
                  extra=cls.SCRIPT_ARGS)

    def test_loss_and_kl_match_an_unpatched_run(self):
        for r in self.ranks:
            got, want = r["service"]["steps"], r["plain"]["steps"]
            self.assertEqual((len(got), len(want)), (3, 3))
            for step, (g, w) in enumerate(zip(got, want), start=1):
                for key in ("loss", "kl"):
                    self.assertLessEqual(abs(g[key] - w[key]), TOL * (1 + abs(w[key])),
                                         "rank %d step %d %s: %r with the service, %r without"
                                         % (r["rank"], step, key, g[key], w[key]))
            self.assertGreater(max(abs(w["kl"]) for w in want), 0.0)
        self.assertEqual(self.ranks[0]["service"]["steps"], self.ranks[1]["service"]["steps"])

    def test_every_rank_routes_its_no_gradient_calls(self):
        for r in self.ranks:
            s, p = r["service"], r["plain"]
            self.assertEqual(r["world"], RANKS)
            self.assertEqual(s["model"], p["model"])
            self.assertEqual(s["model"]["wrapped"], self.WRAPPED)
            self.assertEqual((s["no_grad"], s["no_grad_in_trl"]), (4, 0), "rank %d" % r["rank"])
            self.assertEqual((p["no_grad"], p["no_grad_in_trl"]), (4, 4), "rank %d" % r["rank"])
            self.assertEqual(s["routed"], {"policy": 2, "reference": 2})
            self.assertEqual(len(r["logged"]), 1, r["logged"])
            self.assertIn("2 processes: each push is a collective", r["logged"][0])

    def test_every_rank_scores_on_the_versions_pushed(self):
        runs = {r["service"]["run"] for r in self.ranks}
        self.assertEqual(len(runs), 1)
        run = runs.pop()
        initial = fused_head.head_info(self.client, "reference").version
        for r in self.ranks:
            self.assertEqual([c[:2] for c in r["service"]["calls"]],
                             [["policy", run + "-step-0"], ["reference", initial], ["policy", run + "-step-2"],
                              ["reference", initial]], "rank %d" % r["rank"])
            self.assertEqual(r["service"]["pushes"], 2)
        # At the server: one Begin per version, its upload (below), every
        # rank's calls scored.
        self.assertEqual(requests(self.server, "BeginLmHeadUpdate"), 2)
        self.assertEqual(self.server.metric("logprob_lm_head_updates_total", head="policy", outcome="committed"), 2)
        self.assertEqual(self.server.metric("logprob_lm_head_update_bytes_total", head="policy"), 2 * HEAD_BYTES)
        self.assertEqual(requests(self.server, "Score"), 4 * RANKS)
        self.assertEqual(self.server.metric("logprob_tokens_scored_total"),
                         sum(c[2] for r in self.ranks for c in r["service"]["calls"]))
        head = fused_head.head_info(self.client, "policy", refresh=True)
        self.assertEqual(list(head.retained_versions), [run + "-step-2", run + "-step-0"])


class GrpoDdpTest(_GrpoRanks, RanksTest):
    """GRPO in 2 DDP processes with the service vs without (module
    docstring): rank 0 pushes each version, whole."""

    WRAPPED = "DistributedDataParallel"

    def test_rank_0_pushes_the_whole_head(self):
        for r in self.ranks:
            self.assertEqual(r["service"]["model"],
                             {"wrapped": self.WRAPPED, "dtensor": False, "placements": [],
                              "local_rows": tiny_models.VOCAB})
        self.assertEqual(requests(self.server, "PutLmHeadRows"), 2)  # one per version, rank 0's


class GrpoDdpGradientsTest(RanksTest):
    """GRPO in 2 DDP processes with use_service(..., gradients=True) vs
    without (docs/gradients.md): both ranks' policy calls with gradients
    answered by the service, the head's gradient summed over both ranks on
    the workers and fetched once per step by each; loss and KL within
    test_trl.TOL (1 + |value|) of the unpatched run, every weight within
    1e-4 of its largest |value| (a parameter whose gradient is rounding
    noise, k_proj's bias, within 1e-3), the same on both ranks."""

    @classmethod
    def setUpClass(cls):
        cls.start("py_trl_ddp_gradients", seed=0, retain=2, script="trl_ranks.py", model_arg=True,
                  extra=("gradients",))

    def test_gradients_through_the_service_match_an_unpatched_ddp_run(self):
        for r in self.ranks:
            g = r["gradients"]
            self.assertEqual(g["wrapped"], "DistributedDataParallel")
            self.assertEqual((g["backward_calls"], g["gradient_steps"]), (3, 3), "rank %d" % r["rank"])
            got, want = r["service"]["steps"], r["plain"]["steps"]
            for step, (a, b) in enumerate(zip(got, want), start=1):
                for key in ("loss", "kl"):
                    self.assertLessEqual(abs(a[key] - b[key]), TOL * (1 + abs(b[key])),
                                         "rank %d step %d %s" % (r["rank"], step, key))
            for name, (diff, scale) in g["diffs"].items():
                bound = (1e-3 if name.endswith("k_proj.bias") else 1e-4) * scale
                self.assertLessEqual(diff, bound, "rank %d %s" % (r["rank"], name))
        self.assertEqual(self.ranks[0]["gradients"]["diffs"], self.ranks[1]["gradients"]["diffs"])
        # Each step's sums read once per rank (3 steps x 2 ranks), closed by rank 0.
        self.assertEqual(requests(self.server, "ReadHeadGradients"), 3 * RANKS)
        self.assertEqual(requests(self.server, "CloseHeadGradientStep"), 3)


class GrpoFsdp2Test(_GrpoRanks, RanksTest):
    """GRPO with an FSDP2 policy (``fully_shard`` on a CPU mesh, a
    ``Shard(0)`` DTensor head) in 2 processes with the service vs an
    unpatched FSDP2 run (module docstring): every rank pushes its rows of
    each version."""

    SCRIPT_ARGS = ("fsdp2",)
    WRAPPED = "FSDPQwen2ForCausalLM"  # FSDP2's class of the model itself: no DDP around it

    def test_every_rank_pushes_its_rows(self):
        for r in self.ranks:
            self.assertEqual(r["service"]["model"],
                             {"wrapped": self.WRAPPED, "dtensor": True, "placements": ["Shard(dim=0)"],
                              "local_rows": tiny_models.VOCAB // RANKS})
        # Each version: rank 0's Begin (above), a put of its rows from every rank.
        self.assertEqual(requests(self.server, "PutLmHeadRows"), 2 * RANKS)


class Fsdp2HeadTest(RanksTest):
    """A Shard(0) DTensor lm_head (FSDP2 on a CPU mesh) in 2 processes
    (module docstring)."""

    @classmethod
    def setUpClass(cls):
        # The server starts from other weights (seed 1): the reference is pushed.
        cls.start("py_trl_fsdp2", seed=1, retain=3, script="fsdp2_ranks.py", model_arg=False)

    def test_dtensor_head_calls_are_routed_within_spec(self):
        for r in self.ranks:
            self.assertEqual(r["local_rows"], tiny_models.VOCAB // RANKS)
            self.assertEqual(r["checks"], [""] * 4, "rank %d" % r["rank"])
            self.assertEqual((r["routed"], r["fallbacks"]), ({"policy": 2, "reference": 2}, 0))

    def test_every_rank_pushes_its_rows_of_one_version(self):
        run = self.ranks[0]["run"]
        ref = self.ranks[0]["reference_version"]
        self.assertTrue(ref.startswith("ref-"), ref)  # the gathered reference, pushed by rank 0
        for r in self.ranks:
            self.assertEqual((r["run"], r["reference_version"], r["pushes"]), (run, ref, 2))
            self.assertEqual([c[:2] for c in r["calls"]], [["policy", run + "-step-0"], ["reference", ref],
                                                           ["policy", run + "-step-1"], ["reference", ref]])
        verl = self.ranks[0]["verl"]
        self.assertEqual(self.ranks[1]["verl"], verl)
        self.assertEqual(verl["version"], verl["run"] + "-step-7")
        self.assertEqual(verl["pushes"], 1)
        # Other bytes under a taken name: ALREADY_EXISTS on both ranks (rank 0's, broadcast).
        self.assertEqual(verl["error"][0], "ALREADY_EXISTS")
        self.assertIn("{run}", verl["error"][1])
        # The head in the root's unit: whole in TRL's call, pushed by rank 0.
        root = self.ranks[0]["root_head"]
        self.assertEqual(self.ranks[1]["root_head"], root)
        self.assertEqual((root["calls"], root["pushes"]), ([["policy", root["run"] + "-step-0"]], 1))
        self.assertTrue(root["resharded"])  # the backward after the push freed the whole weight
        m = self.server.metric
        self.assertEqual(m("logprob_lm_head_updates_total", head="policy", outcome="committed"), 4)
        self.assertEqual(m("logprob_lm_head_update_bytes_total", head="policy"), 4 * HEAD_BYTES)
        self.assertEqual(m("logprob_lm_head_updates_total", head="reference", outcome="committed"), 1)
        # Each sharded policy version: one Begin, a put from every rank; the
        # reference and the root unit's head: one of each (rank 0's).
        self.assertEqual(requests(self.server, "BeginLmHeadUpdate"), 3 + 1 + 1)
        self.assertEqual(requests(self.server, "PutLmHeadRows"), 3 * RANKS + 1 + 1)
        head = fused_head.head_info(self.client, "policy", refresh=True)
        self.assertEqual(list(head.retained_versions), [root["run"] + "-step-0", verl["version"], run + "-step-1"])

    def test_server_sha256_is_the_whole_weights(self):
        r = self.ranks[0]
        self.assertEqual(len(r["sha256"]), 4)
        self.assertEqual(len(set(r["sha256"])), 4)  # four different weights
        self.assertEqual(r["server_sha256"], r["sha256"])
        self.assertEqual(hashed_head(self.client, "policy").sha256, r["sha256"][-1])


ZeroParamStatus = enum.Enum("ZeroParamStatus", "AVAILABLE NOT_AVAILABLE INFLIGHT")  # deepspeed's names


def zero3_param(weight, gathered):
    """A stand-in of a ZeRO-3 parameter of ``weight``: ``ds_id``,
    ``ds_shape``, ``ds_status``; partitioned (empty data) unless
    ``gathered``."""
    p = torch.nn.Parameter(weight.clone() if gathered else torch.empty(0))
    p.ds_id, p.ds_shape = 7, weight.shape
    p.ds_status = ZeroParamStatus.AVAILABLE if gathered else ZeroParamStatus.NOT_AVAILABLE
    return p


class Zero3Test(unittest.TestCase):
    """DeepSpeed ZeRO-3 parameters (stand-ins, module docstring)."""

    @classmethod
    def setUpClass(cls):
        cls.server = Server(workers=1, extra=["--lm-head-declare", "policy=%dx%d:f32" % (tiny_models.VOCAB,
                                                                                         tiny_models.HIDDEN),
                                              "--allow-lm-head-updates"], metrics=True)
        cls.client = LogprobClient(cls.server.address, timeout=60)
        cls.weight = torch.randn(tiny_models.VOCAB, tiny_models.HIDDEN, generator=torch.Generator().manual_seed(5))

    @classmethod
    def tearDownClass(cls):
        cls.client.close()
        cls.server.close()

    def service(self):
        return use_verl_service(self.client, module=types.SimpleNamespace(FusedLinearForPPO=type("F", (), {})))

    def committed(self):
        return self.server.metric("logprob_lm_head_updates_total", head="policy", outcome="committed")

    def test_partitioned_without_deepspeed_is_refused(self):
        p = zero3_param(self.weight, gathered=False)
        self.assertEqual(fused_head.weight_shape(p), (tiny_models.VOCAB, tiny_models.HIDDEN))
        service = self.service()
        service.add_head(p, "policy")  # the shape is ds_shape's
        before = self.committed()
        saved = sys.modules.get("deepspeed")
        sys.modules["deepspeed"] = None  # import deepspeed raises ImportError
        try:
            with self.assertRaises(RuntimeError) as cm:
                service.push(p, step=1)
        finally:
            if saved is None:
                del sys.modules["deepspeed"]
            else:
                sys.modules["deepspeed"] = saved
        for words in ("DeepSpeed ZeRO-3", "ds_id 7", "NOT_AVAILABLE", "GatheredParameters"):
            self.assertIn(words, str(cm.exception))
        self.assertEqual((service.pushes, service.policy_version, self.committed()), (0, None, before))

    def test_gathered_is_pushed_as_is(self):
        service = self.service()
        version = service.push(zero3_param(self.weight, gathered=True), step=2)
        self.assertEqual(version, service.run + "-step-2")
        self.assertEqual(hashed_head(self.client, "policy").sha256, fused_head.weight_sha256(self.weight))

    def test_partitioned_is_gathered_with_deepspeed(self):
        p = zero3_param(self.weight, gathered=False)
        weight, entered = self.weight, []

        class GatheredParameters:  # deepspeed.zero.GatheredParameters' contract, on one process
            def __init__(self, params, modifier_rank=None):
                entered.append((list(params), modifier_rank))
                self.params = params

            def __enter__(self):
                for q in self.params:
                    q.data, q.ds_status = weight.clone(), ZeroParamStatus.AVAILABLE

            def __exit__(self, *exc):
                for q in self.params:
                    q.data, q.ds_status = torch.empty(0), ZeroParamStatus.NOT_AVAILABLE

        saved = sys.modules.get("deepspeed")
        sys.modules["deepspeed"] = types.SimpleNamespace(zero=types.SimpleNamespace(
            GatheredParameters=GatheredParameters))
        try:
            service = self.service()
            version = service.push(p, step=3)
        finally:
            if saved is None:
                del sys.modules["deepspeed"]
            else:
                sys.modules["deepspeed"] = saved
        self.assertEqual(len(entered), 1)
        self.assertIs(entered[0][0][0], p)
        self.assertIsNone(entered[0][1])  # read-only: nothing written back
        self.assertEqual(p.ds_status, ZeroParamStatus.NOT_AVAILABLE)  # partitioned again
        self.assertEqual(version, service.run + "-step-3")
        self.assertEqual(hashed_head(self.client, "policy").sha256, fused_head.weight_sha256(self.weight))


if __name__ == "__main__":
    unittest.main()
