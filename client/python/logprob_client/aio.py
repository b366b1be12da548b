"""``logprob_client.aio.LogprobClient``: the asyncio client (``grpc.aio``),
with the API, splitting, retries, deadlines, TLS and token, shared-memory
and CUDA IPC inputs of the sync ``logprob_client.LogprobClient``, large
parts over ``ScoreChunked`` included. The logic of every call is the shared
core's (``base.ClientBase``); this module only performs its I/O operations
(``ops.py``) by awaiting them.

Example (the client is made inside the loop that uses it)::

    import asyncio
    from logprob_client.aio import LogprobClient

    async def main():
        async with LogprobClient("127.0.0.1:50051", timeout=30) as client:
            results = await asyncio.gather(*(client.score(logits=l, input_ids=i) for l, i in batches))

    asyncio.run(main())
"""

import asyncio
from typing import Any, AsyncIterable, AsyncIterator, Iterable, List, Optional, TypeVar, Union, cast

from ._internal import distill, head_gradients, lm_head_sender, transport
from ._internal.base import ClientBase
from ._internal.lm_head_sender import LmHeadUpdateHandle
from ._internal.ops import END, Connect, Emit, Locked, NextResponse, Op, OpenStream, Ops, Rpc, Sleep, Stepper, Work
from ._internal.result import ScoreResult
from ._internal.retry import Deadline
from .errors import LogprobError

__all__ = ["LogprobClient"]

T = TypeVar("T")

# Work (``ops.Work``: serializing a part, copying into shared memory, making
# a region) on at least this many bytes runs in the loop's default executor.
OFFLOAD_BYTES = 1 << 20


