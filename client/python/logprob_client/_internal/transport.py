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

The sync client sends with ``ChunkedScore``, the asyncio client with
``AioChunkedScore``; both make the parts with ``request_parts`` and read
the answer with ``ResponseAssembler``, to the call's end (its status).
"""

import asyncio
import math
from typing import Any, AsyncIterator, Dict, Iterable, Iterator, List, Optional, Tuple

import numpy as np

from ._proto import pb2
from .tensors import NUMPY_DTYPE
from .wire import WireResponse, _fields, _signed64, decode_response, varint

METHOD = "/logprob.v1.LogprobService/ScoreChunked"
# Requests of more bytes than this go chunked (None or < 0: never); pieces
# carry PIECE_BYTES bytes of data; tensors up to INLINE_BYTES ride in the
# first part. A client's ``chunk_above`` / ``piece_bytes`` attributes
# (``base.ClientBase``) default to the first two.
CHUNK_ABOVE = 8 << 20
PIECE_BYTES = 2 << 20  # the server's (common/chunk_codec.h, which says why)
INLINE_BYTES = 64 << 10
# The most output bytes a ScoreChunked answer may announce in pieces, as
# the C++ client's limit (client/chunked_call.cc): beyond it the answer is
# refused, not allocated.
MAX_RESPONSE_BYTES = 16 << 30


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
    header = inputs.header(request_id)
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
    of data))``. Raises ValueError ("malformed chunked part: ...") when the
    bytes break the rules of ``tests/data/chunk_codec/README.md``, which
    the server's codec (``common/chunk_codec.h``) shares: not exactly one
    message or one piece (both, neither, either twice), truncated or
    overlong varints, a field running past the part or the piece, a known
    field of the wrong wire type, a duplicate field in the piece, a
    negative tensor or offset, a tensor above 2^31 - 1. Unknown fields are
    skipped."""
    try:
        return _parse_part(memoryview(raw))
    except ValueError as e:
        raise ValueError("malformed chunked part: %s" % e) from None


_PART_FIELDS = {1: "message", 2: "piece"}
# TensorPiece's fields: number -> (name, wire type).
_PIECE_FIELDS = {1: ("tensor", 0), 2: ("offset", 0), 3: ("data", 2)}
_INT32_MAX = (1 << 31) - 1


def _parse_part(buf: memoryview) -> Tuple[str, Any]:
    """``parse_part`` without the error prefix."""
    found: Optional[Tuple[str, Any]] = None
    for field, wire_type, value in _fields(buf, 0, len(buf)):
        kind = _PART_FIELDS.get(field)
        if kind is None:
            continue  # unknown: skipped
        if wire_type != 2:
            raise ValueError("the %s (field %d) has wire type %d, not 2 (length-delimited)" % (kind, field, wire_type))
        if found is not None:
            raise ValueError("duplicate %s" % kind if found[0] == kind else "both a message and a piece")
        found = (kind, value if kind == "message" else _parse_piece(value))
    if found is None:
        raise ValueError("neither a message nor a piece")
    return found


def _parse_piece(buf: memoryview) -> Tuple[int, int, memoryview]:
    """``(tensor, offset, data)`` of the TensorPiece in ``buf`` (missing
    fields: 0, 0, empty)."""
    values: Dict[str, Any] = {}
    for field, wire_type, value in _fields(buf, 0, len(buf)):
        known = _PIECE_FIELDS.get(field)
        if known is None:
            continue  # unknown: skipped
        name, expected = known
        if wire_type != expected:
            raise ValueError("the piece's %s (field %d) has wire type %d, not %d" % (name, field, wire_type, expected))
        if name in values:
            raise ValueError("duplicate %s in the piece" % name)
        if name != "data":
            value = _signed64(value)
            if value < 0:
                raise ValueError("%s %d is negative" % ("tensor index" if name == "tensor" else name, value))
            if name == "tensor" and value > _INT32_MAX:
                raise ValueError("tensor index %d is out of range (above 2^31 - 1)" % value)
        values[name] = value
    return values.get("tensor", 0), values.get("offset", 0), values.get("data", buf[0:0])


