#!/usr/bin/env bash
# The GPU path's first run, in device calls of under 10 minutes each.
# Builds nothing: it runs from the .gpu bundle (../shared/tools/gpu-bundle,
# see docs/benchmarks.md "GPU"), re-executing itself through .gpu/run.sh
# when it is not already inside it. Every step has its own time limit,
# runs only if it still fits in its part's budget, and writes its output
# to $OUT/NN-name.txt; $OUT/summary.txt has one line per step (status,
# seconds, command), the GPU's name, driver version and compute mode, and
# the tests that skipped (ctest and gtest count a skip as a pass).
#
#   bash bench/gpu_first_run.sh [--part 1|2|3]            # on the GPU machine (device `run`, carry [".gpu", "build/python"])
#   bash bench/gpu_first_run.sh --dry-run [--part N|all]  # anywhere: print the steps and budgets, run nothing
#
# A session's device time is about 15 minutes, start-up included, and one
# call at most 10: part 1 (540 s) is the first call, part 2 (240 s) the
# second if the session has the time left (`status`), part 3 (480 s, the
# figures) a later session. The step limits of a part add up to at most
# its budget (the dry run checks it); GPU_FIRST_RUN_BUDGET_S overrides a
# part's budget, and a step that no longer fits is listed as SKIPPED.
#
# Part 1, correctness (issue 35 item 5):
#   device-info: the GPU, driver version, compute mode, ECC;
#   cuda-units: the in-process CUDA tests (records, filters, one pass,
#     staged collectives, the injected GEMM failure, CUDA IPC range);
#   fault-injection: a trapped kernel re-forms the pool (CudaFault.*), and
#     the LOGPROB_TEST_FAIL_GEMM_AFTER hook from the environment;
#   nccl-1-rank: one-rank NCCL servers, golden cases and a CUDA IPC input;
#   servers-gloo: every golden case on 1 and 2 Gloo workers, CUDA IPC;
#   ipc-update-2-gloo: lm_head update rows by CUDA IPC, 1 and 2 workers;
#   memcheck- / racecheck-filters: CudaRecords.* and CudaFilters.* (the
#     top-k radix and filter slow paths) under compute-sanitizer;
#   hidden-2g: V x T above 2^31, checked against its baseline;
#   invariance: batch invariance through CudaBackend (V = 151936).
# Part 2: batch invariance through servers, the Python client's torch
#   CUDA tests, the one-pass and CUDA IPC tests under the sanitizers.
# Part 3: commands 1-5 of docs/benchmarks.md (bench, precision, server,
#   torch, lm_head updates into CUDA workers at bf16 and fp32).
set -u
dry=0
part=1
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) dry=1 ;;
    --part) part=${2:-}; shift ;;
    *) echo "usage: gpu_first_run.sh [--dry-run] [--part 1|2|3|all]" >&2; exit 2 ;;
  esac
  shift
done
case "$part" in 1|2|3) ;; all) [ "$dry" = 1 ] || { echo "gpu_first_run: --part all is for --dry-run" >&2; exit 2; } ;; *) echo "gpu_first_run: --part must be 1, 2 or 3" >&2; exit 2 ;; esac
cd "$(dirname "$0")/.." || exit 2

if [ "$dry" = 0 ] && [ -z "${LOGPROB_GPU_BUNDLED:-}" ]; then
  [ -f .gpu/run.sh ] || {
    echo "gpu_first_run: no .gpu/run.sh: run ../shared/tools/gpu-bundle on the build machine first" >&2
    exit 2
  }
  # The Python client's generated stubs are not in the bundle: carried
  # with it (build/python), they are used from this working tree.
  stubs=""
  if [ -f build/python/logprob/v1/logprob_pb2.py ]; then
    stubs="LOGPROB_PY_STUBS_DIR='$PWD/build/python' "
  else
    echo "gpu_first_run: no build/python here (carry it with .gpu): the Python steps need protoc to make their stubs" >&2
  fi
  exec bash .gpu/run.sh "${stubs}LOGPROB_GPU_BUNDLED=1 OUT='${OUT:-}' bash bench/gpu_first_run.sh --part $part"
fi

OUT=${OUT:-/tmp/gpu_first_run}
# Seconds for a part's steps: under the device call's 600, and parts 1 and
# 2 with start-up within a session's ~15 minutes.
part_budget() { case "$1" in 1) echo 540 ;; 2) echo 240 ;; 3) echo 480 ;; esac; }
start=$(date +%s)
[ "$dry" = 1 ] || mkdir -p "$OUT"
summary="$OUT/summary.txt"
n=0
failed=0
planned=0  # the step limits of the current part so far
current=0  # the part whose steps are being declared

