"""Full-vocabulary distillation through the service (docs/distillation.md,
issue 48): a student head (H_s = 48, a bias and a logit multiplier) and a
teacher head (H_t = 64, a softcap) over V = 301 on 3 workers; the
divergence for beta 0, 0.5, 1, the soft-target cross entropy and the
student's entropy, and the student's dL/dh and its step sums dL/dW, dL/db
against float64; a token's answer bitwise the same alone or in a batch;
the asyncio client; bad input named by the server."""

import asyncio
import json
import os
import unittest

import numpy as np

from logprob_client import DistillResult, InvalidInputError, LogprobError, logprob_pb2, safetensors
from logprob_client import aio as logprob_aio
from reference import distillation_reference, gradient_error
from support import Server, temp_dir

import grpc

V, HS, HT = 301, 48, 64
S_SCALE, T_SOFTCAP = 1.3, 4.0


def heads(d):
    """The student (a folder: weight, bias, config with logit_scale), the
    teacher (a folder: weight, config with final_logit_softcapping) and a
    head of another vocabulary; their arrays."""
    rng = np.random.default_rng(48)
    ws = (rng.standard_normal((V, HS)) * 0.3).astype(np.float32)
    bs = (rng.standard_normal(V) * 0.5).astype(np.float32)
    wt = (rng.standard_normal((V, HT)) * 0.3).astype(np.float32)
    student, teacher = os.path.join(d, "student"), os.path.join(d, "teacher")
    os.makedirs(student)
    os.makedirs(teacher)
    safetensors.save(os.path.join(student, "model.safetensors"), {"lm_head.weight": ws, "lm_head.bias": bs})
    with open(os.path.join(student, "config.json"), "w") as f:
        json.dump({"logit_scale": S_SCALE}, f)
    safetensors.save(os.path.join(teacher, "model.safetensors"), {"lm_head.weight": wt})
    with open(os.path.join(teacher, "config.json"), "w") as f:
        json.dump({"final_logit_softcapping": T_SOFTCAP}, f)
    other = os.path.join(d, "other.safetensors")
    safetensors.save(other, {"lm_head.weight": (rng.standard_normal((V + 1, HS)) * 0.3).astype(np.float32)})
    return student, teacher, other, ws, bs, wt


class DistillTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        d = temp_dir("distill")
        cls.student, cls.teacher, cls.other, cls.ws, cls.bs, cls.wt = heads(d)
        flags = ["--lm-head", "student=" + cls.student, "--lm-head", "teacher=" + cls.teacher, "--lm-head",
                 "other=" + cls.other, "--hidden-chunk-tokens", "8"]
        cls.server = Server(workers=3, extra=flags)
        cls.client = cls.server.client()

    @classmethod
    def tearDownClass(cls):
        cls.client.close()
        cls.server.close()

    def reference(self, hs, ht, beta, temperature=1.0, g_d=None, g_ce=None):
        return distillation_reference(hs, self.ws, ht, self.wt, beta, temperature, student_bias=self.bs,
                                      student_scale=S_SCALE, teacher_softcap=T_SOFTCAP, grad_divergence=g_d,
                                      grad_cross_entropy=g_ce)

    def call(self, hs, ht, beta, **kw):
        return self.client.distill(hs, ht, student_head="student", teacher_head="teacher", beta=beta, **kw)

    def test_values_against_float64(self):
        rng = np.random.default_rng(1)
        hs = rng.standard_normal((37, HS)).astype(np.float32)
        ht = rng.standard_normal((37, HT)).astype(np.float32)
        for beta in (0.0, 0.5, 1.0):
            for temperature in (1.0, 0.7):
                got = self.call(hs, ht, beta, temperature=temperature)
                ref = self.reference(hs, ht, beta, temperature)
                self.assertIsInstance(got, DistillResult)
                self.assertIsNone(got.grad_student_hidden_states)
                for name in ("divergence", "cross_entropy", "entropy"):
                    np.testing.assert_allclose(getattr(got, name), ref[name], rtol=1e-5, atol=1e-5,
                                               err_msg="%s, beta %s, T %s" % (name, beta, temperature))

    def test_student_gradients_and_step_sums_against_float64(self):
        rng = np.random.default_rng(2)
        step = "distill-step-1"
        beta = 0.5
        expected_w = np.zeros((V, HS))
        expected_b = np.zeros(V)
        for n in (29, 13):  # two micro-batches of one optimizer step
            hs = rng.standard_normal((n, HS)).astype(np.float32)
            ht = rng.standard_normal((n, HT)).astype(np.float32)
            g_d = rng.standard_normal(n).astype(np.float32)
            g_ce = (rng.standard_normal(n) * 0.5).astype(np.float32)
            got = self.call(hs, ht, beta, temperature=0.7, grad_divergence=g_d, grad_cross_entropy=g_ce,
                            gradient_step=step)
            ref = self.reference(hs, ht, beta, 0.7, g_d, g_ce)
            self.assertEqual(got.grad_student_hidden_states.shape, (n, HS))
            self.assertEqual(gradient_error(ref["grad_hidden"], got.grad_student_hidden_states), "")
            expected_w += ref["grad_weight"]
            expected_b += ref["grad_bias"]
        sums = self.client.read_head_gradients(step, head="student")
        self.assertEqual(sums.weight.shape, (V, HS))
        self.assertEqual(sums.micro_batches, 2)
        self.assertEqual(gradient_error(expected_w, sums.weight), "")
        self.assertEqual(gradient_error(expected_b, sums.bias), "")
        self.client.close_gradient_step(step)

    def test_a_tokens_answer_is_the_same_alone_or_in_a_batch(self):
        rng = np.random.default_rng(3)
        hs = rng.standard_normal((40, HS)).astype(np.float32)
        ht = rng.standard_normal((40, HT)).astype(np.float32)
        g_d = rng.standard_normal(40).astype(np.float32)
        whole = self.call(hs, ht, 0.5, grad_divergence=g_d)
        part = self.call(hs[17:30], ht[17:30], 0.5, grad_divergence=g_d[17:30])
        np.testing.assert_array_equal(part.divergence, whole.divergence[17:30])
        np.testing.assert_array_equal(part.cross_entropy, whole.cross_entropy[17:30])
        np.testing.assert_array_equal(part.grad_student_hidden_states, whole.grad_student_hidden_states[17:30])
        forward = self.call(hs[17:30], ht[17:30], 0.5)
        np.testing.assert_array_equal(forward.divergence, part.divergence)

    def test_asyncio_client_answers_the_same(self):
        rng = np.random.default_rng(4)
        hs = rng.standard_normal((9, HS)).astype(np.float32)
        ht = rng.standard_normal((9, HT)).astype(np.float32)

        async def go():
            async with logprob_aio.LogprobClient(self.server.address) as c:
                return await c.distill(hs, ht, student_head="student", teacher_head="teacher", beta=1.0)
        got = asyncio.run(go())
        want = self.call(hs, ht, 1.0)
        np.testing.assert_array_equal(got.divergence, want.divergence)
        np.testing.assert_array_equal(got.entropy, want.entropy)

    def raw(self, **fields):
        """A DistillRequest sent as built (past the client's own checks)."""
        rng = np.random.default_rng(5)

        def tensor(name, arr):
            return logprob_pb2.Tensor(name=name, dtype=logprob_pb2.F32, shape=list(arr.shape), data=arr.tobytes())
        hs = fields.pop("hs", rng.standard_normal((4, HS)).astype(np.float32))
        ht = fields.pop("ht", rng.standard_normal((4, HT)).astype(np.float32))
        inputs = [tensor("student_hidden_states", hs), tensor("teacher_hidden_states", ht)]
        for name in ("grad_divergence", "grad_cross_entropy"):
            if name in fields:
                inputs.append(tensor(name, fields.pop(name)))
        req = logprob_pb2.DistillRequest(inputs=inputs, student_head="student", teacher_head="teacher", beta=0.5)
        for k, v in fields.items():
            setattr(req, k, v)
        return self.client._stub.Distill(req, timeout=60)

    def test_bad_input_is_named_by_the_server(self):
        cases = [
            ({"beta": 1.5}, "beta"),
            ({"teacher_head": "other"}, "vocabulary"),
            ({"hs": np.zeros((4, HT), np.float32)}, "student_hidden_states has H = 64"),
            ({"ht": np.zeros((3, HT), np.float32)}, "teacher_hidden_states has 3 rows"),
            ({"grad_divergence": np.array([0, 1, np.inf, 0], np.float32)}, "grad_divergence[2] is not finite"),
            ({"grad_cross_entropy": np.zeros(4, np.float32)}, "grad_cross_entropy without grad_divergence"),
            ({"gradient_step": "s"}, "gradient_step without grad_divergence"),
            ({"student_head": "nope"}, "nope"),
        ]
        for fields, words in cases:
            with self.assertRaises(grpc.RpcError) as e:
                self.raw(**fields)
            code = grpc.StatusCode.NOT_FOUND if "student_head" in fields else grpc.StatusCode.INVALID_ARGUMENT
            self.assertEqual(e.exception.code(), code, fields)
            self.assertIn(words, e.exception.details(), fields)
        # The client refuses what it can tell before sending.
        hs = np.zeros((2, HS), np.float32)
        ht = np.zeros((2, HT), np.float32)
        with self.assertRaises(InvalidInputError):
            self.call(hs, ht, -0.1)
        with self.assertRaises(InvalidInputError):
            self.call(hs, ht, 0.5, grad_divergence=np.array([np.nan, 0], np.float32))
        # And the server still serves.
        self.assertEqual(self.call(hs, ht, 0.5).divergence.shape, (2,))

    def test_a_server_error_is_a_logprob_error(self):
        with self.assertRaises(LogprobError) as e:
            self.client.distill(np.zeros((2, HS), np.float32), np.zeros((2, HT), np.float32), student_head="student",
                                teacher_head="missing", beta=0.5)
        self.assertEqual(e.exception.code, grpc.StatusCode.NOT_FOUND)


if __name__ == "__main__":
    unittest.main()
