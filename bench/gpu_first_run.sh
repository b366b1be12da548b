#!/usr/bin/env bash
# The GPU path's first run, one part per loan of a GPU machine (issue 50).
# Builds nothing: it runs from the .gpu bundle (../shared/tools/gpu-bundle,
# see docs/benchmarks.md "GPU"), re-executing itself through .gpu/run.sh
# when it is not already inside it.
#
#   bash bench/gpu_first_run.sh [--part 1|2|3]            # on the GPU machine (device `run`, carry [".gpu", "build/python"])
#   bash bench/gpu_first_run.sh --preflight [--part N]    # on the GPU machine: the preflight alone (~5 s)
#   bash bench/gpu_first_run.sh --dry-run [--part N|all] [--check-filters]
#                                                         # anywhere: the plan and budgets; with --check-filters every
#                                                         # gtest filter against build/bin (no GPU needed; ctest runs it;
#                                                         # GPU_FIRST_RUN_BIN_DIR: another folder of the test programs)
#
# A loan lasts 15 minutes of device time, start-up (about 2 minutes)
# included, one command at most 10. Each part is one loan's one command:
#   part 1 (the correctness core: units, fault injection, NCCL on one rank,
#     servers, CUDA IPC, batch invariance): preflight + steps <= 300 s, so
#     with the 120 s start-up allowance it is done within ~420 s of its
#     loan, leaving the rest of the loan to rerun a step;
#   part 2 (server batching, the lm_head's backward, the Python client's
#     torch CUDA tests, V x T above 2^31, the sanitizers): its own loan,
#     <= 520 s;
#   part 3 (the figures: commands 1-5 of docs/benchmarks.md): its own loan.
# Seen on an H200 (2026-11-28): parts 1, 2 and 3 took 32 s, 94 s and 293 s,
# so all three fit one loan as
#   tar -C / -xJf .gpu/bundle.tar.xz; for p in 1 2 3; do
#     bash .gpu/run.sh "bash bench/gpu_first_run.sh --part $p"; done
# (timeout_s 590; the first tar re-unpacks the libraries a warm machine's
# tree sync drops); the budgets below stay the worst case.
# A step runs only if its limit still fits in what is left of its part's
# budget (GPU_FIRST_RUN_BUDGET_S overrides it); one that does not is
# SKIPPED. The dry run checks that every part fits.
#
# Preflight (every part, ~5 s; stops the part with its summary when
# something the part needs is missing): the GPU, driver, compute mode and
# ECC; every program in build/bin resolves all its libraries (ldd); the
# NCCL, cuBLASLt and CUDA runtime the worker loads, and NCCL's version;
# compute-sanitizer's version; the GPU machine's python (GPU_PYTHON, else
# `python3` on PATH) imports torch (with CUDA), numpy, grpc, the client and
# its generated stubs, with only the bundle's libraries on its path.
#
# What each kind of step checks (so that a green step means something):
#   gt BIN FILTER: every ':'-separated pattern of FILTER selects at least
#     one test (gtest exits 0 on an empty filter), the binary exits 0 and
#     at least one test passed (gtest counts a skip as a pass);
#   gt_san TOOL BIN FILTER: the same under compute-sanitizer --tool TOOL;
#   gt_expect_fail MESSAGE BIN FILTER: a negative check: BIN must fail,
#     saying MESSAGE (a missing library or another failure does not pass);
#   py_test MODULE.CLASS...: the Python client's unittest classes with the
#     GPU machine's interpreter (PYTHONPATH: the client and the carried
#     stubs; LOGPROB_BIN_DIR, LOGPROB_GOLDEN_DIR), LD_LIBRARY_PATH only the
#     bundle's libraries (GPU_BUNDLE_LIB_DIR: torch keeps its own CUDA and
#     NCCL), the servers they start given run.sh's full path by wrappers in
#     LOGPROB_BIN_DIR; at least one test ran and not every one skipped;
#   hidden_2g: correctness lines only ("check: ... (OK)", no "ERROR:"),
#     never the benchmark's performance verdict column.
#
# What comes back ($OUT: at most 8 files): two files per part,
#   $OUT/gpu_first_run-partN-summary.txt  one line per step (status,
#     seconds, command), the preflight, the tests that skipped;
#   $OUT/gpu_first_run-partN-logs.tar.gz  every step's full log (NN-name.txt),
#     repacked after each step so that a killed command still returns them.
set -u
dry=0
check_filters=0
preflight_only=0
part=1
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) dry=1 ;;
    --check-filters) check_filters=1 ;;
    --preflight) preflight_only=1 ;;
    --part) part=${2:-}; shift ;;
    *) echo "usage: gpu_first_run.sh [--dry-run [--check-filters]] [--preflight] [--part 1|2|3|all]" >&2; exit 2 ;;
  esac
  shift
