"""``LogprobClient``: scoring numpy / torch batches on a logprob-server."""

import itertools
import os
import random
import threading
import time
import warnings

import grpc
import numpy as np

from . import shared_memory, splitter
from ._proto import pb2, pb2_grpc
from .errors import InvalidInputError, LogprobError
from .tensors import as_numpy, float_array, from_tensor, int_array

# Fraction of the server's max_request_bytes a part may fill (like the C++
# client's kRequestFill), and the limit used when the server reports none.
REQUEST_FILL = 0.9
DEFAULT_MAX_REQUEST_BYTES = 64 << 20

_ALIGNMENTS = {
    "next_token": pb2.NEXT_TOKEN,
    "same_position": pb2.SAME_POSITION,
}

_HEALTH_CHECK = "/grpc.health.v1.Health/Check"


class RetryPolicy:
    """When and how long to wait before sending a failed call again.

    A call failing with a code in ``retry_codes`` (default ``UNAVAILABLE``
    and ``RESOURCE_EXHAUSTED``, the codes the server asks clients to retry)
    is sent again, up to ``max_attempts`` sends in all. Before attempt
    ``n + 1`` the client sleeps ``min(max_backoff, initial_backoff *
    multiplier ** (n - 1))`` scaled by a random factor in ``[1 - jitter,
    1]``. Other codes (``INVALID_ARGUMENT``, ``UNAUTHENTICATED``,
    ``DEADLINE_EXCEEDED``, ...) are raised at once.

    ``max_attempts=1`` disables retries.
    """

    def __init__(
        self,
        max_attempts=5,
        initial_backoff=0.1,
        max_backoff=5.0,
        multiplier=2.0,
        jitter=0.5,
        retry_codes=(grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED),
    ):
        if max_attempts < 1:
            raise ValueError("max_attempts must be >= 1")
        if initial_backoff < 0 or max_backoff < 0 or multiplier < 1 or not 0 <= jitter <= 1:
            raise ValueError("backoffs must be >= 0, multiplier >= 1, jitter in [0, 1]")
        self.max_attempts = int(max_attempts)
        self.initial_backoff = float(initial_backoff)
        self.max_backoff = float(max_backoff)
        self.multiplier = float(multiplier)
        self.jitter = float(jitter)
        self.retry_codes = frozenset(retry_codes)

    def backoff(self, attempt, rng=random):
        """Seconds to sleep after failed attempt number ``attempt`` (1-based)."""
        base = min(self.max_backoff, self.initial_backoff * self.multiplier ** (attempt - 1))
        return base * (1.0 - self.jitter * rng.random())

    def __repr__(self):
        return "RetryPolicy(max_attempts=%d, initial_backoff=%g, max_backoff=%g, multiplier=%g, jitter=%g)" % (
            self.max_attempts,
            self.initial_backoff,
            self.max_backoff,
            self.multiplier,
            self.jitter,
        )


class ScoreResult:
    """The outputs of one score call as numpy arrays (float32; ids int64),
    shaped like the input's token layout (shared/SPEC.md):

    - padded input [B, S, X]: ``[B, S - 1]`` for next_token alignment,
      ``[B, S]`` for same_position (positions past ``seq_lens`` are 0);
    - packed input [T, X]: ``[T - B]`` / ``[T]`` (sequence i's values start
      at ``cu_seqlens[i] - i`` for next_token; see ``split_sequences``).

    ``topk_logprobs``, ``topk_indices`` and ``gathered_logprobs`` add a
    trailing ``[K]``. Outputs not requested are None.

    Attributes: ``token_logprobs``, ``entropy``, ``topk_logprobs``,
    ``topk_indices``, ``gathered_logprobs``, ``outputs`` (dict of all by
    name), ``id``, ``num_parts`` (requests the batch was split into),
    ``attempts`` (calls sent, retries included).
    """

    def __init__(self, outputs, request_id, num_parts, attempts):
        self.outputs = outputs
        self.id = request_id
        self.num_parts = num_parts
        self.attempts = attempts

    token_logprobs = property(lambda self: self.outputs.get("token_logprobs"))
    entropy = property(lambda self: self.outputs.get("entropy"))
    topk_logprobs = property(lambda self: self.outputs.get("topk_logprobs"))
    topk_indices = property(lambda self: self.outputs.get("topk_indices"))
    gathered_logprobs = property(lambda self: self.outputs.get("gathered_logprobs"))

    def __getitem__(self, name):
        return self.outputs[name]

    def __contains__(self, name):
        return name in self.outputs

    def __repr__(self):
        shapes = ", ".join("%s=%s" % (k, list(v.shape)) for k, v in self.outputs.items())
        return "ScoreResult(id=%r, %s, num_parts=%d)" % (self.id, shapes, self.num_parts)


