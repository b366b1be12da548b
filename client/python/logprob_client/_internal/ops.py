"""The I/O operations of the sans-I/O client core (``base.ClientBase``).

Every client operation (``score``, ``score_request``, ``server_info``,
``health``, ``score_stream``, the shared-memory session) is written once,
as a generator that *yields* the I/O it needs as the small ``Op`` objects
below and is resumed with their outcome (a value sent in, or the
exception thrown in). The sync client (``client.LogprobClient``) performs
them with blocking calls, the asyncio client (``aio.LogprobClient``) by
awaiting; neither has any logic of its own, so the two cannot drift.

For example, the retry loop of one RPC (``retried``)::

    while True:
        timeout = attempts.timeout()
        try:
            return (yield Rpc(method, request, timeout, metadata)), attempts.count
        except grpc.RpcError as e:
            delay = attempts.failed(e)          # raises LogprobError to give up
            yield from backoff(delay, reconnect=...)

A shell drives an operation with a ``Stepper``: ``next()`` gives the next
``Op`` (None at the end, the value in ``result``), ``resume(value)`` or
``throw(error)`` reports how performing it went.
"""

import time
from typing import Any, Callable, Generator, Optional, Tuple, TypeVar, Union

import grpc

from .retry import Attempts, error_of

T = TypeVar("T")


class Rpc:
    """Call ``method(request, timeout=timeout, metadata=metadata)`` (a
    ``grpc`` / ``grpc.aio`` multicallable, or a callable like one, e.g.
    ``transport.ChunkedScore``); resume with the response, or throw its
    ``grpc.RpcError``. ``nbytes``: for a client-streaming ``request`` (an
    iterator of serialized parts), the bytes making its parts copies; the
    asyncio client makes large ones in its executor, as for ``Work``."""

    __slots__ = ("method", "request", "timeout", "metadata", "nbytes")

    def __init__(self, method: Any, request: Any, timeout: Optional[float], metadata: Any, nbytes: int = 0) -> None:
        self.method = method
        self.request = request
        self.timeout = timeout
        self.metadata = metadata
        self.nbytes = nbytes


class Work:
    """Run ``fn(*args)`` (CPU work on ``nbytes`` bytes: serializing a
    request, copying tensors into shared memory, creating a region) and
    resume with its result. The asyncio client runs large work in the
    loop's default executor so it does not stall the loop's other tasks."""

    __slots__ = ("fn", "args", "nbytes")

    def __init__(self, fn: Callable[..., Any], *args: Any, nbytes: int = 0) -> None:
        self.fn = fn
        self.args = args
        self.nbytes = nbytes


class Sleep:
    """Wait ``seconds``."""

    __slots__ = ("seconds",)

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds


class Connect:
    """Ask the channel to connect and wait up to ``seconds`` for it to be
    READY; resume with True when it is. (A channel whose connection failed
    otherwise waits for its own reconnect timer, observed at 10-15 s with
    grpcio 1.51, before a fail-fast call sees a server that came back.)"""

    __slots__ = ("seconds",)

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds


class Locked:
    """Run the operation ``ops`` holding ``lock`` (a ``threading.Lock`` in
    the sync client, an ``asyncio.Lock`` in the asyncio client); resume
    with its result."""

    __slots__ = ("lock", "ops")

    def __init__(self, lock: Any, ops: "Ops[Any]") -> None:
        self.lock = lock
        self.ops = ops


class OpenStream:
    """Start the streaming RPC ``method`` whose requests are the messages of
    ``assembler`` (a ``stream.StreamAssembler``) for the caller's
    ``requests`` (an iterable, or for the asyncio client also an async
    iterable); resume with the call (see ``NextResponse``; ``cancel()``)."""

    __slots__ = ("method", "assembler", "requests", "timeout", "metadata")

    def __init__(self, method: Any, assembler: Any, requests: Any, timeout: Optional[float], metadata: Any) -> None:
        self.method = method
        self.assembler = assembler
        self.requests = requests
        self.timeout = timeout
        self.metadata = metadata


# What NextResponse resumes with at the end of a stream.
END = object()


class NextResponse:
    """Read the next response of the streaming ``call`` (from
    ``OpenStream``); resume with it, with ``END`` when the stream is over,
    or throw its ``grpc.RpcError``."""

    __slots__ = ("call",)

    def __init__(self, call: Any) -> None:
        self.call = call


class Emit:
    """Hand ``value`` to the caller iterating the operation
    (``score_stream``); resume when the caller asks for the next one. Only
    an iterating operation emits."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value


Op = Union[Rpc, Work, Sleep, Connect, Locked, OpenStream, NextResponse, Emit]
# An operation: yields Ops, is resumed with their outcomes, returns a T.
Ops = Generator[Op, Any, T]


class Stepper:
    """Drives one operation for a shell: ``next()`` returns the next ``Op``
    to perform (None once the operation has returned: its value is then in
    ``result``; an exception of the operation propagates); after performing
    it, ``resume(value)`` or ``throw(error)``; ``close()`` when the shell
    stops early (a closed ``score_stream``). Not thread-safe."""

    def __init__(self, ops: "Ops[Any]") -> None:
        self._ops = ops
        self._value: Any = None
        self._error: Optional[BaseException] = None
        self.result: Any = None

    def next(self) -> Optional[Op]:
        """The next Op (None: the operation has ended)."""
        value, error = self._value, self._error
        self._value = self._error = None
        try:
            if error is not None:
                return self._ops.throw(error)
            return self._ops.send(value)
        except StopIteration as stop:
            self.result = stop.value
            return None

    def resume(self, value: Any) -> None:
        """The last Op gave ``value``."""
        self._value = value

    def throw(self, error: BaseException) -> None:
        """The last Op raised ``error`` (raised into the operation at the yield)."""
        self._error = error

    def close(self) -> None:
        """Ends the operation early (its ``finally`` blocks run)."""
        self._ops.close()


def backoff(delay: float, reconnect: bool) -> "Ops[None]":
    """Waits ``delay`` seconds in all, meanwhile reconnecting the channel
    when ``reconnect``."""
    end = time.monotonic() + delay
    if reconnect:
        yield Connect(delay)
    remaining = end - time.monotonic()
    if remaining > 0:
        yield Sleep(remaining)


def retried(method: Any, request: Any, attempts: Attempts, metadata: Any) -> "Ops[Tuple[Any, int]]":
    """Sends ``request`` with ``method`` until it succeeds or ``attempts``
    gives up (raising LogprobError), backing off between sends (reconnecting
    after UNAVAILABLE); returns ``(response, sends)``."""
    while True:
        timeout = attempts.timeout()
        try:
            response = yield Rpc(method, request, timeout, metadata)
            return response, attempts.count
        except grpc.RpcError as e:
            delay = attempts.failed(e)
            yield from backoff(delay, reconnect=error_of(e)[0] == grpc.StatusCode.UNAVAILABLE)
