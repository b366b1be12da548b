"""The Python client's ScoreChunked part codec (logprob_client/_internal/transport.py:
``parse_part``, ``piece_header``) against the golden parts of
tests/data/chunk_codec/parts.json (``LOGPROB_CHUNK_CODEC_GOLDEN_DIR``), the
cases the C++ codec is tested against too (tests/chunk_codec_test.cc,
``GoldenParts``); the rules are in that directory's README.md. No server."""

import json
import os
import unittest

import support  # noqa: F401  (puts client/python on sys.path)
from support import CHUNK_CODEC_GOLDEN_DIR

from logprob_client._internal import transport


def load_cases():
    """The cases of parts.json (see its README.md)."""
    with open(os.path.join(CHUNK_CODEC_GOLDEN_DIR, "parts.json")) as f:
        return json.load(f)["cases"]


class CodecGoldenTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.cases = load_cases()

    def parsed(self, buf):
        """parse_part(buf) as the golden file writes results."""
        try:
            kind, body = transport.parse_part(buf)
        except ValueError as e:
            return {"error": str(e)}
        if kind == "message":
            return {"message": bytes(body).hex()}
        tensor, offset, data = body
        return {"piece": {"tensor": tensor, "offset": offset, "data": bytes(data).hex()}}

    def test_parse_part_gives_the_golden_result(self):
        self.assertGreaterEqual(len(self.cases), 50)
        for case in self.cases:
            raw = bytes.fromhex(case["part"])
            # As grpcio hands it over (bytes), and as a view into a larger
            # buffer (offsets are relative to the part).
            for how, buf in (("bytes", raw), ("view", memoryview(b"\x0a" + raw + b"\x12\xff")[1:-2])):
                with self.subTest(case=case["name"], given=how):
                    got = self.parsed(buf)
                    expect = case["expect"]
                    if "error" not in expect:
                        self.assertEqual(got, expect)
                        continue
                    self.assertIn("error", got, "parsed, expected an error with %r" % expect["error"])
                    self.assertTrue(got["error"].startswith("malformed chunked part: "), got["error"])
                    self.assertIn(expect["error"], got["error"])

    def test_piece_header_writes_the_canonical_pieces(self):
        checked = 0
        for case in self.cases:
            if not case.get("canonical"):
                continue
            with self.subTest(case=case["name"]):
                piece = case["expect"]["piece"]
                data = bytes.fromhex(piece["data"])
                header = transport.piece_header(piece["tensor"], piece["offset"], len(data))
                self.assertEqual((header + data).hex(), case["part"])
                checked += 1
        self.assertGreaterEqual(checked, 6)


if __name__ == "__main__":
    unittest.main()
