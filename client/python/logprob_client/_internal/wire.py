"""A ``logprob.v1.ScoreRequest`` serialized straight from the caller's
arrays: the protobuf wire bytes, with each tensor's ``data`` field filled
by one copy from the array's memory, contiguous or not.

Building a ``ScoreRequest`` message instead copies each array three times
(``tobytes``; into the C++ message; ``SerializeToString``). Here the small
parts (id, options, each tensor's name / dtype / shape) are serialized by
protobuf and the data is copied in once:

- on CPython, into a ``bytes`` object allocated at its final size
  (``PyBytes_FromStringAndSize(NULL, n)``) and filled through a numpy view
  of its buffer before anyone else sees it (``np.copyto`` takes any
  strides). gRPC's Python API takes only ``bytes``, so the request cannot
  be a ``bytearray``; a fresh, unshared ``bytes`` is filled exactly like
  CPython's own constructors fill theirs;
- elsewhere, or for small requests, with ``bytes.join`` over the arrays'
  buffers (a strided array is made contiguous first: one more copy).

The result parses as the same ``ScoreRequest`` (protobuf allows fields in
any order), and the clients send it as is (their ``Score`` / ``ScoreStream``
calls take bytes).

The other way, ``decode_response`` reads a ``ScoreResponse``'s bytes as
they came from gRPC, leaving each output's data in place (protobuf's
parser would copy it into the message, and reading ``Tensor.data`` would
copy it again into a new ``bytes``): the clients' numpy outputs are
``np.frombuffer`` views of the received bytes.
"""

import ctypes
import platform
from typing import Any, Iterator, List, Sequence, Tuple

import numpy as np

from ._proto import pb2
from .tensors import NUMPY_DTYPE, Array

_INPUTS_TAG = b"\x12"  # ScoreRequest.inputs: field 2, length-delimited
_DATA_TAG = b"\x22"  # Tensor.data: field 4, length-delimited


def varint(n: int) -> bytes:
    """Protobuf base-128 varint of a non-negative int. Raises ValueError
    for a negative one."""
    if n < 0:
        raise ValueError("varint of a negative int (%d)" % n)
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


# Requests below this size are joined (the fill path's setup is not worth it).
FILL_MIN_BYTES = 1 << 16


def _new_bytes(n: int) -> Tuple[bytes, Array]:
    """A new ``bytes`` of ``n`` (>= 2) uninitialised bytes and a writable
    uint8 view of its buffer (CPython only). Fill it before it is shared."""
    make = ctypes.pythonapi.PyBytes_FromStringAndSize
    make.restype = ctypes.py_object
    make.argtypes = (ctypes.c_char_p, ctypes.c_ssize_t)
    b = make(None, n)
    # ob_sval starts 1 byte before the end of PyBytesObject's basic size.
    buf = (ctypes.c_char * n).from_address(id(b) + bytes.__basicsize__ - 1)
    return b, np.frombuffer(buf, dtype=np.uint8)  # type: ignore[call-overload]


def _fill_works() -> bool:
    """Whether ``_new_bytes`` fills the bytes object it returns (CPython
    with the PyBytesObject layout it assumes); checked once at import."""
    if platform.python_implementation() != "CPython":
        return False
    try:
        b, buf = _new_bytes(16)
        buf[:] = np.arange(16, dtype=np.uint8)
        return b == bytes(range(16))
    except Exception:
        return False


_FILL = _fill_works()


def _tensor_parts(name: str, wire_dtype: int, arr: Array) -> Tuple[bytes, Array]:
    """``(prefix, data)``: the Tensor's bytes up to its data, and the data
    array (wire dtype, the caller's strides)."""
    arr = arr.astype(NUMPY_DTYPE[wire_dtype], copy=False)
    head = pb2.Tensor(name=name, dtype=wire_dtype, shape=[int(d) for d in arr.shape]).SerializeToString()
    data_len = arr.nbytes
    if data_len == 0:  # proto3 leaves an empty bytes field out
        return _INPUTS_TAG + varint(len(head)) + head, arr
    data_head = _DATA_TAG + varint(data_len)
    return _INPUTS_TAG + varint(len(head) + len(data_head) + data_len) + head + data_head, arr


def encode_request(
    request_id: str, tensors: Sequence[Tuple[str, int, Array]], options: Any, fill: Any = None,
    head: str = "", head_version: str = "",
) -> bytes:
    """The serialized ``ScoreRequest{id, inputs, options, head, head_version}`` of
    ``[(name, wire_dtype, array)]`` (arrays in their wire dtype, any
    strides): each array's data copied once. ``fill`` (tests): force
    (True) or avoid (False) the CPython fill path. Thread-safe; reads the
    arrays, never writes them."""
    header = pb2.ScoreRequest(id=request_id, options=options, head=head, head_version=head_version).SerializeToString()
    parts = [_tensor_parts(name, dt, arr) for name, dt, arr in tensors]
    total = len(header) + sum(len(p) + a.nbytes for p, a in parts)
    if fill is None:
        fill = _FILL and total >= FILL_MIN_BYTES
    if fill and total >= 2:
        out, buf = _new_bytes(total)
        pos = 0
        for piece in [(header, None)] + parts:
            prefix, arr = piece
            buf[pos:pos + len(prefix)] = np.frombuffer(prefix, dtype=np.uint8)
            pos += len(prefix)
            if arr is not None and arr.nbytes:
                np.copyto(buf[pos:pos + arr.nbytes].view(arr.dtype).reshape(arr.shape), arr, casting="no")
                pos += arr.nbytes
        assert pos == total
        return out
    pieces: List[Any] = [header]
    for prefix, arr in parts:
        pieces.append(prefix)
        if arr.nbytes:
            # A flat uint8 view of a C-contiguous array: a plain buffer for join.
            pieces.append(np.ascontiguousarray(arr).reshape(-1).view(np.uint8))
    return b"".join(pieces)


