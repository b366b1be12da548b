#!/usr/bin/env bash
# The server's worker compute for one hidden-states request on the GPU
# (issue 14 target: logprob_compute_duration_seconds <= 1.2 x the fused time
# of `logprob_cuda_bench --mode hidden`, which prints the bound in ms).
#
# For each V of $VS: writes a random bf16 lm_head [V, H] safetensors file
# (python3 + torch, no other package), starts `logprob-server --backend cuda
# --workers 1 --lm-head FILE --metrics-listen`, and runs `logprob-client
# bench --packed T --batch 1 --hidden-size H --concurrency 1 --requests N
# --no-echo --metrics-url ...`: read its "worker compute (slowest worker)"
# line (the mean of logprob_compute_duration_seconds over the measured
# requests, ms). One request at a time, so each batch holds one request.
#
#   bash bench/cuda_server_compute.sh            (from the project root, after scripts/build.sh)
# Environment: T (8192), H (4096), VS ("151936 37984"), REQUESTS (10), PORT (44110; uses PORT and PORT + 1),
# BACKEND (cuda; cpu only to try the script on a machine without a GPU).
# Exit status: 0 when every V was measured, 1 otherwise.
set -u
cd "$(dirname "$0")/.."
T=${T:-8192} H=${H:-4096} VS=${VS:-"151936 37984"} REQUESTS=${REQUESTS:-10} PORT=${PORT:-44110} BACKEND=${BACKEND:-cuda}
BIN=build/bin
for b in logprob-server logprob-client logprob-worker; do
  [ -x "$BIN/$b" ] || { echo "cuda_server_compute.sh: $BIN/$b missing: build first (bash scripts/build.sh)" >&2; exit 1; }
done
dir=$(mktemp -d)
server=
cleanup() {
  [ -n "$server" ] && kill "$server" 2>/dev/null && wait "$server" 2>/dev/null
  rm -rf "$dir"
}
trap cleanup EXIT
status=0
for V in $VS; do
  echo "== server worker compute: hidden states bf16 [$T, $H] x lm_head bf16 [$V, $H], --backend $BACKEND, 1 worker, $REQUESTS requests one at a time ($(date -u '+%Y-%m-%d %H:%M UTC'))"
  lm_head="$dir/lm_head_$V.safetensors"
  if ! python3 - "$lm_head" "$V" "$H" <<'PY'; then
import ctypes, json, struct, sys
import torch
path, v, h = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
g = torch.Generator().manual_seed(1)
w = ((torch.rand(v, h, generator=g) * 2 - 1) * 0.05).to(torch.bfloat16).contiguous()
n = w.numel() * 2
header = json.dumps({"lm_head.weight": {"dtype": "BF16", "shape": [v, h], "data_offsets": [0, n]}}).encode()
header += b" " * (-len(header) % 8)
with open(path, "wb") as f:
    f.write(struct.pack("<Q", len(header)))
    f.write(header)
    f.write(ctypes.string_at(w.data_ptr(), n))
PY
    echo "ERROR: could not write the lm_head file (python3 with torch needed)"
    status=1
    continue
  fi
  "$BIN/logprob-server" --listen "127.0.0.1:$PORT" --workers 1 --backend "$BACKEND" --lm-head "$lm_head" \
    --metrics-listen "127.0.0.1:$((PORT + 1))" > "$dir/server.log" 2>&1 &
  server=$!
  # Up to 5 minutes for the lm_head upload; give up at once if a worker exits.
  healthy=0
  for _ in $(seq 60); do
    if "$BIN/logprob-client" health --server "127.0.0.1:$PORT" --wait 5 > /dev/null 2>&1; then healthy=1; break; fi
    if ! kill -0 "$server" 2>/dev/null || grep -q "; exiting" "$dir/server.log"; then break; fi
  done
  if [ "$healthy" != 1 ]; then
    echo "ERROR: the server did not become healthy; its log:"
    tail -20 "$dir/server.log"
    status=1
  elif ! "$BIN/logprob-client" bench --server "127.0.0.1:$PORT" --packed "$T" --batch 1 --hidden-size "$H" \
      --concurrency 1 --requests "$REQUESTS" --no-echo --metrics-url "http://127.0.0.1:$((PORT + 1))/metrics"; then
    echo "ERROR: logprob-client bench failed; the server's log:"
    tail -20 "$dir/server.log"
    status=1
  fi
  kill "$server" 2>/dev/null
  wait "$server" 2>/dev/null
  server=
  rm -f "$lm_head"
done
exit $status
