"""logprob_client.verl at verl's seam, with verl 0.9.1 from PyPI.

verl is installed into the TRL environment without its dependencies
(scripts/setup-trl.sh: ``pip install --no-deps verl==0.9.1``): its package
``__init__`` imports ray (and verl 0.9.1 wants transformers < 5.11), so
``import verl`` fails there. The seam's modules are pure torch / transformers:
``verl_seam()`` imports them from the installed package with its parent
packages' ``__init__`` skipped. What runs is verl's own code:
``dense_common.forward_with_torch_backend`` (the forward verl puts on a
model with ``use_fused_kernels``) on the tiny Qwen2 model of the TRL tests,
and ``torch_functional.FusedLinearForPPO``.

Checked against a live 2-worker CPU server holding the model's head as
``policy`` and ``reference``: no-gradient calls answered by the service
within 2e-4 + 2e-5 |x| of float64 of the model's own hidden states, with
verl's shapes and dtypes; calls with gradients left to verl; the policy
pinned to the version pushed last; ``pushing_after`` on a method with the
signature of verl 0.9's ``ActorRolloutRefWorker.update_weights``.
"""

import asyncio
import importlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import threading
import types
import unittest

import numpy as np

from support import Server, free_port, hashed_head, temp_dir
from reference import fused_head_reference, within_spec
import tiny_models

import torch  # noqa: E402

from logprob_client import LogprobClient, LogprobError, fused_head  # noqa: E402
from logprob_client.verl import SEAM, check_verl_version, use_service  # noqa: E402


def verl_seam():
    """(torch_functional, dense_common) of the installed verl, imported
    without running the ``__init__`` of verl's packages above them."""
    spec = importlib.util.find_spec("verl")
    if spec is None:
        raise unittest.SkipTest("verl is not installed (scripts/setup-trl.sh installs verl==0.9.1 --no-deps)")
    root = list(spec.submodule_search_locations)[0]
    for name in ("verl", "verl.utils", "verl.utils.experimental", "verl.models", "verl.models.transformers"):
        if name not in sys.modules:
            pkg = types.ModuleType(name)
            pkg.__path__ = [os.path.join(root, *name.split(".")[1:])]
            sys.modules[name] = pkg
    return (importlib.import_module(SEAM), importlib.import_module("verl.models.transformers.dense_common"))


def _np(t):
    return t.detach().cpu().double().numpy()


class VerlSeamTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tf, cls.dense = verl_seam()
        cls.dir = temp_dir("py_verl")
        ckpt = os.path.join(cls.dir, "ckpt")
        cls.model = tiny_models.save_model("qwen2", ckpt, seed=4)
        cls.server = Server(workers=2, extra=["--lm-head", "policy=" + ckpt, "--lm-head", "reference=" + ckpt,
                                              "--allow-lm-head-updates", "--lm-head-retain", "2"])
        cls.client = LogprobClient(cls.server.address, timeout=120)

    @classmethod
    def tearDownClass(cls):
        cls.client.close()
        cls.server.close()
        shutil.rmtree(cls.dir, ignore_errors=True)

    def setUp(self):
        self.original = self.tf.FusedLinearForPPO
        g = torch.Generator().manual_seed(1)
        self.ids = torch.randint(3, tiny_models.VOCAB, (3, 9), generator=g)

    def tearDown(self):
        self.tf.FusedLinearForPPO = self.original

    def verl_forward(self, model, temperature):
        """verl's use_fused_kernels forward of ``model`` on self.ids."""
        fwd = types.MethodType(self.dense.forward_with_torch_backend, model)
        return fwd(input_ids=self.ids, return_dict=True, temperature=temperature)

    def expected(self, model, weight, temperature):
        with torch.no_grad():
            hidden = model.model(input_ids=self.ids).last_hidden_state
        labels = torch.roll(self.ids, shifts=-1, dims=-1)  # verl's rolled labels
        return fused_head_reference(_np(hidden).reshape(-1, tiny_models.HIDDEN), _np(weight), labels.reshape(-1).numpy(),
                                    temperature=temperature)

    def test_version_of_the_installed_verl(self):
        self.assertEqual(check_verl_version(), "0.9.1")
        for bad in ("0.8.4", "0.10.0", "1.0.0"):
            with self.assertRaises(RuntimeError) as cm:
                check_verl_version(bad)
            self.assertIn(">= 0.9, < 0.10", str(cm.exception))

    def test_no_gradient_calls_from_the_service(self):
        service = use_service(self.client)
        try:
            lm_head = self.model.lm_head
            service.add_head(lm_head, "reference")
            with torch.no_grad():
                out = self.verl_forward(self.model, 0.7)
            self.assertEqual(dict(service.routed), {"reference": 1})
            want = self.expected(self.model, lm_head.weight, 0.7)
            self.assertEqual(tuple(out.log_probs.shape), (3, 9))
            self.assertEqual(out.log_probs.dtype, torch.float32)
            self.assertEqual(out.entropy.dtype, torch.float32)  # the hidden states' dtype
            self.assertEqual(within_spec(want["log_probs"], _np(out.log_probs).reshape(-1)), "")
            self.assertEqual(within_spec(want["entropy"], _np(out.entropy).reshape(-1)), "")
            # With gradients: verl's own kernel, the same numbers (float32 model).
            out_grad = self.verl_forward(self.model, 0.7)
            self.assertTrue(out_grad.log_probs.requires_grad)
            self.assertEqual(dict(service.routed), {"reference": 1})
            self.assertEqual(within_spec(want["log_probs"], _np(out_grad.log_probs).reshape(-1)), "")
        finally:
            service.remove()
        self.assertIs(self.tf.FusedLinearForPPO, self.original)

    def test_policy_pinned_to_the_last_push(self):
        service = use_service(self.client)
        model = tiny_models.make_model("qwen2", seed=4)
        try:
            service.add_head(model.lm_head, "policy")
            with torch.no_grad(), self.assertRaises(RuntimeError) as cm:
                self.verl_forward(model, 1.0)
            self.assertIn("push", str(cm.exception))
            self.assertEqual(service.push(model.lm_head.weight, step=0), "%s-step-0" % service.run)
            with torch.no_grad():
                model.lm_head.weight.mul_(1.5)  # an optimizer step
            self.assertEqual(service.push(model.lm_head.weight, step=1), "%s-step-1" % service.run)
            with torch.no_grad():
                out = self.verl_forward(model, 1.0)
            self.assertEqual(list(service.calls)[-1][:2], ("policy", "%s-step-1" % service.run))
            want = self.expected(model, model.lm_head.weight, 1.0)
            self.assertEqual(within_spec(want["log_probs"], _np(out.log_probs).reshape(-1)), "")
        finally:
            service.remove()

    def test_bf16_hidden_states_and_packed_input(self):
        service = use_service(self.client)
        try:
            w = self.model.lm_head.weight
            service.add_head(w, "reference")
            g = torch.Generator().manual_seed(2)
            hidden = torch.randn(40, tiny_models.HIDDEN, generator=g).to(torch.bfloat16)
            ids = torch.randint(0, tiny_models.VOCAB, (40,), generator=g)
            with torch.no_grad():
                lp, ent = self.tf.FusedLinearForPPO().forward(hidden, w, ids, 1.0)
            self.assertEqual((lp.dtype, ent.dtype), (torch.float32, torch.bfloat16))  # verl's dtypes
            self.assertEqual(tuple(lp.shape), (40,))
            want = fused_head_reference(_np(hidden), _np(w), ids.numpy())
            self.assertEqual(within_spec(want["log_probs"], _np(lp)), "")
            # verl's own (bf16 logits) is far from float64; the service is not.
            with torch.no_grad():
                own_lp, _ = self.original().forward(hidden, w.to(torch.bfloat16), ids, 1.0)
            self.assertGreater(float(np.abs(_np(own_lp) - want["log_probs"]).max()), 1e-3)
        finally:
            service.remove()

    def test_pushing_after_a_weight_sync(self):
        service = use_service(self.client)
        try:
            class Worker:  # the signature of verl 0.9's ActorRolloutRefWorker.update_weights
                def __init__(self, weight):
                    self.weight = weight
                    self.synced = []

                async def update_weights(self, global_steps=None, mode="auto"):
                    self.synced.append(global_steps)
                    return {}

            Worker.update_weights.dispatch_mode = "ONE_TO_ALL"  # what verl's @register marks
            Worker.update_weights = service.pushing_after(Worker.update_weights, lambda worker: worker.weight)
            self.assertEqual(Worker.update_weights.dispatch_mode, "ONE_TO_ALL")
            model = tiny_models.make_model("qwen2", seed=5)
            worker = Worker(model.lm_head.weight)
            asyncio.run(worker.update_weights(global_steps=7))
            self.assertEqual(worker.synced, [7])
            self.assertEqual(service.policy_version, "%s-step-7" % service.run)
            head = hashed_head(self.client, "policy")
            self.assertEqual(head.version, "%s-step-7" % service.run)
            self.assertEqual(head.sha256, fused_head.weight_sha256(model.lm_head.weight, torch.float32))
        finally:
            service.remove()

    def test_unknown_head_and_other_weights(self):
        service = use_service(self.client)
        try:
            from logprob_client import InvalidInputError

            with self.assertRaises(InvalidInputError):
                service.add_head(self.model.lm_head, "actor")
            with self.assertRaises(InvalidInputError):
                service.add_head(torch.zeros(10, tiny_models.HIDDEN), "reference")
            other = torch.randn(tiny_models.VOCAB, tiny_models.HIDDEN)
            with torch.no_grad():
                self.tf.FusedLinearForPPO().forward(torch.randn(4, tiny_models.HIDDEN), other,
                                                    torch.zeros(4, dtype=torch.int64), 1.0)
            self.assertEqual(dict(service.routed), {})  # not a registered head: verl's
        finally:
            service.remove()


