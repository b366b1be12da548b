"""Tests of the Python clients' chunked transport (logprob_client/_internal/transport.py,
the ScoreChunked RPC) against live logprob-servers, sync (ChunkedTest) and
asyncio (AioChunkedTest): golden cases give the same bytes in pieces as in
one message, large outputs come back in pieces, a 300 MB request scores
with the default limits; the aio client's chunked calls are retried, bounded
by the call's timeout, and cancelled on the server with the awaiting task."""

import asyncio
import os
import unittest

import numpy as np

import support  # noqa: F401  (puts client/python on sys.path)
from support import LOGITS_CASES, Golden, Server, compare

import grpc
from logprob_client import LogprobError, RetryPolicy, aio, bf16_bits_to_float32, float32_to_bf16_bits
from logprob_client._internal import transport

LM_HEAD = os.path.join(support.GOLDEN_DIR, "hidden_bf16.lm_head.safetensors")


class ChunkedTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.server = Server(workers=2, extra=["--lm-head", LM_HEAD])
        cls.addClassCleanup(cls.server.close)

    def client(self, chunk_above, piece_bytes=transport.PIECE_BYTES):
        # Inline bytes: on this host the client would otherwise send the
        # tensors through shared memory (test_shared_memory.py covers that).
        c = self.server.client(shared_memory=False)
        c.chunk_above = chunk_above
        c.piece_bytes = piece_bytes
        self.addCleanup(c.close)
        return c

    def test_piece_and_inline_sizes_are_the_servers(self):
        # The client's defaults for its chunked requests are the sizes the
        # server uses for its answers and reports in ServerInfo (one rule:
        # common/chunk_codec.h).
        with self.server.client() as c:
            info = c.server_info()
        self.assertEqual(info.chunked_piece_bytes, transport.PIECE_BYTES)
        self.assertEqual(info.chunked_inline_bytes, transport.INLINE_BYTES)

    def test_piece_header_matches_protobuf(self):
        from logprob_client._internal._proto import pb2

        part = pb2.ScoreRequestPart(piece=pb2.TensorPiece(tensor=3, offset=1 << 33, data=b"abcde"))
        self.assertEqual(transport.piece_header(3, 1 << 33, 5) + b"abcde", part.SerializeToString())
        kind, (tensor, offset, data) = transport.parse_part(part.SerializeToString())
        self.assertEqual((kind, tensor, offset, bytes(data)), ("piece", 3, 1 << 33, b"abcde"))

    def test_response_assembler_refuses_malformed_answers(self):
        from logprob_client._internal._proto import pb2

        out = pb2.Tensor(name="topk_indices", dtype=pb2.I64, shape=[2, 3])  # 48 bytes, in pieces
        data = np.arange(6, dtype=np.int64).tobytes()
        first = pb2.ScoreResponsePart(response=pb2.ScoreResponse(id="r", outputs=[out])).SerializeToString()

        def piece(offset, chunk):
            return pb2.ScoreResponsePart(piece=pb2.TensorPiece(tensor=0, offset=offset, data=chunk)).SerializeToString()

        resp = transport.assemble_response([first, piece(0, data[:40]), piece(40, data[40:])])
        self.assertEqual(bytes(resp.outputs[0].data), data)
        for parts, message in (([], "without an answer"),
                               ([piece(0, data)], "first answer part"),
                               ([first, piece(0, data[:40])], "8 bytes of outputs missing"),
                               ([first, piece(8, data[8:])], "offset 8"),
                               ([first, piece(0, data + b"x")], "offset 0"),
                               ([first, piece(0, data), first], "second response")):
            with self.subTest(message=message):
                with self.assertRaisesRegex(ValueError, message):
                    transport.assemble_response(parts)

    def test_golden_cases_in_pieces_equal_one_message(self):
        one = self.client(chunk_above=-1)
        pieces = self.client(chunk_above=0, piece_bytes=1000)
        for name in LOGITS_CASES + ["hidden_bf16"]:
            with self.subTest(case=name):
                g = Golden(name)
                a = one.score(**g.score_kwargs())
                b = pieces.score(**g.score_kwargs())
                self.assertEqual(compare(g.expected, b.outputs), "")
                self.assertEqual(sorted(a.outputs), sorted(b.outputs))
                for k in a.outputs:
                    self.assertEqual(a.outputs[k].dtype, b.outputs[k].dtype)
                    np.testing.assert_array_equal(a.outputs[k], b.outputs[k])

    def test_large_outputs_come_back_in_pieces(self):
        rng = np.random.default_rng(5)
        T, V = 2048, 2048
        logits = rng.standard_normal((T, V)).astype(np.float32)
        ids = rng.integers(0, V, T)
        cu = np.array([0, T], dtype=np.int64)
        kw = dict(logits=logits, input_ids=ids, cu_seqlens=cu, topk=1024, dtype="bf16")
        a = self.client(chunk_above=-1).score(**kw)
        b = self.client(chunk_above=0).score(**kw)
        for k in ("token_logprobs", "topk_logprobs", "topk_indices"):
            np.testing.assert_array_equal(a.outputs[k], b.outputs[k])
        self.assertEqual(b.topk_indices.shape, (T - 1, 1024))

    def test_300mb_request_with_default_limits(self):
        # Every row the same random bf16 row: target t's logprob is
        # x[t] - logsumexp(x), computed in float64.
        T, V = 4800, 32000
        rng = np.random.default_rng(9)
        row = float32_to_bf16_bits((rng.standard_normal(V) * 2).astype(np.float32))
        x = bf16_bits_to_float32(row).astype(np.float64)
        lse = x.max() + np.log(np.exp(x - x.max()).sum())
        logits = np.broadcast_to(row, (T, V)).copy()  # 307 MB of bf16 bits
        ids = rng.integers(0, V, T)
        c = self.server.client(shared_memory=False)  # the bytes over gRPC, in pieces
        self.addCleanup(c.close)
        res = c.score(logits=logits, input_ids=ids, cu_seqlens=np.array([0, T]), dtype="bf16")
        self.assertEqual(res.num_parts, 1)
        want = x[ids[1:]] - lse
        np.testing.assert_allclose(res.token_logprobs, want, rtol=2e-5, atol=2e-4)


