"""Full-vocabulary distillation as a ``torch.autograd.Function`` answered by
the service (docs/distillation.md): what TRL's ``ChunkedDivergenceFunction``
computes in the trainer from both models' hidden states and heads, computed
by the workers that hold both heads.

- forward: per-token ``divergence`` (TRL's definition for ``beta``),
  ``cross_entropy`` (the soft-target cross entropy H(p_t, p_s)) and
  ``entropy`` (the student's) of ``student_hidden [N, H_s]`` and
  ``teacher_hidden [N, H_t]`` (``LogprobClient.distill``);
- backward: the student's dL/dh from the upstream gradients of the
  divergence and the cross entropy (the entropy has none, as in TRL), on
  ``student_hidden``'s device and dtype, pinned to the head versions the
  forward was answered with. The student head's dL/dW and dL/db are not
  returned to autograd: the workers add them to the binding's gradient
  step, which the caller reads once per optimizer step
  (``LogprobClient.read_head_gradients(step, head=student_head)``). The
  teacher gets no gradient.

Stateless, as the policy's (``head_autograd``): the backward sends both
models' hidden states again and the workers recompute the logits. Needs
torch (imported when called)."""

from typing import Any, Optional, Tuple

__all__ = ["DistillBinding", "ServiceDivergenceFunction", "service_divergence"]


class DistillBinding:
    """What a call of ``ServiceDivergenceFunction`` needs besides its
    tensors: the synchronous ``client``, the server's ``student_head`` and
    ``teacher_head`` (and versions, "" for their current ones), ``beta``,
    ``temperature`` and ``gradient_step`` (the key the student's dL/dW,
    dL/db go to; "" for dL/dh only)."""

    def __init__(self, client: Any, student_head: str, teacher_head: str, beta: float, temperature: float = 1.0,
                 student_head_version: str = "", teacher_head_version: str = "", gradient_step: str = "") -> None:
        self.client = client
        self.student_head = student_head
        self.teacher_head = teacher_head
        self.beta = float(beta)
        self.temperature = float(temperature)
        self.student_head_version = student_head_version
        self.teacher_head_version = teacher_head_version
        self.gradient_step = gradient_step


def _function() -> Any:
    import torch

    def call(b: DistillBinding, s: Any, t: Any, versions: Tuple[str, str], **kw: Any) -> Any:
        return b.client.distill(s.detach(), t.detach(), student_head=b.student_head, teacher_head=b.teacher_head,
                                beta=b.beta, temperature=b.temperature, student_head_version=versions[0],
                                teacher_head_version=versions[1], **kw)

    class _ServiceDivergenceFunction(torch.autograd.Function):  # type: ignore[misc]
        @staticmethod
        def forward(ctx: Any, student_hidden: Any, teacher_hidden: Any, binding: DistillBinding) -> Any:
            ctx.set_materialize_grads(False)
            r = call(binding, student_hidden, teacher_hidden,
                     (binding.student_head_version, binding.teacher_head_version))
            ctx.save_for_backward(student_hidden, teacher_hidden)
            ctx.binding = binding
            ctx.versions = (r.student_head_version, r.teacher_head_version)
            dev = student_hidden.device
            out = [torch.from_numpy(a).to(dev) for a in (r.divergence, r.cross_entropy, r.entropy)]
            ctx.mark_non_differentiable(out[2])
            return tuple(out)

        @staticmethod
        def backward(ctx: Any, grad_divergence: Any, grad_cross_entropy: Any, _: Any) -> Any:
            student_hidden, teacher_hidden = ctx.saved_tensors
            binding: DistillBinding = ctx.binding
            nothing = grad_divergence is None and grad_cross_entropy is None
            if nothing or (not ctx.needs_input_grad[0] and not binding.gradient_step):
                return None, None, None
            n = int(student_hidden.shape[0])
            g_d = grad_divergence if grad_divergence is not None else torch.zeros(n)
            r = call(binding, student_hidden, teacher_hidden, ctx.versions,
                     grad_divergence=g_d.detach().float().cpu(),
                     grad_cross_entropy=None if grad_cross_entropy is None else
                     grad_cross_entropy.detach().float().cpu(), gradient_step=binding.gradient_step)
            grad = torch.from_numpy(r.grad_student_hidden_states).to(student_hidden.device, student_hidden.dtype)
            return (grad if ctx.needs_input_grad[0] else None), None, None

    return _ServiceDivergenceFunction


_FUNCTION: Optional[Any] = None


class ServiceDivergenceFunction:
    """``ServiceDivergenceFunction.apply(student_hidden, teacher_hidden,
    binding)``: (divergence, cross_entropy, entropy), each [N] float32 on
    ``student_hidden``'s device; the first two differentiable with respect
    to ``student_hidden`` (the module docstring's backward), the entropy
    not. Raises LogprobError for a failed call (in the backward too)."""

    @staticmethod
    def apply(student_hidden: Any, teacher_hidden: Any, binding: DistillBinding) -> Any:
        global _FUNCTION
        if _FUNCTION is None:
            _FUNCTION = _function()
        return _FUNCTION.apply(student_hidden, teacher_hidden, binding)


def service_divergence(client: Any, student_hidden: Any, teacher_hidden: Any, *, student_head: str,
                       teacher_head: str, beta: float, temperature: float = 1.0, gradient_step: str = "") -> Any:
    """TRL's ``ChunkedDivergenceFunction`` contract through the service:
    ``(divergence, entropy)`` of ``ServiceDivergenceFunction.apply`` with a
    ``DistillBinding`` of these arguments (the divergence differentiable
    with respect to ``student_hidden`` and, with ``gradient_step``, the
    student head's weight through the step's sums)."""
    div, _, ent = ServiceDivergenceFunction.apply(
        student_hidden, teacher_hidden,
        DistillBinding(client, student_head, teacher_head, beta, temperature, gradient_step=gradient_step))
    return div, ent
