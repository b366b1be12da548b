"""Sampling masks replayed (docs/SPEC.md "Sampling masks"): logprobs,
entropy, top-k and gathered logprobs renormalised over exactly the
sampler's kept ids, against a float64 log-softmax over the set, with 1 and
3 workers (vocabulary-parallel, logits and hidden states), alone and
batched (bitwise), split calls, and the refused masks."""

import os
import subprocess
import unittest

import numpy as np

import support  # noqa: F401  (puts client/python on sys.path)
from support import BIN_DIR, Server, temp_dir

import grpc
from logprob_client import InvalidInputError, LogprobError
from logprob_client import safetensors

V, H = 97, 16


def within_spec_message(expected, got):
    """"" when got is within the SPEC tolerance of expected (infinities
    equal), else the worst element."""
    e, g = np.asarray(expected, np.float64), np.asarray(got, np.float64)
    if e.shape != g.shape:
        return "shape %s, expected %s" % (list(g.shape), list(e.shape))
    inf = np.isinf(e)
    with np.errstate(invalid="ignore"):
        ok = np.where(inf, e == g, np.abs(g - e) <= 2e-4 + 2e-5 * np.abs(e))
    bad = np.flatnonzero(~ok)
    return "" if not len(bad) else "at %d: %r, expected %r" % (bad[0], g.flat[bad[0]], e.flat[bad[0]])


def masked_reference(x, targets, sets):
    """float64 (token logprob, entropy) per row of x [n, V] (already divided
    by the temperature) over each row's kept ids (None: the whole row)."""
    lp, ent = [], []
    for row, t, keep in zip(x, targets, sets):
        idx = np.arange(V) if keep is None else np.asarray(keep)
        xs = row[idx].astype(np.float64)
        m = xs.max()
        lse = m + np.log(np.exp(xs - m).sum())
        p = np.exp(xs - lse)
        ent.append(float(-(p * (xs - lse)).sum()))
        lp.append(float(row[t] - lse) if t in set(idx.tolist()) else -np.inf)
    return np.array(lp), np.array(ent)


def random_masks(rng, n, unmasked=()):
    """n random kept sets (ascending ids, sizes 1..40; None at `unmasked`) and their CSR."""
    sets, offsets, ids = [], [0], []
    for i in range(n):
        if i in unmasked:
            sets.append(None)
        else:
            keep = np.sort(rng.choice(V, size=int(rng.integers(1, 41)), replace=False))
            sets.append(keep)
            ids.extend(keep.tolist())
        offsets.append(len(ids))
    return sets, np.array(offsets, np.int64), np.array(ids, np.int32)


class MaskCase:
    """A packed logits batch whose targets mostly lie in their kept sets."""

    def __init__(self, seed, lens=(9, 14, 6, 11), temperature=1.0):
        rng = np.random.default_rng(seed)
        self.lens = list(lens)
        T = sum(lens)
        self.logits = (rng.standard_normal((T, V)) * 2).astype(np.float32)
        self.ids = rng.integers(0, V, size=T).astype(np.int64)
        self.cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
        self.rows = np.concatenate([np.arange(a, b - 1) for a, b in zip(self.cu[:-1], self.cu[1:])])
        self.targets = np.concatenate([self.ids[a + 1:b] for a, b in zip(self.cu[:-1], self.cu[1:])])
        n = len(self.rows)
        self.sets, self.offsets, self.mask_ids = random_masks(rng, n, unmasked={0, 5})
        # Most targets inside their set (as a sampler's would be); output 3 keeps its target out.
        for i, keep in enumerate(self.sets):
            if keep is not None and i != 3 and self.targets[i] not in keep:
                keep[0] = self.targets[i]
                self.sets[i] = np.sort(np.unique(keep))
        self.offsets = np.concatenate([[0], np.cumsum([0 if k is None else len(k) for k in self.sets])]).astype(
            np.int64)
        self.mask_ids = np.concatenate([k for k in self.sets if k is not None]).astype(np.int32)
        self.temperature = temperature

    def kwargs(self, **extra):
        kw = dict(logits=self.logits, input_ids=self.ids, cu_seqlens=self.cu,
                  sampling_mask=(self.offsets, self.mask_ids))
        if self.temperature != 1.0:
            kw["temperature"] = self.temperature
        kw.update(extra)
        return kw

    def reference(self):
        x = self.logits[self.rows].astype(np.float32) / np.float32(self.temperature)
        return masked_reference(x.astype(np.float64), self.targets, self.sets)


