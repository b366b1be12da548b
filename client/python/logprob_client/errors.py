"""Exceptions of the logprob client."""

from typing import Optional, Tuple

import grpc


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
