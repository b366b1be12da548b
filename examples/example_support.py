"""What the examples share: importing it keeps transformers offline (the
models are built in code) and puts this checkout's Python client on the
path when it is not installed; their command line and transformers check;
a tiny Llama model and its saved lm_head; a logprob-server started with
named heads, waited for and stopped.
"""

import argparse
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


def example_parser(description):
    """An argument parser with the examples' common flag, ``--bin-dir``."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--bin-dir", default=os.environ.get("LOGPROB_BIN_DIR", os.path.join(REPO, "build", "bin")),
                        help="folder of logprob-server and logprob-worker (default: build/bin)")
    return parser


def have_transformers(program):
    """True, after printing transformers' and torch's versions, when
    transformers imports; otherwise says how to install it (naming
    ``program``) and returns False."""
    try:
        import transformers
    except ImportError:
        print("%s: transformers is missing: run bash scripts/setup-examples.sh, then "
              ".venv-examples/bin/python examples/%s.py" % (program, program), file=sys.stderr)
        return False
    print("transformers %s, torch %s" % (transformers.__version__, torch.__version__))
    return True


def save_lm_head(model, path):
    """Saves ``model``'s output layer as ``lm_head.weight`` in the
    safetensors file ``path``; returns ``path``."""
    from safetensors.torch import save_file

    save_file({"lm_head.weight": model.lm_head.weight.detach().contiguous()}, path)
    return path


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


def wait_ready(client, proc, log_path, program, needs):
    """Waits (up to about 2 minutes) for the server ``proc`` (None: one the
    example did not start) to answer health; False, after printing why
    (its exit status and the end of its log, and that it ``needs`` what),
    when it exits or stays unready."""
    for _ in range(120):
        if client.health(wait=1):
            return True
        if proc is not None and proc.poll() is not None:
            with open(log_path, errors="replace") as f:
                log = f.read()
            print("%s: logprob-server exited (status %d); it needs %s. Its log:\n%s"
                  % (program, proc.returncode, needs, log[-2000:]), file=sys.stderr)
            return False
    print("%s: the server did not become ready" % program, file=sys.stderr)
    return False


def stop_server(proc):
    """Stops a server start_server started (SIGTERM, then SIGKILL after a minute)."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
