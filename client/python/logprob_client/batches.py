"""Trainers' batches as they come: a ``[B, S]`` row holding a left-padded
prompt and a right-padded completion (TRL, verl), with an ``attention_mask``
and optionally a completion mask, packed into the service's ``cu_seqlens``
form and the answers scattered back to ``[B, S - 1]`` (or ``[B, S]``).

The service scores a prefix of each padded row (``seq_lens``), so a
left-padded row cannot go as it is; ``PackedBatch`` sends, of each row, only
the span from the token before the first scored target to the last scored
target, and no row without a scored target::

    from logprob_client.batches import PackedBatch

    # input_ids, attention_mask [B, S]; completion_mask [B, S] or [B, C] (the last C columns)
    batch = PackedBatch(attention_mask, completion_mask)
    res = client.score(hidden_states=batch.pack(hidden),           # [T, H]
                       input_ids=batch.pack(input_ids), cu_seqlens=batch.cu_seqlens,
                       head="policy", entropy=True)
    logp = batch.scatter(res.token_logprobs)                      # [B, S - 1]; 0 where not scored
    ent = batch.scatter(res.entropy)

or in one call: ``score_padded(client, hidden_states=..., input_ids=...,
attention_mask=..., completion_mask=..., **options)``.

numpy arrays or torch tensors (any device) alike: ``pack`` and ``scatter``
return the kind (and device) they are given.
"""

from typing import Any, Dict, Optional

import numpy as np

from ._internal.tensors import Array, as_numpy, is_torch
from .errors import InvalidInputError

__all__ = ["PackedBatch", "score_padded"]


def _mask_array(name: str, mask: Any) -> Array:
    if is_torch(mask):
        mask = mask.detach().cpu()
    arr, _ = as_numpy(mask)
    arr = np.asarray(arr)
    if arr.ndim != 2:
        raise InvalidInputError("%s must be [B, S], got %s" % (name, list(arr.shape)))
    nonzero: Array = arr != 0
    return nonzero


class PackedBatch:
    """The packed (``cu_seqlens``) form of the scored positions of a padded
    ``[B, S]`` batch.

    ``attention_mask`` [B, S] (numpy or torch; nonzero = a real token):
    each row's real tokens must be one contiguous span (any padding left
    and right of it: a left-padded prompt followed by a right-padded
    completion is one span). ``completion_mask`` (optional): [B, S], or
    [B, C] for the last C columns (TRL's and verl's ``completion_mask`` /
    ``response_mask`` of the completion part); the positions whose token is
    scored, within the attention mask. Without it every real token after
    the first of its row is scored (next_token), or every real token
    (same_position). next_token scores a token only when the token before
    it is real (a completion with no prompt loses its first token).

    ``alignment``: ``"next_token"`` (output column t scores token t + 1
    from row t: outputs [B, S - 1], like the service's padded outputs) or
    ``"same_position"`` (column t scores token t: [B, S]).

    Attributes: ``rows`` (int64 [B'], the rows sent: those with at least
    one scored position), ``starts`` / ``ends`` ([B'], the span of each
    sent row, ``ends`` exclusive), ``cu_seqlens`` (int64 [B' + 1]),
    ``tokens`` (T = cu_seqlens[-1]), ``scored`` (bool [B, S - 1] / [B, S]:
    where ``scatter`` puts values; elsewhere ``fill``). Rows whose
    completion is empty are not sent, and a batch with no scored position
    sends nothing (``tokens == 0``; see ``score_padded``).

    Raises InvalidInputError for masks of the wrong shape, a row whose
    real tokens are not contiguous, or a completion position outside the
    attention mask.
    """

    def __init__(self, attention_mask: Any, completion_mask: Any = None, alignment: str = "next_token") -> None:
        if alignment not in ("next_token", "same_position"):
            raise InvalidInputError("alignment must be 'next_token' or 'same_position', got %r" % (alignment,))
        self.alignment = alignment
        att = _mask_array("attention_mask", attention_mask)
        B, S = att.shape
        self.shape = (B, S)
        lens = att.sum(axis=1)
        first = np.where(lens > 0, att.argmax(axis=1), 0)
        span = (np.arange(S)[None, :] >= first[:, None]) & (np.arange(S)[None, :] < (first + lens)[:, None])
        if not np.array_equal(span, att):
            bad = int(np.nonzero((span != att).any(axis=1))[0][0])
            raise InvalidInputError(
                "attention_mask row %d has padding between real tokens; PackedBatch takes one span of real "
                "tokens per row (left padding, right padding, or both)" % bad)
        if completion_mask is None:
            target = att.copy()
        else:
            comp = _mask_array("completion_mask", completion_mask)
            if comp.shape[0] != B or comp.shape[1] > S:
                raise InvalidInputError("completion_mask %s must be [B, S] = %s or [B, C <= S]"
                                        % (list(comp.shape), [B, S]))
            target = np.zeros((B, S), dtype=bool)
            target[:, S - comp.shape[1]:] = comp
            if (target & ~att).any():
                bad = int(np.nonzero((target & ~att).any(axis=1))[0][0])
                raise InvalidInputError("completion_mask row %d marks positions the attention_mask pads" % bad)
        if alignment == "next_token":
            # A token is scored from the row before it, which must be a real token.
            target[:, 1:] &= att[:, :-1]
            target[:, 0] = False
        # target[b, s]: token s of row b is scored.
        has = target.any(axis=1)
        rows = np.nonzero(has)[0].astype(np.int64)
        t_first = target.argmax(axis=1)[rows]
        t_last = S - 1 - target[:, ::-1].argmax(axis=1)[rows]
        shift = 1 if alignment == "next_token" else 0
        self.rows = rows
        self.starts = (t_first - shift).astype(np.int64)
        self.ends = (t_last + 1).astype(np.int64)
        lengths = self.ends - self.starts
        self.cu_seqlens = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        self.tokens = int(self.cu_seqlens[-1])
        # Gather index of the packed tokens: row and column of each.
        self._b = np.repeat(rows, lengths)
        self._s = np.concatenate([np.arange(a, e) for a, e in zip(self.starts, self.ends)]) if len(rows) else \
            np.zeros(0, dtype=np.int64)
        self._s = self._s.astype(np.int64)
        # Output positions of the packed outputs: next_token, sequence i has
        # L_i - 1 outputs at columns starts[i] .. ends[i] - 2 (column t scores token t + 1).
        if alignment == "next_token":
            keep = np.ones(self.tokens, dtype=bool)
            keep[self.cu_seqlens[1:] - 1] = False  # the last token of each sequence has no output
            self._out_b, self._out_s = self._b[keep], self._s[keep]
            self.scored = target[:, 1:].copy()
        else:
            self._out_b, self._out_s = self._b, self._s
            self.scored = target.copy()

    def pack(self, x: Any) -> Any:
        """``x`` [B, S, ...] (numpy or torch) -> [T, ...]: the sent spans, in
        row order (a copy). Raises InvalidInputError for another [B, S]."""
        if tuple(x.shape[:2]) != self.shape:
            raise InvalidInputError("PackedBatch.pack: expected [B, S] = %s leading, got %s"
                                    % (list(self.shape), list(x.shape)))
        if is_torch(x):
            import torch

            b = torch.from_numpy(self._b).to(x.device)
            s = torch.from_numpy(self._s).to(x.device)
            return x[b, s]
        return np.asarray(x)[self._b, self._s]

    def scatter(self, values: Any, fill: float = 0.0) -> Any:
        """A packed output (``[T - B']`` next_token / ``[T]`` same_position,
        with any trailing dims such as top-k's ``[K]``; numpy or torch) ->
        ``[B, S - 1, ...]`` / ``[B, S, ...]`` of its dtype (and device),
        ``fill`` where no position was scored (padding, the prompt,
        completion positions the mask leaves out). None stays None."""
        if values is None:
            return None
        B, S = self.shape
        cols = S - 1 if self.alignment == "next_token" else S
        n = len(self._out_b)
        if int(values.shape[0]) != n:
            raise InvalidInputError("PackedBatch.scatter: expected %d packed rows, got %d" % (n, int(values.shape[0])))
        trailing = tuple(int(d) for d in values.shape[1:])
        if is_torch(values):
            import torch

            out = torch.full((B, max(cols, 0)) + trailing, fill, dtype=values.dtype, device=values.device)
            b = torch.from_numpy(self._out_b).to(values.device)
            s = torch.from_numpy(self._out_s).to(values.device)
            out[b, s] = values
            keep = torch.from_numpy(self.scored).to(values.device)
            out[~keep] = fill
            return out
        arr = np.asarray(values)
        out_np = np.full((B, max(cols, 0)) + trailing, fill, dtype=arr.dtype)
        out_np[self._out_b, self._out_s] = arr
        out_np[~self.scored] = fill
        return out_np