done
case "$part" in
  1|2|3) ;;
  all) [ "$dry" = 1 ] || { echo "gpu_first_run: --part all is for --dry-run" >&2; exit 2; } ;;
  *) echo "gpu_first_run: --part must be 1, 2 or 3" >&2; exit 2 ;;
esac
cd "$(dirname "$0")/.." || exit 2
export GPU_FIRST_RUN_ROOT=$PWD

if [ "$dry" = 0 ] && [ -z "${LOGPROB_GPU_BUNDLED:-}" ]; then
  [ -f .gpu/run.sh ] && [ -f .gpu/bundle.tar.xz ] || {
    echo "gpu_first_run: no .gpu/run.sh and .gpu/bundle.tar.xz: run ../shared/tools/gpu-bundle on the build machine first" >&2
    exit 2
  }
  # The Python client's generated stubs are not in the bundle: carried
  # with it (build/python), they are used from this working tree.
  stubs=""
  [ -f build/python/logprob/v1/logprob_pb2.py ] && stubs="$PWD/build/python"
  args="--part $part"
  [ "$preflight_only" = 1 ] && args="$args --preflight"
  exec bash .gpu/run.sh "LOGPROB_PY_STUBS_DIR='$stubs' LOGPROB_GPU_BUNDLED=1 OUT='${OUT:-}' bash bench/gpu_first_run.sh $args"
fi

# ------------------------------------------------------------------ budgets
startup_s=120    # machine start, transfer and the bundle's unpacking (device README: "minutes")
preflight_s=20   # the preflight's limit (~5 s warm; a cold `import torch` takes longer)
loan_s=900       # device time of one loan
call_s=600       # one device command
part_budget() { case "$1" in 1) echo 300 ;; 2) echo 520 ;; 3) echo 520 ;; esac; }
part_target() { case "$1" in 1) echo 420 ;; *) echo "$loan_s" ;; esac; }  # start-up + budget must fit this

# ------------------------------------------------------------------ helpers
# Exported: the steps run them in `bash -c` under `timeout`.
# GPU_FIRST_RUN_CHECK=1 (the dry run's --check-filters): the helpers check
# their arguments (filters against the binaries, test classes and files
# exist) and run nothing.

# The positive patterns of a gtest filter (before any '-'), one a line.
filter_patterns() { local pos=${1%%-*}; tr ':' '\n' <<< "$pos" | sed '/^$/d'; }

# gt_check BIN FILTER: fails unless every positive pattern of FILTER selects
# at least one test of BIN (--gtest_list_tests: no GPU needed).
gt_check() {
  local bin=$1 filter=$2 pat n bad=0
  [ -x "$bin" ] || { echo "gpu_first_run: $bin: no such program"; return 3; }
  while read -r pat; do
    n=$("$bin" --gtest_list_tests --gtest_filter="$pat" 2>/dev/null | grep -c '^  ')
    if [ "$n" -gt 0 ]; then
      echo "-- $bin --gtest_filter='$pat': $n test(s)"
    else
      echo "gpu_first_run: FILTER SELECTS NO TEST: $bin --gtest_filter='$pat'"
      bad=1
    fi
  done < <(filter_patterns "$filter")
  return "$bad"
}

