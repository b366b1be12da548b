#!/usr/bin/env python3
"""Torch baselines for `logprob_cuda_bench` (docs/benchmarks.md "GPU: how to
measure"): the same shapes on the same GPU, in the same session, so the
CUDA backend's figures can be read against what a trainer would do in torch.

hidden  (hidden states bf16 [T, H] x lm_head bf16 [V, H], for each V):
        - torch bf16 GEMM, bf16 output (h @ w.T);
        - torch bf16 GEMM, f32 output (torch.mm(..., out_dtype=torch.float32)
          where this torch has it, else the bf16 GEMM then .float(), labelled);
        - GEMM, then float32 log_softmax of the full [T, V] and the target gather;
        - the same in chunks of --chunk rows, with logsumexp instead of a full
          log_softmax (x[target] - logsumexp(x)), as chunked trainers do.
        TFLOP/s = 2 T V H / s and ratio = time of the bf16-output GEMM / time.
logits  (bf16 logits [T, V] on the device, for each V):
        - a device-to-device copy of the same bytes: copy bandwidth = bytes read
          + written / time (as CUDA's bandwidthTest and logprob_cuda_bench);
        - torch.compile'd x.float()[target] - logsumexp(x.float()) (one fused
          pass if inductor works on this machine; an ERROR line otherwise);
        - eager log_softmax(x.float()) then gather;
        - eager log_softmax + entropy + top-20.
        GB/s = bytes of logits read / time, and its fraction of the copy bandwidth.

Every figure is the median of --rounds interleaved rounds (after one warm-up
round, which also compiles), timed with CUDA events; spread = (max - min) /
median of the rounds. A case that fails (out of
memory, no compiler) prints an ERROR line and the others go on.

Usage: python3 bench/torch_baseline.py [--mode all|hidden|logits] [--t 8192]
           [--h 4096] [--v 151936,37984] [--chunk 1024] [--rounds 7]
           [--no-compile] [--json OUT.json]
Exit status: 0 when every case ran, 1 when some case failed, 2 when it cannot
run at all here (no torch, or no CUDA device: the message says which).
Needs only python3 and torch (CUDA build).
"""

import argparse
import datetime
import json
import statistics
import sys

try:
    import torch
except ImportError as e:  # pragma: no cover - depends on the machine
    print("torch_baseline.py: cannot import torch (%s); it needs python3 with a CUDA build of torch" % e,
          file=sys.stderr)
    sys.exit(2)


class Case:
    """One timed case: fn() enqueues the work on the current stream."""

    def __init__(self, name, fn):
        self.name = name
        self.fn = fn
        self.ms = []
        self.error = None

    def median(self):
        return statistics.median(self.ms) if self.ms else None


def run_interleaved(cases, rounds):
    """One warm-up round, then `rounds` rounds running every case once, in
    order; CUDA-event milliseconds per run. A failing case keeps its error."""
    for r in range(-1, rounds):
        for c in cases:
            if c.error is not None:
                continue
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            try:
                start.record()
                c.fn()
                end.record()
                end.synchronize()
            except Exception as e:  # OOM, compiler missing, ...: report, go on
                c.error = "%s: %s" % (type(e).__name__, str(e).splitlines()[0] if str(e) else "")
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
                continue
            if r >= 0:
                c.ms.append(start.elapsed_time(end))


def report(section, cases, metric, results, v, ratio_base=None, ratio_name="ratio"):
    """Prints a table and appends rows to `results`. metric(case_ms) -> (value, label)."""
    print("%-50s %10s %8s %12s %10s" % ("case", "ms", "spread", metric(None)[1], ratio_name))
    for c in cases:
        row = {"section": section, "V": v, "case": c.name}
        if c.error is not None or not c.ms:
            print("%-50s ERROR: %s" % (c.name, c.error))
            row["error"] = c.error
        else:
            ms = c.median()
            value, label = metric(ms)
            ratio = ratio_base(ms) if ratio_base else None
            spread = 100.0 * (max(c.ms) - min(c.ms)) / ms if ms > 0 else 0.0
            print("%-50s %10.3f %7.1f%% %12.1f %10s"
                  % (c.name, ms, spread, value, "%.3f" % ratio if ratio is not None else "-"))
            row.update({"ms": ms, "spread_percent": spread, label: value, ratio_name: ratio, "rounds": len(c.ms)})
        results.append(row)


def gemm_f32_out(h, wt):
    """bf16 x bf16 -> f32 output in one GEMM if this torch can (else the bf16
    GEMM then .float()), and the case's label."""
    try:
        torch.mm(h[:16], wt, out_dtype=torch.float32)
        return (lambda: torch.mm(h, wt, out_dtype=torch.float32)), "torch bf16 GEMM, f32 out (mm out_dtype)"
    except (TypeError, RuntimeError):
        return (lambda: torch.mm(h, wt).float()), "torch bf16 GEMM + .float() (no out_dtype)"


