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
outputs), and its outputs are numpy arrays over the assembled bytes (one
copy from the received parts).
"""

import numpy as np

from ._proto import pb2
from .tensors import BF16, NUMPY_DTYPE, bf16_bits_to_float32

METHOD = "/logprob.v1.LogprobService/ScoreChunked"
# Requests of more bytes than this go chunked (None or < 0: never); pieces
# carry PIECE_BYTES bytes of data; tensors up to INLINE_BYTES ride in the
# first part.
CHUNK_ABOVE = 8 << 20
PIECE_BYTES = 4 << 20
INLINE_BYTES = 64 << 10


def use_chunked(inputs, chunk_above=CHUNK_ABOVE):
    """True when ``inputs`` (a ``splitter.Inputs``) should go chunked."""
    return chunk_above is not None and chunk_above >= 0 and inputs.data_bytes() > chunk_above


def _varint(v):
    out = bytearray()
    while v >= 0x80:
        out.append((v & 0x7F) | 0x80)
        v >>= 7
    out.append(v)
    return bytes(out)


def piece_header(tensor, offset, size):
    """The bytes of a ``ScoreRequestPart{piece}`` (or ``ScoreResponsePart``)
    before the piece's data: field 2's tag and length, then ``tensor``,
    ``offset`` and the data's tag and length."""
    inner = b"\x08" + _varint(tensor) + b"\x10" + _varint(offset) + b"\x1a" + _varint(size)
    return b"\x12" + _varint(len(inner) + size) + inner


def _bytes_view(arr):
    return memoryview(np.ascontiguousarray(arr)).cast("B")


def request_parts(request_id, inputs, piece_bytes=PIECE_BYTES, inline_bytes=INLINE_BYTES):
    """Yields the serialized parts of ``inputs`` (a ``splitter.Inputs``:
    ``tensors`` as ``(name, wire_dtype, array)`` and ``options``) as a
    ScoreChunked request with id ``request_id``."""
    header = pb2.ScoreRequest(id=request_id, options=inputs.options)
    pieced = []
    for i, (name, dt, arr) in enumerate(inputs.tensors):
        t = header.inputs.add(name=name, dtype=dt, shape=[int(d) for d in arr.shape])
        if arr.nbytes > inline_bytes:
            pieced.append((i, _bytes_view(np.asarray(arr, dtype=NUMPY_DTYPE[dt]))))
        else:
            t.data = np.ascontiguousarray(arr, dtype=NUMPY_DTYPE[dt]).tobytes()
    first = header.SerializeToString()
    yield b"\x0a" + _varint(len(first)) + first
    for i, view in pieced:
        for off in range(0, len(view), piece_bytes):
            chunk = view[off:off + piece_bytes]
            yield b"".join((piece_header(i, off, len(chunk)), chunk))


def _read_varint(buf, pos):
    result = shift = 0
    while True:
        if pos >= len(buf):
            raise ValueError("truncated varint")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7
        if shift >= 64:
            raise ValueError("varint too long")


def _skip(buf, pos, wire_type):
    if wire_type == 0:
        return _read_varint(buf, pos)[1]
    if wire_type == 1:
        return pos + 8
    if wire_type == 2:
        n, pos = _read_varint(buf, pos)
        return pos + n
    if wire_type == 5:
        return pos + 4
    raise ValueError("unknown wire type %d" % wire_type)


def parse_part(buf):
    """Parses one serialized ``ScoreResponsePart`` (or request part):
    returns ``("message", memoryview)`` or ``("piece", (tensor, offset,
    memoryview of data))``. Raises ValueError when malformed."""
    mv = memoryview(buf)
    pos, found = 0, None
    while pos < len(mv):
        tag, pos = _read_varint(mv, pos)
        field, wt = tag >> 3, tag & 7
        if field in (1, 2) and wt == 2:
            n, pos = _read_varint(mv, pos)
            if pos + n > len(mv):
                raise ValueError("truncated part")
            body = mv[pos:pos + n]
            pos += n
            if field == 1:
                found = ("message", body)
                continue
            tensor = offset = 0
            data = body[0:0]
            p = 0
            while p < len(body):
                t, p = _read_varint(body, p)
                f, w = t >> 3, t & 7
                if f == 1 and w == 0:
                    tensor, p = _read_varint(body, p)
                elif f == 2 and w == 0:
                    offset, p = _read_varint(body, p)
                elif f == 3 and w == 2:
                    k, p = _read_varint(body, p)
                    data = body[p:p + k]
                    p += k
                else:
                    p = _skip(body, p, w)
            found = ("piece", (tensor, offset, data))
        else:
            pos = _skip(mv, pos, wt)
    if found is None:
        raise ValueError("neither a message nor a piece")
    return found


