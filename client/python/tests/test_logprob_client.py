"""Tests of the Python client (client/python/logprob_client) against live
logprob-server processes. Each TestCase class starts its own servers on
free ports (ctest runs one class per test, in parallel)."""

import os
import shutil
import sys
import subprocess
import threading
import time
import unittest
import warnings

import numpy as np

import support  # noqa: F401  (puts client/python on sys.path)
from support import LOGITS_CASES, Golden, Server, compare, temp_dir
import reference

import grpc
from logprob_client import (
    InvalidInputError,
    LogprobClient,
    LogprobError,
    RetryPolicy,
    bf16_bits_to_float32,
    float32_to_bf16_bits,
    split_sequences,
)

LM_HEAD = os.path.join(support.GOLDEN_DIR, "hidden_bf16.lm_head.safetensors")


def _has(module):
    try:
        __import__(module)
        return True
    except ImportError:
        return False


def packed_from_padded(g):
    """basic_f32 as a packed batch: [B*S, V], cu_seqlens, gather rows [B*(S-1), K]."""
    logits, ids = g.inputs["logits"], g.inputs["input_ids"]
    B, S, V = logits.shape
    kw = dict(g.options)
    kw.update(
        logits=logits.reshape(B * S, V),
        input_ids=ids.reshape(B * S),
        cu_seqlens=np.arange(0, B * S + 1, S, dtype=np.int32),
        gather_indices=g.inputs["gather_indices"].reshape(B * (S - 1), -1),
    )
    expected = {k: v.reshape((B * (S - 1),) + v.shape[2:]) for k, v in g.expected.items()}
    return kw, expected


class GoldenTest(unittest.TestCase):
    """Every golden case, padded and packed, logits and hidden states, in
    every input dtype path, within the SPEC tolerance."""

    @classmethod
    def setUpClass(cls):
        cls.server = Server(workers=2, extra=["--lm-head", LM_HEAD])
        cls.addClassCleanup(cls.server.close)
        cls.client = cls.server.client()
        cls.addClassCleanup(cls.client.close)

    def test_server_info(self):
        info = self.client.server_info()
        self.assertEqual(info.workers, 2)
        self.assertEqual(info.backend, "cpu")
        self.assertEqual((info.vocab_size, info.hidden_size), (8192, 256))
        self.assertGreater(info.max_request_bytes, 0)
        self.assertTrue(self.client.health())
        # The golden head has no logit transform: no bias, multiplier 1, no softcap.
        (head,) = self.client.lm_heads()
        self.assertEqual((head.has_bias, head.logit_scale, head.final_logit_softcapping), (False, 1.0, 0.0))

    def test_logits_golden_cases(self):
        for name in LOGITS_CASES:
            with self.subTest(case=name):
                g = Golden(name)
                res = self.client.score(**g.score_kwargs())
                self.assertEqual(compare(g.expected, res.outputs), "")
                self.assertEqual(res.num_parts, 1)
                self.assertEqual(res.attempts, 1)
                self.assertEqual(res.token_logprobs.dtype, np.float32)
                if "topk_indices" in g.expected:
                    self.assertEqual(res.topk_indices.dtype, np.int64)
                    np.testing.assert_array_equal(res.topk_indices, g.expected["topk_indices"])

    def test_hidden_states_golden(self):
        g = Golden("hidden_bf16")
        res = self.client.score(**g.score_kwargs())
        self.assertEqual(list(res.token_logprobs.shape), [2, 31])
        self.assertEqual(compare(g.expected, res.outputs), "")

    def test_packed_output_layout(self):
        g = Golden("packed_bf16")
        res = self.client.score(**g.score_kwargs())
        cu = g.inputs["cu_seqlens"]
        self.assertEqual(res.token_logprobs.shape, (128 - 4,))
        seqs = split_sequences(res.token_logprobs, cu)
        self.assertEqual([len(s) for s in seqs], [int(l) - 1 for l in np.diff(cu)])
        # Sequence i starts at cu_seqlens[i] - i.
        for i, s in enumerate(seqs):
            np.testing.assert_array_equal(s, res.token_logprobs[cu[i] - i:cu[i] - i + len(s)])

    def test_packed_as_padded_with_seq_lens_and_attention_mask(self):
        g = Golden("packed_bf16")
        logits, ids, cu = g.inputs["logits"], g.inputs["input_ids"], g.inputs["cu_seqlens"]
        lens = np.diff(cu)
        B, S, V = len(lens), int(lens.max()), logits.shape[1]
        padded = np.zeros((B, S, V), dtype=np.uint16)
        pids = np.zeros((B, S), dtype=np.int64)
        for i in range(B):
            padded[i, :lens[i]] = logits[cu[i]:cu[i + 1]]
            pids[i, :lens[i]] = ids[cu[i]:cu[i + 1]]
        mask = (np.arange(S)[None, :] < lens[:, None]).astype(np.int64)
        for kw in ({"seq_lens": lens}, {"attention_mask": mask}):
            with self.subTest(**{k: "given" for k in kw}):
                res = self.client.score(logits=padded, input_ids=pids, dtype="bf16", **kw)
                self.assertEqual(res.token_logprobs.shape, (B, S - 1))
                expected = split_sequences(g.expected["token_logprobs"], cu)
                for i in range(B):
                    got = res.token_logprobs[i]
                    self.assertEqual(compare({"t": expected[i]}, {"t": got[:lens[i] - 1]}), "")
                    np.testing.assert_array_equal(got[lens[i] - 1:], 0)  # past seq_lens: 0
        left_padded = mask[:, ::-1].copy()
        with self.assertRaises(InvalidInputError) as cm:
            self.client.score(logits=padded, input_ids=pids, dtype="bf16", attention_mask=left_padded)
        self.assertIn("right-padded", str(cm.exception))

    def test_bf16_as_float32_and_ml_dtypes_and_torch(self):
        g = Golden("packed_bf16")
        kw = g.score_kwargs()
        bits = kw.pop("logits")
        kw.pop("dtype")
        as_f32 = bf16_bits_to_float32(bits)
        # float32 holding the bf16 values exactly: same expected values.
        res = self.client.score(logits=as_f32, **kw)
        self.assertEqual(compare(g.expected, res.outputs), "")
        # float32 rounded to bf16 by the client gives back the same bits.
        np.testing.assert_array_equal(float32_to_bf16_bits(as_f32), bits)
        res = self.client.score(logits=as_f32, dtype="bf16", **kw)
        self.assertEqual(compare(g.expected, res.outputs), "")
        with self.assertRaises(TypeError):
            self.client.score(logits=bits, **kw)  # uint16 without dtype="bf16"
        if _has("ml_dtypes"):
            import ml_dtypes

            res = self.client.score(logits=bits.view(ml_dtypes.bfloat16), **kw)
            self.assertEqual(compare(g.expected, res.outputs), "")
        if _has("torch"):
            import torch

            t = torch.from_numpy(as_f32).to(torch.bfloat16).requires_grad_(False)
            tkw = {k: torch.from_numpy(np.asarray(v)) if k in ("input_ids", "cu_seqlens") else v for k, v in kw.items()}
            res = self.client.score(logits=t, **tkw)
            self.assertIsInstance(res.token_logprobs, torch.Tensor)  # torch in, torch out
            self.assertEqual(compare(g.expected, support.as_numpy_outputs(res.outputs)), "")

    def test_f16_golden_as_float32(self):
        g = Golden("odd_vocab_f16")
        kw = g.score_kwargs()
        kw["logits"] = kw["logits"].astype(np.float32)
        res = self.client.score(**kw)
        self.assertEqual(compare(g.expected, res.outputs), "")

    def test_packed_basic_with_gather(self):
        kw, expected = packed_from_padded(Golden("basic_f32"))
        res = self.client.score(**kw)
        self.assertEqual(compare(expected, res.outputs), "")