def assert_same_bytes(test, a, b):
    """``a`` and ``b`` ({name: ndarray}) hold the same outputs, bit for bit."""
    test.assertEqual(sorted(a), sorted(b))
    for k in a:
        test.assertEqual((a[k].dtype, a[k].shape), (b[k].dtype, b[k].shape), k)
        test.assertEqual(a[k].tobytes(), b[k].tobytes(), k)


def large_output_case():
    """A packed bf16 batch [2048, 2048] with topk=1024 (25 MB of top-k
    outputs: they come back in pieces) and its float64 reference
    (token_logprobs, topk_logprobs)."""
    rng = np.random.default_rng(5)
    T, V, K = 2048, 2048, 1024
    bits = float32_to_bf16_bits(rng.standard_normal((T, V)).astype(np.float32))
    ids = rng.integers(0, V, T)
    x = bf16_bits_to_float32(bits).astype(np.float64)
    m = x.max(axis=1, keepdims=True)
    lp = x - (m + np.log(np.exp(x - m).sum(axis=1, keepdims=True)))
    want = {"token_logprobs": lp[np.arange(T - 1), ids[1:]], "topk_logprobs": -np.sort(-lp[:T - 1], axis=1)[:, :K]}
    kw = dict(logits=bits, input_ids=ids, cu_seqlens=np.array([0, T], dtype=np.int64), topk=K, dtype="bf16")
    return kw, want


