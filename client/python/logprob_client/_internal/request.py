"""One score call, without I/O: checking and encoding the caller's inputs,
cutting them into parts that fit the server's limits, decoding the parts'
responses and joining them into a ``ScoreResult``. Shared by the sync and
asyncio clients (which only send the parts)."""

import copy
import difflib
import inspect
import math
from typing import Any, Callable, Dict, FrozenSet, List, Optional, Tuple

import grpc
import numpy as np

from . import cuda_ipc as cuda_ipc_mod
from . import splitter
from ..errors import InvalidInputError, LogprobError, reason_name
from ._proto import pb2
from .outputs import OutputFormat
from .result import ScoreResult
from .tensors import Array, as_numpy, float_array, from_tensor, int_array
from .wire import encode_request

# Fraction of the server's max_request_bytes a part may fill (like the C++
# client's kRequestFill), and the limit used when the server reports none.
REQUEST_FILL = 0.9
DEFAULT_MAX_REQUEST_BYTES = 64 << 20
# The largest message a ScoreStream announces (Limits.for_stream).
STREAM_MESSAGE_BYTES = 64 << 20

_ALIGNMENTS = {
    "next_token": pb2.NEXT_TOKEN,
    "same_position": pb2.SAME_POSITION,
}

# google.rpc.Code value -> grpc.StatusCode (ScoreResponse.status_code).
_CODES = {c.value[0]: c for c in grpc.StatusCode}


class Limits:
    """What one request may hold: ``server_bytes`` (the server's
    max_request_bytes; a larger message is refused), ``max_bytes`` (what a
    part may fill: 90% of it, or the client's lower limit) and
    ``max_tokens`` (token rows per request, 0: no limit)."""

    def __init__(
        self, info: Any, max_request_bytes: Optional[int] = None, max_tokens_per_request: Optional[int] = None
    ) -> None:
        self.server_bytes = int(info.max_request_bytes) or DEFAULT_MAX_REQUEST_BYTES
        self.max_bytes = max(1, int(self.server_bytes * REQUEST_FILL))
        if max_request_bytes:
            self.max_bytes = min(self.max_bytes, int(max_request_bytes))
        max_tokens = int(info.max_tokens_per_request)
        if max_tokens_per_request:
            mine = int(max_tokens_per_request)
            max_tokens = min(max_tokens, mine) if max_tokens > 0 else mine
        self.max_tokens = max_tokens
        # What one message may carry; on a stream, its announced size.
        self.message_bytes = self.server_bytes

    def for_stream(self) -> "Limits":
        """These limits for the messages of one ``ScoreStream``: each at
        most ``message_bytes`` = min(server_bytes, STREAM_MESSAGE_BYTES),
        the size the stream announces (``logprob-request-bytes``); the
        server holds that much of its queue while it waits for each
        message, so streams announce less than a unary call may send. Dict
        items are split into parts that fit it."""
        limits = copy.copy(self)
        limits.message_bytes = min(self.server_bytes, STREAM_MESSAGE_BYTES)
        limits.max_bytes = max(1, min(self.max_bytes, int(limits.message_bytes * REQUEST_FILL)))
        return limits


class Part:
    """One request of a call: its id, inputs (views of the caller's
    arrays), ``index`` / ``count`` (1-based ``(i, n)`` as ``where``);
    ``checked``: planned to fit the limits (its size is checked);
    ``cuda_ipc``: the hidden states' CUDA IPC reference (``cuda_ipc.Export``,
    kept alive with the part) when they are not among ``inputs.tensors``."""

    def __init__(
        self,
        part_id: str,
        inputs: splitter.Inputs,
        index: int,
        count: int,
        checked: bool,
        cuda_ipc: Optional[cuda_ipc_mod.Export] = None,
    ) -> None:
        self.id = part_id
        self.inputs = inputs
        self.where = (index, count)
        self._checked = checked
        self.cuda_ipc = cuda_ipc

    def serialized(self, max_bytes: int) -> bytes:
        """The serialized ``ScoreRequest`` (``wire.encode_request``: the one
        copy of the caller's data). Its bytes exist only while the caller
        holds them. Raises LogprobError (INTERNAL) when a part planned to fit
        ``max_bytes`` does not (never expected: the plan's estimate is an
        upper bound)."""
        data = encode_request(self.id, self.inputs.tensors, self.inputs.options, head=self.inputs.head,
                              head_version=self.inputs.head_version)
        if self.cuda_ipc is not None:
            data = bytes(data) + self.cuda_ipc.encoded
        if self._checked and len(data) > max_bytes:
            raise LogprobError(
                grpc.StatusCode.INTERNAL, "part %s has %d bytes, over the limit of %d" % (self.id, len(data), max_bytes)
            )
        return data


