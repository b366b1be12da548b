#!/usr/bin/env python3
"""TRL's no-gradient fused lm_head call, answered three ways (docs/benchmarks.md
"TRL's fused lm_head"; docs/rl-frameworks.md quotes the --tiny run):

- service: what logprob_client.trl answers it with (``fused_head.score_rows``:
  the Python client to the answer, hidden states through shared memory to a
  logprob-server with CPU workers holding the head);
- TRL fp32: ``trl.kernels.ChunkedLogProbFunction`` in this process with an
  fp32 head and fp32 hidden states (TRL's ``cast_lm_head_to_fp32=True``);
- TRL bf16: the same with the bf16 head and hidden states (TRL's default in
  bf16 training: the GEMM's tiles are bf16).

Beside them, the box's limit: torch's fp32 matmul of the same shape
([tokens, H] x [H, V], in TRL's row chunks into one reused buffer, torch's
threads), timed in the same rounds; each case's GEMM rate (2 tokens V H /
its time) is reported as a fraction of it, with the CPU's model and the ISA
torch dispatches to (ONEDNN_MAX_CPU_ISA, passed to the server too, emulates
an older CPU for its oneDNN).

Every case scores the same hidden states at the same targets, GRPO's
old-policy call (``outputs=("log_probs", "entropy")``, temperature 1), in
interleaved rounds (each round runs every case once); the medians are
reported, with each case's max |error| against float64 (log_probs and
entropy) over the first ``--check-rows`` rows (every row with ``--tiny``).

Default: a Qwen3-0.6B-size head (V = 151936, H = 1024, bf16, N(0, 0.02)),
4096 tokens of N(0, 1) hidden states (bf16). ``--tiny``: the tiny untied
Qwen2-style model of the TRL tests (client/python/tests/tiny_models.py,
V = 64, H = 32, float32 weights): hidden states and targets from its forward
pass under bf16 autocast (as TRL's default bf16 training runs it), scored
with its float32 head by the service and TRL fp32, and by TRL under bf16
autocast (the GEMM in bf16).

Usage (the TRL environment, scripts/setup-trl.sh):
  PYTHONPATH=client/python:build/python .venv-trl/bin/python bench/trl_fused_head_bench.py
      [--vocab 151936] [--hidden 1024] [--tokens 4096] [--workers 2] [--rounds 3]
      [--check-rows 512] [--torch-threads N] [--tiny]
"""

import argparse
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
BIN = os.environ.get("LOGPROB_BIN_DIR", os.path.join(ROOT, "build", "bin"))
sys.path.insert(0, os.path.join(ROOT, "client", "python", "tests"))  # tiny_models, reference

import torch  # noqa: E402
from trl.kernels import ChunkedLogProbFunction  # noqa: E402
from trl.trainer.utils import _CHUNKED_LOGPROB_CHUNK_SIZE  # noqa: E402

from logprob_client import LogprobClient, fused_head  # noqa: E402

OUTPUTS = ("log_probs", "entropy")


def reference64(hidden, weight, targets, rows):
    """float64 log_probs and entropy of the first ``rows`` rows, in blocks
    of 64 rows (memory: 64 x V doubles)."""
    w = weight[:].double()
    lp, ent = [], []
    for r0 in range(0, rows, 64):
        h = hidden[r0:min(rows, r0 + 64)].double()
        z = h @ w.T
        logp = torch.log_softmax(z, dim=-1)
        lp.append(logp.gather(1, targets[r0:r0 + len(h), None]).squeeze(1))
        ent.append(-(logp.exp() * logp).sum(-1))
    return torch.cat(lp), torch.cat(ent)


def max_errors(out, ref, rows):
    return tuple(float((o[:rows].double() - r).abs().max()) for o, r in zip(out, ref))


def cpu_model():
    """/proc/cpuinfo's model name (the platform's processor elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def torch_matmul(h32, w32):
    """torch's fp32 GEMM of the lm_head's shape, in TRL's row chunks into one buffer."""
    chunk = _CHUNKED_LOGPROB_CHUNK_SIZE
    buf = torch.empty(min(chunk, h32.shape[0]), w32.shape[0])
    wt = w32.t()

    def run():
        with torch.no_grad():
            for r0 in range(0, h32.shape[0], chunk):
                h = h32[r0:r0 + chunk]
                torch.mm(h, wt, out=buf[:h.shape[0]])
    return run


def synthetic(a):
    g = torch.Generator().manual_seed(0)
    V, H, N = a.vocab, a.hidden, a.tokens
    weight = (torch.randn(V, H, generator=g) * 0.02).to(torch.bfloat16)
    hidden = torch.randn(N, H, generator=g).to(torch.bfloat16)
    targets = torch.randint(0, V, (N,), generator=g)
    return weight, hidden, targets, None


def tiny(a, tmp):
    """The tiny model's head (float32) and its bf16-autocast hidden states."""
    import tiny_models

    model_dir = os.path.join(tmp, "model")
    model = tiny_models.save_model("qwen2", model_dir, seed=0)
    tok = tiny_models.tokenizer()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, tiny_models.VOCAB, (64, 33), generator=g)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        hidden = model.model(input_ids=ids).last_hidden_state[:, :-1].reshape(-1, tiny_models.HIDDEN)
    del tok
    return model.lm_head.weight.detach(), hidden.detach(), ids[:, 1:].reshape(-1), model_dir