def fake_seam():
    """A module with the seam's name in it (``use_service(module=...)``):
    the push tests need no verl."""
    class FusedLinearForPPO:
        def forward(self, hidden_states, vocab_weights, input_ids, temperature=1.0):
            raise AssertionError("not called by the push tests")

    return types.SimpleNamespace(FusedLinearForPPO=FusedLinearForPPO)


# One rank of a 2-process gloo job (torch.distributed on the CPU): makes
# its service (rank 0's run id broadcast), waits for the other rank
# (barrier), pushes the same weight as step 1, prints {run, version}.
RANK_SCRIPT = r"""
import json, sys, types
import torch, torch.distributed as dist
from logprob_client import LogprobClient
from logprob_client.verl import use_service

address, init, rank = sys.argv[1], sys.argv[2], int(sys.argv[3])
dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
class FusedLinearForPPO:
    pass
with LogprobClient(address, timeout=60) as client:
    service = use_service(client, module=types.SimpleNamespace(FusedLinearForPPO=FusedLinearForPPO))
    weight = torch.randn(%d, %d, generator=torch.Generator().manual_seed(11))
    dist.barrier()
    version = service.push(weight, step=1)
print(json.dumps({"run": service.run, "version": version, "pushes": service.pushes}))
dist.destroy_process_group()
"""


