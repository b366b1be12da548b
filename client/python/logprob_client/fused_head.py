"""The service's answer to a trainer's fused ``lm_head`` call: the per-token
outputs of ``hidden [N, H] @ weight[V, H]^T`` at ``targets [N]``, computed by
a server holding that weight as a named head (``--lm-head NAME=...``), and
the bookkeeping around it: a head's logit transforms, pushing a trainer's
weight as a head version (``PolicyPushes``: the version names, with a run
id shared by a job's ranks, and the version the policy's calls are pinned
to), and checking that a head holds given weights.

Under ``torch.distributed`` (several training processes) a push is a
collective of the default group: a whole weight (DDP replicas; a DeepSpeed
ZeRO-3 parameter, gathered with ``deepspeed.zero.GatheredParameters``) is
pushed by rank 0 alone, a ``Shard(0)`` DTensor (FSDP2) by every rank, each
its own rows (``tensor_parallel.push_lm_head_shard``, nothing gathered),
and every rank gets the committed version (or the same error) from rank 0
by a broadcast, so that all score on one version (``push_weight``).

Shared by the framework adapters (``logprob_client.trl``,
``logprob_client.verl``), whose adapters subclass ``ServiceAdapter``; it
needs torch (imported when called).

The math is the server's (docs/SPEC.md, hidden-states scoring): logits
``z = softcap(logit_scale * (h W^T + b))``, ``x = z / temperature``, all in
float32 from an f32-accumulated GEMM, within ``2e-4 + 2e-5 |x|`` of
float64; per token ``log_probs = x_t - logsumexp(x)``, ``entropy``,
``log_sum_sq_probs = log sum_v p_v^2``, ``mean_logits = mean_v x_v`` and
``is_top1`` (target is the argmax, lowest id first among equal maxima).
"""

import collections
import contextlib
import math
import re
import secrets
import threading
import warnings
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Set, Tuple

import grpc
import numpy as np

from ._internal import ranks
from ._internal._proto import pb2
from ._internal.base import check_lm_head_names
from .errors import InvalidInputError, LogprobError
from .lm_head_update import weight_sha256
from .tensor_parallel import push_lm_head_shard

__all__ = ["FUSED_OUTPUTS", "NEW_OUTPUTS", "SEGMENT_TOKENS", "UnsupportedCall", "HeadMismatchError", "HeadTransforms",
           "missing_outputs", "require_sync_client", "head_info", "head_torch_dtype", "head_rows", "weight_sha256",
           "check_shape", "push_head", "ensure_head", "score_rows", "backward_rows", "run_id", "PolicyPushes",
           "DEFAULT_VERSION_FORMAT", "weight_shape", "world_size", "on_rank0", "is_dtensor", "is_zero3", "whole_weight",
           "push_weight", "ServiceAdapter", "same_tensor", "release"]

# Per-token outputs of a fused-head call, in the order the frameworks
# return them (TRL's ChunkedLogProbFunction; verl uses the first two).
FUSED_OUTPUTS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")

# The service's output name of each fused output.
_SERVICE_NAMES = {
    "log_probs": "token_logprobs",
    "entropy": "entropy",
    "log_sum_sq_probs": "log_sum_sq_probs",
    "mean_logits": "mean_logits",
    "is_top1": "is_top1",
}

# Outputs that need a ScoreOptions field newer than the first release (the
# "outputs" change of issue 30): requested only when asked for.
NEW_OUTPUTS = ("log_sum_sq_probs", "mean_logits", "is_top1")

# Tokens per packed sequence of a call: rows of a fused call are
# independent (same_position alignment), so they go as sequences of at most
# this many tokens, which the client may split between requests when a call
# is over the server's limits.
SEGMENT_TOKENS = 1024


class UnsupportedCall(Exception):
    """A fused-head call the service cannot answer exactly as the framework
    would: a logit transform the head does not have, an output this
    client or server lacks. The adapters raise it (as ``ValueError``
    subclass ``HeadMismatchError``) or fall back to the framework's kernel."""


class HeadMismatchError(ValueError):
    """Raised by an adapter in mode ``on_unsupported="raise"`` for a call the
    service cannot answer as the framework would (see ``UnsupportedCall``)."""