class WireTensor:
    """A ``logprob.v1.Tensor`` read from a response's bytes: ``name``,
    ``dtype`` (wire dtype), ``shape`` (list of ints) and ``data`` (a
    memoryview of the response's bytes: no copy)."""

    __slots__ = ("name", "dtype", "shape", "data")

    def __init__(self) -> None:
        self.name = ""
        self.dtype = 0
        self.shape: List[int] = []
        self.data: Any = memoryview(b"")


class WireResponse:
    """A ``logprob.v1.ScoreResponse`` read from its bytes (``id``,
    ``outputs`` as ``WireTensor``s, ``status_code``, ``status_message``,
    ``status_reason``, ``head``, ``head_version``, ``rollout_mismatch``: a
    ``logprob.v1.RolloutMismatch`` or None), the tensors' data left in
    place."""

    __slots__ = ("id", "outputs", "status_code", "status_message", "status_reason", "head", "head_version",
                 "rollout_mismatch")

    def __init__(self) -> None:
        self.id = ""
        self.outputs: List[WireTensor] = []
        self.status_code = 0
        self.status_message = ""
        self.status_reason = 0
        self.head = ""
        self.head_version = ""
        self.rollout_mismatch: Any = None


# The largest protobuf field number.
_MAX_FIELD_NUMBER = (1 << 29) - 1


def _read_varint(buf: memoryview, pos: int, end: int) -> Tuple[int, int]:
    """``(value, next pos)`` of the varint at ``buf[pos:end]``: at most 10
    bytes, 64 bits. Raises ValueError when truncated or overlong."""
    result = shift = 0
    while True:
        if pos >= end:
            raise ValueError("truncated varint")
        byte = buf[pos]
        pos += 1
        if shift == 63 and byte > 1:
            raise ValueError("overlong varint (more than 64 bits)")
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7


def _fields(buf: memoryview, pos: int, end: int) -> Iterator[Tuple[int, int, Any]]:
    """(field number, wire type, value) of the message in ``buf[pos:end]``:
    an int for varints, a memoryview for length-delimited fields, None for
    skipped fixed-size fields. Each field is read whole before it is
    yielded. Raises ValueError for a truncated or overlong varint, a field
    running past ``end``, a field number outside 1 to 2^29 - 1, or wire
    types 3, 4 (groups), 6 and 7."""
    while pos < end:
        key, pos = _read_varint(buf, pos, end)
        field, wire_type = key >> 3, key & 7
        if field == 0 or field > _MAX_FIELD_NUMBER:
            raise ValueError("invalid field number %d" % field)
        if wire_type == 0:
            value, pos = _read_varint(buf, pos, end)
            yield field, wire_type, value
        elif wire_type == 2:
            n, pos = _read_varint(buf, pos, end)
            if n > end - pos:
                raise ValueError("truncated field %d: %d bytes, %d left" % (field, n, end - pos))
            yield field, wire_type, buf[pos:pos + n]
            pos += n
        elif wire_type in (1, 5):
            n = 8 if wire_type == 1 else 4
            if n > end - pos:
                raise ValueError("truncated fixed-size field %d" % field)
            pos += n
            yield field, wire_type, None
        else:
            raise ValueError("unsupported wire type %d of field %d" % (wire_type, field))


def _signed64(v: int) -> int:
    return v - (1 << 64) if v >= 1 << 63 else v


def _read_tensor(buf: memoryview) -> WireTensor:
    t = WireTensor()
    for field, wire_type, value in _fields(buf, 0, len(buf)):
        if field == 1 and wire_type == 2:
            t.name = bytes(value).decode("utf-8")
        elif field == 2 and wire_type == 0:
            t.dtype = value
        elif field == 3 and wire_type == 2:  # packed shape
            pos = 0
            while pos < len(value):
                dim, pos = _read_varint(value, pos, len(value))
                t.shape.append(_signed64(dim))
        elif field == 3 and wire_type == 0:
            t.shape.append(_signed64(value))
        elif field == 4 and wire_type == 2:
            t.data = value
    return t


def decode_response(raw: bytes) -> WireResponse:
    """The ``ScoreResponse`` in ``raw`` (the gRPC response deserializer of
    the clients' Score / ScoreStream calls), each output's data a view of
    ``raw``. Unknown fields are skipped. Raises ValueError for malformed
    bytes (gRPC then fails the call with INTERNAL)."""
    buf = memoryview(raw)
    r = WireResponse()
    for field, wire_type, value in _fields(buf, 0, len(buf)):
        if field == 1 and wire_type == 2:
            r.id = bytes(value).decode("utf-8")
        elif field == 2 and wire_type == 2:
            r.outputs.append(_read_tensor(value))
        elif field == 3 and wire_type == 0:
            r.status_code = _signed64(value)
        elif field == 4 and wire_type == 2:
            r.status_message = bytes(value).decode("utf-8", errors="replace")
        elif field == 5 and wire_type == 0:
            r.status_reason = value
        elif field == 6 and wire_type == 2:
            r.head = bytes(value).decode("utf-8")
        elif field == 7 and wire_type == 2:
            r.head_version = bytes(value).decode("utf-8")
        elif field == 8 and wire_type == 2:
            r.rollout_mismatch = pb2.RolloutMismatch.FromString(bytes(value))
    return r
