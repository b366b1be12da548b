"""The lm_head's backward as a service (docs/gradients.md, issue 47): dL/dh
answered per token, dL/dW and dL/db summed per optimizer step on the
workers and read back in pieces, against float64; batch invariance of
dL/dh; worker counts; bad input."""

import asyncio
import json
import os
import unittest

import numpy as np

from logprob_client import LogprobError, safetensors
from logprob_client import aio as logprob_aio
from reference import gradient_error, head_backward_reference
from support import Server, temp_dir

import grpc

V, H = 301, 48  # neither divides the workers' slices or the kernels' tiles
SCALE, SOFTCAP = 0.5, 3.0


def heads(d):
    """A plain head (a bare file) and a head with a bias, a logit multiplier
    and a softcap (a folder with config.json); their weights and bias."""
    rng = np.random.default_rng(47)
    w_plain = (rng.standard_normal((V, H)) * 0.3).astype(np.float32)
    w_fancy = (rng.standard_normal((V, H)) * 0.5).astype(np.float32)
    bias = (rng.standard_normal(V) * 0.5).astype(np.float32)
    plain = os.path.join(d, "plain.safetensors")
    safetensors.save(plain, {"lm_head.weight": w_plain})
    fancy = os.path.join(d, "fancy")
    os.makedirs(fancy)
    safetensors.save(os.path.join(fancy, "model.safetensors"), {"lm_head.weight": w_fancy, "lm_head.bias": bias})
    with open(os.path.join(fancy, "config.json"), "w") as f:
        json.dump({"logit_scale": SCALE, "final_logit_softcapping": SOFTCAP}, f)
    return plain, fancy, w_plain, w_fancy, bias


def packed_batch(rng, lens, ignore_at=()):
    """Packed hidden states [T, H] f32, input_ids [T], cu_seqlens; the next
    token targets [T - B] in output order (ignore_index -100 at
    ``ignore_at`` output positions) and the input row of each output."""
    T = sum(lens)
    hidden = rng.standard_normal((T, H)).astype(np.float32)
    ids = rng.integers(0, V, size=T).astype(np.int64)
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    rows = np.concatenate([np.arange(cu[i], cu[i + 1] - 1) for i in range(len(lens))])
    targets = ids[rows + 1].copy()
    for o in ignore_at:
        ids[rows[o] + 1] = -100
        targets[o] = -1
    return hidden, ids, cu, rows, targets


class HeadBackwardTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        d = temp_dir("head_backward")
        cls.plain, cls.fancy, cls.w_plain, cls.w_fancy, cls.bias = heads(d)
        flags = ["--lm-head", "plain=" + cls.plain, "--lm-head", "fancy=" + cls.fancy, "--hidden-chunk-tokens", "8"]
        cls.server = Server(workers=3, extra=flags)
        cls.client = cls.server.client()

    @classmethod
    def tearDownClass(cls):
        cls.client.close()
        cls.server.close()

    def check(self, what, expected, got):
        err = gradient_error(expected, got)
        self.assertEqual(err, "", "%s: %s" % (what, err))

    def test_grad_hidden_against_float64_plain_head(self):
        rng = np.random.default_rng(1)
        hidden, ids, cu, rows, targets = packed_batch(rng, [7, 12, 5], ignore_at=(3,))
        n = len(rows)
        g_lp = rng.standard_normal(n).astype(np.float32)
        g_ent = rng.standard_normal(n).astype(np.float32)
        res = self.client.backward(hidden, ids, g_lp, grad_entropy=g_ent, cu_seqlens=cu, head="plain", entropy=True)
        ref = head_backward_reference(hidden[rows], self.w_plain, targets, g_lp, g_ent)
        dh = res.grad_hidden_states
        self.assertEqual(dh.shape, hidden.shape)
        self.assertEqual(dh.dtype, np.float32)
        self.check("dL/dh", ref["grad_hidden"], dh[rows])
        # The last position of each sequence scores nothing: no gradient.
        last = cu[1:] - 1
        self.assertTrue(np.all(dh[last] == 0))
        # The forward's outputs come with it, as a forward answers them.
        fwd = self.client.score(hidden_states=hidden, input_ids=ids, cu_seqlens=cu, head="plain", entropy=True)
        np.testing.assert_array_equal(res.token_logprobs, fwd.token_logprobs)
        np.testing.assert_array_equal(res.entropy, fwd.entropy)
        np.testing.assert_allclose(res.token_logprobs, ref["log_probs"], rtol=1e-5, atol=1e-5)

    def test_step_sums_with_bias_scale_softcap_and_temperature(self):
        rng = np.random.default_rng(2)
        step = "fancy-step-1"
        seen = []
        for mb in range(2):  # two micro-batches of one optimizer step
            B, S = 3, 9
            hidden = rng.standard_normal((B, S, H)).astype(np.float32)
            ids = rng.integers(0, V, size=(B, S)).astype(np.int64)
            seq_lens = np.array([9, 4, 6], dtype=np.int64)
            g_lp = rng.standard_normal((B, S - 1)).astype(np.float32)
            g_ent = (rng.standard_normal((B, S - 1)) * 0.3).astype(np.float32)
            res = self.client.backward(hidden, ids, g_lp, grad_entropy=g_ent, seq_lens=seq_lens, head="fancy",
                                       temperature=0.7, gradient_step=step)
            b_idx = np.concatenate([np.full(L - 1, b) for b, L in enumerate(seq_lens)])
            t_idx = np.concatenate([np.arange(L - 1) for L in seq_lens])
            h_rows = hidden[b_idx, t_idx]
            ref = head_backward_reference(h_rows, self.w_fancy, ids[b_idx, t_idx + 1], g_lp[b_idx, t_idx],
                                          g_ent[b_idx, t_idx], bias=self.bias, temperature=0.7, softcap=SOFTCAP,
                                          logit_scale=SCALE)
            self.check("dL/dh of micro-batch %d" % mb, ref["grad_hidden"], res.grad_hidden_states[b_idx, t_idx])
            seen.append((ref, len(b_idx)))
        sums = self.client.read_head_gradients(step, head="fancy")
        self.assertEqual(sums.weight.shape, (V, H))
        self.assertEqual(sums.bias.shape, (V,))
        self.assertEqual(sums.head, "fancy")
        self.assertEqual(sums.micro_batches, 2)
        self.assertEqual(sums.tokens, sum(n for _, n in seen))
        self.check("dL/dW", seen[0][0]["grad_weight"] + seen[1][0]["grad_weight"], sums.weight)
        self.check("dL/db", seen[0][0]["grad_bias"] + seen[1][0]["grad_bias"], sums.bias)
        # A piece of rows across two workers' slices reads the same values.
        part = self.client.read_head_gradients(step, head="fancy", rows=(95, 210))
        np.testing.assert_array_equal(part.weight, sums.weight[95:210])
        np.testing.assert_array_equal(part.bias, sums.bias[95:210])
        self.client.close_gradient_step(step)
        self.client.close_gradient_step(step)  # a retried close
        with self.assertRaises(LogprobError) as e:
            self.client.read_head_gradients(step, head="fancy")
        self.assertEqual(e.exception.code, grpc.StatusCode.ALREADY_EXISTS)
        with self.assertRaises(LogprobError) as e:  # a closed key is never added to again
            self.client.backward(hidden, ids, g_lp, seq_lens=seq_lens, head="fancy", gradient_step=step)
        self.assertEqual(e.exception.code, grpc.StatusCode.ALREADY_EXISTS)
        self.assertIn(step, e.exception.message)

    def test_grad_hidden_rows_bitwise_whatever_shares_the_request(self):
        rng = np.random.default_rng(3)
        hidden, ids, cu, rows, targets = packed_batch(rng, [6, 30, 9])
        g_lp = rng.standard_normal(len(rows)).astype(np.float32)
        whole = self.client.backward(hidden, ids, g_lp, cu_seqlens=cu, head="plain").grad_hidden_states
        # The first sequence alone, then the third alone.
        alone = self.client.backward(hidden[:6], ids[:6], g_lp[:5], cu_seqlens=np.array([0, 6]), head="plain")
        np.testing.assert_array_equal(alone.grad_hidden_states, whole[:6])
        third = self.client.backward(hidden[36:], ids[36:], g_lp[34:], cu_seqlens=np.array([0, 9]), head="plain")
        np.testing.assert_array_equal(third.grad_hidden_states, whole[36:])

    def test_worker_counts_agree_within_float32(self):
        rng = np.random.default_rng(4)
        hidden, ids, cu, rows, targets = packed_batch(rng, [11, 14])
        g_lp = rng.standard_normal(len(rows)).astype(np.float32)
        three = self.client.backward(hidden, ids, g_lp, cu_seqlens=cu, head="plain", gradient_step="w3")
        with Server(workers=1, extra=["--lm-head", "plain=" + self.plain]) as one_server:
            with one_server.client() as one:
                single = one.backward(hidden, ids, g_lp, cu_seqlens=cu, head="plain", gradient_step="w1")
                w1 = one.read_head_gradients("w1")
        w3 = self.client.read_head_gradients("w3", head="plain")
        self.client.close_gradient_step("w3")
        ref = head_backward_reference(hidden[rows], self.w_plain, targets, g_lp)
        for got in (three, single):
            self.check("dL/dh", ref["grad_hidden"], got.grad_hidden_states[rows])
        np.testing.assert_allclose(three.grad_hidden_states, single.grad_hidden_states, rtol=1e-5, atol=1e-6)
        self.assertIsNone(w1.bias)
        self.check("dL/dW (1 worker)", ref["grad_weight"], w1.weight)
        self.check("dL/dW (3 workers)", ref["grad_weight"], w3.weight)

    def test_bad_input_names_the_field(self):
        rng = np.random.default_rng(5)
        hidden, ids, cu, rows, targets = packed_batch(rng, [5, 5])
        g = np.ones(len(rows), dtype=np.float32)

        def refused(code, needle, **kw):
            args = dict(hidden_states=hidden, input_ids=ids, cu_seqlens=cu, head="plain", grad_token_logprobs=g)
            args.update(kw)
            with self.assertRaises(LogprobError) as e:
                self.client.score(**args)
            self.assertEqual(e.exception.code, code, e.exception.message)
            self.assertIn(needle, e.exception.message)

        bad = g.copy()
        bad[6] = np.nan  # sequence 1 (4 outputs each), output position 2
        refused(grpc.StatusCode.INVALID_ARGUMENT, "\"grad_token_logprobs\": nan at sequence 1 position 2",
                grad_token_logprobs=bad)
        inf = g.copy()
        inf[2] = np.inf
        refused(grpc.StatusCode.INVALID_ARGUMENT, "\"grad_entropy\": inf at sequence 0 position 2", grad_entropy=inf)
        refused(grpc.StatusCode.INVALID_ARGUMENT, "\"grad_token_logprobs\": shape", grad_token_logprobs=g[:-1])
        refused(grpc.StatusCode.INVALID_ARGUMENT, "H = 40", hidden_states=hidden[:, :40])
        refused(grpc.StatusCode.INVALID_ARGUMENT, "sampling filters", sampling_top_k=5)
        refused(grpc.StatusCode.INVALID_ARGUMENT, "token_logprobs, entropy and grad_hidden_states only", topk=3)
        refused(grpc.StatusCode.INVALID_ARGUMENT, "options.gradient_step", gradient_step="has space")
        refused(grpc.StatusCode.FAILED_PRECONDITION, "not-a-version", head_version="not-a-version")
        with self.assertRaises(LogprobError) as e:  # a step key needs a backward
            self.client.score(hidden_states=hidden, input_ids=ids, cu_seqlens=cu, head="plain", gradient_step="k")
        self.assertEqual(e.exception.code, grpc.StatusCode.INVALID_ARGUMENT)
        # A step belongs to one head: another head's backward is refused, the step kept.
        self.client.backward(hidden, ids, g, cu_seqlens=cu, head="plain", gradient_step="one-head")
        refused(grpc.StatusCode.FAILED_PRECONDITION, "accumulates head 'plain'", hidden_states=hidden, head="fancy",
                gradient_step="one-head")
        kept = self.client.read_head_gradients("one-head", head="plain")
        self.assertEqual(kept.micro_batches, 1)
        with self.assertRaises(LogprobError) as e:
            self.client.read_head_gradients("one-head", head="fancy")
        self.assertEqual(e.exception.code, grpc.StatusCode.INVALID_ARGUMENT)
        self.client.close_gradient_step("one-head")
        with self.assertRaises(LogprobError) as e:
            self.client.read_head_gradients("never-used", head="plain")
        self.assertEqual(e.exception.code, grpc.StatusCode.NOT_FOUND)

    def test_asyncio_client(self):
        rng = np.random.default_rng(6)
        hidden, ids, cu, rows, targets = packed_batch(rng, [8])
        g_lp = rng.standard_normal(len(rows)).astype(np.float32)

        async def run():
            async with logprob_aio.LogprobClient(self.server.address) as c:
                res = await c.backward(hidden, ids, g_lp, cu_seqlens=cu, head="plain", gradient_step="aio-1")
                sums = await c.read_head_gradients("aio-1", head="plain")
                await c.close_gradient_step("aio-1")
                return res, sums

        res, sums = asyncio.run(run())
        ref = head_backward_reference(hidden[rows], self.w_plain, targets, g_lp)
        self.check("dL/dh", ref["grad_hidden"], res.grad_hidden_states[rows])
        self.check("dL/dW", ref["grad_weight"], sums.weight)


if __name__ == "__main__":
    unittest.main()
