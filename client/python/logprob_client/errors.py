"""Exceptions of the logprob client."""

from typing import Any, FrozenSet, Optional, Tuple

import grpc

from ._internal._proto import pb2

__all__ = ["LogprobError", "InvalidInputError", "REASONS", "reason_name", "has_reason"]

#: Every reason a server may send (``LogprobError.reason``): the names of the
#: generated ``logprob.v1.ErrorReason`` enum, UNSPECIFIED left out. Compare
#: reasons with ``has_reason`` and the enum's values, never with literals.
REASONS: FrozenSet[str] = frozenset(name for name, value in pb2.ErrorReason.items() if value)


def reason_name(value: int) -> str:
    """The name of ``logprob.v1.ErrorReason`` value ``value`` (``""`` for
    UNSPECIFIED; the number as text for a reason newer than this client)."""
    if not value:
        return ""
    try:
        return str(pb2.ErrorReason.Name(value))
    except ValueError:  # a reason newer than this client
        return str(value)


def has_reason(error: Any, reason: int) -> bool:
    """True when ``error`` (a ``LogprobError``; anything else is False)
    carries ``reason``, a ``logprob.v1.ErrorReason`` value such as
    ``pb2.CUDA_IPC_UNAVAILABLE``."""
    return bool(reason) and getattr(error, "reason", "") == pb2.ErrorReason.Name(reason)


class LogprobError(Exception):
    """A failed call (or a request that cannot be sent), with its gRPC status.

    Attributes:
        code: ``grpc.StatusCode`` of the failure (e.g. ``INVALID_ARGUMENT``,
            ``UNAVAILABLE``, ``RESOURCE_EXHAUSTED``, ``UNAUTHENTICATED``).
        message: the server's (or client's) message, e.g. naming the field,
            sequence and position of a bad input.
        attempts: how many times the failing call was sent (1 when not
            retried, 0 when it was never sent).
        part: ``(i, n)`` when the failing call was part ``i`` (1-based) of a
            request split into ``n`` parts, else None.
        reason: the server's machine-readable reason (a name of the
            ``logprob.v1.ErrorReason`` enum, e.g. ``"CUDA_IPC_UNAVAILABLE"``,
            ``"AT_CAPACITY"``), or ``""`` when it gave none. Act on it rather
            than on the message.
    """

    def __init__(
        self,
        code: grpc.StatusCode,
        message: str,
        attempts: int = 0,
        part: Optional[Tuple[int, int]] = None,
        reason: str = "",
    ) -> None:
        self.code = code
        self.message = message
        self.attempts = attempts
        self.part = part
        self.reason = reason
        where = ""
        if part is not None and part[1] > 1:
            where = " (part %d/%d)" % part
        tries = " after %d attempts" % attempts if attempts > 1 else ""
        super().__init__("%s%s%s: %s" % (code.name, where, tries, message))

    @property
    def retryable(self) -> bool:
        """True for codes worth retrying later (UNAVAILABLE, RESOURCE_EXHAUSTED)."""
        return self.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED)


class InvalidInputError(LogprobError, ValueError):
    """The client refused the inputs before sending them (code
    ``INVALID_ARGUMENT``): inconsistent shapes, a sequence too large for the
    server's limits, bad options. Also a ``ValueError``."""

    def __init__(self, message: str) -> None:
        super().__init__(grpc.StatusCode.INVALID_ARGUMENT, message, attempts=0)