def score_padded(client: Any, *, input_ids: Any, attention_mask: Any, completion_mask: Any = None,
                 hidden_states: Any = None, logits: Any = None, alignment: str = "next_token",
                 **options: Any) -> Dict[str, Any]:
    """Scores a padded trainer batch (``PackedBatch``) with ``client.score``
    and returns ``{output name: [B, S - 1(, K)]}`` (``[B, S(, K)]`` for
    same_position), 0 wherever no position was scored; numpy or torch like
    the input (``hidden_states`` [B, S, H] or ``logits`` [B, S, V]).
    ``options``: ``score``'s (``head``, ``head_version``, ``entropy``,
    ``topk``, ``temperature``, ...). Sends only the spans of the rows with
    a scored position, and nothing when there is none (the outputs are
    then all 0: ``token_logprobs``, plus ``entropy`` when requested).
    ``gather_indices`` is not taken (pack it with ``PackedBatch.pack``
    over the output positions yourself). Raises what ``score`` raises."""
    if "gather_indices" in options or "seq_lens" in options or "cu_seqlens" in options:
        raise InvalidInputError("score_padded computes cu_seqlens itself and takes no gather_indices / seq_lens")
    if (hidden_states is None) == (logits is None):
        raise InvalidInputError("give exactly one of hidden_states and logits")
    rows_in = hidden_states if hidden_states is not None else logits
    batch = PackedBatch(attention_mask, completion_mask, alignment)
    if batch.tokens == 0:
        B, S = batch.shape
        cols = S - 1 if alignment == "next_token" else S
        names = ["token_logprobs"] + (["entropy"] if options.get("entropy") else [])
        if is_torch(rows_in):
            import torch

            return {n: torch.zeros((B, cols), dtype=torch.float32, device=rows_in.device) for n in names}
        return {n: np.zeros((B, cols), dtype=np.float32) for n in names}
    key = "hidden_states" if hidden_states is not None else "logits"
    res = client.score(**{key: batch.pack(rows_in)}, input_ids=batch.pack(input_ids), cu_seqlens=batch.cu_seqlens,
                       alignment=alignment, **options)
    return {name: batch.scatter(v) for name, v in res.outputs.items()}
