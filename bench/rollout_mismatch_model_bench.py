#!/usr/bin/env python3
"""Rollout vs trainer mismatch on a small language model's hidden states, as
the service reports it (docs/SPEC.md "Rollout mismatch", "Sampling masks"):
a bf16 "rollout engine" (the whole model in bfloat16, sampling from its own
distribution) and a top-p engine (renormalised logprobs, with and without
the sampler's kept set replayed) against the service scoring the float32
model's final hidden states with its lm_head.

  .venv-trl/bin/python bench/rollout_mismatch_model_bench.py [--sequences 16] [--new-tokens 96] [--top-p 0.8]

Runs in the TRL environment (scripts/setup-trl.sh: torch, transformers,
tokenizers). No model's weights are reachable from the machines this
project runs on, so the model is trained here, once, and kept in --work
(default build/bench-rollout-model): a byte-level BPE tokenizer (4096 ids)
and a Llama-style model (4 layers, hidden 256, untied lm_head [4096, 256])
trained for --train-steps steps on the Python standard library's source
(this interpreter's), on the CPU. Starts its own logprob-server (build/bin,
one CPU worker) with that lm_head. Prints one table row per engine: the
request's figures (ScoreResponse.rollout_mismatch), and the model's
training loss and mean entropy.
"""

import argparse
import glob
import math
import os
import subprocess
import sys
import sysconfig
import tempfile
import time

import numpy as np
import torch

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
BIN = os.environ.get("LOGPROB_BIN_DIR", os.path.join(ROOT, "build", "bin"))
sys.path.insert(0, os.path.join(ROOT, "client", "python"))
sys.path.insert(0, os.path.join(ROOT, "build", "python"))

from logprob_client import LogprobClient  # noqa: E402

VOCAB, HIDDEN, LAYERS, CONTEXT = 4096, 256, 4, 256


def corpus():
    """The text of this Python's standard library modules (sorted paths)."""
    paths = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))
    return [open(p, encoding="utf-8", errors="replace").read() for p in paths]


