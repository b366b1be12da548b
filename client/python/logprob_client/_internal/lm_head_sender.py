"""The steps of an lm_head update, begin / put(row_begin, rows) / commit /
abort, written once for both clients as operations of the sans-I/O core
(``ops.py``), and ``update_lm_head`` built on them (docs/lm-head-updates.md,
"Tensor-parallel senders").

Several senders may fill one update: the sender that begins it gets an
``LmHeadUpdateHandle`` (picklable: hand it to the other ranks), each sender
puts its rows (``row_begin``: where its vocabulary shard starts) with its
own client, and the one that began commits once all puts returned. The
handle's ``update_id`` is the update's capability: whoever holds it may
put, commit or abort.

CPU work on the weight (torch / numpy to host rows, dtype casts, the CUDA
conversion and export) runs as ``ops.Work``, which the asyncio client
performs in its executor, off its event loop.
"""

import secrets
from typing import TYPE_CHECKING, Any, Optional, Tuple

import grpc

from . import cuda_ipc
from ..errors import LogprobError
from ..lm_head_update import lm_head_device_rows, lm_head_ipc_parts, lm_head_rows, weight_nbytes
from ._proto import pb2
from .base import check_lm_head_names
from .ops import Ops, Rpc, Work, retried
from .retry import Deadline, error_of, reason_of
from .tensors import float_array, parse_float_dtype, to_tensor

if TYPE_CHECKING:
    from .base import ClientBase

# Seconds the best-effort abort of a failed update_lm_head may take.
ABORT_SECONDS = 10.0


class LmHeadUpdateHandle:
    """An open lm_head update, as ``begin_lm_head_update`` answers it:
    ``head``, ``version``, ``vocab_size`` and ``hidden_size`` (the weight is
    ``[vocab_size, hidden_size]``), ``dtype`` (the wire dtype rows are sent
    in: ``logprob.v1.DType``), ``already_committed`` (True when the server
    already holds this (head, version, sha256): puts and commit then do
    nothing) and ``update_id``.

    ``update_id`` is the update's capability (128 random bits): whoever
    holds it may put rows into, commit or abort the update. Share it only
    with the processes that send the update (e.g. pickled through
    ``torch.distributed.broadcast_object_list`` on the trainer's own
    process group), never in logs: ``repr`` leaves it out. Picklable;
    immutable by convention."""

    def __init__(self, head: str, version: str, update_id: str, vocab_size: int, hidden_size: int, dtype: int,
                 already_committed: bool = False) -> None:
        self.head = head
        self.version = version
        self.update_id = update_id
        self.vocab_size = int(vocab_size)
        self.hidden_size = int(hidden_size)
        self.dtype = int(dtype)
        self.already_committed = bool(already_committed)

    def __repr__(self) -> str:
        return "LmHeadUpdateHandle(head=%r, version=%r, shape=[%d, %d], dtype=%s%s)" % (
            self.head, self.version, self.vocab_size, self.hidden_size, pb2.DType.Name(self.dtype),
            ", already_committed=True" if self.already_committed else "")


class HeadRows:
    """Rows of an update, ready to put: ``dtype`` (wire), ``shape`` ``(V',
    H)``, and either ``ref`` (a ``cuda_ipc.Export`` of a CUDA tensor) or
    ``host`` (a contiguous numpy array). ``source`` and ``want`` (the
    caller's weight and dtype) make host rows if the server refuses the
    reference."""

    def __init__(self, dtype: int, shape: Tuple[int, int], source: Any, want: Any,
                 ref: Optional[cuda_ipc.Export] = None, host: Any = None) -> None:
        self.dtype = dtype
        self.shape = shape
        self.source = source
        self.want = want
        self.ref = ref
        self.host = host


def _host_rows(weight: Any, dtype: Any) -> HeadRows:
    dt, rows = lm_head_rows(weight, dtype)
    return HeadRows(dt, (int(rows.shape[0]), int(rows.shape[1])), weight, dtype, host=rows)