# gt_run UNDER BIN FILTER: BIN (under the command UNDER, may be empty) on
# FILTER; fails when a pattern selects nothing, BIN fails, or no test passed.
gt_run() {
  local under=$1 bin=$2 filter=$3
  gt_check "$bin" "$filter" || return 3
  [ "${GPU_FIRST_RUN_CHECK:-0}" = 1 ] && return 0
  local log rc passed
  log=$(mktemp)
  # shellcheck disable=SC2086  # UNDER is a command line
  $under "$bin" --gtest_filter="$filter" 2>&1 | tee "$log"
  rc=${PIPESTATUS[0]}
  passed=$(sed -n 's/^\[  PASSED  \] \([0-9][0-9]*\) test.*/\1/p' "$log" | tail -1)
  rm -f "$log"
  [ "$rc" = 0 ] || return "$rc"
  [ "${passed:-0}" -gt 0 ] || { echo "gpu_first_run: $bin --gtest_filter='$filter': no test passed (all skipped?)"; return 4; }
}
gt() { gt_run "" "$1" "$2"; }
# gt_san TOOL BIN FILTER: under compute-sanitizer --tool TOOL (errors fail the run).
gt_san() {
  local tool=$1
  shift
  local extra=""
  [ "$(basename "$1")" = server_cuda_test ] && extra="--target-processes all"
  gt_run "compute-sanitizer --tool $tool --error-exitcode 1 --print-limit 20 $extra" "$1" "$2"
}

# gt_expect_fail MESSAGE BIN FILTER: BIN on FILTER must fail, and its output
# must contain MESSAGE (fixed string).
gt_expect_fail() {
  local msg=$1 bin=$2 filter=$3 out rc
  gt_check "$bin" "$filter" || return 3
  [ "${GPU_FIRST_RUN_CHECK:-0}" = 1 ] && return 0
  out=$("$bin" --gtest_filter="$filter" 2>&1)
  rc=$?
  printf '%s\n' "$out"
  [ "$rc" != 0 ] || { echo "gpu_first_run: expected a failure saying '$msg'; $bin exited 0"; return 5; }
  grep -qF -- "$msg" <<< "$out" || { echo "gpu_first_run: $bin failed (rc $rc), but not with '$msg'"; return 6; }
  echo "-- failed as expected (rc $rc), saying '$msg'"
}

# py_env CMD...: CMD in the Python steps' environment (the header), from
# any folder (paths from the project root, GPU_FIRST_RUN_ROOT).
py_env() {
  local root=$GPU_FIRST_RUN_ROOT
  env LD_LIBRARY_PATH="$GPU_BUNDLE_LIB_DIR" PYTHONPATH="$root/client/python${LOGPROB_PY_STUBS_DIR:+:$LOGPROB_PY_STUBS_DIR}" \
    LOGPROB_BIN_DIR="$GPU_FIRST_RUN_BIN" LOGPROB_GOLDEN_DIR="$root/tests/data/golden" \
    LOGPROB_CHUNK_CODEC_GOLDEN_DIR="$root/tests/data/chunk_codec" PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 "$@"
}

# py_test MODULE.CLASS...: unittest classes of client/python/tests.
py_test() {
  local entry log rc ran skipped
  for entry in "$@"; do
    grep -q "^class ${entry#*.}(" "client/python/tests/${entry%%.*}.py" 2>/dev/null ||
      { echo "gpu_first_run: no class ${entry#*.} in client/python/tests/${entry%%.*}.py"; return 3; }
  done
  [ "${GPU_FIRST_RUN_CHECK:-0}" = 1 ] && return 0
  log=$(mktemp)
  (cd client/python/tests && py_env "$GPU_PYTHON" -m unittest -v "$@") 2>&1 | tee "$log"
  rc=${PIPESTATUS[0]}
  ran=$(sed -n 's/^Ran \([0-9][0-9]*\) test.*/\1/p' "$log" | tail -1)
  skipped=$(sed -n 's/.*skipped=\([0-9][0-9]*\).*/\1/p' "$log" | tail -1)
  rm -f "$log"
  [ "$rc" = 0 ] || return "$rc"
  [ "${ran:-0}" -gt 0 ] || { echo "gpu_first_run: $*: no test ran"; return 4; }
  [ "${skipped:-0}" -lt "$ran" ] || { echo "gpu_first_run: $*: every test skipped"; return 4; }
}

