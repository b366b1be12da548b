"""What the examples share: importing it keeps transformers offline (the
models are built in code) and puts this checkout's Python client on the
path when it is not installed; a tiny Llama model; a logprob-server started
with named heads.
"""

import os
import socket
import subprocess
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the models are built here: never reach the Hugging Face Hub
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
try:
    import logprob_client  # noqa: F401  (installed, or on PYTHONPATH)
except ImportError:
    sys.path.insert(0, os.path.join(REPO, "client", "python"))  # the checkout's client (stubs from build/python)

import torch  # noqa: E402

HIDDEN = 64  # hidden size of tiny_llama


def tiny_llama(seed, vocab_size, tied=False):
    """A randomly initialised LlamaForCausalLM [vocab_size, HIDDEN] small
    enough for the CPU, in eval mode (no dropout either way), float32. Its
    output layer is re-drawn wider than the default initialisation so that
    distributions are peaked (distinct top-k) rather than flat; ``tied``
    shares it with the input embedding (``model.embed_tokens.weight``)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=HIDDEN, intermediate_size=176, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        tie_word_embeddings=tied, attn_implementation="eager", torch_dtype=torch.float32,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.normal_(0.0, 0.5)  # tied: the input embedding too
    return model


def free_port():
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(bin_dir, heads, folder, program, extra=()):
    """``bin_dir/logprob-server`` on a free loopback port with 2 CPU workers,
    the named heads ({name: safetensors path}) and ``extra`` flags, its log
    in ``folder/server.log``. Returns (process, address, log path); exits 2
    naming ``program`` when the binary is missing."""
    binary = os.path.join(bin_dir, "logprob-server")
    if not os.access(binary, os.X_OK):
        print("%s: %s not found: build the tree (bash scripts/build.sh) or pass --bin-dir" % (program, binary),
              file=sys.stderr)
        sys.exit(2)
    address = "127.0.0.1:%d" % free_port()
    args = [binary, "--listen", address, "--workers", "2", "--backend", "cpu"] + list(extra)
    for name, path in heads.items():
        args += ["--lm-head", "%s=%s" % (name, path)]
    log_path = os.path.join(folder, "server.log")
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
    return proc, address, log_path
