#!/usr/bin/env bash
# Static checks of the project's C++ (run by scripts/test.sh):
#   clang-format: every tracked source formatted (scripts/format.sh --check);
#   no absl::Mutex Await / LockWhen (the TSan build cannot see them);
#   no kernel launcher returning a bare cudaGetLastError() (LaunchCheck);
#   clang-tidy:   the checks of .clang-tidy over the front-end, worker, common
#                 and client sources (not CUDA, not tests), with the main
#                 build's compile commands (build/compile_commands.json);
#                 clang 14 has no _Float16 on x86, so it reads __fp16 (as
#                 the fuzzers' clang build does).
# Exit 1 on any finding. Needs scripts/build.sh to have configured build/.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/format.sh --check || { echo "lint: files above differ from clang-format (run scripts/format.sh)" >&2; exit 1; }
# The server's rooms include only the rooms below them (docs/architecture.md).
python3 scripts/check_layers.py || exit 1
# The TSan build sees absl::Mutex Lock / Unlock and CondVar waits only
# (common/tsan_absl_mutex.cc): a Mutex::Await or LockWhen releases the
# mutex unseen, and TSan then reports a double lock. Use a CondVar.
if git grep -n -E '\.(Await|AwaitWithTimeout|AwaitWithDeadline|LockWhen|LockWhenWithTimeout|ReaderLockWhen)\(' -- \
    'server/*.cc' 'server/*.h' 'common/*.cc' 'common/*.h' 'worker/*.cc' 'worker/*.h' 'client/*.cc' 'client/*.h' >&2; then
  echo "lint: absl::Mutex conditions above: wait on an absl::CondVar instead (the TSan build cannot see them)" >&2
  exit 1
fi
# A launcher that returns cudaGetLastError() reports an error some earlier
# call left on the thread as its own (issue 35 item 1, again in issue 50):
# launchers use LaunchCheck (worker/cuda/cuda_error.h).
if git grep -n -E '^[[:space:]]*return[[:space:]]+cudaGetLastError\(\);' -- '*.cu' '*.cuh' >&2; then
  echo "lint: a launcher above returns a bare cudaGetLastError(): use LaunchCheck (worker/cuda/cuda_error.h)" >&2
  exit 1
fi
command -v clang-tidy >/dev/null || { echo "clang-tidy not found (Debian: clang-tidy)" >&2; exit 2; }
[ -f build/compile_commands.json ] || { echo "lint: run scripts/build.sh first (build/compile_commands.json)" >&2; exit 2; }
mapfile -t files < <(git ls-files 'server/*.cc' 'common/*.cc' 'worker/*.cc' 'worker/kernels/*.cc' 'client/*.cc' |
                     grep -v '^common/tsan_absl_mutex.cc$')
echo "lint: clang-tidy over ${#files[@]} files" >&2
printf '%s\n' "${files[@]}" | xargs -P "$(nproc)" -n 4 clang-tidy -p build --quiet --extra-arg=-D_Float16=__fp16 2>&1 |
  grep -v -E '^[0-9]+ warnings? generated\.$|^Suppressed [0-9]+ warnings|^Use -header-filter|^$' > build/clang-tidy.log || true
if grep -q -E 'warning:|error:' build/clang-tidy.log; then
  cat build/clang-tidy.log >&2
  exit 1
fi
echo "lint: clean" >&2
