"""TRL integration: the fused ``lm_head`` calls a TRL trainer makes without
gradients (GRPO's reference-model logprobs with ``beta > 0``, its old-policy
logprobs with ``num_iterations > 1`` or importance sampling; the same in
RLOO, DPO, KTO) are answered by the logprob service, the calls with
gradients stay in TRL's own kernel. Two lines::

    from logprob_client import LogprobClient
    from logprob_client.trl import use_service

    trainer = GRPOTrainer(model=..., args=GRPOConfig(beta=0.04, num_iterations=2, ...), ...)
    service = use_service(trainer, LogprobClient("127.0.0.1:50051", timeout=120))
    trainer.train()

The server holds two heads (``logprob-server --lm-head policy=CKPT
--lm-head reference=CKPT --allow-lm-head-updates --lm-head-retain 2``; see
docs/rl-frameworks.md). ``use_service``:

- puts a router in place of ``trl.trainer.utils._ChunkedLogProbFunction``,
  the name ``add_fused_lm_head``'s forward looks up at each call: a call
  ``apply(hidden [N, H], weight [V, H], bias, targets [N], temperature,
  chunk_size, final_logit_softcapping, logit_scale, outputs)`` made without
  gradients (``torch.is_grad_enabled()`` false, or none of hidden / weight
  / bias requires grad) whose ``weight`` is the reference model's
  ``lm_head`` goes to ``reference_head``, the policy's to ``policy_head``
  pinned to the version pushed last (the weights that generated and score
  the rollouts); every other call (with gradients, another model's weight)
  goes to TRL's function untouched;
- makes sure ``reference_head`` holds the reference model's ``lm_head``
  (tied or not): kept when the server's head already has these weights
  (same sha256 in the head's dtype), else pushed once as ``ref-<sha256
  prefix>``;
- pushes the policy's ``lm_head`` only when a call will score it: before
  the first no-gradient policy call after each optimizer step (GRPO's
  old-policy logprobs with ``num_iterations > 1`` or vLLM importance
  sampling; PEFT's reference pass through the policy's ``lm_head``), as
  version ``{run}-step-N`` (``version_format``; ``run``: a random id made
  once per adapter, rank 0's on every rank when ``torch.distributed`` is
  initialized; ``N``: the trainer's ``global_step``), with its sha256 (a
  repeat of the same bytes under a taken name is a no-op without upload),
  through ``LogprobClient.update_lm_head`` (CUDA IPC for a CUDA weight
  where the server offers it on this host, shared memory on the server's
  host, pieces otherwise), converted to the head's dtype; at
  ``num_iterations = 1`` without vLLM nothing scores the policy, and it is
  never pushed. A ``transformers.TrainerCallback`` marks the pushed
  version stale at train begin and after every optimizer step;
- logs one line (``logging``, logger ``logprob_client.trl``, INFO) at
  install saying which calls go to the service and whether the policy
  will be pushed;
- checks the installed TRL against ``SUPPORTED_TRL`` (these are TRL
  internals) and raises ``RuntimeError`` outside it.

The service's answer has TRL's shapes ([N]), dtypes (float32; ``is_top1``
bool) and device, and is computed as the server computes a head (float32
logits from an f32-accumulated GEMM, ``z = softcap(logit_scale * (h W^T +
b)) / temperature``, within ``2e-4 + 2e-5 |x|`` of float64): like TRL with
``cast_lm_head_to_fp32=True``, not like its default bf16 autocast GEMM.

A call the service cannot answer as TRL would (the call's bias /
``logit_scale`` / ``final_logit_softcapping`` differ from the head's as
``GetServerInfo`` reports them; a trained bias on the policy; an output
this client or server lacks) raises ``HeadMismatchError``
(``on_unsupported="raise"``, the default) or goes to TRL's kernel with a
one-time warning (``on_unsupported="fallback"``). Errors of the service
itself (``LogprobError``) are raised, never hidden by a fallback.

Several training processes (``accelerate launch`` / ``torchrun``: DDP,
FSDP2, DeepSpeed ZeRO-3): call ``use_service`` on every rank (a collective:
rank 0's run id is broadcast, rank 0 loads the reference head). Every
rank's no-gradient calls go to the service; the policy's push before the
first such call after a step is a collective too
(``fused_head.push_weight``): rank 0 pushes a whole weight (DDP; a ZeRO-3
parameter, which TRL has gathered for the call), every rank its own rows
of a ``Shard(0)`` DTensor (FSDP2), and every rank pins its calls to the
version committed, which it gets from rank 0 by a broadcast (so every
rank must make its first no-gradient policy call after a step, as TRL's
trainers do: their ranks run the same steps). A DTensor
head, which TRL gathers into a new tensor per call, is recognised by the
``lm_head`` module of TRL's fused forward on the call stack.

With vLLM importance sampling (``use_vllm=True``,
``vllm_importance_sampling_correction=True``), the old-policy call of each
generation carries vLLM's per-token logprobs (TRL's
``sampling_per_token_logps``, NaN where vLLM had none, outside
``completion_mask`` / ``tool_mask``) to the service, which compares them
with its own (docs/SPEC.md "Rollout mismatch"); the adapter adds the
generation's figures, token-weighted over the calls and the ranks, to
TRL's metrics: ``sampling/service_mismatch/k3``, ``.../k1``,
``.../mean_abs_log_ratio``, ``.../outside_band_fraction`` (band
``rollout_band``) and ``.../tokens``, logged with TRL's own
``sampling/sampling_logp_difference/*`` (whose mean is
``mean_abs_log_ratio``'s). The rows of a call are matched to vLLM's
logprobs through the locals of TRL's frames on the call stack
(``_generate_and_score_completions``: ``sampling_per_token_logps``;
``_get_per_token_logps_and_entropies``: the micro-batch; the fused
forward: its labels): a call whose rows do not line up carries none.

Not supported (refused by ``use_service`` with a message):
``sync_ref_model=True`` (the reference head would go stale).
"""

