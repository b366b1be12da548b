#!/usr/bin/env python3
"""One GRPO step with a Hugging Face model, its logprobs from the service.

What a trainer does each step, on a small randomly initialised
``LlamaForCausalLM`` (config built here, fixed seed, no download):

1. rollouts: G completions of each prompt sampled with ``generate``, a toy
   reward per completion, group-normalised advantages;
2. old-policy and reference logprobs of the sampled tokens from the service:
   the policy's and the frozen reference model's final hidden states go to
   one logprob-server that holds both ``lm_head``s (heads ``policy`` and
   ``reference``), each call pinned to a head version;
3. the clipped-ratio policy loss and the k3 KL to the reference in torch,
   from the policy's own forward pass (the only one with a gradient), and
   one optimizer step;
4. the policy's new ``lm_head`` pushed to the server (``update_lm_head``),
   and the next step's scores: the new version against the model's own
   logits, and against the scores of the version before.

It needs a server with lm_head updates. By default it starts one from
``--bin-dir`` (build/bin):

    logprob-server --workers 2 --backend cpu --lm-head policy=POLICY.safetensors \\
        --lm-head reference=REF.safetensors --allow-lm-head-updates --lm-head-retain 2

(``--server HOST:PORT`` uses a running server with those two heads, of this
script's model: ``--vocab`` and the seed must match). Run it in the
examples' environment (``bash scripts/setup-examples.sh``):

    .venv-examples/bin/python examples/grpo_step.py

Exit status 0 when the step ran and the service's scores match the model's
own logprobs (float32: within 1e-4), 1 otherwise, 2 when something needed
is missing (transformers, the binaries, lm_head updates in the server).
"""

import copy
import os
import sys
import tempfile

# first: it sets up the environment
from example_support import (example_parser, have_transformers, save_lm_head, start_server,  # noqa: E402
                             stop_server, tiny_llama, wait_ready)

import torch  # noqa: E402

from logprob_client import LogprobClient  # noqa: E402

TOLERANCE = 1e-4  # float32 weights and hidden states, f32 GEMM on the server (see examples/hf_logprobs.py)


def head_versions(client):
    """{head name: version} of the server's heads; exits (2) with a message
    when the server has no lm_head updates."""
    info = client.server_info(refresh=True)
    heads = getattr(info, "lm_heads", None)
    if heads is None:
        print("grpo_step: this server (%s) has no lm_head updates (ServerInfo.lm_heads): it needs a build with "
              "--allow-lm-head-updates and named heads" % info.version, file=sys.stderr)
        sys.exit(2)
    return {h.name: h.version for h in heads}


def final_hidden(model, input_ids, attention_mask):
    """The model's final hidden states [B, S, H] (after the final norm: the
    lm_head's input), without gradient."""
    with torch.no_grad():
        out = model(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True, use_cache=False)
    return out.hidden_states[-1]


