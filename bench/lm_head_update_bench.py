#!/usr/bin/env python3
"""lm_head updates (docs/benchmarks.md, "lm_head updates"): a random bf16
head [V, H] (default Qwen's [151936, 4096], 1.24 GB) on a server with CPU
workers.

1. Update time from the Python client, in interleaved rounds (medians):
   - rows in pieces (``shared_memory=False``) against the same bytes
     through ``logprob-client bench``'s echo-chunked phase (ScoreChunked
     to an in-process echo server on loopback): update seconds / (head
     bytes / echo-chunked bytes per second of the same round);
   - rows through shared memory (a torch CPU bf16 tensor, the client's
     default on the server's host) against one memcpy of the head in this
     process (``np.copyto``) in the same round.
   With ``--cuda`` (CUDA workers, a GPU for torch): also a torch CUDA
   tensor by CUDA IPC (a worker copies the rows into the store) against
   one device-to-device copy of it (``Tensor.copy_``) and against the same
   tensor with ``cuda_ipc=False`` (the client copies it to the host, then
   shared memory), in the same rounds.
   After each update the bench waits until the server lists the head's
   sha256 (computed after a commit that announced none) and reports that
   wait, so no timing overlaps the hash.
2. Scoring during updates: CONCURRENCY threads send hidden-states requests
   ([T, H] bf16) back to back; p50 / p99 latency while nothing happens,
   then while the head is updated UPDATES times; every request must
   succeed, and each reports the version that scored it.

Usage: PYTHONPATH=client/python:build/python python3 bench/lm_head_update_bench.py
       [--vocab 151936] [--hidden 4096] [--workers 2] [--rounds 3] [--updates 10]
       [--tokens 16] [--concurrency 2] [--port 45117] [--store-dir DIR] [--piece-bytes N]
       [--compare-piece-bytes N] [--cuda]
       (--updates 0: no scoring phase)
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

from logprob_client import LogprobClient, float32_to_bf16_bits, safetensors
from logprob_client._internal import transport

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
BIN = os.environ.get("LOGPROB_BIN_DIR", os.path.join(ROOT, "build", "bin"))


def random_head(V, H, seed):
    """bf16 bits [V, H] of N(0, 0.02), made in row blocks (memory: the result)."""
    rng = np.random.default_rng(seed)
    out = np.empty((V, H), dtype=np.uint16)
    for r0 in range(0, V, 8192):
        r1 = min(V, r0 + 8192)
        out[r0:r1] = float32_to_bf16_bits(rng.standard_normal((r1 - r0, H), dtype=np.float32) * 0.02)
    return out


def echo_chunked_bytes_per_s(address, nbytes, piece_bytes):
    """Request bytes per second of logprob-client bench's echo-chunked phase,
    one request of about ``nbytes`` bf16 logits (no scoring phase worth
    timing: one small warm-up call)."""
    vocab = 32768
    seq = max(1, nbytes // (2 * vocab))
    out = subprocess.run(
        [os.path.join(BIN, "logprob-client"), "bench", "--server", address, "--batch", "1", "--seq", str(seq),
         "--vocab", str(vocab), "--dtype", "bf16", "--requests", "3", "--warmup", "0", "--chunk-above", "0",
         "--json", "--progress", "0", "--piece-bytes", str(piece_bytes)], capture_output=True, text=True, check=True).stdout
    report = json.loads(out)
    return report["echo_chunked"]["request_mb_per_s"] * 1e6


def digest_wait(client, head="default"):
    """Seconds until the server lists the head's sha256 (computed after a
    commit that announced none), so the next timing starts on an idle
    machine."""
    t0 = time.perf_counter()
    while not [h for h in client.lm_heads() if h.name == head][0].sha256:
        time.sleep(0.005)  # polling observed state; not in a timed section
    return time.perf_counter() - t0


def percentile(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--updates", type=int, default=10)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=2)
    ap.add_argument("--port", type=int, default=45117)
    ap.add_argument("--piece-bytes", type=int, default=transport.PIECE_BYTES,
                    help="piece size of the pieced updates and of the echo-chunked baseline (default: the clients')")
    ap.add_argument("--compare-piece-bytes", type=int, default=0,
                    help="also time the pieced update and echo-chunked in pieces of N bytes in every round")
    ap.add_argument("--store-dir", default="", help="the server's --lm-head-store-dir (default: its own)")
    ap.add_argument("--precision", default="",
                    help="the server's --lm-head-precision (bf16, tf32, fp32; default: auto, bf16 for this head): "
                         "at tf32 and fp32 every version is widened to f32 as the workers load it")
    ap.add_argument("--cuda", action="store_true",
                    help="CUDA workers; also time updates from a CUDA tensor by CUDA IPC and by a host copy")
    a = ap.parse_args()
    V, H = a.vocab, a.hidden
    tmp = tempfile.mkdtemp(prefix="lm_head_bench_")
    heads = [random_head(V, H, 1), random_head(V, H, 2)]
    path = os.path.join(tmp, "head.safetensors")
    safetensors.save(path, {"lm_head.weight": heads[0]}, bf16={"lm_head.weight"})
    nbytes = heads[0].nbytes
    address = "127.0.0.1:%d" % a.port
    log = open(os.path.join(tmp, "server.log"), "wb")
    server = subprocess.Popen([os.path.join(BIN, "logprob-server"), "--listen", address, "--workers",
                               str(a.workers), "--lm-head", path, "--allow-lm-head-updates",
                               "--max-request-bytes", str(1 << 30)] +
                              (["--lm-head-store-dir", a.store_dir] if a.store_dir else []) +
                              (["--lm-head-precision", a.precision] if a.precision else []) +
                              (["--backend", "cuda"] if a.cuda else []),
                              stdout=log, stderr=subprocess.STDOUT)
    try:
        with LogprobClient(address, timeout=600) as c:
            if not c.health(wait=300):
                raise SystemExit("server did not become SERVING; log in %s" % tmp)
            print("lm_head bf16 [%d, %d] = %.2f GB, %d %s workers, %d interleaved rounds, pieces of %d bytes" %
                  (V, H, nbytes / 1e9, a.workers, "CUDA" if a.cuda else "CPU", a.rounds, a.piece_bytes))
            # How the workers hold and multiply the head (the bf16 matmul, or
            # f32 on a CPU without one, e.g. under ONEDNN_MAX_CPU_ISA=AVX2).
            with open(os.path.join(tmp, "server.log"), errors="replace") as f:
                for line in f:
                    if "loaded lm_head" in line and "rank 0" in line:
                        print("worker:", line.split(" transform ", 1)[-1].strip())
            import torch  # the shared-memory path's input: a torch CPU tensor
            tensors = [torch.from_numpy(h.view(np.int16)).view(torch.bfloat16) for h in heads]
            copy_dst = np.empty_like(heads[0])
            rows = {k: [] for k in ("pieces", "echo", "shm", "memcpy", "digest", "alt-pieces", "alt-echo")}
            with LogprobClient(address, timeout=600, shared_memory=False) as pieces:
                pieces.piece_bytes = a.piece_bytes
                for r in range(a.rounds):
                    t0 = time.perf_counter()
                    pieces.update_lm_head("default", heads[(r + 1) % 2], version="pieces-%d" % r, dtype="bf16")
                    rows["pieces"].append(time.perf_counter() - t0)
                    rows["digest"].append(digest_wait(c))
                    rows["echo"].append(nbytes / echo_chunked_bytes_per_s(address, min(nbytes, 256 << 20), a.piece_bytes))
                    if a.compare_piece_bytes:  # the same, in pieces of the other size, in the same round
                        pieces.piece_bytes = a.compare_piece_bytes
                        t0 = time.perf_counter()
                        pieces.update_lm_head("default", heads[r % 2], version="alt-pieces-%d" % r, dtype="bf16")
                        rows["alt-pieces"].append(time.perf_counter() - t0)
                        digest_wait(c)
                        rows["alt-echo"].append(
                            nbytes / echo_chunked_bytes_per_s(address, min(nbytes, 256 << 20), a.compare_piece_bytes))
                        pieces.piece_bytes = a.piece_bytes
                        print("round %d: in pieces of %d bytes: pieces %.2f s, echo-chunked %.2f s" %
                              (r, a.compare_piece_bytes, rows["alt-pieces"][-1], rows["alt-echo"][-1]), flush=True)
                    t0 = time.perf_counter()
                    c.update_lm_head("default", tensors[r % 2], version="shm-%d" % r)
                    rows["shm"].append(time.perf_counter() - t0)
                    rows["digest"].append(digest_wait(c))
                    t0 = time.perf_counter()
                    np.copyto(copy_dst, heads[r % 2])
                    rows["memcpy"].append(time.perf_counter() - t0)
                    print("round %d: pieces %.2f s, echo-chunked %.2f s (ratio %.2f); shared memory %.2f s, "
                          "memcpy %.3f s (ratio %.1f); sha256 listed %.2f / %.2f s after the commits" %
                          (r, rows["pieces"][-1], rows["echo"][-1], rows["pieces"][-1] / rows["echo"][-1],
                           rows["shm"][-1], rows["memcpy"][-1], rows["shm"][-1] / rows["memcpy"][-1],
                           rows["digest"][-2], rows["digest"][-1]), flush=True)
            if a.cuda:
                if not c.server_info().cuda_ipc_inputs:
                    raise SystemExit("--cuda: the server does not offer CUDA IPC (see its log in %s)" % tmp)
                on_gpu = [t.cuda() for t in tensors]
                d2d_dst = torch.empty_like(on_gpu[0])
                gpu_rows = {"ipc": [], "gpu-host": [], "d2d": []}
                with LogprobClient(address, timeout=600, cuda_ipc=False) as host:
                    for r in range(a.rounds):
                        torch.cuda.synchronize()
                        t0 = time.perf_counter()
                        c.update_lm_head("default", on_gpu[(r + 1) % 2], version="ipc-%d" % r)
                        gpu_rows["ipc"].append(time.perf_counter() - t0)
                        digest_wait(c)
                        t0 = time.perf_counter()
                        host.update_lm_head("default", on_gpu[r % 2], version="gpu-host-%d" % r)
                        gpu_rows["gpu-host"].append(time.perf_counter() - t0)
                        digest_wait(c)
                        # The baseline: one device-to-device copy of the head.
                        torch.cuda.synchronize()
                        t0 = time.perf_counter()
                        d2d_dst.copy_(on_gpu[r % 2])
                        torch.cuda.synchronize()
                        gpu_rows["d2d"].append(time.perf_counter() - t0)
                        print("round %d: CUDA tensor by CUDA IPC %.2f s, by a host copy %.2f s, device-to-device "
                              "copy %.4f s (IPC / d2d %.1f)" %
                              (r, gpu_rows["ipc"][-1], gpu_rows["gpu-host"][-1], gpu_rows["d2d"][-1],
                               gpu_rows["ipc"][-1] / gpu_rows["d2d"][-1]), flush=True)
                gm = {k: statistics.median(v) for k, v in gpu_rows.items()}
                print("median: CUDA tensor by CUDA IPC %.2f s (%.0f MB/s), by a host copy %.2f s (%.0f MB/s); "
                      "device-to-device copy %.4f s; IPC / d2d %.1f, IPC / host copy %.2f (medians of rounds)" %
                      (gm["ipc"], nbytes / gm["ipc"] / 1e6, gm["gpu-host"], nbytes / gm["gpu-host"] / 1e6, gm["d2d"],
                       statistics.median([x / y for x, y in zip(gpu_rows["ipc"], gpu_rows["d2d"])]),
                       statistics.median([x / y for x, y in zip(gpu_rows["ipc"], gpu_rows["gpu-host"])])))
                del on_gpu, d2d_dst
            med = {k: statistics.median(v) for k, v in rows.items() if v}
            ratio_p = statistics.median([p / e for p, e in zip(rows["pieces"], rows["echo"])])
            ratio_s = statistics.median([x / m for x, m in zip(rows["shm"], rows["memcpy"])])
            print("median: pieces %.2f s (%.0f MB/s), echo-chunked %.2f s, ratio %.2f; shared memory %.2f s "
                  "(%.0f MB/s), memcpy %.3f s, ratio %.1f; sha256 listed %.2f s after a commit" %
                  (med["pieces"], nbytes / med["pieces"] / 1e6, med["echo"], ratio_p, med["shm"],
                   nbytes / med["shm"] / 1e6, med["memcpy"], ratio_s, med["digest"]))
            if a.compare_piece_bytes:
                print("median: in pieces of %d bytes: pieces %.2f s (%.2fx the default size's, median of rounds), "
                      "echo-chunked %.2f s (%.2fx)" %
                      (a.compare_piece_bytes, med["alt-pieces"],
                       statistics.median([x / y for x, y in zip(rows["alt-pieces"], rows["pieces"])]), med["alt-echo"],
                       statistics.median([x / y for x, y in zip(rows["alt-echo"], rows["echo"])])))
            del copy_dst
            if not a.updates:
                return 0

            rng = np.random.default_rng(5)
            hidden = float32_to_bf16_bits(rng.standard_normal((a.tokens, H), dtype=np.float32))
            ids = rng.integers(0, V, a.tokens)
            cu = np.array([0, a.tokens])

            def stream(stop, lat, versions, failures):
                with LogprobClient(address, timeout=600) as s:
                    while not stop.is_set():
                        t0 = time.perf_counter()
                        try:
                            res = s.score(hidden_states=hidden, input_ids=ids, cu_seqlens=cu, dtype="bf16")
                            lat.append(time.perf_counter() - t0)
                            versions.add(res.head_version)
                        except Exception as e:  # counted: no request may fail
                            failures.append(repr(e))

            def run(seconds=None, updates=0):
                stop, lat, versions, failures = threading.Event(), [], set(), []
                threads = [threading.Thread(target=stream, args=(stop, lat, versions, failures))
                           for _ in range(a.concurrency)]
                for t in threads:
                    t.start()
                try:
                    if updates:
                        for i in range(updates):
                            c.update_lm_head("default", heads[i % 2], version="stream-%d" % i, dtype="bf16")
                    else:
                        time.sleep(seconds)  # a measured period of steady load, not synchronisation
                finally:  # the streams stop also when an update fails
                    stop.set()
                    for t in threads:
                        t.join()
                return lat, versions, failures

            t0 = time.perf_counter()
            lat_u, ver_u, fail_u = run(updates=a.updates)
            during = time.perf_counter() - t0
            lat_q, _, fail_q = run(seconds=min(during, 120))
            for name, lat, fails in (("no updates", lat_q, fail_q), ("%d updates" % a.updates, lat_u, fail_u)):
                print("%-12s %5d requests  p50 %.3f s  p99 %.3f s  failed %d" %
                      (name, len(lat), percentile(lat, 0.5), percentile(lat, 0.99), len(fails)))
            print("versions seen during the updates: %d; p50 ratio %.2f, p99 ratio %.2f" %
                  (len(ver_u), percentile(lat_u, 0.5) / percentile(lat_q, 0.5),
                   percentile(lat_u, 0.99) / percentile(lat_q, 0.99)))
            if fail_u or fail_q:
                print("FAILURES:", (fail_u + fail_q)[:3])
                return 1
    finally:
        server.terminate()
        server.wait()
        os.remove(path)  # the 1.24 GB checkpoint; the server's log stays in tmp
    return 0


if __name__ == "__main__":
    sys.exit(main())
