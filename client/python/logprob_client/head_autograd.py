"""The fused lm_head as a ``torch.autograd.Function`` answered by the
service, forward and backward (docs/gradients.md): what TRL's
``ChunkedLogProbFunction`` computes in the trainer, computed by the workers
that hold the head.

- forward: per-token ``log_probs`` (and ``entropy``, ``log_sum_sq_probs``,
  ``mean_logits``, ``is_top1`` on request) of ``hidden [N, H]`` at
  ``targets [N]`` under the server's head (``fused_head.score_rows``);
- backward: dL/dh from the upstream gradients of ``log_probs`` and
  ``entropy`` (``fused_head.backward_rows``, pinned to the version the
  forward used), on ``hidden``'s device and dtype. The head's dL/dW and
  dL/db are not returned to autograd: the workers add them to the
  binding's gradient step, and the caller fetches the step's sum once per
  optimizer step (``LogprobClient.read_head_gradients``; the TRL adapter
  does it before the gradients are clipped). Nothing of size [N, V] is made
  anywhere, and the trainer holds O(N H).

Stateless: the backward sends the hidden states again (the forward keeps a
reference to them, as TRL's function does) and the workers recompute the
logits and the log-normalisers, so no statistic can disagree with its
inputs. Needs torch (imported when called)."""

from typing import Any, Optional, Tuple

from . import fused_head

__all__ = ["HeadBinding", "ServiceLogProbFunction", "service_logprobs"]


class HeadBinding:
    """What a call of ``ServiceLogProbFunction`` needs besides its tensors:
    the synchronous ``client``, the server's ``head`` and ``head_version``
    ("" for its current one; the backward pins the version the forward was
    answered with), ``temperature``, the ``outputs`` to compute (among
    ``fused_head.FUSED_OUTPUTS``), and ``gradient_step``: the key the
    head's dL/dW, dL/db go to ("" for dL/dh only). ``on_backward`` (optional)
    is called with the number of rows of each backward sent."""

    def __init__(self, client: Any, head: str, head_version: str = "", temperature: float = 1.0,
                 outputs: Tuple[str, ...] = ("log_probs",), gradient_step: str = "",
                 on_backward: Any = None) -> None:
        self.client = client
        self.head = head
        self.head_version = head_version
        self.temperature = float(temperature)
        self.outputs = tuple(outputs)
        self.gradient_step = gradient_step
        self.on_backward = on_backward


def _function() -> Any:
    import torch

    class _ServiceLogProbFunction(torch.autograd.Function):  # type: ignore[misc]
        @staticmethod
        def forward(ctx: Any, hidden: Any, targets: Any, binding: HeadBinding) -> Any:
            ctx.set_materialize_grads(False)
            out = fused_head.score_rows(binding.client, hidden, targets, head=binding.head,
                                        head_version=binding.head_version, temperature=binding.temperature,
                                        outputs=binding.outputs)
            ctx.save_for_backward(hidden, targets)
            ctx.binding = binding
            ctx.version = str(out["head_version"])
            fixed = [out[n] for n in ("log_sum_sq_probs", "mean_logits", "is_top1") if out[n] is not None]
            ctx.mark_non_differentiable(*fixed)
            return tuple(out[n] for n in fused_head.FUSED_OUTPUTS)

        @staticmethod
        def backward(ctx: Any, grad_logprobs: Any, grad_entropy: Any, *_: Any) -> Any:
            hidden, targets = ctx.saved_tensors
            binding: HeadBinding = ctx.binding
            nothing = grad_logprobs is None and grad_entropy is None
            if nothing or (not ctx.needs_input_grad[0] and not binding.gradient_step):
                return None, None, None
            if binding.on_backward is not None:
                binding.on_backward(int(hidden.shape[0]))
            grad = fused_head.backward_rows(binding.client, hidden, targets, grad_logprobs, grad_entropy,
                                            head=binding.head, head_version=ctx.version,
                                            temperature=binding.temperature, gradient_step=binding.gradient_step)
            return (grad.to(hidden.dtype) if ctx.needs_input_grad[0] else None), None, None

    return _ServiceLogProbFunction


_FUNCTION: Optional[Any] = None


class ServiceLogProbFunction:
    """``ServiceLogProbFunction.apply(hidden, targets, binding)``: TRL's
    5-tuple (``fused_head.FUSED_OUTPUTS``: log_probs and entropy
    differentiable, the others not, None when not requested), each [N] on
    ``hidden``'s device, with the backward the module docstring describes.
    Raises LogprobError for a failed call (in the backward too)."""

    @staticmethod
    def apply(hidden: Any, targets: Any, binding: HeadBinding) -> Any:
        global _FUNCTION
        if _FUNCTION is None:
            _FUNCTION = _function()
        return _FUNCTION.apply(hidden, targets, binding)


def service_logprobs(client: Any, hidden: Any, targets: Any, *, head: str, head_version: str = "",
                     temperature: float = 1.0, outputs: Tuple[str, ...] = ("log_probs", "entropy"),
                     gradient_step: str = "") -> Any:
    """``ServiceLogProbFunction.apply`` with a ``HeadBinding`` of these
    arguments: the per-token outputs of ``hidden`` at ``targets`` under the
    server's ``head``, differentiable with respect to ``hidden`` (and, with
    ``gradient_step``, the head's weight through the step's sums)."""
    return ServiceLogProbFunction.apply(hidden, targets,
                                        HeadBinding(client, head, head_version, temperature, outputs, gradient_step))
