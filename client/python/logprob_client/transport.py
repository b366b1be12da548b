"""Large requests as a stream of pieces (``ScoreChunked``).

One gRPC message of tens of MB moves several times slower than the same
bytes in messages of a few MB (README "Large requests"), and building a
``ScoreRequest`` protobuf copies the tensor bytes several times
(``tobytes``, the message's bytes field, ``SerializeToString``). This
module sends a request of any size through the ``ScoreChunked`` RPC of
``proto/logprob/v1/logprob.proto`` and frames each part by hand:

- the first part is ``ScoreRequestPart{request}``: the request with every
  tensor's name, dtype and shape, and the data of tensors up to
  ``INLINE_BYTES`` (ids, lengths);
- then ``ScoreRequestPart{piece}`` parts, ``TensorPiece{tensor, offset,
  data}`` in order, each written as its protobuf header (tags and varints)
  joined with a ``memoryview`` slice of the caller's array: one copy of the
  array's bytes in this module (grpcio then copies each part into its own
  send buffer; that copy cannot be avoided through grpcio's API).

The answer comes back the same way (the response, then pieces of its large
outputs) and is read into a ``wire.WireResponse`` whose outputs view the
received bytes (small outputs) or the buffer their pieces were copied into
(one copy), so the clients turn it into numpy / torch outputs as any
``Score`` answer.
"""

from typing import Any, Iterator, List, Optional, Tuple

import numpy as np

from ._proto import pb2
from .tensors import NUMPY_DTYPE
from .wire import WireResponse, _fields, decode_response, varint

METHOD = "/logprob.v1.LogprobService/ScoreChunked"
# Requests of more bytes than this go chunked (None or < 0: never); pieces
# carry PIECE_BYTES bytes of data; tensors up to INLINE_BYTES ride in the
# first part. A client's ``chunk_above`` / ``piece_bytes`` attributes, when
# set, override the first two.
CHUNK_ABOVE = 8 << 20
PIECE_BYTES = 4 << 20
INLINE_BYTES = 64 << 10


def use_chunked(inputs: Any, chunk_above: Optional[int] = CHUNK_ABOVE) -> bool:
    """True when ``inputs`` (a ``splitter.Inputs``) should go chunked."""
    return chunk_above is not None and chunk_above >= 0 and inputs.data_bytes() > chunk_above


def piece_header(tensor: int, offset: int, size: int) -> bytes:
    """The bytes of a ``ScoreRequestPart{piece}`` (or ``ScoreResponsePart``)
    before the piece's data: field 2's tag and length, then ``tensor``,
    ``offset`` and the data's tag and length."""
    inner = b"\x08" + varint(tensor) + b"\x10" + varint(offset) + b"\x1a" + varint(size)
    return b"\x12" + varint(len(inner) + size) + inner


def request_parts(
    request_id: str, inputs: Any, piece_bytes: int = PIECE_BYTES, inline_bytes: int = INLINE_BYTES
) -> Iterator[bytes]:
    """Yields the serialized parts of ``inputs`` (a ``splitter.Inputs``:
    ``tensors`` as ``(name, wire_dtype, array)`` and ``options``) as a
    ScoreChunked request with id ``request_id``: each piece is its header
    joined with a ``memoryview`` slice of the array (one copy)."""
    header = pb2.ScoreRequest(id=request_id, options=inputs.options)
    pieced: List[Tuple[int, memoryview]] = []
    for i, (name, dt, arr) in enumerate(inputs.tensors):
        arr = np.ascontiguousarray(arr, dtype=NUMPY_DTYPE[dt])
        t = header.inputs.add(name=name, dtype=dt, shape=[int(d) for d in arr.shape])
        if arr.nbytes > inline_bytes:
            pieced.append((i, memoryview(arr.reshape(-1).view(np.uint8))))
        else:
            t.data = arr.tobytes()
    first = header.SerializeToString()
    yield b"\x0a" + varint(len(first)) + first
    for i, view in pieced:
        for off in range(0, len(view), piece_bytes):
            chunk = view[off:off + piece_bytes]
            yield b"".join((piece_header(i, off, len(chunk)), chunk))


