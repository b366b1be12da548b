"""Writes the golden cases of heads with a logit transform (issue 50):
hidden_softcap_bias_bf16 (a Gemma-2 head: final_logit_softcapping 30, with
a bias) and hidden_scale_bias_bf16 (a Cohere head: logit_scale 0.0625, with
a bias), each an inputs file, an expected file and a checkpoint directory
(config.json + model.safetensors with lm_head.weight BF16 and lm_head.bias
F32) that `logprob-server --lm-head DIR` reads.

The expected logits follow transformers' own forward passes step by step,
in float64 on the exact bf16 / f32 values (not the service's formula
softcap(scale * (h W^T + b)), so the golden checks that formula too):
  Gemma2ForCausalLM.forward: logits = self.lm_head(hidden_states);
    logits = logits / final_logit_softcapping; logits = torch.tanh(logits);
    logits = logits * final_logit_softcapping
  CohereForCausalLM.forward: logits = self.lm_head(hidden_states);
    logits = logits * self.logit_scale
with lm_head an nn.Linear(H, V, bias=True): h W^T + b. Then log_softmax;
token logprobs of the next token, entropy, log_sum_sq_probs, mean_logits.

Run from the repository root with Debian's python3 (numpy):
    python3 tests/data/golden/make_head_transforms.py
"""

import json
import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.join(ROOT, "client", "python"))

from logprob_client import safetensors  # noqa: E402
from logprob_client import bf16_bits_to_float32  # noqa: E402

GOLDEN = os.path.dirname(os.path.abspath(__file__))
V, H, B, T = 1000, 64, 2, 24


def bf16_bits(x):
    """float32 -> bf16 bits, round to nearest even (finite values)."""
    u = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def gemma2_logits(h, w, b, cap):
    logits = h @ w.T + b  # self.lm_head(hidden_states)
    logits = logits / cap
    logits = np.tanh(logits)
    return logits * cap


def cohere_logits(h, w, b, scale):
    logits = h @ w.T + b  # self.lm_head(hidden_states)
    return logits * scale


def expected(logits, ids):
    """Outputs of next-token scoring of [B, T, V] float64 logits."""
    x = logits[:, :-1, :]
    m = x.max(axis=-1, keepdims=True)
    lse = m + np.log(np.exp(x - m).sum(axis=-1, keepdims=True))
    lp = x - lse
    p = np.exp(lp)
    tgt = ids[:, 1:]
    return {
        "token_logprobs": np.take_along_axis(lp, tgt[..., None], axis=-1)[..., 0].astype(np.float32),
        "entropy": (-(p * lp).sum(axis=-1)).astype(np.float32),
        "log_sum_sq_probs": np.log((p * p).sum(axis=-1)).astype(np.float32),
        "mean_logits": x.mean(axis=-1).astype(np.float32),
    }


def write_case(name, head_dir, config, w_std, seed, logits_of):
    rng = np.random.default_rng(seed)
    w_bits = bf16_bits(rng.normal(0.0, w_std, size=(V, H)))
    bias = rng.normal(0.0, 2.0, size=V).astype(np.float32)
    h_bits = bf16_bits(rng.normal(0.0, 1.0, size=(B, T, H)))
    ids = rng.integers(0, V, size=(B, T)).astype(np.int64)
    os.makedirs(os.path.join(GOLDEN, head_dir), exist_ok=True)
    with open(os.path.join(GOLDEN, head_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
        f.write("\n")
    safetensors.save(os.path.join(GOLDEN, head_dir, "model.safetensors"),
                     {"lm_head.weight": w_bits, "lm_head.bias": bias}, bf16=("lm_head.weight",))
    safetensors.save(os.path.join(GOLDEN, name + ".safetensors"), {"hidden_states": h_bits, "input_ids": ids},
                     metadata={"alignment": "next_token", "lm_head": head_dir}, bf16=("hidden_states",))
    w = bf16_bits_to_float32(w_bits).astype(np.float64)
    h = bf16_bits_to_float32(h_bits).astype(np.float64)
    logits = logits_of(h, w, bias.astype(np.float64))
    out = expected(logits, ids)
    safetensors.save(os.path.join(GOLDEN, name + ".expected.safetensors"), out)
    print("%s: logits std %.2f, max |logit| %.2f" % (name, logits.std(), np.abs(logits).max()))


def main():
    cap, scale = 30.0, 0.0625
    # Logits of std ~25 before the cap: the softcap bends most of them.
    write_case("hidden_softcap_bias_bf16", "head_gemma2_softcap",
               {"model_type": "gemma2", "final_logit_softcapping": cap, "vocab_size": V, "hidden_size": H},
               3.0, 50, lambda h, w, b: gemma2_logits(h, w, b, cap))
    write_case("hidden_scale_bias_bf16", "head_cohere_scale",
               {"model_type": "cohere", "logit_scale": scale, "vocab_size": V, "hidden_size": H},
               2.0, 51, lambda h, w, b: cohere_logits(h, w, b, scale))


if __name__ == "__main__":
    main()
