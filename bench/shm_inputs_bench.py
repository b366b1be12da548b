#!/usr/bin/env python3
"""Shared-memory inputs vs inline bytes (docs/benchmarks.md, "Shared-memory
inputs"): one hidden-states request of T x H bf16 (default 8192 x 4096 = 64 MiB)
against a random bf16 lm_head [V, H], from the Python client.

Per request and path (interleaved rounds, medians):
- client latency (LogprobClient.score wall time) and the server's handler time
  (the request's logprob_request_duration_seconds, from /metrics around it);
  their difference is what getting the bytes to the server costs;
- the front-end's peak RSS growth per request in flight: VmHWM is reset
  (/proc/PID/clear_refs 5), C requests are sent at once, and
  (VmHWM - VmRSS before) / C is reported (after warm-up rounds at the same C,
  so pooled payload regions already exist).

Usage: PYTHONPATH=client/python:build/python python3 bench/shm_inputs_bench.py
       [--rounds 7] [--tokens 8192] [--hidden 4096] [--vocab 2048] [--workers 2]
       [--concurrency 2] [--port 45113] [--lm-head-dtype bf16|f32]
"""

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

import numpy as np

from logprob_client import LogprobClient, safetensors

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def scrape(port):
    with urllib.request.urlopen("http://127.0.0.1:%d/metrics" % port, timeout=10) as f:
        return f.read().decode()


def handler_sum(text):
    """(count, sum) of logprob_request_duration_seconds of the scoring calls
    (Score, and ScoreChunked: the client sends a large inline request in
    pieces), all codes."""
    count = total = 0.0
    for line in text.splitlines():
        if 'method="Score"' not in line and 'method="ScoreChunked"' not in line:
            continue
        if line.startswith("logprob_request_duration_seconds_sum"):
            total += float(line.split()[-1])
        if line.startswith("logprob_request_duration_seconds_count"):
            count += float(line.split()[-1])
    return count, total


def status_kib(pid, key):
    with open("/proc/%d/status" % pid) as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return -1


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--concurrency", type=int, default=2)
    ap.add_argument("--port", type=int, default=45113)
    ap.add_argument("--lm-head-dtype", choices=("bf16", "f32"), default="bf16",
                    help="f32 where oneDNN has no bf16 matmul (CPUs without AVX-512)")
    args = ap.parse_args()
    T, H, V = args.tokens, args.hidden, args.vocab

    rng = np.random.default_rng(0)
    tmp = tempfile.mkdtemp(prefix="shm_bench_")
    lm_head = os.path.join(tmp, "lm_head.safetensors")
    w = (rng.standard_normal((V, H), dtype=np.float32) * 0.02).view(np.uint32)
    w = (w >> 16).astype(np.uint16)  # bf16 bits
    if args.lm_head_dtype == "bf16":
        safetensors.save(lm_head, {"lm_head.weight": w}, bf16=("lm_head.weight",))
    else:  # the same values, widened
        safetensors.save(lm_head, {"lm_head.weight": (w.astype(np.uint32) << 16).view(np.float32)})
    hidden = (rng.standard_normal((T, H), dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)
    ids = rng.integers(0, V, size=T, dtype=np.int64)
    cu = np.array([0, T], dtype=np.int32)

    metrics_port = args.port + 1
    server = subprocess.Popen(
        [os.path.join(ROOT, "build", "bin", "logprob-server"), "--listen", "127.0.0.1:%d" % args.port,
         "--workers", str(args.workers), "--backend", "cpu", "--lm-head", lm_head,
         "--metrics-listen", "127.0.0.1:%d" % metrics_port],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        target = "127.0.0.1:%d" % args.port
        clients = {"shared memory": LogprobClient(target, timeout=600),
                   "inline": LogprobClient(target, timeout=600, shared_memory=False)}
        if not clients["inline"].health(wait=120):
            sys.exit("server did not become SERVING")

        def score(client):
            return client.score(hidden_states=hidden, input_ids=ids, cu_seqlens=cu, dtype="bf16")

        ref = None
        for name, c in clients.items():  # warm-up; results must agree bitwise
            out = score(c).token_logprobs
            if ref is None:
                ref = out
            elif not np.array_equal(ref, out):
                sys.exit("shared-memory and inline results differ")
        used_shm = clients["shared memory"]._shm is not None
        lat = {k: [] for k in clients}
        over = {k: [] for k in clients}
        for _ in range(args.rounds):
            for name, c in clients.items():
                n0, s0 = handler_sum(scrape(metrics_port))
                t0 = time.perf_counter()
                score(c)
                dt = time.perf_counter() - t0
                n1, s1 = handler_sum(scrape(metrics_port))
                assert n1 - n0 == 1
                lat[name].append(dt)
                over[name].append(dt - (s1 - s0))

        # Peak RSS growth per request in flight.
        C = args.concurrency
        rss = {k: [] for k in clients}

        def burst(c):
            threads = [threading.Thread(target=score, args=(c,)) for _ in range(C)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()

        for name, c in clients.items():
            burst(c)  # warm-up at this concurrency
        for _ in range(max(3, args.rounds // 2)):
            for name, c in clients.items():
                before = status_kib(server.pid, "VmRSS")
                with open("/proc/%d/clear_refs" % server.pid, "w") as f:
                    f.write("5")
                burst(c)
                peak = status_kib(server.pid, "VmHWM")
                rss[name].append((peak - before) / 1024.0 / C)

        mb = T * H * 2 / 2 ** 20
        print("request: hidden_states [%d, %d] bf16 (%.0f MiB), lm_head [%d, %d] %s, %d CPU workers; "
              "%d rounds; shared memory used: %s" % (T, H, mb, V, H, args.lm_head_dtype, args.workers, args.rounds,
                                                     used_shm))
        print("| path | client latency p50 (ms) | server handler p50 (ms) | latency - handler p50 (ms) | "
              "peak RSS growth per request in flight, C=%d (MiB) |" % C)
        print("| --- | ---: | ---: | ---: | ---: |")
        for name in clients:
            handler = [l - o for l, o in zip(lat[name], over[name])]
            print("| %s | %.1f | %.1f | %.1f | %.1f |" % (
                name, statistics.median(lat[name]) * 1e3, statistics.median(handler) * 1e3,
                statistics.median(over[name]) * 1e3, statistics.median(rss[name])))
        for c in clients.values():
            c.close()
    finally:
        server.terminate()
        server.wait()
        for f in os.listdir(tmp):
            os.unlink(os.path.join(tmp, f))
        os.rmdir(tmp)


if __name__ == "__main__":
    main()
