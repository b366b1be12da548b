"""verl integration: the calls of verl's fused PPO head made without
gradients (``compute_log_prob``: the old policy's logprobs, and
``compute_ref_log_prob``: the reference's, with ``use_fused_kernels``)
answered by the logprob service; the actor's ``lm_head`` pushed to the
server when verl syncs weights.

The seam: with ``use_fused_kernels`` verl's models run
``verl.utils.experimental.torch_functional.FusedLinearForPPO().forward(
hidden_states [B, S, H] or [T, H], vocab_weights [V, H], input_ids (same
shape as hidden_states' leading dims), temperature)``, which returns
``(log_probs float32, entropy in hidden_states' dtype)`` shaped like
``input_ids`` (row t scored at ``input_ids[t]``: verl passes the rolled
labels). The model code imports the class from that module at each call,
so ``use_service`` replaces the module's ``FusedLinearForPPO`` by a
subclass whose ``forward`` answers calls without gradients whose
``vocab_weights`` is a registered head, and leaves every other call to
verl's own code (the same ``FusedLinearForPPO``, any backend)::

    from logprob_client import LogprobClient
    from logprob_client.verl import use_service

    # In the process that computes the logprobs (verl's actor / ref worker):
    service = use_service(LogprobClient("10.0.0.5:50051", timeout=120))
    service.add_head(actor_model.lm_head, "policy")        # old logprobs: pinned to the last push
    service.add_head(ref_model.lm_head, "reference")       # reference logprobs
    service.push(actor_model.lm_head.weight, step=0)       # and after each weight sync (or pushing_after)

``push`` sends the actor's weight as version ``{run}-step-N``
(``version_format``; ``run``: a random id made at ``use_service``, rank
0's on every rank when ``torch.distributed`` is initialized, so that every
data-parallel rank names a step alike), with its sha256, and pins the
policy's calls to it. Under ``torch.distributed`` it is a collective of
the default group (``fused_head.push_weight``): rank 0 pushes a whole
weight, every rank its own rows of a ``Shard(0)`` DTensor (FSDP2; give
the parameter itself, not a gathered copy), a DeepSpeed ZeRO-3 parameter
is gathered with ``deepspeed.zero.GatheredParameters``, and every rank
gets the committed version from rank 0. Processes of different jobs (or
without ``torch.distributed``) pushing the same step at once upload it
once: the server has the others wait for that update and answer them
``already_committed``; a repeated push of a whole weight is a no-op
without upload.
``pushing_after(method, weight_of)`` wraps
a worker's weight-sync method (verl 0.9's async
``ActorRolloutRefWorker.update_weights(self, global_steps=None, ...)``) so
that every sync also pushes ``weight_of(worker)``.

Answers have verl's shapes, dtypes and device; they are the server's
float32 computation (within ``2e-4 + 2e-5 |x|`` of float64), where verl's
torch backend computes the logits in the hidden states' dtype (bf16 logits
in bf16 training). ``on_unsupported`` as in ``logprob_client.trl``
(``"raise"``: ``HeadMismatchError`` for a head with logit transforms, which
verl's seam does not apply). ``SUPPORTED_VERL``: the releases this was
written against (0.9.x), checked from the installed distribution's
metadata (``import verl`` itself needs ray).
"""

import functools
import importlib
from typing import Any, Callable, Dict, List, Optional, Tuple

from . import fused_head
from .fused_head import HeadMismatchError, UnsupportedCall

__all__ = ["use_service", "VerlService", "HeadMismatchError", "SUPPORTED_VERL", "check_verl_version", "SEAM"]

SEAM = "verl.utils.experimental.torch_functional"
SUPPORTED_VERL = ((0, 9), (0, 10))


def check_verl_version(version: Optional[str] = None) -> str:
    """The installed verl's version (``importlib.metadata``), or
    ``version``, when within ``SUPPORTED_VERL``; RuntimeError otherwise,
    ImportError when verl is not installed."""
    if version is None:
        from importlib import metadata

        try:
            version = metadata.version("verl")
        except metadata.PackageNotFoundError as e:
            raise ImportError("logprob_client.verl needs verl (pip install 'verl>=0.9,<0.10')") from e
    lo, hi = SUPPORTED_VERL
    if not (lo <= fused_head.release(version)[:2] < hi):
        raise RuntimeError("logprob_client.verl supports verl >= %d.%d, < %d.%d (it replaces %s.FusedLinearForPPO); "
                           "verl %s is installed" % (lo + hi + (SEAM, version)))
    return version


