"""The sans-I/O core of the sync and asyncio clients: their configuration,
and every client operation (``score``, ``score_request``, ``server_info``,
``health``, ``score_stream``, shared memory, ``close``) written once as a
generator of I/O operations (``ops.py``). ``client.LogprobClient`` performs
those with blocking calls and ``aio.LogprobClient`` by awaiting; they hold
no logic of their own, so every option behaves the same in both.

What an operation decides here: request building and option checks
(``request.ScoreCall``), the retry loop and its backoffs (``ops.retried``,
``retry.Attempts``), the transport of each part (shared memory, CUDA IPC,
``ScoreChunked`` or one ``Score`` message), the per-call fallback from a
refused CUDA IPC reference to bytes, response decoding and joining, and the
stream's ordering (``stream.StreamAssembler``).
"""

import itertools
import os
import random
import re
import threading
import time
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import grpc

from ._proto import pb2, pb2_grpc
from .channel import ChannelSettings
from ..errors import LogprobError
from ..lm_head_update import (PUT_ROWS_METHOD, UPDATE_PUT_BYTES, UPDATE_REGION_BYTES, lm_head_rows_part,
                             lm_head_rows_parts)
from . import cuda_ipc, shared_memory, transport
from .ops import Emit, Locked, NextResponse, OpenStream, Ops, Rpc, Work, END, backoff, retried
from .request import Limits, Part, ScoreCall
from .result import ScoreResult
from .retry import Attempts, Deadline, OnRetry, RetryPolicy, error_of, reason_of
from .shared_memory import SharedMemoryInputs
from .stream import StreamAssembler, deliver
from .version_pin import VersionPin
from .wire import decode_response

# The server's rules for lm_head names (server/heads/lm_heads.h CheckLmHeadName,
# CheckLmHeadVersionName; docs/lm-head-updates.md): kept in step with it.
HEAD_NAME_RE = re.compile(r"[A-Za-z0-9._-]{1,64}")
VERSION_NAME_RE = re.compile(r"[A-Za-z0-9._:+-]{1,128}")


def check_lm_head_names(head: str, version: str) -> None:
    """Raises ValueError naming the field when ``head`` or ``version``
    breaks the server's rule (checked before anything is sent)."""
    if not isinstance(head, str) or not HEAD_NAME_RE.fullmatch(head):
        raise ValueError("head %r: an lm_head name is 1..64 characters of [A-Za-z0-9._-]" % (str(head)[:64],))
    if not isinstance(version, str) or not VERSION_NAME_RE.fullmatch(version):
        raise ValueError("version %r: an lm_head version is 1..128 characters of [A-Za-z0-9._:+-]"
                         % (str(version)[:128],))

HEALTH_CHECK = "/grpc.health.v1.Health/Check"
# The scoring RPCs, called with requests serialized by wire.encode_request
# (request_serializer None: the bytes go as they are) and responses read
# by wire.decode_response.
_SERVICE = pb2.DESCRIPTOR.services_by_name["LogprobService"].full_name
SCORE_METHOD = "/%s/Score" % _SERVICE
SCORE_STREAM_METHOD = "/%s/ScoreStream" % _SERVICE
# A unary Score request's size (a ScoreStream's: its largest message),
# announced in its metadata so that the server admits (or refuses) it
# before reading its body (the Score RPC in proto/logprob/v1/logprob.proto).
REQUEST_BYTES_METADATA = "logprob-request-bytes"


def announcing(metadata: Any, nbytes: int) -> Tuple[Tuple[str, str], ...]:
    """``metadata`` with a serialized request's size ``nbytes`` announced."""
    return tuple(metadata or ()) + ((REQUEST_BYTES_METADATA, str(nbytes)),)
# HealthCheckResponse{status = 1 (SERVING)}.
HEALTH_SERVING = b"\x08\x01"


