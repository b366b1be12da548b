"""``LogprobClient``: scoring numpy / torch batches on a logprob-server
(synchronous ``grpc``; ``aio.LogprobClient`` is the asyncio twin). The
logic of every call is the shared core's (``base.ClientBase``); this module
only performs its I/O operations (``ops.py``) with blocking calls."""

import threading
import time
from typing import Any, Dict, Iterable, Iterator, List, Optional, TypeVar, Union, cast

import grpc

from ._internal import distill, head_gradients, lm_head_sender, transport
from ._internal.base import ClientBase
from ._internal.lm_head_sender import LmHeadUpdateHandle
from ._internal.ops import END, Connect, Emit, Locked, NextResponse, Op, OpenStream, Ops, Rpc, Sleep, Stepper, Work
from ._internal.result import ScoreResult
from ._internal.retry import Deadline
from .errors import LogprobError

__all__ = ["LogprobClient"]

T = TypeVar("T")


class LogprobClient(ClientBase):
    """A client of ``logprob.v1.LogprobService`` over a ``grpc`` channel;
    arguments (target, timeout, retry, TLS, token, limits, shared memory,
    CUDA IPC) as in ``ClientBase``. Thread-safe: threads may share one
    client (one channel); use it as a context manager or ``close()`` it."""

    def _open(self) -> None:
        self._info_lock = threading.Lock()
        self._channel = self._settings.open_sync()
        self._open_methods(self._channel)
        self._read_gradients_rpc = head_gradients.ReadGradients(head_gradients.open_method(self._channel))

    def _chunked_rpc(self) -> Any:
        return transport.ChunkedScore(self._score_chunked_raw, self.piece_bytes)

    # -- performing the core's operations ----------------------------------

    def _perform(self, op: Op) -> Any:
        """Performs one I/O operation of the core, blocking."""
        if isinstance(op, Rpc):
            return op.method(op.request, timeout=op.timeout, metadata=op.metadata)
        if isinstance(op, Work):
            return op.fn(*op.args)
        if isinstance(op, Sleep):
            time.sleep(op.seconds)
            return None
        if isinstance(op, Connect):
            future = grpc.channel_ready_future(self._channel)
            try:
                future.result(timeout=max(0.0, op.seconds))
                return True
            except grpc.FutureTimeoutError:
                future.cancel()
                return False
        if isinstance(op, Locked):
            with op.lock:
                return self._run(op.ops)
        if isinstance(op, OpenStream):
            return op.method(op.assembler.messages(op.requests), timeout=op.timeout, metadata=op.metadata)
        if isinstance(op, NextResponse):
            return next(op.call, END)
        raise TypeError("cannot perform %r here" % (op,))

    def _drive(self, steps: Stepper) -> Iterator[Any]:
        """Runs an operation to its end, yielding what it emits (``Emit``);
        closing this iterator ends the operation."""
        try:
            while True:
                op = steps.next()
                if op is None:
                    return
                if isinstance(op, Emit):
                    yield op.value
                    continue
                try:
                    steps.resume(self._perform(op))
                except BaseException as e:  # raised into the operation, where it was waiting
                    steps.throw(e)
        finally:
            steps.close()

    def _run(self, ops: Ops[T]) -> T:
        """The result of an operation that emits nothing."""
        steps = Stepper(ops)
        for _ in self._drive(steps):
            raise RuntimeError("an operation emitted a value outside an iteration")
        return cast(T, steps.result)

    # -- lifecycle -------------------------------------------------------

    def close(self) -> None:
        """Closes the channel (and removes the shared-memory regions)."""
        try:
            self._run(self._close_ops())
        finally:
            self._channel.close()

    def __enter__(self) -> "LogprobClient":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- calls -----------------------------------------------------------

    def server_info(self, refresh: bool = False, _deadline: Optional[Deadline] = None) -> Any:
        """The server's ``logprob.v1.ServerInfo`` (workers, limits, lm_head
        vocab_size / hidden_size ...), fetched once and cached. ``lm_heads``
        lists every head with its own vocab_size and hidden_size; the
        top-level vocab_size / hidden_size are those of the head
        ``default`` (or the only one), else the shape all heads share (0
        when they differ). Raises LogprobError."""
        return self._run(self._server_info_ops(refresh, _deadline))

    def health(self, wait: float = 0.0) -> bool:
        """True once ``grpc.health.v1`` reports SERVING for the server,
        polling for up to ``wait`` seconds; False otherwise (never raises for
        an unreachable server)."""
        return self._run(self._health_ops(wait))

    def score_request(self, request: Any) -> Any:
        """Sends a prepared ``logprob.v1.ScoreRequest`` as is (no splitting),
        with retries within the client's timeout; returns the
        ``ScoreResponse``. Raises LogprobError."""
        return self._run(self._score_request_ops(request))

    def score(self, logits: Any = None, input_ids: Any = None, *, request_id: Optional[str] = None,
              **options: Any) -> ScoreResult:
        """Scores a batch; returns a ``ScoreResult`` (numpy arrays for numpy
        input, torch tensors on the input's device for torch input).

        Inputs (numpy arrays, array-likes or torch tensors; docs/SPEC.md):

        - ``logits`` [B, S, V] (padded) or [T, V] (packed), or
          ``hidden_states`` [B, S, H] / [T, H] (server started with
          ``--lm-head``): float32, float16 or bfloat16 (torch bf16,
          ml_dtypes bf16, or a uint16 array of raw bits with
          ``dtype="bf16"``), contiguous or not. ``dtype`` ("f32", "bf16",
          "f16") also converts float input before sending (e.g. float32 ->
          bf16 halves the bytes).
        - ``input_ids`` [B, S] / [T], int32 or int64 (other ints become
          int64).
        - padded: optional ``seq_lens`` [B], or ``attention_mask`` [B, S]
          (right padding: ones then zeros; converted to ``seq_lens``).
        - packed: ``cu_seqlens`` [B + 1] (0, ..., T).
        - ``gather_indices`` [..output shape.., K]: global token ids whose
          logprobs come back in ``gathered_logprobs``.
        - ``rollout_logprobs`` [..output shape..] (float; sent as float32):
          the rollout engine's logprob of each scored token, NaN where it
          has none (prompt positions); the result then carries the
          mismatch (``rollout_log_ratio``, ``rollout_ratio``, per-sequence
          ``rollout_seq_*`` outputs and ``rollout_mismatch``; docs/SPEC.md
          "Rollout mismatch"), with ``rollout_ratio_cap`` (default 3) and
          ``rollout_band`` ((low, high), default (0.9, 1.1)).
        - ``sampling_mask`` (offsets [n + 1], ids [nnz]): the sampler's kept
          token ids of each of the n output positions (CSR over the
          flattened ``token_logprobs``, ids strictly ascending; an empty
          set: no mask there), as vLLM / SGLang return them; the logprobs
          (entropy, top-k, gathered) are renormalised over exactly that set
          (docs/SPEC.md "Sampling masks"). Not with ``sampling_top_k`` /
          ``sampling_top_p`` or ``is_top1``.

        Options: ``alignment`` "next_token" (row t scores input_ids[t + 1])
        or "same_position"; ``entropy``; ``log_sum_sq_probs``,
        ``mean_logits``, ``is_top1`` (bools: those per-token outputs, SPEC's
        definitions; ``is_top1`` comes back as bool); ``topk`` (K of ``topk_logprobs`` /
        ``topk_indices``); ``temperature`` (> 0); ``sampling_top_k`` (0
        off), ``sampling_top_p`` (1 or None off); ``ignore_index`` (default
        -100 at the server: such targets score 0); ``request_id`` (default
        ``py-<pid>-<n>``); ``timeout`` (seconds for this call, overriding
        the client's); ``head`` / ``head_version`` (hidden states: the
        lm_head to score with, empty for the default one, and a version to
        pin; the result's ``head`` / ``head_version`` say which scored it).

        A batch larger than the server's limits (``max_request_bytes``,
        ``max_tokens_per_request`` from GetServerInfo, or the client's own)
        is sent as several requests of whole sequences and the results are
        joined (``split=False`` sends it as one). Each request is retried
        per the ``RetryPolicy``; the timeout bounds the whole call.

        The caller's arrays are copied once (into the request message; a
        CUDA tensor is copied to the host first, a dtype conversion makes
        one more array). ``cuda_ipc`` (default: the client's): CUDA
        ``hidden_states`` go to a same-host server with CUDA workers as a
        CUDA IPC reference, no copy to the host (``cuda_ipc.py``); a refused
        reference sends this call again as bytes. Raises InvalidInputError
        (a ValueError) for inputs the client can tell are wrong, TypeError
        for unsupported dtypes, LogprobError with the gRPC code and message
        for a failed call (DEADLINE_EXCEEDED when the timeout passes).
        """
        return self._run(self._score_ops(logits, input_ids, request_id, options))

    def backward(self, hidden_states: Any, input_ids: Any, grad_token_logprobs: Any, *, grad_entropy: Any = None,
                 gradient_step: str = "", request_id: Optional[str] = None, **options: Any) -> ScoreResult:
        """The lm_head's backward (docs/gradients.md): for the forward's
        inputs (``hidden_states``, ``input_ids``, ``seq_lens`` /
        ``cu_seqlens``, ``head`` / ``head_version``, ``temperature``, as
        ``score``) and the upstream gradients ``grad_token_logprobs``
        (dL/dlogprob, shaped like ``token_logprobs``; ignored at
        ignore_index targets) and optional ``grad_entropy`` (dL/dentropy),
        returns a ``ScoreResult`` whose ``grad_hidden_states`` is dL/dh
        (float32, shaped like ``hidden_states``), with the forward's
        ``token_logprobs`` (and ``entropy`` on request). With
        ``gradient_step`` (a key per optimizer step, shared by its
        micro-batches and data-parallel ranks) the workers add dL/dW and
        dL/db to that step: ``read_head_gradients`` fetches the sums,
        ``close_gradient_step`` frees them. Raises as ``score`` (INVALID_ARGUMENT
        naming the field for non-finite gradients; ALREADY_EXISTS for a
        closed step key)."""
        return self.score(hidden_states=hidden_states, input_ids=input_ids, grad_token_logprobs=grad_token_logprobs,
                          grad_entropy=grad_entropy, gradient_step=gradient_step, request_id=request_id, **options)

    def distill(self, student_hidden_states: Any, teacher_hidden_states: Any, *, student_head: str = "",
                teacher_head: str = "", beta: float = 0.5, temperature: Optional[float] = None,
                student_head_version: str = "", teacher_head_version: str = "", grad_divergence: Any = None,
                grad_cross_entropy: Any = None, gradient_step: str = "", request_id: Optional[str] = None,
                dtype: Any = None, timeout: Any = "default") -> distill.DistillResult:
        """Full-vocabulary distillation (docs/distillation.md) between the
        server's lm_heads ``student_head`` and ``teacher_head`` (the same
        vocabulary; empty: the default head; ``*_head_version``: a pinned
        version, else the current one): for ``student_hidden_states`` [N,
        H_s] and ``teacher_hidden_states`` [N, H_t] (numpy or torch, f32 /
        bf16 / f16; ``dtype`` converts both), per token the divergence
        (``beta`` 0: forward KL(teacher || student), 1: reverse KL, between:
        the generalized JSD, TRL's definition), the soft-target cross
        entropy and the student's entropy at ``temperature``. With
        ``grad_divergence`` [N] (and optional ``grad_cross_entropy`` [N]):
        the student's dL/dh too, and with ``gradient_step`` its dL/dW, dL/db
        added to that step (``read_head_gradients(step, head=student_head)``,
        then ``close_gradient_step``). Returns a ``DistillResult``. Raises
        InvalidInputError for inputs the client can tell are wrong,
        LogprobError with the server's code and message otherwise."""
        req = distill.request(student_hidden_states, teacher_hidden_states, student_head=student_head,
                              teacher_head=teacher_head, beta=beta, temperature=temperature,
                              student_head_version=student_head_version, teacher_head_version=teacher_head_version,
                              grad_divergence=grad_divergence, grad_cross_entropy=grad_cross_entropy,
                              gradient_step=gradient_step, request_id=request_id, dtype=dtype)
        return self._run(distill.distill_ops(self, req, timeout))

    def read_head_gradients(self, gradient_step: str, *, head: str = "", rows: Any = None,
                            timeout: Any = "default") -> head_gradients.HeadGradients:
        """The sums of step ``gradient_step`` on lm_head ``head`` (empty:
        the default one): ``HeadGradients`` with ``weight`` float32 [V, H]
        (or rows ``(begin, end)``), ``bias`` [V] or None, and
        ``micro_batches`` / ``tokens`` added. Read in pieces of 4 MiB, never
        one message. Raises LogprobError: NOT_FOUND (no backward added to
        the step), ALREADY_EXISTS (closed), FAILED_PRECONDITION (dropped:
        expired or a failed backward)."""
        return self._run(head_gradients.read_ops(self, gradient_step, head, rows, timeout))

    def close_gradient_step(self, gradient_step: str, *, timeout: Any = "default") -> None:
        """Frees the step's sums on every worker; its key cannot be used
        again (a retried close is fine)."""
        self._run(head_gradients.close_ops(self, gradient_step, timeout))

    def update_lm_head(self, head: str, weight: Any, *, version: str, sha256: Optional[str] = None,
                       timeout: Any = "default", dtype: Any = None, bias: Any = None,
                       logit_scale: Optional[float] = None,
                       final_logit_softcapping: Optional[float] = None) -> str:
        """Replaces the server's lm_head ``head`` by ``weight`` as version
        ``version`` and returns the committed version (server started with
        ``--allow-lm-head-updates``). ``weight``: [V, H] torch tensor (CPU or
        CUDA), numpy array (uint16 bf16 bits with ``dtype="bf16"``) or
        safetensors path, of the head's shape and dtype. A CUDA tensor goes
        as a CUDA IPC handle when the server offers CUDA IPC on this host
        (unless ``cuda_ipc=False``; a worker there copies the rows into the
        server's store), else it is copied to the host once. Host rows go
        through this client's shared-memory region when
        the server is on this host (unless ``shared_memory=False``), else
        in pieces; the server stages them, every
        worker loads them while scoring goes on, and only then requests
        admitted afterwards use the new version (earlier ones finish on the
        old). ``sha256`` (hex of the weight's bytes) is checked at commit.
        Re-sending a committed (head, version, sha256) does nothing. On any
        failure the update is aborted and the old version keeps serving.
        The head's logit transform (docs/serving.md "Head transforms")
        stays unless given: ``bias`` ([V] float array or tensor: the new
        version's ``lm_head.bias``; a head's bias cannot be removed),
        ``logit_scale`` (> 0) and ``final_logit_softcapping`` (>= 0, 0:
        none). A head with a bias whose training changes it needs
        ``bias=`` at every update, or the new weight is scored with the old
        bias.
        Raises LogprobError (NOT_FOUND unknown head, INVALID_ARGUMENT shape,
        dtype, sha256 mismatch or a bad transform, FAILED_PRECONDITION
        updates off or another update open, ALREADY_EXISTS version
        taken)."""
        return self._run(lm_head_sender.update_ops(self, head, weight, version, sha256, self._deadline(timeout), dtype,
                                                   bias, logit_scale, final_logit_softcapping))

    def begin_lm_head_update(self, head: str, *, version: str, vocab_size: int, hidden_size: int, dtype: Any,
                             sha256: Optional[str] = None, timeout: Any = "default", bias: Any = None,
                             logit_scale: Optional[float] = None,
                             final_logit_softcapping: Optional[float] = None) -> LmHeadUpdateHandle:
        """Opens an update of ``head`` to ``version``, a ``[vocab_size,
        hidden_size]`` weight of ``dtype`` (``"f32"``, ``"bf16"``, ``"f16"``
        or a torch / numpy dtype: the head's), whose rows one or several
        senders then put (``put_lm_head_rows``, e.g. each tensor-parallel
        rank its vocabulary shard, each with its own client) before this
        sender commits (``commit_lm_head_update``); ``update_lm_head`` is
        these steps by one sender. ``sha256``, ``bias``, ``logit_scale``
        and ``final_logit_softcapping`` as in ``update_lm_head``. Returns an
        ``LmHeadUpdateHandle`` (picklable: send it to the other senders; its
        ``update_id`` is the capability to put, commit or abort, keep it
        among them); ``already_committed`` on it when the server holds this
        (head, version, sha256) already (puts and commit then do nothing).
        An update without progress for ``--lm-head-update-timeout`` is
        aborted by the server. Retried on UNAVAILABLE (a retried Begin
        answers the update it opened). Raises LogprobError (as
        ``update_lm_head``), ValueError for a bad name or dtype."""
        return self._run(lm_head_sender.begin_ops(self, head, version, vocab_size, hidden_size, dtype, sha256,
                                                  self._deadline(timeout), bias, logit_scale, final_logit_softcapping))

    def put_lm_head_rows(self, update: LmHeadUpdateHandle, row_begin: int, rows: Any, *,
                         timeout: Any = "default") -> None:
        """Puts ``rows`` (``[n, hidden_size]``: a torch tensor on the CPU or
        a GPU, a numpy array, or a safetensors path, converted to the
        update's dtype) as rows ``[row_begin, row_begin + n)`` of
        ``update``, which may have been begun by another client or process.
        The rows travel as in ``update_lm_head`` (CUDA IPC, shared memory,
        or pieces). Every row of the weight must be put exactly once before
        the commit, by any number of senders, in any order. Not retried: a
        failed put leaves the update open without those rows (put them
        again, or abort). Nothing for an ``already_committed`` update.
        Raises LogprobError (INVALID_ARGUMENT rows outside ``[0, V)``, given
        twice, or of another shape; NOT_FOUND an update that ended)."""
        self._run(lm_head_sender.put_ops(self, update, int(row_begin), rows, self._deadline(timeout)))

    def commit_lm_head_update(self, update: LmHeadUpdateHandle, *, timeout: Any = "default") -> str:
        """Commits ``update`` once every row was put (by every sender): the
        server checks the rows, has every worker load them, and makes the
        version current (as ``update_lm_head``'s commit). Returns the
        committed version. Retried on UNAVAILABLE (a retried Commit answers
        the first one's outcome). Raises LogprobError: FAILED_PRECONDITION
        when rows are missing (naming the first missing range; the update
        stays open: put them and commit again, or abort), else the error
        that ended the update (INVALID_ARGUMENT a sha256 mismatch or a
        non-finite weight, ABORTED an update that was aborted or timed out,
        FAILED_PRECONDITION a worker that failed to load it)."""
        return self._run(lm_head_sender.commit_ops(self, update, self._deadline(timeout)))

    def abort_lm_head_update(self, update: LmHeadUpdateHandle, *, timeout: Any = "default") -> None:
        """Aborts ``update`` (any sender may): its rows are dropped and the
        current version keeps serving. Sent once. Raises LogprobError
        (NOT_FOUND an update that already ended)."""
        self._run(lm_head_sender.abort_ops(self, update, self._deadline(timeout).remaining()))

    def lm_heads(self) -> List[Any]:
        """The server's lm_heads (``LmHeadInfo``: name, version,
        retained_versions, shape, dtype, sha256, and the head's logit
        transform ``has_bias``, ``logit_scale`` (1 when none; 0 from a
        server that predates transforms: read as 1) and
        ``final_logit_softcapping`` (0 when none)), fetched now."""
        return list(self.server_info(refresh=True).lm_heads)

    def score_stream(
        self,
        requests: Iterable[Union[Dict[str, Any], Any]],
        *,
        timeout: Any = "default",
        return_exceptions: bool = False,
    ) -> Iterator[Union[ScoreResult, LogprobError]]:
        """Scores many requests over one ``ScoreStream`` RPC, yielding one
        outcome per request in request order.

        ``requests``: an iterable (consumed lazily, as the stream can take
        them) of dicts of ``score`` keyword arguments (``request_id``
        optional) or prepared ``logprob.v1.ScoreRequest`` messages (sent as
        is). A dict over the server's limits goes as several stream
        messages and comes back joined.

        ``timeout`` (default: the client's) bounds the whole stream. A
        failure of the stream itself (UNAVAILABLE, UNAUTHENTICATED,
        DEADLINE_EXCEEDED, ...) raises LogprobError after the outcomes
        already known are yielded; the stream is not retried.

        Per-request errors (the answer's ``status_code`` /
        ``status_message``, or a request the client refuses): with
        ``return_exceptions=False`` (default) the ``LogprobError`` is raised
        at that request's place in the order and the stream is cancelled;
        with ``return_exceptions=True`` it is yielded in that place (check
        ``isinstance(x, LogprobError)``) and the stream goes on. Per-request
        errors are not retried.

        Breaking out of the loop (or closing the generator) cancels the
        stream. Nothing is sent before the iteration starts.
        """
        return self._drive(Stepper(self._score_stream_ops(requests, timeout, return_exceptions)))
