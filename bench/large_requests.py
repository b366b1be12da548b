#!/usr/bin/env python3
"""Large requests end to end (docs/benchmarks.md "Large requests"):
interleaved rounds, medians.

1. raw transfer: `logprob-client bench` echo phases (one Score message and
   ScoreChunked pieces) of 8, 64 and 256 MB bf16 logits requests, with the
   client's malloc tuning on (default) and off
   (LOGPROB_KEEP_FREED_MEMORY_BYTES=0, glibc's defaults);
2. a 64 MB hidden-states request ([8192, 4096] bf16; lm_head [2048, 4096],
   2 CPU workers) from the Python client and `logprob-client score`, each in
   pieces (default) and in one message: client latency vs the server's
   handler time (its log line; for ScoreChunked also the time receiving);
3. bf16 logits [4, 256, 151936] with --entropy --topk 20 through
   `logprob-client score` (2 CPU workers) vs single-thread torch
   (log_softmax + gather + entropy + top-20 on the same data), if torch is
   installed.

Usage: bench/large_requests.py [--rounds 3] [--lm-head-dtype f32|bf16]
(needs scripts/build.sh; writes its data to a temporary folder; ports 44020-44029).
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
BIN = os.path.join(ROOT, "build", "bin")
sys.path.insert(0, os.path.join(ROOT, "client", "python"))
sys.path.insert(0, os.path.join(ROOT, "build", "python"))

import numpy as np  # noqa: E402

from logprob_client import LogprobClient, float32_to_bf16_bits, safetensors  # noqa: E402


def run(cmd, env=None):
    e = dict(os.environ)
    e.update(env or {})
    return subprocess.run(cmd, capture_output=True, text=True, env=e)


class Server:
    def __init__(self, port, workers, extra=()):
        self.address = "127.0.0.1:%d" % port
        self.log_path = tempfile.mktemp(prefix="large_requests_server_", suffix=".log")
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [os.path.join(BIN, "logprob-server"), "--listen", self.address, "--workers", str(workers)] + list(extra),
            stdout=self.log, stderr=subprocess.STDOUT)
        r = run([os.path.join(BIN, "logprob-client"), "health", "--server", self.address, "--wait", "120"])
        if r.returncode != 0:
            raise RuntimeError("server did not start: " + open(self.log_path).read()[-2000:])

    def last_request(self):
        """(seconds, receive_seconds) of the last request line of the log."""
        lines = [l for l in open(self.log_path) if l.startswith("request id=")]
        m = re.search(r" seconds=([0-9.e-]+)", lines[-1])
        rc = re.search(r" receive_seconds=([0-9.e-]+)", lines[-1])
        return float(m.group(1)), float(rc.group(1)) if rc else 0.0

    def close(self):
        self.proc.terminate()
        self.proc.wait()
        self.log.close()
        os.remove(self.log_path)


def med(xs):
    return statistics.median(xs) if xs else float("nan")


def raw_transfer(rounds):
    server = Server(44021, 1)
    sizes = {128: "8 MB", 1024: "64 MB", 4096: "256 MB"}
    res = {}
    try:
        for _ in range(rounds):
            for keep in ("on", "off"):
                for T in sizes:
                    r = run([os.path.join(BIN, "logprob-client"), "bench", "--server", server.address, "--packed", str(T),
                             "--batch", "1", "--vocab", "32768", "--dtype", "bf16", "--requests", "5", "--warmup", "0.3",
                             "--json", "--progress", "0", "--chunk-above", "-1"],
                            env={} if keep == "on" else {"LOGPROB_KEEP_FREED_MEMORY_BYTES": "0"})
                    j = json.loads(r.stdout)
                    for phase in ("echo", "echo_chunked"):
                        res.setdefault((keep, T, phase), []).append(j[phase]["request_mb_per_s"])
    finally:
        server.close()
    print("\n## raw transfer (echo, request MB/s, median of %d rounds)" % rounds)
    print("| client malloc tuning | request | one message MB/s | % of 8 MB message | pieces MB/s | % of 8 MB message |")
    print("| --- | --- | --- | --- | --- | --- |")
    for keep in ("on", "off"):
        base = med(res[(keep, 128, "echo")])
        for T, label in sizes.items():
            a, b = med(res[(keep, T, "echo")]), med(res[(keep, T, "echo_chunked")])
            print("| %s | %s | %.0f | %.0f %% | %.0f | %.0f %% |" % (keep, label, a, 100 * a / base, b, 100 * b / base))


def hidden(rounds, tmp, lm_dtype):
    rng = np.random.default_rng(1)
    V, H, T = 2048, 4096, 8192
    w = (rng.standard_normal((V, H)) * 0.02).astype(np.float32)
    lm = os.path.join(tmp, "lm_head.safetensors")
    if lm_dtype == "bf16":
        safetensors.save(lm, {"lm_head.weight": float32_to_bf16_bits(w)}, bf16=("lm_head.weight",))
    else:
        safetensors.save(lm, {"lm_head.weight": w})
    hs = float32_to_bf16_bits(rng.standard_normal((T, H)).astype(np.float32))
    ids = rng.integers(0, V, T)
    cu = np.array([0, T], dtype=np.int64)
    inp = os.path.join(tmp, "hidden.safetensors")
    safetensors.save(inp, {"hidden_states": hs, "input_ids": ids, "cu_seqlens": cu}, bf16=("hidden_states",))
    server = Server(44023, 2, ["--lm-head", lm])
    res = {}
    try:
        with LogprobClient(server.address, timeout=600) as c_pieces, LogprobClient(server.address, timeout=600) as c_one:
            c_one.chunk_above = -1
            for _ in range(rounds):
                for way, c in (("pieces", c_pieces), ("one message", c_one)):
                    t0 = time.perf_counter()
                    c.score(hidden_states=hs, input_ids=ids, cu_seqlens=cu, dtype="bf16")
                    lat = time.perf_counter() - t0
                    res.setdefault(("python", way), []).append((lat,) + server.last_request())
                for way, args, env in (("pieces", [], {}),
                                       ("one message", ["--chunk-above", "-1"], {"LOGPROB_KEEP_FREED_MEMORY_BYTES": "0"})):
                    out = os.path.join(tmp, "out.safetensors")
                    r = run([os.path.join(BIN, "logprob-client"), "score", "--server", server.address, "--input", inp,
                             "--output", out] + args, env=env)
                    m = re.search(r"in ([0-9.]+) s", r.stdout)
                    res.setdefault(("cli", way), []).append((float(m.group(1)),) + server.last_request())
    finally:
        server.close()
    print("\n## 64 MB hidden states [8192, 4096] bf16, lm_head [2048, 4096] %s, 2 CPU workers (median of %d rounds)"
          % (lm_dtype, rounds))
    print("| client | transport | client latency s | server handler s | of which receiving s | client / handler |"
          " client / (handler - receiving) |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for (client, way), v in res.items():
        lat, handler, recv = (med([x[i] for x in v]) for i in range(3))
        print("| %s | %s | %.3f | %.3f | %.3f | %.2f | %.2f |" % (client, way, lat, handler, recv, lat / handler,
                                                                  lat / (handler - recv)))


def logits_vs_torch(rounds, tmp):
    rng = np.random.default_rng(2)
    B, S, V, K = 4, 256, 151936, 20
    logits = float32_to_bf16_bits((rng.standard_normal((B, S, V)) * 3).astype(np.float32))
    ids = rng.integers(0, V, (B, S))
    inp = os.path.join(tmp, "logits.safetensors")
    safetensors.save(inp, {"logits": logits, "input_ids": ids}, bf16=("logits",))
    try:
        import torch
    except ImportError:
        torch = None
    server = Server(44025, 2)
    cli, base = [], []
    try:
        for _ in range(rounds):
            out = os.path.join(tmp, "out.safetensors")
            t0 = time.perf_counter()
            r = run([os.path.join(BIN, "logprob-client"), "score", "--server", server.address, "--input", inp,
                     "--output", out, "--entropy", "--topk", str(K)])
            wall = time.perf_counter() - t0
            m = re.search(r"in ([0-9.]+) s", r.stdout)
            cli.append((float(m.group(1)), wall))
            if torch is not None:
                torch.set_num_threads(1)
                x = torch.from_numpy(logits.view(np.int16)).view(torch.bfloat16)
                tgt = torch.from_numpy(ids[:, 1:])
                t0 = time.perf_counter()
                lp = torch.log_softmax(x[:, :-1].float(), dim=-1)
                tok = lp.gather(-1, tgt.unsqueeze(-1)).squeeze(-1)
                ent = -(lp.exp() * lp).sum(-1)
                top = lp.topk(K, dim=-1)
                base.append(time.perf_counter() - t0)
                del lp, tok, ent, top
    finally:
        server.close()
    print("\n## bf16 logits [4, 256, 151936] --entropy --topk 20 (median of %d rounds)" % rounds)
    c, w = med([x[0] for x in cli]), med([x[1] for x in cli])
    print("| way | seconds | speed-up vs torch |")
    print("| --- | --- | --- |")
    t = med(base) if base else float("nan")
    print("| torch, 1 thread (log_softmax + gather + entropy + top-20) | %.3f | 1.00 |" % t)
    print("| logprob-client score, 2 CPU workers (request to answer) | %.3f | %.2f |" % (c, t / c))
    print("| logprob-client score, whole process (file read, write) | %.3f | %.2f |" % (w, t / w))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--lm-head-dtype", default="f32", choices=("f32", "bf16"))
    ap.add_argument("--only", default="raw,hidden,logits")
    a = ap.parse_args()
    print("machine: %s, %d cores; %s" % (open("/proc/cpuinfo").read().split("model name")[1].split("\n")[0].strip(": "),
                                          os.cpu_count(), time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())))
    with tempfile.TemporaryDirectory(prefix="large_requests_") as tmp:
        if "raw" in a.only:
            raw_transfer(a.rounds)
        if "hidden" in a.only:
            hidden(a.rounds, tmp, a.lm_head_dtype)
        if "logits" in a.only:
            logits_vs_torch(a.rounds, tmp)


if __name__ == "__main__":
    main()
