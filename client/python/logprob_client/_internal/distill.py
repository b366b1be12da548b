"""Full-vocabulary distillation through the service (``Distill``,
docs/distillation.md): the request from both models' hidden states (and the
student's upstream gradients), the answer's per-token divergence, cross
entropy and student entropy (and the student's dL/dh). Written once as
operations of the sans-I/O core (``ops.py``); the sync and asyncio clients
perform them."""

from typing import Any, Optional

import numpy as np

from ..errors import InvalidInputError
from ._proto import pb2
from .ops import Ops, retried
from .tensors import F32, float_array, from_tensor, to_tensor


class DistillResult:
    """One ``distill`` answer, numpy float32 arrays: ``divergence`` [N]
    (TRL's definition for the call's beta), ``cross_entropy`` [N] (the
    teacher's soft targets under the student, H(p_t, p_s)), ``entropy`` [N]
    (the student's) and, for a call with ``grad_divergence``,
    ``grad_student_hidden_states`` [N, H_s] (dL/dh of the student), else
    None; ``student_head_version`` / ``teacher_head_version``: the versions
    the call was answered with (pin them for the backward of the same
    tokens)."""

    def __init__(self, divergence: Any, cross_entropy: Any, entropy: Any,
                 grad_student_hidden_states: Optional[Any], student_head_version: str = "",
                 teacher_head_version: str = "") -> None:
        self.divergence = divergence
        self.cross_entropy = cross_entropy
        self.entropy = entropy
        self.grad_student_hidden_states = grad_student_hidden_states
        self.student_head_version = student_head_version
        self.teacher_head_version = teacher_head_version

    def __repr__(self) -> str:
        return "DistillResult(tokens=%d, grad_student_hidden_states=%s)" % (
            self.divergence.shape[0],
            None if self.grad_student_hidden_states is None else list(self.grad_student_hidden_states.shape))


def _rows(name: str, x: Any, dtype: Any) -> Any:
    wire, arr = float_array(name, x, dtype)
    if arr.ndim != 2:
        raise InvalidInputError("%s must be [N, H], got shape %s" % (name, list(arr.shape)))
    return to_tensor(name, wire, arr)


def _per_token(name: str, x: Any, n: int) -> Any:
    wire, arr = float_array(name, x, "f32")
    arr = arr.reshape(-1) if arr.ndim == 2 and arr.shape[1] == 1 else arr
    if arr.shape != (n,):
        raise InvalidInputError("%s must be [N] = [%d], got shape %s" % (name, n, list(arr.shape)))
    if not np.all(np.isfinite(arr)):
        raise InvalidInputError("%s holds a value that is not finite (position %d)" %
                                (name, int(np.flatnonzero(~np.isfinite(arr))[0])))
    return to_tensor(name, F32, arr)


def request(student_hidden_states: Any, teacher_hidden_states: Any, *, student_head: str, teacher_head: str,
            beta: float, temperature: Optional[float], student_head_version: str, teacher_head_version: str,
            grad_divergence: Any, grad_cross_entropy: Any, gradient_step: str, request_id: Optional[str],
            dtype: Any) -> Any:
    """The ``DistillRequest`` of a ``distill`` call; InvalidInputError for
    inputs the client can tell are wrong (shapes, beta, temperature,
    non-finite upstream gradients, grad_cross_entropy or gradient_step
    without grad_divergence)."""
    if not 0.0 <= float(beta) <= 1.0:
        raise InvalidInputError("beta must be in [0, 1], got %r" % (beta,))
    if temperature is not None and not float(temperature) > 0.0:
        raise InvalidInputError("temperature must be > 0, got %r" % (temperature,))
    if grad_divergence is None and (grad_cross_entropy is not None or gradient_step):
        raise InvalidInputError("grad_cross_entropy and gradient_step need grad_divergence (the student's backward)")
    s = _rows("student_hidden_states", student_hidden_states, dtype)
    t = _rows("teacher_hidden_states", teacher_hidden_states, dtype)
    n = int(s.shape[0])
    if int(t.shape[0]) != n:
        raise InvalidInputError("teacher_hidden_states has %d rows, student_hidden_states %d" % (t.shape[0], n))
    inputs = [s, t]
    if grad_divergence is not None:
        inputs.append(_per_token("grad_divergence", grad_divergence, n))
    if grad_cross_entropy is not None:
        inputs.append(_per_token("grad_cross_entropy", grad_cross_entropy, n))
    req = pb2.DistillRequest(id=request_id or "", inputs=inputs, student_head=str(student_head or ""),
                             teacher_head=str(teacher_head or ""), student_head_version=str(student_head_version or ""),
                             teacher_head_version=str(teacher_head_version or ""), beta=float(beta),
                             gradient_step=str(gradient_step or ""))
    if temperature is not None:
        req.temperature = float(temperature)
    return req


def result(resp: Any) -> DistillResult:
    """The arrays of a ``DistillResponse`` (writable copies)."""
    out = {t.name: np.array(from_tensor(t)) for t in resp.outputs}
    return DistillResult(out["divergence"], out["cross_entropy"], out["entropy"],
                         out.get("grad_student_hidden_states"), str(resp.student_head_version),
                         str(resp.teacher_head_version))


def distill_ops(client: Any, req: Any, timeout: Any) -> Ops[DistillResult]:
    """``distill``: one ``Distill`` call, retried per the client's policy
    as ``backward`` is."""
    got, _ = yield from retried(client._stub.Distill, req, client._attempts(client._deadline(timeout)),
                                client._metadata)
    return result(got)
