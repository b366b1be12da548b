#!/bin/bash
# Load benchmark, shared-memory payloads on vs off (docs/benchmarks.md,
# "After: dynamic batching and shared-memory payloads"): 3 interleaved rounds.
# Needs a build (scripts/build.sh); prints one line per run.
set -u
cd "$(dirname "$0")/../build/bin"
for round in 1 2 3; do
for shm in true false; do
  ./logprob-server --listen 127.0.0.1:50781 --workers 2 --metrics-listen 127.0.0.1:9781 --shared-memory=$shm --max-request-bytes 1000000000 2>/dev/null &
  pid=$!
  ./logprob-client health --server 127.0.0.1:50781 --wait 60 >/dev/null 2>&1 || sleep 5
  for shape in "--batch 1 --seq 64" "--batch 2 --seq 256" "--batch 4 --seq 1024"; do
    out=$(./logprob-client bench --server 127.0.0.1:50781 --metrics-url http://127.0.0.1:9781/metrics --json --progress 0 $shape --vocab 32000 --dtype bf16 --concurrency 1 --duration 5 --warmup 1 2>/dev/null)
    echo "round=$round shm=$shm shape=[$shape] $(echo "$out" | python3 -c 'import json,sys; j=json.load(sys.stdin); s=j["server_split"]; print("req/s=%.2f echo=%.2f ratio=%.3f p50=%.1fms handler=%.1fms call=%.1fms compute=%.1fms" % (j["scoring"]["requests_per_s"], j["echo"]["requests_per_s"], j["scoring_over_echo"], j["scoring"]["latency_s"]["p50"]*1e3, s["request_mean_s"]*1e3, s["worker_call_mean_s"]*1e3, s["compute_mean_s"]*1e3))')"
  done
  kill $pid; wait $pid 2>/dev/null
done
done
