"""Splitting a batch that is too large for the server into requests of whole
sequences, and joining their results (the Python counterpart of
``client/request_splitter.cc``).

- Padded input (``logits``/``hidden_states`` [B, S, X]): every input is cut
  along B into groups of consecutive sequences.
- Packed input ([T, X], ``input_ids`` [T], ``cu_seqlens`` [B + 1], optional
  ``gather_indices`` [T - B or T, K], ``rollout_logprobs``,
  ``grad_token_logprobs`` and ``grad_entropy`` [T - B or T]):
  cut by whole sequences; each part's ``cu_seqlens`` is rebased to 0 and
  keeps its dtype; the rows of those output-shaped inputs follow
  the output rows (L - 1 per sequence of length L for
  next_token, L for same_position). Without ``cu_seqlens`` the T rows are
  one sequence.
- Parts are filled greedily so that each part's serialized size is at most
  ``max_bytes`` and its token rows (B*S padded, T packed) at most
  ``max_tokens`` (0: no limit). Results are concatenated along the first
  dimension.
"""

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import grpc
import numpy as np

from ..errors import InvalidInputError, LogprobError
from ._proto import pb2
from .tensors import DTYPE_SIZE, NUMPY_DTYPE, Array, to_tensor

ROW_NAMES = ("logits", "hidden_states")
# Inputs with one row per output row (shaped like the outputs).
_OUTPUT_ROW_INPUTS = ("gather_indices", "rollout_logprobs", "grad_token_logprobs", "grad_entropy")
# The sampling mask: CSR over the output rows (offsets [n + 1], ids [nnz]).
_MASK_INPUTS = ("sampling_mask_offsets", "sampling_mask_ids")


def _plan_mask(inp: "Inputs", out_off: Any) -> Tuple[List[int], Callable[[int, int], List["Input"]]]:
    """The sampling mask's bytes per sequence (``out_off`` [B + 1]: the
    sequences' first output rows) and ``make(s0, s1)``: its tensors for
    sequences [s0, s1), offsets rebased to 0."""
    off, ids = inp.get("sampling_mask_offsets"), inp.get("sampling_mask_ids")
    if off is None or ids is None:
        return [0] * (len(out_off) - 1), lambda s0, s1: []
    offv = off[2].astype(np.int64).reshape(-1)
    n = int(out_off[-1])
    if off[2].ndim != 1 or offv.shape[0] != n + 1 or offv[0] != 0 or np.any(np.diff(offv) < 0) or \
            ids[2].ndim != 1 or offv[-1] != ids[2].shape[0]:
        raise InvalidInputError(
            "sampling_mask: offsets must be [%d] (one per output row, plus one), start at 0, not decrease and end "
            "at len(ids); got offsets %s, ids %s" % (n + 1, list(off[2].shape), list(ids[2].shape)))
    (_, off_dt, off_arr), (_, ids_dt, ids_arr) = off, ids
    oi, ii = off_arr.itemsize, ids_arr.itemsize
    seq_bytes = [int((out_off[i + 1] - out_off[i]) * oi + (offv[out_off[i + 1]] - offv[out_off[i]]) * ii)
                 for i in range(len(out_off) - 1)]

    def make(s0: int, s1: int) -> List["Input"]:
        a, b = int(out_off[s0]), int(out_off[s1])
        return [("sampling_mask_offsets", off_dt, (offv[a:b + 1] - offv[a]).astype(off_arr.dtype)),
                ("sampling_mask_ids", ids_dt, ids_arr[offv[a]:offv[b]])]

    return seq_bytes, make

# Upper bound of what the id suffix "-<i>" adds, and of how much a tensor's
# serialized size can exceed its data plus its header without data (the
# varint length prefixes of the bytes field and of the Tensor message).
_ID_SLACK = 32
_TENSOR_SLACK = 12

# One input tensor: (name, wire dtype, array in that dtype; the rows sent by
# CUDA IPC: a device tensor).
Input = Tuple[str, int, Any]
# What _plan_padded / _plan_packed give plan(): each sequence's bytes and
# token rows, bytes a part adds once, and make(s0, s1): the tensors of
# sequences [s0, s1).
_Plan = Tuple[List[int], List[int], int, Callable[[int, int], List[Input]]]


