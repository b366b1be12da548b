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
import os
import shutil
import sys
import types
import unittest

import numpy as np

from support import Server, hashed_head, temp_dir
from reference import fused_head_reference, within_spec
import tiny_models

import torch  # noqa: E402

from logprob_client import LogprobClient, fused_head  # noqa: E402
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


if __name__ == "__main__":
    unittest.main()