import logging
import threading
from types import FrameType, SimpleNamespace
from typing import Any, Callable, Dict, List, Optional, Tuple

from . import fused_head, head_autograd
from ._internal.request import rollout_mismatch as join_rollout_mismatch
from .fused_head import HeadMismatchError, UnsupportedCall

logger = logging.getLogger(__name__)

__all__ = ["use_service", "ServiceLogProbs", "HeadMismatchError", "SUPPORTED_TRL", "check_trl_version"]

# TRL releases whose internals this module was written against and tested
# with: >= 1.16.0, < 1.17 (trl.trainer.utils._ChunkedLogProbFunction and
# add_fused_lm_head's call of its apply).
SUPPORTED_TRL = ((1, 16), (1, 17))


def check_trl_version(version: Optional[str] = None) -> str:
    """The installed TRL's version (or ``version``) when it is within
    ``SUPPORTED_TRL``; raises RuntimeError saying which versions are
    supported otherwise, and ImportError when TRL is not installed."""
    if version is None:
        try:
            import trl
        except ImportError as e:
            raise ImportError("logprob_client.trl needs TRL (pip install 'trl>=%d.%d,<%d.%d'): %s"
                              % (SUPPORTED_TRL[0] + SUPPORTED_TRL[1] + (e,))) from e
        version = str(trl.__version__)
    lo, hi = SUPPORTED_TRL
    rel = fused_head.release(version)
    if not (lo <= rel[:2] < hi):
        raise RuntimeError(
            "logprob_client.trl supports TRL >= %d.%d, < %d.%d (it replaces the TRL internal "
            "trl.trainer.utils._ChunkedLogProbFunction); TRL %s is installed. Install a supported TRL "
            "(pip install 'trl>=%d.%d,<%d.%d') or a logprob_client that supports this one."
            % (lo + hi + (version,) + lo + hi))
    return version