class SplitTest(unittest.TestCase):
    """Batches over the server's --max-request-bytes / --max-tokens-per-request
    (or the client's own limits) go as several requests and come back joined."""

    MAX_BYTES = 600000
    MAX_TOKENS = 100

    @classmethod
    def setUpClass(cls):
        cls.server = Server(
            workers=1,
            extra=["--max-request-bytes", str(cls.MAX_BYTES), "--max-tokens-per-request", str(cls.MAX_TOKENS)],
        )
        cls.addClassCleanup(cls.server.close)
        cls.client = cls.server.client()
        cls.addClassCleanup(cls.client.close)

    def test_limits_from_server_info(self):
        info = self.client.server_info()
        self.assertEqual(info.max_request_bytes, self.MAX_BYTES)
        self.assertEqual(info.max_tokens_per_request, self.MAX_TOKENS)

    def test_padded_split_by_tokens(self):
        g = Golden("basic_f32")  # [4, 64, 1000] f32: 1 MB, 256 tokens
        res = self.client.score(**g.score_kwargs())
        self.assertEqual(res.num_parts, 4)  # 2 sequences would be 128 tokens > 100
        self.assertEqual(compare(g.expected, res.outputs), "")

    def test_packed_split_by_bytes(self):
        g = Golden("packed_bf16")  # sequences of 24, 48, 16, 40 rows of 8 KiB
        res = self.client.score(**g.score_kwargs())
        self.assertEqual(res.num_parts, 3)  # [24], [48, 16], [40] under 540000 bytes
        self.assertEqual(compare(g.expected, res.outputs), "")

    def test_packed_split_with_gather(self):
        kw, expected = packed_from_padded(Golden("basic_f32"))
        res = self.client.score(**kw)
        self.assertEqual(res.num_parts, 4)
        self.assertEqual(compare(expected, res.outputs), "")

    def test_client_side_limits(self):
        g = Golden("packed_bf16")
        with self.server.client(max_tokens_per_request=50) as c:
            res = c.score(**g.score_kwargs())
        self.assertEqual(res.num_parts, 4)  # 24+48 > 50, 16+40 > 50
        self.assertEqual(compare(g.expected, res.outputs), "")
        with self.server.client(max_request_bytes=150000) as c:
            g = Golden("sampling_f32")  # [2, 40, 2048] f32: 327680 bytes a sequence
            with self.assertRaises(InvalidInputError) as cm:
                c.score(**g.score_kwargs())
            self.assertIn("sequence 0 alone needs", str(cm.exception))
            self.assertEqual(cm.exception.code, grpc.StatusCode.INVALID_ARGUMENT)
        with self.server.client(max_request_bytes=400000) as c:
            res = c.score(**g.score_kwargs())
            self.assertEqual(res.num_parts, 2)
            self.assertEqual(compare(g.expected, res.outputs), "")

    def test_too_large_sequence_and_unsplit_request(self):
        g = Golden("llama_vocab_bf16")  # 6 MB a sequence
        with self.assertRaises(InvalidInputError) as cm:
            self.client.score(**g.score_kwargs())
        self.assertIn("sequence 0 alone needs", cm.exception.message)
        # Not split: the server refuses the message, and it is not retried.
        g = Golden("basic_f32")
        with self.assertRaises(LogprobError) as cm:
            self.client.score(split=False, **g.score_kwargs())
        self.assertEqual(cm.exception.code, grpc.StatusCode.RESOURCE_EXHAUSTED)
        self.assertEqual(cm.exception.attempts, 1)


