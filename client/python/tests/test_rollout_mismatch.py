"""Rollout logprobs in, mismatch out (docs/SPEC.md "Rollout mismatch"):
the per-token log-ratios and truncated weights, the per-sequence and
per-request estimators, against numpy float64 on random and adversarial
inputs (rollout logprobs of 0 and -inf, NaN prompt positions, ignored and
filtered targets, one-token sequences), split and unsplit calls, and the
errors."""

import asyncio
import os
import shutil
import subprocess
import unittest

import numpy as np

import support  # noqa: F401  (puts client/python on sys.path)
from support import BIN_DIR, Server, temp_dir
import reference
from reference import mismatch_reference

import grpc
from logprob_client import LogprobError, aio
from logprob_client import safetensors

V = 61


class RolloutMismatchTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.server = Server(workers=2, metrics=True)
        cls.client = cls.server.client()

    @classmethod
    def tearDownClass(cls):
        cls.client.close()
        cls.server.close()

    def assertClose(self, want, got, what, rtol=1e-6):
        want, got = np.asarray(want, dtype=np.float64), np.asarray(got, dtype=np.float64)
        self.assertEqual(want.shape, got.shape, what)
        with np.errstate(invalid="ignore"):
            same = (np.isnan(want) & np.isnan(got)) | (want == got) | (np.abs(want - got) <= rtol * np.abs(want) + 1e-7)
        self.assertTrue(np.all(same), "%s: want %s got %s" % (what, want[~same][:5], got[~same][:5]))

    def packed_case(self, rng, lens):
        T = int(sum(lens))
        logits = (rng.standard_normal((T, V)) * 3).astype(np.float32)
        ids = rng.integers(0, V, size=T).astype(np.int64)
        cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
        return logits, ids, cu

    def check(self, res, rollout, compared, seq_out, cap=3.0, low=0.9, high=1.1):
        l, ratio, seqs, req = mismatch_reference(res.token_logprobs, rollout, compared, seq_out, cap, low, high)
        self.assertClose(l, res.rollout_log_ratio, "rollout_log_ratio")
        self.assertClose(ratio, res.rollout_ratio, "rollout_ratio")
        out = res.outputs
        np.testing.assert_array_equal(out["rollout_seq_tokens"], [s["tokens"] for s in seqs])
        for name, key in (("rollout_seq_mean_abs_log_ratio", "mean_abs_log_ratio"), ("rollout_seq_k1", "k1"),
                          ("rollout_seq_k3", "k3"), ("rollout_seq_outside_band", "outside_band_fraction"),
                          ("rollout_seq_ratio", "ratio"), ("rollout_seq_geo_ratio", "geo")):
            self.assertEqual(out[name].dtype, np.float32, name)
            self.assertClose([s[key] for s in seqs], out[name], name, rtol=1e-5)
        got = res.rollout_mismatch
        self.assertEqual(got["tokens"], req["tokens"])
        for key in ("mean_abs_log_ratio", "k1", "k3", "outside_band_fraction"):
            self.assertClose(req[key], got[key], key, rtol=1e-9)
        return l

    def test_random_packed_against_float64(self):
        rng = np.random.default_rng(5)
        lens = [1, 2, 9, 17, 30]  # a one-token sequence has no output (next_token)
        logits, ids, cu = self.packed_case(rng, lens)
        res0 = self.client.score(logits, ids, cu_seqlens=cu)
        # The rollout: the same model's logprobs from bf16-rounded logits, NaN on the first 3 outputs of each
        # sequence (the prompt), and a few exact copies (l = 0).
        bf16 = (logits.view(np.uint32) & 0xFFFF0000).view(np.float32)
        rows = np.concatenate([np.arange(a, b - 1) for a, b in zip(cu[:-1], cu[1:])])
        targets = np.concatenate([ids[a + 1:b] for a, b in zip(cu[:-1], cu[1:])])
        rollout = np.array([reference.scored_logprobs(bf16[r])[t] for r, t in zip(rows, targets)], np.float32)
        seq_out = np.concatenate([[0], np.cumsum(np.maximum(np.array(lens) - 1, 0))])
        for a in seq_out[:-1]:
            rollout[a:a + 3] = np.nan
        rollout[-2:] = res0.token_logprobs[-2:]
        res = self.client.score(logits, ids, cu_seqlens=cu, rollout_logprobs=rollout)
        np.testing.assert_array_equal(res.token_logprobs, res0.token_logprobs)  # the scoring is unchanged
        l = self.check(res, rollout, np.ones(len(rollout), bool), seq_out)
        self.assertTrue(np.all(l[-2:] == 0))
        self.assertGreater(res.rollout_mismatch["tokens"], 20)
        self.assertGreater(res.rollout_mismatch["k3"], 0)
        # Another cap and band.
        res = self.client.score(logits, ids, cu_seqlens=cu, rollout_logprobs=rollout, rollout_ratio_cap=1.01,
                                rollout_band=(0.99, 1.001))
        self.check(res, rollout, np.ones(len(rollout), bool), seq_out, 1.01, 0.99, 1.001)
        self.assertTrue(np.nanmax(res.rollout_ratio) <= np.float32(1.01))

    def test_adversarial_values(self):
        rng = np.random.default_rng(7)
        lens = [12, 1, 2, 16]
        logits, ids, cu = self.packed_case(rng, lens)
        ids[3] = -100  # ignore_index: output 2 of sequence 0 is not compared
        res0 = self.client.score(logits, ids, cu_seqlens=cu, sampling_top_k=20)
        lp = res0.token_logprobs
        n = len(lp)
        rollout = lp.copy()
        kept = [i for i in np.flatnonzero(np.isfinite(lp)) if i not in (2, 3)]
        filtered = [i for i in np.flatnonzero(np.isneginf(lp)) if i not in (2, 3)]
        self.assertGreater(len(kept), 1)
        self.assertGreater(len(filtered), 1)
        sure, unsampled = kept[0], kept[1]
        rollout[sure] = 0.0              # the rollout was sure: l = logp <= 0
        rollout[unsampled] = -np.inf     # the rollout could not sample it: l = +inf, r capped
        rollout[2] = -1.0                # ignored target: not compared
        rollout[3] = np.nan              # none
        rollout[filtered[0]] = -np.inf   # both -inf: not compared
        rollout[filtered[1]] = -0.5      # the service filtered it out: l = -inf, r = 0
        res = self.client.score(logits, ids, cu_seqlens=cu, sampling_top_k=20, rollout_logprobs=rollout)
        compared = np.ones(n, bool)
        compared[2] = False
        seq_out = np.concatenate([[0], np.cumsum(np.array(lens) - 1)])
        l = self.check(res, rollout, compared, seq_out)
        self.assertEqual(l[unsampled], np.inf)
        self.assertEqual(l[sure], lp[sure])
        self.assertEqual(l[filtered[1]], -np.inf)
        self.assertTrue(np.isnan(res.rollout_log_ratio[2]) and np.isnan(res.rollout_log_ratio[3]), res.rollout_log_ratio[:5])
        self.assertTrue(np.isnan(res.rollout_log_ratio[filtered[0]]))
        self.assertEqual(res.rollout_ratio[unsampled], np.float32(3.0))
        self.assertEqual(res.rollout_ratio[filtered[1]], 0.0)
        self.assertEqual(res.outputs["rollout_seq_tokens"][1], 0)  # the one-token sequence
        self.assertTrue(np.isnan(res.outputs["rollout_seq_k1"][1]))
        self.assertEqual(res.rollout_mismatch["k3"], np.inf)

    def test_padded_with_seq_lens(self):
        rng = np.random.default_rng(11)
        B, S = 3, 7
        logits = rng.standard_normal((B, S, V)).astype(np.float32)
        ids = rng.integers(0, V, size=(B, S)).astype(np.int64)
        seq_lens = np.array([7, 1, 4], np.int64)
        res0 = self.client.score(logits, ids, seq_lens=seq_lens)
        rollout = (res0.token_logprobs + rng.normal(0, 0.05, size=(B, S - 1))).astype(np.float32)
        rollout = np.minimum(rollout, 0)
        rollout[1, 3] = 5.0  # past seq_lens: never read
        res = self.client.score(logits, ids, seq_lens=seq_lens, rollout_logprobs=rollout)
        compared = (np.arange(S - 1)[None, :] < (seq_lens - 1)[:, None]).reshape(-1)
        seq_out = np.arange(B + 1) * (S - 1)
        self.assertEqual(res.rollout_log_ratio.shape, (B, S - 1))
        l, ratio, seqs, req = mismatch_reference(res.token_logprobs.reshape(-1), rollout.reshape(-1), compared,
                                                 seq_out, 3.0, 0.9, 1.1)
        self.assertClose(l.reshape(B, S - 1), res.rollout_log_ratio, "rollout_log_ratio")
        np.testing.assert_array_equal(res.outputs["rollout_seq_tokens"], [6, 0, 3])
        self.assertClose([s["k3"] for s in seqs], res.outputs["rollout_seq_k3"], "k3", rtol=1e-5)
        self.assertClose(req["k1"], res.rollout_mismatch["k1"], "k1", rtol=1e-9)

    def test_split_call_joins_like_one_request(self):
        rng = np.random.default_rng(13)
        lens = [10, 4, 12, 7, 9]
        logits, ids, cu = self.packed_case(rng, lens)
        res0 = self.client.score(logits, ids, cu_seqlens=cu)
        rollout = np.minimum(res0.token_logprobs + rng.normal(0, 0.2, size=res0.token_logprobs.shape), 0)
        whole = self.client.score(logits, ids, cu_seqlens=cu, rollout_logprobs=rollout)
        with self.server.client(max_tokens_per_request=16) as c:
            split = c.score(logits, ids, cu_seqlens=cu, rollout_logprobs=rollout)
        self.assertGreater(split.num_parts, 2)
        for name in whole.outputs:
            np.testing.assert_array_equal(whole.outputs[name], split.outputs[name], name)
        self.assertEqual(whole.rollout_mismatch["tokens"], split.rollout_mismatch["tokens"])
        for key in ("mean_abs_log_ratio", "k1", "k3", "outside_band_fraction"):
            self.assertClose(whole.rollout_mismatch[key], split.rollout_mismatch[key], key, rtol=1e-12)

    def test_every_transport_carries_the_request_figures(self):
        # Unary (its own wire decoder), chunked (protobuf messages), ScoreStream and the asyncio client.
        rng = np.random.default_rng(19)
        logits, ids, cu = self.packed_case(rng, [8, 11])
        lp = self.client.score(logits, ids, cu_seqlens=cu).token_logprobs
        kw = dict(logits=logits, input_ids=ids, cu_seqlens=cu, rollout_logprobs=np.minimum(lp + 0.1, 0))
        want = self.client.score(**kw)
        self.assertEqual(want.rollout_mismatch["tokens"], 17)
        with self.server.client(shared_memory=False) as c:
            c.chunk_above = 0
            c.piece_bytes = 1000
            got = [c.score(**kw)]
        got += list(self.client.score_stream([kw]))

        async def run():
            async with aio.LogprobClient(self.server.address) as c:
                return await c.score(**kw)

        got.append(asyncio.run(run()))
        for res in got:
            self.assertEqual(res.rollout_mismatch, want.rollout_mismatch)
            np.testing.assert_array_equal(res.rollout_log_ratio, want.rollout_log_ratio)

    def metrics_now(self):
        m = self.server
        buckets = {float(labels["le"]): v for labels, v in m.samples("logprob_rollout_log_ratio_bucket")
                   if labels.get("head") == ""}
        return dict(buckets=buckets,
                    count=m.metric("logprob_rollout_log_ratio_count", head=""),
                    sum=m.metric("logprob_rollout_log_ratio_sum", head=""),
                    k3_count=m.metric("logprob_rollout_request_k3_count", head=""),
                    k3_sum=m.metric("logprob_rollout_request_k3_sum", head=""),
                    tokens=m.metric("logprob_rollout_tokens_total", head=""),
                    outside=m.metric("logprob_rollout_outside_band_tokens_total", head=""),
                    infinite=m.metric("logprob_rollout_infinite_log_ratios_total", head=""))

    def test_metrics_count_every_compared_token(self):
        # The calls return after the server recorded them: no waiting. (Logits requests: head="".)
        rng = np.random.default_rng(23)
        logits, ids, cu = self.packed_case(rng, [15, 20])
        lp = self.client.score(logits, ids, cu_seqlens=cu).token_logprobs
        rollout = np.minimum(lp + rng.normal(0, 0.3, size=lp.shape), 0).astype(np.float32)
        rollout[:4] = np.nan
        with_inf = rollout.copy()
        with_inf[5] = -np.inf
        before = self.metrics_now()
        finite_res = self.client.score(logits, ids, cu_seqlens=cu, rollout_logprobs=rollout)
        inf_res = self.client.score(logits, ids, cu_seqlens=cu, rollout_logprobs=with_inf)
        after = self.metrics_now()
        ls = np.concatenate([finite_res.rollout_log_ratio, inf_res.rollout_log_ratio]).astype(np.float64)
        ls = ls[~np.isnan(ls)]
        finite = ls[np.isfinite(ls)]
        self.assertEqual(len(ls), 2 * (len(lp) - 4))
        self.assertEqual(after["count"] - before["count"], len(finite))
        self.assertAlmostEqual(after["sum"] - before["sum"], float(finite.sum()), places=4)
        self.assertEqual(after["infinite"] - before["infinite"], 1)
        self.assertEqual(after["tokens"] - before["tokens"], len(ls))
        outside = sum(r.rollout_mismatch["outside_band_fraction"] * r.rollout_mismatch["tokens"]
                      for r in (finite_res, inf_res))
        self.assertEqual(after["outside"] - before["outside"], round(outside))
        self.assertGreater(round(outside), 0)
        self.assertEqual(len(after["buckets"]), 20)  # 19 bounds and +Inf
        for le, v in after["buckets"].items():
            self.assertEqual(v - before["buckets"].get(le, 0), int(np.sum(finite <= le)), "le=%g" % le)
        # k3: the finite request only.
        self.assertEqual(after["k3_count"] - before["k3_count"], 1)
        self.assertAlmostEqual(after["k3_sum"] - before["k3_sum"], finite_res.rollout_mismatch["k3"], places=9)
        promtool = shutil.which("promtool")
        if promtool is None:
            self.skipTest("promtool not installed (Debian package prometheus)")
        lint = subprocess.run([promtool, "check", "metrics"], input=self.server.metrics(), capture_output=True,
                              text=True)
        self.assertEqual(lint.returncode, 0, lint.stdout + lint.stderr)
        self.assertNotIn("rollout", lint.stdout + lint.stderr)

    def test_cli_contract(self):
        # logprob-client score --rollout-logprobs NAME: the outputs as the Python client's, the request's
        # figures in OUT's metadata, whole and split into parts.
        rng = np.random.default_rng(29)
        logits, ids, cu = self.packed_case(rng, [12, 9, 14, 6])
        lp = self.client.score(logits, ids, cu_seqlens=cu).token_logprobs
        rollout = np.minimum(lp + rng.normal(0, 0.2, size=lp.shape), 0).astype(np.float32)
        rollout[0] = np.nan
        want = self.client.score(logits, ids, cu_seqlens=cu, rollout_logprobs=rollout, rollout_ratio_cap=1.5,
                                 rollout_band=(0.8, 1.25))
        d = temp_dir("rollout_cli")
        inp = os.path.join(d, "in.safetensors")
        safetensors.save(inp, {"logits": logits, "input_ids": ids, "cu_seqlens": cu, "vllm_logprobs": rollout})
        cli = os.path.join(BIN_DIR, "logprob-client")
        for extra in ([], ["--max-request-bytes", "6000"]):
            out = os.path.join(d, "out%d.safetensors" % len(extra))
            r = subprocess.run([cli, "score", "--server", self.server.address, "--input", inp, "--output", out,
                                "--rollout-logprobs", "vllm_logprobs", "--rollout-ratio-cap", "1.5",
                                "--rollout-band", "0.8,1.25"] + extra, capture_output=True, text=True, timeout=120)
            self.assertEqual(r.returncode, 0, r.stderr)
            if extra:
                self.assertIn("scored part 2/", r.stderr)
            self.assertIn("rollout mismatch: %d tokens compared" % want.rollout_mismatch["tokens"], r.stdout)
            got, meta = safetensors.load(out)
            for name in want.outputs:
                np.testing.assert_array_equal(got[name], want.outputs[name], name)
            self.assertEqual(int(meta["rollout_tokens"]), want.rollout_mismatch["tokens"])
            for key in ("mean_abs_log_ratio", "k1", "k3", "outside_band_fraction"):
                self.assertClose(want.rollout_mismatch[key], float(meta["rollout_" + key]), key, rtol=1e-5)
        for args, message in ((["--rollout-logprobs", "nope"], "input has no tensor 'nope'"),
                              (["--rollout-logprobs", "input_ids"], "'input_ids' is I64; store it as F32"),
                              (["--rollout-logprobs", "vllm_logprobs", "--rollout-band", "1.2,0.9"], "LOW,HIGH")):
            r = subprocess.run([cli, "score", "--server", self.server.address, "--input", inp, "--output",
                                os.path.join(d, "bad.safetensors")] + args, capture_output=True, text=True, timeout=120)
            self.assertEqual(r.returncode, 2, r.stderr)
            self.assertIn(message, r.stderr)

    def test_without_rollout_nothing_is_added(self):
        rng = np.random.default_rng(3)
        logits, ids, cu = self.packed_case(rng, [5, 6])
        res = self.client.score(logits, ids, cu_seqlens=cu)
        self.assertIsNone(res.rollout_mismatch)
        self.assertFalse(any(name.startswith("rollout_") for name in res.outputs))

    def test_bad_input(self):
        rng = np.random.default_rng(17)
        logits, ids, cu = self.packed_case(rng, [5, 6])
        good = np.full(9, -1.0, np.float32)
        cases = [
            (dict(rollout_logprobs=np.where(np.arange(9) == 6, 0.25, good).astype(np.float32)),
             "value 0.25 of sequence 1 at position 2 is not a log-probability"),
            (dict(rollout_logprobs=np.where(np.arange(9) == 0, np.inf, good).astype(np.float32)),
             "value inf of sequence 0 at position 0"),
            (dict(rollout_logprobs=good[:8]), "\"rollout_logprobs\": shape [8] does not match the output shape [9]"),
            (dict(rollout_logprobs=good, rollout_ratio_cap=0.0), "options.rollout_ratio_cap must be > 0"),
            (dict(rollout_logprobs=good, rollout_band=(1.1, 0.9)), "rollout_band_low / rollout_band_high"),
            (dict(rollout_logprobs=good, rollout_band=(-0.1, 2)), "rollout_band_low / rollout_band_high"),
        ]
        for kw, message in cases:
            with self.assertRaises(LogprobError) as cm:
                self.client.score(logits, ids, cu_seqlens=cu, split=False, **kw)
            self.assertEqual(cm.exception.code, grpc.StatusCode.INVALID_ARGUMENT, kw)
            self.assertIn(message, cm.exception.message)


if __name__ == "__main__":
    unittest.main()
