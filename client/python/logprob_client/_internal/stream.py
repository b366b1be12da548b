"""Ordered assembly of a ``ScoreStream``: the caller's requests go out as
stream messages (a batch over the server's limits as several parts), the
answers (matched by id, in whatever order they come) come back as one
``ScoreResult`` or ``LogprobError`` per request, in request order. Shared
by the sync and asyncio clients, which only move the messages."""

import asyncio
import collections
import collections.abc
import threading
from typing import Any, AsyncIterable, AsyncIterator, Callable, Deque, Dict, Iterable, Iterator, List, Optional, Union

import grpc

from ..errors import InvalidInputError, LogprobError
from ._proto import pb2
from .request import Limits, ScoreCall, decode, status_error
from .result import ScoreResult
from .retry import Deadline, error_of


class Fatal:
    """The end of a stream that fails it as a whole (the RPC failed, or the
    caller's iterable raised): ``deliver`` raises ``error`` whatever
    ``return_exceptions`` says."""

    def __init__(self, error: BaseException) -> None:
        self.error = error


Outcome = Union[ScoreResult, LogprobError, Fatal]


class _Entry:
    """One caller request: its call (None for a prepared ScoreRequest),
    the answers by part index, and its outcome once known."""

    def __init__(self, request_id: str, call: Optional[ScoreCall], count: int) -> None:
        self.id = request_id
        self.call = call
        self.count = count
        self.responses: List[Any] = [None] * count
        self.received = 0
        self.outcome: Optional[Outcome] = None