class SamplingMaskTest(unittest.TestCase):
    """One worker (token-parallel) and three workers (vocabulary-parallel, uneven slices of V = 97)."""

    @classmethod
    def setUpClass(cls):
        cls.one = Server(workers=1)
        cls.three = Server(workers=3, extra=["--parallelism", "vocab"])
        cls.clients = [cls.one.client(), cls.three.client()]

    @classmethod
    def tearDownClass(cls):
        for c in cls.clients:
            c.close()
        cls.one.close()
        cls.three.close()

    def test_logprobs_and_entropy_over_the_set(self):
        for temperature in (1.0, 0.7):
            case = MaskCase(1, temperature=temperature)
            want_lp, want_ent = case.reference()
            results = []
            for c in self.clients:
                res = c.score(entropy=True, topk=3, gather_indices=np.tile(np.arange(4), (len(case.rows), 1)),
                              **case.kwargs())
                results.append(res)
                self.assertEqual(within_spec_message(want_lp, res.token_logprobs), "")
                self.assertEqual(within_spec_message(want_ent, res.entropy), "")
                self.assertEqual(res.token_logprobs[3], -np.inf)  # its target is outside its set
                # Top-k and gathered logprobs follow the masked distribution: -inf outside the set.
                for i, keep in enumerate(case.sets):
                    if keep is None:
                        continue
                    self.assertTrue(set(res.topk_indices[i][: min(3, len(keep))].tolist()) <= set(keep.tolist()))
                    for j in range(4):
                        if j not in keep:
                            self.assertEqual(res.gathered_logprobs[i, j], -np.inf)
            # 1 and 3 workers agree within float32 rounding.
            np.testing.assert_allclose(results[0].token_logprobs, results[1].token_logprobs, rtol=1e-5, atol=1e-5)

    def test_unmasked_rows_equal_the_plain_scores(self):
        case = MaskCase(2)
        for c in self.clients:
            masked = c.score(**case.kwargs())
            plain = c.score(case.logits, case.ids, cu_seqlens=case.cu)
            for i in (0, 5):  # empty sets: no mask
                self.assertEqual(masked.token_logprobs[i], plain.token_logprobs[i])

    def test_bitwise_the_same_alone_and_batched(self):
        case = MaskCase(3, lens=(7, 12))
        other = MaskCase(4, lens=(10, 5, 8))
        for c in self.clients:
            alone = c.score(**case.kwargs())
            # The same sequences after others in one request: their rows share a batch with other rows.
            logits = np.concatenate([other.logits, case.logits])
            ids = np.concatenate([other.ids, case.ids])
            cu = np.concatenate([other.cu, case.cu[1:] + other.cu[-1]])
            offsets = np.concatenate([other.offsets, case.offsets[1:] + other.offsets[-1]])
            mask_ids = np.concatenate([other.mask_ids, case.mask_ids])
            both = c.score(logits, ids, cu_seqlens=cu, sampling_mask=(offsets, mask_ids))
            n_other = len(other.rows)
            np.testing.assert_array_equal(both.token_logprobs[n_other:], alone.token_logprobs)
            # And split into one request per few sequences by the client.
            with (self.one if c is self.clients[0] else self.three).client(max_tokens_per_request=16) as split_c:
                split = split_c.score(logits, ids, cu_seqlens=cu, sampling_mask=(offsets, mask_ids))
            self.assertGreater(split.num_parts, 1)
            np.testing.assert_array_equal(split.token_logprobs, both.token_logprobs)

    def test_padded_batches(self):
        rng = np.random.default_rng(5)
        B, S = 2, 6
        logits = rng.standard_normal((B, S, V)).astype(np.float32)
        ids = rng.integers(0, V, size=(B, S)).astype(np.int64)
        seq_lens = np.array([6, 4])
        n = B * (S - 1)
        sets, offsets, mask_ids = random_masks(rng, n, unmasked={3})
        targets = ids[:, 1:].reshape(-1)
        x = logits[:, :-1].reshape(n, V).astype(np.float64)
        want_lp, _ = masked_reference(x, targets, sets)
        scored = (np.arange(S - 1)[None, :] < (seq_lens - 1)[:, None]).reshape(-1)
        for c in self.clients:
            res = c.score(logits, ids, seq_lens=seq_lens, sampling_mask=(offsets, mask_ids))
            got = res.token_logprobs.reshape(-1)
            self.assertEqual(within_spec_message(want_lp[scored], got[scored]), "")
            self.assertTrue(np.all(got[~scored] == 0))

    def test_cli_contract(self):
        # logprob-client score --sampling-mask NAME reads NAME_offsets / NAME_ids: whole and split into parts,
        # the same outputs as the Python client's.
        case = MaskCase(8, lens=(12, 9, 14, 6))
        want = self.clients[1].score(entropy=True, **case.kwargs())
        d = temp_dir("mask_cli")
        inp = os.path.join(d, "in.safetensors")
        safetensors.save(inp, {"logits": case.logits, "input_ids": case.ids, "cu_seqlens": case.cu,
                               "vllm_mask_offsets": case.offsets, "vllm_mask_ids": case.mask_ids})
        cli = os.path.join(BIN_DIR, "logprob-client")
        for extra in ([], ["--max-request-bytes", "12000"]):
            out = os.path.join(d, "out%d.safetensors" % len(extra))
            r = subprocess.run([cli, "score", "--server", self.three.address, "--input", inp, "--output", out,
                                "--entropy", "--sampling-mask", "vllm_mask"] + extra,
                               capture_output=True, text=True, timeout=120)
            self.assertEqual(r.returncode, 0, r.stderr)
            if extra:
                self.assertIn("scored part 2/", r.stderr)
            got, _ = safetensors.load(out)
            np.testing.assert_array_equal(got["token_logprobs"], want.token_logprobs)
            np.testing.assert_array_equal(got["entropy"], want.entropy)
        r = subprocess.run([cli, "score", "--server", self.three.address, "--input", inp, "--output",
                            os.path.join(d, "bad.safetensors"), "--sampling-mask", "nope"],
                           capture_output=True, text=True, timeout=120)
        self.assertEqual(r.returncode, 2, r.stderr)
        self.assertIn("--sampling-mask: input has no tensor 'nope_offsets'", r.stderr)

    def test_bad_masks(self):
        case = MaskCase(6)
        n = len(case.rows)
        good_off, good_ids = case.offsets, case.mask_ids
        unsorted = good_ids.copy()
        a = int(good_off[1])  # output 1's set starts here
        unsorted[a], unsorted[a + 1] = good_ids[a + 1], good_ids[a]
        dup = good_ids.copy()
        dup[a + 1] = dup[a]
        outside = good_ids.copy()
        outside[a] = V
        cases = [
            ((good_off, unsorted), {}, "are not strictly ascending"),
            ((good_off, dup), {}, "are not strictly ascending"),
            ((good_off, outside), {}, "id 97 of sequence 0 at position 1 (entry 0) is outside [0, V = 97)"),
            ((good_off[:-1], good_ids), {}, "\"sampling_mask_offsets\": shape [%d] does not match" % n),
            ((good_off, good_ids[:-1]), {}, "offsets must start at 0, not decrease and end at nnz = %d"
             % (len(good_ids) - 1)),
            ((good_off, np.append(good_ids, 3)), {}, "\"sampling_mask_offsets\" ends at %d but \"sampling_mask_ids\" has %d ids"
             % (len(good_ids), len(good_ids) + 1)),
            ((good_off, good_ids), {"is_top1": True}, "not defined with a sampling mask"),
        ]
        for mask, extra, message in cases:
            with self.subTest(message=message):
                with self.assertRaises(LogprobError) as cm:
                    self.clients[1].score(split=False, **case.kwargs(sampling_mask=mask, **extra))
                self.assertEqual(cm.exception.code, grpc.StatusCode.INVALID_ARGUMENT)
                self.assertIn(message, cm.exception.message)
        with self.assertRaises(InvalidInputError):
            self.clients[0].score(**case.kwargs(sampling_top_k=5))