class ClientBase:
    """Configuration of a client of ``logprob.v1.LogprobService``, and its
    operations (sans I/O; see the module's docstring).

    Args:
        target: ``"HOST:PORT"`` of the server.
        timeout: seconds a whole call may take (all parts of a split batch,
            every attempt and backoff; a ``score_stream``: the whole
            stream); None for no deadline.
        retry: a ``RetryPolicy`` (default: 5 attempts on UNAVAILABLE and
            RESOURCE_EXHAUSTED, 0.1 s doubling to 5 s, 50% jitter).
        tls_ca: PEM file of the CA that signs the server's certificate;
            turns on TLS (also turned on by any other ``tls_*`` argument; the
            system roots verify the server when ``tls_ca`` is not given).
        tls_cert, tls_key: PEM client certificate chain and key (mutual TLS;
            both or neither).
        tls_server_name: the name to verify in the server's certificate
            instead of the target's host.
        token: bearer token (surrounding whitespace trimmed), sent as
            ``authorization: Bearer TOKEN`` on every call, like
            ``logprob-client --auth-token-file``.
        token_file: file holding the token (instead of ``token``).
        update_token: the server's update token (its
            ``--update-token-file``), sent on ``update_lm_head``'s calls
            instead of ``token``; also on the other calls when ``token`` is
            not given (an update token may also score). Like
            ``logprob-client update-lm-head --update-token-file``.
        update_token_file: file holding it (instead of ``update_token``).
        max_request_bytes: split batches into requests of at most this many
            serialized bytes (default: 90% of the server's
            ``max_request_bytes`` from GetServerInfo; never more than that).
        max_tokens_per_request: split so that a request has at most this
            many token rows (default and upper bound: the server's
            ``max_tokens_per_request``).
        on_retry: optional ``callable(attempt, code, message, delay)`` called
            before each retry's sleep (logging, metrics).
        channel_options: extra ``grpc`` channel options.
        shared_memory: when the server reports this host (GetServerInfo's
            ``host_id``), send the tensors through a POSIX shared-memory
            region registered with it instead of in the request
            (``shared_memory.py``; both clients). False: always inline.
        cuda_ipc: when the hidden states (or the weight of
            ``update_lm_head``) are a torch CUDA tensor and the server
            reports ``cuda_ipc_inputs`` on this host, send a CUDA IPC
            handle of their GPU memory instead of the bytes
            (``cuda_ipc.py``; both clients; ``score(..., cuda_ipc=False)``
            turns it off for one call). False: always bytes. A server that
            refuses a reference (FAILED_PRECONDITION about CUDA IPC, e.g. its
            workers cannot open the handle) gets that call again as bytes;
            the client's ``cuda_ipc`` is left as it is (construct the client
            with ``cuda_ipc=False`` for such a server).

    Raises InvalidInputError for unreadable or empty TLS/token files.

    Attributes ``chunk_above`` (bytes; None or < 0: never) and
    ``piece_bytes``: a part with more bytes of tensor data than
    ``chunk_above`` goes through the ``ScoreChunked`` RPC in pieces of
    ``piece_bytes`` (``transport``); set them on a client to change them.
    """

    chunk_above: Optional[int] = transport.CHUNK_ABOVE
    piece_bytes: int = transport.PIECE_BYTES
    # The lock of server_info's cache, of the client's kind (made by _open).
    _info_lock: Any
    # Test seam: called with each part of a score() once it is answered,
    # before the next part is sent (e.g. to commit an update between parts).
    _after_part: Optional[Callable[[Part], None]] = None

    def __init__(
        self,
        target: str,
        timeout: Optional[float] = 60.0,
        retry: Optional[RetryPolicy] = None,
        tls_ca: Optional[str] = None,
        tls_cert: Optional[str] = None,
        tls_key: Optional[str] = None,
        tls_server_name: Optional[str] = None,
        token: Optional[str] = None,
        token_file: Optional[str] = None,
        max_request_bytes: Optional[int] = None,
        max_tokens_per_request: Optional[int] = None,
        on_retry: Optional[OnRetry] = None,
        channel_options: Sequence[Tuple[str, Any]] = (),
        shared_memory: bool = True,
        cuda_ipc: bool = True,
        update_token: Optional[str] = None,
        update_token_file: Optional[str] = None,
    ) -> None:
        self.target = target
        self.timeout = timeout
        self.retry = retry if retry is not None else RetryPolicy()
        self.max_request_bytes = max_request_bytes
        self.max_tokens_per_request = max_tokens_per_request
        self.on_retry = on_retry
        self.shared_memory = shared_memory
        self.cuda_ipc = cuda_ipc
        self._ids = itertools.count(1)
        self._info: Any = None
        self._rng = random.Random()
        # True: decided at the first score() (GetServerInfo's host_id); then
        # a SharedMemoryInputs, or None for inline bytes.
        self._shm: Union[bool, SharedMemoryInputs, None] = True if shared_memory else None
        # Updates with their own token: their own session (a session is bound
        # to the token it was opened with), made like _shm.
        self._update_shm: Union[bool, SharedMemoryInputs, None] = True if shared_memory else None
        self._shm_lock = threading.Lock()  # bookkeeping only, never held across I/O
        self._settings = ChannelSettings(
            target, tls_ca, tls_cert, tls_key, tls_server_name, token, token_file, channel_options,
            update_token, update_token_file
        )
        self._metadata = self._settings.metadata
        self._update_metadata = self._settings.update_metadata
        self._open()

    # -- what each client kind provides ------------------------------------

    def _open(self) -> None:
        """Opens the channel and its methods (``_open_methods``) and makes
        ``_info_lock`` (the lock a ``Locked`` op holds); per client kind."""
        raise NotImplementedError

    def _chunked_rpc(self) -> Any:
        """The ScoreChunked callable of a part (``transport.ChunkedScore`` or
        ``AioChunkedScore``, with this client's ``piece_bytes``); per client kind."""
        raise NotImplementedError

    def _open_methods(self, channel: Any) -> None:
        """The multicallables of ``channel`` (grpc or grpc.aio): ``_stub``
        (messages), ``_score_raw`` / ``_score_stream_raw`` (requests
        serialized by ``wire.encode_request``, responses read by
        ``wire.decode_response``), ``_score_chunked_raw`` (parts as bytes,
        ``transport.open_method``), ``_health``."""
        self._stub = pb2_grpc.LogprobServiceStub(channel)
        self._score_chunked_raw = transport.open_method(channel)
        self._score_raw = channel.unary_unary(SCORE_METHOD, response_deserializer=decode_response)
        self._score_stream_raw = channel.stream_stream(SCORE_STREAM_METHOD, response_deserializer=decode_response)
        self._health = channel.unary_unary(
            HEALTH_CHECK, request_serializer=lambda x: x, response_deserializer=lambda x: x
        )
        self._put_lm_head_rows_raw = channel.stream_unary(
            PUT_ROWS_METHOD, request_serializer=lambda x: x, response_deserializer=pb2.LmHeadUpdate.FromString
        )

    # -- small decisions ---------------------------------------------------

    def _next_id(self) -> str:
        return "py-%d-%d" % (os.getpid(), next(self._ids))

    def _deadline(self, timeout: Any = "default") -> Deadline:
        """The deadline of a call starting now (``timeout`` overrides the client's)."""
        return Deadline(self.timeout if timeout == "default" else timeout)

    def _attempts(self, deadline: Deadline, part: Optional[Tuple[int, int]] = None, oversize: bool = False) -> Attempts:
        return Attempts(self.retry, deadline, self._rng, self.on_retry, part=part, oversize=oversize)

    def _chunked(self, part: Part) -> bool:
        """True when ``part`` goes through ScoreChunked (``chunk_above``;
        never a part whose hidden states go by CUDA IPC)."""
        return part.cuda_ipc is None and transport.use_chunked(part.inputs, self.chunk_above)

    def _cuda_ipc_candidate(self, options: Dict[str, Any]) -> bool:
        """Pops ``score``'s per-call ``cuda_ipc`` option (default: the
        client's); True when the call may send its hidden states by CUDA IPC
        (``cuda_ipc.candidate``), which the server's info then decides
        (``cuda_ipc.server_accepts``)."""
        return cuda_ipc.candidate(options.pop("cuda_ipc", self.cuda_ipc), options.get("hidden_states"))

    def _part_attempts(self, part: Part, limits: Limits, deadline: Deadline, size: int) -> Attempts:
        """The retry loop of a part of ``size`` bytes (not retried when over
        the server's limit: it would fail the same way each time)."""
        return self._attempts(deadline, part.where, oversize=size > limits.server_bytes)

    def _limits_of(self, info: Any) -> Limits:
        return Limits(info, self.max_request_bytes, self.max_tokens_per_request)

    # -- operations (ops.py) -----------------------------------------------

    def _server_info_ops(self, refresh: bool = False, deadline: Optional[Deadline] = None) -> Ops[Any]:
        """``server_info``: the server's ``ServerInfo``, fetched once (under
        ``_info_lock``) and cached."""
        return (yield Locked(self._info_lock, self._fetch_info_ops(refresh, deadline)))

    def _fetch_info_ops(self, refresh: bool, deadline: Optional[Deadline]) -> Ops[Any]:
        if self._info is None or refresh:
            attempts = self._attempts(deadline or self._deadline())
            self._info, _ = yield from retried(self._stub.GetServerInfo, pb2.ServerInfoRequest(), attempts,
                                               self._metadata)
        return self._info

    def _health_ops(self, wait: float) -> Ops[bool]:
        """``health``: polls ``grpc.health.v1`` for up to ``wait`` seconds."""
        deadline = time.monotonic() + max(0.0, wait)
        while True:
            unreachable = False
            try:
                remaining = max(0.5, deadline - time.monotonic())
                if (yield Rpc(self._health, b"", min(5.0, remaining), None)) == HEALTH_SERVING:
                    return True
            except grpc.RpcError as e:
                unreachable = error_of(e)[0] == grpc.StatusCode.UNAVAILABLE
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            yield from backoff(min(0.2, remaining), reconnect=unreachable)

    def _score_request_ops(self, request: Any) -> Ops[Any]:
        """``score_request``: a prepared ScoreRequest as is, retried."""
        response, _ = yield from retried(self._stub.Score, request, self._attempts(self._deadline()),
                                         announcing(self._metadata, request.ByteSize()))
        return response

    def _score_ops(self, logits: Any, input_ids: Any, request_id: Optional[str],
                   options: Dict[str, Any]) -> Ops[ScoreResult]:
        """``score`` (``options``: its keyword options, consumed)."""
        deadline = self._deadline(options.pop("timeout", "default"))
        ipc = False
        if self._cuda_ipc_candidate(options):
            ipc = cuda_ipc.server_accepts((yield from self._server_info_ops(deadline=deadline)))
        call = ScoreCall(request_id or self._next_id(), logits, input_ids, cuda_ipc=ipc, **options)
        limits = self._limits_of((yield from self._server_info_ops(deadline=deadline)))
        # Every part is scored with the version the first got (version_pin.py).
        pin = VersionPin(call.inputs.head, call.inputs.head_version)
        while True:
            responses: List[Any] = []
            sends = 0
            pin.start()
            try:
                parts = call.parts(limits)
                for part in parts:
                    response, tries = yield from self._send_part_ops(part, limits, deadline)
                    responses.append(response)
                    sends += tries
                    if len(responses) == 1:
                        pin.first_scored(response, parts)
                    if self._after_part is not None:
                        self._after_part(part)
                return call.result(responses, sends)
            except LogprobError as e:
                # The server refused the CUDA IPC reference (once per call at
                # most): this call goes again with bytes. Nothing changes for
                # other calls (the client's cuda_ipc is the caller's setting).
                # Or the version the parts were pinned to was released: the
                # whole call starts again on the current one (once).
                if not call.refused(e) and not pin.restart(e):
                    raise

    def _send_part_ops(self, part: Part, limits: Limits, deadline: Deadline) -> Ops[Tuple[Any, int]]:
        """The send path of a score call: one part's serialized
        ``ScoreRequest`` over the unary ``Score`` RPC, or for a large part
        (``chunk_above``) its pieces over ``ScoreChunked``, retried per the
        policy within ``deadline``; returns ``(ScoreResponse, sends)``. The
        request's bytes (the copy of the caller's data) exist only during
        this call; a large part is serialized as ``Work`` (off the asyncio
        client's loop). Same-host servers get the tensors through shared
        memory instead (``shared_memory.py``), and hidden states in CUDA
        memory as a CUDA IPC reference (``cuda_ipc.py``; the part's bytes are
        then the small tensors and the reference)."""
        if part.cuda_ipc is None:
            sent = yield from self._shared_memory_send_ops(part, limits, deadline)
            if sent is not None:
                return sent
        if self._chunked(part):
            # Large parts go as pieces viewing the arrays (transport.py).
            attempts = self._part_attempts(part, limits, deadline, part.inputs.data_bytes())
            return (yield from retried(self._chunked_rpc(), (part.id, part.inputs), attempts, self._metadata))
        request: bytes = yield Work(part.serialized, limits.max_bytes, nbytes=part.inputs.data_bytes())
        attempts = self._part_attempts(part, limits, deadline, len(request))
        return (yield from retried(self._score_raw, request, attempts, announcing(self._metadata, len(request))))

    def _shared_memory_ops(self, deadline: Deadline, update: bool = False) -> Ops[Optional[SharedMemoryInputs]]:
        """This client's shared-memory session (``update``: the one of
        update calls, which is the same unless an ``update_token`` differs
        from ``token``): decided at its first use (the server's info), then
        kept; None when shared memory is not used (off, or the server is on
        another host)."""
        attr = "_update_shm" if update and self._update_metadata != self._metadata else "_shm"
        metadata = self._update_metadata if update else self._metadata
        if getattr(self, attr) is True:
            use = shared_memory.usable((yield from self._server_info_ops(deadline=deadline)))
            with self._shm_lock:
                if getattr(self, attr) is True:
                    setattr(self, attr, SharedMemoryInputs(self._stub, self.timeout, metadata) if use else None)
        shm = getattr(self, attr)
        return shm if isinstance(shm, SharedMemoryInputs) else None

    def _shared_memory_send_ops(self, part: Part, limits: Limits, deadline: Deadline) -> Ops[Optional[Tuple[Any, int]]]:
        """Sends ``part`` through this client's shared-memory region
        (``shared_memory.py``); None when shared memory is not used (off, the
        server is on another host, or no region could be had), and the caller
        sends inline. The server counts referenced bytes against its
        max_request_bytes, like inline bytes."""
        shm = yield from self._shared_memory_ops(deadline)
        if shm is None:
            return None
        attempts = self._part_attempts(part, limits, deadline, part.inputs.data_bytes())

        def send(tensors: List[Any], metadata: Any) -> Ops[Tuple[Any, int]]:
            # The request holds references only (small); the answer is read as
            # views of its bytes, as on the inline path.
            request = part.inputs.header(part.id)
            request.inputs.extend(tensors)
            serialized = request.SerializeToString()
            return retried(self._score_raw, serialized, attempts, announcing(metadata, len(serialized)))

        return (yield from shm.send(part.inputs.tensors, send))

    def _score_stream_ops(self, requests: Union[Iterable[Any], Any], timeout: Any,
                          return_exceptions: bool) -> Ops[None]:
        """``score_stream``: emits (``Emit``) one outcome per request, in
        request order; cancels the stream when it ends or is closed."""
        deadline = self._deadline(timeout)
        limits = self._limits_of((yield from self._server_info_ops(deadline=deadline))).for_stream()
        assembler = StreamAssembler(limits, self._next_id)
        call = yield OpenStream(self._score_stream_raw, assembler, requests, assembler.timeout(deadline),
                                announcing(self._metadata, limits.message_bytes))
        try:
            try:
                while True:
                    response = yield NextResponse(call)
                    if response is END:
                        break
                    for outcome in assembler.on_response(response):
                        yield Emit(deliver(outcome, return_exceptions))
            except grpc.RpcError as e:
                tail = assembler.on_failure(e)
            else:
                tail = assembler.finish()
            for outcome in tail:
                yield Emit(deliver(outcome, return_exceptions))
        finally:
            call.cancel()

    def _put_rows_ops(self, parts: Callable[[], Any], deadline: Deadline, metadata: Any,
                      nbytes: int = 0) -> Ops[Any]:
        """One PutLmHeadRows call of the serialized parts ``parts()`` makes
        (an iterator; making them copies ``nbytes``), sent again after
        UNAVAILABLE as the client's retry policy allows: a put that failed
        part way counted no rows on the server, and one whose answer was
        lost is answered OK again (the server compares the same bytes with
        the rows it received). Other errors raise at once."""
        attempts = self._attempts(deadline)
        while True:
            try:
                return (yield Rpc(self._put_lm_head_rows_raw, parts(), attempts.timeout(), metadata, nbytes=nbytes))
            except grpc.RpcError as e:
                code, message = error_of(e)
                if code != grpc.StatusCode.UNAVAILABLE:
                    raise LogprobError(code, message, reason=reason_of(e)) from None
                yield from backoff(attempts.failed(e), reconnect=True)

    def _put_host_rows_ops(self, update_id: str, rows: Any, dt: int, deadline: Deadline,
                           row_begin: int = 0) -> Ops[None]:
        """The host rows ``[V', H]`` of an update (its rows ``[row_begin,
        row_begin + V')``): through this client's shared-memory regions on
        the server's host, in puts of at most ``UPDATE_REGION_BYTES``, else
        in pieces (made in the asyncio client's executor), in puts of at
        most ``UPDATE_PUT_BYTES``; both at most 90% of the server's
        max_request_bytes."""
        info = yield from self._server_info_ops(deadline=deadline)
        server_limit = int(info.max_request_bytes)
        limit = int(server_limit * 0.9) if server_limit else UPDATE_PUT_BYTES
        row_bytes = max(1, int(rows[:1].nbytes))
        shm = yield from self._shared_memory_ops(deadline, update=True)
        per_put = max(1, min(UPDATE_PUT_BYTES if shm is None else UPDATE_REGION_BYTES, limit) // row_bytes)
        starts = list(range(0, int(rows.shape[0]), per_put))
        sent: List[Any] = [None] * len(starts)
        if shm is not None:
            # Same host: the rows go through this client's regions, the copy
            # of one put overlapping the call of the one before.
            def put(i: int, tensors: List[Any], metadata: Any) -> Ops[Any]:
                return self._put_rows_ops(lambda: iter([lm_head_rows_part(update_id, row_begin + starts[i], tensors[0])]),
                                          deadline, metadata)

            sent = yield from shm.send_each([[("rows", dt, rows[r0:r0 + per_put])] for r0 in starts], put)
        for i, r0 in enumerate(starts):
            if sent[i] is None:
                # Otherwise (or without a region) the bytes in pieces.
                chunk = rows[r0:r0 + per_put]
                yield from self._put_rows_ops(
                    lambda: lm_head_rows_parts(update_id, row_begin + r0, chunk, dt, self.piece_bytes), deadline,
                    self._update_metadata, nbytes=int(chunk.nbytes))

    def _close_ops(self) -> Ops[None]:
        """``close``, before the channel closes: unregisters and removes the
        shared-memory regions."""
        for shm in (self._shm, self._update_shm):
            if isinstance(shm, SharedMemoryInputs):
                yield from shm.close()