def _numel(shape):
    return int(np.prod(shape, dtype=np.int64)) if shape else 1


class ChunkedResponse:
    """The answer of a ScoreChunked call: ``id`` and ``outputs``, a dict of
    numpy arrays by name (BF16 as float32, like ``tensors.from_tensor``)."""

    def __init__(self, request_id, outputs):
        self.id = request_id
        self.outputs = outputs


def assemble_response(parts):
    """Reads serialized ``ScoreResponsePart``s from the iterator ``parts``
    into a ``ChunkedResponse``. Raises ValueError for a malformed answer."""
    parts = iter(parts)
    kind, body = parse_part(next(parts))
    if kind != "message":
        raise ValueError("the first answer part is not the response")
    resp = pb2.ScoreResponse.FromString(bytes(body))
    buffers, received, meta = {}, {}, []
    for i, t in enumerate(resp.outputs):
        shape = tuple(int(d) for d in t.shape)
        dt = NUMPY_DTYPE.get(t.dtype)
        if dt is None:
            raise ValueError("output '%s' has unsupported dtype %d" % (t.name, t.dtype))
        size = _numel(shape) * dt.itemsize
        if len(t.data) == 0 and size > 0:
            buffers[i] = bytearray(size)
            received[i] = 0
            meta.append((t.name, t.dtype, dt, shape, None))
        else:
            if len(t.data) != size:
                raise ValueError("output '%s' has %d bytes; shape %s needs %d" % (t.name, len(t.data), list(shape), size))
            meta.append((t.name, t.dtype, dt, shape, t.data))
    missing = sum(len(b) for b in buffers.values())
    while missing > 0:
        try:
            kind, body = parse_part(next(parts))
        except StopIteration:
            raise ValueError("the answer ended with %d bytes of outputs missing" % missing) from None
        if kind != "piece":
            raise ValueError("a second response part")
        i, offset, data = body
        if i not in buffers or offset != received[i] or offset + len(data) > len(buffers[i]):
            raise ValueError("unexpected piece for output %d at offset %d" % (i, offset))
        buffers[i][offset:offset + len(data)] = data
        received[i] += len(data)
        missing -= len(data)
    outputs = {}
    for i, (name, wire, dt, shape, data) in enumerate(meta):
        arr = np.frombuffer(buffers[i] if data is None else data, dtype=dt).reshape(shape)
        outputs[name] = bf16_bits_to_float32(arr).reshape(shape) if wire == BF16 else arr
    return ChunkedResponse(resp.id, outputs)


class ChunkedScore:
    """A callable sending one request through ScoreChunked on ``channel``:
    ``call((request_id, inputs), timeout=None, metadata=None)`` returns a
    ``ChunkedResponse``; raises ``grpc.RpcError`` for a failed call (like a
    grpcio multicallable, so retry loops treat both alike)."""

    def __init__(self, channel, piece_bytes=PIECE_BYTES):
        if piece_bytes < 1:
            raise ValueError("piece_bytes must be >= 1")
        self._method = channel.stream_stream(METHOD, request_serializer=None, response_deserializer=None)
        self.piece_bytes = int(piece_bytes)

    def __call__(self, request, timeout=None, metadata=None):
        request_id, inputs = request
        answer = self._method(request_parts(request_id, inputs, self.piece_bytes), timeout=timeout, metadata=metadata)
        try:
            return assemble_response(answer)
        except StopIteration:
            raise ValueError("ScoreChunked ended without an answer") from None