def _mask_to_seq_lens(mask: Any, ids_shape: Tuple[int, ...]) -> Array:
    m, _ = as_numpy(mask)
    m = np.asarray(m)
    if m.shape != tuple(ids_shape):
        raise InvalidInputError("attention_mask %s must have input_ids' shape %s" % (list(m.shape), list(ids_shape)))
    m = m != 0
    lens: Array = m.sum(axis=1).astype(np.int64)
    # Right padding only: ones first, then zeros.
    prefix = np.arange(m.shape[1])[None, :] < lens[:, None]
    if not np.array_equal(prefix, m):
        bad = int(np.nonzero((prefix != m).any(axis=1))[0][0])
        raise InvalidInputError(
            "attention_mask row %d is not right-padded (ones then zeros), and a padded batch is scored "
            "from the start of each row; for left padding (a left-padded prompt and a right-padded "
            "completion, as TRL and verl hold them) use logprob_client.batches.PackedBatch or "
            "score_padded, which pack the rows into cu_seqlens form and scatter the answers back" % bad
        )
    return lens


def score_options(
    alignment: Any = "next_token",
    entropy: bool = False,
    topk: int = 0,
    temperature: Optional[float] = None,
    sampling_top_k: int = 0,
    sampling_top_p: Optional[float] = None,
    ignore_index: Optional[int] = None,
    log_sum_sq_probs: bool = False,
    mean_logits: bool = False,
    is_top1: bool = False,
    rollout_ratio_cap: Optional[float] = None,
    rollout_band: Optional[Tuple[float, float]] = None,
    gradient_step: str = "",
) -> Any:
    """The ``logprob.v1.ScoreOptions`` of ``score``'s keyword options.
    Raises InvalidInputError for an unknown alignment or a ``rollout_band``
    that is not a pair."""
    options = pb2.ScoreOptions()
    if alignment not in _ALIGNMENTS and alignment not in (pb2.NEXT_TOKEN, pb2.SAME_POSITION):
        raise InvalidInputError("alignment must be 'next_token' or 'same_position', got %r" % (alignment,))
    options.alignment = _ALIGNMENTS.get(alignment, alignment)
    options.entropy = bool(entropy)
    options.topk = int(topk)
    if temperature is not None:
        options.temperature = float(temperature)
    options.sampling_top_k = int(sampling_top_k)
    if sampling_top_p is not None:
        options.sampling_top_p = float(sampling_top_p)
    if ignore_index is not None:
        options.ignore_index = int(ignore_index)
    options.log_sum_sq_probs = bool(log_sum_sq_probs)
    options.mean_logits = bool(mean_logits)
    options.is_top1 = bool(is_top1)
    if rollout_ratio_cap is not None:
        options.rollout_ratio_cap = float(rollout_ratio_cap)
    if rollout_band is not None:
        try:
            low, high = rollout_band
        except (TypeError, ValueError):
            raise InvalidInputError("rollout_band must be a pair (low, high), got %r" % (rollout_band,)) from None
        options.rollout_band_low, options.rollout_band_high = float(low), float(high)
    if gradient_step:
        options.gradient_step = str(gradient_step)
    return options


def unknown_keyword(name: str) -> TypeError:
    """The error for a keyword ``score`` does not take (instead of Python's
    own, which names the internal ``score_options``), naming the closest
    keyword it does take."""
    known = sorted(score_keywords())
    close = difflib.get_close_matches(name, known, n=1)
    hint = " (did you mean %r?)" % close[0] if close else ""
    return TypeError("score() got an unexpected keyword argument %r%s; it takes: %s" % (name, hint, ", ".join(known)))


