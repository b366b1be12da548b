"""Property tests (hypothesis) of the Python client's ScoreChunked answer
reassembly (``transport.ResponseAssembler``): any response whose outputs
are cut into pieces of any sizes reassembles to exactly its outputs; a
stream broken in any way (a piece dropped, moved, shifted, sent twice, a
second response part, an answer announcing more than the client's limit)
raises ValueError and never returns wrong data. The C++ side is fuzzed
(tests/fuzz/fuzz_chunked.cc)."""
import unittest

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from logprob_client._internal import transport
from logprob_client._internal._proto import pb2
from logprob_client._internal.wire import varint

DTYPES = {pb2.F32: np.float32, pb2.I64: np.int64, pb2.BF16: np.uint16, pb2.F16: np.float16, pb2.I32: np.int32}


def message_part(resp):
    body = resp.SerializeToString()
    return b"\x0a" + varint(len(body)) + body


@st.composite
def answers(draw):
    """(response with every output's data, [output index pieced], parts)."""
    resp = pb2.ScoreResponse(id=draw(st.text(max_size=8)))
    pieced = []
    for i in range(draw(st.integers(0, 4))):
        dt = draw(st.sampled_from(sorted(DTYPES)))
        shape = draw(st.lists(st.integers(0, 6), max_size=3))
        n = int(np.prod(shape, dtype=np.int64)) if shape else 1
        data = draw(st.binary(min_size=n * np.dtype(DTYPES[dt]).itemsize, max_size=n * np.dtype(DTYPES[dt]).itemsize))
        resp.outputs.add(name="out%d" % i, dtype=dt, shape=shape, data=data)
        if data and draw(st.booleans()):
            pieced.append(i)
    header = pb2.ScoreResponse()
    header.CopyFrom(resp)
    for i in pieced:
        header.outputs[i].data = b""
    parts = [message_part(header)]
    for i in pieced:
        data = resp.outputs[i].data
        off = 0
        while off < len(data):
            size = draw(st.integers(1, max(1, len(data) - off)))
            parts.append(transport.piece_header(i, off, size) + data[off:off + size])
            off += size
    return resp, pieced, parts


def assemble(parts):
    return transport.assemble_response(parts)


class ReassemblyPropertyTest(unittest.TestCase):
    @settings(max_examples=300, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
    @given(answers())
    def test_any_cut_of_a_response_reassembles_to_its_outputs(self, answer):
        resp, _, parts = answer
        got = assemble(parts)
        self.assertEqual(len(got.outputs), len(resp.outputs))
        for g, e in zip(got.outputs, resp.outputs):
            self.assertEqual((g.name, g.dtype, list(g.shape)), (e.name, e.dtype, list(e.shape)))
            self.assertEqual(bytes(g.data), e.data)

    @settings(max_examples=300, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
    @given(answers(), st.data())
    def test_a_broken_stream_raises_and_never_returns_other_data(self, answer, data):
        resp, pieced, parts = answer
        if len(parts) < 2:
            return  # nothing in pieces: nothing to break
        broken = list(parts)
        how = data.draw(st.sampled_from(["drop", "swap", "twice", "shift", "second_response"]))
        k = data.draw(st.integers(1, len(parts) - 1))
        if how == "drop":
            del broken[k]
        elif how == "swap":
            j = data.draw(st.integers(1, len(parts) - 1))
            if j == k:
                return
            broken[j], broken[k] = broken[k], broken[j]
        elif how == "twice":
            broken.insert(k, broken[k])
        elif how == "shift":
            kind, (i, off, chunk) = transport.parse_part(broken[k])
            broken[k] = transport.piece_header(i, off + 1, len(chunk)) + bytes(chunk)
        else:
            broken.insert(k, parts[0])
        try:
            got = assemble(broken)
        except ValueError:
            return
        # Swapping two pieces of different outputs keeps every output's order: still exact.
        self.assertEqual(how, "swap")
        for g, e in zip(got.outputs, resp.outputs):
            self.assertEqual(bytes(g.data), e.data)

    def test_an_answer_announcing_more_than_the_limit_is_refused_before_any_allocation(self):
        for shape in ([1 << 40], [1 << 62, 1 << 62], [-1, 8]):
            header = pb2.ScoreResponse()
            header.outputs.add(name="token_logprobs", dtype=pb2.F32, shape=shape)
            with self.assertRaises(ValueError) as e:
                assemble([message_part(header)])
            self.assertRegex(str(e.exception), "over the client's limit|negative dimension")


if __name__ == "__main__":
    unittest.main()