class Inputs:
    """The encoded inputs of one request: ``[(name, wire_dtype, array)]`` in
    sending order, the rows' name (``logits``/``hidden_states``) and the
    options."""

    def __init__(self, tensors: Sequence[Input], options: Any, rows: Optional[Input] = None,
                 head: str = "", head_version: str = "") -> None:
        self.tensors = list(tensors)
        self.options = options
        # The lm_head (and pinned version) hidden states are scored with.
        self.head = head
        self.head_version = head_version
        self.names = [n for n, _, _ in tensors]
        if rows is not None:
            # The rows travel apart (a CUDA IPC reference, cuda_ipc.py):
            # `rows` is (name, wire_dtype, device tensor), not in `tensors`.
            self.rows = rows
            return
        found = [t for t in tensors if t[0] in ROW_NAMES]
        if len(found) != 1:
            raise InvalidInputError("give exactly one of 'logits' and 'hidden_states'")
        self.rows = found[0]

    def get(self, name: str) -> Optional[Input]:
        """The tensor called ``name``, or None."""
        for t in self.tensors:
            if t[0] == name:
                return t
        return None

    def tokens(self) -> int:
        """Token rows (B*S padded, T packed)."""
        shape = self.rows[2].shape
        return int(np.prod(shape[:-1], dtype=np.int64)) if len(shape) >= 1 else 0

    def data_bytes(self) -> int:
        """Bytes of tensor data (not counting rows that travel apart)."""
        return sum(int(a.nbytes) for _, _, a in self.tensors)

    def header(self, request_id: str) -> Any:
        """The ``ScoreRequest`` of these inputs without its tensors: id,
        options, head and head_version (every request of a call is built
        from it)."""
        return pb2.ScoreRequest(id=request_id, options=self.options, head=self.head, head_version=self.head_version)

    def header_bytes(self, request_id: str) -> int:
        """Serialized size of the request without the tensors' data."""
        req = self.header(request_id)
        for name, dt, arr in self.tensors:
            req.inputs.add(name=name, dtype=dt, shape=[int(d) for d in arr.shape])
        return int(req.ByteSize()) + _TENSOR_SLACK * len(self.tensors)

    def request(self, request_id: str) -> Any:
        """The ``ScoreRequest`` (a protobuf message) of these inputs."""
        req = self.header(request_id)
        for name, dt, arr in self.tensors:
            req.inputs.append(to_tensor(name, dt, arr))
        return req


def _plan_padded(inp: Inputs) -> _Plan:
    rows = inp.rows[2]
    B, S = int(rows.shape[0]), int(rows.shape[1])
    per_seq = 0
    for name, dt, arr in inp.tensors:
        if name in _MASK_INPUTS:
            continue
        if name == "cu_seqlens":
            raise InvalidInputError("'cu_seqlens' given with 3-D '%s' %s" % (inp.rows[0], list(rows.shape)))
        if arr.ndim < 1 or arr.shape[0] != B:
            raise InvalidInputError(
                "input '%s' %s does not have B = %d rows like '%s' %s"
                % (name, list(arr.shape), B, inp.rows[0], list(rows.shape))
            )
        per_seq += arr.nbytes // B if B else 0
    s_out = max(S - 1, 0) if inp.options.alignment == pb2.NEXT_TOKEN else S
    mask_bytes, mask_make = _plan_mask(inp, np.arange(B + 1, dtype=np.int64) * s_out)
    seq_bytes = [per_seq + m for m in mask_bytes]
    seq_tokens = [S] * B

    def make(s0: int, s1: int) -> List[Input]:
        return [(n, dt, a[s0:s1]) for n, dt, a in inp.tensors if n not in _MASK_INPUTS] + mask_make(s0, s1)

    return seq_bytes, seq_tokens, _mask_extra(inp), make


