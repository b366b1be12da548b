#!/usr/bin/env python3
"""Rollout vs trainer mismatch, as the service reports it (docs/SPEC.md
"Rollout mismatch", "Sampling masks"), on synthetic logits: how far a bf16
engine's logprobs and a top-p engine's renormalised logprobs are from the
float32 logprobs the service computes, and what replaying the sampler's
kept set (the sampling mask) leaves.

  python3 bench/rollout_mismatch_bench.py [--tokens 2048] [--vocab 32000] [--scale 3] [--top-p 0.8]

Starts its own logprob-server (build/bin, one CPU worker). The "model" is
random logits z ~ N(0, scale^2) per token: scale 3 gives an entropy of a
few nats per token, like a language model's. Tokens are sampled from each
engine's own distribution. Prints, per case, the request's figures
(ScoreResponse.rollout_mismatch).
"""

import argparse
import os
import subprocess
import sys
import tempfile

import numpy as np

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
BIN = os.environ.get("LOGPROB_BIN_DIR", os.path.join(ROOT, "build", "bin"))
sys.path.insert(0, os.path.join(ROOT, "client", "python"))
sys.path.insert(0, os.path.join(ROOT, "build", "python"))

from logprob_client import LogprobClient  # noqa: E402


def log_softmax(x):
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def bf16(x):
    """float32 rounded to bfloat16 (nearest even), as float32."""
    u = x.astype(np.float32).view(np.uint32)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return u.view(np.float32)


def top_p_sets(lp, p):
    """Each row's kept ids under top-p (the smallest set of largest
    probabilities whose mass reaches p), ascending."""
    order = np.argsort(-lp, axis=-1, kind="stable")
    probs = np.exp(np.take_along_axis(lp, order, axis=-1))
    keep_n = (np.cumsum(probs, axis=-1) < p).sum(axis=-1) + 1
    return [np.sort(order[i, :k]) for i, k in enumerate(keep_n)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--scale", type=float, default=3.0)
    ap.add_argument("--top-p", type=float, default=0.8)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = np.random.default_rng(args.seed)
    T, V = args.tokens, args.vocab
    z = (rng.standard_normal((T + 1, V)) * args.scale).astype(np.float32)  # row t scores token t + 1
    trainer = log_softmax(z.astype(np.float64))[:T]

    with tempfile.TemporaryDirectory() as d:
        log = open(os.path.join(d, "server.log"), "w")
        port = 50000 + os.getpid() % 10000
        address = "127.0.0.1:%d" % port
        server = subprocess.Popen([os.path.join(BIN, "logprob-server"), "--listen", address, "--workers", "1",
                                   "--backend", "cpu", "--max-request-bytes", str(1 << 30)],
                                  stdout=log, stderr=subprocess.STDOUT)
        try:
            with LogprobClient(address, max_request_bytes=1 << 30) as client:
                if not client.health(wait=60):
                    raise SystemExit("logprob-server did not start; see its log")

                def report(name, rollout_lp, sampled, **kw):
                    ids = np.concatenate([[0], sampled]).astype(np.int64)
                    res = client.score(z, ids, cu_seqlens=np.array([0, T + 1]), rollout_logprobs=rollout_lp, **kw)
                    m = res.rollout_mismatch
                    print("| %s | %d | %.3g | %.3g | %.3g | %.2f%% |" % (
                        name, m["tokens"], m["mean_abs_log_ratio"], m["k1"], m["k3"],
                        100 * m["outside_band_fraction"]))

                print("| case | tokens | mean abs l | k1 | k3 | r outside [0.9, 1.1] |")
                print("| --- | --- | --- | --- | --- | --- |")
                # A bf16 engine: the same model's logits rounded to bf16, sampled from its own distribution.
                engine = log_softmax(bf16(z).astype(np.float64))[:T]
                sampled = np.array([rng.choice(V, p=np.exp(row) / np.exp(row).sum()) for row in engine])
                report("bf16 logits, full vocabulary", engine[np.arange(T), sampled].astype(np.float32), sampled)
                # A top-p engine: float32 logits, top-p, the kept set renormalised (vLLM's processed logprobs).
                sets = top_p_sets(trainer, args.top_p)
                sampled, rollout = [], []
                for t, keep in enumerate(sets):
                    q = trainer[t, keep] - np.log(np.exp(trainer[t, keep]).sum())
                    j = rng.choice(len(keep), p=np.exp(q) / np.exp(q).sum())
                    sampled.append(keep[j])
                    rollout.append(q[j])
                sampled = np.array(sampled)
                rollout = np.array(rollout, np.float32)
                report("top-p %.2g renormalised, scored over the full vocabulary" % args.top_p, rollout, sampled)
                offsets = np.concatenate([[0], np.cumsum([len(k) for k in sets])]).astype(np.int64)
                mask_ids = np.concatenate(sets).astype(np.int32)
                report("top-p %.2g renormalised, sampling mask replayed" % args.top_p, rollout, sampled,
                       sampling_mask=(offsets, mask_ids))
                print("mean kept ids per token (top-p %.2g): %.1f" % (args.top_p, np.mean([len(k) for k in sets])))
        finally:
            server.terminate()
            server.wait(30)


if __name__ == "__main__":
    main()
