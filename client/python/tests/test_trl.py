"""logprob_client.trl against live 2-worker CPU servers: GRPO runs with TRL's
GRPOTrainer (3 steps, beta > 0, num_iterations = 2, CPU, float32) on tiny
models made in code (an untied Qwen2-style one, a tied Llama-style one),
and the adapter at TRL's seam.

Run in the TRL environment (scripts/setup-trl.sh: .venv-trl) by ctest
(py_trl_*), with this checkout's client and build (PYTHONPATH,
LOGPROB_BIN_DIR). Offline: models, tokenizer and data are made here.

What the GRPO tests check, per model:
- the calls of TRL's fused head that the service answered are exactly the
  ones made without gradients (counted by wrapping TRL's function outside
  and inside the adapter), each with the head of its weight (policy /
  reference) and, for the policy, the version pushed after the step before;
- each answer is within 2e-4 + 2e-5 |x| of a float64 computation on the
  call's own inputs (hidden, weight, bias, transforms, temperature);
- the loss and KL logged at each step equal those of a run without the
  service with cast_lm_head_to_fp32=True (same seed) within
  TOL * (1 + |value|) (both runs compute float32 logits from float32 weights; they
  differ by the summation order of the two kernels, ~1e-7 relative in
  each logprob, which the three steps' updates carry into the loss and the
  k3 KL's exponential magnifies): TOL 1e-5 for the untied model, 1e-4 for
  the tied one;
- the policy is pushed only before the calls that score it (generation at
  global steps 0 and 2: versions {run}-step-0 and {run}-step-2), counted
  by the adapter and by the server's metrics;
- the reference head was kept when the server held the reference weights
  already (Qwen2: started from the checkpoint), pushed once otherwise
  (Llama: started from other weights).
"""

import os
import shutil
import unittest
import warnings

import numpy as np

from support import Server, hashed_head, temp_dir
from reference import fused_head_reference, mismatch_reference, within_spec
import tiny_models

import torch  # noqa: E402  (the TRL environment's)
import trl.trainer.utils as trl_utils  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import TrainerCallback, set_seed  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from logprob_client import LogprobClient  # noqa: E402
from logprob_client import fused_head  # noqa: E402
from logprob_client.trl import MISMATCH_METRICS, HeadMismatchError, check_trl_version, use_service  # noqa: E402

STEPS = 3
# |service run - unpatched fp32 run| <= TOL * (1 + |unpatched|) per logged
# loss and KL (module docstring; docs/rl-frameworks.md, "Numerics"). Both
# runs compute float32 logprobs (the service 2.9e-7 from float64 per token,
# TRL's kernel 7.9e-7); the k3 KL, exp(ref - logp) - (ref - logp) - 1,
# multiplies a logprob's rounding by exp(ref - logp), several nats on the
# tokens a step moved. Measured at step 2: 8.3e-5 at a KL of 8.87 (Qwen2
# tiny: 8.4e-6 relative) and 1.5e-4 at a KL of 1.78 (Llama tiny, tied:
# 5.4e-5 relative); on the 2-core VM (2026-11-28, seeds 0-3) at most 2.5e-6
# and 1.1e-6 relative. TOL is per model (``_GrpoTest.TOL``).
TOL = 1e-5
TOL_TIED = 1e-4


def grpo_args(out_dir, cast_lm_head_to_fp32, num_iterations=2, learning_rate=0.05):
    return GRPOConfig(
        output_dir=out_dir, max_steps=STEPS, per_device_train_batch_size=4, num_generations=4,
        max_completion_length=6, beta=0.1, num_iterations=num_iterations, learning_rate=learning_rate, bf16=False,
        use_cpu=True, cast_lm_head_to_fp32=cast_lm_head_to_fp32, logging_steps=1, report_to=[], seed=0,
        save_strategy="no", disable_tqdm=True, dataloader_num_workers=0)


