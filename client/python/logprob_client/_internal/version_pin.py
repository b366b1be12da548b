"""Which lm_head version the parts of one split ``score()`` are scored with
(docs/lm-head-updates.md, "Scoring with a head").

A call split into several requests is scored on one version: the parts
after the first are pinned (``ScoreRequest.head_version``) to the version
that scored the first. When that version is released before a later part
is scored (an update committed mid-call on a server retaining too few
versions: the server answers FAILED_PRECONDITION, reason
``LM_HEAD_VERSION_UNAVAILABLE``), the whole call starts again once, every
part re-scored, the first unpinned (on the version then current) and the
others pinned to it; a second release fails the call with that reason,
naming both versions. A version the caller pinned is never replaced: its
release fails the call at once, as for an unsplit request.
"""

from typing import Any, Sequence

import grpc

from ..errors import LogprobError, has_reason
from ._proto import pb2

#: The reason (a ``logprob.v1.ErrorReason`` name) of a pinned version the
#: server does not hold.
VERSION_UNAVAILABLE = pb2.ErrorReason.Name(pb2.LM_HEAD_VERSION_UNAVAILABLE)


class VersionPin:
    """The version pin of one split score call across its attempts; sans
    I/O, not thread-safe (one per call). ``asked``: the ``head_version``
    the caller gave ("" for the current one)."""

    def __init__(self, head: str, asked: str) -> None:
        self.head = head
        self.asked = asked
        self.pinned = ""  # the version of this attempt's first part ("": not pinned by the client)
        self.released = ""  # the version the first attempt was pinned to, once it was released
        self._released_where = ""

    def start(self) -> None:
        """An attempt of the whole call starts: nothing is pinned yet."""
        self.pinned = ""

    def first_scored(self, response: Any, parts: Sequence[Any]) -> None:
        """The first of ``parts`` (``request.Part``s) was answered with
        ``response``: the others are pinned to its version (unless the
        caller pinned one, or there is no other part)."""
        version = str(getattr(response, "head_version", "") or "")
        if self.asked or not version or len(parts) < 2:
            return
        self.pinned = version
        for later in parts[1:]:
            later.inputs.head_version = version

    def restart(self, error: LogprobError) -> bool:
        """Judges a failed part: True when the call should start again (the
        version the client pinned was released, for the first time); False
        when ``error`` is not about that (the caller raises it). Raises
        LogprobError (FAILED_PRECONDITION, reason
        ``LM_HEAD_VERSION_UNAVAILABLE``) naming both versions when the
        version of the second attempt was released too."""
        if not self.pinned or not has_reason(error, pb2.LM_HEAD_VERSION_UNAVAILABLE):
            return False
        if not self.released:
            self.released, self._released_where = self.pinned, _before(error)
            return True
        raise LogprobError(
            grpc.StatusCode.FAILED_PRECONDITION,
            "lm_head %r: version %r, which scored the first part of this split call, was released%s; the call "
            "started again on version %r, which was released too%s (the server keeps --lm-head-retain versions "
            "of a head: raise it, or update less often than a call takes): %s"
            % (self.head or "default", self.released, self._released_where, self.pinned, _before(error),
               error.message),
            attempts=error.attempts,
            part=error.part,
            reason=VERSION_UNAVAILABLE,
        )


def _before(error: LogprobError) -> str:
    """" before part i/n" of a failed part, or ""."""
    return " before part %d/%d was scored" % error.part if error.part else ""