class OptionsTest(unittest.TestCase):
    """Every option against a float64 numpy reference on random logits."""

    @classmethod
    def setUpClass(cls):
        cls.server = Server(workers=2)
        cls.addClassCleanup(cls.server.close)
        cls.client = cls.server.client()
        cls.addClassCleanup(cls.client.close)
        rng = np.random.default_rng(7)
        cls.B, cls.S, cls.V = 3, 12, 257
        cls.logits = (rng.standard_normal((cls.B, cls.S, cls.V)) * 3).astype(np.float32)
        cls.ids = rng.integers(0, cls.V, size=(cls.B, cls.S)).astype(np.int64)
        cls.ids[0, 5] = -100
        cls.ids[2, 3] = 7
        cls.seq_lens = np.array([12, 9, 5], dtype=np.int32)

    def test_same_position_entropy_topk_gather_temperature(self):
        rng = np.random.default_rng(1)
        gather = rng.integers(0, self.V, size=(self.B, self.S, 3)).astype(np.int32)
        res = self.client.score(
            logits=self.logits, input_ids=self.ids, seq_lens=self.seq_lens, alignment="same_position",
            entropy=True, topk=5, gather_indices=gather, temperature=1.3,
        )
        self.assertEqual(res.token_logprobs.shape, (self.B, self.S))
        self.assertEqual(res.topk_indices.shape, (self.B, self.S, 5))
        self.assertEqual(res.gathered_logprobs.shape, (self.B, self.S, 3))
        ref = reference.score_padded(self.logits, self.ids, self.seq_lens, "same_position", temperature=1.3,
                                     topk=5, gather=gather)
        self.assertEqual(compare(ref, res.outputs), "")
        self.assertEqual(res.token_logprobs[0, 5], 0.0)  # ignore_index -100
        # Past seq_lens: 0.
        np.testing.assert_array_equal(res.token_logprobs[2, 5:], 0)

    def test_sampling_filters_and_ignore_index(self):
        ids = self.ids.copy()
        ids[0, 5] = 3
        res = self.client.score(
            logits=self.logits, input_ids=ids, entropy=True, temperature=0.8, sampling_top_k=20,
            sampling_top_p=0.7, ignore_index=7,
        )
        ref = reference.score_padded(self.logits, ids, None, "next_token", temperature=0.8, top_k=20, top_p=0.7,
                                     ignore_index=7)
        self.assertEqual(compare(ref, res.outputs), "")
        self.assertEqual(res.token_logprobs[2, 2], 0.0)  # target 7 ignored
        self.assertTrue(np.isneginf(res.token_logprobs).any())  # filtered targets: -inf

    def test_log_sum_sq_probs_mean_logits_is_top1(self):
        # bf16-exact values on a grid of 1/4: exact ties at the maxima.
        rng = np.random.default_rng(30)
        logits = (np.round(rng.standard_normal((self.B, self.S, self.V)) * 8) / 4).astype(np.float32)
        ids = self.ids.copy()
        first_max = np.argmax(logits, axis=-1)  # the lowest id among equal maxima
        for b in range(self.B):
            for t in range(0, self.S - 1, 2):
                top = np.flatnonzero(logits[b, t] == logits[b, t].max())
                ids[b, t + 1] = first_max[b, t] if t % 4 == 0 else top[-1]  # a later tie is not top-1
        ids[0, 3] = -100
        extras = dict(log_sum_sq_probs=True, mean_logits=True, is_top1=True)
        for kw, ref_kw in (
            (dict(temperature=0.7), dict(temperature=0.7)),
            # top-k only: reference.py's top-p does not apply SPEC's tie rule, and these rows tie a lot.
            (dict(temperature=0.9, sampling_top_k=20), dict(temperature=0.9, top_k=20)),
        ):
            for split in (False, True):  # split: one request per sequence, joined
                with self.subTest(options=kw, split=split):
                    client = self.server.client(max_tokens_per_request=12) if split else self.client
                    try:
                        res = client.score(logits=logits, input_ids=ids, seq_lens=self.seq_lens, dtype="bf16",
                                           entropy=True, **kw, **extras)
                    finally:
                        if split:
                            client.close()
                    self.assertEqual(res.num_parts, 3 if split else 1)
                    ref = reference.score_padded(logits, ids, self.seq_lens, extras=True, **ref_kw)
                    self.assertEqual(compare(ref, res.outputs), "")
                    self.assertEqual(res.is_top1.dtype, np.bool_)
                    self.assertEqual(res.log_sum_sq_probs.dtype, np.float32)
                    self.assertEqual(res.mean_logits.shape, (self.B, self.S - 1))
                    self.assertTrue(res.is_top1.any() and not res.is_top1.all())
                    # Not scored (ignore_index, past seq_lens): 0.
                    self.assertEqual((res.log_sum_sq_probs[0, 2], res.mean_logits[0, 2], res.is_top1[0, 2]),
                                     (0.0, 0.0, False))
                    self.assertFalse(res.is_top1[2, 4:].any())
                    np.testing.assert_array_equal(res.mean_logits[2, 4:], 0)
        res = self.client.score(logits=logits, input_ids=ids, dtype="bf16")
        self.assertIsNone(res.log_sum_sq_probs)
        self.assertIsNone(res.mean_logits)
        self.assertIsNone(res.is_top1)
        self.assertEqual(set(res.outputs), {"token_logprobs"})

    def test_wire_dtype_conversion(self):
        for dtype, rounded in (
            ("f16", self.logits.astype(np.float16).astype(np.float32)),
            ("bf16", bf16_bits_to_float32(float32_to_bf16_bits(self.logits))),
        ):
            with self.subTest(dtype=dtype):
                res = self.client.score(logits=self.logits, input_ids=self.ids.astype(np.int32), dtype=dtype, topk=3)
                ref = reference.score_padded(rounded, self.ids, topk=3)
                ref.pop("entropy")
                self.assertEqual(compare(ref, res.outputs), "")
                self.assertIsNone(res.entropy)

    def test_server_errors_carry_code_and_message(self):
        ids = self.ids.copy()
        ids[1, 4] = self.V + 5
        with self.assertRaises(LogprobError) as cm:
            self.client.score(logits=self.logits, input_ids=ids)
        e = cm.exception
        self.assertEqual(e.code, grpc.StatusCode.INVALID_ARGUMENT)
        self.assertEqual(e.attempts, 1)  # not retried
        self.assertIn("sequence 1", e.message)
        self.assertIn("INVALID_ARGUMENT", str(e))
        with self.assertRaises(LogprobError) as cm:
            self.client.score(logits=self.logits, input_ids=self.ids, temperature=-1.0)
        self.assertEqual(cm.exception.code, grpc.StatusCode.INVALID_ARGUMENT)
        self.assertIn("temperature", cm.exception.message)
        with self.assertRaises(LogprobError) as cm:  # no --lm-head on this server
            self.client.score(hidden_states=self.logits, input_ids=self.ids)
        self.assertEqual(cm.exception.code, grpc.StatusCode.FAILED_PRECONDITION)
        with self.assertRaises(InvalidInputError):
            self.client.score(logits=self.logits, input_ids=self.ids[:, :5])
        with self.assertRaises(TypeError):
            self.client.score(logits=self.logits.astype(np.int32), input_ids=self.ids)

    def test_deadline(self):
        big = np.zeros((16, 64, 4096), dtype=np.float32)  # 16 MiB
        with self.server.client() as c:
            c.server_info()
            c.timeout = 0.001
            with self.assertRaises(LogprobError) as cm:
                c.score(logits=big, input_ids=np.zeros((16, 64), dtype=np.int64))
        self.assertEqual(cm.exception.code, grpc.StatusCode.DEADLINE_EXCEEDED)
        # The timeout bounds the whole call: it may pass before the one send.
        self.assertLessEqual(cm.exception.attempts, 1)