def grpo_trainer(model, out_dir, cast_lm_head_to_fp32, num_iterations=2, learning_rate=0.05):
    """A GRPOTrainer (grpo_args) of ``model`` (a checkpoint directory or a
    model) on the tiny models' tokenizer, prompts and reward, made but not
    trained."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return GRPOTrainer(model=model, reward_funcs=tiny_models.reward,
                           args=grpo_args(out_dir, cast_lm_head_to_fp32, num_iterations, learning_rate),
                           train_dataset=Dataset.from_dict({"prompt": tiny_models.prompts()}),
                           processing_class=tiny_models.tokenizer())


def _no_grad(args):
    hidden, weight, bias = args[0], args[1], args[2]
    return not torch.is_grad_enabled() or not any(t is not None and t.requires_grad for t in (hidden, weight, bias))


def _np(t):
    return None if t is None else t.detach().cpu().to(torch.float64 if t.is_floating_point() else t.dtype).numpy()


class CallLog:
    """Wraps TRL's ``_ChunkedLogProbFunction`` twice: ``outer`` sees every
    call of the fused head (and records its inputs and answer), ``inner``
    (what the adapter passes calls on to) sees those that reached TRL's
    kernel. Installed with ``install_inner()`` before ``use_service`` and
    ``install_outer()`` after; ``uninstall`` undoes both in order."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.records = []
        self.real = trl_utils._ChunkedLogProbFunction
        self._reached = False
        self._routed_inside = None

    def install_inner(self):
        log, real = self, self.real

        class Inner:
            @staticmethod
            def apply(*args):
                log._reached = True
                return real.apply(*args)

        trl_utils._ChunkedLogProbFunction = Inner

    def install_outer(self, adapter=None):
        log, routed = self, trl_utils._ChunkedLogProbFunction
        self._routed_inside = routed

        class Outer:
            @staticmethod
            def apply(*args):
                log._reached = False
                before = len(adapter.calls) if adapter is not None else 0
                out = routed.apply(*args)
                model = log.trainer.model
                ref = log.trainer.ref_model
                log.records.append(dict(
                    step=int(log.trainer.state.global_step), no_grad=_no_grad(args), reached_trl=log._reached,
                    policy=args[1] is model.get_output_embeddings().weight,
                    reference=ref is not None and args[1] is ref.get_output_embeddings().weight,
                    hidden=_np(args[0]), weight=_np(args[1]), bias=_np(args[2]), targets=_np(args[3]),
                    temperature=float(args[4]), softcap=args[6], logit_scale=args[7], outputs=tuple(args[8]),
                    answer=[None if x is None else x for x in out],
                    answer_np=[_np(x) for x in out],
                    service=adapter.calls[-1] if adapter is not None and len(adapter.calls) > before else None))
                return out

        trl_utils._ChunkedLogProbFunction = Outer

    def uninstall(self, adapter=None):
        if self._routed_inside is not None:
            trl_utils._ChunkedLogProbFunction = self._routed_inside
        if adapter is not None:
            adapter.remove()
        trl_utils._ChunkedLogProbFunction = self.real


class VersionLog(TrainerCallback):
    """The server's policy version at train begin and after each step
    (added after the adapter's callback, so it sees its push)."""

    def __init__(self, client, head):
        self.client, self.head, self.versions = client, head, []

    def _record(self, state):
        info = fused_head.head_info(self.client, self.head, refresh=True)
        self.versions.append((int(state.global_step), info.version, list(info.retained_versions)))

    def on_train_begin(self, args, state, control, **kwargs):
        self._record(state)

    def on_step_end(self, args, state, control, **kwargs):
        self._record(state)


