"""float64 numpy reference of docs/SPEC.md's scoring, for the tests."""

import math

import numpy as np


def scored_logprobs(z, temperature=1.0, top_k=0, top_p=1.0):
    """log_softmax of one row after temperature and the sampling filters
    (NeMo-RL apply_top_k_top_p): -inf where filtered out."""
    x = np.asarray(z, dtype=np.float32).astype(np.float64) / np.float64(np.float32(temperature))
    keep = np.ones(x.shape, dtype=bool)
    if top_k > 0:
        kth = np.sort(x)[::-1][min(top_k, x.size) - 1]
        keep &= x >= kth
    if 0 < top_p < 1:
        xs = np.where(keep, x, -np.inf)
        order = np.argsort(xs, kind="stable")  # ascending; -inf first
        s = xs[order]
        p = np.exp(s - s.max())
        p /= p.sum()
        c = np.cumsum(p)
        kept_sorted = c > 1 - top_p
        kept_sorted[-1] = True
        k2 = np.zeros(x.shape, dtype=bool)
        k2[order[kept_sorted]] = True
        keep &= k2
    xs = np.where(keep, x, -np.inf)
    m = xs[keep].max()
    lse = m + np.log(np.exp(xs[keep] - m).sum())
    return np.where(keep, xs - lse, -np.inf)


def extra_outputs(z, target, temperature=1.0, top_k=0, top_p=1.0):
    """(log_sum_sq_probs, mean_logits, is_top1) of one row scoring
    ``target`` (docs/SPEC.md): log(sum p^2) of the filtered distribution,
    the mean of x = z / temperature (float32 division, as the server) over
    the whole vocabulary before the filters, and whether the target is the
    argmax of x (np.argmax: the lowest id among equal maxima). A target
    < 0 (ignore_index) gives (0, 0, False)."""
    if target < 0:
        return 0.0, 0.0, False
    lp = scored_logprobs(z, temperature, top_k, top_p)
    p = np.exp(lp)
    x = (np.asarray(z, dtype=np.float32) / np.float32(temperature)).astype(np.float64)
    return float(np.log(np.sum(p * p))), float(x.sum() / x.size), bool(int(np.argmax(x)) == int(target))


def score_padded(logits, ids, seq_lens=None, alignment="next_token", temperature=1.0, top_k=0, top_p=1.0,
                 topk=0, gather=None, ignore_index=-100, extras=False):
    """Reference outputs {name: array} of a padded batch [B, S, V];
    ``extras``: also log_sum_sq_probs, mean_logits (float32) and is_top1
    (bool)."""
    B, S, V = logits.shape
    lens = np.full(B, S) if seq_lens is None else np.asarray(seq_lens)
    shift = 1 if alignment == "next_token" else 0
    O = S - shift
    out = {
        "token_logprobs": np.zeros((B, O)),
        "entropy": np.zeros((B, O)),
    }
    if topk:
        out["topk_logprobs"] = np.zeros((B, O, topk))
        out["topk_indices"] = np.zeros((B, O, topk), dtype=np.int64)
    if gather is not None:
        out["gathered_logprobs"] = np.zeros(gather.shape)
    if extras:
        out["log_sum_sq_probs"] = np.zeros((B, O))
        out["mean_logits"] = np.zeros((B, O))
        out["is_top1"] = np.zeros((B, O), dtype=bool)
    for b in range(B):
        for t in range(int(lens[b]) - shift):
            lp = scored_logprobs(logits[b, t], temperature, top_k, top_p)
            target = int(ids[b, t + shift])
            out["token_logprobs"][b, t] = 0.0 if target == ignore_index else lp[target]
            p = np.exp(lp)
            out["entropy"][b, t] = -np.sum(np.where(p > 0, p * lp, 0.0))
            if topk:
                order = np.lexsort((np.arange(V), -lp))[:topk]  # largest first, lower id on ties
                out["topk_logprobs"][b, t] = lp[order]
                out["topk_indices"][b, t] = order
            if gather is not None:
                out["gathered_logprobs"][b, t] = lp[gather[b, t]]
            if extras:
                e = extra_outputs(logits[b, t], -1 if target == ignore_index else target, temperature, top_k, top_p)
                out["log_sum_sq_probs"][b, t], out["mean_logits"][b, t], out["is_top1"][b, t] = e
    return {k: (v.astype(np.float32) if v.dtype.kind == "f" else v) for k, v in out.items()}


def _head_logits(hidden, weight, bias, temperature, softcap, logit_scale):
    """float64 (h, w, z, x, lse) of a fused head: z = softcap(logit_scale *
    (h W^T + b)), x = z / temperature, lse [N, 1] = logsumexp_v x."""
    h = np.asarray(hidden, dtype=np.float64)
    w = np.asarray(weight, dtype=np.float64)
    z = h @ w.T
    if bias is not None:
        z = z + np.asarray(bias, dtype=np.float64)
    z = z * float(logit_scale)
    if softcap:
        z = float(softcap) * np.tanh(z / float(softcap))
    x = z / float(temperature)
    m = x.max(axis=1, keepdims=True)
    return h, w, z, x, m + np.log(np.exp(x - m).sum(axis=1, keepdims=True))


