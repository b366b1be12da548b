"""Adds the float64 expected values of log_sum_sq_probs, mean_logits and
is_top1 (docs/SPEC.md) to every golden case's NAME.expected.safetensors,
and writes the case top1_ties_bf16 (inputs and every expected output).

The other expected outputs of the existing cases are copied unchanged.
Math: client/python/tests/reference.py (numpy float64 on the exact input
values; hidden states: logits = hidden @ lm_head^T in float64 from the
bf16 values). is_top1 is stored as I32 0/1, as the server returns it.
Prints, per case, how many positions are top-1 and the smallest gap
between a target's x and the largest other x (a gap within float32
rounding of the GEMM would make a hidden-states is_top1 fragile).

Run from the repository root with Debian's python3 (numpy):
    python3 tests/data/golden/make_extra_outputs.py
"""

import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.join(ROOT, "client", "python"))
sys.path.insert(0, os.path.join(ROOT, "client", "python", "tests"))

import reference  # noqa: E402
from logprob_client import safetensors  # noqa: E402
from logprob_client import bf16_bits_to_float32  # noqa: E402

GOLDEN = os.path.dirname(os.path.abspath(__file__))
CASES = ["basic_f32", "llama_vocab_bf16", "odd_vocab_f16", "sampling_f32", "packed_bf16", "hidden_bf16"]
EXTRAS = ("log_sum_sq_probs", "mean_logits", "is_top1")


def as_f32(arr, dtype):
    if dtype == "BF16":
        return bf16_bits_to_float32(arr)
    return np.asarray(arr, dtype=np.float32)


def rows_of(name, inputs, meta):
    """float32 logits rows [.., V] of a case (hidden states: float64 product)."""
    dtypes = meta["__dtypes__"]
    if "logits" in inputs:
        return as_f32(inputs["logits"], dtypes["logits"]).astype(np.float64)
    w, wmeta = safetensors.load(os.path.join(GOLDEN, meta["lm_head"]))
    weight = as_f32(w["lm_head.weight"], wmeta["__dtypes__"]["lm_head.weight"]).astype(np.float64)
    h = as_f32(inputs["hidden_states"], dtypes["hidden_states"]).astype(np.float64)
    return h @ weight.T


def options(meta):
    return dict(temperature=float(meta.get("temperature", 1.0)), top_k=int(meta.get("sampling_top_k", 0)),
                top_p=float(meta.get("sampling_top_p", 1.0)))


def scored_positions(inputs, meta):
    """[(input row index tuple, target, output index tuple)] of a case."""
    ids = inputs["input_ids"]
    shift = 0 if meta.get("alignment") == "same_position" else 1
    out = []
    if "cu_seqlens" in inputs:
        cu = inputs["cu_seqlens"]
        for i in range(len(cu) - 1):
            for t in range(int(cu[i]), int(cu[i + 1]) - shift):
                out.append(((t,), int(ids[t + shift]), (t - shift * i,)))
        return out, (len(ids) - shift * (len(cu) - 1),)
    B, S = ids.shape
    lens = inputs.get("seq_lens", np.full(B, S))
    for b in range(B):
        for t in range(int(lens[b]) - shift):
            out.append(((b, t), int(ids[b, t + shift]), (b, t)))
    return out, (B, S - shift)


def extras_of(rows, inputs, meta):
    positions, shape = scored_positions(inputs, meta)
    o = options(meta)
    res = {"log_sum_sq_probs": np.zeros(shape), "mean_logits": np.zeros(shape),
           "is_top1": np.zeros(shape, dtype=np.int32)}
    gaps = []
    for row_idx, target, out_idx in positions:
        z = rows[row_idx].astype(np.float32) if "logits" in inputs else rows[row_idx]
        if target == -100:
            continue
        lss, mean, top1 = reference.extra_outputs(z, target, **o)
        if "hidden_states" in inputs:  # float64 logits: no float32 rounding of x for the argmax
            x = np.asarray(z, dtype=np.float64) / o["temperature"]
            top1 = int(np.argmax(x)) == target
            others = np.delete(x, target)
            gaps.append(abs(x[target] - others.max()))
        res["log_sum_sq_probs"][out_idx] = lss
        res["mean_logits"][out_idx] = mean
        res["is_top1"][out_idx] = int(top1)
    res["log_sum_sq_probs"] = res["log_sum_sq_probs"].astype(np.float32)
    res["mean_logits"] = res["mean_logits"].astype(np.float32)
    return res, (min(gaps) if gaps else None)


def write_expected(name, expected):
    path = os.path.join(GOLDEN, name + ".expected.safetensors")
    safetensors.save(path, expected)


def add_to_existing(name):
    inputs, meta = safetensors.load(os.path.join(GOLDEN, name + ".safetensors"))
    expected, emeta = safetensors.load(os.path.join(GOLDEN, name + ".expected.safetensors"))
    assert all(d != "BF16" for d in emeta["__dtypes__"].values())
    extras, gap = extras_of(rows_of(name, inputs, meta), inputs, meta)
    out = {k: np.array(v) for k, v in expected.items() if k not in EXTRAS}
    out.update(extras)
    write_expected(name, out)
    print("%s: %d of %d positions top-1%s" % (name, int(extras["is_top1"].sum()), extras["is_top1"].size,
                                             "" if gap is None else ", smallest target gap %.3g" % gap))


def make_ties_case():
    """top1_ties_bf16: logits [3, 40, 1000] bf16 with many exact ties (values
    on a grid of 1/4), temperature 0.7, top-5, seq_lens [40, 25, 33]; the
    targets are the first argmax, a later id tying it (not top-1), or
    random, in turn, with some maxima placed across the 2- and 3-worker
    slice boundaries."""
    rng = np.random.default_rng(30)
    B, S, V = 3, 40, 1000
    z = np.round(rng.normal(0.0, 2.0, size=(B, S, V)) * 4) / 4
    ids = rng.integers(0, V, size=(B, S))
    for b in range(B):
        for t in range(S - 1):
            row = z[b, t]
            mx = row.max() + 0.25 * (t % 3)
            if t % 4 == 0:  # the max at ids around the slice boundaries 334 / 500 / 667
                for i in (333, 334, 499, 500, 666, 667)[t % 6::2]:
                    row[i] = mx
            top = np.flatnonzero(row == row.max())
            if t % 3 == 0:
                ids[b, t + 1] = top[0]
            elif t % 3 == 1 and len(top) > 1:
                ids[b, t + 1] = top[-1]
    bits = (z.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)  # the grid is exact in bf16
    assert np.array_equal(bf16_bits_to_float32(bits), z.astype(np.float32))
    seq_lens = np.array([40, 25, 33], dtype=np.int64)
    meta = {"alignment": "next_token", "temperature": "0.7", "sampling_top_k": "0", "sampling_top_p": "1.0",
            "topk": "5"}
    safetensors.save(os.path.join(GOLDEN, "top1_ties_bf16.safetensors"),
                     {"logits": bits, "input_ids": ids.astype(np.int64), "seq_lens": seq_lens}, meta, bf16={"logits"})
    exp = reference.score_padded(z.astype(np.float32), ids, seq_lens=seq_lens, temperature=0.7, topk=5, extras=True)
    exp["is_top1"] = exp["is_top1"].astype(np.int32)
    write_expected("top1_ties_bf16", exp)
    print("top1_ties_bf16: %d of %d positions top-1" % (int(exp["is_top1"].sum()), int(seq_lens.sum()) - B))


if __name__ == "__main__":
    for c in CASES:
        add_to_existing(c)
    make_ties_case()