def parse_part(raw: Any) -> Tuple[str, Any]:
    """Parses one serialized ``ScoreResponsePart`` (or request part):
    ``("message", memoryview)`` or ``("piece", (tensor, offset, memoryview
    of data))``. Raises ValueError when malformed."""
    buf = memoryview(raw)
    found = None
    for field, wire_type, value in _fields(buf, 0, len(buf)):
        if field == 1 and wire_type == 2:
            found = ("message", value)
        elif field == 2 and wire_type == 2:
            tensor, offset, data = 0, 0, value[0:0]
            for f, w, v in _fields(value, 0, len(value)):
                if f == 1 and w == 0:
                    tensor = v
                elif f == 2 and w == 0:
                    offset = v
                elif f == 3 and w == 2:
                    data = v
            found = ("piece", (tensor, offset, data))
    if found is None:
        raise ValueError("neither a message nor a piece")
    return found


def assemble_response(parts: Iterator[bytes]) -> WireResponse:
    """Reads serialized ``ScoreResponsePart``s from ``parts`` into a
    ``wire.WireResponse``: the first part's response, with the data of its
    pieced outputs copied from the pieces that follow into one buffer each.
    Raises ValueError for a malformed answer, StopIteration when ``parts``
    ends before the response."""
    parts = iter(parts)
    kind, body = parse_part(next(parts))
    if kind != "message":
        raise ValueError("the first answer part is not the response")
    resp = decode_response(body)
    buffers, received = {}, {}
    for i, t in enumerate(resp.outputs):
        dt = NUMPY_DTYPE.get(t.dtype)
        if dt is None:
            raise ValueError("output '%s' has unsupported dtype %d" % (t.name, t.dtype))
        size = int(np.prod(t.shape, dtype=np.int64)) * dt.itemsize if t.shape else dt.itemsize
        if len(t.data) == 0 and size > 0:
            buffers[i] = bytearray(size)
            received[i] = 0
    missing = sum(len(b) for b in buffers.values())
    while missing > 0:
        try:
            kind, piece = parse_part(next(parts))
        except StopIteration:
            raise ValueError("the answer ended with %d bytes of outputs missing" % missing) from None
        if kind != "piece":
            raise ValueError("a second response part")
        i, offset, data = piece
        if i not in buffers or offset != received[i] or offset + len(data) > len(buffers[i]):
            raise ValueError("unexpected piece for output %d at offset %d" % (i, offset))
        buffers[i][offset:offset + len(data)] = data
        received[i] += len(data)
        missing -= len(data)
    for i, buf in buffers.items():
        resp.outputs[i].data = memoryview(buf)
    return resp


class ChunkedScore:
    """A callable sending one request through ScoreChunked on ``channel``
    (a ``grpc`` channel): ``call((request_id, inputs), timeout=None,
    metadata=None)`` returns the answer as a ``wire.WireResponse``; raises
    ``grpc.RpcError`` for a failed call, like a grpcio multicallable, so
    the clients' retry loop treats both alike."""

    def __init__(self, channel: Any, piece_bytes: int = PIECE_BYTES) -> None:
        if piece_bytes < 1:
            raise ValueError("piece_bytes must be >= 1")
        self._method = channel.stream_stream(METHOD)
        self.piece_bytes = int(piece_bytes)

    def __call__(self, request: Tuple[str, Any], timeout: Optional[float] = None, metadata: Any = None) -> WireResponse:
        request_id, inputs = request
        answer = self._method(request_parts(request_id, inputs, self.piece_bytes), timeout=timeout, metadata=metadata)
        try:
            return assemble_response(answer)
        except StopIteration:
            raise ValueError("ScoreChunked ended without an answer") from None
