#!/usr/bin/env python3
"""The fused lm_head's forward and backward, TRL's ``ChunkedLogProbFunction``
contract with gradients, answered three ways (docs/benchmarks.md "The
lm_head's backward through the service (issue 47)"); the forward-only twin
is bench/trl_fused_head_bench.py, whose inputs, server start, rounds and
reporting this follows (its helpers are imported from it):

- service: ``head_autograd.service_logprobs`` (what ``logprob_client.trl``
  answers a call with gradients with: the forward by ``fused_head.score_rows``,
  the backward by ``fused_head.backward_rows``), its outputs' backward giving
  dL/dh to the trainer, the head's dL/dW summed on the workers under a
  gradient step (a new key per call), then read once
  (``read_head_gradients``: float32 [V, H]) and the step closed; a
  logprob-server with CPU workers holding the head;
- TRL fp32: ``trl.kernels.ChunkedLogProbFunction`` in this process with an
  fp32 head and fp32 hidden states (TRL's ``cast_lm_head_to_fp32=True``),
  hidden.grad and weight.grad from autograd;
- TRL bf16: the same with the bf16 head and hidden states (TRL's default in
  bf16 training; it accumulates the gradient GEMMs in fp32 and returns them
  in bf16).

Each case computes ``lp, ent = f(hidden, targets)`` (``outputs=("log_probs",
"entropy")``, temperature 1) and ``(lp * g_lp + ent * g_ent).sum().backward()``
with fixed random upstream gradients (g_lp ~ N(0, 1), g_ent ~ 0.3 N(0, 1)):
the trainer gets dL/dh [N, H] and dL/dW [V, H]. The service's hidden states
are the same values in fp32 (``--service-hidden bf16``: in bf16, whose dL/dh
then comes back rounded to bf16, as TRL's bf16 case returns it).

Beside them, the box's limit: torch's fp32 GEMMs of a forward and backward
([N, H] x [H, V]: the logits; the backward's recomputed logits, dL/dh = G W
and dL/dW = G^T h: 4 GEMMs, 8 N V H flops), in TRL's tiles
(TOKEN_CHUNK_SIZE x its vocabulary chunk, one reused buffer, fp32
accumulators, torch's threads, no softmax), timed in the same rounds; each
case's rate (8 N V H / its time) is reported as a fraction of it.

Interleaved rounds (each runs every case once, after one warm-up call per
case, which also gives the errors); medians reported, the ratio column is
the median of each round's time over TRL fp32's in that round.

Errors: max |error| against float64 of the same inputs (torch float64, in
blocks of 128 rows over all N tokens: the logits, log-normalisers, entropy
and dL/dlogits of every token): dL/dh over the first ``--check-rows``
rows, dL/dW over ``--check-vocab`` vocabulary rows (the targets of the
first tokens and random others; each row summed over all N tokens); with
``--tiny`` every row of both (the full dL/dW). Also the largest of
|error| / (the max |float64 element| of its row), the tests' bound being
1e-4 of it (client/python/tests/reference.py gradient_error).

Memory: each case is run again in a fresh subprocess of this script
(``--memory-case``), holding what a trainer holds for it (the head as the
model's parameter: bf16 for the service and TRL bf16, fp32 for TRL fp32;
the hidden states, targets, upstream gradients; the client for the
service); after one warm-up call the process's RSS high-water mark is
reset (``/proc/self/clear_refs`` 5), its RSS read, one call made, and
``VmHWM`` read from /proc/self/status: the peak RSS of a step and its
increase over the RSS before the call. The server's processes (server and
workers) are reported separately: their VmHWM over the whole run.

Default: a Qwen3-0.6B-size head (V = 151936, H = 1024, bf16, N(0, 0.02)),
4096 tokens of N(0, 1) hidden states (bf16). ``--tiny``: the tiny untied
Qwen2-style model of the TRL tests (as the forward bench: V = 64, H = 32,
float32 head; the service and TRL fp32 in fp32, TRL under bf16 autocast).

``--device cuda`` (a GPU machine): the service's workers are CUDA workers
(``--backend cuda``; ``--workers`` of them share the GPU), TRL's cases, the
torch GEMMs and the trainer's tensors are on the GPU (each call timed to
its torch.cuda.synchronize()); the service's hidden states go by CUDA IPC
for the forward and by bytes for the backward; no memory subprocesses (the
RSS says nothing of device memory): the trainer's torch.cuda peak
allocation per call is reported instead.

Usage (the TRL environment, scripts/setup-trl.sh):
  PYTHONPATH=client/python:build/python .venv-trl/bin/python bench/trl_head_backward_bench.py
      [--vocab 151936] [--hidden 1024] [--tokens 4096] [--workers 2] [--rounds 3]
      [--check-rows 512] [--check-vocab 1024] [--service-hidden fp32|bf16] [--torch-threads N]
      [--no-memory] [--tiny] [--device cpu|cuda]
"""

