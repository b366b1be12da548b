"""A ``logprob.v1.ScoreRequest`` serialized straight from the caller's
arrays: the protobuf wire bytes, with each tensor's ``data`` field filled
by one copy from the array's memory.

Building a ``ScoreRequest`` message instead copies each array three times
(``tobytes``; into the C++ message; ``SerializeToString``). Here the small
parts (id, options, each tensor's name / dtype / shape) are serialized by
protobuf and the data is spliced in with ``bytes.join``, which copies a
C-contiguous array once, straight into the request's bytes (a strided array
is made contiguous first: one more copy). The result parses as the same
``ScoreRequest`` (protobuf allows fields in any order), and the clients
send it as is (their ``Score`` / ``ScoreStream`` calls take bytes).
"""

from typing import Any, List, Sequence, Tuple

import numpy as np

from ._proto import pb2
from .tensors import NUMPY_DTYPE

_INPUTS_TAG = b"\x12"  # ScoreRequest.inputs: field 2, length-delimited
_DATA_TAG = b"\x22"  # Tensor.data: field 4, length-delimited


def varint(n: int) -> bytes:
    """Protobuf base-128 varint of a non-negative int."""
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _tensor_pieces(name: str, wire_dtype: int, arr: np.ndarray) -> List[Any]:
    arr = arr.astype(NUMPY_DTYPE[wire_dtype], copy=False)
    if not arr.flags.c_contiguous:
        arr = np.ascontiguousarray(arr)
    head = pb2.Tensor(name=name, dtype=wire_dtype, shape=[int(d) for d in arr.shape]).SerializeToString()
    data_len = arr.nbytes
    if data_len == 0:  # proto3 leaves an empty bytes field out
        return [_INPUTS_TAG + varint(len(head)) + head]
    data_head = _DATA_TAG + varint(data_len)
    prefix = _INPUTS_TAG + varint(len(head) + len(data_head) + data_len) + head + data_head
    # A flat uint8 view of the C-contiguous array: a plain buffer for join.
    return [prefix, arr.reshape(-1).view(np.uint8)]


def encode_request(request_id: str, tensors: Sequence[Tuple[str, int, np.ndarray]], options: Any) -> bytes:
    """The serialized ``ScoreRequest{id, inputs, options}`` of
    ``[(name, wire_dtype, array)]`` (arrays in their wire dtype, any
    strides). Thread-safe; reads the arrays, never writes them."""
    pieces: List[Any] = [pb2.ScoreRequest(id=request_id, options=options).SerializeToString()]
    for name, dt, arr in tensors:
        pieces.extend(_tensor_pieces(name, dt, arr))
    return b"".join(pieces)