def missing_outputs(requested: Sequence[str]) -> Tuple[str, ...]:
    """The requested outputs among ``NEW_OUTPUTS`` that this client's stubs
    cannot request (``logprob.v1.ScoreOptions`` lacks the field, or
    ``score`` lacks the keyword)."""
    from ._internal.request import score_keywords

    fields = {f.name for f in pb2.ScoreOptions.DESCRIPTOR.fields}
    keywords = score_keywords()
    return tuple(n for n in requested if n in NEW_OUTPUTS and (n not in fields or n not in keywords))


class HeadTransforms:
    """A head's logit transforms as ``GetServerInfo`` reports them
    (``LmHeadInfo.has_bias``, ``logit_scale``, ``final_logit_softcapping``).
    A server (or stubs) without those fields reports none: no bias, scale
    1, no softcap; a ``logit_scale`` of 0 means 1 (proto3's unset)."""

    def __init__(self, has_bias: bool = False, logit_scale: float = 1.0, softcap: Optional[float] = None) -> None:
        self.has_bias = bool(has_bias)
        self.logit_scale = float(logit_scale)
        self.softcap = None if not softcap else float(softcap)

    @classmethod
    def of_info(cls, info: Any) -> "HeadTransforms":
        """The transforms of an ``LmHeadInfo`` message."""
        scale = float(getattr(info, "logit_scale", 0.0) or 0.0)
        return cls(bool(getattr(info, "has_bias", False)), scale if scale != 0.0 else 1.0,
                    float(getattr(info, "final_logit_softcapping", 0.0) or 0.0))

    def mismatch(self, has_bias: bool, logit_scale: Optional[float], softcap: Optional[float]) -> str:
        """Empty when a call with these transforms (``logit_scale`` None =
        1, ``softcap`` None or 0 = none) is what this head computes; else
        a sentence saying what differs."""
        scale = 1.0 if logit_scale is None else float(logit_scale)
        cap = None if not softcap else float(softcap)
        diffs = []
        if bool(has_bias) != self.has_bias:
            diffs.append("the call %s a bias, the head %s" % ("has" if has_bias else "has no",
                                                                "has one" if self.has_bias else "has none"))
        if not math.isclose(scale, self.logit_scale, rel_tol=1e-6, abs_tol=0.0):
            diffs.append("logit_scale %r, the head's %r" % (scale, self.logit_scale))
        if (cap is None) != (self.softcap is None) or (
                cap is not None and self.softcap is not None and not math.isclose(cap, self.softcap, rel_tol=1e-6)):
            diffs.append("final_logit_softcapping %r, the head's %r" % (cap, self.softcap))
        return "; ".join(diffs)

    def __repr__(self) -> str:
        return "HeadTransforms(has_bias=%r, logit_scale=%r, softcap=%r)" % (self.has_bias, self.logit_scale,
                                                                            self.softcap)


def require_sync_client(client: Any) -> None:
    """Raises TypeError unless ``client`` is a synchronous client
    (``logprob_client.LogprobClient``): the frameworks call their fused
    head synchronously, inside their forward."""
    import inspect

    if inspect.iscoroutinefunction(getattr(client, "score", None)):
        raise TypeError("the framework adapters need a synchronous logprob_client.LogprobClient (TRL and verl call "
                        "the fused lm_head synchronously inside the model's forward), not the asyncio client")


def head_info(client: Any, head: str, refresh: bool = False) -> Any:
    """The ``LmHeadInfo`` of ``head`` on the client's server. Raises
    InvalidInputError naming the heads it has when it has no such head."""
    info = client.server_info(refresh=refresh)
    for h in info.lm_heads:
        if h.name == head:
            return h
    names = [h.name for h in info.lm_heads] or ["none: start it with --lm-head NAME=PATH"]
    raise InvalidInputError("the server has no lm_head %r (it has: %s)" % (head, ", ".join(names)))


_TORCH_DTYPE_NAMES = {pb2.F32: "float32", pb2.BF16: "bfloat16", pb2.F16: "float16"}


def head_torch_dtype(info: Any) -> Any:
    """The torch dtype of a head (``LmHeadInfo.dtype``)."""
    import torch

    name = _TORCH_DTYPE_NAMES.get(int(info.dtype))
    if name is None:
        raise InvalidInputError("lm_head %r has dtype %d, not a float dtype" % (info.name, int(info.dtype)))
    return getattr(torch, name)