class LogprobClient(ClientBase):
    """An asyncio client of ``logprob.v1.LogprobService`` over one
    ``grpc.aio`` channel; arguments (target, timeout, retry, TLS, token,
    limits, shared memory, CUDA IPC) as in
    ``logprob_client._internal.base.ClientBase``.

    Create it in the event loop that uses it (``async with
    LogprobClient(...) as client`` inside a coroutine of that loop): its
    ``grpc.aio`` channel belongs to the loop it was made on. Any number of
    tasks of that loop may await its calls concurrently, sharing the
    channel. Not for use from other threads or loops: a call (or
    ``close()``) awaited on another event loop raises ``RuntimeError``
    saying so, before anything is sent (e.g. a client made outside any
    loop, or in one ``asyncio.run()``, then used in another
    ``asyncio.run()``). Cancelling a task that awaits ``score`` cancels
    the RPC (the server stops the work and counts it CANCELLED).
    """

    def _open(self) -> None:
        self._info_lock = asyncio.Lock()
        self._channel = self._settings.open_aio()
        # The loop the channel is bound to: the running one, else the one
        # grpc.aio picked (asyncio's current loop); None: the first to use it.
        self._loop: Optional[asyncio.AbstractEventLoop] = _running_loop() or getattr(self._channel, "_loop", None)
        self._open_methods(self._channel)
        self._read_gradients_rpc = head_gradients.AioReadGradients(head_gradients.open_method(self._channel))

    def _chunked_rpc(self) -> Any:
        return transport.AioChunkedScore(self._score_chunked_raw, self.piece_bytes, offload_bytes=OFFLOAD_BYTES)

    # -- performing the core's operations ----------------------------------

    async def _perform(self, op: Op) -> Any:
        """Performs one I/O operation of the core, awaiting it (large
        ``Work`` in the loop's default executor)."""
        if isinstance(op, Rpc):
            request = transport.parts_in_executor(op.request) if op.nbytes >= OFFLOAD_BYTES else op.request
            return await op.method(request, timeout=op.timeout, metadata=op.metadata)
        if isinstance(op, Work):
            if op.nbytes >= OFFLOAD_BYTES:
                return await _in_executor(op)
            return op.fn(*op.args)
        if isinstance(op, Sleep):
            await asyncio.sleep(op.seconds)
            return None
        if isinstance(op, Connect):
            try:
                await asyncio.wait_for(self._channel.channel_ready(), timeout=op.seconds)
                return True
            except asyncio.TimeoutError:
                return False
        if isinstance(op, Locked):
            async with op.lock:
                return await self._run(op.ops)
        if isinstance(op, OpenStream):
            return op.method(op.assembler.amessages(op.requests), timeout=op.timeout, metadata=op.metadata)
        if isinstance(op, NextResponse):
            try:
                return await op.call.__aiter__().__anext__()
            except StopAsyncIteration:
                return END
        raise TypeError("cannot perform %r here" % (op,))

    async def _drive(self, steps: Stepper) -> AsyncIterator[Any]:
        """Runs an operation to its end, yielding what it emits (``Emit``);
        closing this iterator (or cancelling its task) ends the operation.
        RuntimeError on another event loop than the client's."""
        try:
            _check_loop(self)
            while True:
                op = steps.next()
                if op is None:
                    return
                if isinstance(op, Emit):
                    yield op.value
                    continue
                try:
                    steps.resume(await self._perform(op))
                except BaseException as e:  # raised into the operation, where it was waiting
                    steps.throw(e)
        finally:
            steps.close()

    async def _run(self, ops: Ops[T]) -> T:
        """The result of an operation that emits nothing."""
        steps = Stepper(ops)
        async for _ in self._drive(steps):
            raise RuntimeError("an operation emitted a value outside an iteration")
        return cast(T, steps.result)

    # -- lifecycle -------------------------------------------------------

    async def close(self) -> None:
        """Closes the channel (calls in flight are cancelled) and removes the
        shared-memory regions. RuntimeError on another event loop than the
        client's (nothing is closed then)."""
        _check_loop(self)
        try:
            await self._run(self._close_ops())
        finally:
            await self._channel.close()

    async def __aenter__(self) -> "LogprobClient":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    # -- calls -----------------------------------------------------------

    async def server_info(self, refresh: bool = False, _deadline: Optional[Deadline] = None) -> Any:
        """The server's ``logprob.v1.ServerInfo``, fetched once and cached.
        Raises LogprobError."""
        return await self._run(self._server_info_ops(refresh, _deadline))

    async def backward(self, hidden_states: Any, input_ids: Any, grad_token_logprobs: Any, *,
                       grad_entropy: Any = None, gradient_step: str = "", request_id: Optional[str] = None,
                       **options: Any) -> ScoreResult:
        """As the sync client's ``backward``."""
        return await self.score(hidden_states=hidden_states, input_ids=input_ids,
                                grad_token_logprobs=grad_token_logprobs, grad_entropy=grad_entropy,
                                gradient_step=gradient_step, request_id=request_id, **options)

    async def distill(self, student_hidden_states: Any, teacher_hidden_states: Any, *, student_head: str = "",
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
        return await self._run(distill.distill_ops(self, req, timeout))

    async def read_head_gradients(self, gradient_step: str, *, head: str = "", rows: Any = None,
                                  timeout: Any = "default") -> head_gradients.HeadGradients:
        """As the sync client's ``read_head_gradients``."""
        return await self._run(head_gradients.read_ops(self, gradient_step, head, rows, timeout))

    async def close_gradient_step(self, gradient_step: str, *, timeout: Any = "default") -> None:
        """As the sync client's ``close_gradient_step``."""
        await self._run(head_gradients.close_ops(self, gradient_step, timeout))

    async def update_lm_head(self, head: str, weight: Any, *, version: str, sha256: Optional[str] = None,
                             timeout: Any = "default", dtype: Any = None, bias: Any = None,
                             logit_scale: Optional[float] = None,
                             final_logit_softcapping: Optional[float] = None) -> str:
        """As ``LogprobClient.update_lm_head`` (same core)."""
        return await self._run(lm_head_sender.update_ops(self, head, weight, version, sha256, self._deadline(timeout),
                                                         dtype, bias, logit_scale, final_logit_softcapping))

    async def begin_lm_head_update(self, head: str, *, version: str, vocab_size: int, hidden_size: int, dtype: Any,
                                   sha256: Optional[str] = None, timeout: Any = "default", bias: Any = None,
                                   logit_scale: Optional[float] = None,
                                   final_logit_softcapping: Optional[float] = None) -> LmHeadUpdateHandle:
        """As ``LogprobClient.begin_lm_head_update`` (same core); the handle
        may be used by either kind of client."""
        return await self._run(lm_head_sender.begin_ops(self, head, version, vocab_size, hidden_size, dtype, sha256,
                                                        self._deadline(timeout), bias, logit_scale,
                                                        final_logit_softcapping))

    async def put_lm_head_rows(self, update: LmHeadUpdateHandle, row_begin: int, rows: Any, *,
                               timeout: Any = "default") -> None:
        """As ``LogprobClient.put_lm_head_rows``; converting the rows runs in
        the loop's default executor."""
        await self._run(lm_head_sender.put_ops(self, update, int(row_begin), rows, self._deadline(timeout)))

    async def commit_lm_head_update(self, update: LmHeadUpdateHandle, *, timeout: Any = "default") -> str:
        """As ``LogprobClient.commit_lm_head_update``."""
        return await self._run(lm_head_sender.commit_ops(self, update, self._deadline(timeout)))

    async def abort_lm_head_update(self, update: LmHeadUpdateHandle, *, timeout: Any = "default") -> None:
        """As ``LogprobClient.abort_lm_head_update``."""
        await self._run(lm_head_sender.abort_ops(self, update, self._deadline(timeout).remaining()))

    async def lm_heads(self) -> List[Any]:
        """As ``LogprobClient.lm_heads``."""
        return list((await self.server_info(refresh=True)).lm_heads)

    async def health(self, wait: float = 0.0) -> bool:
        """True once ``grpc.health.v1`` reports SERVING, polling for up to
        ``wait`` seconds; False otherwise (never raises for an unreachable
        server)."""
        return await self._run(self._health_ops(wait))

    async def score_request(self, request: Any) -> Any:
        """Sends a prepared ``logprob.v1.ScoreRequest`` as is (no splitting),
        with retries within the client's timeout; returns the
        ``ScoreResponse``. Raises LogprobError."""
        return await self._run(self._score_request_ops(request))

    async def score(self, logits: Any = None, input_ids: Any = None, *, request_id: Optional[str] = None,
                    **options: Any) -> ScoreResult:
        """Scores a batch, like the sync ``LogprobClient.score`` (same
        arguments, result and errors). The parts of a split batch are sent
        one after the other; concurrent ``score`` calls share the channel.
        Serializing a large part and copying it into shared memory run in
        the loop's default executor."""
        return await self._run(self._score_ops(logits, input_ids, request_id, options))

    def score_stream(
        self,
        requests: Union[Iterable[Any], AsyncIterable[Any]],
        *,
        timeout: Any = "default",
        return_exceptions: bool = False,
    ) -> AsyncIterator[Union[ScoreResult, LogprobError]]:
        """Scores many requests over one ``ScoreStream`` RPC; an async
        iterator of one outcome per request, in request order. ``requests``
        may be an iterable or an async iterable; everything else (items,
        the whole-stream ``timeout``, ``return_exceptions``, no retries) as
        in the sync ``LogprobClient.score_stream``. Cancelling the task
        cancels the stream; to leave the ``async for`` early, close the
        iterator (``async with contextlib.aclosing(client.score_stream(...))
        as results``), which cancels the stream at once (an abandoned async
        generator is only closed when it is garbage-collected)."""
        return self._drive(Stepper(self._score_stream_ops(requests, timeout, return_exceptions)))


def _check_loop(client: LogprobClient) -> None:
    """Raises RuntimeError when the running loop is not the one ``client``
    (its grpc.aio channel) belongs to; binds a client whose loop was not
    known to the first loop that uses it."""
    loop = asyncio.get_running_loop()
    if client._loop is None:
        client._loop = loop
    elif loop is not client._loop:
        raise RuntimeError(
            "logprob_client.aio.LogprobClient(%r) is used from another event loop than the one it was "
            "created on (its grpc.aio channel belongs to that loop); create the client inside the loop "
            "that uses it, e.g. 'async with LogprobClient(...) as client:' in the coroutine that "
            "asyncio.run() runs, one client per loop" % (client.target,)
        )


def _running_loop() -> Optional[asyncio.AbstractEventLoop]:
    """The running event loop, or None outside one."""
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


async def _in_executor(work: Work) -> Any:
    """Runs ``work`` in the running loop's default executor. Work cannot be
    stopped midway, so a cancelled task first waits for it to end (it may
    be writing a leased shared-memory region, which is only given back
    after), then is cancelled."""
    future = asyncio.get_running_loop().run_in_executor(None, work.fn, *work.args)
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        while not future.done():
            try:
                await asyncio.wait([future])
            except asyncio.CancelledError:
                pass
        if not future.cancelled():
            future.exception()  # retrieved: the cancellation is what is raised
        raise