class RetryTest(unittest.TestCase):
    """UNAVAILABLE and RESOURCE_EXHAUSTED are retried with exponential
    backoff and jitter, a bounded number of times."""

    def test_stopped_server_bounded_retries(self):
        server = Server(workers=1)
        try:
            with server.client() as c:
                g = Golden("sampling_f32")
                self.assertEqual(compare(g.expected, c.score(**g.score_kwargs()).outputs), "")
                server.stop()
                events = []
                c.retry = RetryPolicy(max_attempts=4, initial_backoff=0.05, multiplier=2.0, jitter=0.0)
                c.on_retry = lambda attempt, code, message, delay: events.append((attempt, code, delay))
                start = time.monotonic()
                with self.assertRaises(LogprobError) as cm:
                    c.score(**g.score_kwargs())
                elapsed = time.monotonic() - start
        finally:
            server.close()
        self.assertEqual(cm.exception.code, grpc.StatusCode.UNAVAILABLE)
        self.assertEqual(cm.exception.attempts, 4)
        # The message says what to do when the server is merely still starting.
        self.assertIn("gave up after 4 attempts", cm.exception.message)
        self.assertIn("client.health(wait=SECONDS)", cm.exception.message)
        self.assertEqual([(a, c) for a, c, _ in events], [(i, grpc.StatusCode.UNAVAILABLE) for i in (1, 2, 3)])
        self.assertEqual([round(d, 6) for _, _, d in events], [0.05, 0.1, 0.2])
        self.assertGreaterEqual(elapsed, 0.35)
        self.assertLess(elapsed, 30)

    def test_backoff_jitter_bounds(self):
        p = RetryPolicy(max_attempts=10, initial_backoff=0.1, max_backoff=1.0, multiplier=3.0, jitter=0.5)
        for attempt, base in ((1, 0.1), (2, 0.3), (3, 0.9), (4, 1.0), (9, 1.0)):
            delays = [p.backoff(attempt) for _ in range(200)]
            self.assertTrue(all(base * 0.5 <= d <= base for d in delays), (attempt, min(delays), max(delays)))
            self.assertGreater(max(delays) - min(delays), 0.1 * base)  # jittered

    def test_server_starting_later_is_waited_for(self):
        # The server is started once the client has seen the call fail
        # (from on_retry, in another thread); the retried call then succeeds.
        port = support.free_port()
        g = Golden("sampling_f32")
        events = []
        later = {}

        def start_server():
            later["server"] = Server(workers=1, port=port, wait=False)

        starter = threading.Thread(target=start_server)

        def on_retry(*a):
            events.append(a)
            if len(events) == 1:
                starter.start()

        try:
            with LogprobClient(
                "127.0.0.1:%d" % port,
                timeout=120,
                retry=RetryPolicy(max_attempts=1000, initial_backoff=0.1, max_backoff=0.5),
                on_retry=on_retry,
            ) as c:
                res = c.score(**g.score_kwargs())
        finally:
            if starter.is_alive() or events:
                starter.join()
            if "server" in later:
                later["server"].close()
        self.assertEqual(compare(g.expected, res.outputs), "")
        self.assertGreater(len(events), 0)
        self.assertTrue(all(e[1] == grpc.StatusCode.UNAVAILABLE for e in events), events)

    def test_queue_full_is_retried_until_admitted(self):
        # One token of queue: a request is refused while another is in flight.
        server = Server(workers=1, extra=["--lm-head", LM_HEAD, "--max-queue-tokens", "1", "--worker-threads", "1"])
        try:
            rng = np.random.default_rng(3)
            g = Golden("sampling_f32")
            # A slow hidden-states request holds the queue; larger on a fast machine.
            for T in (16384, 65536):
                hidden = float32_to_bf16_bits(rng.standard_normal((T, 256)).astype(np.float32))
                ids = rng.integers(0, 8192, size=T)
                slow = {}

                def run_slow(T=T, hidden=hidden, ids=ids, slow=slow):
                    with server.client(timeout=300) as c:
                        t0 = time.monotonic()
                        slow["result"] = c.score(hidden_states=hidden, input_ids=ids, cu_seqlens=[0, T],
                                                 dtype="bf16", entropy=True)
                        slow["seconds"] = time.monotonic() - t0
                    slow["done"] = time.monotonic()

                with server.client(retry=RetryPolicy(max_attempts=1)) as probe:
                    probe.server_info()
                    t = threading.Thread(target=run_slow)
                    t.start()
                    refused = None
                    deadline = time.monotonic() + 20
                    while refused is None and time.monotonic() < deadline and "done" not in slow:
                        try:
                            probe.score(**g.score_kwargs())
                        except LogprobError as e:
                            refused = e
                        time.sleep(0.01)
                if refused is not None:
                    break
                t.join()
            self.assertIsNotNone(refused, "the slow request (%s) never filled the queue" % slow.get("seconds"))
            self.assertEqual(refused.code, grpc.StatusCode.RESOURCE_EXHAUSTED)
            self.assertEqual(refused.attempts, 1)
            self.assertIn("max-queue-tokens", refused.message)

            events = []
            with server.client(
                retry=RetryPolicy(max_attempts=200, initial_backoff=0.05, max_backoff=0.5),
                on_retry=lambda *a: events.append(a),
            ) as c:
                started = time.monotonic()
                res = c.score(**g.score_kwargs())
            t.join()
            print("\nslow request: %.2f s; queued request: %d retries on %s"
                  % (slow.get("seconds", -1), len(events), sorted({e[1].name for e in events})), file=sys.stderr)
            self.assertEqual(compare(g.expected, res.outputs), "")
            self.assertEqual(slow["result"].token_logprobs.shape, (T - 1,))
            if slow["done"] > started + 0.2:  # the slow request was still in flight: refused, retried
                self.assertGreater(len(events), 0)
                self.assertTrue(all(e[1] == grpc.StatusCode.RESOURCE_EXHAUSTED for e in events))
                self.assertEqual(res.attempts, len(events) + 1)
        finally:
            server.close()