class ResponseAssembler:
    """Reads the serialized ``ScoreResponsePart``s of one ScoreChunked
    answer, fed one at a time (``feed``) by the sync or the asyncio client,
    into a ``wire.WireResponse``: the first part's response, with the data
    of its pieced outputs copied from the pieces that follow into one
    buffer each. Raises ValueError for a malformed answer (a first part
    that is not the response, a second response, a piece out of order or
    past its output's size, bytes missing at the end). Not thread-safe."""

    def __init__(self) -> None:
        self._resp: Optional[WireResponse] = None
        self._buffers: Dict[int, bytearray] = {}
        self._received: Dict[int, int] = {}
        self._missing = 0

    def feed(self, raw: Any) -> None:
        """Takes the next serialized part of the answer."""
        kind, body = parse_part(raw)
        if self._resp is None:
            if kind != "message":
                raise ValueError("the first answer part is not the response")
            self._start(decode_response(body))
            return
        if kind != "piece":
            raise ValueError("a second response part")
        i, offset, data = body
        buf = self._buffers.get(i)
        if buf is None or offset != self._received[i] or offset + len(data) > len(buf):
            raise ValueError("unexpected piece for output %d at offset %d" % (i, offset))
        buf[offset:offset + len(data)] = data
        self._received[i] += len(data)
        self._missing -= len(data)

    def _start(self, resp: WireResponse) -> None:
        sizes = {}
        for i, t in enumerate(resp.outputs):
            dt = NUMPY_DTYPE.get(t.dtype)
            if dt is None:
                raise ValueError("output '%s' has unsupported dtype %d" % (t.name, t.dtype))
            if any(int(d) < 0 for d in t.shape):
                raise ValueError("output '%s' has a negative dimension in %s" % (t.name, list(t.shape)))
            size = math.prod(int(d) for d in t.shape) * dt.itemsize  # exact: no int64 wrap-around
            if len(t.data) == 0 and size > 0:
                sizes[i] = size
        total = sum(sizes.values())
        if total > MAX_RESPONSE_BYTES:  # a broken or hostile answer: an error, not an allocation
            raise ValueError("the answer announces %d bytes in pieces, over the client's limit of %d"
                             % (total, MAX_RESPONSE_BYTES))
        for i, size in sizes.items():
            self._buffers[i] = bytearray(size)
            self._received[i] = 0
        self._missing = total
        self._resp = resp

    def result(self) -> WireResponse:
        """The assembled answer (its pieced outputs view their buffers).
        Raises ValueError when parts are missing."""
        if self._resp is None:
            raise ValueError("ScoreChunked ended without an answer")
        if self._missing > 0:
            raise ValueError("the answer ended with %d bytes of outputs missing" % self._missing)
        for i, buf in self._buffers.items():
            self._resp.outputs[i].data = memoryview(buf)
        return self._resp


def assemble_response(parts: Iterable[Any]) -> WireResponse:
    """Reads serialized ``ScoreResponsePart``s from ``parts`` to its end (a
    grpc call's end: its status) into a ``wire.WireResponse`` (see
    ``ResponseAssembler``). Raises ValueError for a malformed or incomplete
    answer, ``grpc.RpcError`` for a failed call."""
    assembler = ResponseAssembler()
    for raw in parts:
        assembler.feed(raw)
    return assembler.result()


def open_method(channel: Any) -> Any:
    """The ScoreChunked multicallable of ``channel`` (``grpc`` or
    ``grpc.aio``): parts go as the bytes ``request_parts`` makes and come
    back as bytes (no serializer / deserializer)."""
    return channel.stream_stream(METHOD)


def _check_piece_bytes(piece_bytes: int) -> int:
    if piece_bytes < 1:
        raise ValueError("piece_bytes must be >= 1")
    return int(piece_bytes)


class ChunkedScore:
    """A callable sending one request through ScoreChunked over ``method``
    (``open_method`` of a ``grpc`` channel): ``call((request_id, inputs),
    timeout=None, metadata=None)`` returns the answer as a
    ``wire.WireResponse``; raises ``grpc.RpcError`` for a failed call,
    like a grpcio multicallable, so the clients' retry loop treats both
    alike, and ValueError for a malformed answer."""

    def __init__(self, method: Any, piece_bytes: int = PIECE_BYTES) -> None:
        self._method = method
        self.piece_bytes = _check_piece_bytes(piece_bytes)

    def __call__(self, request: Tuple[str, Any], timeout: Optional[float] = None, metadata: Any = None) -> WireResponse:
        request_id, inputs = request
        answer = self._method(request_parts(request_id, inputs, self.piece_bytes), timeout=timeout, metadata=metadata)
        try:
            return assemble_response(answer)
        finally:
            answer.cancel()  # a no-op once the call has ended


class AioChunkedScore:
    """The asyncio twin of ``ChunkedScore`` over ``method`` (``open_method``
    of a ``grpc.aio`` channel): ``await call((request_id, inputs),
    timeout=None, metadata=None)``, same parts, answer and errors. With
    ``offload_bytes`` set and at least that many bytes of tensor data, each
    part is made (the one copy of its bytes) in the loop's default
    executor, so the copies do not stall the loop's other tasks.
    Cancelling the awaiting task cancels the RPC."""

    def __init__(self, method: Any, piece_bytes: int = PIECE_BYTES, offload_bytes: Optional[int] = None) -> None:
        self._method = method
        self.piece_bytes = _check_piece_bytes(piece_bytes)
        self.offload_bytes = offload_bytes

    async def __call__(
        self, request: Tuple[str, Any], timeout: Optional[float] = None, metadata: Any = None
    ) -> WireResponse:
        request_id, inputs = request
        parts = request_parts(request_id, inputs, self.piece_bytes)
        if self.offload_bytes is not None and inputs.data_bytes() >= self.offload_bytes:
            call = self._method(parts_in_executor(parts), timeout=timeout, metadata=metadata)
        else:
            call = self._method(parts, timeout=timeout, metadata=metadata)
        try:
            assembler = ResponseAssembler()
            async for raw in call:
                assembler.feed(raw)
            return assembler.result()
        finally:
            call.cancel()  # a no-op once the call has ended


async def parts_in_executor(parts: Iterator[bytes]) -> AsyncIterator[bytes]:
    """``parts`` as an async iterator whose items are made, one at a time,
    in the running loop's default executor: the next while the caller
    sends the one before (one part ahead at most)."""
    loop = asyncio.get_running_loop()
    end = object()
    pending = loop.run_in_executor(None, next, parts, end)
    while True:
        part = await pending
        if part is end:
            return
        pending = loop.run_in_executor(None, next, parts, end)
        yield part  # type: ignore[misc]
