"""What one rank tells the others of a call's outcome under
``torch.distributed``: ``("ok", value)`` or ``("error", code name,
message)``, picklable (unlike a LogprobError, whose constructor takes
more than its text); ``tensor_parallel`` and ``fused_head.on_rank0`` send
it with ``broadcast_object_list`` / ``all_gather_object``."""

from typing import Any, Tuple

from ..errors import LogprobError

Outcome = Tuple[Any, ...]


def attempt(fn: Any) -> Outcome:
    """``fn()``'s outcome: its value, or its error as code name and message."""
    try:
        return ("ok", fn())
    except LogprobError as e:
        return ("error", e.code.name, e.message)
    except Exception as e:  # e.g. a ValueError of a bad name: raised on every rank as INVALID_ARGUMENT
        return ("error", "INVALID_ARGUMENT", "%s: %s" % (type(e).__name__, e))


def value(outcome: Outcome) -> Any:
    """The value of an outcome; raises its error as LogprobError."""
    if outcome[0] == "ok":
        return outcome[1]
    import grpc

    raise LogprobError(grpc.StatusCode[outcome[1]], outcome[2])