# py_script FILE ARGS...: a Python program of the repository in the same environment.
py_script() {
  [ -f "$1" ] || { echo "gpu_first_run: no $1"; return 3; }
  [ "${GPU_FIRST_RUN_CHECK:-0}" = 1 ] && return 0
  py_env "$GPU_PYTHON" "$@"
}

# run CMD...: a plain command (checked: the program, or bash's script, exists).
run() {
  if [ "${GPU_FIRST_RUN_CHECK:-0}" = 1 ]; then
    local f=$1
    [ "$f" = bash ] && f=$2
    [ -e "$f" ] || command -v "$f" > /dev/null || { echo "gpu_first_run: no $f"; return 3; }
    return 0
  fi
  "$@"
}

# hidden_2g: V x T = 151936 x 16384 > 2^31 through the hidden path, every
# case against the GEMM + log_softmax baseline. Correctness lines only:
# every "check:" line ends "(OK)", the (f) vs fused one is there, and no
# case or setup says "ERROR:". The performance table's verdict column
# (PASS / FAIL against the speed targets) is not read.
hidden_2g() {
  local bin=${GPU_FIRST_RUN_BIN_DIR:-build/bin}/logprob_cuda_bench log rc bad=0
  [ -x "$bin" ] || { echo "gpu_first_run: $bin: no such program"; return 3; }
  [ "${GPU_FIRST_RUN_CHECK:-0}" = 1 ] && return 0
  log=$(mktemp)
  "$bin" --mode hidden --t 16384 --v 151936 --h 4096 --rounds 1 2>&1 | tee "$log"
  rc=${PIPESTATUS[0]}
  echo "-- correctness of the run above:"
  [ "$rc" = 0 ] || { echo "exit status $rc"; bad=1; }
  grep -q '^check: token logprobs of (f) vs fused: .*(OK)$' "$log" || { echo "no '(f) vs fused ... (OK)' check"; bad=1; }
  grep '^check:' "$log" | grep -v '(OK)$' && bad=1
  grep -E '(^|[[:space:]])ERROR: ' "$log" && bad=1
  rm -f "$log"
  [ "$bad" = 0 ] && echo "every check OK, no ERROR"
  return "$bad"
}
export -f filter_patterns gt_check gt_run gt gt_san gt_expect_fail py_env py_test py_script run hidden_2g

# ------------------------------------------------------------------ state
n=0
failed=0
current=0  # the part whose steps are being declared
declare -A part_total=() part_steps=()
budget=${GPU_FIRST_RUN_BUDGET_S:-$(part_budget "${part/all/1}")}
start=$(date +%s)
if [ "$dry" = 0 ]; then
  OUT=${OUT:-/tmp/gpu_first_run}
  mkdir -p "$OUT"
  work=$(mktemp -d /tmp/gpu_first_run.XXXXXX)
  logs="$work/logs"
  mkdir -p "$logs"
  summary="$OUT/gpu_first_run-part$part-summary.txt"
  tarball="$OUT/gpu_first_run-part$part-logs.tar.gz"
  : > "$summary"
  export GPU_PYTHON=${GPU_PYTHON:-$(command -v python3 || echo python3)}
  # run.sh before GPU_BUNDLE_LIB_DIR: its LD_LIBRARY_PATH's first entry.
  LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}
  export GPU_BUNDLE_LIB_DIR=${GPU_BUNDLE_LIB_DIR:-${LD_LIBRARY_PATH%%:*}}
  export LOGPROB_PY_STUBS_DIR=${LOGPROB_PY_STUBS_DIR:-}
  # The programs the Python steps start, given run.sh's full library path
  # (the Python process itself sees only the bundle's).
  export GPU_FIRST_RUN_LOGS="$logs"  # where a step writes files of its own (packed with the logs)
  export GPU_FIRST_RUN_BIN="$work/bin"
  mkdir -p "$GPU_FIRST_RUN_BIN"
  for b in build/bin/*; do
    [ -f "$b" ] && [ -x "$b" ] || continue
    printf '#!/bin/sh\nLD_LIBRARY_PATH=%q exec %q "$@"\n' "$LD_LIBRARY_PATH" "$PWD/$b" > "$GPU_FIRST_RUN_BIN/${b##*/}"
    chmod +x "$GPU_FIRST_RUN_BIN/${b##*/}"
  done
