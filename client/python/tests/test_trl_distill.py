"""Full-vocabulary distillation through the service against TRL's
``ChunkedDivergenceFunction`` (docs/distillation.md, issue 48): run in the
TRL environment (.venv-trl) by ctest (py_trl_*), against a live 2-worker
CPU server holding a student head (H_s = 32, a bias, a logit multiplier)
and a teacher head (H_t = 48, a softcap) of one vocabulary.

- DistillContractTest: ``distill_autograd.service_divergence`` for beta 0,
  0.5 and 1 (temperature 1 and 0.7): the divergence and the student's
  entropy, the student's dL/dh (autograd) and dL/dW, dL/db (the step's
  sums) within 1e-4 of a row's largest float64 element (plus 1e-7) of
  float64 and within that of TRL's in-process float32 function; their
  distance from float64 (the Frobenius norm of the error) at most 1.1
  times TRL's (two float32 paths trade places element by element)."""

import json
import os
import shutil
import unittest

import numpy as np

from reference import distillation_reference, gradient_error
from support import Server, temp_dir

import torch  # noqa: E402  (the TRL environment's)
from trl.kernels.chunked_divergence import ChunkedDivergenceFunction  # noqa: E402

from logprob_client import LogprobClient, safetensors  # noqa: E402
from logprob_client.distill_autograd import service_divergence  # noqa: E402

V, HS, HT = 257, 32, 48
S_SCALE, T_SOFTCAP = 1.2, 5.0


def _np(t):
    return t.detach().cpu().to(torch.float64).numpy()


def _norm(expected, got):
    return float(np.linalg.norm(np.asarray(got, dtype=np.float64) - expected))


class DistillContractTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.dir = temp_dir("py_trl_distill_contract")
        rng = np.random.default_rng(48)
        cls.ws = (rng.standard_normal((V, HS)) * 0.3).astype(np.float32)
        cls.bs = (rng.standard_normal(V) * 0.5).astype(np.float32)
        cls.wt = (rng.standard_normal((V, HT)) * 0.3).astype(np.float32)
        student, teacher = os.path.join(cls.dir, "student"), os.path.join(cls.dir, "teacher")
        os.makedirs(student)
        os.makedirs(teacher)
        safetensors.save(os.path.join(student, "model.safetensors"), {"lm_head.weight": cls.ws, "lm_head.bias": cls.bs})
        with open(os.path.join(student, "config.json"), "w") as f:
            json.dump({"logit_scale": S_SCALE}, f)
        safetensors.save(os.path.join(teacher, "model.safetensors"), {"lm_head.weight": cls.wt})
        with open(os.path.join(teacher, "config.json"), "w") as f:
            json.dump({"final_logit_softcapping": T_SOFTCAP}, f)
        cls.server = Server(workers=2, extra=["--lm-head", "student=" + student, "--lm-head", "teacher=" + teacher])
        cls.client = LogprobClient(cls.server.address, timeout=120)

    @classmethod
    def tearDownClass(cls):
        cls.client.close()
        cls.server.close()
        shutil.rmtree(cls.dir, ignore_errors=True)

    def trl(self, hs, ht, beta, temperature, g):
        """TRL's float32 function in process: (divergence, entropy, dL/dh, dL/dW, dL/db)."""
        h = hs.clone().requires_grad_(True)
        w = torch.from_numpy(self.ws).clone().requires_grad_(True)
        b = torch.from_numpy(self.bs).clone().requires_grad_(True)
        div, ent = ChunkedDivergenceFunction.apply(h, w, b, ht, torch.from_numpy(self.wt), None, beta, temperature,
                                                   S_SCALE, None, 1.0, T_SOFTCAP)
        (div * g).sum().backward()
        return div, ent, h.grad, w.grad, b.grad

    def test_values_and_student_gradients_against_trl_and_float64(self):
        gen = torch.Generator().manual_seed(7)
        N = 41
        hs = torch.randn(N, HS, generator=gen)
        ht = torch.randn(N, HT, generator=gen)
        g = torch.randn(N, generator=gen)
        for k, (beta, temperature) in enumerate(((0.0, 1.0), (0.5, 0.7), (1.0, 1.0))):
            with self.subTest(beta=beta, temperature=temperature):
                ref = distillation_reference(hs.numpy(), self.ws, ht.numpy(), self.wt, beta, temperature,
                                             student_bias=self.bs, student_scale=S_SCALE, teacher_softcap=T_SOFTCAP,
                                             grad_divergence=g.numpy())
                t_div, t_ent, t_dh, t_dw, t_db = self.trl(hs, ht, beta, temperature, g)
                step = "distill-contract-%d" % k
                h = hs.clone().requires_grad_(True)
                div, ent = service_divergence(self.client, h, ht, student_head="student", teacher_head="teacher",
                                              beta=beta, temperature=temperature, gradient_step=step)
                self.assertFalse(ent.requires_grad)
                (div * g).sum().backward()
                sums = self.client.read_head_gradients(step, head="student")
                self.client.close_gradient_step(step)
                got = {"divergence": _np(div), "entropy": _np(ent), "grad_hidden": _np(h.grad),
                       "grad_weight": sums.weight, "grad_bias": sums.bias}
                theirs = {"divergence": _np(t_div), "entropy": _np(t_ent), "grad_hidden": _np(t_dh),
                          "grad_weight": _np(t_dw), "grad_bias": _np(t_db)}
                for name in ("divergence", "entropy"):
                    np.testing.assert_allclose(got[name], ref[name], rtol=1e-5, atol=1e-5, err_msg=name)
                    np.testing.assert_allclose(got[name], theirs[name], rtol=1e-4, atol=1e-4, err_msg=name)
                for name in ("grad_hidden", "grad_weight", "grad_bias"):
                    self.assertEqual(gradient_error(ref[name], got[name]), "", name)
                    self.assertEqual(gradient_error(theirs[name], got[name]), "", name + " against TRL")
                    bound = 1.1 * _norm(ref[name], theirs[name]) + 1e-7 * float(np.linalg.norm(ref[name]))
                    self.assertLessEqual(_norm(ref[name], got[name]), bound, name + ": farther from float64 than TRL")


if __name__ == "__main__":
    unittest.main()