def split_sequences(values, cu_seqlens, alignment="next_token"):
    """Cuts a packed output (``[T - B, ...]`` for next_token, ``[T, ...]``
    for same_position) into a list of per-sequence arrays, sequence i having
    ``L_i - 1`` (next_token) or ``L_i`` rows."""
    cu = np.asarray(cu_seqlens, dtype=np.int64)
    lens = np.diff(cu)
    if alignment in ("next_token", pb2.NEXT_TOKEN):
        lens = np.maximum(lens - 1, 0)
    off = np.concatenate([[0], np.cumsum(lens)])
    if off[-1] != len(values):
        raise ValueError("values have %d rows, cu_seqlens gives %d" % (len(values), off[-1]))
    return [values[off[i]:off[i + 1]] for i in range(len(lens))]


def _read_file(what, path):
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise InvalidInputError("%s %s: cannot read: %s" % (what, path, e.strerror)) from None
    if not data:
        raise InvalidInputError("%s %s: the file is empty" % (what, path))
    return data


def _check_token(token, where):
    token = token.strip()
    if not token:
        raise InvalidInputError("%s: the token is empty" % where)
    if any(not 0x21 <= ord(c) <= 0x7E for c in token):
        raise InvalidInputError("%s: the token holds a character that is not printable ASCII" % where)
    return token


