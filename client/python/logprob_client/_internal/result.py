"""``ScoreResult`` (the outputs of one score call) and ``split_sequences``."""

from typing import Any, Dict, List, Optional

import numpy as np

from ._proto import pb2


class ScoreResult:
    """The outputs of one score call: numpy arrays (float32; ids int64;
    ``is_top1`` bool) for
    numpy input, torch tensors on the input's device for torch input,
    shaped like the input's token layout (docs/SPEC.md):

    - padded input [B, S, X]: ``[B, S - 1]`` for next_token alignment,
      ``[B, S]`` for same_position (positions past ``seq_lens`` are 0);
    - packed input [T, X]: ``[T - B]`` / ``[T]`` (sequence i's values start
      at ``cu_seqlens[i] - i`` for next_token; see ``split_sequences``).

    ``topk_logprobs``, ``topk_indices`` and ``gathered_logprobs`` add a
    trailing ``[K]``. Outputs not requested are None. numpy outputs of a
    call sent in one part are read-only views of the response's bytes
    (``.copy()`` to modify); torch outputs share that memory (CPU).

    Attributes: ``token_logprobs``, ``entropy``, ``log_sum_sq_probs``
    (float32: log of the sum of p^2 of the scored distribution),
    ``mean_logits`` (float32: mean of logits / temperature over the
    vocabulary, before the sampling filters), ``is_top1`` (bool: the target
    is the argmax, the lowest id among equal maxima), ``topk_logprobs``,
    ``topk_indices``, ``gathered_logprobs``, ``outputs`` (dict of all by
    name), ``id``, ``num_parts`` (requests the batch was split into),
    ``attempts`` (calls sent, retries included), ``head`` and
    ``head_version`` (hidden states: the lm_head version that scored every
    row; empty for logits).

    With ``rollout_logprobs`` (docs/SPEC.md "Rollout mismatch"):
    ``rollout_log_ratio`` (l = logp - logp_rollout) and ``rollout_ratio``
    (min(exp(l), cap)), shaped like ``token_logprobs``, NaN where not
    compared; per sequence ``outputs["rollout_seq_tokens"]`` (int64),
    ``"rollout_seq_mean_abs_log_ratio"``, ``"rollout_seq_k1"``,
    ``"rollout_seq_k3"``, ``"rollout_seq_outside_band"``,
    ``"rollout_seq_ratio"`` and ``"rollout_seq_geo_ratio"`` [B]; and
    ``rollout_mismatch``, the request's figures as a dict (``tokens``,
    ``mean_abs_log_ratio``, ``k1``, ``k3``, ``outside_band_fraction``), None
    without rollout logprobs.
    """

    def __init__(self, outputs: Dict[str, Any], request_id: str, num_parts: int, attempts: int) -> None:
        self.outputs = outputs
        self.id = request_id
        self.num_parts = num_parts
        self.attempts = attempts
        self.head = ""
        self.head_version = ""
        self.rollout_mismatch: Optional[Dict[str, float]] = None

    @property
    def token_logprobs(self) -> Any:
        return self.outputs.get("token_logprobs")

    @property
    def entropy(self) -> Optional[Any]:
        return self.outputs.get("entropy")

    @property
    def log_sum_sq_probs(self) -> Optional[Any]:
        return self.outputs.get("log_sum_sq_probs")

    @property
    def mean_logits(self) -> Optional[Any]:
        return self.outputs.get("mean_logits")

    @property
    def is_top1(self) -> Optional[Any]:
        return self.outputs.get("is_top1")

    @property
    def topk_logprobs(self) -> Optional[Any]:
        return self.outputs.get("topk_logprobs")

    @property
    def topk_indices(self) -> Optional[Any]:
        return self.outputs.get("topk_indices")

    @property
    def gathered_logprobs(self) -> Optional[Any]:
        return self.outputs.get("gathered_logprobs")

    @property
    def grad_hidden_states(self) -> Optional[Any]:
        """The lm_head's backward (``grad_token_logprobs`` given): dL/dh,
        float32, shaped like ``hidden_states`` (docs/gradients.md)."""
        return self.outputs.get("grad_hidden_states")

    @property
    def rollout_log_ratio(self) -> Optional[Any]:
        return self.outputs.get("rollout_log_ratio")

    @property
    def rollout_ratio(self) -> Optional[Any]:
        return self.outputs.get("rollout_ratio")

    def __getitem__(self, name: str) -> Any:
        return self.outputs[name]

    def __contains__(self, name: str) -> bool:
        return name in self.outputs

    def __repr__(self) -> str:
        shapes = ", ".join("%s=%s" % (k, list(v.shape)) for k, v in self.outputs.items())
        return "ScoreResult(id=%r, %s, num_parts=%d)" % (self.id, shapes, self.num_parts)


def split_sequences(values: Any, cu_seqlens: Any, alignment: Any = "next_token") -> List[Any]:
    """Cuts a packed output (``[T - B, ...]`` for next_token, ``[T, ...]``
    for same_position; numpy or torch) into a list of per-sequence views,
    sequence i having ``L_i - 1`` (next_token) or ``L_i`` rows."""
    cu = np.asarray(cu_seqlens.cpu() if hasattr(cu_seqlens, "cpu") else cu_seqlens, dtype=np.int64)
    lens = np.diff(cu)
    if alignment in ("next_token", pb2.NEXT_TOKEN):
        lens = np.maximum(lens - 1, 0)
    off = np.concatenate([[0], np.cumsum(lens)])
    if off[-1] != len(values):
        raise ValueError("values have %d rows, cu_seqlens gives %d" % (len(values), off[-1]))
    return [values[int(off[i]):int(off[i + 1])] for i in range(len(lens))]
