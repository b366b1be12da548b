#!/usr/bin/env bash
# README command 2: installs dependencies, builds, runs every check:
#   1. the whole test suite on the main build (build/);
#   2. static checks: clang-format and clang-tidy (scripts/lint.sh);
#   3. the whole suite again under AddressSanitizer + UndefinedBehaviorSanitizer
#      (build-asan/), and the concurrent parts under ThreadSanitizer
#      (build-tsan/, ctest label "concurrency"): scripts/sanitize.sh.
# LOGPROB_SANITIZE=0 skips step 3 (a quick local run).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
bash scripts/build.sh
(cd build && ctest --output-on-failure -j "$(nproc)" --timeout 600)
bash scripts/lint.sh
if [ "${LOGPROB_SANITIZE:-1}" != 0 ]; then
  bash scripts/sanitize.sh asan
  bash scripts/sanitize.sh tsan
fi