def score_keywords() -> FrozenSet[str]:
    """``score``'s keyword arguments: ScoreCall's, score_options' and those
    the clients consume before making a ScoreCall (timeout, cuda_ipc)."""
    names = {"timeout", "cuda_ipc"}
    fns: Tuple[Callable[..., Any], ...] = (ScoreCall.__init__, score_options)
    for fn in fns:
        names.update(p.name for p in inspect.signature(fn).parameters.values()
                     if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name != "self")
    return frozenset(names)


class ScoreCall:
    """A checked, encoded score call (arguments as in
    ``LogprobClient.score``; ``options`` those of ``score_options``). No copy of the caller's arrays is made here
    (except for a dtype conversion); ``parts()`` cuts views of them and
    each ``Part.request`` copies one part into its message.

    Raises InvalidInputError (a ValueError) for inputs the client can tell
    are wrong, TypeError for unsupported dtypes. Not thread-safe; one per call.
    """

    def __init__(
        self,
        request_id: str,
        logits: Any = None,
        input_ids: Any = None,
        *,
        hidden_states: Any = None,
        seq_lens: Any = None,
        attention_mask: Any = None,
        cu_seqlens: Any = None,
        gather_indices: Any = None,
        rollout_logprobs: Any = None,
        sampling_mask: Any = None,
        grad_token_logprobs: Any = None,
        grad_entropy: Any = None,
        dtype: Any = None,
        split: bool = True,
        cuda_ipc: bool = False,
        head: str = "",
        head_version: str = "",
        **options: Any,
    ) -> None:
        unknown = set(options) - set(inspect.signature(score_options).parameters)
        if unknown:
            raise unknown_keyword(sorted(unknown)[0])
        if (logits is None) == (hidden_states is None):
            raise InvalidInputError("give exactly one of logits and hidden_states")
        if input_ids is None:
            raise InvalidInputError("input_ids is required")
        rows_name = "logits" if logits is not None else "hidden_states"
        rows_in = logits if logits is not None else hidden_states
        self.output = OutputFormat.of(rows_in)
        # cuda_ipc (the client's decision, cuda_ipc_mod.use_cuda_ipc): the
        # hidden states stay on their GPU until parts() exports them.
        # Sampling filters need the rows on the workers' hosts (the filtered
        # path exchanges full logits rows), so such calls send bytes.
        filters = int(options.get("sampling_top_k") or 0) > 0 or float(
            1.0 if options.get("sampling_top_p") is None else options["sampling_top_p"]
        ) < 1.0
        if filters and sampling_mask is not None:
            raise InvalidInputError("sampling_mask replaces sampling_top_k / sampling_top_p: give one or the other")
        # The lm_head's backward takes the hidden states' bytes (docs/gradients.md).
        self._on_device = bool(cuda_ipc) and not filters and sampling_mask is None and grad_token_logprobs is None
        if self._on_device:
            rows_dt, rows = cuda_ipc_mod.device_rows(rows_in, dtype)
        else:
            rows_dt, rows = float_array(rows_name, rows_in, dtype)
        ids_dt, ids = int_array("input_ids", input_ids)
        if rows.ndim == 3:
            if ids.shape != rows.shape[:2]:
                raise InvalidInputError(
                    "padded '%s' %s needs input_ids [B, S] = %s, got %s"
                    % (rows_name, list(rows.shape), list(rows.shape[:2]), list(ids.shape))
                )
            if cu_seqlens is not None:
                raise InvalidInputError("cu_seqlens is for packed [T, X] input; padded input takes seq_lens")
        elif rows.ndim == 2:
            if ids.shape != rows.shape[:1]:
                raise InvalidInputError(
                    "packed '%s' %s needs input_ids [T] = %s, got %s"
                    % (rows_name, list(rows.shape), list(rows.shape[:1]), list(ids.shape))
                )
            if seq_lens is not None or attention_mask is not None:
                raise InvalidInputError(
                    "seq_lens / attention_mask are for padded [B, S, X] input; packed takes cu_seqlens"
                )
        else:
            raise InvalidInputError("'%s' must be [B, S, X] or [T, X], got %s" % (rows_name, list(rows.shape)))

        if attention_mask is not None:
            if seq_lens is not None:
                raise InvalidInputError("give seq_lens or attention_mask, not both")
            seq_lens = _mask_to_seq_lens(attention_mask, ids.shape)

        tensors = [(rows_name, rows_dt, rows), ("input_ids", ids_dt, ids)]
        if cu_seqlens is not None:
            tensors.append(("cu_seqlens",) + int_array("cu_seqlens", cu_seqlens))
        if seq_lens is not None:
            tensors.append(("seq_lens",) + int_array("seq_lens", seq_lens))
        if gather_indices is not None:
            tensors.append(("gather_indices",) + int_array("gather_indices", gather_indices))
        if rollout_logprobs is not None:
            tensors.append(("rollout_logprobs",) + float_array("rollout_logprobs", rollout_logprobs, "f32"))
        if grad_entropy is not None and grad_token_logprobs is None:
            raise InvalidInputError("grad_entropy needs grad_token_logprobs (the lm_head's backward)")
        if grad_token_logprobs is not None:
            if rows_name != "hidden_states":
                raise InvalidInputError("grad_token_logprobs: the lm_head's backward takes hidden_states, not logits")
            tensors.append(("grad_token_logprobs",) + float_array("grad_token_logprobs", grad_token_logprobs, "f32"))
            if grad_entropy is not None:
                tensors.append(("grad_entropy",) + float_array("grad_entropy", grad_entropy, "f32"))
        if sampling_mask is not None:
            try:
                mask_offsets, mask_ids = sampling_mask
            except (TypeError, ValueError):
                raise InvalidInputError("sampling_mask must be a pair (offsets, ids): CSR over the output "
                                        "positions") from None
            tensors.append(("sampling_mask_offsets",) + int_array("sampling_mask_offsets", mask_offsets))
            tensors.append(("sampling_mask_ids",) + int_array("sampling_mask_ids", mask_ids))
        head, head_version = str(head or ""), str(head_version or "")
        if (head or head_version) and rows_name != "hidden_states":
            raise InvalidInputError("head / head_version select an lm_head for hidden_states; this call has logits")
        self._options = score_options(**options)
        if self._on_device:
            self.inputs = splitter.Inputs(tensors[1:], self._options, rows=tensors[0], head=head,
                                          head_version=head_version)
        else:
            self.inputs = splitter.Inputs(tensors, self._options, head=head, head_version=head_version)
        self.id = request_id
        self.split = split

    def refused(self, error: LogprobError) -> bool:
        """True when ``error`` is the server refusing this call's CUDA IPC
        reference (reason ``CUDA_IPC_UNAVAILABLE``: e.g. CPU workers, or a
        worker that cannot open the handle, in another container); the
        hidden states then go to the host and ``parts()`` gives parts with
        bytes. False (nothing changes) for any other error or a call without
        a reference."""
        if not self._on_device or not cuda_ipc_mod.refused(error):
            return False
        self._to_host(error.message)
        return True

    def _to_host(self, reason: Any) -> None:
        """Falls back from CUDA IPC: the hidden states are copied to the host
        and sent as bytes like any input (with a warning saying why)."""
        cuda_ipc_mod.warn_fallback(reason)
        name, dt, rows = self.inputs.rows
        host = (name,) + float_array(name, rows, dt)
        self.inputs = splitter.Inputs([host] + list(self.inputs.tensors), self._options)
        self._on_device = False

    def parts(self, limits: Limits) -> List[Part]:
        """The requests to send, in order: one when the call fits
        ``limits`` (or ``split=False``), else whole sequences per part
        (ids ``"<id>-<i>"``). Raises InvalidInputError when a sequence
        alone does not fit."""
        if self._on_device:
            # One request referencing the GPU memory, when it fits the token limit.
            if self.split and limits.max_tokens and self.inputs.tokens() > limits.max_tokens:
                self._to_host("%d tokens exceed max_tokens_per_request %d" % (self.inputs.tokens(), limits.max_tokens))
            else:
                _, dt, rows = self.inputs.rows
                try:
                    ref = cuda_ipc_mod.export(rows, dt)
                except cuda_ipc_mod.Unavailable as e:
                    self._to_host(e)
                else:
                    return [Part(self.id, self.inputs, 1, 1, checked=False, cuda_ipc=ref)]
        if not self.split:
            return [Part(self.id, self.inputs, 1, 1, checked=False)]
        planned = splitter.plan(self.inputs, self.id, limits.max_bytes, limits.max_tokens)
        n = len(planned)
        return [Part(pid, inputs, i + 1, n, checked=True) for i, (pid, inputs) in enumerate(planned)]

    def result(self, responses: List[Any], attempts: int) -> ScoreResult:
        """Joins the parts' ``ScoreResponse``s (in part order) into a
        ``ScoreResult`` in this call's output format. Raises LogprobError
        (INTERNAL) for responses that do not fit together, ABORTED for parts
        scored with different lm_head versions."""
        versions = sorted({getattr(r, "head_version", "") or "" for r in responses})
        if len(versions) > 1:
            # Never joined from two versions: score() pins its parts, but a
            # streamed item's parts are all in flight at once.
            raise LogprobError(
                grpc.StatusCode.ABORTED,
                "request %s: its %d parts were scored with lm_head versions %s (an update committed while they "
                "were in flight); send it again, or pin head_version" % (self.id, len(responses), ", ".join(
                    repr(v) for v in versions)))
        outputs = [decode(r) for r in responses]
        joined = splitter.join(outputs)
        result = ScoreResult(self.output.convert(joined), self.id, len(responses), attempts)
        result.head = getattr(responses[0], "head", "") or ""
        result.head_version = getattr(responses[0], "head_version", "") or ""
        parts = [_rollout_mismatch_of(r) for r in responses]
        if any(p is not None for p in parts):
            result.rollout_mismatch = rollout_mismatch([p for p in parts if p is not None])
        return result