def train(work, steps, seed):
    """Trains (or loads from ``work``) the tokenizer and model; returns
    (tokenizer, float32 model, final training loss)."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import LlamaConfig, LlamaForCausalLM

    done = os.path.join(work, "trained-%d-steps" % steps)
    if os.path.exists(done):
        tok = ByteLevelBPETokenizer(os.path.join(work, "vocab.json"), os.path.join(work, "merges.txt"))
        model = LlamaForCausalLM.from_pretrained(work, torch_dtype=torch.float32)
        return tok, model.eval(), float(open(done).read())
    os.makedirs(work, exist_ok=True)
    texts = corpus()
    tok = ByteLevelBPETokenizer()
    tok.train_from_iterator(texts, vocab_size=VOCAB, min_frequency=2, show_progress=False)
    tok.save_model(work)
    ids = np.concatenate([np.array(e.ids, np.int64) for e in tok.encode_batch(texts)])
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=4 * HIDDEN, num_hidden_layers=LAYERS,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=CONTEXT,
                         tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.01)
    rng = np.random.default_rng(seed)
    batch, start, loss = 16, time.time(), float("nan")
    model.train()
    for step in range(steps):
        at = rng.integers(0, len(ids) - CONTEXT - 1, batch)
        x = torch.from_numpy(np.stack([ids[a:a + CONTEXT] for a in at]))
        for g in opt.param_groups:  # linear warm-up, cosine decay
            g["lr"] = 2e-3 * min(1.0, (step + 1) / 50) * 0.5 * (1 + math.cos(math.pi * step / steps))
        out = model(input_ids=x, labels=x)
        opt.zero_grad()
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        loss = float(out.loss.detach())
        if step % 100 == 0 or step == steps - 1:
            print("train: step %d/%d loss %.3f (%.0f s)" % (step + 1, steps, loss, time.time() - start),
                  file=sys.stderr)
    model.eval()
    model.save_pretrained(work, safe_serialization=True)
    with open(done, "w") as f:
        f.write(repr(loss))
    return tok, model, loss


def top_p_set(lp, p):
    """The kept ids of top-p over the log-probabilities ``lp`` [V] (the
    smallest set of largest probabilities whose mass reaches p), ascending."""
    order = torch.argsort(lp, descending=True, stable=True)
    n = int((torch.cumsum(lp[order].exp(), 0) < p).sum()) + 1
    return torch.sort(order[:n]).values


def generate(model, prompt, new_tokens, top_p, gen):
    """Samples ``new_tokens`` after ``prompt`` from ``model`` (the engine,
    whatever its dtype), one token at a time over the whole prefix; returns
    (sequence ids, engine logprob of each new token, kept sets or None).
    Under top-p the logprob is renormalised over the kept set (vLLM's
    processed logprobs)."""
    ids = list(prompt)
    logprobs, sets = [], []
    with torch.no_grad():
        for _ in range(new_tokens):
            logits = model(input_ids=torch.tensor([ids[-CONTEXT:]])).logits[0, -1].double()
            lp = torch.log_softmax(logits, 0)
            if top_p is not None:
                keep = top_p_set(lp, top_p)
                q = lp[keep] - torch.logsumexp(lp[keep], 0)
                j = int(torch.multinomial(q.exp(), 1, generator=gen))
                ids.append(int(keep[j]))
                logprobs.append(float(q[j]))
                sets.append(keep.numpy().astype(np.int32))
            else:
                t = int(torch.multinomial(lp.exp(), 1, generator=gen))
                ids.append(t)
                logprobs.append(float(lp[t]))
    return ids, logprobs, (sets if top_p is not None else None)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", default=os.path.join(ROOT, "build", "bench-rollout-model"))
    ap.add_argument("--train-steps", type=int, default=600)
    ap.add_argument("--sequences", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--top-p", type=float, default=0.8)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    tok, model, loss = train(args.work, args.train_steps, args.seed)
    engine_bf16 = type(model).from_pretrained(args.work, torch_dtype=torch.bfloat16).eval()
    texts = corpus()
    rng = np.random.default_rng(args.seed + 1)
    gen = torch.Generator().manual_seed(args.seed + 2)
    prompts = []
    while len(prompts) < args.sequences:
        text = texts[int(rng.integers(len(texts)))]
        ids = tok.encode(text).ids
        if len(ids) > args.prompt_tokens:
            a = int(rng.integers(len(ids) - args.prompt_tokens))
            prompts.append(ids[a:a + args.prompt_tokens])

    def hidden_of(seq):
        """The float32 model's final hidden states [T, H] of ``seq``."""
        with torch.no_grad():
            out = model.model(input_ids=torch.tensor([seq]))
        return out.last_hidden_state[0].float().numpy()

    with tempfile.TemporaryDirectory() as d:
        log = open(os.path.join(d, "server.log"), "w")
        port = 50000 + os.getpid() % 10000
        address = "127.0.0.1:%d" % port
        server = subprocess.Popen([os.path.join(BIN, "logprob-server"), "--listen", address, "--workers", "1",
                                   "--backend", "cpu", "--lm-head", "policy=" + args.work,
                                   "--max-request-bytes", str(1 << 30)], stdout=log, stderr=subprocess.STDOUT)
        try:
            with LogprobClient(address, max_request_bytes=1 << 30) as client:
                if not client.health(wait=120):
                    raise SystemExit("logprob-server did not start; see its log")

                def score(engine, top_p, name, replay):
                    rows = []
                    for prompt in prompts:
                        seq, lps, sets = generate(engine, prompt, args.new_tokens, top_p, gen)
                        rows.append((seq, lps, sets))
                    h = np.concatenate([hidden_of(seq) for seq, _, _ in rows])
                    ids = np.concatenate([seq for seq, _, _ in rows]).astype(np.int64)
                    cu = np.cumsum([0] + [len(seq) for seq, _, _ in rows]).astype(np.int64)
                    # Output t of a sequence scores its token t + 1 (T - 1 per
                    # sequence): NaN on the prompt.
                    rollout = np.concatenate([[np.nan] * (args.prompt_tokens - 1) + lps
                                              for _, lps, _ in rows]).astype(np.float32)
                    kw = {}
                    kept = []
                    if replay:
                        empty = np.zeros(0, np.int32)
                        per_pos = []
                        for _, _, sets in rows:
                            per_pos += [empty] * (args.prompt_tokens - 1) + sets
                            kept += [len(s) for s in sets]
                        offsets = np.cumsum([0] + [len(s) for s in per_pos]).astype(np.int64)
                        kw["sampling_mask"] = (offsets, np.concatenate(per_pos).astype(np.int32))
                    res = client.score(hidden_states=h, input_ids=ids, cu_seqlens=cu, head="policy",
                                       rollout_logprobs=rollout, entropy=True, **kw)
                    m = res.rollout_mismatch
                    print("| %s | %d | %.3g | %.3g | %.3g | %.2f%% |" % (
                        name, m["tokens"], m["mean_abs_log_ratio"], m["k1"], m["k3"],
                        100 * m["outside_band_fraction"]), flush=True)
                    return res, kept

                print("model: %d layers, hidden %d, vocabulary %d, trained %d steps (final training loss %.3f "
                      "nats/token)" % (LAYERS, HIDDEN, VOCAB, args.train_steps, loss))
                print("| rollout engine | tokens | mean abs l | k1 | k3 | r outside [0.9, 1.1] |")
                print("| --- | --- | --- | --- | --- | --- |")
                res, _ = score(engine_bf16, None, "bf16 model, full vocabulary", False)
                ent = res.outputs["entropy"]
                print("mean entropy of the float32 model on those tokens: %.3f nats" % float(np.nanmean(ent)))
                p = args.top_p
                score(model, p, "float32 model, top-p %.2g renormalised, scored over the full vocabulary" % p, False)
                _, kept = score(model, p, "float32 model, top-p %.2g renormalised, sampling mask replayed" % p, True)
                print("mean kept ids per token (top-p %.2g, the replayed run): %.1f" % (p, np.mean(kept)))
        finally:
            server.terminate()
            server.wait(30)


if __name__ == "__main__":
    main()