def head_rows(info: Any, weight: Any) -> Any:
    """``weight`` ([V, H] torch tensor, any device) converted on its device
    to the head's dtype (``info``: its ``LmHeadInfo``), contiguous, without
    gradients: the rows a push sends and its ``weight_sha256`` hashes.
    Raises InvalidInputError for a weight of another shape."""
    import torch

    check_shape(info, weight)
    with torch.no_grad():
        return weight.detach().to(dtype=head_torch_dtype(info)).contiguous()


def weight_shape(weight: Any) -> Tuple[int, int]:
    """``(V, H)`` of a weight: its shape, a DTensor's global one, a
    DeepSpeed ZeRO-3 parameter's ``ds_shape`` (its ``shape`` is empty while
    partitioned)."""
    shape = weight.ds_shape if is_zero3(weight) else weight.shape
    return int(shape[0]), int(shape[1])


def check_shape(info: Any, weight: Any) -> None:
    """Raises InvalidInputError when ``weight`` [V, H] is not of the head's
    shape (``info.vocab_size``, ``info.hidden_size``)."""
    V, H = weight_shape(weight)
    if (V, H) != (int(info.vocab_size), int(info.hidden_size)):
        raise InvalidInputError("lm_head %r on the server is [%d, %d], the model's is [%d, %d]"
                                % (info.name, int(info.vocab_size), int(info.hidden_size), V, H))


def push_head(client: Any, head: str, weight: Any, version: str, sha256: Optional[str] = None) -> str:
    """Pushes ``weight`` ([V, H] torch tensor, CPU or CUDA) as version
    ``version`` of ``head`` and returns the committed version
    (``LogprobClient.update_lm_head``: by CUDA IPC for a CUDA tensor where
    the server offers it on this host, else through shared memory on the
    server's host, else in pieces). The weight is converted to the head's
    dtype on its device first, and always sent with its sha256 (computed
    here unless given), so that a push of bytes the server already holds
    under that name is a no-op without upload (``already_committed``),
    and several ranks pushing the same (head, version, weight) at once
    upload it once (the server has the later ones wait for the first).
    Raises LogprobError (ALREADY_EXISTS: the name holds other bytes) /
    InvalidInputError."""
    info = head_info(client, head)
    rows = head_rows(info, weight)
    digest = sha256 or weight_sha256(rows)
    return str(client.update_lm_head(head, rows, version=version, sha256=digest))


def world_size() -> int:
    """Processes of the default ``torch.distributed`` group; 1 when it is
    not initialized (or torch is not installed)."""
    try:
        import torch.distributed as dist
    except ImportError:
        return 1
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return int(dist.get_world_size())