class AuthTest(unittest.TestCase):
    """Bearer token (string or file, same metadata as logprob-client), TLS
    with a CA and a server name override, mutual TLS."""

    TOKEN = "s3cret-token-for-the-python-client"

    @classmethod
    def setUpClass(cls):
        cls.dir = temp_dir("pyclient_auth")
        cls.addClassCleanup(shutil.rmtree, cls.dir, True)
        d = cls.dir + "/"
        ec = " -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes"
        steps = [
            "openssl req -x509" + ec + " -keyout " + d + "ca.key -out " + d + "ca.pem -days 2 -subj /CN=py-test-ca",
            "openssl req -x509" + ec + " -keyout " + d + "other_ca.key -out " + d + "other_ca.pem -days 2 -subj /CN=x",
            "printf 'subjectAltName=IP:127.0.0.1,DNS:localhost\\nextendedKeyUsage=serverAuth\\n' > " + d + "server.ext",
            "openssl req" + ec + " -keyout " + d + "server.key -out " + d + "server.csr -subj /CN=localhost",
            "openssl x509 -req -in " + d + "server.csr -CA " + d + "ca.pem -CAkey " + d + "ca.key -set_serial 2 "
            "-days 2 -extfile " + d + "server.ext -out " + d + "server.pem",
            "printf 'extendedKeyUsage=clientAuth\\n' > " + d + "client.ext",
            "openssl req" + ec + " -keyout " + d + "client.key -out " + d + "client.csr -subj /CN=client",
            "openssl x509 -req -in " + d + "client.csr -CA " + d + "ca.pem -CAkey " + d + "ca.key -set_serial 3 "
            "-days 2 -extfile " + d + "client.ext -out " + d + "client.pem",
        ]
        for cmd in steps:
            subprocess.run(cmd, shell=True, check=True, capture_output=True)
        with open(d + "token", "w") as f:
            f.write("  " + cls.TOKEN + "\n")
        cls.golden = Golden("sampling_f32")
        cls.plain = Server(workers=1, extra=["--auth-token-file", d + "token"])
        cls.addClassCleanup(cls.plain.close)
        cls.mtls_kwargs = dict(tls_ca=d + "ca.pem", tls_cert=d + "client.pem", tls_key=d + "client.key")
        cls.mtls = Server(
            workers=1,
            extra=["--auth-token-file", d + "token", "--tls-cert", d + "server.pem", "--tls-key", d + "server.key",
                   "--tls-client-ca", d + "ca.pem"],
            client_kwargs=cls.mtls_kwargs,
        )
        cls.addClassCleanup(cls.mtls.close)

    def score(self, client):
        res = client.score(**self.golden.score_kwargs())
        self.assertEqual(compare(self.golden.expected, res.outputs), "")
        return res

    def assert_code(self, client, code):
        with self.assertRaises(LogprobError) as cm:
            client.score(**self.golden.score_kwargs())
        self.assertEqual(cm.exception.code, code, str(cm.exception))
        return cm.exception

    def test_token(self):
        with self.plain.client() as c:
            self.assertTrue(c.health())  # health needs no token
            e = self.assert_code(c, grpc.StatusCode.UNAUTHENTICATED)
            self.assertEqual(e.attempts, 1)  # not retried
            self.assertIn("bearer token", e.message)
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            wrong = self.plain.client(token="wrong-" + self.TOKEN)
        self.assertTrue(any("plaintext" in str(x.message) for x in w))
        with wrong as c:
            self.assert_code(c, grpc.StatusCode.UNAUTHENTICATED)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with self.plain.client(token=self.TOKEN) as c:
                self.score(c)
            with self.plain.client(token_file=self.dir + "/token") as c:
                self.score(c)
        with self.assertRaises(InvalidInputError):
            self.plain.client(token_file=self.dir + "/missing")
        with self.assertRaises(InvalidInputError):
            self.plain.client(token="   ")

    def test_mutual_tls_with_token(self):
        d = self.dir + "/"
        with self.mtls.client(token_file=d + "token") as c:
            self.score(c)
        with self.mtls.client(token=self.TOKEN, tls_server_name="localhost") as c:
            self.score(c)
        with self.mtls.client() as c:  # certificate but no token
            self.assert_code(c, grpc.StatusCode.UNAUTHENTICATED)
        retry = RetryPolicy(max_attempts=2, initial_backoff=0.01)
        with LogprobClient(self.mtls.address, tls_ca=d + "ca.pem", token=self.TOKEN, retry=retry) as c:
            self.assert_code(c, grpc.StatusCode.UNAVAILABLE)  # no client certificate
        with LogprobClient(self.mtls.address, tls_ca=d + "other_ca.pem", tls_cert=d + "client.pem",
                           tls_key=d + "client.key", token=self.TOKEN, retry=retry) as c:
            self.assert_code(c, grpc.StatusCode.UNAVAILABLE)  # server not trusted
        with self.mtls.client(token=self.TOKEN, tls_server_name="not-the-server.example", retry=retry) as c:
            self.assert_code(c, grpc.StatusCode.UNAVAILABLE)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with LogprobClient(self.mtls.address, token=self.TOKEN, retry=retry) as c:
                self.assert_code(c, grpc.StatusCode.UNAVAILABLE)  # plaintext client
        with self.assertRaises(InvalidInputError):
            LogprobClient(self.mtls.address, tls_ca=d + "ca.pem", tls_cert=d + "client.pem")


    def test_aio_client_token_and_mutual_tls(self):
        import asyncio
        from logprob_client import aio

        d = self.dir + "/"

        async def run():
            async with aio.LogprobClient(self.mtls.address, token_file=d + "token", **self.mtls_kwargs) as c:
                res = await c.score(**self.golden.score_kwargs())
            async with aio.LogprobClient(self.mtls.address, **self.mtls_kwargs) as c:  # no token
                with self.assertRaises(LogprobError) as cm:
                    await c.score(**self.golden.score_kwargs())
            return res, cm.exception

        res, err = asyncio.run(run())
        self.assertEqual(compare(self.golden.expected, res.outputs), "")
        self.assertEqual(err.code, grpc.StatusCode.UNAUTHENTICATED)
        self.assertEqual(err.attempts, 1)