def bench_hidden(args, v, results):
    t, hsz = args.t, args.h
    flops = 2.0 * t * v * hsz
    print("\n== hidden: hidden states bf16 [%d, %d] x lm_head bf16 [%d, %d], %.2f TFLOP per pass; %d interleaved "
          "rounds, medians, CUDA events" % (t, hsz, v, hsz, flops / 1e12, args.rounds))
    g = torch.Generator(device="cuda").manual_seed(1)
    h = torch.randn(t, hsz, device="cuda", dtype=torch.bfloat16, generator=g)
    w = ((torch.rand(v, hsz, device="cuda", generator=g) * 2 - 1) * 0.05).to(torch.bfloat16)
    wt = w.t()
    targets = torch.randint(0, v, (t,), device="cuda", generator=g)
    f32_fn, f32_label = gemm_f32_out(h, wt)

    def full_log_softmax():
        logits = torch.mm(h, wt).float()
        return logits.log_softmax(-1).gather(1, targets[:, None])

    def chunked_logsumexp():
        out = torch.empty(t, device="cuda")
        for r0 in range(0, t, args.chunk):
            x = torch.mm(h[r0:r0 + args.chunk], wt).float()
            out[r0:r0 + args.chunk] = x.gather(1, targets[r0:r0 + args.chunk, None]).squeeze(1) - torch.logsumexp(x, -1)
        return out

    cases = [
        Case("torch bf16 GEMM, bf16 out", lambda: torch.mm(h, wt)),
        Case(f32_label, f32_fn),
        Case("GEMM + f32 log_softmax [T, V] + gather", full_log_softmax),
        Case("chunks of %d rows: GEMM, x[t] - logsumexp(x)" % args.chunk, chunked_logsumexp),
    ]
    run_interleaved(cases, args.rounds)
    base = cases[0].median() if cases[0].error is None else None
    report("hidden", cases, lambda ms: (flops / (ms * 1e-3) / 1e12 if ms else 0, "TFLOP/s"), results, v,
           (lambda ms: base / ms) if base else None, "vs bf16 GEMM")


def bench_logits(args, v, results):
    t = args.t
    nbytes = t * v * 2
    print("\n== logits: bf16 [%d, %d] on the device (%.3f GB); %d interleaved rounds, medians, CUDA events"
          % (t, v, nbytes / 1e9, args.rounds))
    g = torch.Generator(device="cuda").manual_seed(2)
    x = (torch.randn(t, v, device="cuda", generator=g) * 3).to(torch.bfloat16)
    dst = torch.empty_like(x)
    targets = torch.randint(0, v, (t,), device="cuda", generator=g)

    def token_logprobs(logits, tgt):
        xf = logits.float()
        return xf.gather(1, tgt[:, None]).squeeze(1) - torch.logsumexp(xf, -1)

    def eager_full():
        lsm = x.float().log_softmax(-1)
        entropy = -(lsm.exp() * lsm).sum(-1)
        top = lsm.topk(20, dim=-1)
        return lsm.gather(1, targets[:, None]), entropy, top

    cases = [Case("D2D copy (dst.copy_(x), same bytes)", lambda: dst.copy_(x))]
    if args.no_compile:
        pass
    elif not hasattr(torch, "compile"):
        c = Case("torch.compile'd x[t] - logsumexp(x)", None)
        c.error = "torch %s has no torch.compile" % torch.__version__
        cases.append(c)
    else:
        compiled = torch.compile(token_logprobs)
        cases.append(Case("torch.compile'd x[t] - logsumexp(x)", lambda: compiled(x, targets)))
    cases.append(Case("eager log_softmax(x.float()) + gather", lambda: x.float().log_softmax(-1).gather(1, targets[:, None])))
    cases.append(Case("eager log_softmax + entropy + top-20", eager_full))
    run_interleaved(cases, args.rounds)
    copy = cases[0]
    copy_bw = 2.0 * nbytes / (copy.median() * 1e-3) if copy.error is None and copy.ms else None
    if copy_bw:
        print("copy bandwidth: %.3f ms for %.3f GB = %.1f GB/s (read + written / time)"
              % (copy.median(), nbytes / 1e9, copy_bw / 1e9))
    report("logits", cases, lambda ms: (nbytes / (ms * 1e-3) / 1e9 if ms else 0, "GB/s (read)"), results, v,
           (lambda ms: (nbytes / (ms * 1e-3)) / copy_bw) if copy_bw else None, "of copy bw")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", choices=["all", "hidden", "logits"], default="all")
    p.add_argument("--t", type=int, default=8192)
    p.add_argument("--h", type=int, default=4096)
    p.add_argument("--v", default="151936,37984", help="comma-separated vocabulary sizes")
    p.add_argument("--chunk", type=int, default=1024, help="rows per chunk of the chunked torch version")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--no-compile", action="store_true", help="leave out the torch.compile case")
    p.add_argument("--json", metavar="OUT", help="also write the results to OUT as JSON")
    args = p.parse_args()
    try:
        vs = [int(s) for s in args.v.split(",") if s]
    except ValueError:
        p.error("--v: comma-separated integers")
    if not vs or min(vs) <= 0 or args.t <= 0 or args.h <= 0 or args.chunk <= 0 or args.rounds <= 0:
        p.error("sizes, --chunk and --rounds must be positive")
    if not torch.cuda.is_available():
        print("torch_baseline.py: no CUDA device (torch %s, torch.cuda.is_available() is False): nothing to measure "
              "on this machine; run it on the GPU machine (docs/benchmarks.md)" % torch.__version__, file=sys.stderr)
        return 2
    name = torch.cuda.get_device_name(0)
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    print("torch_baseline.py --mode %s: %s, torch %s (CUDA %s), %s"
          % (args.mode, name, torch.__version__, torch.version.cuda, date))
    results = []
    if args.mode in ("all", "logits"):
        for v in vs:
            bench_logits(args, v, results)
            torch.cuda.empty_cache()  # the section's tensors died with its frame
            sys.stdout.flush()
    if args.mode in ("all", "hidden"):
        for v in vs:
            bench_hidden(args, v, results)
            torch.cuda.empty_cache()
            sys.stdout.flush()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": name, "torch": torch.__version__, "cuda": torch.version.cuda, "date": date,
                       "t": args.t, "h": args.h, "rounds": args.rounds, "results": results}, f, indent=1)
        print("wrote", args.json)
    return 1 if any("error" in r for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
