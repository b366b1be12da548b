#!/usr/bin/env python3
"""Token logprobs, entropy and top-k of a Hugging Face model, from the service.

A small ``LlamaForCausalLM`` (config built here, random weights with a fixed
seed: no download) runs a padded batch; its final hidden states (the last
entry of ``output_hidden_states``, after the final norm) go to a
logprob-server that holds the model's ``lm_head``, and the service returns
per-token logprobs, entropy and top-k. The script checks them against the
model's own ``model(...).logits`` (log-softmax in float64) and prints the
largest difference of each output.

It does this twice, for the two ways a checkpoint holds the output layer:

- untied: ``lm_head.weight`` saved alone as a ``.safetensors`` file, as a
  trainer would export its head (``--lm-head FILE``);
- tied (``tie_word_embeddings=True``): ``save_pretrained`` writes only
  ``model.embed_tokens.weight``; the server, given the checkpoint directory
  (``--lm-head DIR``), falls back to it.

Each variant starts its own ``logprob-server --workers 2 --backend cpu`` from
``--bin-dir`` (default: ``build/bin`` of this repository) and stops it at the
end. Run it in the examples' environment (``bash scripts/setup-examples.sh``:
transformers from PyPI, Debian's torch):

    .venv-examples/bin/python examples/hf_logprobs.py

Exit status 0 when every output is within the tolerance, 1 when one is not,
2 when something is missing. The tolerance: the weights and hidden states are
float32 and the server computes the ``lm_head`` GEMM in float32
(``--lm-head-precision auto`` is ``fp32`` for F32 weights), so the only
differences from the model's logits are float32 rounding in another
summation order: a few 1e-6 here, far below the 1e-4 checked (docs/SPEC.md
allows 2e-4 + 2e-5 |x|).
"""

import os
import sys
import tempfile
import time

# first: it sets up the environment
from example_support import (example_parser, have_transformers, save_lm_head, start_server,  # noqa: E402
                             stop_server, tiny_llama, wait_ready)

import torch  # noqa: E402

from logprob_client import LogprobClient  # noqa: E402

TOLERANCE = 1e-4  # float32 weights and hidden states (see the docstring)


def save_variant(model, tied, folder):
    """The model's output layer as a checkpoint the server reads: untied, a
    file holding ``lm_head.weight`` alone; tied, the model's own
    ``save_pretrained`` folder (its ``model.safetensors`` holds only
    ``model.embed_tokens.weight``). Returns (path for --lm-head, tensor the
    server should report)."""
    if tied:
        model.save_pretrained(folder, safe_serialization=True)
        return folder, "model.embed_tokens.weight"
    os.makedirs(folder, exist_ok=True)
    return save_lm_head(model, os.path.join(folder, "lm_head.safetensors")), "lm_head.weight"


def reference(logits, input_ids, lengths, k):
    """What the service computes (docs/SPEC.md, next_token alignment), from
    the model's logits in float64: row t scores input_ids[:, t + 1]."""
    logp = torch.log_softmax(logits.double()[:, :-1], dim=-1)  # [B, S - 1, V]
    token = logp.gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    topk_values, topk_ids = logp.topk(k, dim=-1)
    # Position t is scored when its target t + 1 lies within the sequence.
    scored = torch.arange(logits.shape[1] - 1)[None, :] + 1 < lengths[:, None]
    return logp, token, entropy, topk_values, topk_ids, scored


def check_variant(tied, args, folder):
    """Runs one variant; returns the largest difference of any output."""
    name = "tied (model.embed_tokens.weight)" if tied else "untied (lm_head.weight)"
    model = tiny_llama(args.seed, args.vocab, tied=tied)
    variant = os.path.join(folder, "tied" if tied else "untied")
    lm_head, tensor = save_variant(model, tied, variant)

    # A padded batch, right padding: lengths B, S - 3, S // 2.
    g = torch.Generator().manual_seed(args.seed + 1)
    b, s = 3, args.seq
    input_ids = torch.randint(0, args.vocab, (b, s), generator=g)
    lengths = torch.tensor([s, s - 3, s // 2])
    attention_mask = (torch.arange(s)[None, :] < lengths[:, None]).long()
    with torch.no_grad():
        out = model(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True, use_cache=False)
    hidden = out.hidden_states[-1]  # [B, S, H] float32, after the final norm: logits = hidden @ W^T

    server, address, log_path = start_server(args.bin_dir, {"default": lm_head}, variant, "hf_logprobs")
    try:
        with LogprobClient(address, timeout=120) as client:
            if not wait_ready(client, server, log_path, "hf_logprobs", "an lm_head it can load"):
                raise SystemExit(2)
            info = client.server_info()
            assert (info.vocab_size, info.hidden_size) == (args.vocab, 64), info
            assert info.lm_head_tensor == tensor, (info.lm_head_tensor, tensor)
            t0 = time.monotonic()
            res = client.score(hidden_states=hidden, input_ids=input_ids, attention_mask=attention_mask,
                               entropy=True, topk=args.topk)
            seconds = time.monotonic() - t0
    finally:
        stop_server(server)

    logp, token, entropy, topk_values, topk_ids, scored = reference(out.logits, input_ids, lengths, args.topk)
    diffs = {
        "token_logprobs": (res.token_logprobs.double() - token).abs()[scored].max().item(),
        "entropy": (res.entropy.double() - entropy).abs()[scored].max().item(),
        "topk_logprobs": (res.topk_logprobs.double() - topk_values).abs()[scored].max().item(),
    }
    # Top-k ids: the same ids, except where two candidates tie within the
    # tolerance (then either order is right): compare the model's logprob
    # at the service's ids with the reference's values.
    at_ids = logp.gather(-1, res.topk_indices)
    diffs["logprob at top-k ids"] = (at_ids - topk_values).abs()[scored].max().item()
    same_ids = (res.topk_indices == topk_ids)[scored].float().mean().item()
    # Positions past each length come back as 0.
    padding_zero = bool((res.token_logprobs[~scored] == 0).all())

    print("%s: lm_head %s [%d, %d] %s, %s precision, %d workers; scored %d positions in %.3f s" % (
        name, info.lm_head_tensor, info.vocab_size, info.hidden_size, info.lm_head_dtype,
        info.lm_head_precision, info.workers, int(scored.sum()), seconds))
    for what, d in diffs.items():
        print("  max |service - model log_softmax (float64)| %-22s %.3g" % (what, d))
    print("  top-%d ids equal to the reference's: %.1f %% of positions; padding scored 0: %s"
          % (args.topk, 100 * same_ids, padding_zero))
    worst = max(diffs.values())
    if not padding_zero:
        worst = float("inf")
    return worst


def main():
    parser = example_parser(__doc__.split("\n")[0])
    parser.add_argument("--vocab", type=int, default=1031, help="vocabulary size (uneven slices over 2 workers)")
    parser.add_argument("--seq", type=int, default=24, help="padded sequence length")
    parser.add_argument("--topk", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if not have_transformers("hf_logprobs"):
        return 2
    with tempfile.TemporaryDirectory(prefix="hf_logprobs_") as folder:
        worst = max(check_variant(tied, args, folder) for tied in (False, True))
    ok = worst <= TOLERANCE
    print("largest difference %.3g: %s (tolerance %g)" % (worst, "OK" if ok else "FAILED", TOLERANCE))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