def run_grpo(model_dir, out_dir, cast_lm_head_to_fp32, client=None, num_iterations=2, learning_rate=0.05,
             **service_kwargs):
    """One GRPO run of STEPS steps of ``model_dir`` (a checkpoint directory,
    or a model: GRPOTrainer's ``model``); returns (trainer, CallLog,
    adapter or None, VersionLog or None)."""
    trainer = grpo_trainer(model_dir, out_dir, cast_lm_head_to_fp32, num_iterations, learning_rate)
    log = CallLog(trainer)
    log.install_inner()
    adapter = versions = None
    try:
        if client is not None:
            adapter = use_service(trainer, client, **service_kwargs)
            versions = VersionLog(client, adapter.policy_head)
            trainer.add_callback(versions)
        log.install_outer(adapter)
        set_seed(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.train()
    finally:
        log.uninstall(adapter)
    return trainer, log, adapter, versions


def step_logs(trainer):
    return [h for h in trainer.state.log_history if "loss" in h and "kl" in h]


class _GrpoTest:
    """GRPO with the service vs without (mixin; KIND, SERVER_HEADS_FROM)."""

    KIND = None
    TOL = TOL
    # "checkpoint": the server starts from the model's own checkpoint (the
    # reference head is kept); "other": from another model's lm_head (the
    # reference head is pushed).
    SERVER_HEADS_FROM = None

    @classmethod
    def setUpClass(cls):
        cls.dir = temp_dir("py_trl_" + cls.KIND)
        model_dir = os.path.join(cls.dir, "model")
        model = tiny_models.save_model(cls.KIND, model_dir, seed=0)
        if cls.SERVER_HEADS_FROM == "checkpoint":
            heads = ["--lm-head", "policy=" + model_dir, "--lm-head", "reference=" + model_dir]
        else:
            other = os.path.join(cls.dir, "other")
            tiny_models.save_model(cls.KIND, other, seed=1)
            heads = ["--lm-head", "policy=" + other, "--lm-head", "reference=" + other]
        cls.initial_reference = model.get_output_embeddings().weight.detach().clone()
        cls.server = Server(workers=2, extra=heads + ["--allow-lm-head-updates", "--lm-head-retain", "2"],
                            metrics=True)
        try:
            cls.client = LogprobClient(cls.server.address, timeout=120)
            cls.start_info = {h.name: h for h in cls.client.lm_heads()}
            cls.service = run_grpo(model_dir, os.path.join(cls.dir, "service"), False, cls.client)
            cls.plain = run_grpo(model_dir, os.path.join(cls.dir, "plain"), True)
        except BaseException:
            cls.tearDownClass()
            raise

    @classmethod
    def tearDownClass(cls):
        if getattr(cls, "client", None) is not None:
            cls.client.close()
        cls.server.close()
        shutil.rmtree(cls.dir, ignore_errors=True)

    def test_routed_calls_are_exactly_the_no_gradient_ones(self):
        _, log, adapter, _ = self.service
        recs = log.records
        # Generation at steps 1 and 3 (num_iterations = 2): old-policy and
        # reference logprobs without gradients; the loss's calls with.
        self.assertEqual([(r["step"], r["policy"], r["reference"], r["no_grad"]) for r in recs if r["no_grad"]],
                         [(0, True, False, True), (0, False, True, True), (2, True, False, True),
                          (2, False, True, True)])
        self.assertEqual(sum(not r["no_grad"] for r in recs), STEPS)
        for i, r in enumerate(recs):
            self.assertEqual(not r["reached_trl"], r["no_grad"], "call %d: routed iff without gradients" % i)
            self.assertEqual(r["service"] is not None, r["no_grad"], "call %d" % i)
        self.assertEqual(dict(adapter.routed), {"policy": 2, "reference": 2})
        self.assertEqual(adapter.fallbacks, 0)
        # The same calls as a run without the service.
        _, plain_log, _, _ = self.plain
        self.assertEqual([(r["step"], r["policy"], r["no_grad"], r["outputs"]) for r in plain_log.records],
                         [(r["step"], r["policy"], r["no_grad"], r["outputs"]) for r in recs])

    def test_routed_calls_use_the_right_heads_and_versions(self):
        _, log, adapter, _ = self.service
        for r in log.records:
            if r["service"] is None:
                continue
            if r["policy"]:
                self.assertEqual(r["service"].head, "policy")
                # Pushed before the step's first policy call: the weights of that call.
                self.assertEqual(r["service"].version, adapter.policy.name(r["step"]))
            else:
                self.assertEqual(r["service"].head, "reference")
                self.assertEqual(r["service"].version, adapter.reference_version)
                np.testing.assert_array_equal(r["weight"], _np(self.initial_reference))

    def test_routed_answers_within_spec_of_float64(self):
        _, log, _, _ = self.service
        checked = 0
        for i, r in enumerate(log.records):
            if r["service"] is None:
                continue
            want = fused_head_reference(r["hidden"], r["weight"], r["targets"], r["bias"], r["temperature"],
                                        r["softcap"], r["logit_scale"])
            for k, name in enumerate(fused_head.FUSED_OUTPUTS):
                got = r["answer"][k]
                if name != "log_probs" and name not in r["outputs"]:
                    self.assertIsNone(got, name)
                    continue
                self.assertEqual(got.dtype, torch.bool if name == "is_top1" else torch.float32, name)
                self.assertEqual(tuple(got.shape), (r["hidden"].shape[0],), name)
                self.assertEqual(got.device, torch.device("cpu"))
                self.assertEqual(within_spec(want[name], r["answer_np"][k]), "", "call %d %s" % (i, name))
                checked += 1
        self.assertEqual(checked, 6)  # 2 policy calls x (log_probs, entropy) + 2 reference x log_probs

    def test_loss_and_kl_match_an_unpatched_fp32_run(self):
        got, want = step_logs(self.service[0]), step_logs(self.plain[0])
        self.assertEqual(len(got), STEPS)
        self.assertEqual(len(want), STEPS)
        for step, (g, w) in enumerate(zip(got, want), start=1):
            for key in ("loss", "kl"):
                self.assertLessEqual(abs(g[key] - w[key]), self.TOL * (1 + abs(w[key])),
                                     "step %d %s: %r with the service, %r without" % (step, key, g[key], w[key]))
        self.assertGreater(max(abs(w["kl"]) for w in want), 0.0, "the reference must matter (KL > 0)")

    def test_policy_pushed_before_the_calls_that_score_it(self):
        _, log, adapter, versions = self.service
        name = adapter.policy.name
        # Generation (old-policy logprobs) at global steps 0 and 2 only
        # (num_iterations = 2): two pushes, none at steps 1 and 3.
        self.assertEqual([(s, v) for s, v, _ in versions.versions],
                         [(0, self.start_info["policy"].version), (1, name(0)), (2, name(0)), (3, name(2))])
        self.assertEqual(versions.versions[-1][2], [name(2), name(0)])
        self.assertEqual((adapter.pushes, adapter.policy_version), (2, name(2)))
        self.assertEqual(self.server.metric("logprob_lm_head_updates_total", head="policy", outcome="committed"), 2)
        # What the server holds is the weight of the last policy call.
        last = [r for r in log.records if r["service"] is not None and r["policy"]][-1]
        head = hashed_head(self.client, "policy")
        self.assertEqual(head.sha256, fused_head.weight_sha256(last["weight"].astype(np.float32)))

    def test_reference_head_loaded_once(self):
        _, _, adapter, _ = self.service
        info = hashed_head(self.client, "reference")
        self.assertEqual(info.sha256, fused_head.weight_sha256(self.initial_reference, torch.float32))
        if self.SERVER_HEADS_FROM == "checkpoint":
            self.assertEqual(adapter.reference_version, self.start_info["reference"].version)  # kept
            self.assertEqual(list(info.retained_versions), [self.start_info["reference"].version])
        else:
            self.assertTrue(adapter.reference_version.startswith("ref-"), adapter.reference_version)
            self.assertEqual(list(info.retained_versions)[0], adapter.reference_version)


class GrpoQwen2Test(_GrpoTest, unittest.TestCase):
    """Untied lm_head (Qwen2-style); the server starts from the checkpoint."""

    KIND = "qwen2"
    SERVER_HEADS_FROM = "checkpoint"


class GrpoLlamaTiedTest(_GrpoTest, unittest.TestCase):
    """Tied embeddings (Llama-style: lm_head.weight is embed_tokens.weight);
    the server starts from another model's weights."""

    KIND = "llama_tied"
    SERVER_HEADS_FROM = "other"
    TOL = TOL_TIED


class GrpoPushesTest(unittest.TestCase):
    """No push nobody uses, and runs one after another on one long-lived
    server: GRPO (3 steps) with num_iterations = 1 makes no no-gradient
    policy call, so the policy is never pushed; with num_iterations = 2
    it is pushed before each generation (global steps 0 and 2), counted by
    the adapter and by the server (``logprob_lm_head_updates_total``,
    ``logprob_lm_head_update_bytes_total``); a second such run (other
    weights) gets another run id and succeeds. The line use_service logs
    says which."""

    @classmethod
    def setUpClass(cls):
        cls.dir = temp_dir("py_trl_pushes")
        cls.model_dir = os.path.join(cls.dir, "model")
        tiny_models.save_model("qwen2", cls.model_dir, seed=8)
        cls.server = Server(workers=2, extra=["--lm-head", "policy=" + cls.model_dir, "--lm-head",
                                              "reference=" + cls.model_dir, "--allow-lm-head-updates",
                                              "--lm-head-retain", "2"], metrics=True)
        cls.client = LogprobClient(cls.server.address, timeout=120)
        cls.head_bytes = tiny_models.VOCAB * tiny_models.HIDDEN * 4

    @classmethod
    def tearDownClass(cls):
        cls.client.close()
        cls.server.close()
        shutil.rmtree(cls.dir, ignore_errors=True)

    def pushed(self):
        """(policy updates committed, policy bytes uploaded) at the server."""
        return (self.server.metric("logprob_lm_head_updates_total", head="policy", outcome="committed"),
                self.server.metric("logprob_lm_head_update_bytes_total", head="policy"))

    def run_logged(self, name, **kwargs):
        with self.assertLogs("logprob_client.trl", "INFO") as logs:
            trainer, log, adapter, _ = run_grpo(self.model_dir, os.path.join(self.dir, name), False, self.client,
                                                **kwargs)
        self.assertEqual(len(logs.records), 1, logs.output)
        self.assertEqual(len(step_logs(trainer)), STEPS)
        return log, adapter, logs.records[0].getMessage()

    def test_pushes_only_for_the_calls_that_score_the_policy(self):
        before = self.pushed()
        log, adapter, line = self.run_logged("one", num_iterations=1)
        self.assertEqual(adapter.pushes, 0)
        self.assertIsNone(adapter.policy_version)
        self.assertEqual(self.pushed(), before)
        self.assertEqual(dict(adapter.routed), {"reference": STEPS})  # a generation at every step
        self.assertFalse(any(r["no_grad"] and r["policy"] for r in log.records))
        self.assertIn("the reference model's to head 'reference'", line)
        self.assertIn("the policy is not pushed", line)
        self.assertIn("num_iterations=1", line)

        first_log, first, line = self.run_logged("two", num_iterations=2)
        self.assertIn("pushed as '%s-step-{step}'" % first.run, line)
        self.assertIn("num_iterations=2", line)
        self.assertEqual((first.pushes, first.policy_version), (2, first.policy.name(2)))
        self.assertEqual(dict(first.routed), {"policy": 2, "reference": 2})
        self.assertEqual(self.pushed(), (before[0] + 2, before[1] + 2 * self.head_bytes))

        # A second run against the same server: its own run id, its own
        # versions (its step-0 is the same checkpoint: uploaded again under
        # the new name; its later steps differ, learning rate 0.1).
        _, second, _ = self.run_logged("three", num_iterations=2, learning_rate=0.1)
        self.assertNotEqual(second.run, first.run)
        self.assertEqual((second.pushes, second.policy_version), (2, second.policy.name(2)))
        self.assertEqual(self.pushed(), (before[0] + 4, before[1] + 4 * self.head_bytes))
        head = fused_head.head_info(self.client, "policy", refresh=True)
        self.assertEqual(list(head.retained_versions), [second.policy.name(2), second.policy.name(0)])
        versions = [r["service"].version for r in first_log.records if r["service"] is not None and r["policy"]]
        self.assertEqual(versions, [first.policy.name(0), first.policy.name(2)])


class SeamTest(unittest.TestCase):
    """The adapter at TRL's seam, calls made by hand: transforms, outputs,
    gradients, the version check."""

    @classmethod
    def setUpClass(cls):
        cls.dir = temp_dir("py_trl_seam")
        cls.model_dir = os.path.join(cls.dir, "model")
        tiny_models.save_model("qwen2", cls.model_dir, seed=3)
        cls.server = Server(workers=2, extra=["--lm-head", "policy=" + cls.model_dir, "--lm-head",
                                              "reference=" + cls.model_dir, "--allow-lm-head-updates",
                                              "--lm-head-retain", "2"])
        cls.client = LogprobClient(cls.server.address, timeout=120)
        cls.trainer = grpo_trainer(cls.model_dir, os.path.join(cls.dir, "out"), False)

    @classmethod
    def tearDownClass(cls):
        cls.client.close()
        cls.server.close()
        shutil.rmtree(cls.dir, ignore_errors=True)

    def setUp(self):
        self.real = trl_utils._ChunkedLogProbFunction
        g = torch.Generator().manual_seed(7)
        self.hidden = torch.randn(37, tiny_models.HIDDEN, generator=g)
        self.targets = torch.randint(0, tiny_models.VOCAB, (37,), generator=g)

    def tearDown(self):
        trl_utils._ChunkedLogProbFunction = self.real

    def call(self, weight, bias=None, temperature=0.7, softcap=None, logit_scale=1.0, outputs=("log_probs",),
             hidden=None):
        return trl_utils._ChunkedLogProbFunction.apply(self.hidden if hidden is None else hidden, weight, bias,
                                                       self.targets, temperature, 4096, softcap, logit_scale,
                                                       outputs)

    def check(self, got, weight, outputs, temperature=0.7, bias=None):
        want = fused_head_reference(_np(self.hidden), _np(weight), _np(self.targets), _np(bias), temperature)
        for k, name in enumerate(fused_head.FUSED_OUTPUTS):
            if name != "log_probs" and name not in outputs:
                self.assertIsNone(got[k])
                continue
            self.assertEqual(got[k].dtype, torch.bool if name == "is_top1" else torch.float32)
            self.assertEqual(within_spec(want[name], _np(got[k])), "", name)

    def test_no_gradient_calls_go_to_the_service_gradient_calls_to_trl(self):
        adapter = use_service(self.trainer, self.client)
        try:
            w = self.trainer.model.get_output_embeddings().weight
            ref = self.trainer.ref_model.get_output_embeddings().weight
            with torch.no_grad():
                self.check(self.call(w, outputs=("log_probs", "entropy")), w, ("log_probs", "entropy"))
                self.check(self.call(ref), ref, ("log_probs",))
            self.assertEqual(dict(adapter.routed), {"policy": 1, "reference": 1})
            out = self.call(w, outputs=("log_probs", "entropy"))  # with gradients: TRL's
            self.assertTrue(out[0].requires_grad)
            self.assertEqual(dict(adapter.routed), {"policy": 1, "reference": 1})
            # Gradients enabled but nothing requires them (a detached view of
            # the policy's weight: the same memory): the service.
            self.assertTrue(torch.is_grad_enabled())
            got = self.call(w.detach())
            self.assertFalse(got[0].requires_grad)
            self.check(got, w, ("log_probs",))
            self.assertEqual(dict(adapter.routed), {"policy": 2, "reference": 1})
            other = torch.randn(tiny_models.VOCAB, tiny_models.HIDDEN)
            with torch.no_grad():
                self.call(other)  # another model's weight: TRL's
            self.assertEqual(dict(adapter.routed), {"policy": 2, "reference": 1})
            self.assertEqual(adapter.policy_version, "%s-step-0" % adapter.run)  # pushed on first use
            self.assertEqual(adapter.pushes, 1)
        finally:
            adapter.remove()
        self.assertIs(trl_utils._ChunkedLogProbFunction, self.real)

    def test_transform_mismatch_raises_or_falls_back(self):
        ref = self.trainer.ref_model.get_output_embeddings().weight
        adapter = use_service(self.trainer, self.client)
        try:
            with torch.no_grad():
                for kw, what in ((dict(logit_scale=2.0), "logit_scale"), (dict(softcap=30.0), "softcapping"),
                                 (dict(bias=torch.zeros(tiny_models.VOCAB)), "bias")):
                    with self.assertRaises(HeadMismatchError) as cm:
                        self.call(ref, **kw)
                    self.assertIn(what, str(cm.exception))
                    self.assertIn("on_unsupported", str(cm.exception))
        finally:
            adapter.remove()
        adapter = use_service(self.trainer, self.client, on_unsupported="fallback")
        try:
            with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                got = self.call(ref, logit_scale=2.0)
                got2 = self.call(ref, logit_scale=2.0)
            self.assertEqual(adapter.fallbacks, 2)
            self.assertEqual(sum("logit_scale" in str(w.message) for w in caught), 1)  # warned once
            want = fused_head_reference(_np(self.hidden), _np(ref), _np(self.targets), None, 0.7, None, 2.0)
            self.assertEqual(within_spec(want["log_probs"], _np(got[0])), "")
            torch.testing.assert_close(got[0], got2[0])
            self.assertEqual(dict(adapter.routed), {})
        finally:
            adapter.remove()

    def test_new_outputs(self):
        lacking = fused_head.missing_outputs(fused_head.NEW_OUTPUTS)
        if lacking:
            self.skipTest("this checkout's client/stubs lack ScoreOptions fields %s (the 'outputs' branch of issue "
                          "30 has not landed)" % (list(lacking),))
        ref = self.trainer.ref_model.get_output_embeddings().weight
        adapter = use_service(self.trainer, self.client)
        try:
            with torch.no_grad():
                got = self.call(ref, outputs=fused_head.FUSED_OUTPUTS)
            self.check(got, ref, fused_head.FUSED_OUTPUTS)
        finally:
            adapter.remove()

    def test_new_outputs_refused_clearly_without_stubs(self):
        if not fused_head.missing_outputs(fused_head.NEW_OUTPUTS):
            self.skipTest("this checkout's client has the new outputs (test_new_outputs checks them)")
        ref = self.trainer.ref_model.get_output_embeddings().weight
        adapter = use_service(self.trainer, self.client)
        try:
            with torch.no_grad(), self.assertRaises(HeadMismatchError) as cm:
                self.call(ref, outputs=("log_probs", "is_top1"))
            self.assertIn("is_top1", str(cm.exception))
            self.assertEqual(dict(adapter.routed), {})
        finally:
            adapter.remove()

    def test_empty_call_and_bf16_hidden(self):
        ref = self.trainer.ref_model.get_output_embeddings().weight
        adapter = use_service(self.trainer, self.client)
        try:
            with torch.no_grad():
                empty = trl_utils._ChunkedLogProbFunction.apply(
                    self.hidden[:0], ref, None, self.targets[:0], 1.0, 4096, None, 1.0, ("log_probs", "entropy"))
                self.assertEqual([tuple(x.shape) for x in empty[:2]], [(0,), (0,)])
                h16 = self.hidden.to(torch.bfloat16)
                got = self.call(ref, hidden=h16)
            want = fused_head_reference(_np(h16), _np(ref), _np(self.targets), None, 0.7)
            self.assertEqual(within_spec(want["log_probs"], _np(got[0])), "")
        finally:
            adapter.remove()

    def test_trl_version_check(self):
        self.assertEqual(check_trl_version(), trl_utils.__name__ and __import__("trl").__version__)
        for ok in ("1.16.0", "1.16.3", "1.16.0.dev0", "1.16.1+local"):
            self.assertEqual(check_trl_version(ok), ok)
        for bad in ("1.15.2", "1.17.0", "2.0.0", "0.29.0"):
            with self.assertRaises(RuntimeError) as cm:
                check_trl_version(bad)
            self.assertIn(">= 1.16, < 1.17", str(cm.exception))
            self.assertIn(bad, str(cm.exception))

    def test_asyncio_client_is_refused(self):
        class AioLike:
            async def score(self, *args, **kwargs):
                pass

        with self.assertRaises(TypeError) as cm:
            use_service(self.trainer, AioLike())
        self.assertIn("synchronous", str(cm.exception))
        self.assertIs(trl_utils._ChunkedLogProbFunction, self.real)

    def test_unknown_head_is_refused_at_setup(self):
        from logprob_client import InvalidInputError

        with self.assertRaises(InvalidInputError) as cm:
            use_service(self.trainer, self.client, reference_head="ref")
        self.assertIn("no lm_head 'ref'", str(cm.exception))
        self.assertIs(trl_utils._ChunkedLogProbFunction, self.real)


class VllmMismatchTest(unittest.TestCase):
    """GRPO with vLLM importance sampling (``use_vllm``,
    ``vllm_importance_sampling_correction``): vLLM is played by TRL's own
    generation with the policy's logprobs plus N(0, 0.08) noise as the
    sampling logprobs (one missing as vLLM's None), 3 steps on the tiny Qwen2 model against a
    2-worker server. Each generation's old-policy calls carry those
    logprobs to the service, and the figures the adapter adds to TRL's
    metrics equal numpy float64 ones computed from TRL's own tensors of
    that generation (old_per_token_logps, which the service answered,
    sampling_per_token_logps, completion_mask): rows matched to the right
    tokens, the reference calls carrying none."""

    @classmethod
    def setUpClass(cls):
        cls.dir = temp_dir("py_trl_vllm_mismatch")
        model_dir = os.path.join(cls.dir, "model")
        tiny_models.save_model("qwen2", model_dir, seed=5)
        cls.server = Server(workers=2, extra=["--lm-head", "policy=" + model_dir, "--lm-head",
                                              "reference=" + model_dir, "--allow-lm-head-updates",
                                              "--lm-head-retain", "2"], metrics=True)
        try:
            cls.client = LogprobClient(cls.server.address, timeout=120)
            trainer = grpo_trainer(model_dir, os.path.join(cls.dir, "out"), False, num_iterations=1)
            # vLLM, played by TRL's generation with made-up logprobs.
            trainer.use_vllm, trainer.vllm_importance_sampling_correction = True, True
            rng = np.random.default_rng(11)
            generate = trainer._generate_single_turn

            def engine_logprobs(prompt, completion):
                # The policy's own logprobs (float64 from its float32
                # logits) with an engine's noise: N(0, 0.08) nats.
                ids = torch.tensor([list(prompt) + list(completion)])
                with torch.no_grad():
                    logits = trainer.model(input_ids=ids).logits[0].double() / float(trainer.temperature)
                lp = torch.log_softmax(logits, dim=-1)
                noise = rng.normal(0.0, 0.08, len(completion))
                return [float(lp[len(prompt) - 1 + j, t]) + float(noise[j]) for j, t in enumerate(completion)]

            def fake_vllm(prompt_ids, *args, **kwargs):
                trainer.use_vllm = False
                try:
                    completion_ids, _ = generate(prompt_ids, *args, **kwargs)
                finally:
                    trainer.use_vllm = True
                assert len(completion_ids) == len(prompt_ids), "one completion per prompt"
                logprobs = [engine_logprobs(p, c) for p, c in zip(prompt_ids, completion_ids)]
                logprobs[0][0] = None  # vLLM's NaN
                return completion_ids, logprobs

            trainer._generate_single_turn = fake_vllm
            cls.adapter = use_service(trainer, cls.client)
            cls.generations = []
            wrapped = trainer._generate_and_score_completions

            def capture(*args, **kwargs):
                out = wrapped(*args, **kwargs)
                cls.generations.append({k: _np(out[k]) for k in ("old_per_token_logps", "sampling_per_token_logps",
                                                                 "completion_mask")})
                return out

            trainer._generate_and_score_completions = capture
            set_seed(0)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                trainer.train()
            cls.trainer = trainer
        except BaseException:
            cls.tearDownClass()
            raise

    @classmethod
    def tearDownClass(cls):
        if getattr(cls, "adapter", None) is not None:
            cls.adapter.remove()
        if getattr(cls, "client", None) is not None:
            cls.client.close()
        cls.server.close()
        shutil.rmtree(cls.dir, ignore_errors=True)

    def expected(self, g):
        """The generation's request figures in float64 (the service's
        definition, reference.mismatch_reference) from TRL's tensors."""
        service, rollout = g["old_per_token_logps"].ravel(), g["sampling_per_token_logps"].ravel()
        compared = g["completion_mask"].ravel() != 0
        _, _, _, request = mismatch_reference(service, rollout, compared, [0, service.size], 3.0, 0.9, 1.1)
        return request

    def test_figures_in_trls_metrics_match_float64_from_trls_tensors(self):
        logs = [h for h in self.trainer.state.log_history if MISMATCH_METRICS + "k3" in h]
        self.assertEqual(len(self.generations), STEPS)
        self.assertEqual(len(logs), STEPS, "one generation, one log line per step")
        for step, (g, log) in enumerate(zip(self.generations, logs)):
            want = self.expected(g)
            self.assertGreater(want["tokens"], 10)
            self.assertTrue(0 < want["outside_band_fraction"] < 1, want)
            # Rows matched to their tokens: only the engine's noise is left.
            self.assertLess(want["mean_abs_log_ratio"], 0.1, want)
            self.assertEqual(log[MISMATCH_METRICS + "tokens"], want["tokens"], "step %d" % step)
            for name in ("mean_abs_log_ratio", "k1", "k3", "outside_band_fraction"):
                self.assertAlmostEqual(log[MISMATCH_METRICS + name], want[name], delta=1e-9 * (1 + abs(want[name])),
                                       msg="step %d %s" % (step, name))
            # TRL's own figure from the same tensors (float32).
            self.assertAlmostEqual(log["sampling/sampling_logp_difference/mean"], want["mean_abs_log_ratio"],
                                   delta=1e-5 * (1 + want["mean_abs_log_ratio"]))
        self.assertEqual(self.adapter.mismatch["tokens"], logs[-1][MISMATCH_METRICS + "tokens"])

    def test_only_the_old_policy_calls_carried_rollout_logprobs(self):
        # Each generation's old-policy pass, and no other call, was compared:
        # the server counted as many tokens as the generations have.
        want = sum(self.expected(g)["tokens"] for g in self.generations)
        self.assertEqual(self.server.metric("logprob_rollout_tokens_total", head="policy"), want)
        self.assertEqual(self.server.metric("logprob_rollout_request_k3_count", head="reference"), 0)


class TransformedHeadTest(unittest.TestCase):
    """Heads with a logit transform (issue 30 item 1, the transforms
    change): a Granite-style checkpoint (logits / logits_scaling) and a
    Gemma-2-style one (final_logit_softcapping): TRL's own fused forward of
    the reference model, without gradients, answered by the service within
    2e-4 + 2e-5 |x| of float64 with the model's transform; a call with
    another transform refused."""

    @classmethod
    def setUpClass(cls):
        from logprob_client import logprob_pb2

        fields = {f.name for f in logprob_pb2.LmHeadInfo.DESCRIPTOR.fields}
        if not {"has_bias", "logit_scale", "final_logit_softcapping"} <= fields:
            raise unittest.SkipTest("this checkout's LmHeadInfo has no logit transform (the 'transforms' branch of "
                                    "issue 30 has not landed): servers score such heads without it")
        cls.dir = temp_dir("py_trl_transforms")

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.dir, ignore_errors=True)

    def check_kind(self, kind, scale, softcap):
        model_dir = os.path.join(self.dir, kind)
        tiny_models.save_model(kind, model_dir, seed=6)
        with Server(workers=2, extra=["--lm-head", "policy=" + model_dir, "--lm-head", "reference=" + model_dir,
                                      "--allow-lm-head-updates"]) as server, \
                LogprobClient(server.address, timeout=120) as client:
            head = fused_head.head_info(client, "reference")
            self.assertAlmostEqual(head.logit_scale, scale, places=12)
            self.assertEqual(head.final_logit_softcapping, softcap or 0.0)
            trainer = grpo_trainer(model_dir, os.path.join(self.dir, kind + "-out"), False)
            adapter = use_service(trainer, client)
            try:
                ref = trainer.ref_model
                ids = torch.randint(3, tiny_models.VOCAB, (2, 12), generator=torch.Generator().manual_seed(3))
                with torch.no_grad():
                    out = ref(input_ids=ids, labels=ids, fused_lm_head=True)  # TRL's fused forward
                    hidden = ref.model(input_ids=ids).last_hidden_state[:, :-1].reshape(-1, tiny_models.HIDDEN)
                self.assertEqual(dict(adapter.routed), {"reference": 1})
                want = fused_head_reference(_np(hidden), _np(ref.lm_head.weight), ids[:, 1:].reshape(-1).numpy(),
                                            None, 1.0, softcap, scale)
                self.assertEqual(within_spec(want["log_probs"], _np(out.log_probs).reshape(-1)), "")
                with torch.no_grad(), self.assertRaises(HeadMismatchError):
                    trl_utils._ChunkedLogProbFunction.apply(hidden, ref.lm_head.weight, None, ids[:, 1:].reshape(-1),
                                                            1.0, 4096, softcap, scale * 2, ("log_probs",))
            finally:
                adapter.remove()

    def test_granite_style_logits_scaling(self):
        self.check_kind("granite", 1 / 8.0, None)

    def test_gemma2_style_softcapping(self):
        self.check_kind("gemma2", 1.0, 30.0)


if __name__ == "__main__":
    unittest.main()
