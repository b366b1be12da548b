"""Retry policy and the overall deadline of a call, shared by the sync
(``client.LogprobClient``) and asyncio (``aio.LogprobClient``) clients.

Only the decisions live here (which failure is retried, how long to back
off, how much time an attempt may take); the loop is ``ops.retried``,
whose sends and sleeps the clients perform (blocking / awaiting).
"""

import random
import time
from typing import Callable, Iterable, Optional, Tuple

import grpc

from ..errors import LogprobError

# on_retry(attempt, code, message, delay): called before each backoff.
OnRetry = Callable[[int, grpc.StatusCode, str, float], None]


class RetryPolicy:
    """When and how long to wait before sending a failed call again.

    A call failing with a code in ``retry_codes`` (default ``UNAVAILABLE``
    and ``RESOURCE_EXHAUSTED``, the codes the server asks clients to retry)
    is sent again, up to ``max_attempts`` sends in all. Before attempt
    ``n + 1`` the client sleeps ``min(max_backoff, initial_backoff *
    multiplier ** (n - 1))`` scaled by a random factor in ``[1 - jitter,
    1]``. Other codes (``INVALID_ARGUMENT``, ``UNAUTHENTICATED``,
    ``DEADLINE_EXCEEDED``, ...) are raised at once.

    ``max_attempts=1`` disables retries. Immutable after construction;
    safe to share between clients and threads.
    """

    def __init__(
        self,
        max_attempts: int = 5,
        initial_backoff: float = 0.1,
        max_backoff: float = 5.0,
        multiplier: float = 2.0,
        jitter: float = 0.5,
        retry_codes: Iterable[grpc.StatusCode] = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED),
    ) -> None:
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

    def backoff(self, attempt: int, rng: random.Random = random) -> float:  # type: ignore[assignment]
        """Seconds to sleep after failed attempt number ``attempt`` (1-based)."""
        base = min(self.max_backoff, self.initial_backoff * self.multiplier ** (attempt - 1))
        return base * (1.0 - self.jitter * rng.random())

    def __repr__(self) -> str:
        return "RetryPolicy(max_attempts=%d, initial_backoff=%g, max_backoff=%g, multiplier=%g, jitter=%g)" % (
            self.max_attempts,
            self.initial_backoff,
            self.max_backoff,
            self.multiplier,
            self.jitter,
        )


class Deadline:
    """The end of a whole call (all its parts, attempts and backoffs):
    ``seconds`` from now on the monotonic clock; None: no deadline."""

    def __init__(self, seconds: Optional[float]) -> None:
        self.seconds = seconds
        self.end = None if seconds is None else time.monotonic() + float(seconds)

    def remaining(self) -> Optional[float]:
        """Seconds left (may be <= 0), or None without a deadline."""
        return None if self.end is None else self.end - time.monotonic()

    def expired_error(self, attempts: int = 0, part: Optional[Tuple[int, int]] = None) -> LogprobError:
        return LogprobError(
            grpc.StatusCode.DEADLINE_EXCEEDED,
            "the call's timeout of %g s passed" % float(self.seconds or 0.0),
            attempts=attempts,
            part=part,
        )


def error_of(e: grpc.RpcError) -> Tuple[grpc.StatusCode, str]:
    """``(code, message)`` of a failed gRPC call (sync or aio)."""
    code = e.code() if hasattr(e, "code") else grpc.StatusCode.UNKNOWN
    message = e.details() if hasattr(e, "details") else str(e)
    return code, message or ""


#: Trailing metadata key of a failed call's reason (common/error_reason.h).
REASON_METADATA_KEY = "logprob-error-reason"


def reason_of(e: grpc.RpcError) -> str:
    """The server's reason for a failed call (its ``logprob-error-reason``
    trailing metadata: a ``logprob.v1.ErrorReason`` name), or ``""``."""
    trailing = getattr(e, "trailing_metadata", None)
    try:
        items = trailing() if callable(trailing) else None
    except Exception:  # a call that never reached the server has none
        items = None
    for key, value in items or ():
        if key == REASON_METADATA_KEY:
            return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
    return ""


#: What an UNAVAILABLE error that ends the retries adds to its message.
UNAVAILABLE_HINT = (
    " [gave up after %d attempt%s: if the server is still starting (its workers join in"
    " seconds), wait for it first with client.health(wait=SECONDS), or allow more attempts with"
    " RetryPolicy(max_attempts=...)]"
)


class Attempts:
    """The retry loop of one call (one part of a score), without the
    sleeping: ``timeout()`` before each send, ``failed(error)`` after a
    failed send returns the backoff in seconds or raises ``LogprobError``.

    Stops retrying when the policy's ``max_attempts`` is reached, the code
    is not retryable, the request is over the server's size limit
    (``oversize``: it fails the same way each time), or the backoff would
    end past the overall ``deadline`` (then the last error is raised, its
    message saying so). Not thread-safe: one per call.
    """

    def __init__(
        self,
        policy: RetryPolicy,
        deadline: Deadline,
        rng: random.Random,
        on_retry: Optional[OnRetry] = None,
        part: Optional[Tuple[int, int]] = None,
        oversize: bool = False,
    ) -> None:
        self.policy = policy
        self.deadline = deadline
        self.rng = rng
        self.on_retry = on_retry
        self.part = part
        self.oversize = oversize
        self.count = 0

    def timeout(self) -> Optional[float]:
        """Starts an attempt: its gRPC timeout (what is left of the
        deadline, None without one). Raises DEADLINE_EXCEEDED when none is left."""
        self.count += 1
        left = self.deadline.remaining()
        if left is not None and left <= 0:
            raise self.deadline.expired_error(self.count - 1, self.part)
        return left

    def _unavailable_hint(self) -> str:
        return UNAVAILABLE_HINT % (self.count, "" if self.count == 1 else "s")

    def failed(self, e: grpc.RpcError) -> float:
        """Judges a failed attempt: returns the backoff (seconds) before the
        next one, or raises ``LogprobError`` (chained to nothing)."""
        code, message = error_of(e)
        retry = code in self.policy.retry_codes and self.count < self.policy.max_attempts and not self.oversize
        if not retry:
            if code == grpc.StatusCode.UNAVAILABLE and code in self.policy.retry_codes:
                message += self._unavailable_hint()
            raise LogprobError(code, message, attempts=self.count, part=self.part, reason=reason_of(e))
        delay = self.policy.backoff(self.count, self.rng)
        left = self.deadline.remaining()
        if left is not None and delay >= left:
            raise LogprobError(
                code,
                "%s (not retried: the call's timeout of %g s ends before the next attempt)%s"
                % (message, float(self.deadline.seconds or 0.0),
                   self._unavailable_hint() if code == grpc.StatusCode.UNAVAILABLE else ""),
                attempts=self.count,
                part=self.part,
            )
        if self.on_retry is not None:
            self.on_retry(self.count, code, message, delay)
        return delay