class HiddenStatesMaskTest(unittest.TestCase):
    """Hidden states times a float32 head on three workers: the rounds bring the logits to the host and the
    masks apply there."""

    @classmethod
    def setUpClass(cls):
        rng = np.random.default_rng(9)
        cls.weight = (rng.standard_normal((V, H)) * 0.5).astype(np.float32)
        d = temp_dir("mask_head")
        path = os.path.join(d, "head.safetensors")
        safetensors.save(path, {"lm_head.weight": cls.weight})
        cls.server = Server(workers=3, extra=["--lm-head", path])
        cls.client = cls.server.client()

    @classmethod
    def tearDownClass(cls):
        cls.client.close()
        cls.server.close()

    def test_hidden_states_over_the_set(self):
        rng = np.random.default_rng(10)
        lens = [8, 13]
        T = sum(lens)
        hidden = rng.standard_normal((T, H)).astype(np.float32)
        ids = rng.integers(0, V, size=T).astype(np.int64)
        cu = np.array([0, 8, 21], np.int64)
        rows = np.concatenate([np.arange(0, 7), np.arange(8, 20)])
        targets = np.concatenate([ids[1:8], ids[9:21]])
        sets, offsets, mask_ids = random_masks(rng, len(rows), unmasked={2})
        x = hidden[rows].astype(np.float64) @ self.weight.astype(np.float64).T
        want_lp, want_ent = masked_reference(x, targets, sets)
        res = self.client.score(hidden_states=hidden, input_ids=ids, cu_seqlens=cu, entropy=True,
                                sampling_mask=(offsets, mask_ids))
        self.assertEqual(within_spec_message(want_lp, res.token_logprobs), "")
        self.assertEqual(within_spec_message(want_ent, res.entropy), "")


if __name__ == "__main__":
    unittest.main()