def _plan_packed(inp: Inputs) -> _Plan:
    rows = inp.rows[2]
    T = int(rows.shape[0])
    next_token = inp.options.alignment == pb2.NEXT_TOKEN
    ids = inp.get("input_ids")
    cu = inp.get("cu_seqlens")
    for name, _, _ in inp.tensors:
        if name not in (inp.rows[0], "input_ids", "cu_seqlens") + _OUTPUT_ROW_INPUTS + _MASK_INPUTS:
            raise InvalidInputError("packed input cannot carry '%s'" % name)
    if ids is None or ids[2].ndim != 1 or ids[2].shape[0] != T:
        raise InvalidInputError(
            "packed 'input_ids' must be [T] with T = %d like '%s' %s" % (T, inp.rows[0], list(rows.shape))
        )
    if cu is None:
        cuv = np.array([0, T], dtype=np.int64)
    else:
        cuv = cu[2].astype(np.int64)
        if cuv.ndim != 1 or cuv.shape[0] < 1 or cuv[0] != 0 or cuv[-1] != T or np.any(np.diff(cuv) < 0):
            raise InvalidInputError(
                "'cu_seqlens' must be [B + 1], start at 0, not decrease and end at T = %d; got %s"
                % (T, cuv.tolist() if cuv.size <= 16 else list(cuv.shape))
            )
    B = cuv.shape[0] - 1
    lens = np.diff(cuv)
    outs = np.maximum(lens - 1, 0) if next_token else lens
    out_off = np.concatenate([[0], np.cumsum(outs)]).astype(np.int64)
    out_row_bytes = 0  # of the inputs with one row per output row
    for name in _OUTPUT_ROW_INPUTS:
        t = inp.get(name)
        if t is None:
            continue
        if t[2].ndim < 1 or t[2].shape[0] != out_off[-1]:
            raise InvalidInputError(
                "'%s' %s must have %d rows, one per output row" % (name, list(t[2].shape), out_off[-1])
            )
        out_row_bytes += t[2].nbytes // t[2].shape[0] if t[2].shape[0] else 0
    token_bytes = rows.nbytes // T + ids[2].itemsize if T else 0
    cu_entry = DTYPE_SIZE[cu[1]] if cu is not None else 0
    mask_bytes, mask_make = _plan_mask(inp, out_off)
    seq_bytes = [int(lens[i] * token_bytes + cu_entry + outs[i] * out_row_bytes) + mask_bytes[i] for i in range(B)]
    seq_tokens = [int(x) for x in lens]

    def make(s0: int, s1: int) -> List[Input]:
        part: List[Input] = []
        for name, dt, arr in inp.tensors:
            if name in (inp.rows[0], "input_ids"):
                part.append((name, dt, arr[cuv[s0]:cuv[s1]]))
            elif name in _OUTPUT_ROW_INPUTS:
                part.append((name, dt, arr[out_off[s0]:out_off[s1]]))
            elif name == "cu_seqlens":
                part.append((name, dt, (cuv[s0:s1 + 1] - cuv[s0]).astype(NUMPY_DTYPE[dt])))
        return part + mask_make(s0, s1)

    return seq_bytes, seq_tokens, cu_entry + _mask_extra(inp), make


def _mask_extra(inp: "Inputs") -> int:
    """Bytes a part's sampling mask adds once: its offsets' last entry."""
    off = inp.get("sampling_mask_offsets")
    return int(off[2].itemsize) if off is not None else 0