class StreamAssembler:
    """Turns caller items into stream messages (``messages_of``) and
    stream answers into outcomes in order (``receive``, ``ready``,
    ``finish``).

    An item is a ``dict`` of ``LogprobClient.score`` keyword arguments
    (``request_id`` optional) or a prepared ``logprob.v1.ScoreRequest``
    (sent as is, never split). An item the client refuses
    (InvalidInputError, TypeError) sends nothing and becomes that item's
    ``LogprobError`` outcome (code INVALID_ARGUMENT). Thread-safe: the
    messages may be produced in one thread (gRPC's request iterator) while
    answers are received in another.
    """

    def __init__(self, limits: Limits, next_id: Callable[[], str]) -> None:
        self.limits = limits
        self.next_id = next_id
        self._lock = threading.Lock()
        self._order: Deque[_Entry] = collections.deque()
        self._by_part: Dict[str, Any] = {}  # part id -> (entry, index)
        self.sent = 0  # caller items taken
        self._source_error: Optional[BaseException] = None

    @staticmethod
    def timeout(deadline: Deadline) -> Optional[float]:
        """The stream RPC's gRPC timeout: what is left of ``deadline``.
        Raises DEADLINE_EXCEEDED when nothing is."""
        remaining = deadline.remaining()
        if remaining is not None and remaining <= 0:
            raise deadline.expired_error()
        return remaining

    def messages(self, items: Iterable[Any]) -> Iterator[Any]:
        """The stream's messages for the caller's ``items``. An exception
        of the iterable ends the messages; it is raised to the caller after
        the outcomes of the items taken before it."""
        try:
            for item in items:
                yield from self.messages_of(item)
        except Exception as e:  # the caller's iterable failed
            self._source_error = e

    async def amessages(self, items: Union[Iterable[Any], AsyncIterable[Any]]) -> AsyncIterator[Any]:
        """``messages`` of an iterable or async iterable, as an async
        iterator; each item is checked and serialized in the running loop's
        default executor (the copies do not stall the loop)."""
        loop = asyncio.get_running_loop()
        try:
            if isinstance(items, collections.abc.AsyncIterable):
                async for item in items:
                    for message in await loop.run_in_executor(None, self.messages_of, item):
                        yield message
            else:
                for item in items:
                    for message in await loop.run_in_executor(None, self.messages_of, item):
                        yield message
        except Exception as e:  # the caller's iterable failed
            self._source_error = e

    def messages_of(self, item: Any) -> List[Any]:
        """The serialized ScoreRequests to send for one caller item (none
        when it is refused)."""
        try:
            if isinstance(item, pb2.ScoreRequest):
                request_id = item.id or self.next_id()
                if not item.id:
                    # A copy with the id: every other field (head,
                    # head_version included) as the caller set it.
                    named = pb2.ScoreRequest()
                    named.CopyFrom(item)
                    named.id = request_id
                    item = named
                if item.ByteSize() > self.limits.message_bytes:
                    raise InvalidInputError(
                        "prepared ScoreRequest %r has %d bytes, over the %d this stream announces "
                        "(logprob-request-bytes; pass it as a dict of score() arguments, which the stream splits, "
                        "or send it with score())" % (request_id, item.ByteSize(), self.limits.message_bytes))
                entry = _Entry(request_id, None, 1)
                parts = [(request_id, item)]
            elif isinstance(item, dict):
                kwargs = dict(item)
                request_id = kwargs.pop("request_id", None) or self.next_id()
                kwargs.pop("cuda_ipc", None)  # streamed items always send bytes
                call = ScoreCall(request_id, **kwargs)
                planned = call.parts(self.limits)
                entry = _Entry(request_id, call, len(planned))
                parts = [(p.id, p) for p in planned]
            else:
                raise InvalidInputError(
                    "score_stream items are dicts of score() arguments or ScoreRequests, got %s" % type(item).__name__
                )
            with self._lock:
                if any(pid in self._by_part for pid, _ in parts):
                    raise InvalidInputError("request id %r is already in flight on this stream" % request_id)
                for i, (pid, _) in enumerate(parts):
                    self._by_part[pid] = (entry, i)
                self._order.append(entry)
                self.sent += 1
        except (InvalidInputError, TypeError, ValueError) as e:
            err = e if isinstance(e, LogprobError) else InvalidInputError(str(e))
            entry = _Entry("", None, 0)
            entry.outcome = err
            with self._lock:
                self._order.append(entry)
                self.sent += 1
            return []
        return [p.SerializeToString() if isinstance(p, pb2.ScoreRequest) else p.serialized(self.limits.max_bytes)
                for _, p in parts]

    def on_response(self, response: Any) -> List[Outcome]:
        """Files one answer; returns the outcomes it completes, in order."""
        self.receive(response)
        return self.ready()

    def on_failure(self, e: Any) -> List[Outcome]:
        """The stream RPC failed with ``e`` (a grpc.RpcError): the outcomes
        already known, then a Fatal LogprobError of the stream."""
        code, message = error_of(e)
        return self.ready() + [Fatal(LogprobError(code, message, attempts=1))]

    def receive(self, response: Any) -> None:
        """Files one answer. Raises LogprobError (INTERNAL) for an answer
        whose id was not sent on this stream."""
        with self._lock:
            found = self._by_part.pop(response.id, None)
            if found is None:
                raise LogprobError(grpc.StatusCode.INTERNAL, "the stream answered unknown id %r" % response.id)
            entry, i = found
            entry.received += 1
            if entry.outcome is not None:
                return  # an earlier part failed; the others are dropped
            err = status_error(response, (i + 1, entry.count))
            if err is not None:
                entry.outcome = err
                entry.responses = []
                return
            entry.responses[i] = response
            if entry.received == entry.count:
                responses, entry.responses = entry.responses, []
                try:
                    if entry.call is None:
                        result = ScoreResult(decode(responses[0]), entry.id, 1, 1)
                        result.head = getattr(responses[0], "head", "") or ""
                        result.head_version = getattr(responses[0], "head_version", "") or ""
                        entry.outcome = result
                    else:
                        entry.outcome = entry.call.result(responses, entry.count)
                except LogprobError as e:
                    entry.outcome = e

    def ready(self) -> List[Outcome]:
        """Outcomes now known, in request order (removed from the stream's
        pending list)."""
        out: List[Outcome] = []
        with self._lock:
            while self._order:
                outcome = self._order[0].outcome
                if outcome is None:
                    break
                self._order.popleft()
                out.append(outcome)
        return out

    def finish(self) -> List[Outcome]:
        """At the stream's end: the remaining outcomes in order, requests
        left without an answer as INTERNAL errors, then a Fatal of the
        caller's iterable's exception, if it raised."""
        out = self.ready()
        with self._lock:
            while self._order:
                e = self._order.popleft()
                if e.outcome is None:
                    e.outcome = LogprobError(
                        grpc.StatusCode.INTERNAL,
                        "the stream ended without an answer to request %r (%d of %d parts answered)"
                        % (e.id, e.received, e.count),
                    )
                out.append(e.outcome)
        if self._source_error is not None:
            out.append(Fatal(self._source_error))
        return out


def deliver(outcome: Outcome, return_exceptions: bool) -> Union[ScoreResult, LogprobError]:
    """What the caller's iteration gets for one outcome: a LogprobError is
    raised unless ``return_exceptions``; a Fatal's error is raised; a
    ScoreResult is returned."""
    if isinstance(outcome, Fatal):
        raise outcome.error
    if isinstance(outcome, LogprobError) and not return_exceptions:
        raise outcome
    return outcome
