#!/usr/bin/env python3
"""GRPO with TRL, its no-gradient logprobs from the service (logprob_client.trl).

TRL's GRPOTrainer runs a few steps (beta > 0: reference logprobs;
num_iterations = 2: old-policy logprobs) with two added lines::

    service = use_service(trainer, client)   # policy_head="policy", reference_head="reference"
    trainer.train()

The old-policy and reference logprobs (TRL's fused lm_head called without
gradients) come from the server; the policy's own, with gradients, from
TRL's kernel. The reference model's lm_head is pushed once; the policy's
before each generation that scores it, as version ``{run}-step-N``
(``--version-format``).

The model: ``--model`` (a hub id such as Qwen/Qwen2.5-0.5B-Instruct, or a
local checkpoint directory), by default a tiny random Qwen2-style model
and word-level tokenizer made here (no download). The server: ``--server
HOST:PORT``, one started with heads declared by the model's lm_head shape
(docs/rl-frameworks.md, TRL):

    build/bin/logprob-server --listen 127.0.0.1:50051 --workers 2 --backend cpu \
        --lm-head-declare policy=VxH:f32 --lm-head-declare reference=VxH:f32 \
        --allow-lm-head-updates --lm-head-retain 2

or, without ``--server``, one this script starts so (from ``--bin-dir``,
default build/bin). ``--bf16``: bf16 training with
``cast_lm_head_to_fp32=True`` (TRL's own lm_head calls then compute float32
logits from a float32 head, as the service does).

Run it in the TRL environment (``bash scripts/setup-trl.sh``):

    PYTHONPATH=client/python:build/python .venv-trl/bin/python examples/trl_grpo.py

or in several processes (DDP; gloo on the CPU), against a running server:

    PYTHONPATH=client/python:build/python .venv-trl/bin/torchrun --nproc_per_node 2 examples/trl_grpo.py \
        --server 127.0.0.1:50051

(every rank's no-gradient calls go to the service; rank 0 pushes the
policy and every rank scores on the version it committed; each rank
prints its own lines, prefixed ``[rank R]``).

Exit status 0 when training ran and the service answered exactly the
no-gradient calls, 1 otherwise.
"""

import argparse
import logging
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
from transformers import AutoConfig, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM  # noqa: E402
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


def head_shape(model):
    """``VxH`` of the model's lm_head (its config's vocab_size, hidden_size)."""
    config = AutoConfig.from_pretrained(model)
    config = getattr(config, "text_config", None) or config
    return "%dx%d" % (config.vocab_size, config.hidden_size)


def start_server(bin_dir, model, work, port):
    """A logprob-server with heads policy and reference declared by the
    model's lm_head shape (f32); returns (process, address)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
        address = "127.0.0.1:%d" % s.getsockname()[1]
    shape = head_shape(model)
    server = subprocess.Popen(
        [os.path.join(bin_dir, "logprob-server"), "--listen", address, "--workers", "2", "--backend", "cpu",
         "--lm-head-declare", "policy=%s:f32" % shape, "--lm-head-declare", "reference=%s:f32" % shape,
         "--allow-lm-head-updates", "--lm-head-retain", "2"],
        stdout=open(os.path.join(work, "server.log"), "wb"), stderr=subprocess.STDOUT)
    return server, address


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bin-dir", default=os.path.join(ROOT, "build", "bin"))
    ap.add_argument("--server", default="", help="HOST:PORT of a running server (default: start one)")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--model", default="", help="hub id or checkpoint directory (default: a tiny model made here)")
    ap.add_argument("--version-format", default="{run}-step-{step}",
                    help="the policy's version names, with {run} (a random id per run) and {step}")
    ap.add_argument("--bf16", action="store_true", help="bf16 training, with cast_lm_head_to_fp32=True")
    ap.add_argument("--max-steps", type=int, default=3)
    ap.add_argument("--num-iterations", type=int, default=2)
    a = ap.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not a.server:
        ap.error("%d processes (torchrun / accelerate launch): give --server HOST:PORT, one server for all of "
                 "them (each would start its own)" % world)
    rank = "[rank %s] " % os.environ.get("RANK", "0") if world > 1 else ""
    logging.basicConfig(level=logging.WARNING, format=rank + "%(name)s: %(message)s")
    logging.getLogger("logprob_client.trl").setLevel(logging.INFO)  # its line: what goes to the service
    work = tempfile.mkdtemp(prefix="trl_grpo_")
    model = a.model
    if not model:
        model = os.path.join(work, "ckpt")
        save_checkpoint(model)
    server = None
    address = a.server
    if not address:
        server, address = start_server(a.bin_dir, model, work, a.port)
    try:
        with LogprobClient(address, timeout=120) as client:
            if not client.health(wait=120):
                print("the server at %s did not become SERVING (log: %s)" % (address, work), file=sys.stderr)
                return 1
            args = GRPOConfig(output_dir=os.path.join(work, "out"), max_steps=a.max_steps,
                              per_device_train_batch_size=4, num_generations=4, max_completion_length=6, beta=0.1,
                              num_iterations=a.num_iterations, learning_rate=0.05, bf16=a.bf16,
                              cast_lm_head_to_fp32=a.bf16, use_cpu=not torch.cuda.is_available(), logging_steps=1,
                              report_to=[], save_strategy="no", disable_tqdm=True)
            prompts = Dataset.from_dict({"prompt": ["w%d w%d w%d" % (i, i + 1, i + 2) for i in range(8)]})
            # The checkpoint's tokenizer.json as is (AutoTokenizer would pick the
            # model type's tokenizer class, which the tiny word-level one is not).
            trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=prompts,
                                  processing_class=PreTrainedTokenizerFast.from_pretrained(model))
            # The two lines: no-gradient logprobs from the service, the policy's head pushed when they need it.
            service = use_service(trainer, client, policy_head="policy", reference_head="reference",
                                  version_format=a.version_format)
            trainer.train()
            service.remove()
            for log in trainer.state.log_history:
                if "kl" in log:
                    print("%sstep %d: loss %.6f, kl %.6f" % (rank, log["step"], log["loss"], log["kl"]))
            print("%sanswered by the service: %s; policy pushes: %d (version now %s); left to TRL's kernel: the "
                  "calls with gradients" % (rank, dict(service.routed), service.pushes, service.policy_version))
            # One generation every num_iterations steps, each with a reference
            # call, and a policy call (after a push) when num_iterations > 1.
            generations = -(-a.max_steps // a.num_iterations)
            policy = generations if service.policy_scored else 0
            want = {"reference": generations, "policy": policy} if policy else {"reference": generations}
            last = service.policy.name((generations - 1) * a.num_iterations) if policy else None
            ok = dict(service.routed) == want and service.pushes == policy and service.policy_version == last
            return 0 if ok else 1
    finally:
        if server is not None:
            server.terminate()
            server.wait(60)


if __name__ == "__main__":
    sys.exit(main())
