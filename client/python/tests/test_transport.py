"""Tests of the Python client's chunked transport (logprob_client/transport.py,
the ScoreChunked RPC) against a live logprob-server: golden cases give the
same arrays in pieces as in one message, large outputs come back in pieces,
and a 300 MB request scores with the default limits."""

import os
import unittest

import numpy as np

import support  # noqa: F401  (puts client/python on sys.path)
from support import LOGITS_CASES, Golden, Server, compare

from logprob_client import bf16_bits_to_float32, float32_to_bf16_bits, transport

LM_HEAD = os.path.join(support.GOLDEN_DIR, "hidden_bf16.lm_head.safetensors")


class ChunkedTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.server = Server(workers=2, extra=["--lm-head", LM_HEAD])
        cls.addClassCleanup(cls.server.close)

    def client(self, chunk_above, piece_bytes=transport.PIECE_BYTES):
        c = self.server.client()
        c.chunk_above = chunk_above
        c.piece_bytes = piece_bytes
        self.addCleanup(c.close)
        return c

    def test_piece_header_matches_protobuf(self):
        from logprob_client._proto import pb2

        part = pb2.ScoreRequestPart(piece=pb2.TensorPiece(tensor=3, offset=1 << 33, data=b"abcde"))
        self.assertEqual(transport.piece_header(3, 1 << 33, 5) + b"abcde", part.SerializeToString())
        kind, (tensor, offset, data) = transport.parse_part(part.SerializeToString())
        self.assertEqual((kind, tensor, offset, bytes(data)), ("piece", 3, 1 << 33, b"abcde"))

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
        c = self.server.client()
        self.addCleanup(c.close)
        res = c.score(logits=logits, input_ids=ids, cu_seqlens=np.array([0, T]), dtype="bf16")
        self.assertEqual(res.num_parts, 1)
        want = x[ids[1:]] - lse
        np.testing.assert_allclose(res.token_logprobs, want, rtol=2e-5, atol=2e-4)


if __name__ == "__main__":
    unittest.main()