class AioChunkedTest(unittest.IsolatedAsyncioTestCase):
    """``logprob_client.aio.LogprobClient`` over ScoreChunked."""

    @classmethod
    def setUpClass(cls):
        cls.server = Server(workers=2, extra=["--lm-head", LM_HEAD], metrics=True)
        cls.addClassCleanup(cls.server.close)

    async def asyncSetUp(self):
        # IsolatedAsyncioTestCase runs the loop in debug mode, which logs every
        # slow callback (numpy work on a busy machine); not what is tested here.
        asyncio.get_running_loop().set_debug(False)

    async def client(self, chunk_above, piece_bytes=transport.PIECE_BYTES, address=None, **kwargs):
        # Inline bytes, as ChunkedTest.client: on this host the client would
        # otherwise send the tensors through shared memory.
        kwargs.setdefault("shared_memory", False)
        c = aio.LogprobClient(address or self.server.address, **kwargs)
        c.chunk_above = chunk_above
        c.piece_bytes = piece_bytes
        self.addAsyncCleanup(c.close)
        return c

    def requests(self, method, code="OK"):
        return self.server.metric("logprob_requests_total", code=code, method=method)

    async def test_golden_cases_in_pieces_equal_one_message(self):
        one = await self.client(chunk_above=-1)
        pieces = await self.client(chunk_above=0, piece_bytes=1000)
        names = LOGITS_CASES + ["hidden_bf16"]
        score_before, chunked_before = self.requests("Score"), self.requests("ScoreChunked")
        cancelled_before = self.requests("ScoreChunked", code="CANCELLED")
        for name in names:
            with self.subTest(case=name):
                g = Golden(name)
                a = await one.score(**g.score_kwargs())
                b = await pieces.score(**g.score_kwargs())
                self.assertEqual(compare(g.expected, b.outputs), "")
                assert_same_bytes(self, a.outputs, b.outputs)
                self.assertEqual((b.num_parts, b.attempts), (1, 1))
        # Each client used its own RPC, and every chunked answer was read to
        # its end (a call dropped before its status would count CANCELLED).
        self.assertEqual(self.requests("Score") - score_before, len(names))
        self.assertEqual(self.requests("ScoreChunked") - chunked_before, len(names))
        self.assertEqual(self.requests("ScoreChunked", code="CANCELLED"), cancelled_before)

    async def test_large_outputs_come_back_in_pieces(self):
        # 8 MB of input: over OFFLOAD_BYTES, so the pieces are made in the executor.
        kw, want = large_output_case()
        self.assertGreaterEqual(kw["logits"].nbytes, aio.OFFLOAD_BYTES)
        a = await (await self.client(chunk_above=-1)).score(**kw)
        b = await (await self.client(chunk_above=0)).score(**kw)
        assert_same_bytes(self, a.outputs, b.outputs)
        self.assertEqual(b.topk_indices.shape, (2047, 1024))
        for k, v in want.items():
            np.testing.assert_allclose(b.outputs[k], v, rtol=2e-5, atol=2e-4, err_msg=k)
        # The sync client's chunked answer is the same.
        sync = self.server.client(shared_memory=False)
        sync.chunk_above = 0
        try:
            c = await asyncio.get_running_loop().run_in_executor(None, lambda: sync.score(**kw))
        finally:
            sync.close()
        assert_same_bytes(self, b.outputs, c.outputs)

    async def test_timeout_bounds_the_chunked_call(self):
        # 256 MB, chunked with the default chunk_above, taking seconds on the
        # server (top-p over V = 65536): the 0.3 s timeout ends the call
        # after it was sent (attempts 1), and the server stops it.
        rng = np.random.default_rng(7)
        T, V = 1024, 65536
        logits = rng.standard_normal((T, V), dtype=np.float32)
        ids = rng.integers(0, V, T)
        c = await self.client(chunk_above=transport.CHUNK_ABOVE)
        await c.server_info()

        def ended():
            return sum(self.requests("ScoreChunked", code=code) for code in ("DEADLINE_EXCEEDED", "CANCELLED"))

        before = ended()
        with self.assertRaises(LogprobError) as cm:
            await c.score(logits=logits, input_ids=ids, cu_seqlens=np.arange(0, T + 1, 128), sampling_top_p=0.9,
                          timeout=0.3)
        self.assertEqual(cm.exception.code, grpc.StatusCode.DEADLINE_EXCEEDED)
        self.assertEqual(cm.exception.attempts, 1)
        await support.until(lambda: ended() > before, "the server to end the ScoreChunked call past its deadline")

    async def test_chunked_call_retried_until_the_server_comes_back(self):
        # The client knows the server (GetServerInfo), the server stops; the
        # chunked call fails UNAVAILABLE and is retried until a server is
        # back on the same port.
        g = Golden("sampling_f32")
        first = Server(workers=1)
        port = first.port
        events = []
        failed = asyncio.Event()

        def on_retry(*a):
            events.append(a)
            failed.set()

        retry = RetryPolicy(max_attempts=1000, initial_backoff=0.05, max_backoff=0.2)
        loop = asyncio.get_running_loop()
        started = {}
        try:
            c = await self.client(chunk_above=0, piece_bytes=4096, address=first.address, retry=retry, timeout=120,
                                  on_retry=on_retry)
            await c.server_info()
            await loop.run_in_executor(None, first.stop)
            task = asyncio.ensure_future(c.score(**g.score_kwargs()))
            await asyncio.wait_for(failed.wait(), 60)
            started["server"] = await loop.run_in_executor(None, lambda: Server(workers=1, port=port))
            res = await asyncio.wait_for(task, 120)
        finally:
            first.close()
            if "server" in started:
                started["server"].close()
        self.assertEqual(compare(g.expected, res.outputs), "")
        self.assertGreater(len(events), 0)
        self.assertTrue(all(e[1] == grpc.StatusCode.UNAVAILABLE for e in events), events)
        self.assertEqual(res.attempts, len(events) + 1)

    async def test_cancelling_the_task_cancels_the_chunked_call_on_the_server(self):
        c = await self.client(chunk_above=transport.CHUNK_ABOVE, timeout=600)  # 64 MB: chunked
        await c.server_info()
        score_before = self.requests("Score", code="CANCELLED")
        self.assertTrue(await support.cancel_on_server(self.server, c, "ScoreChunked"),
                        "the slow request always finished before it could be cancelled")
        self.assertEqual(self.requests("Score", code="CANCELLED"), score_before)


if __name__ == "__main__":
    unittest.main()
