#!/usr/bin/env bash
# The GPU path's first run, in one device call under 10 minutes. Builds
# nothing: it runs from the .gpu bundle (../shared/tools/gpu-bundle, see
# docs/benchmarks.md "GPU"), re-executing itself through .gpu/run.sh when
# it is not already inside it. Every step has its own time limit, runs
# only if it still fits in the total budget, and writes its output to
# $OUT/NN-name.txt; $OUT/summary.txt has one line per step (status,
# seconds, command).
#
#   bash bench/gpu_first_run.sh              # on the GPU machine (device `run`, carry [".gpu"])
#   bash bench/gpu_first_run.sh --dry-run    # anywhere: print the steps, run nothing
#
# Steps, most important first:
#   1. the CUDA tests (ctest -R Cuda);
#   2. the Python client's torch CUDA tests (ctest -R py_client_Gpu: CUDA
#      IPC scoring inputs and lm_head update rows);
#   3. the injected Compute failure followed by a concurrent logits item
#      (CudaOnePass.*, Options::fail_gemm_after / LOGPROB_TEST_FAIL_GEMM_AFTER);
#   4. 2 workers over Gloo on one GPU: the W >= 2 one-pass path over
#      device collectives staged through host memory
#      (worker/host_staged_device_collectives.h), in process
#      (CudaOnePass.*StagedCollectives*) and through servers with --comm
#      gloo, whose CUDA IPC test can only pass on that path (a device
#      pointer is never scored in rounds);
#   5-8. the one-pass and CUDA IPC tests under compute-sanitizer memcheck
#      and racecheck;
#   9-12. commands 1-4 of docs/benchmarks.md (bench, precision, server, torch).
set -u
dry=0
[ "${1:-}" = "--dry-run" ] && dry=1
cd "$(dirname "$0")/.."

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
  exec bash .gpu/run.sh "${stubs}LOGPROB_GPU_BUNDLED=1 OUT='${OUT:-}' bash bench/gpu_first_run.sh"
fi

OUT=${OUT:-/tmp/gpu_first_run}
budget=${GPU_FIRST_RUN_BUDGET_S:-570}  # seconds for all steps: the device call's limit is 600
start=$(date +%s)
[ "$dry" = 1 ] || mkdir -p "$OUT"
summary="$OUT/summary.txt"
n=0
failed=0

# step NAME TIMEOUT_S COMMAND: runs COMMAND (bash -c) under `timeout`, if
# it fits in what is left of the budget.
step() {
  local name=$1 limit=$2 cmd=$3
  n=$((n + 1))
  local file
  file=$(printf '%s/%02d-%s.txt' "$OUT" "$n" "$name")
  if [ "$dry" = 1 ]; then
    printf '[%02d] %-22s timeout %4ss > %s\n     %s\n' "$n" "$name" "$limit" "$file" "$cmd"
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

if [ "$dry" = 0 ]; then
  {
    echo "gpu_first_run: $(date -u +%FT%TZ), budget ${budget}s"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | head -2
    command -v compute-sanitizer || echo "compute-sanitizer: not on PATH"
  } | tee "$summary"
fi

san="compute-sanitizer --error-exitcode 1 --print-limit 20"
one_pass='CudaOnePass.*:CudaInvariance.HiddenItemPartials*:CudaHidden.FusedGemmAndPartialsMatchTheCpuPath'
ipc='CudaIpc.*'

step ctest-cuda 150 "cd build && ctest -R Cuda --output-on-failure"
# The Python client with torch CUDA tensors: scoring inputs and lm_head
# update rows by CUDA IPC, bitwise against their bytes.
step python-gpu 90 "cd build && ctest -R 'py_client_Gpu' --output-on-failure"
step inject-failure 45 \
  "build/bin/cuda_backend_test --gtest_filter='CudaOnePass.InjectedGemmFailure*' && { echo '-- the hook from the environment: this run must fail with an injected INTERNAL error'; ! LOGPROB_TEST_FAIL_GEMM_AFTER=2 build/bin/cuda_backend_test --gtest_filter='CudaOnePass.PassesOfBoundedMemory*'; }"
step gloo-2-workers 120 \
  "build/bin/cuda_backend_test --gtest_filter='CudaOnePass.*StagedCollectives*' && build/bin/server_cuda_test --gtest_filter='Workers/CudaGolden.*:CudaIpc.TwoWorkersOverGloo*' && build/bin/server_cuda_batching_test --gtest_filter='Workers/*'"
step memcheck-one-pass 60 "$san --tool memcheck build/bin/cuda_backend_test --gtest_filter='$one_pass' && $san --tool memcheck build/bin/cuda_invariance_test --gtest_filter='CudaInvariance.HiddenItemPartials*'"
step memcheck-ipc 45 "$san --tool memcheck --target-processes all build/bin/server_cuda_test --gtest_filter='$ipc'"
step racecheck-one-pass 60 "$san --tool racecheck build/bin/cuda_backend_test --gtest_filter='$one_pass'"
step racecheck-ipc 45 "$san --tool racecheck --target-processes all build/bin/server_cuda_test --gtest_filter='$ipc'"
step bench 120 "build/bin/logprob_cuda_bench --mode all"
step precision 60 "build/bin/logprob_hidden_bench --backend cuda --precisions bf16,tf32,fp32 --h 4096 --n 151936 --t 8192 --rounds 7"
step server-compute 60 "bash bench/cuda_server_compute.sh"
step torch 60 "python3 bench/torch_baseline.py --json $OUT/torch.json"

if [ "$dry" = 0 ]; then
  echo "gpu_first_run: $failed step(s) failed, $(($(date +%s) - start))s" | tee -a "$summary"
  [ "$failed" = 0 ]
fi
