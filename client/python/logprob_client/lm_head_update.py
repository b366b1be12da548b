"""What ``update_lm_head`` sends: a weight as host rows, and the
``PutLmHeadRows`` parts of a row range (``LmHeadRows`` first, then its bytes
in ``TensorPiece``s, as ScoreChunked sends a request's tensors)."""

from typing import Any, Iterator, Tuple

import numpy as np

from ._proto import pb2
from . import safetensors
from .errors import InvalidInputError
from .tensors import Array, float_array

# Bytes of rows one PutLmHeadRows call carries at most (also bounded by the
# server's max_request_bytes): the server assembles one call's rows in memory.
UPDATE_PUT_BYTES = 64 << 20

_TENSOR_NAMES = ("lm_head.weight", "model.embed_tokens.weight")


def lm_head_rows(weight: Any) -> Tuple[int, Array]:
    """``(wire dtype, [V, H] array)`` of ``weight``: a torch tensor (CPU or
    CUDA; copied to the host), a numpy array (float32, float16, or bf16 as
    ``float_array`` takes it), or the path of a safetensors file holding
    ``lm_head.weight`` (or the tied ``model.embed_tokens.weight``). Raises
    InvalidInputError for another rank or a missing tensor."""
    if isinstance(weight, str):
        tensors, _ = safetensors.load(weight)
        for name in _TENSOR_NAMES:
            if name in tensors:
                weight = tensors[name]
                break
        else:
            raise InvalidInputError("%s holds neither of %s" % (weight, ", ".join(_TENSOR_NAMES)))
    dt, rows = float_array("weight", weight)
    if rows.ndim != 2:
        raise InvalidInputError("an lm_head weight is [vocab_size, hidden_size], got %s" % (list(rows.shape),))
    return dt, np.ascontiguousarray(rows)


def lm_head_rows_parts(update_id: str, row_begin: int, rows: Array, dt: int,
                       piece_bytes: int) -> Iterator[Any]:
    """The ``LmHeadRowsPart``s of rows ``[row_begin, row_begin + len(rows))``."""
    tensor = pb2.Tensor(name="rows", dtype=dt, shape=[int(d) for d in rows.shape])
    yield pb2.LmHeadRowsPart(rows=pb2.LmHeadRows(update_id=update_id, row_begin=row_begin, rows=tensor))
    flat = memoryview(np.ascontiguousarray(rows).reshape(-1).view(np.uint8).data)
    step = max(1, int(piece_bytes))
    for off in range(0, len(flat), step):
        yield pb2.LmHeadRowsPart(piece=pb2.TensorPiece(tensor=0, offset=off, data=bytes(flat[off:off + step])))