def torch_logprobs(model, input_ids, attention_mask):
    """Logprobs of input_ids[:, t + 1] at row t under ``model``, in torch
    (with gradient when enabled): [B, S - 1]."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    return logp.gather(-1, input_ids[:, 1:, None]).squeeze(-1)


def service_logprobs(client, hidden, input_ids, attention_mask, head, version):
    """The same from the service: [B, S - 1], row t scores input_ids[:, t + 1]
    (0 past each sequence), scored by ``head`` at ``version``."""
    res = client.score(hidden_states=hidden, input_ids=input_ids, attention_mask=attention_mask,
                       head=head, head_version=version)
    assert (res.head, res.head_version) == (head, version), (res.head, res.head_version, head, version)
    return res.token_logprobs


def rollouts(policy, args, generator):
    """``args.prompts`` random prompts, ``args.group`` sampled completions
    each, of ``args.new_tokens`` tokens (no EOS: every completion has the
    same length, so no padding). Returns (sequences [B, S], prompt length)."""
    prompts = torch.randint(0, args.vocab, (args.prompts, args.prompt_len), generator=generator)
    prompts = prompts.repeat_interleave(args.group, dim=0)
    torch.manual_seed(args.seed + 2)  # generate samples with torch's global generator
    with torch.no_grad():
        sequences = policy.generate(
            prompts, attention_mask=torch.ones_like(prompts), do_sample=True, top_k=0, top_p=1.0, temperature=1.0,
            max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, pad_token_id=0, eos_token_id=None)
    return sequences, args.prompt_len


def main():
    parser = example_parser(__doc__.split("\n")[0])
    parser.add_argument("--server", help="HOST:PORT of a running server with heads 'policy' and 'reference'")
    parser.add_argument("--vocab", type=int, default=1031)
    parser.add_argument("--prompts", type=int, default=4, help="prompts per step")
    parser.add_argument("--group", type=int, default=4, help="completions per prompt (the GRPO group)")
    parser.add_argument("--prompt-len", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=12)
    parser.add_argument("--lr", type=float, default=1e-3, help="Adam learning rate")
    parser.add_argument("--clip", type=float, default=0.2, help="PPO clip range epsilon")
    parser.add_argument("--kl-coef", type=float, default=0.04, help="beta of the k3 KL term")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if not have_transformers("grpo_step"):
        return 2

    policy = tiny_llama(args.seed, args.vocab)
    reference = copy.deepcopy(policy).eval().requires_grad_(False)  # frozen at the start of training
    optimizer = torch.optim.Adam(policy.parameters(), lr=args.lr)
    g = torch.Generator().manual_seed(args.seed + 1)

    with tempfile.TemporaryDirectory(prefix="grpo_step_") as folder:
        server = log_path = None
        address = args.server
        if address is None:
            heads = {name: save_lm_head(model, os.path.join(folder, name + ".safetensors"))
                     for name, model in (("policy", policy), ("reference", reference))}
            server, address, log_path = start_server(args.bin_dir, heads, folder, "grpo_step",
                                                     ["--allow-lm-head-updates", "--lm-head-retain", "2"])
        try:
            with LogprobClient(address, timeout=120) as client:
                # A server that exits: e.g. a build without lm_head updates.
                if not wait_ready(client, server, log_path, "grpo_step",
                                  "lm_head updates (named heads, --allow-lm-head-updates)"):
                    return 2
                return step(client, policy, reference, optimizer, args, g)
        finally:
            if server is not None:
                stop_server(server)


def step(client, policy, reference, optimizer, args, g):
    versions = head_versions(client)
    missing = {"policy", "reference"} - set(versions)
    if missing:
        print("grpo_step: the server has no head %s (heads: %s)" % (sorted(missing), sorted(versions)),
              file=sys.stderr)
        return 2
    v_old, v_ref = versions["policy"], versions["reference"]
    print("heads: policy %s, reference %s" % (v_old, v_ref))

    # 1. Rollouts and rewards (a toy reward: the share of sampled ids below V / 2).
    policy.eval()
    sequences, prompt_len = rollouts(policy, args, g)
    mask = torch.ones_like(sequences)  # no padding: every completion has new_tokens tokens
    completions = sequences[:, prompt_len:]
    rewards = (completions < args.vocab // 2).float().mean(dim=1)
    grouped = rewards.view(args.prompts, args.group)
    advantages = ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-6)).view(-1)
    # Row t scores sequences[:, t + 1]: the completion's tokens are rows prompt_len - 1 ...
    response = torch.zeros(sequences.shape[0], sequences.shape[1] - 1)
    response[:, prompt_len - 1:] = 1.0
    print("rollouts: %d sequences of %d tokens (%d prompt + %d sampled), mean reward %.3f"
          % (sequences.shape[0], sequences.shape[1], prompt_len, completions.shape[1], rewards.mean()))

    # 2. Old-policy and reference logprobs from the service (no gradient needed).
    old_logp = service_logprobs(client, final_hidden(policy, sequences, mask), sequences, mask, "policy", v_old)
    ref_logp = service_logprobs(client, final_hidden(reference, sequences, mask), sequences, mask, "reference", v_ref)

    # 3. The loss from the policy's own forward pass, and one optimizer step.
    policy.train()
    logp = torch_logprobs(policy, sequences, mask)
    worst = (logp.detach() - old_logp).abs().mul(response).max().item()  # the service scored this very policy
    ratio = torch.exp(logp - old_logp)
    adv = advantages[:, None]
    pg = -torch.min(ratio * adv, ratio.clamp(1 - args.clip, 1 + args.clip) * adv)
    kl = torch.exp(ref_logp - logp) - (ref_logp - logp) - 1  # k3 estimator of KL(policy || reference)
    per_token = pg + args.kl_coef * kl
    loss = (per_token * response).sum() / response.sum()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    print("step: loss %.4f, KL(policy || reference) %.2e, |policy logprobs - service's| max %.2e"
          % (loss.item(), ((kl * response).sum() / response.sum()).item(), worst))

    # 4. Push the policy's new lm_head; the next step's scores use it.
    policy.eval()
    v_new = client.update_lm_head("policy", policy.lm_head.weight.detach(), version="step-1")
    print("pushed the policy's lm_head: version %s (heads now: %s)" % (v_new, head_versions(client)))
    hidden = final_hidden(policy, sequences, mask)
    new_logp = service_logprobs(client, hidden, sequences, mask, "policy", v_new)
    stale = service_logprobs(client, hidden, sequences, mask, "policy", v_old)  # the old head, still retained
    with torch.no_grad():
        model_logp = torch_logprobs(policy, sequences, mask)
    worst_new = (new_logp - model_logp).abs().mul(response).max().item()
    n = response.sum()
    print("next step: mean logprob of the sampled tokens %.4f -> %.4f (policy version %s -> %s)"
          % ((old_logp * response).sum() / n, (new_logp * response).sum() / n, v_old, v_new))
    print("  |new version - model's own logprobs| max %.2e; |new - old version, same hidden states| mean %.2e"
          % (worst_new, ((new_logp - stale).abs() * response).sum() / n))
    # GRPO's effect: sampled tokens of completions better than their group's
    # mean become more likely, those of worse ones less likely.
    delta = ((new_logp - old_logp) * response).sum(1) / response.sum(1)
    for sign, pick in (("> 0", advantages > 0), ("< 0", advantages < 0)):
        if pick.any():
            print("  completions with advantage %s: mean logprob change %+.4f (%d sequences)"
                  % (sign, delta[pick].mean(), int(pick.sum())))
    ok = max(worst, worst_new) <= TOLERANCE
    print("largest difference from the model %.3g: %s (tolerance %g)"
          % (max(worst, worst_new), "OK" if ok else "FAILED", TOLERANCE))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