fi
say() { printf '%s\n' "$*" | tee -a "$summary"; }
# Packs every log into the one tarball (written aside, then renamed: a
# command killed meanwhile leaves the previous one).
pack() {
  tar -C "$work" -czf "$work/logs.tar.gz" logs 2>/dev/null && mv -f "$work/logs.tar.gz" "$tarball"
}

# ------------------------------------------------------------------ preflight
preflight() {
  local needs_py=0 needs_san=0 bad=0 b missing lib
  [ "$part" = 1 ] || needs_py=1
  [ "$part" = 2 ] && needs_san=1
  item() {  # item NEEDED NAME STATUS DETAIL
    local status=$3
    [ "$3" = ok ] || { if [ "$1" = 1 ]; then status=FAILED; bad=1; else status="missing (part $part does not need it)"; fi; }
    printf '  %-26s %-10s %s\n' "$2" "$status" "$4"
  }
  echo "preflight (part $part):"
  local gpu
  if gpu=$(nvidia-smi --query-gpu=name,driver_version,compute_mode,memory.total,ecc.mode.current --format=csv,noheader 2>&1); then
    item 1 "GPU" ok "$(head -1 <<< "$gpu")"
  else
    item 1 "GPU" no "nvidia-smi: $(head -1 <<< "$gpu")"
  fi
  missing=""
  ls build/bin/logprob-server build/bin/logprob-worker > /dev/null 2>&1 || missing="build/bin has no logprob-server / logprob-worker; "
  for b in build/bin/*; do
    [ -f "$b" ] && [ -x "$b" ] || continue
    lib=$(ldd "$b" 2>&1 | awk '/not found/{print $1}' | tr '\n' ' ')
    [ -z "$lib" ] || missing+="${b##*/}: $lib; "
  done
  if [ -z "$missing" ]; then item 1 "libraries (ldd build/bin)" ok "every program resolves"; else item 1 "libraries (ldd build/bin)" no "$missing"; fi
  local worker_libs nccl
  worker_libs=$(ldd build/bin/logprob-worker 2>/dev/null)
  nccl=$(awk '/libnccl/{print $3}' <<< "$worker_libs")
  if [ -n "$nccl" ] && [ -e "$nccl" ]; then
    item 1 "NCCL (the worker's)" ok "$(basename "$(readlink -f "$nccl")") at $nccl"
  else
    item 1 "NCCL (the worker's)" no "logprob-worker finds no libnccl"
  fi
  printf '  %-26s %-10s %s\n' "cuBLASLt, CUDA runtime" "" \
    "$(awk '/libcublasLt|libcudart/{print $3}' <<< "$worker_libs" | xargs -r -n1 readlink -f | tr '\n' ' ')"
  local san
  if san=$(compute-sanitizer --version 2>&1); then item "$needs_san" "compute-sanitizer" ok "$(tail -1 <<< "$san")"; else item "$needs_san" "compute-sanitizer" no "not runnable"; fi
  if [ -n "$LOGPROB_PY_STUBS_DIR" ]; then item "$needs_py" "Python stubs (carried)" ok "$LOGPROB_PY_STUBS_DIR"; else item "$needs_py" "Python stubs (carried)" no "carry build/python with .gpu"; fi
  local py
  if py=$(cd client/python/tests && py_env "$GPU_PYTHON" -c '
import grpc, numpy, torch
import logprob_client
from logprob.v1 import logprob_pb2
assert torch.cuda.is_available(), "torch sees no CUDA device"
print("torch %s (CUDA %s, NCCL %s), numpy %s, grpc %s" % (torch.__version__, torch.version.cuda,
      ".".join(map(str, torch.cuda.nccl.version())), numpy.__version__, grpc.__version__))' 2>&1); then
    item "$needs_py" "python ($GPU_PYTHON)" ok "$(tail -1 <<< "$py")"
  else
    item "$needs_py" "python ($GPU_PYTHON)" no "$(tail -1 <<< "$py") [LD_LIBRARY_PATH=$GPU_BUNDLE_LIB_DIR]"
  fi
  [ -d "$GPU_BUNDLE_LIB_DIR" ] || item 1 "GPU_BUNDLE_LIB_DIR" no "$GPU_BUNDLE_LIB_DIR is no folder (an old .gpu/run.sh, or a second call on a warm machine, whose tree sync drops the unpacked libraries while build/bin stays: begin the command with 'tar -C / -xJf .gpu/bundle.tar.xz;')"
  [ "$bad" = 0 ] && echo "preflight: ok" || echo "preflight: FAILED: part $part stops here (fix the items marked FAILED)"
  return "$bad"
}