import argparse
import gc
import itertools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the forward bench, importable
import trl_fused_head_bench as fwd  # noqa: E402  (also puts client/python/tests on sys.path)
from trl_fused_head_bench import BIN, OUTPUTS, cpu_model, start_server  # noqa: E402

import torch  # noqa: E402
from trl.kernels import ChunkedLogProbFunction  # noqa: E402
from trl.kernels.chunked_logprob import TOKEN_CHUNK_SIZE  # noqa: E402
from trl.trainer.utils import _CHUNKED_LOGPROB_CHUNK_SIZE  # noqa: E402

from logprob_client import LogprobClient, fused_head  # noqa: E402
from logprob_client.head_autograd import service_logprobs  # noqa: E402

CASES = ("service", "trl_fp32", "trl_bf16")


def upstream(N):
    """The fixed upstream gradients of log_probs and entropy."""
    g = torch.Generator().manual_seed(1)
    return torch.randn(N, generator=g), torch.randn(N, generator=g) * 0.3


def check_vocab_rows(targets, V, k):
    """The vocabulary rows whose dL/dW is checked: the targets of the first
    k / 2 tokens and random others, sorted, k at most (every row if k >= V)."""
    if k >= V:
        return torch.arange(V)
    g = torch.Generator().manual_seed(2)
    chosen = set(int(t) for t in targets[:k // 2])
    for v in torch.randperm(V, generator=g).tolist():
        if len(chosen) >= k:
            break
        chosen.add(v)
    return torch.tensor(sorted(chosen))


def reference64(hidden, weight, targets, g_lp, g_ent, rows, vocab_rows, block=128):
    """float64 dL/dh of the first ``rows`` rows and dL/dW of ``vocab_rows``
    summed over all N tokens (the math of client/python/tests/reference.py
    head_backward_reference, temperature 1, no bias), in blocks of
    ``block`` tokens (memory: a few block x V doubles and the float64 head)."""
    w = weight.double()
    N, H = hidden.shape
    dh = torch.empty(rows, H, dtype=torch.float64)
    dw = torch.zeros(len(vocab_rows), H, dtype=torch.float64)
    for r0 in range(0, N, block):
        r1 = min(N, r0 + block)
        h = hidden[r0:r1].double()
        x = h @ w.T
        logp = x - torch.logsumexp(x, dim=-1, keepdim=True)
        del x
        p = logp.exp()
        ent = -(p * logp).sum(-1)
        gl, ge = g_lp[r0:r1].double(), g_ent[r0:r1].double()
        gx = p.mul_(-(gl[:, None] + ge[:, None] * (logp.add_(ent[:, None]))))  # -g_lp p - g_ent p (logp + ent)
        del logp
        gx[torch.arange(r1 - r0), targets[r0:r1]] += gl
        if r0 < rows:
            dh[r0:min(r1, rows)] = gx[:rows - r0] @ w
        dw += gx[:, vocab_rows].T @ h
        del gx, p
    return dh, dw


def errors(got, ref, rows=None):
    """(max |got - ref|, max of |got - ref| / its row's max |ref|)."""
    g = got.detach().cpu().double()
    if rows is not None:
        g = g[rows]
    err = (g - ref).abs()
    scale = ref.abs().max(dim=1, keepdim=True).values.clamp_min(1e-300)
    return float(err.max()), float((err / scale).max())


def torch_gemms(h32, w32):
    """torch's fp32 GEMMs of a fused-head forward and backward (4 GEMMs of
    2 N V H flops), in TRL's tiles into one reused buffer, fp32 accumulators."""
    N, H = h32.shape
    V = w32.shape[0]
    T, C = TOKEN_CHUNK_SIZE, _CHUNKED_LOGPROB_CHUNK_SIZE
    buf = torch.empty(min(N, T), C, device=h32.device)
    dh = torch.empty(N, H, device=h32.device)
    dw = torch.empty(V, H, device=h32.device)

    def run():
        with torch.no_grad():
            for t0 in range(0, N, T):  # forward: the logits
                h = h32[t0:t0 + T]
                for c0 in range(0, V, C):
                    torch.mm(h, w32[c0:c0 + C].t(), out=buf[:h.shape[0], :min(C, V - c0)])
            dh.zero_()
            dw.zero_()
            for t0 in range(0, N, T):  # backward: logits again, then G W and G^T h
                h = h32[t0:t0 + T]
                for c0 in range(0, V, C):
                    wc = w32[c0:c0 + C]
                    tile = buf[:h.shape[0], :wc.shape[0]]
                    torch.mm(h, wc.t(), out=tile)
                    dh[t0:t0 + T].addmm_(tile, wc)
                    dw[c0:c0 + C].addmm_(tile.t(), h)
    return run


def inputs(a, tmp):
    """weight [V, H], hidden [N, H], targets [N] and the server's --lm-head
    path: the forward bench's inputs (its synthetic head saved as
    safetensors, or the tiny model's directory)."""
    if a.tiny:
        return fwd.tiny(a, tmp)
    weight, hidden, targets, _ = fwd.synthetic(a)
    head_path = os.path.join(tmp, "head.safetensors")
    from logprob_client import safetensors

    safetensors.save(head_path, {"lm_head.weight": weight.view(torch.int16).numpy().view(np.uint16)},
                     bf16={"lm_head.weight"})
    return weight, hidden, targets, head_path


def case_names(a):
    if a.tiny:
        return {"service": "service (f32 head)", "trl_fp32": "TRL fp32 (cast_lm_head_to_fp32)",
                "trl_bf16": "TRL bf16 autocast (default)"}
    return {"service": "service (bf16 head)", "trl_fp32": "TRL fp32 (cast_lm_head_to_fp32)", "trl_bf16": "TRL bf16"}


def make_case(kind, a, weight, hidden, targets, g_lp, g_ent, client):
    """A call of case ``kind``: runs the forward and backward, returns
    (dL/dh, dL/dW) as the trainer gets them. Holds the case's own head
    parameter (see the docstring's Memory)."""
    if kind == "service":
        h0 = hidden.float() if a.service_hidden == "fp32" else hidden.to(torch.bfloat16)
        keys = itertools.count()
        prefix = "bench-%d-%d" % (os.getpid(), int(time.time()))

        def service():
            key = "%s-%d" % (prefix, next(keys))
            h = h0.detach().clone().requires_grad_(True)
            lp, ent, *_ = service_logprobs(client, h, targets, head="policy", outputs=OUTPUTS, gradient_step=key)
            (lp * g_lp + ent * g_ent).sum().backward()
            dw = client.read_head_gradients(key, head="policy").weight
            client.close_gradient_step(key)
            return h.grad, torch.from_numpy(dw)
        service.param = weight  # the model's head stays the trainer's (bf16 / the tiny model's f32)
        return service
    if kind == "trl_fp32":
        h0, w = hidden.float(), weight.float()
        autocast = False
    else:
        h0 = hidden if a.tiny else hidden.to(torch.bfloat16)
        w = weight.float() if a.tiny else weight.to(torch.bfloat16)
        autocast = a.tiny
    w = w.detach().requires_grad_(True)

    def trl():
        h = h0.detach().clone().requires_grad_(True)
        w.grad = None
        if autocast:
            with torch.autocast(hidden.device.type, dtype=torch.bfloat16):
                out = ChunkedLogProbFunction.apply(h, w, None, targets, 1.0, _CHUNKED_LOGPROB_CHUNK_SIZE, None, 1.0,
                                                   OUTPUTS)
        else:
            out = ChunkedLogProbFunction.apply(h, w, None, targets, 1.0, _CHUNKED_LOGPROB_CHUNK_SIZE, None, 1.0,
                                               OUTPUTS)
        (out[0] * g_lp + out[1] * g_ent).sum().backward()
        return h.grad, w.grad
    trl.param = w
    return trl


def synchronised(fn, dev):
    """``fn`` returning once the device's queued work is done (CUDA: timed
    to torch.cuda.synchronize())."""
    if dev.type != "cuda":
        return fn

    def run():
        out = fn()
        torch.cuda.synchronize()
        return out
    return run


def proc_status(pid="self"):
    """VmRSS and VmHWM of a process, bytes."""
    got = {}
    with open("/proc/%s/status" % pid) as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                k, v = line.split(":", 1)
                got[k] = int(v.split()[0]) * 1024
    return got


def memory_case(a):
    """--memory-case: one case's step in this fresh process (the docstring's
    Memory); prints one JSON line."""
    if a.torch_threads:
        torch.set_num_threads(a.torch_threads)
    tmp = tempfile.mkdtemp(prefix="trl_bwd_mem_")
    client = None
    try:
        weight, hidden, targets, _ = fwd.tiny(a, tmp) if a.tiny else fwd.synthetic(a)
        g_lp, g_ent = upstream(hidden.shape[0])
        if a.memory_case == "service":
            client = LogprobClient(a.address, timeout=600)
        fn = make_case(a.memory_case, a, weight, hidden, targets, g_lp, g_ent, client)
        del weight  # the case holds its own head parameter
        out = fn()  # warm-up: one-time allocations (oneDNN, the client's channel and regions)
        del out
        gc.collect()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        before = proc_status()["VmRSS"]
        out = fn()
        after = proc_status()
        print(json.dumps({"case": a.memory_case, "before": before, "peak": after["VmHWM"],
                          "dh": list(out[0].shape), "dw": list(out[1].shape)}), flush=True)
    finally:
        if client is not None:
            client.close()
        shutil.rmtree(tmp, ignore_errors=True)


def measure_memory(a, address):
    """Each case's step in a fresh subprocess: {kind: (peak, before) bytes}."""
    got = {}
    for kind in CASES:
        cmd = [sys.executable, os.path.abspath(__file__), "--memory-case", kind, "--address", address,
               "--vocab", str(a.vocab), "--hidden", str(a.hidden), "--tokens", str(a.tokens),
               "--service-hidden", a.service_hidden, "--torch-threads", str(a.torch_threads)]
        if a.tiny:
            cmd.append("--tiny")
        res = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=3600)
        line = [s for s in res.stdout.splitlines() if s.startswith("{")]
        if res.returncode != 0 or not line:
            print("memory of %s failed (rc %d): %s" % (kind, res.returncode, res.stderr[-2000:]), flush=True)
            continue
        m = json.loads(line[-1])
        got[kind] = (m["peak"], m["before"])
        print("memory %s: peak RSS %.0f MiB, %.0f MiB before the call" % (kind, m["peak"] / 2**20,
                                                                         m["before"] / 2**20), flush=True)
    return got


def server_memory(pid):
    """Sum of VmHWM over the server and its worker processes, bytes."""
    pids = [pid]
    try:
        import psutil

        pids += [c.pid for c in psutil.Process(pid).children(recursive=True)]
    except Exception:  # noqa: BLE001  (psutil missing: the server alone)
        pass
    total = 0
    for p in pids:
        try:
            total += proc_status(p).get("VmHWM", 0)
        except OSError:
            pass
    return total, len(pids)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--check-rows", type=int, default=512, help="tokens whose dL/dh is checked against float64")
    ap.add_argument("--check-vocab", type=int, default=1024, help="vocabulary rows whose dL/dW is checked")
    ap.add_argument("--service-hidden", choices=("fp32", "bf16"), default="fp32",
                    help="dtype of the hidden states the service case sends (and of its dL/dh)")
    ap.add_argument("--torch-threads", type=int, default=0, help="torch threads of TRL's cases (0: torch's default)")
    ap.add_argument("--no-memory", action="store_true", help="skip the per-case memory subprocesses")
    ap.add_argument("--tiny", action="store_true", help="the tiny model of the TRL tests (see the docstring)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="where the trainer's tensors and TRL run, and the service's workers' backend")
    ap.add_argument("--memory-case", choices=CASES, help=argparse.SUPPRESS)
    ap.add_argument("--address", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.memory_case:
        return memory_case(a)
    if a.torch_threads:
        torch.set_num_threads(a.torch_threads)
    tmp = tempfile.mkdtemp(prefix="trl_bwd_bench_")
    server = None
    try:
        weight, hidden, targets, head_path = inputs(a, tmp)
        V, H = weight.shape
        N = hidden.shape[0]
        rows = N if a.tiny else min(a.check_rows, N)
        vocab_rows = check_vocab_rows(targets, V, V if a.tiny else a.check_vocab)
        g_lp, g_ent = upstream(N)
        server, client = start_server(head_path, a.workers, tmp, 45700, backend=a.device)
        head = fused_head.head_info(client, "policy")
        names = case_names(a)
        dev = torch.device(a.device)
        on = [t.to(dev) for t in (weight, hidden, targets, g_lp, g_ent)]
        cases = {names[k]: synchronised(make_case(k, a, *on, client), dev) for k in CASES}
        cpu_kernel = client.server_info().lm_head_cpu_kernel or "none"
        print("%s; head %s [%d, %d] (server: %s, precision %s, CPU kernel %s), %d tokens, %d CPU workers, "
              "service hidden states %s, torch %s with %d threads, %d interleaved rounds, %s (torch ISA %s, "
              "ONEDNN_MAX_CPU_ISA %s), %d cores" %
              ("tiny Qwen2-style model" if a.tiny else "synthetic head", "float32" if weight.dtype == torch.float32
               else "bf16", V, H, fused_head._TORCH_DTYPE_NAMES.get(int(head.dtype)), head.precision, cpu_kernel, N,
               a.workers, a.service_hidden, torch.__version__, torch.get_num_threads(), a.rounds, cpu_model(),
               torch.backends.cpu.get_cpu_capability(), os.environ.get("ONEDNN_MAX_CPU_ISA", "unset"),
               os.cpu_count()), flush=True)
        h32, w32 = hidden.float(), weight.float()
        limit_name = "torch fp32 GEMMs (the box's, 4 per step)"
        limit = synchronised(torch_gemms(h32.to(dev), w32.to(dev)), dev)
        limit()  # warm-up
        t0 = time.perf_counter()
        ref_dh, ref_dw = reference64(h32, w32, targets, g_lp, g_ent, rows, vocab_rows)
        print("float64 reference (dL/dh of %d rows, dL/dW of %d vocabulary rows over %d tokens): %.1f s; "
              "max |dL/dh| %.3g, max |dL/dW| %.3g" % (rows, len(vocab_rows), N, time.perf_counter() - t0,
                                                      float(ref_dh.abs().max()), float(ref_dw.abs().max())),
              flush=True)
        times = {k: [] for k in list(cases) + [limit_name]}
        errs = {}
        for name, fn in cases.items():  # warm-up, and the errors
            t0 = time.perf_counter()
            dh, dw = fn()
            errs[name] = errors(dh[:rows], ref_dh) + errors(dw, ref_dw, vocab_rows)
            print("warm-up %s %.3f s (dL/dh %s %s, dL/dW %s %s)" % (name, time.perf_counter() - t0, dh.dtype,
                                                                    list(dh.shape), dw.dtype, list(dw.shape)),
                  flush=True)
            del dh, dw
        for r in range(a.rounds):
            line = []
            for name, fn in cases.items():
                t0 = time.perf_counter()
                out = fn()
                times[name].append(time.perf_counter() - t0)
                del out
                line.append("%s %.3f s" % (name, times[name][-1]))
            t0 = time.perf_counter()
            limit()
            times[limit_name].append(time.perf_counter() - t0)
            line.append("%s %.3f s" % (limit_name, times[limit_name][-1]))
            print("round %d: %s" % (r, ", ".join(line)), flush=True)
        del limit
        gc.collect()
        memory = {} if a.no_memory or a.device == "cuda" else measure_memory(a, client.bench_address)
        if a.device == "cuda":
            for name, fn in cases.items():
                torch.cuda.reset_peak_memory_stats()
                before = torch.cuda.memory_allocated()
                out = fn()
                print("%s: trainer torch.cuda peak allocated over the call %.0f MiB" %
                      (name, (torch.cuda.max_memory_allocated() - before) / 2**20), flush=True)
                del out
        srv, nproc = server_memory(server.pid)
        print("server processes (%d): VmHWM summed %.0f MiB over the run" % (nproc, srv / 2**20), flush=True)
        base = times[list(cases)[1]]
        flops = 8.0 * N * V * H
        print("\n| case | median s | GEMM GFLOP/s (8 N V H / time) | time / TRL fp32's (median of rounds) | "
              "fraction of the box's GEMMs (its time / the case's, median of rounds) | max err dL/dh (row-rel.) | "
              "max err dL/dW (row-rel.) | trainer peak RSS MiB (over the RSS before the call) |")
        print("|---|---|---|---|---|---|---|---|")
        kinds = dict(zip(cases, CASES))
        for name in list(cases) + [limit_name]:
            m = statistics.median(times[name])
            ratio = statistics.median([t / b for t, b in zip(times[name], base)])
            of_best = statistics.median([b / t for t, b in zip(times[name], times[limit_name])])
            if name in errs:
                e = errs[name]
                err = "%.2e (%.1e) | %.2e (%.1e)" % e
            else:
                err = "- | -"
            mem = memory.get(kinds.get(name))
            mem_s = "%.0f (+%.0f)" % (mem[0] / 2**20, (mem[0] - mem[1]) / 2**20) if mem else "-"
            print("| %s | %.3f | %.1f | %.2f | %.2f | %s | %s |" % (name, m, flops / m * 1e-9, ratio, of_best, err,
                                                                   mem_s))
        client.close()
    finally:
        if server is not None:
            server.terminate()
            server.wait(60)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