def _weight_of(x: Any) -> Any:
    return x.weight if hasattr(x, "weight") and not hasattr(x, "data_ptr") else x


class VerlService(fused_head.ServiceAdapter):
    """What ``use_service`` returns: the registered heads, the policy's
    pinned version (``policy_version``), ``run`` (the run id of its version
    names), counters (``pushes``, ``routed`` by head, ``fallbacks``,
    ``calls``: the last 10000 ``(head, version, tokens)``). ``remove()``
    puts verl's class back."""

    RAISE_FORMAT = "logprob_client.verl cannot answer this call: %s"
    WARN_FORMAT = "logprob_client.verl: %s; such calls run in verl's kernel"

    def __init__(self, client: Any, module: Any, original: Any, on_unsupported: str, version_format: str,
                 policy_head: str, run: Optional[str] = None) -> None:
        super().__init__(client, policy_head, on_unsupported, version_format, run)
        self.module = module
        self.original = original
        self.heads: List[Tuple[Any, str]] = []

    def add_head(self, weight: Any, head: str) -> None:
        """Registers a model's lm_head (its ``[V, H]`` weight tensor, or the
        ``lm_head`` module, whose ``.weight`` is then read at each call) as
        the server's ``head``. Checks the head exists with that shape and
        has no logit transform (verl's seam applies none): raises
        InvalidInputError / HeadMismatchError."""
        info = fused_head.head_info(self.client, head, refresh=True)
        fused_head.check_shape(info, _weight_of(weight))
        transforms = fused_head.HeadTransforms.of_info(info)
        why = transforms.mismatch(False, 1.0, None)
        if why:
            raise HeadMismatchError("head %r cannot answer verl's FusedLinearForPPO (no bias, scale or softcap): %s"
                                    % (head, why))
        self._transforms[head] = transforms
        self.heads.append((weight, head))

    def push(self, weight: Any, step: int, head: Optional[str] = None) -> str:
        """Pushes ``weight`` ([V, H]; CPU or CUDA; a ``Shard(0)`` DTensor of
        FSDP2; a DeepSpeed ZeRO-3 parameter) as version
        ``version_format.format(run=run, step=step)`` of ``head`` (the
        policy head by default, whose calls it then pins to it) and returns
        the version. Under ``torch.distributed`` a collective: every rank
        calls it; rank 0 pushes a whole weight, with its sha256 (a repeat is
        a no-op without upload), every rank its own rows of a DTensor, and
        every rank is pinned to the version committed
        (``fused_head.push_weight``). Raises LogprobError (ALREADY_EXISTS:
        that name holds other weights)."""
        if head is None or head == self.policy_head:
            return self.policy.push(_weight_of(weight), step)
        return fused_head.push_weight(self.client, head, _weight_of(weight), self.policy.name(step))

    def pushing_after(self, method: Callable[..., Any], weight_of: Callable[[Any], Any]) -> Callable[..., Any]:
        """Wraps a worker's weight-sync method (sync or async, called as
        ``method(worker, global_steps=N, ...)`` or with ``global_steps`` as
        the first positional argument) so that once it returns, the
        policy's weight ``weight_of(worker)`` is pushed as step N. The
        wrapper keeps the method's attributes (verl's ``register``
        dispatch marks)."""
        service = self

        def steps_of(args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> int:
            steps = kwargs.get("global_steps", args[0] if args else None)
            return int(steps or 0)

        if _is_coroutine_function(method):
            @functools.wraps(method)
            async def async_wrapper(worker: Any, *args: Any, **kwargs: Any) -> Any:
                out = await method(worker, *args, **kwargs)
                service.push(weight_of(worker), steps_of(args, kwargs))
                return out
            return async_wrapper

        @functools.wraps(method)
        def wrapper(worker: Any, *args: Any, **kwargs: Any) -> Any:
            out = method(worker, *args, **kwargs)
            service.push(weight_of(worker), steps_of(args, kwargs))
            return out
        return wrapper

    def _head_of(self, weight: Any) -> Optional[str]:
        for registered, head in self.heads:
            if fused_head.same_tensor(weight, _weight_of(registered)):
                return head
        return None

    def answer(self, hidden_states: Any, vocab_weights: Any, input_ids: Any, temperature: float) -> Optional[Any]:
        """verl's ``(log_probs, entropy)`` from the service for a call this
        service takes, else None."""
        import torch

        if torch.is_grad_enabled() and (hidden_states.requires_grad or vocab_weights.requires_grad):
            return None
        head = self._head_of(vocab_weights)
        if head is None:
            return None
        if tuple(input_ids.shape) != tuple(hidden_states.shape[:-1]) or hidden_states.dim() not in (2, 3):
            raise ValueError("FusedLinearForPPO: input_ids %s must be hidden_states' leading shape %s"
                             % (list(input_ids.shape), list(hidden_states.shape[:-1])))
        version = ""
        if head == self.policy_head:
            if self.policy_version is None:
                raise RuntimeError("logprob_client.verl: the policy's no-gradient logprobs need a pushed version "
                                   "first: call service.push(actor lm_head weight, step) after loading the actor "
                                   "(and after each weight sync, e.g. with pushing_after)")
            version = self.policy_version
        flat = hidden_states.reshape(-1, hidden_states.shape[-1])
        try:
            out = fused_head.score_rows(self.client, flat, input_ids.reshape(-1), head=head, head_version=version,
                                        temperature=float(temperature), outputs=("log_probs", "entropy"))
        except UnsupportedCall as e:
            self._unsupported(str(e), cause=e, stacklevel=3)
            return None
        self.routed[head] += 1
        self.calls.append((head, str(out["head_version"]), int(flat.shape[0])))
        shape = input_ids.shape
        return out["log_probs"].reshape(shape), out["entropy"].to(hidden_states.dtype).reshape(shape)

    def remove(self) -> None:
        """Puts verl's own ``FusedLinearForPPO`` back in its module."""
        if getattr(self.module, "FusedLinearForPPO", None) is not self.original:
            self.module.FusedLinearForPPO = self.original


def _is_coroutine_function(fn: Any) -> bool:
    import inspect

    return inspect.iscoroutinefunction(fn)


def use_service(client: Any, *, policy_head: str = "policy", on_unsupported: str = "raise",
                version_format: str = fused_head.DEFAULT_VERSION_FORMAT, run: Optional[str] = None,
                module: Any = None, check_version: bool = True) -> VerlService:
    """Replaces ``FusedLinearForPPO`` in verl's module (``SEAM``, or
    ``module`` given) by a subclass answering registered heads' calls
    without gradients from the service behind ``client`` (a synchronous
    ``LogprobClient``); returns the ``VerlService`` to register heads
    (``add_head``) and push the policy (``push`` / ``pushing_after``).
    Call it in every process whose model computes logprobs: when
    ``torch.distributed`` is initialized it is a collective (rank 0's run
    id is broadcast, ``fused_head.run_id``) unless ``run`` is given.
    ``version_format``: the policy's version names, ``str.format``ted with
    ``run`` and ``step`` (keep ``{run}`` when a server outlives runs).
    Raises RuntimeError for an unsupported verl (``check_version=False``
    skips the check, e.g. for a module that only copies the seam's
    signature), ValueError for a bad ``version_format`` or ``run``."""
    fused_head.require_sync_client(client)
    if module is None:
        if check_version:
            check_verl_version()
        module = importlib.import_module(SEAM)
    original = module.FusedLinearForPPO
    service = VerlService(client, module, original, on_unsupported, version_format, policy_head, run)

    class ServiceFusedLinearForPPO(original):  # type: ignore[misc,valid-type]
        """verl's FusedLinearForPPO; no-gradient calls of registered heads
        are answered by the logprob service (logprob_client.verl)."""

        def forward(self, hidden_states: Any, vocab_weights: Any, input_ids: Any,
                    temperature: float = 1.0) -> Any:
            out = service.answer(hidden_states, vocab_weights, input_ids, temperature)
            if out is not None:
                return out
            return super().forward(hidden_states, vocab_weights, input_ids, temperature)

    ServiceFusedLinearForPPO.__name__ = "FusedLinearForPPO"
    ServiceFusedLinearForPPO.__qualname__ = "FusedLinearForPPO"
    module.FusedLinearForPPO = ServiceFusedLinearForPPO
    return service