class VerlPushTest(unittest.TestCase):
    """Pushes safe to repeat, also when ranks race: every push carries the
    weight's sha256, so a repeat is the server's no-op Begin
    (``already_committed``, nothing uploaded) and data-parallel ranks
    pushing one step at once upload it once (the server has a Begin that
    repeats the open update's head, version and sha256 wait for its end).
    Counted at the server: ``logprob_lm_head_updates_total`` and
    ``logprob_lm_head_update_bytes_total``."""

    @classmethod
    def setUpClass(cls):
        cls.dir = temp_dir("py_verl_push")
        ckpt = os.path.join(cls.dir, "ckpt")
        tiny_models.save_model("qwen2", ckpt, seed=4)
        cls.server = Server(workers=2, extra=["--lm-head", "policy=" + ckpt, "--allow-lm-head-updates",
                                              "--lm-head-retain", "2"], metrics=True)
        cls.client = LogprobClient(cls.server.address, timeout=60)
        cls.nbytes = tiny_models.VOCAB * tiny_models.HIDDEN * 4  # the f32 head

    @classmethod
    def tearDownClass(cls):
        cls.client.close()
        cls.server.close()
        shutil.rmtree(cls.dir, ignore_errors=True)

    def counts(self):
        """(committed updates, aborted updates, bytes uploaded) of head policy."""
        m = self.server.metric
        return (m("logprob_lm_head_updates_total", head="policy", outcome="committed"),
                m("logprob_lm_head_updates_total", head="policy", outcome="aborted"),
                m("logprob_lm_head_update_bytes_total", head="policy"))

    def weight(self, seed):
        return torch.randn(tiny_models.VOCAB, tiny_models.HIDDEN, generator=torch.Generator().manual_seed(seed))

    def test_a_repeated_push_uploads_nothing(self):
        service = use_service(self.client, module=fake_seam())
        w = self.weight(1)
        before = self.counts()
        version = service.push(w, step=3)
        self.assertEqual(version, "%s-step-3" % service.run)
        self.assertEqual(self.counts(), (before[0] + 1, before[1], before[2] + self.nbytes))
        # The same bytes again under the taken name: already_committed, no upload.
        self.assertEqual(service.push(w.clone(), step=3), version)
        self.assertEqual(self.counts(), (before[0] + 1, before[1], before[2] + self.nbytes))
        # Another process of the run (same run id) repeating it: the same.
        other = use_service(LogprobClient(self.server.address, timeout=60), module=fake_seam(), run=service.run)
        try:
            self.assertEqual(other.push(w, step=3), version)
            self.assertEqual(other.policy_version, version)
        finally:
            other.client.close()
        self.assertEqual(self.counts(), (before[0] + 1, before[1], before[2] + self.nbytes))
        # Other bytes under that name: refused, saying what to do.
        with self.assertRaises(LogprobError) as cm:
            service.push(self.weight(2), step=3)
        self.assertEqual(cm.exception.code.name, "ALREADY_EXISTS")
        self.assertIn("{run}", cm.exception.message)
        self.assertEqual(service.pushes, 2)  # pushes that returned, uploads or not
        # A format without {run} still works.
        plain = use_service(self.client, module=fake_seam(), version_format="plain-{step}")
        self.assertEqual(plain.push(w, step=3), "plain-3")

    def two_ranks(self, run):
        """Two services of one run on their own clients, the first one's
        upload held open after its Begin until ``release`` is set."""
        ranks = [use_service(LogprobClient(self.server.address, timeout=60), module=fake_seam(), run=run)
                 for _ in range(2)]
        for r in ranks:
            self.addCleanup(r.client.close)
        began, release, sent = threading.Event(), threading.Event(), threading.Event()
        first = ranks[0].client
        real_put = first._put_host_rows_ops

        def held_put(*args, **kwargs):  # rank 0: Begin answered, rows not sent yet
            began.set()
            if not release.wait(60):
                raise AssertionError("never released")
            if release.abort:
                raise RuntimeError("rank 0 failed before its upload")
            return (yield from real_put(*args, **kwargs))

        first._put_host_rows_ops = held_put
        second = ranks[1].client
        real_begin = second._stub.BeginLmHeadUpdate

        def begin(request, **kwargs):  # rank 1: its Begin handed to gRPC, then wait for the answer
            call = real_begin.future(request, **kwargs)
            sent.set()
            return call.result()

        second._stub.BeginLmHeadUpdate = begin
        release.abort = False
        return ranks, began, release, sent

    def race(self, ranks, began, release, sent, weight):
        """Rank 0 pushes and holds its open update; rank 1 pushes the same
        step meanwhile; rank 0 goes on once rank 1's Begin is sent.
        Returns [(version or exception)] of both."""
        results = [None, None]

        def push(i):
            try:
                results[i] = ranks[i].push(weight, step=5)
            except Exception as e:  # reported below
                results[i] = e

        threads = [threading.Thread(target=push, args=(i,)) for i in range(2)]
        threads[0].start()
        self.assertTrue(began.wait(60), "rank 0 never opened its update")
        threads[1].start()
        self.assertTrue(sent.wait(60), "rank 1 never sent its Begin")
        release.set()
        for t in threads:
            t.join(120)
            self.assertFalse(t.is_alive())
        return results

    def test_ranks_pushing_the_same_step_at_once_upload_it_once(self):
        ranks, began, release, sent = self.two_ranks("race1")
        before = self.counts()
        results = self.race(ranks, began, release, sent, self.weight(3))
        self.assertEqual(results, ["race1-step-5", "race1-step-5"],
                         "both ranks' pushes must succeed (a server without the joined Begin refuses the second "
                         "with FAILED_PRECONDITION)")
        self.assertEqual(self.counts(), (before[0] + 1, before[1], before[2] + self.nbytes))  # one upload
        head = fused_head.head_info(self.client, "policy", refresh=True)
        self.assertEqual(head.version, "race1-step-5")
        self.assertEqual(list(head.retained_versions).count("race1-step-5"), 1)
        self.assertEqual([r.policy_version for r in ranks], ["race1-step-5"] * 2)

    def test_when_the_first_rank_aborts_the_waiting_one_uploads(self):
        ranks, began, release, sent = self.two_ranks("race2")
        release.abort = True
        before = self.counts()
        results = self.race(ranks, began, release, sent, self.weight(4))
        self.assertIsInstance(results[0], RuntimeError)
        self.assertEqual(results[1], "race2-step-5")
        self.assertEqual(self.counts(), (before[0] + 1, before[1] + 1, before[2] + self.nbytes))
        self.assertEqual(fused_head.head_info(self.client, "policy", refresh=True).version, "race2-step-5")

    def test_ranks_agree_on_the_run_id(self):
        """Two processes of a gloo job: the same run id (rank 0's, broadcast
        by use_service), the same step pushed by both, one Begin and one
        upload (rank 0's; the push is a collective)."""
        init = "tcp://127.0.0.1:%d" % free_port()
        before = self.counts()
        begins = self.server.metric("logprob_requests_total", method="BeginLmHeadUpdate", code="OK")
        procs = [subprocess.Popen([sys.executable, "-c", RANK_SCRIPT % (tiny_models.VOCAB, tiny_models.HIDDEN),
                                   self.server.address, init, str(rank)], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True) for rank in range(2)]
        outs = []
        for p in procs:
            out, err = p.communicate(timeout=180)
            self.assertEqual(p.returncode, 0, err[-3000:])
            outs.append(json.loads(out.strip().splitlines()[-1]))
        self.assertEqual(outs[0]["run"], outs[1]["run"])
        self.assertEqual([o["version"] for o in outs], ["%s-step-1" % outs[0]["run"]] * 2)
        self.assertEqual([o["pushes"] for o in outs], [1, 1])
        self.assertEqual(self.counts(), (before[0] + 1, before[1], before[2] + self.nbytes))
        # A collective: rank 0 alone began the update; rank 1 got its version by the broadcast.
        self.assertEqual(self.server.metric("logprob_requests_total", method="BeginLmHeadUpdate", code="OK"),
                         begins + 1)
        # Another job: another run id.
        self.assertNotEqual(use_service(self.client, module=fake_seam()).run, outs[0]["run"])


if __name__ == "__main__":
    unittest.main()