def _device_export(weight: Any, dtype: Any) -> Optional[HeadRows]:
    """The CUDA IPC reference of ``weight`` converted on its GPU; None
    (with a warning) when the driver cannot export its memory."""
    dt, dev = lm_head_device_rows(weight, dtype)
    try:
        ref = cuda_ipc.export(dev, dt)
    except cuda_ipc.Unavailable as e:
        cuda_ipc.warn_fallback(e)
        return None
    return HeadRows(dt, (int(dev.shape[0]), int(dev.shape[1])), weight, dtype, ref=ref)


def rows_ops(client: "ClientBase", weight: Any, dtype: Any, deadline: Deadline) -> Ops[HeadRows]:
    """``weight`` ([V', H]: torch tensor, numpy array or safetensors path;
    ``dtype``: the wire dtype to send, None: the weight's) as rows to put:
    a CUDA IPC reference when the server offers CUDA IPC on this host
    (``cuda_ipc.offered``, the client's ``cuda_ipc`` option) and the driver
    can export the tensor, else host rows. The conversion is ``Work``."""
    nbytes = weight_nbytes(weight)
    if cuda_ipc.candidate(client.cuda_ipc, weight):
        if cuda_ipc.offered(client.cuda_ipc, (yield from client._server_info_ops(deadline=deadline)), weight):
            exported: Optional[HeadRows] = yield Work(_device_export, weight, dtype, nbytes=nbytes)
            if exported is not None:
                return exported
    rows: HeadRows = yield Work(_host_rows, weight, dtype, nbytes=nbytes)
    return rows


def begin_ops(client: "ClientBase", head: str, version: str, vocab_size: int, hidden_size: int, dtype: Any,
              sha256: Optional[str], deadline: Deadline, bias: Any = None, logit_scale: Optional[float] = None,
              final_logit_softcapping: Optional[float] = None) -> Ops[LmHeadUpdateHandle]:
    """``BeginLmHeadUpdate`` of a ``[vocab_size, hidden_size]`` weight of
    ``dtype``, retried on UNAVAILABLE (its ``client_token`` makes a retried
    Begin answer the update it opened). The head's transform stays unless
    given (``bias`` [V], ``logit_scale``, ``final_logit_softcapping``)."""
    check_lm_head_names(head, version)
    dt = parse_float_dtype(dtype)
    if dt is None:
        raise ValueError("dtype: give the weight's dtype ('f32', 'bf16' or 'f16')")
    # client_token: a retried Begin whose answer was lost gets the update
    # it opened, instead of finding the head busy until the time-out.
    begin = pb2.BeginLmHeadUpdateRequest(head=head, version=version, vocab_size=int(vocab_size),
                                         hidden_size=int(hidden_size), dtype=dt, sha256=sha256 or "",
                                         client_token=secrets.token_hex(16))
    if logit_scale is not None:
        begin.logit_scale = float(logit_scale)
    if final_logit_softcapping is not None:
        begin.final_logit_softcapping = float(final_logit_softcapping)
    if bias is not None:
        bias_dt, bias_arr = float_array("bias", bias)
        begin.bias.CopyFrom(to_tensor("lm_head.bias", bias_dt, bias_arr))
    update, _ = yield from retried(client._stub.BeginLmHeadUpdate, begin, client._attempts(deadline),
                                   client._update_metadata)
    return LmHeadUpdateHandle(head, version, str(update.update_id), int(vocab_size), int(hidden_size), dt,
                              already_committed=bool(update.already_committed))


def put_ops(client: "ClientBase", update: LmHeadUpdateHandle, row_begin: int, weight: Any,
            deadline: Deadline) -> Ops[None]:
    """``put_lm_head_rows``: ``weight`` (``[n, H]``, as ``rows_ops`` takes
    it) converted to the update's dtype, then ``put_rows_ops``. Nothing for
    an update that was already committed."""
    if update.already_committed:
        return
    rows = yield from rows_ops(client, weight, update.dtype, deadline)
    yield from put_rows_ops(client, update, row_begin, rows, deadline)


