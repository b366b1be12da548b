"""What ``update_lm_head`` sends: a weight as host rows, and the
``PutLmHeadRows`` parts of a row range (``LmHeadRows`` first, then its bytes
in ``TensorPiece``s, as ScoreChunked sends a request's tensors)."""

import hashlib
import os
from typing import Any, Iterator, Tuple

import numpy as np

from . import safetensors
from ._internal import cuda_ipc
from ._internal._proto import pb2
from ._internal.tensors import Array, float_array
from ._internal.transport import piece_header
from ._internal.wire import varint
from .errors import InvalidInputError

__all__ = ["weight_sha256", "lm_head_rows"]

# Bytes of rows one PutLmHeadRows call carries at most in pieces (also
# bounded by 90% of the server's max_request_bytes). Each call ends with a
# round trip in which the sender waits for the server to take the bytes in
# flight, so fewer calls move a head faster (a Qwen head, 1.24 GB, on the
# 2-core VM: 0.47 s in puts of 64 MiB, 0.42-0.44 s in puts of 256 MiB,
# docs/benchmarks.md); neither side holds a put's bytes (the server writes
# the pieces into the staged file as they come), but a put that fails is
# sent again whole.
UPDATE_PUT_BYTES = 256 << 20
# Bytes of rows one PutLmHeadRows call carries at most through shared
# memory: the client keeps two regions of this size (the copy of one put
# overlaps the call of the one before), so fewer, larger puts (0.146 s in
# 64 MiB puts, 0.131 s in 128 MiB, 0.118 s in 256 MiB) cost the client
# that much more memory in /dev/shm for its life.
UPDATE_REGION_BYTES = 128 << 20

_TENSOR_NAMES = ("lm_head.weight", "model.embed_tokens.weight")


def lm_head_rows(weight: Any, dtype: Any = None) -> Tuple[int, Array]:
    """``(wire dtype, [V, H] array)`` of ``weight``: a torch tensor (CPU or
    CUDA; copied to the host), a numpy array (float32, float16, or bf16 as
    ``float_array`` takes it: ml_dtypes bf16, or uint16 bits with
    ``dtype="bf16"``), or the path of a safetensors file holding
    ``lm_head.weight`` (or the tied ``model.embed_tokens.weight``). Raises
    InvalidInputError for another rank or a missing tensor."""
    if isinstance(weight, str):
        tensors, meta = safetensors.load(weight)
        for name in _TENSOR_NAMES:
            if name in tensors:
                if meta["__dtypes__"][name] == "BF16":
                    dtype = "bf16"
                weight = tensors[name]
                break
        else:
            raise InvalidInputError("%s holds neither of %s" % (weight, ", ".join(_TENSOR_NAMES)))
    dt, rows = float_array("weight", weight, dtype)
    if rows.ndim != 2:
        raise InvalidInputError("an lm_head weight is [vocab_size, hidden_size], got %s" % (list(rows.shape),))
    return dt, np.ascontiguousarray(rows)


def weight_sha256(weight: Any, dtype: Any = None) -> str:
    """Hex SHA-256 of ``weight``'s bytes as ``update_lm_head`` sends them
    (``lm_head_rows``: row-major, in ``dtype``, a wire or torch / numpy
    float dtype, None: the weight's own): what ``LmHeadInfo.sha256``
    reports for a head holding it, what the server checks at commit, and
    what makes a re-sent version a no-op. A CUDA tensor is copied to the
    host for it (convert it to the head's dtype on its device first to
    copy half as many bytes of an f32 weight for a bf16 head)."""
    _, rows = lm_head_rows(weight, dtype)
    return hashlib.sha256(np.ascontiguousarray(rows).reshape(-1).view(np.uint8).data).hexdigest()


def weight_nbytes(weight: Any) -> int:
    """Bytes of a weight as given (a tensor's or array's ``nbytes``, a
    file's size, 0 when unknown): how much CPU work making its rows is."""
    if isinstance(weight, str):
        try:
            return os.path.getsize(weight)
        except OSError:
            return 0
    if callable(getattr(weight, "element_size", None)) and callable(getattr(weight, "numel", None)):
        return int(weight.element_size()) * int(weight.numel())  # torch (nbytes only from torch 2)
    return int(getattr(weight, "nbytes", 0) or 0)


# PutLmHeadRows with parts serialized here (bytes in, LmHeadUpdate out).
PUT_ROWS_METHOD = "/logprob.v1.LogprobService/PutLmHeadRows"


def lm_head_rows_part(update_id: str, row_begin: int, tensor: Any) -> bytes:
    """The serialized first ``LmHeadRowsPart`` of a put: ``LmHeadRows`` of
    rows from ``row_begin`` described by the ``Tensor`` message ``tensor``
    (its bytes inline, a reference, or none: pieces follow)."""
    first: bytes = pb2.LmHeadRows(update_id=update_id, row_begin=row_begin, rows=tensor).SerializeToString()
    return b"\x0a" + varint(len(first)) + first


def lm_head_ipc_parts(update_id: str, row_begin: int, ref: Any) -> Iterator[bytes]:
    """The one serialized ``LmHeadRowsPart`` of rows ``[row_begin, row_begin +
    V')`` given as a CUDA IPC reference (``cuda_ipc.Export`` of a contiguous
    ``[V', H]`` CUDA tensor): ``LmHeadRows`` whose ``rows`` carry the
    reference and no bytes (a worker on the server's host copies them)."""
    yield lm_head_rows_part(update_id, row_begin, ref.tensor_pb("rows"))


def lm_head_device_rows(weight: Any, dtype: Any = None) -> Tuple[int, Any]:
    """``(wire dtype, [V, H] contiguous CUDA tensor)`` of a CUDA ``weight``
    (``cuda_ipc.device_rows``, converted on its GPU). Raises
    InvalidInputError for another rank, TypeError for a non-float dtype."""
    dt, rows = cuda_ipc.device_rows(weight, dtype, "weight")
    if rows.dim() != 2:
        raise InvalidInputError("an lm_head weight is [vocab_size, hidden_size], got %s" % (list(rows.shape),))
    return dt, rows


def lm_head_rows_parts(update_id: str, row_begin: int, rows: Array, dt: int,
                       piece_bytes: int) -> Iterator[bytes]:
    """The serialized ``LmHeadRowsPart``s of rows ``[row_begin, row_begin +
    len(rows))``: ``LmHeadRows`` (the shape, no data), then the bytes in
    pieces of ``piece_bytes``, each its header joined with a slice of the
    rows (one copy), as ScoreChunked's parts (``transport.request_parts``)."""
    yield lm_head_rows_part(update_id, row_begin, pb2.Tensor(name="rows", dtype=dt, shape=[int(d) for d in rows.shape]))
    flat = memoryview(np.ascontiguousarray(rows).reshape(-1).view(np.uint8).data)
    step = max(1, int(piece_bytes))
    for off in range(0, len(flat), step):
        chunk = flat[off:off + step]
        yield b"".join((piece_header(0, off, len(chunk)), chunk))