def fused_head_reference(hidden, weight, targets, bias=None, temperature=1.0, softcap=None, logit_scale=1.0):
    """float64 outputs of a fused lm_head call (TRL's ChunkedLogProbFunction,
    verl's FusedLinearForPPO; the server's hidden-states scoring): hidden
    [N, H], weight [V, H], bias [V] or None, targets [N] (numpy, any float
    dtype: widened exactly). Logits z = softcap(logit_scale * (h W^T + b)),
    x = z / temperature. Returns {"log_probs", "entropy", "log_sum_sq_probs",
    "mean_logits": float64 [N], "is_top1": bool [N] (lowest id first among
    equal maxima)}."""
    _, _, z, x, lse = _head_logits(hidden, weight, bias, temperature, softcap, logit_scale)
    lp = x - lse
    p = np.exp(lp)
    t = np.asarray(targets, dtype=np.int64)
    rows = np.arange(len(t))
    return {
        "log_probs": lp[rows, t],
        "entropy": -(p * lp).sum(axis=1),
        "log_sum_sq_probs": np.log((p * p).sum(axis=1)),
        "mean_logits": x.mean(axis=1),
        "is_top1": x.argmax(axis=1) == t,
    }


def head_backward_reference(hidden, weight, targets, grad_logprobs, grad_entropy=None, bias=None, temperature=1.0,
                            softcap=None, logit_scale=1.0):
    """float64 backward of the fused lm_head (docs/gradients.md; NeMo-RL
    DistributedLogprob.backward with ChunkedDistributedEntropy's term, TRL's
    ChunkedLogProbFunction.backward): rows hidden [N, H], weight [V, H],
    bias [V] or None, targets [N] (< 0: no logprob term), upstream
    dL/dlogprob and dL/dentropy [N]. Returns {"grad_hidden" [N, H],
    "grad_weight" [V, H], "grad_bias" [V], "log_probs", "entropy" [N]},
    float64."""
    h, w, z, x, lse = _head_logits(hidden, weight, bias, temperature, softcap, logit_scale)
    p = np.exp(x - lse)
    ent = lse[:, 0] - (p * x).sum(axis=1)
    t = np.asarray(targets, dtype=np.int64)
    rows = np.arange(len(t))
    scored = t >= 0
    g_lp = np.where(scored, np.asarray(grad_logprobs, dtype=np.float64), 0.0)
    g_ent = np.zeros(len(t)) if grad_entropy is None else np.asarray(grad_entropy, dtype=np.float64)
    gx = -g_lp[:, None] * p - g_ent[:, None] * p * (x - lse + ent[:, None])
    gx[rows[scored], t[scored]] += g_lp[scored]
    gz = gx / float(temperature)
    gs = gz * (1.0 - (z / float(softcap)) ** 2) if softcap else gz
    gy = gs * float(logit_scale)
    lp = np.where(scored, x[rows, np.maximum(t, 0)] - lse[:, 0], 0.0)
    return {"grad_hidden": gy @ w, "grad_weight": gy.T @ h, "grad_bias": gy.sum(axis=0), "log_probs": lp,
            "entropy": ent}


def distillation_reference(student_hidden, student_weight, teacher_hidden, teacher_weight, beta, temperature=1.0,
                           student_bias=None, student_scale=1.0, student_softcap=None, teacher_bias=None,
                           teacher_scale=1.0, teacher_softcap=None, grad_divergence=None, grad_cross_entropy=None):
    """float64 full-vocabulary distillation (docs/distillation.md; TRL 1.16's
    ChunkedDivergenceFunction, NeMo-RL's DistributedCrossEntropy): per token
    the divergence (beta 0: KL(p_t || p_s), 1: KL(p_s || p_t), between: the
    generalized JSD with m = (1 - beta) p_s + beta p_t), the soft-target
    cross entropy H(p_t, p_s) and the student's entropy; with upstream
    gradients the student's "grad_hidden" [N, H_s], "grad_weight" [V, H_s]
    and "grad_bias" [V] (computed from the definitions with np.log of the
    probabilities, not the kernels' closed forms)."""
    hs, ws, zs, xs, lse_s = _head_logits(student_hidden, student_weight, student_bias, temperature, student_softcap,
                                         student_scale)
    _, _, _, xt, lse_t = _head_logits(teacher_hidden, teacher_weight, teacher_bias, temperature, teacher_softcap,
                                      teacher_scale)
    log_ps, log_pt = xs - lse_s, xt - lse_t
    ps, pt = np.exp(log_ps), np.exp(log_pt)
    out = {"entropy": -(ps * log_ps).sum(axis=1), "cross_entropy": -(pt * log_ps).sum(axis=1)}
    fkl = (pt * (log_pt - log_ps)).sum(axis=1)
    rkl = (ps * (log_ps - log_pt)).sum(axis=1)
    if beta == 0:
        out["divergence"] = fkl
        g = ps - pt
    elif beta == 1:
        out["divergence"] = rkl
        g = ps * (log_ps - log_pt - rkl[:, None])
    else:
        log_m = np.log((1 - beta) * ps + beta * pt)
        kl_sm = (ps * (log_ps - log_m)).sum(axis=1)
        out["divergence"] = beta * (pt * (log_pt - log_m)).sum(axis=1) + (1 - beta) * kl_sm
        g = (1 - beta) * ps * (log_ps - log_m - kl_sm[:, None])
    if grad_divergence is not None:
        g_d = np.asarray(grad_divergence, dtype=np.float64)[:, None]
        g_ce = 0.0 if grad_cross_entropy is None else np.asarray(grad_cross_entropy, dtype=np.float64)[:, None]
        gx = g_d * g + g_ce * (ps - pt)
        gz = gx / float(temperature)
        gs = gz * (1.0 - (zs / float(student_softcap)) ** 2) if student_softcap else gz
        gy = gs * float(student_scale)
        out.update({"grad_hidden": gy @ ws, "grad_weight": gy.T @ hs, "grad_bias": gy.sum(axis=0)})
    return out