# step NAME TIMEOUT_S COMMAND: runs COMMAND (bash -c) under `timeout`, if
# it fits in what is left of the budget.
step() {
  local name=$1 limit=$2 cmd=$3
  n=$((n + 1))
  if [ "$part" != all ] && [ "$current" != "$part" ]; then return 0; fi
  part_total[$current]=$((${part_total[$current]:-0} + limit))
  planned=${part_total[$current]}
  local file
  file=$(printf '%s/%02d-%s.txt' "$OUT" "$n" "$name")
  if [ "$dry" = 1 ]; then
    printf '[%02d] part %s %-22s timeout %4ss (part total %4ss) > %s\n     %s\n' "$n" "$current" "$name" "$limit" \
      "$planned" "$file" "$cmd"
    return 0
  fi
  local now left
  now=$(date +%s)
  left=$((budget - (now - start)))
  if [ "$left" -lt "$limit" ]; then
    printf '%-22s SKIPPED (needs %ss, %ss left)  %s\n' "$name" "$limit" "$left" "$cmd" | tee -a "$summary"
    return 0
  fi
  echo "== $name: $cmd" >&2
  local t0 rc
  t0=$(date +%s)
  timeout --kill-after=10 "$limit" bash -c "$cmd" > "$file" 2>&1
  rc=$?
  local status=ok
  [ "$rc" = 0 ] || { status="FAILED rc=$rc"; failed=$((failed + 1)); }
  [ "$rc" = 124 ] && status="TIMED OUT after ${limit}s"
  printf '%-22s %-20s %4ss  %s\n' "$name" "$status" "$(($(date +%s) - t0))" "$cmd" | tee -a "$summary"
}

budget=${GPU_FIRST_RUN_BUDGET_S:-$(part_budget "${part/all/1}")}
declare -A part_total=()

if [ "$dry" = 0 ]; then
  {
    echo "gpu_first_run: part $part, $(date -u +%FT%TZ), budget ${budget}s"
    # The GPU, its driver and compute mode (Exclusive_Process would refuse
    # a second worker on the GPU), ECC: recorded with every part.
    nvidia-smi --query-gpu=index,name,driver_version,compute_mode,memory.total,ecc.mode.current --format=csv 2>&1 |
      head -3
    command -v compute-sanitizer || echo "compute-sanitizer: not on PATH"
  } | tee "$summary"
fi

san="compute-sanitizer --error-exitcode 1 --print-limit 20"
one_pass='CudaOnePass.*:CudaInvariance.HiddenItemPartials*:CudaHidden.FusedGemmAndPartialsMatchTheCpuPath'
hidden2g="$OUT/hidden-2g.log"

# Part 1: correctness. The old single ctest step (about 45 tests, 10 live
# servers, five V = 151936 invariance tests in 150 s) is split by binary
# and kind, each within its own limit.
current=1
step device-info 10 \
  "nvidia-smi --query-gpu=index,name,driver_version,compute_mode,memory.total,ecc.mode.current,persistence_mode,clocks.max.sm --format=csv && nvidia-smi -q -d COMPUTE,ECC | head -60 && { compute-sanitizer --version || true; }"
step cuda-units 60 "build/bin/cuda_error_test && build/bin/cuda_ipc_range_test && build/bin/cuda_backend_test"
# A kernel that executes __trap() (LOGPROB_TEST_TRAP_FILE) fails one request
# with UNAVAILABLE and the re-formed pool serves the next; then the GEMM
# failure hook from the environment.
step fault-injection 45 \
  "build/bin/server_cuda_test --gtest_filter='CudaFault.*' && { echo '-- the GEMM failure hook from the environment: this run must fail with an injected INTERNAL error'; ! LOGPROB_TEST_FAIL_GEMM_AFTER=2 build/bin/cuda_backend_test --gtest_filter='CudaOnePass.PassesOfBoundedMemory*'; }"
# NCCL on one GPU: the two-GPU NCCL tests skip there.
step nccl-1-rank 45 "build/bin/server_cuda_test --gtest_filter='CudaGoldenNccl.*OneRank:CudaIpc.OneRankOverNccl*'"
step servers-gloo 80 \
  "build/bin/server_cuda_test --gtest_filter='Workers/CudaGolden.*:CudaIpc.OneWorker*:CudaIpc.TwoWorkersOverGloo*:CudaFlags.*'"