# ------------------------------------------------------------------ steps
# step NAME TIMEOUT_S COMMAND: runs COMMAND (bash -c, the helpers above)
# under `timeout`, if it fits in what is left of the budget.
step() {
  local name=$1 limit=$2 cmd=$3
  n=$((n + 1))
  if [ "$part" != all ] && [ "$current" != "$part" ]; then return 0; fi
  part_total[$current]=$((${part_total[$current]:-0} + limit))
  part_steps[$current]=$((${part_steps[$current]:-0} + 1))
  local file
  file=$(printf '%02d-%s.txt' "$n" "$name")
  if [ "$dry" = 1 ]; then
    if [ "$check_filters" = 1 ]; then
      local out
      if out=$(GPU_FIRST_RUN_CHECK=1 bash -c "$cmd" 2>&1); then
        printf '[%02d] part %s %-24s checked\n' "$n" "$current" "$name"
      else
        printf '[%02d] part %s %-24s CHECK FAILED\n%s\n' "$n" "$current" "$name" "$out"
        failed=$((failed + 1))
      fi
      return 0
    fi
    printf '[%02d] part %s %-24s timeout %4ss (steps %4ss) > logs/%s\n     %s\n' "$n" "$current" "$name" "$limit" \
      "${part_total[$current]}" "$file" "$cmd"
    return 0
  fi
  local now left
  now=$(date +%s)
  left=$((budget - (now - start)))
  if [ "$left" -lt "$limit" ]; then
    printf '%-24s SKIPPED (needs %ss, %ss left)  %s\n' "$name" "$limit" "$left" "$cmd" | tee -a "$summary"
    return 0
  fi
  echo "== $name: $cmd" >&2
  local t0 rc status=ok
  t0=$(date +%s)
  timeout --kill-after=10 "$limit" bash -c "$cmd" > "$logs/$file" 2>&1
  rc=$?
  [ "$rc" = 0 ] || { status="FAILED rc=$rc"; failed=$((failed + 1)); }
  [ "$rc" = 124 ] && status="TIMED OUT after ${limit}s"
  [ "$rc" = 0 ] || tail -5 "$logs/$file" | sed 's/^/    | /' >&2
  printf '%-24s %-22s %4ss  %s\n' "$name" "$status" "$(($(date +%s) - t0))" "$cmd" | tee -a "$summary"
  pack
}

