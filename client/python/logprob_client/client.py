"""``LogprobClient``: scoring numpy / torch batches on a logprob-server
(synchronous ``grpc``; ``aio.LogprobClient`` is the asyncio twin)."""

import threading
import time
from typing import Any, Iterable, Iterator, Optional, Tuple, Union

import grpc

from ._proto import pb2
from .base import HEALTH_SERVING, ClientBase
from .errors import LogprobError
from .request import Limits, Part, ScoreCall
from .result import ScoreResult
from .retry import Attempts, Deadline, error_of
from .stream import StreamAssembler, deliver
from . import cuda_ipc, shared_memory, transport


class LogprobClient(ClientBase):
    """A client of ``logprob.v1.LogprobService`` over a ``grpc`` channel;
    arguments (target, timeout, retry, TLS, token, limits) as in
    ``ClientBase``. Thread-safe: threads may share one client (one
    channel); use it as a context manager or ``close()`` it."""

    def _open(self) -> None:
        self._info_lock = threading.Lock()
        # True: decided at the first score() (GetServerInfo's host_id); then
        # a SharedMemoryInputs, or None for inline bytes.
        self._shm: Any = True if self.shared_memory else None
        self._channel = self._settings.open_sync()
        self._open_methods(self._channel)

    # -- lifecycle -------------------------------------------------------

    def close(self) -> None:
        """Closes the channel (and removes the shared-memory regions)."""
        if isinstance(self._shm, shared_memory.SharedMemoryInputs):
            self._shm.close()
        self._channel.close()

    def __enter__(self) -> "LogprobClient":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- calls -----------------------------------------------------------

    def _call(self, method: Any, request: Any, attempts: Attempts, metadata: Any = None) -> Tuple[Any, int]:
        """Sends ``request`` with ``method`` (and ``metadata``, default the
        client's) until it succeeds or ``attempts`` gives up (raising
        LogprobError); returns ``(response, sends)``."""
        while True:
            timeout = attempts.timeout()
            try:
                return method(request, timeout=timeout, metadata=metadata or self._metadata), attempts.count
            except grpc.RpcError as e:
                delay = attempts.failed(e)
                self._backoff(delay, reconnect=error_of(e)[0] == grpc.StatusCode.UNAVAILABLE)

    def _send_part(self, part: Part, limits: Limits, deadline: Deadline) -> Tuple[Any, int]:
        """The send path of a score call: one part's serialized ``ScoreRequest`` over
        the unary ``Score`` RPC, or for a large part (``chunk_above``) its
        pieces over ``ScoreChunked``, retried per the policy within
        ``deadline``; returns ``(ScoreResponse, sends)``. The request's bytes
        (the copy of the caller's data) exist only during this call. Same-host
        servers get the tensors through shared memory instead
        (``shared_memory.py``), and hidden states in CUDA memory as a CUDA IPC
        reference (``cuda_ipc.py``; the part's bytes are then the small
        tensors and the reference)."""
        sent = None if part.cuda_ipc is not None else self._shared_memory_send(part, limits, deadline)
        if sent is not None:
            return sent
        if self._chunked(part):
            # Large parts go as pieces viewing the arrays (transport.py).
            chunked = transport.ChunkedScore(self._score_chunked_raw, self.piece_bytes)
            attempts = self._part_attempts(part, limits, deadline, part.inputs.data_bytes())
            return self._call(chunked, (part.id, part.inputs), attempts)
        request = part.serialized(limits.max_bytes)
        return self._call(self._score_raw, request, self._part_attempts(part, limits, deadline, len(request)))

    def _shared_memory_send(self, part: Part, limits: Limits, deadline: Deadline) -> Optional[Tuple[Any, int]]:
        """Sends ``part`` through this client's shared-memory region
        (``shared_memory.py``); None when shared memory is not used (off, the
        server is on another host, or registering failed), and the caller
        sends inline. The server counts referenced bytes against its
        max_request_bytes, like inline bytes."""
        if self._shm is True:
            use = shared_memory.usable(self.server_info(_deadline=deadline))
            with self._info_lock:
                if self._shm is True:
                    self._shm = shared_memory.SharedMemoryInputs(self._stub, self.timeout, self._metadata) if use else None
        if not self._shm:
            return None
        attempts = self._part_attempts(part, limits, deadline, part.inputs.data_bytes())
        return self._shm.send(
            part.id,
            part.inputs.tensors,
            part.inputs.options,
            # The request holds references only (small); the answer is read as
            # views of its bytes, as on the inline path.
            lambda request, metadata: self._call(
                self._score_raw, request.SerializeToString(), attempts, metadata=metadata
            ),
        )

    def _wait_connected(self, seconds: float) -> bool:
        """Asks the channel to connect and waits up to ``seconds`` for it to be
        READY. (A channel whose connection failed otherwise waits for its own
        reconnect timer, observed at 10-15 s with grpcio 1.51, before a
        fail-fast call sees a server that came back.)"""
        future = grpc.channel_ready_future(self._channel)
        try:
            future.result(timeout=max(0.0, seconds))
            return True
        except grpc.FutureTimeoutError:
            future.cancel()
            return False

    def _backoff(self, delay: float, reconnect: bool) -> None:
        """Sleeps ``delay`` seconds, meanwhile reconnecting when ``reconnect``."""
        end = time.monotonic() + delay
        if reconnect:
            self._wait_connected(delay)
        remaining = end - time.monotonic()
        if remaining > 0:
            time.sleep(remaining)

    def server_info(self, refresh: bool = False, _deadline: Optional[Deadline] = None) -> Any:
        """The server's ``logprob.v1.ServerInfo`` (workers, limits, lm_head
        vocab_size / hidden_size ...), fetched once and cached. Raises
        LogprobError."""
        with self._info_lock:
            if self._info is None or refresh:
                attempts = self._attempts(_deadline or self._deadline())
                self._info, _ = self._call(self._stub.GetServerInfo, pb2.ServerInfoRequest(), attempts)
            return self._info

    def health(self, wait: float = 0.0) -> bool:
        """True once ``grpc.health.v1`` reports SERVING for the server,
        polling for up to ``wait`` seconds; False otherwise (never raises for
        an unreachable server)."""
        deadline = time.monotonic() + max(0.0, wait)
        while True:
            unreachable = False
            try:
                remaining = max(0.5, deadline - time.monotonic())
                if self._health(b"", timeout=min(5.0, remaining)) == HEALTH_SERVING:
                    return True
            except grpc.RpcError as e:
                unreachable = e.code() == grpc.StatusCode.UNAVAILABLE
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            self._backoff(min(0.2, remaining), reconnect=unreachable)

    def score_request(self, request: Any) -> Any:
        """Sends a prepared ``logprob.v1.ScoreRequest`` as is (no splitting),
        with retries within the client's timeout; returns the
        ``ScoreResponse``. Raises LogprobError."""
        response, _ = self._call(self._stub.Score, request, self._attempts(self._deadline()))
        return response

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

        Options: ``alignment`` "next_token" (row t scores input_ids[t + 1])
        or "same_position"; ``entropy``; ``topk`` (K of ``topk_logprobs`` /
        ``topk_indices``); ``temperature`` (> 0); ``sampling_top_k`` (0
        off), ``sampling_top_p`` (1 or None off); ``ignore_index`` (default
        -100 at the server: such targets score 0); ``request_id`` (default
        ``py-<pid>-<n>``); ``timeout`` (seconds for this call, overriding
        the client's).

        A batch larger than the server's limits (``max_request_bytes``,
        ``max_tokens_per_request`` from GetServerInfo, or the client's own)
        is sent as several requests of whole sequences and the results are
        joined (``split=False`` sends it as one). Each request is retried
        per the ``RetryPolicy``; the timeout bounds the whole call.

        The caller's arrays are copied once (into the request message; a
        CUDA tensor is copied to the host first, a dtype conversion makes
        one more array). ``cuda_ipc`` (default: the client's): CUDA
        ``hidden_states`` go to a same-host server with CUDA workers as a
        CUDA IPC reference, no copy to the host (``cuda_ipc.py``). Raises InvalidInputError (a ValueError) for inputs
        the client can tell are wrong, TypeError for unsupported dtypes,
        LogprobError with the gRPC code and message for a failed call
        (DEADLINE_EXCEEDED when the timeout passes).
        """
        deadline = self._deadline(options.pop("timeout", "default"))
        ipc = self._cuda_ipc_candidate(options) and cuda_ipc.server_accepts(self.server_info(_deadline=deadline))
        call = ScoreCall(request_id or self._next_id(), logits, input_ids, cuda_ipc=ipc, **options)
        limits = self._limits_of(self.server_info(_deadline=deadline))
        while True:
            responses, sends = [], 0
            try:
                for part in call.parts(limits):
                    response, tries = self._send_part(part, limits, deadline)
                    responses.append(response)
                    sends += tries
                return call.result(responses, sends)
            except LogprobError as e:
                # The server refused the CUDA IPC reference (once per call at
                # most): the call goes again with bytes, and so do later ones.
                if not call.refused(e):
                    raise
                self.cuda_ipc = False

    def score_stream(
        self,
        requests: Iterable[Union[dict, Any]],
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
        stream.
        """
        deadline = self._deadline(timeout)
        limits = self._limits_of(self.server_info(_deadline=deadline))
        assembler = StreamAssembler(limits, self._next_id)

        responses = self._score_stream_raw(
            assembler.messages(requests), timeout=assembler.timeout(deadline), metadata=self._metadata
        )
        try:
            try:
                for response in responses:
                    for outcome in assembler.on_response(response):
                        yield deliver(outcome, return_exceptions)
            except grpc.RpcError as e:
                tail = assembler.on_failure(e)
            else:
                tail = assembler.finish()
            for outcome in tail:
                yield deliver(outcome, return_exceptions)
        finally:
            responses.cancel()

