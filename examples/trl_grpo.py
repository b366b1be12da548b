#!/usr/bin/env python3
"""GRPO with TRL, its no-gradient logprobs from the service (logprob_client.trl).

A tiny Qwen2-style model and a word-level tokenizer are made here (random
weights, no download) and saved as a checkpoint; a logprob-server with 2 CPU
workers holds that checkpoint's lm_head twice, as heads ``policy`` and
``reference``:

    logprob-server --workers 2 --backend cpu --lm-head policy=CKPT --lm-head reference=CKPT \\
        --allow-lm-head-updates --lm-head-retain 2

Then TRL's GRPOTrainer runs 3 steps (beta > 0: reference logprobs;
num_iterations = 2: old-policy logprobs) with two added lines::

    service = use_service(trainer, client)   # policy_head="policy", reference_head="reference"
    trainer.train()

The old-policy and reference logprobs (TRL's fused lm_head called without
gradients) come from the server; the policy's own, with gradients, from
TRL's kernel; the policy's lm_head is pushed as step-N after every step.

Run it in the TRL environment (``bash scripts/setup-trl.sh``) from a built
tree (``--bin-dir``, default build/bin):

    PYTHONPATH=client/python:build/python .venv-trl/bin/python examples/trl_grpo.py

(``--server HOST:PORT``: a running server with those heads, of this
script's model.) Exit status 0 when training ran and the service answered
exactly the no-gradient calls (4 of them), 1 otherwise.
"""

import argparse
import os
import subprocess
import sys
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.join(ROOT, "client", "python"))

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from logprob_client import LogprobClient  # noqa: E402
from logprob_client.trl import use_service  # noqa: E402

WORDS = ["<pad>", "<eos>", "<unk>"] + ["w%d" % i for i in range(61)]


def save_checkpoint(path):
    """A random tiny Qwen2ForCausalLM (untied lm_head) and its tokenizer."""
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(
        vocab_size=len(WORDS), hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=64, tie_word_embeddings=False, pad_token_id=0,
        eos_token_id=1, bos_token_id=None))
    tok = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    model.save_pretrained(path)
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                            unk_token="<unk>").save_pretrained(path)


def reward(completions, **kwargs):
    return [float(c.split().count("w5")) - 0.1 * len(c.split()) for c in completions]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bin-dir", default=os.path.join(ROOT, "build", "bin"))
    ap.add_argument("--server", default="", help="HOST:PORT of a running server (default: start one)")
    ap.add_argument("--port", type=int, default=0)
    a = ap.parse_args()
    work = tempfile.mkdtemp(prefix="trl_grpo_")
    ckpt = os.path.join(work, "ckpt")
    save_checkpoint(ckpt)
    server = None
    address = a.server
    if not address:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", a.port))
            address = "127.0.0.1:%d" % s.getsockname()[1]
        server = subprocess.Popen(
            [os.path.join(a.bin_dir, "logprob-server"), "--listen", address, "--workers", "2", "--backend", "cpu",
             "--lm-head", "policy=" + ckpt, "--lm-head", "reference=" + ckpt, "--allow-lm-head-updates",
             "--lm-head-retain", "2"],
            stdout=open(os.path.join(work, "server.log"), "wb"), stderr=subprocess.STDOUT)
    try:
        with LogprobClient(address, timeout=120) as client:
            if not client.health(wait=120):
                print("the server at %s did not become SERVING (log: %s)" % (address, work), file=sys.stderr)
                return 1
            args = GRPOConfig(output_dir=os.path.join(work, "out"), max_steps=3, per_device_train_batch_size=4,
                              num_generations=4, max_completion_length=6, beta=0.1, num_iterations=2,
                              learning_rate=0.05, bf16=False, use_cpu=True, logging_steps=1, report_to=[],
                              save_strategy="no", disable_tqdm=True)
            prompts = Dataset.from_dict({"prompt": ["w%d w%d w%d" % (i, i + 1, i + 2) for i in range(8)]})
            trainer = GRPOTrainer(model=ckpt, reward_funcs=reward, args=args, train_dataset=prompts,
                                  processing_class=PreTrainedTokenizerFast.from_pretrained(ckpt))
            # The two lines: no-gradient logprobs from the service, the policy's head pushed every step.
            service = use_service(trainer, client, policy_head="policy", reference_head="reference")
            trainer.train()
            service.remove()
            for log in trainer.state.log_history:
                if "kl" in log:
                    print("step %d: loss %.6f, kl %.6f" % (log["step"], log["loss"], log["kl"]))
            print("answered by the service: %s (policy version now %s); left to TRL's kernel: the calls with "
                  "gradients" % (dict(service.routed), service.policy_version))
            ok = dict(service.routed) == {"policy": 2, "reference": 2} and service.policy_version == "step-3"
            return 0 if ok else 1
    finally:
        if server is not None:
            server.terminate()
            server.wait(60)


if __name__ == "__main__":
    sys.exit(main())