def plan(inp: Inputs, request_id: str, max_bytes: int, max_tokens: int = 0) -> List[Tuple[str, Inputs]]:
    """Splits ``inp`` (an ``Inputs``) into parts of at most ``max_bytes``
    serialized bytes and ``max_tokens`` token rows (0: no limit), without
    copying: returns ``[(part_id, Inputs)]`` whose arrays are views of
    ``inp``'s; build each one's request with ``build_part`` when sending it.
    Returns ``[(request_id, inp)]`` when it already fits; parts get ids
    ``"<id>-<i>"``. Raises InvalidInputError when one sequence alone does
    not fit or the inputs are inconsistent."""
    if max_bytes <= 0:
        raise InvalidInputError("max_bytes must be > 0")
    header = inp.header_bytes(request_id)
    total_tokens = inp.tokens()
    if header + inp.data_bytes() <= max_bytes and (max_tokens <= 0 or total_tokens <= max_tokens):
        return [(request_id, inp)]

    ndim = inp.rows[2].ndim
    if ndim == 3:
        seq_bytes, seq_tokens, extra, make = _plan_padded(inp)
    elif ndim == 2:
        seq_bytes, seq_tokens, extra, make = _plan_packed(inp)
    else:
        raise InvalidInputError(
            "'%s' %s is neither [B, S, X] nor [T, X]" % (inp.rows[0], list(inp.rows[2].shape))
        )
    budget = max_bytes - header - _ID_SLACK - extra
    if budget <= 0:
        raise InvalidInputError(
            "a request of at most %d bytes has no room for tensor data (%d bytes of overhead)"
            % (max_bytes, header + _ID_SLACK + extra)
        )

    groups: List[Tuple[int, int]] = []
    begin = used_bytes = used_tokens = 0
    for i, (sb, st) in enumerate(zip(seq_bytes, seq_tokens)):
        if sb > budget:
            raise InvalidInputError(
                "sequence %d alone needs %d bytes of tensor data, more than the %d that fit in a request of "
                "at most %d bytes; it cannot be sent (raise the server's --max-request-bytes)"
                % (i, sb, budget, max_bytes)
            )
        if max_tokens > 0 and st > max_tokens:
            raise InvalidInputError(
                "sequence %d has %d tokens, more than the %d allowed per request; it cannot be sent"
                % (i, st, max_tokens)
            )
        if i > begin and (used_bytes + sb > budget or (max_tokens > 0 and used_tokens + st > max_tokens)):
            groups.append((begin, i))
            begin, used_bytes, used_tokens = i, 0, 0
        used_bytes += sb
        used_tokens += st
    if len(seq_bytes) > begin:
        groups.append((begin, len(seq_bytes)))
    if len(groups) <= 1:
        return [(request_id, inp)]
    return [
        ("%s-%d" % (request_id, g + 1), Inputs(make(s0, s1), inp.options, head=inp.head, head_version=inp.head_version))
        for g, (s0, s1) in enumerate(groups)
    ]


def build_part(part_id: str, part: Inputs, max_bytes: int) -> Any:
    """The ``ScoreRequest`` of one part of ``plan``; checks its size."""
    request = part.request(part_id)
    size = request.ByteSize()
    if size > max_bytes:  # plan's estimate is an upper bound; never expected
        raise LogprobError(
            grpc.StatusCode.INTERNAL, "part %s has %d bytes, over the limit of %d" % (part_id, size, max_bytes)
        )
    return request


def split(inp: Inputs, request_id: str, max_bytes: int, max_tokens: int = 0) -> List[Any]:
    """``plan`` with every part's ``ScoreRequest`` built: ``[ScoreRequest]``."""
    return [build_part(pid, part, max_bytes) for pid, part in plan(inp, request_id, max_bytes, max_tokens)]


def join(outputs_per_part: List[Dict[str, Array]]) -> Dict[str, Array]:
    """Concatenates the parts' outputs (``[{name: array}]`` in part order)
    along the first dimension into ``{name: array}``."""
    if not outputs_per_part:
        return {}
    if len(outputs_per_part) == 1:
        return dict(outputs_per_part[0])
    first = outputs_per_part[0]
    joined: Dict[str, Array] = {}
    for name, arr in first.items():
        pieces = []
        for p, outs in enumerate(outputs_per_part):
            if name not in outs:
                raise LogprobError(
                    grpc.StatusCode.INTERNAL, "part %d has no output '%s'" % (p + 1, name)
                )
            piece = outs[name]
            if piece.dtype != arr.dtype or piece.shape[1:] != arr.shape[1:]:
                raise LogprobError(
                    grpc.StatusCode.INTERNAL,
                    "output '%s' of part %d is %s %s, of part 1 %s %s"
                    % (name, p + 1, piece.dtype, list(piece.shape), arr.dtype, list(arr.shape)),
                )
            pieces.append(piece)
        joined[name] = np.concatenate(pieces, axis=0)
    return joined