def on_rank0(fn: Callable[[], Any]) -> Any:
    """``fn()`` run by rank 0 of the default group alone, its value (or
    its LogprobError, InvalidInputError, ValueError: raised as
    LogprobError with the same code and message) given to every rank by a
    broadcast: a collective, every rank must call it. Just ``fn()`` in a
    single process."""
    if world_size() == 1:
        return fn()
    import torch.distributed as dist

    box: List[Any] = [ranks.attempt(fn) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return ranks.value(box[0])


def is_dtensor(weight: Any) -> bool:
    """Whether ``weight`` is a ``torch.distributed.tensor.DTensor`` (FSDP2)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return False
    return isinstance(weight, DTensor)


def is_zero3(weight: Any) -> bool:
    """Whether ``weight`` is a DeepSpeed ZeRO-3 parameter (it has
    ``ds_id`` and ``ds_status``)."""
    return hasattr(weight, "ds_id") and hasattr(weight, "ds_status")


@contextlib.contextmanager
def whole_weight(weight: Any) -> Iterator[Any]:
    """``weight`` itself, or for a DeepSpeed ZeRO-3 parameter that is not
    gathered (``ds_status`` other than AVAILABLE) the parameter gathered
    for the block (``deepspeed.zero.GatheredParameters``, a collective:
    every rank enters it). Raises RuntimeError for such a parameter when
    deepspeed cannot be imported."""
    if not is_zero3(weight) or getattr(weight.ds_status, "name", str(weight.ds_status)) == "AVAILABLE":
        yield weight
        return
    try:
        import deepspeed
    except ImportError as e:
        raise RuntimeError("the lm_head weight is a DeepSpeed ZeRO-3 parameter (ds_id %r, ds_status %s) and "
                           "deepspeed cannot be imported here to gather it (%s): push its whole [V, H] weight "
                           "yourself (gathered with deepspeed.zero.GatheredParameters)"
                           % (weight.ds_id, weight.ds_status, e)) from None
    with deepspeed.zero.GatheredParameters([weight], modifier_rank=None):
        yield weight


def _shard0(weight: Any) -> bool:
    """A DTensor split by rows over a 1-D mesh (FSDP2's ``Shard(0)``)."""
    from torch.distributed.tensor import Shard

    return weight.device_mesh.ndim == 1 and tuple(weight.placements) == (Shard(0),)


def push_weight(client: Any, head: str, weight: Any, version: str) -> str:
    """Pushes ``weight`` as ``version`` of ``head`` from a job of one or
    several processes, and returns the committed version on every rank
    (the module docstring): a ``Shard(0)`` DTensor on a 1-D mesh is sent
    by every rank of the mesh, its local rows at their offset (no sha256:
    that would need the whole weight; the server computes it at commit),
    another DTensor is gathered (``full_tensor``), a ZeRO-3 parameter is
    gathered while pushed (``whole_weight``), and a whole weight is
    pushed by rank 0 (``push_head``, with its sha256). A collective under
    ``torch.distributed``: every rank calls it with its weight. Raises
    LogprobError / InvalidInputError on every rank."""
    if is_dtensor(weight):
        if not _shard0(weight):
            return _push_on_rank0(client, head, weight.full_tensor(), version)
        import torch.distributed as dist
        import torch

        info = head_info(client, head)
        check_shape(info, weight)
        mesh = weight.device_mesh
        group = mesh.get_group()
        rows = int(weight.shape[0])
        chunk = -(-rows // mesh.size())  # torch.chunk's split, as FSDP2 shards
        with torch.no_grad():
            local = weight.to_local().detach().to(dtype=head_torch_dtype(info)).contiguous()
        return push_lm_head_shard(client, local, min(mesh.get_local_rank() * chunk, rows), rows, version, head,
                                  group=group, src=dist.get_global_rank(group, 0))
    with whole_weight(weight) as whole:
        return _push_on_rank0(client, head, whole, version)


def _push_on_rank0(client: Any, head: str, weight: Any, version: str) -> str:
    return str(on_rank0(lambda: push_head(client, head, weight, version)))


def ensure_head(client: Any, head: str, weight: Any, version: Optional[str] = None) -> str:
    """Makes ``head`` hold ``weight`` and returns the version that does:
    the head's current version when it already holds these bytes (the
    sha256 of ``weight`` in the head's dtype), else ``push_head`` as
    ``version`` (default ``"ref-"`` and the first 16 hex digits of the
    sha256). A frozen reference model's head is loaded once this way.
    Under ``torch.distributed`` a collective: the weight is made whole (a
    DTensor's ``full_tensor``, ``whole_weight``) and rank 0 checks and
    pushes it (``on_rank0``)."""
    def ensure(whole: Any) -> str:
        info = head_info(client, head, refresh=True)
        digest = weight_sha256(head_rows(info, whole))
        if info.sha256 == digest:
            return str(info.version)
        return push_head(client, head, whole, version or "ref-" + digest[:16], sha256=digest)

    if is_dtensor(weight):
        weight = weight.full_tensor()
    with whole_weight(weight) as whole:
        return str(on_rank0(lambda: ensure(whole)))


# The adapters' policy version names: a run id (``run_id``) and the
# trainer's step, so that a server outliving a run never sees a name of an
# earlier run with other weights.
DEFAULT_VERSION_FORMAT = "{run}-step-{step}"

_RUN_RE = re.compile(r"[A-Za-z0-9._:+-]{1,64}")


def run_id(run: Optional[str] = None) -> str:
    """The run id of an adapter's version names: ``run`` when given
    (1..64 characters of ``[A-Za-z0-9._:+-]``), else 8 random hex
    digits made here, which every rank of the job gets when
    ``torch.distributed`` is initialized: rank 0's id is broadcast
    (``broadcast_object_list``, a collective of the default group: every
    rank must make its adapter at the same point, or pass ``run``).
    Raises ValueError for a malformed ``run``."""
    if run is not None:
        if not isinstance(run, str) or not _RUN_RE.fullmatch(run):
            raise ValueError("run %r: a run id is 1..64 characters of [A-Za-z0-9._:+-]" % (run,))
        return run
    made = secrets.token_hex(4)
    try:
        import torch.distributed as dist
    except ImportError:
        return made
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        box = [made]
        dist.broadcast_object_list(box, src=0)
        made = str(box[0])
    return made


class PolicyPushes:
    """The pushes of a trained model's head, as the adapters make them:
    version names ``version_format.format(run=run, step=step)``
    (``run``: ``run_id``; a format without ``{run}`` works, but a server
    that outlives the run then refuses another run's weights under its
    names), the version the policy's calls are pinned to (``version``,
    None before the first push; ``step``: its step), and ``count`` (pushes
    made). Thread-safe."""

    def __init__(self, client: Any, head: str, version_format: str = DEFAULT_VERSION_FORMAT,
                 run: Optional[str] = None) -> None:
        self.client = client
        self.head = head
        self.version_format = version_format
        try:
            example = version_format.format(run="r", step=0)
        except (KeyError, IndexError, ValueError, AttributeError) as e:
            raise ValueError("version_format %r: a str.format pattern with {step} (and {run}), e.g. %r: %s"
                             % (version_format, DEFAULT_VERSION_FORMAT, e)) from None
        if "{step" not in version_format:
            raise ValueError("version_format %r has no {step}: every push would reuse one name"
                             % (version_format,))
        check_lm_head_names(head, example)
        self.run = run_id(run)
        self.version: Optional[str] = None
        self.step: Optional[int] = None
        self.count = 0
        self._lock = threading.Lock()

    def name(self, step: int) -> str:
        """The version name of ``step``."""
        return self.version_format.format(run=self.run, step=int(step))

    def push(self, weight: Any, step: int) -> str:
        """Pushes ``weight`` as ``name(step)`` (``push_weight``: a
        collective under ``torch.distributed``; a whole weight with its
        sha256, so a repeat is a no-op) and pins the policy's calls to it;
        returns the version. Raises LogprobError (ALREADY_EXISTS with what
        to do when the name holds other weights)."""
        version = self.name(step)
        try:
            committed = push_weight(self.client, self.head, weight, version)
        except LogprobError as e:
            if e.code == grpc.StatusCode.ALREADY_EXISTS:
                raise LogprobError(e.code, "%s (the server holds %s version %r with other weights, e.g. from an "
                                   "earlier run: keep {run} in version_format, as the default %r does)"
                                   % (e.message, self.head, version, DEFAULT_VERSION_FORMAT),
                                   attempts=e.attempts, reason=e.reason) from e
            raise
        with self._lock:
            self.version, self.step = committed, int(step)
            self.count += 1
        return committed


def score_rows(client: Any, hidden: Any, targets: Any, *, head: str, head_version: str = "",
               temperature: float = 1.0, outputs: Sequence[str] = ("log_probs",),
               rollout_logprobs: Any = None, rollout_band: Optional[Tuple[float, float]] = None) -> Dict[str, Any]:
    """Scores the rows of a fused-head call on the service.

    ``hidden``: [N, H] torch tensor (f32, bf16 or f16; any device); row n
    is scored at ``targets[n]`` ([N] integer tensor, ids in [0, V)), each
    row on its own (same_position alignment: the rows go packed as
    sequences of at most ``SEGMENT_TOKENS``). ``head`` / ``head_version``:
    the server's head and the version to pin ("" for its current one).
    ``outputs``: among ``FUSED_OUTPUTS`` (``log_probs`` always computed).

    Returns ``{name: tensor}`` for every name of ``FUSED_OUTPUTS`` (None
    when not requested), each [N] on ``hidden``'s device: float32, and
    ``is_top1`` bool; plus ``"head_version"``: the version that scored the
    call. ``rollout_logprobs``: the rollout engine's logprob of each row
    ([N] float32 tensor, NaN where it has none), compared by the service
    (docs/SPEC.md "Rollout mismatch", band ``rollout_band``, default
    [0.9, 1.1]); ``"rollout_mismatch"`` is then the request's figures
    (``ScoreResult.rollout_mismatch``), else None. Raises UnsupportedCall
    for an output this client or the server lacks, LogprobError for a
    failed call."""
    import torch

    want = [n for n in outputs if n in FUSED_OUTPUTS and n != "log_probs"]
    unknown = [n for n in outputs if n not in FUSED_OUTPUTS]
    if unknown:
        raise UnsupportedCall("outputs %s are not among %s" % (unknown, FUSED_OUTPUTS))
    lacking = missing_outputs(want)
    if lacking:
        raise UnsupportedCall(
            "outputs %s need logprob.v1.ScoreOptions fields this client does not have yet (the 'outputs' change "
            "of issue 30: ScoreOptions.log_sum_sq_probs / mean_logits / is_top1); update the client and server"
            % (list(lacking),))
    N = int(hidden.shape[0])
    device = hidden.device
    result: Dict[str, Any] = {n: None for n in FUSED_OUTPUTS}
    if N == 0:
        for n in ["log_probs"] + want:
            result[n] = torch.zeros(0, dtype=torch.bool if n == "is_top1" else torch.float32, device=device)
        result["head_version"] = head_version
        result["rollout_mismatch"] = None
        return result
    ids, cu = _packed_rows(targets)
    options: Dict[str, Any] = {n: True for n in want}
    if temperature is not None and float(temperature) != 1.0:
        options["temperature"] = float(temperature)
    if rollout_logprobs is not None:
        options["rollout_logprobs"] = rollout_logprobs.detach().reshape(-1).float().cpu()
        if rollout_band is not None:
            options["rollout_band"] = rollout_band
    res = client.score(hidden_states=hidden.detach(), input_ids=ids, cu_seqlens=cu, alignment="same_position",
                       head=head, head_version=head_version, **options)
    for n in ["log_probs"] + want:
        got = res.outputs.get(_SERVICE_NAMES[n])
        if got is None:
            raise UnsupportedCall("the server did not return %r (a server older than this client: update it)"
                                  % (_SERVICE_NAMES[n],))
        if n == "is_top1":
            got = got != 0
        elif got.dtype != torch.float32:
            got = got.float()
        result[n] = got.to(device)
    result["head_version"] = res.head_version
    result["rollout_mismatch"] = res.rollout_mismatch
    return result


def _packed_rows(targets: Any) -> Tuple[Any, Any]:
    """The ids (host [N] tensor) and ``cu_seqlens`` of a fused call's rows:
    each row on its own (same_position), packed as sequences of at most
    ``SEGMENT_TOKENS`` that the client may split between requests."""
    N = int(targets.reshape(-1).shape[0])
    seg = np.arange(0, N, SEGMENT_TOKENS, dtype=np.int64)
    cu = np.concatenate([seg, [N]]).astype(np.int64)
    ids = targets.detach().reshape(-1)
    if ids.device.type != "cpu":
        ids = ids.cpu()
    return ids, cu


def backward_rows(client: Any, hidden: Any, targets: Any, grad_logprobs: Any, grad_entropy: Any = None, *,
                  head: str, head_version: str, temperature: float = 1.0, gradient_step: str = "",
                  ignore_index: int = -100) -> Any:
    """The service's backward of a fused-head call (docs/gradients.md):
    dL/dh [N, H] (float32 on ``hidden``'s device) of rows ``hidden`` [N, H]
    scored at ``targets`` [N] by ``head`` version ``head_version`` (pin the
    forward's), from the upstream ``grad_logprobs`` and ``grad_entropy``
    ([N] tensors or None: 0). With ``gradient_step`` the workers also add
    dL/dW and dL/db to that step. Rows whose target is ``ignore_index``
    have no logprob term. Raises LogprobError for a failed call."""
    import torch

    N, H = int(hidden.shape[0]), int(hidden.shape[1])
    if N == 0:
        return torch.zeros((0, H), dtype=torch.float32, device=hidden.device)
    ids, cu = _packed_rows(targets)
    g_lp = (grad_logprobs.detach().reshape(-1).float().cpu() if grad_logprobs is not None
            else torch.zeros(N, dtype=torch.float32))
    g_ent = grad_entropy.detach().reshape(-1).float().cpu() if grad_entropy is not None else None
    options: Dict[str, Any] = {"ignore_index": int(ignore_index)}
    if temperature is not None and float(temperature) != 1.0:
        options["temperature"] = float(temperature)
    res = client.backward(hidden.detach(), ids, g_lp, grad_entropy=g_ent, cu_seqlens=cu, alignment="same_position",
                          head=head, head_version=head_version, gradient_step=gradient_step, **options)
    got = res.grad_hidden_states
    if got is None:
        raise UnsupportedCall("the server did not return grad_hidden_states (a server older than this client)")
    return got.float().to(hidden.device)


def same_tensor(a: Any, b: Any) -> bool:
    """Whether tensors ``a`` and ``b`` are one tensor: the same object, or
    views of the same memory with the same device, dtype, shape and
    strides."""
    if a is b:
        return True
    try:
        return bool(a.device == b.device and a.dtype == b.dtype and tuple(a.shape) == tuple(b.shape)
                    and a.data_ptr() == b.data_ptr() and a.stride() == b.stride())
    except (AttributeError, RuntimeError):
        return False


def release(version: str) -> Tuple[int, ...]:
    """The leading numbers (at most 3) of a version string:
    ``"1.16.0.dev0+g1"`` -> ``(1, 16, 0)``."""
    parts: List[int] = []
    for p in version.split("+")[0].split("."):
        digits = ""
        for ch in p:
            if not ch.isdigit():
                break
            digits += ch
        if not digits:
            break
        parts.append(int(digits))
        if len(parts) == 3:
            break
    return tuple(parts)


class ServiceAdapter:
    """What the framework adapters (``logprob_client.trl``, ``.verl``)
    share: the client, the policy's pushes (``policy``: ``PolicyPushes``),
    the heads' transforms, the counters (``routed`` by head, ``fallbacks``,
    ``calls``: the last 10000) and the ``on_unsupported`` handling
    (``"raise"``: ``HeadMismatchError``; ``"fallback"``: a one-time
    warning, and the call goes to the framework's kernel). A subclass sets
    ``RAISE_FORMAT`` and ``WARN_FORMAT`` (``%s``: why)."""

    RAISE_FORMAT = "%s"
    WARN_FORMAT = "%s"

    def __init__(self, client: Any, policy_head: str, on_unsupported: str,
                 version_format: str = DEFAULT_VERSION_FORMAT, run: Optional[str] = None) -> None:
        if on_unsupported not in ("raise", "fallback"):
            raise ValueError("on_unsupported must be 'raise' or 'fallback', got %r" % (on_unsupported,))
        self.client = client
        self.policy_head = policy_head
        self.on_unsupported = on_unsupported
        self.policy = PolicyPushes(client, policy_head, version_format, run)
        self.calls: Any = collections.deque(maxlen=10000)
        self.routed: Dict[str, int] = collections.Counter()
        self.fallbacks = 0
        self._warned: Set[str] = set()
        self._transforms: Dict[str, HeadTransforms] = {}

    @property
    def policy_version(self) -> Optional[str]:
        """The policy version pushed last (None before the first push)."""
        return self.policy.version

    @property
    def version_format(self) -> str:
        """The policy's version names, ``str.format``ted with ``run`` and ``step``."""
        return self.policy.version_format

    @property
    def run(self) -> str:
        """The run id of the policy's version names."""
        return self.policy.run

    @property
    def pushes(self) -> int:
        """Policy pushes made so far."""
        return self.policy.count

    def _refresh_transforms(self, head: str) -> HeadTransforms:
        """Reads ``head``'s transforms from the server anew and keeps them."""
        self._transforms[head] = HeadTransforms.of_info(head_info(self.client, head, refresh=True))
        return self._transforms[head]

    def _unsupported(self, why: str, cause: Optional[BaseException] = None, stacklevel: int = 2) -> None:
        """A call the service cannot answer: raises ``HeadMismatchError``
        (``"raise"``), or warns once per reason and counts a fallback
        (``"fallback"``; ``stacklevel`` as the caller's ``warnings.warn``)."""
        if self.on_unsupported == "raise":
            if cause is not None:
                raise HeadMismatchError(self.RAISE_FORMAT % why) from cause
            raise HeadMismatchError(self.RAISE_FORMAT % why)
        if why not in self._warned:
            self._warned.add(why)
            warnings.warn(self.WARN_FORMAT % why, RuntimeWarning, stacklevel=stacklevel + 1)
        self.fallbacks += 1