if [ "$dry" = 0 ]; then
  say "gpu_first_run: part $part, $(date -u +%FT%TZ), budget ${budget}s (preflight and steps)"
  timeout "$preflight_s" bash -c "part=$part; $(declare -f preflight); preflight" > "$logs/00-preflight.txt" 2>&1
  pre=$?
  tee -a "$summary" < "$logs/00-preflight.txt"
  pack
  if [ "$pre" != 0 ] || [ "$preflight_only" = 1 ]; then
    [ "$pre" = 124 ] && say "preflight: TIMED OUT after ${preflight_s}s"
    say "gpu_first_run: part $part: preflight $([ "$pre" = 0 ] && echo ok || echo FAILED), $(($(date +%s) - start))s; no step ran"
    exit $(( pre != 0 ))
  fi
fi

# The test programs (GPU_FIRST_RUN_BIN_DIR: another build's, for --check-filters).
bin=${GPU_FIRST_RUN_BIN_DIR:-build/bin}
cab=$bin/cuda_backend_test
sct=$bin/server_cuda_test

# Part 1: the correctness core.
current=1
step cuda-units 45 "gt $bin/cuda_error_test '*' && gt $bin/cuda_ipc_range_test '*' && gt $cab '*'"
# A kernel that executes __trap() (LOGPROB_TEST_TRAP_FILE) fails one request
# with UNAVAILABLE and the re-formed pool serves the next; then the GEMM
# failure hook from the environment must fail with its own message.
step fault-injection 40 \
  "gt $sct 'CudaFault.*' && LOGPROB_TEST_FAIL_GEMM_AFTER=2 gt_expect_fail 'lm_head GEMM: injected failure after 2 GEMMs' $cab 'CudaOnePass.PassesOfBoundedMemory*'"
# NCCL on one GPU (the two-GPU NCCL tests skip there) and CUDA IPC over it.
step nccl-1-rank 40 "gt $sct 'CudaGoldenNccl.*OneRank:CudaIpc.OneRankOverNccl*'"
# Every golden case on 1 and 2 Gloo workers, CUDA IPC inputs, the head
# transform's golden on the GPU, the start-up flags.
step servers-gloo 70 \
  "gt $sct 'Workers/CudaGolden.*:CudaIpc.OneWorker*:CudaIpc.TwoWorkersOverGloo*:CudaHeadTransformGolden.*:CudaFlags.*'"
step invariance 85 "gt $bin/cuda_invariance_test '*'"

# Part 2: its own loan.
current=2
step server-batching 60 "gt $bin/server_cuda_batching_test '*'"
# The lm_head's backward (issue 47): float64 references, dL/dh batch
# invariance, the forward's bits, on 1 and 3 ranks sharing the GPU.
step backward 40 "gt $bin/cuda_backward_test '*'"
# The Python client's torch CUDA tests; lm_head update rows from a torch
# CUDA tensor by CUDA IPC with 1 and 2 Gloo workers on the one GPU.
step python-gpu 45 "py_test test_cuda_ipc.GpuTest"
step ipc-update-2-gloo 60 "py_test test_cuda_ipc.GpuUpdateTest"
# V x T = 151936 x 16384 > 2^31 against the GEMM + log_softmax baseline.
step hidden-2g 60 "hidden_2g"
# The top-k radix and sampling-filter slow paths, the one pass (the
# invariance tests' V = 151936 batches are too slow under a sanitizer: the
# one-pass tests of cuda_backend_test stand for them) and CUDA IPC.
filters='CudaRecords.*:CudaFilters.*'
one_pass='CudaOnePass.*:CudaHidden.FusedGemmAndPartialsMatchTheCpuPath'
step memcheck-filters 45 "gt_san memcheck $cab '$filters'"
step racecheck-filters 45 "gt_san racecheck $cab '$filters'"
step memcheck-one-pass-ipc 60 "gt_san memcheck $cab '$one_pass' && gt_san memcheck $sct 'CudaIpc.OneWorker*'"
step racecheck-one-pass-ipc 60 "gt_san racecheck $cab '$one_pass' && gt_san racecheck $sct 'CudaIpc.OneWorker*'"

# Part 3: the figures (commands 1-5 of docs/benchmarks.md), its own loan.
current=3
step bench 120 "run $bin/logprob_cuda_bench --mode all"
step precision 60 \
  "run $bin/logprob_hidden_bench --backend cuda --precisions bf16,tf32,fp32 --h 4096 --n 151936 --t 8192 --rounds 7"