class LogprobClient:
    """A client of ``logprob.v1.LogprobService``.

    Args:
        target: ``"HOST:PORT"`` of the server.
        timeout: deadline of each call (each attempt of each part), seconds;
            None for no deadline.
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
        shared_memory: send tensors through POSIX shared memory when the
            server is on this host (``shared_memory.py``); False: always inline.

    Raises InvalidInputError for unreadable or empty TLS/token files.
    The client is thread-safe; use it as a context manager or ``close()`` it.
    """

    def __init__(
        self,
        target,
        timeout=60.0,
        retry=None,
        tls_ca=None,
        tls_cert=None,
        tls_key=None,
        tls_server_name=None,
        token=None,
        token_file=None,
        max_request_bytes=None,
        max_tokens_per_request=None,
        on_retry=None,
        channel_options=(),
        shared_memory=True,
    ):
        self.target = target
        self.timeout = timeout
        self.retry = retry if retry is not None else RetryPolicy()
        self.max_request_bytes = max_request_bytes
        self.max_tokens_per_request = max_tokens_per_request
        self.on_retry = on_retry
        self._ids = itertools.count(1)
        self._info = None
        self._info_lock = threading.Lock()
        self._rng = random.Random()
        self._shm = shared_memory  # True: decided at the first score(); then a SharedMemoryInputs or None

        if token is not None and token_file is not None:
            raise InvalidInputError("give token or token_file, not both")
        if token_file is not None:
            token = _check_token(_read_file("token_file", token_file).decode("latin-1"), "token_file " + token_file)
        elif token is not None:
            token = _check_token(token, "token")
        self._metadata = (("authorization", "Bearer " + token),) if token else None

        options = [
            ("grpc.max_send_message_length", -1),
            ("grpc.max_receive_message_length", -1),
            # Quick reconnects to a server that comes back. (Not
            # grpc.min_reconnect_backoff_ms: gRPC also takes it as the time a
            # connection attempt, TLS handshake included, may last.)
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 500),
        ]
        use_tls = any(x for x in (tls_ca, tls_cert, tls_key, tls_server_name))
        if use_tls:
            if bool(tls_cert) != bool(tls_key):
                raise InvalidInputError("tls_cert and tls_key go together (mutual TLS)")
            creds = grpc.ssl_channel_credentials(
                root_certificates=_read_file("tls_ca", tls_ca) if tls_ca else None,
                private_key=_read_file("tls_key", tls_key) if tls_key else None,
                certificate_chain=_read_file("tls_cert", tls_cert) if tls_cert else None,
            )
            if tls_server_name:
                options.append(("grpc.ssl_target_name_override", tls_server_name))
            options.extend(channel_options)
            self._channel = grpc.secure_channel(target, creds, options=options)
        else:
            options.extend(channel_options)
            self._channel = grpc.insecure_channel(target, options=options)
        if token and not use_tls:
            warnings.warn("logprob_client: bearer token without TLS: the token is sent in plaintext", stacklevel=2)

        self._stub = pb2_grpc.LogprobServiceStub(self._channel)
        self._health = self._channel.unary_unary(
            _HEALTH_CHECK, request_serializer=lambda x: x, response_deserializer=lambda x: x
        )

    # -- lifecycle -------------------------------------------------------

    def close(self):
        """Closes the channel (and removes the shared-memory regions)."""
        if isinstance(self._shm, shared_memory.SharedMemoryInputs):
            self._shm.close()
        self._channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- calls -----------------------------------------------------------

    def _call(self, method, request, part=None, oversize=False, metadata=None):
        """Sends ``request`` with retries; returns ``(response, attempts)``."""
        attempt = 0
        while True:
            attempt += 1
            try:
                return method(request, timeout=self.timeout, metadata=metadata or self._metadata), attempt
            except grpc.RpcError as e:
                code = e.code() if hasattr(e, "code") else grpc.StatusCode.UNKNOWN
                message = e.details() if hasattr(e, "details") else str(e)
                # A message over the server's size limit fails the same way each time.
                retry = code in self.retry.retry_codes and attempt < self.retry.max_attempts and not oversize
                if not retry:
                    raise LogprobError(code, message or "", attempts=attempt, part=part) from None
                delay = self.retry.backoff(attempt, self._rng)
                if self.on_retry is not None:
                    self.on_retry(attempt, code, message, delay)
                self._backoff(delay, reconnect=code == grpc.StatusCode.UNAVAILABLE)

    def _wait_connected(self, seconds):
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

    def _backoff(self, delay, reconnect):
        """Sleeps ``delay`` seconds, meanwhile reconnecting when ``reconnect``."""
        end = time.monotonic() + delay
        if reconnect:
            self._wait_connected(delay)
        remaining = end - time.monotonic()
        if remaining > 0:
            time.sleep(remaining)

    def server_info(self, refresh=False):
        """The server's ``logprob.v1.ServerInfo`` (workers, limits, lm_head
        vocab_size / hidden_size ...), fetched once and cached. Raises
        LogprobError."""
        with self._info_lock:
            if self._info is None or refresh:
                self._info, _ = self._call(self._stub.GetServerInfo, pb2.ServerInfoRequest())
            return self._info

    def health(self, wait=0.0):
        """True once ``grpc.health.v1`` reports SERVING for the server,
        polling for up to ``wait`` seconds; False otherwise (never raises for
        an unreachable server)."""
        deadline = time.monotonic() + max(0.0, wait)
        while True:
            unreachable = False
            try:
                remaining = max(0.5, deadline - time.monotonic())
                reply = self._health(b"", timeout=min(5.0, remaining))
                # HealthCheckResponse{status = 1 (SERVING)} is b"\x08\x01".
                if reply == b"\x08\x01":
                    return True
            except grpc.RpcError as e:
                unreachable = e.code() == grpc.StatusCode.UNAVAILABLE
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            self._backoff(min(0.2, remaining), reconnect=unreachable)

    def _limits(self):
        info = self.server_info()
        server_bytes = int(info.max_request_bytes) or DEFAULT_MAX_REQUEST_BYTES
        max_bytes = max(1, int(server_bytes * REQUEST_FILL))
        if self.max_request_bytes:
            max_bytes = min(max_bytes, int(self.max_request_bytes))
        max_tokens = int(info.max_tokens_per_request)
        if self.max_tokens_per_request:
            max_tokens = (
                min(max_tokens, int(self.max_tokens_per_request)) if max_tokens > 0 else int(self.max_tokens_per_request)
            )
        return server_bytes, max_bytes, max_tokens

    def _shared_memory_send(self, part_id, inputs, part, server_bytes):
        """Sends one part through shared memory (``shared_memory.py``);
        None when it is not used (then the caller sends inline). The server
        counts referenced bytes against its max_request_bytes, like inline."""
        if self._shm is True:
            use = shared_memory.usable(self.server_info())
            with self._info_lock:
                if self._shm is True:
                    self._shm = shared_memory.SharedMemoryInputs(self._stub, self.timeout, self._metadata) if use else None
        if not self._shm:
            return None
        return self._shm.send(
            part_id, inputs.tensors, inputs.options,
            lambda req, md: self._call(
                self._stub.Score, req, part=part, metadata=md, oversize=inputs.data_bytes() > server_bytes
            ),
        )

    def _next_id(self):
        return "py-%d-%d" % (os.getpid(), next(self._ids))

    def score_request(self, request):
        """Sends a prepared ``logprob.v1.ScoreRequest`` as is (no splitting),
        with retries; returns the ``ScoreResponse``. Raises LogprobError."""
        response, _ = self._call(self._stub.Score, request)
        return response

    def score(
        self,
        logits=None,
        input_ids=None,
        *,
        hidden_states=None,
        seq_lens=None,
        attention_mask=None,
        cu_seqlens=None,
        gather_indices=None,
        alignment="next_token",
        entropy=False,
        topk=0,
        temperature=None,
        sampling_top_k=0,
        sampling_top_p=None,
        ignore_index=None,
        dtype=None,
        split=True,
        request_id=None,
    ):
        """Scores a batch; returns a ``ScoreResult`` of numpy arrays.

        Inputs (numpy arrays, array-likes or torch tensors; shared/SPEC.md):

        - ``logits`` [B, S, V] (padded) or [T, V] (packed), or
          ``hidden_states`` [B, S, H] / [T, H] (server started with
          ``--lm-head``): float32, float16 or bfloat16 (torch bf16,
          ml_dtypes bf16, or a uint16 array of raw bits with
          ``dtype="bf16"``). ``dtype`` ("f32", "bf16", "f16") also converts
          float input before sending (e.g. float32 -> bf16 halves the bytes).
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
        -100 at the server: such targets score 0).

        A batch larger than the server's limits (``max_request_bytes``,
        ``max_tokens_per_request`` from GetServerInfo, or the client's own)
        is sent as several requests of whole sequences and the results are
        joined (``split=False`` sends it as one). Each request is retried
        per the ``RetryPolicy``.

        Raises InvalidInputError (a ValueError) for inputs the client can
        tell are wrong, TypeError for unsupported dtypes, LogprobError with
        the gRPC code and message for a failed call.
        """
        if (logits is None) == (hidden_states is None):
            raise InvalidInputError("give exactly one of logits and hidden_states")
        if input_ids is None:
            raise InvalidInputError("input_ids is required")
        rows_name = "logits" if logits is not None else "hidden_states"
        rows_dt, rows = float_array(rows_name, logits if logits is not None else hidden_states, dtype)
        ids_dt, ids = int_array("input_ids", input_ids)
        if rows.ndim == 3:
            if ids.shape != rows.shape[:2]:
                raise InvalidInputError(
                    "padded '%s' %s needs input_ids [B, S] = %s, got %s"
                    % (rows_name, list(rows.shape), list(rows.shape[:2]), list(ids.shape))
                )
            if cu_seqlens is not None:
                raise InvalidInputError("cu_seqlens is for packed [T, X] input; padded input takes seq_lens")
        elif rows.ndim == 2:
            if ids.shape != rows.shape[:1]:
                raise InvalidInputError(
                    "packed '%s' %s needs input_ids [T] = %s, got %s"
                    % (rows_name, list(rows.shape), list(rows.shape[:1]), list(ids.shape))
                )
            if seq_lens is not None or attention_mask is not None:
                raise InvalidInputError("seq_lens / attention_mask are for padded [B, S, X] input; packed takes cu_seqlens")
        else:
            raise InvalidInputError("'%s' must be [B, S, X] or [T, X], got %s" % (rows_name, list(rows.shape)))

        if attention_mask is not None:
            if seq_lens is not None:
                raise InvalidInputError("give seq_lens or attention_mask, not both")
            seq_lens = _mask_to_seq_lens(attention_mask, ids.shape)

        tensors = [(rows_name, rows_dt, rows), ("input_ids", ids_dt, ids)]
        if cu_seqlens is not None:
            tensors.append(("cu_seqlens",) + int_array("cu_seqlens", cu_seqlens))
        if seq_lens is not None:
            tensors.append(("seq_lens",) + int_array("seq_lens", seq_lens))
        if gather_indices is not None:
            tensors.append(("gather_indices",) + int_array("gather_indices", gather_indices))

        options = pb2.ScoreOptions()
        if alignment not in _ALIGNMENTS and alignment not in (pb2.NEXT_TOKEN, pb2.SAME_POSITION):
            raise InvalidInputError("alignment must be 'next_token' or 'same_position', got %r" % (alignment,))
        options.alignment = _ALIGNMENTS.get(alignment, alignment)
        options.entropy = bool(entropy)
        options.topk = int(topk)
        if temperature is not None:
            options.temperature = float(temperature)
        options.sampling_top_k = int(sampling_top_k)
        if sampling_top_p is not None:
            options.sampling_top_p = float(sampling_top_p)
        if ignore_index is not None:
            options.ignore_index = int(ignore_index)

        inputs = splitter.Inputs(tensors, options)
        request_id = request_id or self._next_id()
        server_bytes, max_bytes, max_tokens = self._limits()
        if split:
            parts = splitter.plan(inputs, request_id, max_bytes, max_tokens)
        else:
            parts = [(request_id, inputs)]
        n = len(parts)
        outputs, attempts = [], 0
        for i, (part_id, part_inputs) in enumerate(parts):
            sent = self._shared_memory_send(part_id, part_inputs, (i + 1, n), server_bytes)
            if sent is not None:
                response, tries = sent
            else:
                # Each part's bytes exist only while it is sent.
                request = splitter.build_part(part_id, part_inputs, max_bytes) if split else part_inputs.request(part_id)
                response, tries = self._call(
                    self._stub.Score, request, part=(i + 1, n), oversize=request.ByteSize() > server_bytes
                )
                del request
            attempts += tries
            outputs.append({t.name: from_tensor(t, copy=n == 1) for t in response.outputs})
        return ScoreResult(splitter.join(outputs), request_id, n, attempts)


def _mask_to_seq_lens(mask, ids_shape):
    m, _ = as_numpy(mask)
    m = np.asarray(m)
    if m.shape != tuple(ids_shape):
        raise InvalidInputError("attention_mask %s must have input_ids' shape %s" % (list(m.shape), list(ids_shape)))
    m = m != 0
    lens = m.sum(axis=1).astype(np.int64)
    # Right padding only: ones first, then zeros.
    prefix = np.arange(m.shape[1])[None, :] < lens[:, None]
    if not np.array_equal(prefix, m):
        bad = int(np.nonzero((prefix != m).any(axis=1))[0][0])
        raise InvalidInputError(
            "attention_mask row %d is not right-padded (ones then zeros); the service scores a prefix "
            "of each row: pass seq_lens, or shift left-padded rows" % bad
        )
    return lens
