#!/bin/bash
# The internal plane's per-call check (issue 42): the same build, one
# cluster-mode front-end with 2 CPU workers on loopback, with the pool
# secret (every Control and Worker call checked: SHA-256 of the metadata
# value, constant-time compare) and without it (loopback, unauthenticated).
# Small requests, where a per-call cost weighs most: 2 Worker.Run calls per
# Score. Both pools run side by side; ROUNDS (default 5) interleaved rounds
# of `logprob-client bench` alternate between them; prints one line per
# run and the medians. Needs a build (scripts/build.sh).
# Usage: bench/internal_auth_compare.sh [ROUNDS] [SECONDS_PER_RUN]
set -u
rounds=${1:-5}
seconds=${2:-5}
bin="$(cd "$(dirname "$0")/.." && pwd)/build/bin"
work=$(mktemp -d)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done
  wait 2>/dev/null
  rm -rf "$work"
}
trap cleanup EXIT
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
openssl rand -hex 32 > "$work/secret" && chmod 600 "$work/secret"
declare -A listen
for mode in secret none; do
  control=127.0.0.1:$(free_port)
  listen[$mode]=127.0.0.1:$(free_port)
  auth=()
  [ "$mode" = secret ] && auth=(--internal-secret-file "$work/secret")
  "$bin/logprob-server" --listen "${listen[$mode]}" --external-workers 2 --control-listen "$control" --backend cpu \
    "${auth[@]}" 2> "$work/server-$mode.log" &
  pids+=($!)
  for w in 1 2; do
    "$bin/logprob-worker" --frontend "$control" "${auth[@]}" --exit-with-parent 2> "$work/worker-$mode-$w.log" &
    pids+=($!)
  done
done
for mode in secret none; do
  "$bin/logprob-client" health --server "${listen[$mode]}" --wait 120 > /dev/null ||
    { echo "the $mode pool did not start:"; tail -5 "$work/server-$mode.log"; exit 1; }
done
grep -h "internal plane" "$work"/server-*.log
shape=(--batch 1 --seq 16 --vocab 1000 --dtype bf16)
for round in $(seq "$rounds"); do
  for mode in secret none; do
    "$bin/logprob-client" bench --server "${listen[$mode]}" --json --progress 0 --no-echo "${shape[@]}" \
      --concurrency 1 --duration "$seconds" --warmup 1 2> /dev/null |
      python3 -c 'import json,sys; j=json.load(sys.stdin)["scoring"]; print("round=%s mode=%s req/s=%.1f p50_ms=%.3f mean_ms=%.3f" % (sys.argv[1], sys.argv[2], j["requests_per_s"], j["latency_s"]["p50"]*1e3, j["latency_s"]["mean"]*1e3))' "$round" "$mode"
  done
done | tee "$work/runs.txt"
python3 - "$work/runs.txt" <<'PY'
import statistics, sys
runs = {}
for line in open(sys.argv[1]):
    f = dict(kv.split("=") for kv in line.split()[1:])
    runs.setdefault(f["mode"], []).append((float(f["req/s"]), float(f["p50_ms"])))
med = {m: (statistics.median(r for r, _ in v), statistics.median(p for _, p in v)) for m, v in runs.items()}
for m, (r, p) in med.items():
    print("median mode=%s req/s=%.1f p50_ms=%.3f" % (m, r, p))
print("secret / none: req/s %.3f, p50 %.3f" % (med["secret"][0] / med["none"][0], med["secret"][1] / med["none"][1]))
PY