def start_server(head_path, workers, tmp, port_base, backend="cpu"):
    """A logprob-server with ``workers`` workers of ``backend`` (cpu or
    cuda) holding ``head_path`` as head "policy" (its log in ``tmp``), and
    a client of it once SERVING: (process, client); the client's
    ``bench_address`` is the server's address."""
    address = "127.0.0.1:%d" % (port_base + os.getpid() % 500)
    log = open(os.path.join(tmp, "server.log"), "wb")
    server = subprocess.Popen([os.path.join(BIN, "logprob-server"), "--listen", address, "--workers", str(workers),
                               "--backend", backend, "--lm-head", "policy=" + head_path, "--max-request-bytes",
                               str(1 << 30)], stdout=log, stderr=subprocess.STDOUT)
    client = LogprobClient(address, timeout=600)
    client.bench_address = address
    if not client.health(wait=300):
        raise SystemExit("server did not become SERVING; log in %s" % tmp)
    return server, client


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--check-rows", type=int, default=512)
    ap.add_argument("--torch-threads", type=int, default=0, help="torch threads of TRL's cases (0: torch's default)")
    ap.add_argument("--tiny", action="store_true", help="the tiny model of the TRL tests (see the docstring)")
    a = ap.parse_args()
    if a.torch_threads:
        torch.set_num_threads(a.torch_threads)
    tmp = tempfile.mkdtemp(prefix="trl_fused_bench_")
    server = None
    try:
        if a.tiny:
            weight, hidden, targets, head_path = tiny(a, tmp)
        else:
            weight, hidden, targets, _ = synthetic(a)
            head_path = os.path.join(tmp, "head.safetensors")
            from logprob_client import safetensors

            safetensors.save(head_path, {"lm_head.weight": weight.view(torch.int16).numpy().view(np.uint16)},
                             bf16={"lm_head.weight"})
        V, H = weight.shape
        N = hidden.shape[0]
        rows = N if a.tiny else min(a.check_rows, N)
        server, client = start_server(head_path, a.workers, tmp, 45200)
        head = fused_head.head_info(client, "policy")
        w32 = weight.float()
        w16 = weight.to(torch.bfloat16)
        h32 = hidden.float()

        def service():
            out = fused_head.score_rows(client, hidden, targets, head="policy", outputs=OUTPUTS)
            return out["log_probs"], out["entropy"]

        def trl(h, w, autocast=False):
            def run():
                with torch.no_grad():
                    if autocast:
                        with torch.autocast("cpu", dtype=torch.bfloat16):
                            out = ChunkedLogProbFunction.apply(h, w, None, targets, 1.0, _CHUNKED_LOGPROB_CHUNK_SIZE,
                                                               None, 1.0, OUTPUTS)
                    else:
                        out = ChunkedLogProbFunction.apply(h, w, None, targets, 1.0, _CHUNKED_LOGPROB_CHUNK_SIZE,
                                                           None, 1.0, OUTPUTS)
                return out[0], out[1]
            return run

        if a.tiny:
            cases = {"service (f32 head)": service, "TRL fp32 (cast_lm_head_to_fp32)": trl(h32, w32),
                     "TRL bf16 autocast (default)": trl(hidden, w32, autocast=True)}
        else:
            cases = {"service (bf16 head)": service, "TRL fp32 (cast_lm_head_to_fp32)": trl(h32, w32),
                     "TRL bf16": trl(hidden, w16)}
        cpu_kernel = client.server_info().lm_head_cpu_kernel or "none"
        print("%s; head %s [%d, %d] (server: %s, precision %s, CPU kernel %s), %d tokens, %d CPU workers, "
              "torch %s with %d threads, %d interleaved rounds, %s (torch ISA %s, ONEDNN_MAX_CPU_ISA %s), %d cores" %
              ("tiny Qwen2-style model" if a.tiny else "synthetic head", "float32" if weight.dtype == torch.float32
               else "bf16", V, H, fused_head._TORCH_DTYPE_NAMES.get(int(head.dtype)), head.precision, cpu_kernel, N,
               a.workers, torch.__version__, torch.get_num_threads(), a.rounds, cpu_model(),
               torch.backends.cpu.get_cpu_capability(), os.environ.get("ONEDNN_MAX_CPU_ISA", "unset"),
               os.cpu_count()), flush=True)
        limit_name = "torch fp32 matmul (the box's GEMM)"
        limit = torch_matmul(h32, w32)
        limit()  # warm-up
        t0 = time.perf_counter()
        ref = reference64(h32, w32, targets, rows)
        print("float64 reference of %d rows: %.1f s" % (rows, time.perf_counter() - t0), flush=True)
        times = {k: [] for k in list(cases) + [limit_name]}
        errors = {}
        for name, fn in cases.items():  # warm-up, and the errors
            errors[name] = max_errors(fn(), ref, rows)
        for r in range(a.rounds):
            line = []
            for name, fn in cases.items():
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
                line.append("%s %.3f s" % (name, times[name][-1]))
            t0 = time.perf_counter()
            limit()
            times[limit_name].append(time.perf_counter() - t0)
            line.append("%s %.3f s" % (limit_name, times[limit_name][-1]))
            print("round %d: %s" % (r, ", ".join(line)), flush=True)
        base = times[list(cases)[1]]
        flops = 2.0 * N * V * H
        print("\n| case | median s | GEMM GFLOP/s | time / TRL fp32's (median of rounds) | fraction of the box's GEMM "
              "(its time / the case's, median of rounds) | max err log_probs | max err entropy |")
        print("|---|---|---|---|---|---|---|")
        for name in list(cases) + [limit_name]:
            m = statistics.median(times[name])
            ratio = statistics.median([t / b for t, b in zip(times[name], base)])
            of_best = statistics.median([b / t for t, b in zip(times[name], times[limit_name])])
            err = errors.get(name, (float("nan"), float("nan")))
            print("| %s | %.3f | %.1f | %.2f | %.2f | %.2e | %.2e |" % (name, m, flops / m * 1e-9, ratio, of_best,
                                                                       err[0], err[1]))
        client.close()
    finally:
        if server is not None:
            server.terminate()
            server.wait(60)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