def _rollout_mismatch_of(response: Any) -> Any:
    """A response's ``RolloutMismatch``, or None (a ``WireResponse`` or a
    ``ScoreResponse`` message)."""
    if hasattr(response, "HasField"):
        return response.rollout_mismatch if response.HasField("rollout_mismatch") else None
    return getattr(response, "rollout_mismatch", None)


def rollout_mismatch(parts: List[Any]) -> Dict[str, float]:
    """The request's ``RolloutMismatch`` as a dict, from its parts' (in part
    order): each mean over all compared tokens is the token-weighted mean
    of the parts' (exactly the server's definition, docs/SPEC.md "Rollout
    mismatch"); NaN when no token was compared."""
    tokens = sum(int(p.tokens) for p in parts)
    out: Dict[str, float] = {"tokens": tokens}
    for name in ("mean_abs_log_ratio", "k1", "k3", "outside_band_fraction"):
        out[name] = (math.fsum(getattr(p, name) * p.tokens for p in parts if p.tokens) / tokens
                     if tokens else float("nan"))
    return out


# Outputs the server sends as I32 0/1 that the clients return as bool.
BOOL_OUTPUTS = frozenset({"is_top1"})


def decode(response: Any) -> Dict[str, Array]:
    """``{name: ndarray}`` of a ``ScoreResponse``'s outputs (views of its
    bytes; the I32 0/1 outputs of BOOL_OUTPUTS as bool copies). Raises
    LogprobError (INTERNAL) for a malformed output."""
    try:
        out = {t.name: from_tensor(t) for t in response.outputs}
    except ValueError as e:
        raise LogprobError(grpc.StatusCode.INTERNAL, "response %s: %s" % (response.id, e)) from None
    for name in BOOL_OUTPUTS & out.keys():
        out[name] = out[name] != 0
    return out


def status_error(response: Any, part: Optional[Tuple[int, int]] = None) -> Optional[LogprobError]:
    """The ``LogprobError`` of a ScoreStream response whose ``status_code``
    is not OK (its ``status_message`` as the message), else None."""
    if response.status_code == 0:
        return None
    code = _CODES.get(response.status_code, grpc.StatusCode.UNKNOWN)
    return LogprobError(code, response.status_message, attempts=1, part=part,
                        reason=reason_name(response.status_reason))