step server-compute 60 "run bash bench/cuda_server_compute.sh"
step torch 60 "py_script bench/torch_baseline.py --json \$GPU_FIRST_RUN_LOGS/torch.json"
# lm_head updates into CUDA workers (issue 34): the weight buffer and, at
# fp32, the staging of the conversion on the device are recycled per
# version; the server log's load times are kept.
step update-cuda 90 "py_script bench/lm_head_update_bench.py --cuda --workers 1 --rounds 3 --updates 3"
step update-cuda-fp32 90 \
  "py_script bench/lm_head_update_bench.py --cuda --workers 1 --rounds 3 --updates 3 --precision fp32"

if [ "$dry" = 1 ]; then
  over=0
  if [ "$check_filters" = 1 ]; then
    echo "gpu_first_run --dry-run --check-filters: $failed step(s) whose filters, classes or programs do not hold"
    exit $(( failed > 0 ))
  fi
  for p in 1 2 3; do
    [ "$part" = all ] || [ "$part" = "$p" ] || continue
    t=${part_total[$p]:-0}
    b=$(part_budget "$p")
    [ -n "${GPU_FIRST_RUN_BUDGET_S:-}" ] && b=$GPU_FIRST_RUN_BUDGET_S
    target=$(part_target "$p")
    status=ok
    [ $((preflight_s + t)) -le "$b" ] || { status="OVER BUDGET"; over=1; }
    [ $((startup_s + b)) -le "$target" ] || { status="OVER THE LOAN TARGET"; over=1; }
    [ "$b" -le "$call_s" ] || { status="OVER ONE DEVICE COMMAND"; over=1; }
    printf 'part %s: %s steps; preflight %ss + steps %ss = %ss of its %ss budget; + start-up %ss = %ss of %ss (%s)\n' \
      "$p" "${part_steps[$p]:-0}" "$preflight_s" "$t" $((preflight_s + t)) "$b" "$startup_s" $((startup_s + b)) \
      "$target" "$status"
  done
  echo "each part: its own loan (${loan_s}s of device time); device run timeout_s = its budget + 60; files in \$OUT: 2 (of 8)"
  # What travels: the working tree (tracked and untracked-not-ignored
  # files) and the carried .gpu and build/python, under 64 MiB.
  if git rev-parse --show-toplevel > /dev/null 2>&1; then
    tree=$(git ls-files -z --cached --others --exclude-standard | du -cb --files0-from=- 2>/dev/null | tail -1 | cut -f1)
    carried=$(du -cb .gpu build/python 2>/dev/null | tail -1 | cut -f1)
    total=$(( ${tree:-0} + ${carried:-0} ))
    status=ok
    [ "$total" -le $((64 << 20)) ] || { status="OVER 64 MiB"; over=1; }
    printf 'travels: working tree %s MiB + .gpu and build/python %s MiB = %s MiB of 64 MiB (%s)\n' \
      $(( ${tree:-0} >> 20 )) $(( ${carried:-0} >> 20 )) $((total >> 20)) "$status"
  fi
  exit "$over"
fi

# Tests that skipped (a GTEST_SKIP, a unittest skip): a skip counts as a
# pass, so they are named here.
{
  echo "skipped tests:"
  grep -h -E '^\[  SKIPPED \] [A-Za-z]' "$logs"/[0-9]*-*.txt 2>/dev/null | sed -E 's/^\[  SKIPPED \] //; s/ \([0-9]+ ms\)$//' |
    sort -u | sed 's/^/  /'
  grep -h -E '\.\.\. skipped ' "$logs"/[0-9]*-*.txt 2>/dev/null | sed -E 's/^ +//' | sort -u | sed 's/^/  /'
} | tee -a "$summary"
say "gpu_first_run: part $part, $failed step(s) failed, $(($(date +%s) - start))s"
pack
[ "$failed" = 0 ]
