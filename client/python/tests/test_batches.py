"""logprob_client.batches: trainers' [B, S] batches (left-padded prompt,
right-padded completion) packed into cu_seqlens form and the answers
scattered back, against direct float64 computations (PackTest: the packing
itself, numpy and torch; ScorePaddedTest: score_padded against a live
2-worker server holding an lm_head)."""

import os
import shutil
import unittest

import numpy as np

from support import Server, temp_dir
from reference import fused_head_reference, within_spec

from logprob_client import InvalidInputError, LogprobClient, safetensors
from logprob_client.batches import PackedBatch, score_padded

try:
    import torch
except ImportError:  # Debian's python3-torch is installed by scripts/install-deps.sh
    torch = None

V, H = 96, 24


def trainer_batch(rng, prompt_lens, completion_lens, P=6, C=5):
    """TRL's layout: prompts left-padded to P, completions right-padded to
    C, one [B, P + C] row each; returns input_ids, attention_mask
    [B, S], completion_mask [B, C]."""
    B = len(prompt_lens)
    ids = rng.integers(3, V, size=(B, P + C))
    att = np.zeros((B, P + C), dtype=np.int64)
    comp = np.zeros((B, C), dtype=np.int64)
    for b, (p, c) in enumerate(zip(prompt_lens, completion_lens)):
        att[b, P - p:P + c] = 1
        comp[b, :c] = 1
    ids = np.where(att == 1, ids, 0)
    return ids, att, comp


def direct(hidden, weight, ids, scored, alignment="next_token", temperature=1.0):
    """float64 outputs [B, S - 1] / [B, S] computed position by position
    where ``scored`` ([B, S - 1] / [B, S]) is set, 0 elsewhere."""
    shift = 1 if alignment == "next_token" else 0
    B, O = scored.shape
    out = {"token_logprobs": np.zeros((B, O)), "entropy": np.zeros((B, O))}
    for b in range(B):
        for t in range(O):
            if scored[b, t]:
                r = fused_head_reference(hidden[b, t:t + 1], weight, ids[b, t + shift:t + shift + 1],
                                         temperature=temperature)
                out["token_logprobs"][b, t] = r["log_probs"][0]
                out["entropy"][b, t] = r["entropy"][0]
    return out


def packed_reference(batch, hidden, weight, ids, alignment="next_token"):
    """What the service answers for the packed batch, in float64: per
    packed sequence, its rows scored at the next (or same) token."""
    h, i = batch.pack(hidden), batch.pack(ids)
    out = []
    for s, e in zip(batch.cu_seqlens[:-1], batch.cu_seqlens[1:]):
        if alignment == "next_token":
            out.append(fused_head_reference(h[s:e - 1], weight, i[s + 1:e])["log_probs"])
        else:
            out.append(fused_head_reference(h[s:e], weight, i[s:e])["log_probs"])
    return np.concatenate(out) if out else np.zeros(0)


class PackTest(unittest.TestCase):
    def setUp(self):
        self.rng = np.random.default_rng(5)
        self.w = self.rng.standard_normal((V, H)).astype(np.float32)

    def check_layout(self, prompt_lens, completion_lens, with_completion_mask=True, alignment="next_token"):
        ids, att, comp = trainer_batch(self.rng, prompt_lens, completion_lens)
        B, S = ids.shape
        hidden = self.rng.standard_normal((B, S, H)).astype(np.float32)
        batch = PackedBatch(att, comp if with_completion_mask else None, alignment)
        # Where the scattered values must be: completion tokens (or every
        # real token after a real one), at the column of the row scoring them.
        target = np.zeros((B, S), dtype=bool)
        if with_completion_mask:
            target[:, S - comp.shape[1]:] = comp == 1
        else:
            target = att == 1
        if alignment == "next_token":
            target[:, 1:] &= att[:, :-1] == 1
            target[:, 0] = False
            scored = target[:, 1:]
        else:
            scored = target
        np.testing.assert_array_equal(batch.scored, scored)
        # Only rows with a scored position are sent; their spans are tight.
        np.testing.assert_array_equal(batch.rows, np.nonzero(scored.any(axis=1))[0])
        self.assertEqual(batch.tokens, int(np.sum(batch.ends - batch.starts)))
        want = direct(hidden, self.w, ids, scored, alignment)
        got = batch.scatter(packed_reference(batch, hidden, self.w, ids, alignment))
        self.assertEqual(got.shape, scored.shape)
        np.testing.assert_allclose(got, want["token_logprobs"], rtol=1e-12, atol=1e-12)
        if torch is not None:
            tb = PackedBatch(torch.from_numpy(att), torch.from_numpy(comp) if with_completion_mask else None,
                             alignment)
            packed = tb.pack(torch.from_numpy(hidden))
            self.assertIsInstance(packed, torch.Tensor)
            np.testing.assert_array_equal(packed.numpy(), batch.pack(hidden))
            back = tb.scatter(torch.from_numpy(packed_reference(batch, hidden, self.w, ids, alignment)))
            self.assertIsInstance(back, torch.Tensor)
            np.testing.assert_allclose(back.numpy(), want["token_logprobs"], rtol=1e-12, atol=1e-12)
        return batch

    def test_left_padded_prompt_right_padded_completion(self):
        batch = self.check_layout([6, 2, 4, 1], [5, 3, 1, 4])
        self.assertLess(batch.tokens, 4 * 11)  # prompt padding and prompt tokens are not sent
        np.testing.assert_array_equal(batch.starts, [5, 5, 5, 5])  # the last prompt token scores the first

    def test_right_padding_only(self):
        self.check_layout([6, 6, 6], [5, 2, 3])

    def test_empty_completions(self):
        batch = self.check_layout([3, 4, 2], [2, 0, 0])
        np.testing.assert_array_equal(batch.rows, [0])
        batch = PackedBatch(np.ones((2, 5)), np.zeros((2, 3)))
        self.assertEqual(batch.tokens, 0)
        self.assertEqual(batch.scatter(np.zeros(0, np.float32)).shape, (2, 4))
        self.assertFalse(batch.scatter(np.zeros(0, np.float32)).any())

    def test_without_completion_mask_and_same_position(self):
        self.check_layout([6, 2, 4], [5, 3, 0], with_completion_mask=False)
        self.check_layout([6, 2, 4], [5, 3, 1], alignment="same_position")

    def test_trailing_dims_scatter(self):
        ids, att, comp = trainer_batch(self.rng, [2, 3], [3, 1])
        batch = PackedBatch(att, comp)
        n = batch.tokens - len(batch.rows)
        topk = np.arange(n * 4, dtype=np.int64).reshape(n, 4)
        got = batch.scatter(topk)
        self.assertEqual(got.shape, (2, ids.shape[1] - 1, 4))
        self.assertEqual(got.dtype, np.int64)
        np.testing.assert_array_equal(got[batch.scored], topk)

    def test_refusals(self):
        with self.assertRaises(InvalidInputError) as cm:
            PackedBatch(np.array([[1, 0, 1, 1]]))
        self.assertIn("padding between real tokens", str(cm.exception))
        with self.assertRaises(InvalidInputError) as cm:
            PackedBatch(np.array([[0, 1, 1, 0]]), np.array([[1, 1]]))
        self.assertIn("attention_mask pads", str(cm.exception))
        with self.assertRaises(InvalidInputError):
            PackedBatch(np.ones((2, 3)), np.ones((3, 2)))
        with self.assertRaises(InvalidInputError):
            PackedBatch(np.ones((2, 3))).scatter(np.zeros(3))


class ScorePaddedTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.dir = temp_dir("py_batches")
        rng = np.random.default_rng(11)
        cls.w = (rng.standard_normal((V, H)) * 0.5).astype(np.float32)
        path = os.path.join(cls.dir, "head.safetensors")
        safetensors.save(path, {"lm_head.weight": cls.w})
        cls.server = Server(workers=2, extra=["--lm-head", path])
        cls.client = LogprobClient(cls.server.address, timeout=60)

    @classmethod
    def tearDownClass(cls):
        cls.client.close()
        cls.server.close()
        shutil.rmtree(cls.dir, ignore_errors=True)

    def test_trainer_batch_against_float64(self):
        rng = np.random.default_rng(12)
        ids, att, comp = trainer_batch(rng, [6, 2, 4, 3], [5, 3, 0, 2])
        hidden = rng.standard_normal((4, ids.shape[1], H)).astype(np.float32)
        got = score_padded(self.client, hidden_states=hidden, input_ids=ids, attention_mask=att,
                           completion_mask=comp, entropy=True, temperature=0.8)
        scored = PackedBatch(att, comp).scored
        want = direct(hidden, self.w, ids, scored, temperature=0.8)
        for name in ("token_logprobs", "entropy"):
            self.assertEqual(got[name].shape, scored.shape)
            self.assertEqual(within_spec(want[name], got[name]), "", name)
            self.assertFalse(got[name][~scored].any(), name)

    def test_torch_and_empty(self):
        if torch is None:
            self.skipTest("no torch")
        rng = np.random.default_rng(13)
        ids, att, comp = trainer_batch(rng, [1, 5], [4, 2])
        hidden = rng.standard_normal((2, ids.shape[1], H)).astype(np.float32)
        got = score_padded(self.client, hidden_states=torch.from_numpy(hidden), input_ids=torch.from_numpy(ids),
                           attention_mask=torch.from_numpy(att), completion_mask=torch.from_numpy(comp))
        self.assertIsInstance(got["token_logprobs"], torch.Tensor)
        want = direct(hidden, self.w, ids, PackedBatch(att, comp).scored)
        self.assertEqual(within_spec(want["token_logprobs"], got["token_logprobs"].numpy()), "")
        empty = score_padded(self.client, hidden_states=torch.from_numpy(hidden), input_ids=torch.from_numpy(ids),
                             attention_mask=torch.from_numpy(att), completion_mask=torch.zeros(2, 5), entropy=True)
        self.assertEqual(sorted(empty), ["entropy", "token_logprobs"])
        self.assertEqual(tuple(empty["token_logprobs"].shape), (2, ids.shape[1] - 1))
        self.assertFalse(empty["token_logprobs"].any())

    def test_left_padded_attention_mask_error_points_to_the_helper(self):
        rng = np.random.default_rng(14)
        ids, att, _ = trainer_batch(rng, [2, 6], [3, 5])
        hidden = rng.standard_normal((2, ids.shape[1], H)).astype(np.float32)
        with self.assertRaises(InvalidInputError) as cm:
            self.client.score(hidden_states=hidden, input_ids=ids, attention_mask=att)
        msg = str(cm.exception)
        self.assertIn("right-padded", msg)
        self.assertIn("PackedBatch", msg)
        self.assertNotIn("seq_lens", msg)


if __name__ == "__main__":
    unittest.main()