class OfflineTest(unittest.TestCase):
    """No server: stub generation at import time, the splitter's parts, and
    the input conversions."""

    def test_public_names_exist(self):
        import importlib

        import logprob_client

        for module in ("logprob_client", "logprob_client.client", "logprob_client.aio", "logprob_client.batches",
                       "logprob_client.errors", "logprob_client.safetensors", "logprob_client.lm_head_update",
                       "logprob_client.replicas", "logprob_client.tensor_parallel", "logprob_client.fused_head",
                       "logprob_client.trl", "logprob_client.verl"):
            m = importlib.import_module(module)
            self.assertEqual([n for n in m.__all__ if not hasattr(m, n)], [], module)
        self.assertEqual(len(set(logprob_client.__all__)), len(logprob_client.__all__))

    def test_target_slips_say_what_to_change(self):
        from logprob_client import aio

        for target, says in (("http://127.0.0.1:50051", "drop the scheme"),
                             ("https://scorer.example:443", "tls_ca"),
                             ("127.0.0.1", "add the port"),
                             ("scorer.example", "'scorer.example:50051'"),
                             ("[::1]", "add the port"),
                             ("::1:50051", "brackets"),
                             ("127.0.0.1:0", "1..65535"),
                             ("127.0.0.1:http", "1..65535"),
                             (":50051", "add the host")):
            with self.assertRaises(InvalidInputError, msg=target) as cm:
                LogprobClient(target)
            self.assertIn(says, cm.exception.message, target)
            with self.assertRaises(InvalidInputError, msg=target):
                aio.LogprobClient(target)
        for target in ("127.0.0.1:50051", "scorer.example:50051", "[::1]:50051", "unix:/tmp/logprob.sock",
                       "dns:///scorer.example:50051"):
            LogprobClient(target).close()

    def test_float64_and_misspelled_keywords_are_refused_clearly(self):
        with LogprobClient("127.0.0.1:%d" % support.free_port()) as c:
            ids = np.zeros((1, 4), dtype=np.int64)
            with self.assertRaises(TypeError) as cm:
                c.score(logits=np.zeros((1, 4, 8)), input_ids=ids)  # float64, nothing sent
            self.assertIn("'logits' is float64", str(cm.exception))
            self.assertIn("dtype='f32'", str(cm.exception))
            # A uint16 array: the error names the keyword score() takes,
            # and that keyword does send it (as raw bf16 bits).
            bits = np.zeros((1, 4, 8), dtype=np.uint16)
            with self.assertRaises(TypeError) as cm:
                c.score(logits=bits, input_ids=ids)
            self.assertIn("pass dtype='bf16'", str(cm.exception))
            self.assertNotIn("logits_dtype", str(cm.exception))
            from logprob_client._internal.tensors import BF16, float_array
            wire, arr = float_array("logits", bits, dtype="bf16")
            self.assertEqual(wire, BF16)
            self.assertEqual(arr.dtype, np.dtype("<u2"))
            with self.assertRaises(TypeError) as cm:
                c.score(logits=np.zeros((1, 4, 8), np.float32), input_ids=ids, entropyy=True)
            self.assertIn("score() got an unexpected keyword argument 'entropyy' (did you mean 'entropy'?)",
                          str(cm.exception))
            self.assertNotIn("score_options", str(cm.exception))
            try:
                import torch
            except ImportError:
                return
            with self.assertRaises(TypeError) as cm:
                c.score(hidden_states=torch.zeros(1, 4, 8, dtype=torch.float64), input_ids=ids)
            self.assertIn("'hidden_states' is float64", str(cm.exception))

    def test_stubs_generated_at_import_time(self):
        # A copy of the package outside the source tree (no build/python next
        # to it): the stubs are generated from LOGPROB_PROTO_DIR into the cache.
        d = temp_dir("pyclient_stubs")
        self.addCleanup(shutil.rmtree, d, True)
        shutil.copytree(os.path.join(support.SOURCE_ROOT, "client", "python", "logprob_client"),
                        os.path.join(d, "pkg", "logprob_client"),
                        ignore=shutil.ignore_patterns("__pycache__"))
        env = dict(os.environ, PYTHONPATH=os.path.join(d, "pkg"), XDG_CACHE_HOME=os.path.join(d, "cache"),
                   LOGPROB_PROTO_DIR=os.path.join(support.SOURCE_ROOT, "proto"))
        env.pop("LOGPROB_PY_STUBS_DIR", None)
        code = ("import logprob_client as c; print(c.logprob_pb2.__file__); "
                "print(c.logprob_pb2.ScoreOptions(topk=3).topk, hasattr(c.logprob_pb2_grpc, 'LogprobServiceStub'))")
        out = subprocess.run([sys.executable, "-c", code], env=env, cwd=d, capture_output=True, text=True)
        self.assertEqual(out.returncode, 0, out.stderr)
        path, values = out.stdout.splitlines()
        self.assertTrue(path.startswith(os.path.join(d, "cache", "logprob_client")), path)
        self.assertEqual(values, "3 True")
        # Without protoc's inputs: a clear ImportError.
        env["LOGPROB_PROTO_DIR"] = os.path.join(d, "nowhere")
        env["XDG_CACHE_HOME"] = os.path.join(d, "cache2")
        out = subprocess.run([sys.executable, "-c", "import logprob_client"], env=env, cwd=d, capture_output=True,
                             text=True)
        self.assertNotEqual(out.returncode, 0)
        self.assertIn("logprob_python_stubs", out.stderr)

    def test_split_packed_parts(self):
        from logprob_client import logprob_pb2 as pb2
        from logprob_client._internal import splitter
        from logprob_client._internal.tensors import I32, I64, F32

        V, lens = 8, [3, 5, 1, 4]
        T = sum(lens)
        cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
        logits = np.arange(T * V, dtype=np.float32).reshape(T, V)
        ids = np.arange(T, dtype=np.int64)
        for alignment, outs in ((pb2.NEXT_TOKEN, [2, 4, 0, 3]), (pb2.SAME_POSITION, lens)):
            gather = np.arange(sum(outs) * 2, dtype=np.int64).reshape(-1, 2)
            inp = splitter.Inputs(
                [("logits", F32, logits), ("input_ids", I64, ids), ("cu_seqlens", I32, cu),
                 ("gather_indices", I64, gather)],
                pb2.ScoreOptions(alignment=alignment),
            )
            parts = splitter.split(inp, "r", max_bytes=10 ** 6, max_tokens=6)  # [3], [5, 1], [4]
            self.assertEqual([p.id for p in parts], ["r-1", "r-2", "r-3"])
            got_cu = [np.frombuffer(p.inputs[2].data, "<i4").tolist() for p in parts]
            self.assertEqual(got_cu, [[0, 3], [0, 5, 6], [0, 4]])
            self.assertTrue(all(p.inputs[2].dtype == I32 for p in parts))
            rows = [np.frombuffer(p.inputs[0].data, "<f4").reshape(-1, V) for p in parts]
            np.testing.assert_array_equal(np.concatenate(rows), logits)
            g_rows = [list(p.inputs[3].shape)[0] for p in parts]
            self.assertEqual(g_rows, [outs[0], outs[1] + outs[2], outs[3]])
            np.testing.assert_array_equal(
                np.concatenate([np.frombuffer(p.inputs[3].data, "<i8").reshape(-1, 2) for p in parts]), gather)
            # Byte limit: the same cut from sizes alone.
            one = parts[1].ByteSize()
            self.assertEqual(len(splitter.split(inp, "r", max_bytes=one + 40)), 3)
            self.assertEqual(len(splitter.split(inp, "r", max_bytes=10 ** 6)), 1)
            for p in splitter.split(inp, "r", max_bytes=one + 40):
                self.assertLessEqual(p.ByteSize(), one + 40)
        joined = splitter.join([{"a": np.ones((2, 3))}, {"a": np.zeros((0, 3))}, {"a": np.full((1, 3), 2.0)}])
        self.assertEqual(joined["a"].shape, (3, 3))

    def test_wire_encoding_matches_protobuf(self):
        # encode_request's bytes parse as the ScoreRequest protobuf builds,
        # for contiguous, strided, bf16 and empty tensors, on both paths.
        from logprob_client import logprob_pb2 as pb2
        from logprob_client._internal import splitter, wire
        from logprob_client._internal.tensors import float_array, int_array

        import platform

        if platform.python_implementation() == "CPython":
            self.assertTrue(wire._FILL, "the in-place fill path is off on CPython")
        rng = np.random.default_rng(2)
        logits = rng.standard_normal((5, 3, 300)).astype(np.float32)
        ids = rng.integers(0, 300, (3, 5))
        for rows in (logits, logits.transpose(1, 0, 2), float32_to_bf16_bits(logits)[:, ::2]):
            kind = "bf16" if rows.dtype == np.uint16 else None
            tensors = [("logits",) + float_array("logits", rows, kind),
                       ("input_ids",) + int_array("input_ids", ids if rows.shape[0] == 3 else ids.T),
                       ("gather_indices",) + int_array("g", np.zeros(rows.shape[:2] + (0,), np.int64))]
            options = pb2.ScoreOptions(topk=3, temperature=0.5, alignment=pb2.SAME_POSITION)
            built = splitter.Inputs(tensors, options).request("r-1")
            for fill in (True, False):  # filled in place (CPython) / joined
                raw = wire.encode_request("r-1", tensors, options, fill=fill)
                self.assertIsInstance(raw, bytes)
                self.assertEqual(pb2.ScoreRequest.FromString(raw), built)
                self.assertEqual(len(raw), built.ByteSize())
        for n in (0, 1, 127, 128, 16383, 16384, 2 ** 35):
            v = wire.varint(n)
            self.assertEqual(v, pb2.ServerInfo(max_request_bytes=n).SerializeToString()[1:] if n else b"\x00")

    def test_wire_response_decoding_matches_protobuf(self):
        from logprob_client import logprob_pb2 as pb2
        from logprob_client._internal import wire
        from logprob_client._internal.request import decode
        from logprob_client._internal.tensors import to_tensor

        rng = np.random.default_rng(4)
        lp = rng.standard_normal((3, 7)).astype(np.float32)
        idx = rng.integers(0, 1 << 40, (3, 7, 2))
        resp = pb2.ScoreResponse(id="r-\u00e9", outputs=[to_tensor("token_logprobs", pb2.F32, lp),
                                                           to_tensor("topk_indices", pb2.I64, idx),
                                                           to_tensor("entropy", pb2.F32, np.zeros((3, 0), np.float32))],
                                 status_code=8, status_message="queue full")
        raw = resp.SerializeToString()
        # An unknown field of each wire type (a newer server) is skipped.
        raw += b"\x28\x05" + b"\x31" + bytes(8) + b"\x3a\x02ab" + b"\x45" + bytes(4)
        got = wire.decode_response(raw)
        self.assertEqual((got.id, got.status_code, got.status_message), ("r-\u00e9", 8, "queue full"))
        self.assertEqual([(t.name, t.dtype, t.shape) for t in got.outputs],
                         [(t.name, t.dtype, list(t.shape)) for t in resp.outputs])
        outs = decode(got)
        np.testing.assert_array_equal(outs["token_logprobs"], lp)
        np.testing.assert_array_equal(outs["topk_indices"], idx)
        self.assertEqual(outs["entropy"].shape, (3, 0))
        self.assertTrue(np.shares_memory(outs["token_logprobs"], np.frombuffer(raw, np.uint8)))
        # Unpacked shape (allowed by the wire format) and malformed bytes.
        t = pb2.Tensor(name="x", dtype=pb2.I32, data=np.arange(6, dtype="<i4").tobytes())
        unpacked = b"\x12" + bytes([len(t.SerializeToString()) + 4]) + t.SerializeToString() + b"\x18\x02\x18\x03"
        self.assertEqual(decode(wire.decode_response(unpacked))["x"].tolist(), [[0, 1, 2], [3, 4, 5]])
        for bad in (raw[:-3], b"\x12\x7f\x0a", b"\x0b"):
            with self.assertRaises(ValueError):
                wire.decode_response(bad)
        with self.assertRaises(LogprobError) as cm:  # data that does not fit its shape
            decode(wire.decode_response(pb2.ScoreResponse(id="q", outputs=[pb2.Tensor(
                name="token_logprobs", dtype=pb2.F32, shape=[3], data=b"\0" * 8)]).SerializeToString()))
        self.assertEqual(cm.exception.code, grpc.StatusCode.INTERNAL)

    def test_conversions(self):
        from logprob_client._internal.tensors import BF16, F16, F32, I32, I64, float_array, int_array

        x = np.linspace(-3, 3, 12, dtype=np.float64).reshape(3, 4)
        # float64 is refused unless a dtype says how to send it (as the CLI refuses float64 files).
        with self.assertRaises(TypeError) as cm:
            float_array("logits", x)
        self.assertIn("dtype='f32'", str(cm.exception))
        dt, arr = float_array("logits", x, dtype="f32")
        self.assertEqual((dt, arr.dtype), (F32, np.dtype("<f4")))
        self.assertEqual(float_array("logits", x.astype(np.float16))[0], F16)
        dt, bits = float_array("logits", x, dtype="bf16")
        self.assertEqual((dt, bits.dtype), (BF16, np.dtype("<u2")))
        np.testing.assert_allclose(bf16_bits_to_float32(bits), x, rtol=2 ** -8)
        self.assertEqual(int_array("ids", np.zeros(3, np.int32))[0], I32)
        self.assertEqual(int_array("ids", [1, 2, 3])[0], I64)
        self.assertEqual(int_array("ids", np.zeros(3, np.uint8))[0], I64)
        with self.assertRaises(TypeError):
            int_array("ids", x)
        with self.assertRaises(ValueError):
            float_array("logits", x, dtype="f8")
        be = x.astype(">f4")
        dt, arr = float_array("logits", be)
        self.assertEqual(arr.tobytes(), x.astype("<f4").tobytes())  # sent little-endian


if __name__ == "__main__":
    unittest.main()