_OPTIONAL_DEFAULT = ("entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
_ARG_NAMES = ("hidden", "weight", "bias", "targets", "temperature", "chunk_size", "final_logit_softcapping",
              "logit_scale", "outputs")
_ARG_DEFAULTS: Dict[str, Any] = {"final_logit_softcapping": None, "logit_scale": 1.0,
                                 "outputs": ("log_probs",) + _OPTIONAL_DEFAULT}


def _bind(args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Dict[str, Any]:
    """``ChunkedLogProbFunction.apply``'s arguments by name."""
    if len(args) > len(_ARG_NAMES):
        raise TypeError("ChunkedLogProbFunction.apply takes %d arguments, got %d" % (len(_ARG_NAMES), len(args)))
    bound = dict(_ARG_DEFAULTS)
    bound.update(zip(_ARG_NAMES, args))
    bound.update(kwargs)
    missing = [n for n in _ARG_NAMES if n not in bound]
    if missing:
        raise TypeError("ChunkedLogProbFunction.apply: missing %s" % ", ".join(missing))
    return bound


def _without_grad(torch: Any, a: Dict[str, Any]) -> bool:
    """True for a call that builds no autograd graph."""
    if not torch.is_grad_enabled():
        return True
    return not any(t is not None and t.requires_grad for t in (a["hidden"], a["weight"], a["bias"]))


class _Router:
    """What ``trl.trainer.utils._ChunkedLogProbFunction`` is while adapters
    are active: ``apply`` offers each call to the adapters (newest first);
    the first that takes it answers; else the function it replaced does."""

    lock = threading.Lock()
    adapters: List["ServiceLogProbs"] = []
    original: Any = None

    @staticmethod
    def apply(*args: Any, **kwargs: Any) -> Any:
        for adapter in reversed(list(_Router.adapters)):
            out = adapter._maybe_answer(args, kwargs)
            if out is not None:
                return out
        return _Router.original.apply(*args, **kwargs)


def _install(adapter: "ServiceLogProbs") -> None:
    import trl.trainer.utils as trl_utils

    if not hasattr(trl_utils, "_ChunkedLogProbFunction"):
        raise RuntimeError("trl.trainer.utils has no _ChunkedLogProbFunction: this TRL's fused lm_head is not the "
                           "one logprob_client.trl supports (see SUPPORTED_TRL)")
    with _Router.lock:
        # original is None exactly while the router is not in TRL's module
        # (itself, or wrapped by someone who wrapped it after us).
        if _Router.original is None:
            _Router.original = trl_utils._ChunkedLogProbFunction
            trl_utils._ChunkedLogProbFunction = _Router
        _Router.adapters.append(adapter)


def _uninstall(adapter: "ServiceLogProbs") -> None:
    import trl.trainer.utils as trl_utils

    with _Router.lock:
        if adapter in _Router.adapters:
            _Router.adapters.remove(adapter)
        # Put TRL's function back when nothing uses the router and nobody
        # wrapped it (else it stays in the chain, passing every call on).
        if not _Router.adapters and trl_utils._ChunkedLogProbFunction is _Router:
            trl_utils._ChunkedLogProbFunction = _Router.original
            _Router.original = None


class RoutedCall:
    """One call the service answered: ``head``, ``version`` (the version
    that scored it), ``tokens`` (N), ``outputs`` (requested)."""

    __slots__ = ("head", "version", "tokens", "outputs")

    def __init__(self, head: str, version: str, tokens: int, outputs: Tuple[str, ...]) -> None:
        self.head, self.version, self.tokens, self.outputs = head, version, tokens, outputs

    def __repr__(self) -> str:
        return "RoutedCall(head=%r, version=%r, tokens=%d, outputs=%r)" % (self.head, self.version, self.tokens,
                                                                           self.outputs)


def _unwrap(trainer: Any, model: Any) -> Any:
    acc = getattr(trainer, "accelerator", None)
    if acc is not None:
        try:
            model = acc.unwrap_model(model)
        except Exception:  # not prepared by accelerate
            pass
    if hasattr(model, "get_base_model"):  # PEFT
        model = model.get_base_model()
    return model


def _head_weight(model: Any) -> Any:
    emb = model.get_output_embeddings()
    if emb is None:
        raise ValueError("%s has no output embeddings (lm_head)" % type(model).__name__)
    return emb.weight


# The function of TRL's fused forward (``add_fused_lm_head``) that calls
# ``_ChunkedLogProbFunction.apply``, and its local holding the lm_head module.
_FUSED_FORWARD = "_fused_forward"
_FUSED_FORWARD_HEAD = "lm_head"


def _gathering_lm_head(depth: int = 8) -> Any:
    """The ``lm_head`` module of TRL's fused forward on the call stack when
    its weight is a DTensor (FSDP2: TRL passes ``weight.full_tensor()``,
    a new tensor each call, so the weight itself names no model); None
    otherwise. Looks ``depth`` frames up, no further."""
    import sys

    frame: Optional[FrameType] = sys._getframe(1)
    for _ in range(depth):
        if frame is None:
            return None
        if frame.f_code.co_name == _FUSED_FORWARD:
            lm_head = frame.f_locals.get(_FUSED_FORWARD_HEAD)
            weight = getattr(lm_head, "weight", None)
            return lm_head if weight is not None and fused_head.is_dtensor(weight) else None
        frame = frame.f_back
    return None


# TRL's generation step and the frames a policy call's rollout logprobs are
# found through (TRL 1.16 GRPOTrainer; _rollout_rows).
_GENERATE_AND_SCORE = "_generate_and_score_completions"
_PER_TOKEN_LOGPS = "_get_per_token_logps_and_entropies"
# The prefix of the figures the adapter adds to TRL's metrics.
MISMATCH_METRICS = "sampling/service_mismatch/"
_MISMATCH_FIGURES = ("k3", "k1", "mean_abs_log_ratio", "outside_band_fraction", "tokens")


def _frames(names: Tuple[str, ...], depth: int = 48) -> Optional[Dict[str, FrameType]]:
    """The innermost frame of each function in ``names`` within ``depth``
    frames above the caller's caller, or None when one is missing."""
    import sys

    found: Dict[str, FrameType] = {}
    frame: Optional[FrameType] = sys._getframe(2)
    for _ in range(depth):
        if frame is None:
            break
        name = frame.f_code.co_name
        if name in names and name not in found:
            found[name] = frame
            if len(found) == len(names):
                return found
        frame = frame.f_back
    return None


def _rollout_rows(rows: int) -> Any:
    """vLLM's logprobs of the rows of the fused-head call being answered
    (float32 [rows] on the CPU, NaN where vLLM had none or TRL masks the
    token out), when that call is TRL's old-policy pass of a generation
    with vLLM logprobs; else None.

    TRL 1.16: ``_generate_and_score_completions`` holds
    ``sampling_per_token_logps`` [B, K] (right-padded completions,
    ``completion_mask``, ``tool_mask``) and has not yet assigned
    ``old_per_token_logps`` (the old-policy pass runs first; a PEFT
    reference pass through the policy's head comes after);
    ``_get_per_token_logps_and_entropies`` scores rows [start, end) with
    ``logits_to_keep`` = K; the fused forward's ``labels`` [b, L - 1]
    (shifted) end with those K completion positions, and the call's rows
    are ``labels[mask]`` (``compact``) or all of them."""
    import torch

    frames = _frames((_FUSED_FORWARD, _PER_TOKEN_LOGPS, _GENERATE_AND_SCORE))
    if frames is None:
        return None
    gen = frames[_GENERATE_AND_SCORE].f_locals
    sampling = gen.get("sampling_per_token_logps")
    if sampling is None or "old_per_token_logps" in gen or "completion_mask" not in gen:
        return None
    per = frames[_PER_TOKEN_LOGPS].f_locals
    fwd = frames[_FUSED_FORWARD].f_locals
    start, end, keep = per.get("start"), per.get("end"), per.get("logits_to_keep")
    labels, mask = fwd.get("labels"), fwd.get("mask")
    if start is None or end is None or keep is None or labels is None or labels.dim() != 2:
        return None
    keep = int(keep)
    if sampling.dim() != 2 or sampling.shape[1] != keep or labels.shape[0] != end - start or labels.shape[1] < keep:
        return None
    valid = gen["completion_mask"][start:end].bool()
    if gen.get("tool_mask") is not None:
        valid = valid & gen["tool_mask"][start:end].bool()
    nan = torch.tensor(float("nan"))
    full = torch.full(tuple(labels.shape), float("nan"), dtype=torch.float32)
    full[:, labels.shape[1] - keep:] = torch.where(valid.cpu(), sampling[start:end].detach().float().cpu(), nan)
    out = full[mask.cpu()] if fwd.get("compact") and mask is not None else full.reshape(-1)
    return out if int(out.numel()) == rows else None


class ServiceLogProbs(fused_head.ServiceAdapter):
    """The adapter ``use_service`` returns (one per trainer).

    Attributes: ``policy_head``, ``reference_head`` (the server's head
    names), ``policy_version`` (the policy version pushed last, which
    scores the policy's calls; None before the first push), ``run`` (the
    run id of its version names), ``pushes`` (policy pushes made),
    ``policy_scored`` (whether this trainer's configuration makes
    no-gradient policy calls, so that the policy is pushed; logged at
    install), ``reference_version`` (None without a reference model),
    ``calls`` (the last 10000 ``RoutedCall``s), ``routed`` (count of calls
    the service answered, by head), ``fallbacks`` (no-gradient calls of a
    known head left to TRL under ``on_unsupported="fallback"``),
    ``callback`` (the ``transformers.TrainerCallback`` that marks the
    pushed version stale after each optimizer step), ``rollout_band``,
    ``mismatch`` (the figures of the last generation compared with vLLM's
    logprobs, the dict added to TRL's metrics under
    ``MISMATCH_METRICS``; None before). ``remove()`` takes
    the adapter out (TRL's function is back once none is left).
    Thread-safe as far as TRL's calls are (one training loop).
    """

    RAISE_FORMAT = ("logprob_client.trl cannot answer this fused lm_head call as TRL would: %s. Pass "
                    "use_service(..., on_unsupported=\"fallback\") to leave such calls to TRL's kernel.")
    WARN_FORMAT = "logprob_client.trl: %s; these calls run in TRL's own kernel"

    def __init__(self, trainer: Any, client: Any, policy_head: str, reference_head: str, on_unsupported: str,
                 version_format: str = fused_head.DEFAULT_VERSION_FORMAT, run: Optional[str] = None,
                 rollout_band: Tuple[float, float] = (0.9, 1.1), gradients: bool = False) -> None:
        super().__init__(client, policy_head, on_unsupported, version_format, run)
        self.trainer = trainer
        self.gradients = bool(gradients)
        self.backward_calls = 0  # backwards the service answered (gradients=True)
        self.gradient_steps = 0  # optimizer steps whose head gradients were fetched
        self._grad_step = 0  # index of the open gradient step's key
        self._grad_step_used = False  # a backward added to it
        self._grad_wrapped: List[str] = []
        self.reference_head = reference_head
        self.policy_scored, self.policy_scored_why = policy_calls(trainer)
        self.reference_version: Optional[str] = None
        self.callback: Any = None
        self.rollout_band = (float(rollout_band[0]), float(rollout_band[1]))
        self.mismatch: Optional[Dict[str, float]] = None
        self._stale = True  # the policy's weights may differ from the version pushed last
        self._mismatch_parts: List[Dict[str, float]] = []  # this generation's calls' figures
        self._generate_wrapped = False

    # -- models -------------------------------------------------------------

    def _policy_model(self) -> Any:
        return _unwrap(self.trainer, self.trainer.model)

    def _reference_model(self) -> Any:
        ref = getattr(self.trainer, "ref_model", None)
        return None if ref is None else _unwrap(self.trainer, ref)

    def _head_of(self, weight: Any) -> Optional[str]:
        """The server head of a call's weight, or None (not a model of this
        trainer): the model whose ``lm_head.weight`` the call's weight is,
        or, for a DTensor head (FSDP2), which TRL gathers into a new tensor
        at each call, the model whose ``lm_head`` TRL's fused forward is
        projecting through."""
        policy = self._policy_model()
        ref = self._reference_model()
        if fused_head.same_tensor(weight, _head_weight(policy)):
            return self.policy_head
        if ref is not None and fused_head.same_tensor(weight, _head_weight(ref)):
            return self.reference_head
        lm_head = _gathering_lm_head()
        if lm_head is None:
            return None
        if lm_head is policy.get_output_embeddings():
            return self.policy_head
        if ref is not None and lm_head is ref.get_output_embeddings():
            return self.reference_head
        return None

    # -- pushing ------------------------------------------------------------

    def setup_reference(self) -> None:
        """Makes ``reference_head`` hold the reference model's lm_head (once)."""
        ref = self._reference_model()
        if ref is None:
            return
        self.reference_version = fused_head.ensure_head(self.client, self.reference_head, _head_weight(ref))
        self._refresh_transforms(self.reference_head)

    def push_policy(self, step: int) -> str:
        """Pushes the policy's lm_head as ``version_format.format(run=run,
        step=step)`` and makes it the version the policy's calls are
        pinned to (``fused_head.PolicyPushes.push``). Raises LogprobError
        (ALREADY_EXISTS: the server holds that version with other weights,
        e.g. from an earlier run under a format without ``{run}``)."""
        committed = self.policy.push(_head_weight(self._policy_model()), step)
        self._stale = False
        if self.policy_head not in self._transforms:
            self._refresh_transforms(self.policy_head)
        return committed

    def weights_changed(self) -> None:
        """Marks the pushed policy version stale: the next no-gradient
        policy call pushes the policy's lm_head first (the callback calls
        this at train begin and after every optimizer step)."""
        self._stale = True

    def describe(self) -> str:
        """The one line ``use_service`` logs: which calls go to the
        service, and whether (and how) the policy is pushed."""
        trainer = type(self.trainer).__name__
        if self._reference_model() is not None:
            ref = "the reference model's to head %r (version %s)" % (self.reference_head, self.reference_version)
        else:
            ref = "no reference model"
        if self.policy_scored:
            policy = ("the policy's to head %r, pushed as %r before the first such call after each optimizer "
                      "step (%s)" % (self.policy_head, self.version_format.replace("{run}", self.run),
                                     self.policy_scored_why))
        else:
            policy = ("the policy's: none expected (%s), so the policy is not pushed (should one come, it is "
                      "pushed first, to head %r)" % (self.policy_scored_why, self.policy_head))
        world = fused_head.world_size()
        ranks = ("; %d processes: each push is a collective, every rank scores on the version rank 0 reports"
                 % world if world > 1 else "")
        compared = ("; vLLM's logprobs go with the old-policy calls, the service's mismatch figures to TRL's "
                    "metrics (%s*)" % MISMATCH_METRICS if self._compares() else "")
        grads = ("calls with gradients go to the service too, the head's weight gradient fetched once per "
                 "optimizer step" if self.gradients else "calls with gradients stay in TRL's kernel")
        return ("%s's fused lm_head calls without gradients go to the logprob service: %s; "
                "%s; %s%s%s" % (trainer, ref, policy, grads, ranks, compared))

    # -- routing ------------------------------------------------------------

    def _maybe_answer(self, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Optional[Tuple[Any, ...]]:
        """TRL's 5-tuple for a call this adapter answers; None for a call it
        leaves to TRL (with gradients, another weight, unsupported with
        fallback)."""
        import torch

        a = _bind(args, kwargs)
        if not _without_grad(torch, a):
            return self._maybe_answer_with_gradients(a) if self.gradients else None
        head = self._head_of(a["weight"])
        if head is None:
            return None
        outputs = tuple(a["outputs"])
        why = self._check(head, a)
        if why:
            self._unsupported(why, stacklevel=3)
            return None
        version = ""
        if head == self.policy_head:
            version = self._current_policy_version()
        elif self.reference_version is not None:
            version = self.reference_version
        rollout = _rollout_rows(int(a["hidden"].shape[0])) if head == self.policy_head and self._compares() else None
        try:
            out = fused_head.score_rows(self.client, a["hidden"], a["targets"], head=head, head_version=version,
                                        temperature=float(a["temperature"]), outputs=outputs,
                                        rollout_logprobs=rollout, rollout_band=self.rollout_band)
        except UnsupportedCall as e:
            self._unsupported(str(e), stacklevel=3)
            return None
        if out.get("rollout_mismatch") is not None:
            self._mismatch_parts.append(out["rollout_mismatch"])
        self.routed[head] += 1
        self.calls.append(RoutedCall(head, str(out["head_version"]), int(a["hidden"].shape[0]), outputs))
        return tuple(out[n] for n in fused_head.FUSED_OUTPUTS)

    def _maybe_answer_with_gradients(self, a: Dict[str, Any]) -> Optional[Tuple[Any, ...]]:
        """A policy call with gradients (``gradients=True``): answered by
        ``head_autograd.ServiceLogProbFunction`` on the version pushed last
        (pushed first when the weights changed), its head's dL/dW added to
        this optimizer step's key on the workers; None for other calls."""
        head = self._head_of(a["weight"])
        if head != self.policy_head:
            return None
        why = self._check(head, a)
        if why:
            self._unsupported(why, stacklevel=4)
            return None
        version = self._current_policy_version()
        step = self.gradient_step_key() if a["weight"].requires_grad else ""
        binding = head_autograd.HeadBinding(self.client, head, version, float(a["temperature"]),
                                            tuple(a["outputs"]), step, on_backward=self._backward_sent)
        out = head_autograd.ServiceLogProbFunction.apply(a["hidden"], a["targets"], binding)
        self.routed[head] += 1
        self.calls.append(RoutedCall(head, version, int(a["hidden"].shape[0]), tuple(a["outputs"])))
        return tuple(out)

    def _current_policy_version(self) -> str:
        """The version a policy call scores with: the one pushed last, pushed
        first when the weights changed since (or nothing was pushed yet)."""
        if self._stale or self.policy_version is None:
            state = getattr(self.trainer, "state", None)
            self.push_policy(int(getattr(state, "global_step", 0) or 0))
        return self.policy_version or ""

    def _backward_sent(self, rows: int) -> None:
        self.backward_calls += 1
        self._grad_step_used = True

    def gradient_step_key(self) -> str:
        """The key of the open optimizer step's head gradients on the
        workers: ``<run>/grad-<n>``, the same on every rank."""
        return "%s/grad-%d" % (self.run, self._grad_step)

    def flush_head_gradients(self) -> bool:
        """Once per optimizer step, before the gradients are clipped: reads
        the step's dL/dW of the policy head from the workers (the sum over
        every micro-batch of every rank), adds it divided by the world size
        (DDP averages the other gradients) to ``lm_head.weight.grad``, and
        closes the step. Under ``torch.distributed`` a collective (barriers
        around the read, so that every rank's backwards are in and no rank
        closes before all read). True when there was a step to fetch."""
        import torch

        world = fused_head.world_size()
        used = self._grad_step_used
        if world > 1:
            flag = torch.tensor([1 if used else 0])
            torch.distributed.all_reduce(flag)
            used = bool(flag.item())
        if not used:
            return False
        key = self.gradient_step_key()
        if world > 1:
            torch.distributed.barrier()
        sums = self.client.read_head_gradients(key, head=self.policy_head)
        if world > 1:
            torch.distributed.barrier()
        fused_head.on_rank0(lambda: self.client.close_gradient_step(key))
        weight = _head_weight(self._policy_model())
        grad = torch.from_numpy(sums.weight).to(device=weight.device, dtype=weight.dtype)
        if world > 1:
            grad /= world
        if weight.grad is None:
            weight.grad = grad
        else:
            weight.grad.add_(grad)
        self._grad_step += 1
        self._grad_step_used = False
        self.gradient_steps += 1
        return True

    def wrap_gradient_steps(self) -> None:
        """Makes the trainer fetch the head's gradients at the start of each
        optimizer step (``flush_head_gradients``): before its
        ``_clip_grad_norm`` and ``_get_grad_norm`` (transformers' Trainer
        calls them, in that order, before the optimizer's step), and at
        ``on_pre_optimizer_step`` (the callback) when neither ran."""
        adapter = self
        for name in ("_clip_grad_norm", "_get_grad_norm"):
            original = getattr(self.trainer, name, None)
            if not callable(original):
                continue

            def wrapped(*args: Any, _original: Any = original, **kwargs: Any) -> Any:
                adapter.flush_head_gradients()
                return _original(*args, **kwargs)

            setattr(self.trainer, name, wrapped)
            self._grad_wrapped.append(name)

    def _check(self, head: str, a: Dict[str, Any]) -> str:
        """Why the service cannot answer this call ("" when it can)."""
        if a["bias"] is not None and head == self.policy_head:
            return ("the policy's lm_head has a bias, which changes with training and which an lm_head update "
                    "does not carry")
        if head not in self._transforms:
            self._refresh_transforms(head)
        mismatch = self._transforms[head].mismatch(a["bias"] is not None, a["logit_scale"],
                                                   a["final_logit_softcapping"])
        if mismatch:
            return "head %r: %s" % (head, mismatch)
        lacking = fused_head.missing_outputs(tuple(a["outputs"]))
        if lacking:
            return ("outputs %s need ScoreOptions fields this client does not have yet (the 'outputs' change of "
                    "issue 30)" % (list(lacking),))
        return ""

    # -- rollout mismatch ---------------------------------------------------

    def _compares(self) -> bool:
        """Whether the trainer runs with vLLM importance sampling (the same
        on every rank): its generations' old-policy calls carry vLLM's
        logprobs, and their figures go to TRL's metrics."""
        t = self.trainer
        return bool(getattr(t, "use_vllm", False) and getattr(t, "vllm_importance_sampling_correction", False))

    def wrap_generation(self) -> None:
        """Wraps the trainer's ``_generate_and_score_completions`` (when it
        has one) so that each generation's figures reach TRL's metrics
        (``report_mismatch``)."""
        found = getattr(self.trainer, _GENERATE_AND_SCORE, None)
        if not callable(found) or self._generate_wrapped:
            return
        original: Callable[..., Any] = found
        adapter = self

        def generate_and_score(*args: Any, **kwargs: Any) -> Any:
            adapter._mismatch_parts = []
            out = original(*args, **kwargs)
            if adapter._compares():
                adapter.report_mismatch()
            return out

        setattr(self.trainer, _GENERATE_AND_SCORE, generate_and_score)
        self._generate_wrapped = True

    def report_mismatch(self) -> Dict[str, float]:
        """Joins this generation's figures (its calls', then every rank's:
        a collective under ``torch.distributed``, made by every rank at the
        same point, like TRL's own gathers), token-weighted (the service's
        definition), keeps them in ``mismatch`` and appends each to TRL's
        metrics (``trainer._metrics[mode]``) as ``MISMATCH_METRICS`` +
        name. NaN figures when no token was compared."""
        parts = list(self._mismatch_parts)
        self._mismatch_parts = []
        if fused_head.world_size() > 1:
            from accelerate.utils import gather_object

            parts = list(gather_object(parts))
        figures = join_rollout_mismatch([SimpleNamespace(**p) for p in parts])
        self.mismatch = figures
        metrics = getattr(self.trainer, "_metrics", None)
        if metrics is not None:
            model = getattr(self.trainer, "model", None)
            mode = "train" if model is None or model.training else "eval"
            for name in _MISMATCH_FIGURES:
                metrics[mode][MISMATCH_METRICS + name].append(float(figures[name]))
        return figures

    def remove(self) -> None:
        """Takes this adapter out of TRL and its callback out of the
        trainer; TRL's own function answers every call again once no
        adapter is left."""
        _uninstall(self)
        for name in self._grad_wrapped:
            self.trainer.__dict__.pop(name, None)
        self._grad_wrapped = []
        if self._generate_wrapped:
            self.trainer.__dict__.pop(_GENERATE_AND_SCORE, None)
            self._generate_wrapped = False
        if self.callback is not None:
            try:
                self.trainer.remove_callback(self.callback)
            except (AttributeError, ValueError):
                pass


def policy_calls(trainer: Any) -> Tuple[bool, str]:
    """Whether ``trainer`` (as configured) makes no-gradient calls of the
    policy's lm_head, and why, from TRL 1.16's rules: GRPO / RLOO compute
    old-policy logprobs when ``gradient_accumulation_steps`` is not a
    multiple of ``steps_per_generation * num_iterations`` (e.g.
    ``num_iterations > 1``) or with vLLM importance sampling; with
    ``beta != 0`` and no reference model (PEFT) the reference pass runs
    through the policy's lm_head. Another trainer: assumed yes."""
    args = getattr(trainer, "args", None)
    if not hasattr(args, "num_iterations"):
        return True, "%s: assumed" % type(trainer).__name__
    reasons = []
    iterations = int(getattr(args, "num_iterations", 1) or 1)
    per_generation = int(getattr(args, "steps_per_generation", None) or 1)
    accumulation = int(getattr(args, "gradient_accumulation_steps", 1) or 1)
    if accumulation % (per_generation * iterations) != 0:
        reasons.append("old-policy logprobs: num_iterations=%d, steps_per_generation=%d, "
                       "gradient_accumulation_steps=%d" % (iterations, per_generation, accumulation))
    if getattr(args, "use_vllm", False) and getattr(args, "vllm_importance_sampling_correction", False):
        reasons.append("vLLM importance sampling")
    if float(getattr(args, "beta", 0.0) or 0.0) != 0.0 and getattr(trainer, "ref_model", None) is None:
        reasons.append("reference logprobs through the policy's lm_head (no reference model: PEFT)")
    if reasons:
        return True, "; ".join(reasons)
    return False, "num_iterations=%d%s" % (iterations, ", no vLLM importance sampling"
                                           if getattr(args, "use_vllm", False) else "")


def _make_callback(adapter: ServiceLogProbs) -> Any:
    from transformers import TrainerCallback

    class PolicyWeightsChanged(TrainerCallback):  # type: ignore[misc]
        """Marks the policy version pushed last stale at train begin and
        after every optimizer step, so that the next no-gradient policy
        call pushes the new weights first (logprob_client.trl)."""

        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            adapter.weights_changed()

        def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if adapter.gradients:
                adapter.flush_head_gradients()

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            adapter.weights_changed()

    return PolicyWeightsChanged()


def _prepare_gradients(adapter: ServiceLogProbs) -> None:
    """Checks that ``gradients=True`` fits the trainer's setup and tells
    DDP to leave the policy head's weight alone when nothing else uses it
    (its gradient comes from the service, already summed over the ranks):
    ``DistributedDataParallel._set_params_and_buffers_to_ignore_for_model``
    before accelerate wraps the model. A weight tied to the input embedding
    keeps DDP's all-reduce of its embedding gradient; the head's part is
    added after it. Raises ValueError for sharded heads (FSDP, DeepSpeed
    ZeRO-3: not supported yet) and for a model already wrapped by DDP."""
    model = adapter._policy_model()
    weight = _head_weight(model)
    if fused_head.is_dtensor(weight) or fused_head.is_zero3(weight):
        raise ValueError("use_service(gradients=True) does not support a sharded lm_head (FSDP, DeepSpeed "
                         "ZeRO-3) yet: its gradient would have to be scattered to the shards")
    if fused_head.world_size() <= 1:
        return
    import torch

    wrapped = getattr(adapter.trainer, "model_wrapped", None)
    if isinstance(wrapped, torch.nn.parallel.DistributedDataParallel):
        raise ValueError("use_service(gradients=True) must be called before the trainer wraps the model in DDP "
                         "(before train())")
    embed = model.get_input_embeddings()
    if embed is not None and embed.weight is weight:
        return  # tied: DDP reduces the embedding's part, the service's is added after
    names = [n for n, p in model.named_parameters() if p is weight]
    torch.nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, names)


def use_service(trainer: Any, client: Any, policy_head: str = "policy", reference_head: str = "reference", *,
                on_unsupported: str = "raise", version_format: str = fused_head.DEFAULT_VERSION_FORMAT,
                run: Optional[str] = None, rollout_band: Tuple[float, float] = (0.9, 1.1),
                gradients: bool = False) -> ServiceLogProbs:
    """Routes ``trainer``'s fused-lm_head calls made without gradients to
    the logprob service behind ``client`` (a synchronous
    ``logprob_client.LogprobClient``) and keeps the server's heads in step
    with the trainer (module docstring).

    ``trainer``: a TRL trainer whose models use ``add_fused_lm_head``
    (``GRPOTrainer``, ``RLOOTrainer``, ...), made but not yet trained;
    ``policy_head`` / ``reference_head``: the server's heads for the
    trained model (``trainer.model``) and the reference model
    (``trainer.ref_model``, when there is one), each of the model's
    ``lm_head`` shape ``[V, H]``; ``on_unsupported``: ``"raise"`` or
    ``"fallback"`` (module docstring); ``version_format``: the policy's
    version names, ``str.format``ted with ``run`` and ``step`` (the
    trainer's ``global_step``; keep ``{run}`` when a server outlives runs);
    ``run``: the run id (default: made here, rank 0's when
    ``torch.distributed`` is initialized, see ``fused_head.run_id``);
    ``rollout_band``: the band of the ``outside_band_fraction`` figure
    reported with vLLM importance sampling (module docstring);
    ``gradients``: route the policy's calls with gradients to the service
    too (docs/gradients.md): their forward and dL/dh come from the workers
    (``head_autograd.ServiceLogProbFunction``), and the head's dL/dW,
    summed on the workers over the optimizer step's micro-batches (and
    ranks), is added to ``lm_head.weight.grad`` before the gradients are
    clipped (``ServiceLogProbs.flush_head_gradients``). What stays in TRL:
    the model's body, the loss, the optimizer; calls of a head with a bias
    (refused or left to TRL per ``on_unsupported``); sharded heads
    (ValueError).

    Pushes the reference head now when needed; the policy's before the
    first no-gradient policy call after each optimizer step (never when
    no call scores it). Under ``torch.distributed`` call it on every rank
    at the same point: it and the policy's pushes are collectives of the
    default group (module docstring). Logs one line saying so (logger
    ``logprob_client.trl``, INFO). Returns the ``ServiceLogProbs`` adapter
    (counters, ``remove()``).
    Raises RuntimeError for an unsupported TRL, ValueError for a setup it
    does not support, InvalidInputError for heads the server lacks or of
    another shape, LogprobError when the server cannot be reached.
    """
    check_trl_version()
    fused_head.require_sync_client(client)
    args = getattr(trainer, "args", None)
    if getattr(args, "sync_ref_model", False):
        raise ValueError("use_service does not support sync_ref_model=True: the reference head on the server "
                         "would not follow the reference model")
    adapter = ServiceLogProbs(trainer, client, policy_head, reference_head, on_unsupported, version_format, run,
                              rollout_band, gradients)
    if gradients:
        _prepare_gradients(adapter)
    # The heads exist and have the models' shapes: fail now, not at step 1.
    fused_head.check_shape(fused_head.head_info(client, policy_head, refresh=True),
                           _head_weight(adapter._policy_model()))
    adapter._refresh_transforms(policy_head)
    adapter.setup_reference()
    adapter.callback = _make_callback(adapter)
    trainer.add_callback(adapter.callback)
    adapter.wrap_generation()
    if gradients:
        adapter.wrap_gradient_steps()
    _install(adapter)
    logger.info("%s", adapter.describe())
    return adapter
