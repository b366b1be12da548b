"""``logprob_client.aio.LogprobClient``: the asyncio client (``grpc.aio``),
with the API, splitting, retries, deadlines, TLS and token of the sync
``logprob_client.LogprobClient``, large parts over ``ScoreChunked`` included
(the shared logic is in ``request``, ``transport``, ``retry``, ``stream``,
``channel`` and ``base``).

Example::

    import asyncio
    from logprob_client.aio import LogprobClient

    async def main():
        async with LogprobClient("127.0.0.1:50051", timeout=30) as client:
            results = await asyncio.gather(*(client.score(logits=l, input_ids=i) for l, i in batches))
"""

import asyncio
import time
from typing import Any, AsyncIterable, AsyncIterator, Iterable, Optional, Tuple, Union

import grpc
import grpc.aio

from ._proto import pb2
from .base import HEALTH_SERVING, ClientBase
from .errors import LogprobError
from .request import Limits, Part, ScoreCall
from .result import ScoreResult
from .retry import Attempts, Deadline, error_of
from .stream import StreamAssembler, deliver
from . import cuda_ipc, transport

# Parts with at least this many bytes of tensor data are serialized off the event loop.
OFFLOAD_BYTES = 1 << 20


class LogprobClient(ClientBase):
    """An asyncio client of ``logprob.v1.LogprobService`` over one
    ``grpc.aio`` channel; arguments (target, timeout, retry, TLS, token,
    limits) as in ``logprob_client.base.ClientBase``.

    Create it in the event loop that uses it (``async with
    LogprobClient(...) as client``); any number of tasks of that loop may
    await its calls concurrently, sharing the channel. Not for use from
    other threads or loops. Cancelling a task that awaits ``score``
    cancels the RPC (the server stops the work and counts it CANCELLED).
    """

    def _open(self) -> None:
        self._info_lock = asyncio.Lock()
        self._channel = self._settings.open_aio()
        self._open_methods(self._channel)

    # -- lifecycle -------------------------------------------------------

    async def close(self) -> None:
        """Closes the channel (calls in flight are cancelled)."""
        await self._channel.close()

    async def __aenter__(self) -> "LogprobClient":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    # -- calls -----------------------------------------------------------

    async def _call(self, method: Any, request: Any, attempts: Attempts) -> Tuple[Any, int]:
        """Sends ``request`` with ``method`` until it succeeds or
        ``attempts`` gives up (raising LogprobError); returns
        ``(response, sends)``."""
        while True:
            timeout = attempts.timeout()
            try:
                return await method(request, timeout=timeout, metadata=self._metadata), attempts.count
            except grpc.RpcError as e:
                delay = attempts.failed(e)
                await self._backoff(delay, reconnect=error_of(e)[0] == grpc.StatusCode.UNAVAILABLE)

    async def _send_part(self, part: Part, limits: Limits, deadline: Deadline) -> Tuple[Any, int]:
        """The send path of a score call, as the sync client's: one part's
        serialized ``ScoreRequest`` over the unary ``Score`` RPC, or for a
        large part (``chunk_above``) its pieces over ``ScoreChunked``,
        retried per the policy within ``deadline``; returns
        ``(ScoreResponse, sends)``. A large part is serialized (the request,
        or each piece) in the loop's default executor, so the copies do not
        stall the loop's other tasks."""
        if self._chunked(part):
            chunked = transport.AioChunkedScore(self._score_chunked_raw, self.piece_bytes, offload_bytes=OFFLOAD_BYTES)
            attempts = self._part_attempts(part, limits, deadline, part.inputs.data_bytes())
            return await self._call(chunked, (part.id, part.inputs), attempts)
        if part.inputs.data_bytes() >= OFFLOAD_BYTES:
            loop = asyncio.get_running_loop()
            request = await loop.run_in_executor(None, part.serialized, limits.max_bytes)
        else:
            request = part.serialized(limits.max_bytes)
        return await self._call(self._score_raw, request, self._part_attempts(part, limits, deadline, len(request)))

    async def _backoff(self, delay: float, reconnect: bool) -> None:
        """Waits ``delay`` seconds, meanwhile reconnecting when ``reconnect``
        (see the sync client's ``_wait_connected``)."""
        end = time.monotonic() + delay
        if reconnect:
            try:
                await asyncio.wait_for(self._channel.channel_ready(), timeout=delay)
            except asyncio.TimeoutError:
                pass
        remaining = end - time.monotonic()
        if remaining > 0:
            await asyncio.sleep(remaining)

    async def server_info(self, refresh: bool = False, _deadline: Optional[Deadline] = None) -> Any:
        """The server's ``logprob.v1.ServerInfo``, fetched once and cached.
        Raises LogprobError."""
        async with self._info_lock:
            if self._info is None or refresh:
                attempts = self._attempts(_deadline or self._deadline())
                self._info, _ = await self._call(self._stub.GetServerInfo, pb2.ServerInfoRequest(), attempts)
            return self._info

    async def health(self, wait: float = 0.0) -> bool:
        """True once ``grpc.health.v1`` reports SERVING, polling for up to
        ``wait`` seconds; False otherwise (never raises for an unreachable
        server)."""
        deadline = time.monotonic() + max(0.0, wait)
        while True:
            unreachable = False
            try:
                remaining = max(0.5, deadline - time.monotonic())
                if await self._health(b"", timeout=min(5.0, remaining)) == HEALTH_SERVING:
                    return True
            except grpc.RpcError as e:
                unreachable = e.code() == grpc.StatusCode.UNAVAILABLE
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            await self._backoff(min(0.2, remaining), reconnect=unreachable)

    async def score_request(self, request: Any) -> Any:
        """Sends a prepared ``logprob.v1.ScoreRequest`` as is (no splitting),
        with retries within the client's timeout; returns the
        ``ScoreResponse``. Raises LogprobError."""
        response, _ = await self._call(self._stub.Score, request, self._attempts(self._deadline()))
        return response

    async def score(self, logits: Any = None, input_ids: Any = None, *, request_id: Optional[str] = None,
                    **options: Any) -> ScoreResult:
        """Scores a batch, like the sync ``LogprobClient.score`` (same
        arguments, result and errors). The parts of a split batch are sent
        one after the other; concurrent ``score`` calls share the channel."""
        deadline = self._deadline(options.pop("timeout", "default"))
        ipc = self._cuda_ipc_candidate(options) and cuda_ipc.server_accepts(
            await self.server_info(_deadline=deadline)
        )
        call = ScoreCall(request_id or self._next_id(), logits, input_ids, cuda_ipc=ipc, **options)
        limits = self._limits_of(await self.server_info(_deadline=deadline))
        while True:
            responses, sends = [], 0
            try:
                for part in call.parts(limits):
                    response, tries = await self._send_part(part, limits, deadline)
                    responses.append(response)
                    sends += tries
                return call.result(responses, sends)
            except LogprobError as e:
                # The server refused the CUDA IPC reference (once per call at
                # most): the call goes again with bytes, and so do later ones.
                if not call.refused(e):
                    raise
                self.cuda_ipc = False

    async def score_stream(
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
        deadline = self._deadline(timeout)
        limits = self._limits_of(await self.server_info(_deadline=deadline))
        assembler = StreamAssembler(limits, self._next_id)

        call = self._score_stream_raw(
            assembler.amessages(requests), timeout=assembler.timeout(deadline), metadata=self._metadata
        )
        try:
            try:
                async for response in call:
                    for outcome in assembler.on_response(response):
                        yield deliver(outcome, return_exceptions)
            except grpc.RpcError as e:
                tail = assembler.on_failure(e)
            else:
                tail = assembler.finish()
            for outcome in tail:
                yield deliver(outcome, return_exceptions)
        finally:
            call.cancel()