def gradient_error(expected, got):
    """"" when every element of ``got`` is within 1e-4 of its row's largest
    |expected| element plus 1e-7 (issue 47's fidelity bound; a 1-d array is
    one row), else a line naming the worst element."""
    e = np.atleast_2d(np.asarray(expected, dtype=np.float64))
    g = np.atleast_2d(np.asarray(got, dtype=np.float64))
    if e.shape != g.shape:
        return "shape %s, expected %s" % (list(g.shape), list(e.shape))
    bound = 1e-4 * np.abs(e).max(axis=1, keepdims=True) + 1e-7
    excess = np.abs(g - e) / bound
    if not np.all(np.isfinite(g)) or excess.max(initial=0.0) > 1.0:
        i = np.unravel_index(int(np.nanargmax(np.where(np.isfinite(excess), excess, np.inf))), excess.shape)
        return "element %s is %r, expected %r (bound %.3g)" % (tuple(int(k) for k in i), float(g[i]), float(e[i]),
                                                              float(bound[i[0], 0]))
    return ""


def within_spec(expected, got):
    """"" when every |got - expected| <= 2e-4 + 2e-5 |expected| (float
    arrays) or got == expected (bool arrays), else a line naming the worst
    element."""
    e = np.asarray(expected)
    g = np.asarray(got)
    if e.shape != g.shape:
        return "shape %s, expected %s" % (list(g.shape), list(e.shape))
    if e.dtype == bool:
        bad = np.nonzero(e != g.astype(bool))[0]
        return "" if not len(bad) else "at %d: %r, expected %r" % (bad[0], g[bad[0]], e[bad[0]])
    err = np.abs(g.astype(np.float64) - e)
    tol = 2e-4 + 2e-5 * np.abs(e)
    if e.size == 0 or (err <= tol).all():
        return ""
    i = int(np.argmax(err - tol))
    return "at %d: %r, expected %r (error %.3g, tolerance %.3g)" % (i, g.flat[i], e.flat[i], err.flat[i], tol.flat[i])


def mismatch_reference(service, rollout, compared, seq_out, cap, low, high):
    """float64 reference of the rollout outputs from the service's float32
    token logprobs ``service`` [n] and ``rollout`` [n]; ``compared`` [n]
    bool: scored and not ignore_index; ``seq_out`` [B + 1] output offsets."""
    s64, r64 = service.astype(np.float64), rollout.astype(np.float64)
    use = compared & ~np.isnan(r64) & ~(np.isneginf(s64) & np.isneginf(r64))
    with np.errstate(invalid="ignore", over="ignore"):
        l = np.where(use, s64 - r64, np.nan)
        ratio = np.where(use, np.minimum(np.exp(l), cap), np.nan)
        k3 = np.where(np.isinf(l), np.inf, np.expm1(l) - l)
        outside = (np.exp(l) < low) | (np.exp(l) > high)

    def stats(sel):
        n = int(sel.sum())
        if n == 0:
            nan = float("nan")
            return dict(tokens=0, mean_abs_log_ratio=nan, k1=nan, k3=nan, outside_band_fraction=nan, ratio=nan,
                        geo=nan)
        ls = l[sel]
        with np.errstate(invalid="ignore", over="ignore"):
            total = math.fsum(ls) if np.all(np.isfinite(ls)) else float(np.sum(ls))
            return dict(tokens=n, mean_abs_log_ratio=float(np.abs(ls).sum() / n), k1=-total / n,
                        k3=float(k3[sel].sum() / n), outside_band_fraction=float(outside[sel].sum() / n),
                        ratio=float(min(np.exp(total), cap)) if not math.isnan(total) else total,
                        geo=float(min(np.exp(total / n), cap)) if not math.isnan(total) else total)

    seqs = [stats(use & (np.arange(len(l)) >= a) & (np.arange(len(l)) < b)) for a, b in zip(seq_out[:-1], seq_out[1:])]
    return l, ratio, seqs, stats(use)