# lm_head update rows from a torch CUDA tensor by CUDA IPC: 1 worker, and 2
# Gloo workers on the one GPU.
step ipc-update-2-gloo 60 "cd build && ctest -R 'py_client_GpuUpdateTest' --output-on-failure -V"
# The top-k radix and sampling-filter slow paths under the sanitizers.
step memcheck-filters 45 "$san --tool memcheck build/bin/cuda_backend_test --gtest_filter='CudaRecords.*:CudaFilters.*'"
step racecheck-filters 45 "$san --tool racecheck build/bin/cuda_backend_test --gtest_filter='CudaRecords.*:CudaFilters.*'"
# V x T = 151936 x 16384 > 2^31: every case against the GEMM + log_softmax
# baseline ((f) vs fused within the SPEC tolerance), no FAIL or ERROR.
step hidden-2g 60 \
  "build/bin/logprob_cuda_bench --mode hidden --t 16384 --v 151936 --h 4096 --rounds 1 > '$hidden2g' 2>&1; rc=\$?; cat '$hidden2g'; [ \$rc = 0 ] && grep -q 'check: token logprobs of (f) vs fused: .*(OK)' '$hidden2g' && ! grep -qE 'FAIL|ERROR' '$hidden2g'"
step invariance 90 "build/bin/cuda_invariance_test"

# Part 2: the second call of a session, if it has the time left.
current=2
step server-batching 60 "build/bin/server_cuda_batching_test"
step python-gpu 60 "cd build && ctest -R 'py_client_GpuTest' --output-on-failure -V"
step memcheck-one-pass-ipc 60 \
  "$san --tool memcheck build/bin/cuda_backend_test --gtest_filter='$one_pass' && $san --tool memcheck --target-processes all build/bin/server_cuda_test --gtest_filter='CudaIpc.OneWorker*'"
step racecheck-one-pass-ipc 60 \
  "$san --tool racecheck build/bin/cuda_backend_test --gtest_filter='$one_pass' && $san --tool racecheck --target-processes all build/bin/server_cuda_test --gtest_filter='CudaIpc.OneWorker*'"

# Part 3: the figures (commands 1-5 of docs/benchmarks.md), a later session.
current=3
step bench 120 "build/bin/logprob_cuda_bench --mode all"
step precision 60 "build/bin/logprob_hidden_bench --backend cuda --precisions bf16,tf32,fp32 --h 4096 --n 151936 --t 8192 --rounds 7"
step server-compute 60 "bash bench/cuda_server_compute.sh"
step torch 60 "python3 bench/torch_baseline.py --json $OUT/torch.json"
# lm_head updates into CUDA workers (issue 34): the weight buffer and, at
# fp32, the staging of the conversion on the device are recycled per
# version; the server log's load times are kept.
step update-cuda 90 "PYTHONPATH=client/python python3 bench/lm_head_update_bench.py --cuda --workers 1 --rounds 3 --updates 3"
step update-cuda-fp32 90 \
  "PYTHONPATH=client/python python3 bench/lm_head_update_bench.py --cuda --workers 1 --rounds 3 --updates 3 --precision fp32"

if [ "$dry" = 1 ]; then
  over=0
  for p in 1 2 3; do
    [ "$part" = all ] || [ "$part" = "$p" ] || continue
    t=${part_total[$p]:-0}
    b=$(part_budget "$p")
    [ -n "${GPU_FIRST_RUN_BUDGET_S:-}" ] && b=$GPU_FIRST_RUN_BUDGET_S
    status=ok
    [ "$t" -le "$b" ] || { status="OVER BUDGET"; over=1; }
    printf 'part %s: step limits add up to %ss of its %ss budget (%s)\n' "$p" "$t" "$b" "$status"
  done
  exit "$over"
fi

# Tests that skipped (a GTEST_SKIP, a ctest "Skipped", a unittest skip): a
# skip counts as a pass, so they are named here.
{
  echo "skipped tests:"
  grep -h -E '^\[  SKIPPED \] [A-Za-z]' "$OUT"/[0-9]*-*.txt 2>/dev/null | sed -E 's/^\[  SKIPPED \] //; s/ \([0-9]+ ms\)$//' |
    sort -u | sed 's/^/  /'
  grep -h -E ' \(Skipped\)|\.\.\. skipped ' "$OUT"/[0-9]*-*.txt 2>/dev/null | sed -E 's/^ +//' | sort -u | sed 's/^/  /'
} | tee -a "$summary"
echo "gpu_first_run: part $part, $failed step(s) failed, $(($(date +%s) - start))s" | tee -a "$summary"
[ "$failed" = 0 ]
