"""What the sync and asyncio clients share besides the I/O: their
configuration, request ids, the retry loop's state and the limits."""

import itertools
import os
import random
from typing import Any, Dict, Optional, Sequence, Tuple

from ._proto import pb2, pb2_grpc
from .channel import ChannelSettings
from .request import Limits, Part
from .retry import Attempts, Deadline, OnRetry, RetryPolicy
from . import cuda_ipc, transport
from .wire import decode_response

HEALTH_CHECK = "/grpc.health.v1.Health/Check"
# The scoring RPCs, called with requests serialized by wire.encode_request
# (request_serializer None: the bytes go as they are) and responses read
# by wire.decode_response.
_SERVICE = pb2.DESCRIPTOR.services_by_name["LogprobService"].full_name
SCORE_METHOD = "/%s/Score" % _SERVICE
SCORE_STREAM_METHOD = "/%s/ScoreStream" % _SERVICE
# HealthCheckResponse{status = 1 (SERVING)}.
HEALTH_SERVING = b"\x08\x01"


class ClientBase:
    """Configuration of a client of ``logprob.v1.LogprobService``.

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
            (``shared_memory.py``; the synchronous client only, the asyncio
            client always sends inline). False: always inline.
        cuda_ipc: when the hidden states are a torch CUDA tensor and the
            server reports ``cuda_ipc_inputs`` on this host, send a CUDA IPC
            handle of their GPU memory instead of the bytes
            (``cuda_ipc.py``; both clients; ``score(..., cuda_ipc=False)``
            turns it off for one call). False: always bytes. A server that
            refuses a reference (FAILED_PRECONDITION about CUDA IPC, e.g. its
            workers cannot open the handle) gets the call again as bytes, and
            the client sets ``cuda_ipc`` False.

    Raises InvalidInputError for unreadable or empty TLS/token files.

    Attributes ``chunk_above`` (bytes; None or < 0: never) and
    ``piece_bytes``: a part with more bytes of tensor data than
    ``chunk_above`` goes through the ``ScoreChunked`` RPC in pieces of
    ``piece_bytes`` (``transport``); set them on a client to change them.
    """

    chunk_above: Optional[int] = transport.CHUNK_ABOVE
    piece_bytes: int = transport.PIECE_BYTES

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
        self._settings = ChannelSettings(
            target, tls_ca, tls_cert, tls_key, tls_server_name, token, token_file, channel_options
        )
        self._metadata = self._settings.metadata
        self._open()

    def _open(self) -> None:
        """Opens the channel and its methods (``_open_methods``); per client kind."""
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