def put_rows_ops(client: "ClientBase", update: LmHeadUpdateHandle, row_begin: int, rows: HeadRows,
                 deadline: Deadline) -> Ops[None]:
    """Puts ``rows`` as rows ``[row_begin, row_begin + V')`` of ``update``:
    a CUDA IPC reference in one call (if the server refuses it, reason
    ``CUDA_IPC_UNAVAILABLE``, the rows go to the host and as bytes, with a
    warning), host rows through the client's shared memory or in pieces
    (``ClientBase._put_host_rows_ops``). Nothing for an update that was
    already committed."""
    if update.already_committed:
        return
    if rows.ref is not None:
        try:
            # A worker on the server's host copies them into the store.
            yield from client._put_rows_ops(lambda: lm_head_ipc_parts(update.update_id, row_begin, rows.ref), deadline,
                                            client._update_metadata)
            return
        except LogprobError as e:
            if not cuda_ipc.refused(e):
                raise
            cuda_ipc.warn_fallback(e.message)  # the rows were not taken: send them as bytes
            rows = yield Work(_host_rows, rows.source, rows.want, nbytes=weight_nbytes(rows.source))
    yield from client._put_host_rows_ops(update.update_id, rows.host, rows.dtype, deadline, row_begin=row_begin)


def commit_ops(client: "ClientBase", update: LmHeadUpdateHandle, deadline: Deadline) -> Ops[str]:
    """``CommitLmHeadUpdate``, retried on UNAVAILABLE (a retried Commit
    answers the first one's outcome); returns the committed version (the
    update's own when it was already committed)."""
    if update.already_committed:
        return update.version
    ref = pb2.LmHeadUpdateRef(update_id=update.update_id)
    committed, _ = yield from retried(client._stub.CommitLmHeadUpdate, ref, client._attempts(deadline),
                                      client._update_metadata)
    return str(committed.version)


def abort_ops(client: "ClientBase", update: LmHeadUpdateHandle, timeout: Optional[float],
              quiet: bool = False) -> Ops[None]:
    """``AbortLmHeadUpdate``, sent once (the server also aborts an update
    without progress after ``--lm-head-update-timeout``); raises
    LogprobError unless ``quiet``. Nothing for an already committed one."""
    if update.already_committed:
        return
    try:
        yield Rpc(client._stub.AbortLmHeadUpdate, pb2.LmHeadUpdateRef(update_id=update.update_id), timeout,
                  client._update_metadata)
    except grpc.RpcError as e:
        if not quiet:
            code, message = error_of(e)
            raise LogprobError(code, message, reason=reason_of(e)) from None


def update_ops(client: "ClientBase", head: str, weight: Any, version: str, sha256: Optional[str],
               deadline: Deadline, dtype: Any = None, bias: Any = None, logit_scale: Optional[float] = None,
               final_logit_softcapping: Optional[float] = None) -> Ops[str]:
    """``update_lm_head``: the steps above by one sender: begin, put every
    row from row 0, commit; on any failure (or cancellation) abort,
    quietly, and re-raise."""
    check_lm_head_names(head, version)
    rows = yield from rows_ops(client, weight, dtype, deadline)
    update = yield from begin_ops(client, head, version, rows.shape[0], rows.shape[1], rows.dtype, sha256,
                                  deadline, bias, logit_scale, final_logit_softcapping)
    if update.already_committed:
        return version
    try:
        yield from put_rows_ops(client, update, 0, rows, deadline)
        return (yield from commit_ops(client, update, deadline))
    except BaseException:
        yield from abort_ops(client, update, ABORT_SECONDS, quiet=True)
        raise
