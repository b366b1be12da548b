#!/usr/bin/env bash
# Builds the suite with sanitizers and runs it (scripts/test.sh calls it;
# it can also run alone once scripts/install-deps.sh has run).
#
#   bash scripts/sanitize.sh asan   # AddressSanitizer + UndefinedBehaviorSanitizer,
#                                   # every C++ and Python test (build-asan/)
#   bash scripts/sanitize.sh tsan   # ThreadSanitizer over the concurrent parts
#                                   # (ctest label "concurrency", build-tsan/)
#
# Extra arguments go to ctest (e.g. -R batcher). A report fails the test
# that triggered it (halt_on_error / -fno-sanitize-recover). CUDA code and
# the libFuzzer targets are not part of these builds (the fuzzers have
# their own ASan/UBSan build in the main tree).
set -euo pipefail
cd "$(dirname "$0")/.."
kind="${1:-}"
shift || true
case "$kind" in
  asan)
    sanitizers="address,undefined"
    # Everything but the soak and stress tests: their memory-bound checks
    # read RSS, which ASan's shadow memory and quarantine inflate.
    labels=(-LE 'soak|stress')
    # Leaks are reported at exit, so a leak fails the process's test.
    export ASAN_OPTIONS="detect_leaks=1:abort_on_error=0:halt_on_error=1:strict_string_checks=1:detect_stack_use_after_return=1:check_initialization_order=1"
    export LSAN_OPTIONS="suppressions=$PWD/scripts/sanitizers/lsan.supp:print_suppressions=0"
    export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
    ;;
  tsan)
    sanitizers="thread"
    # Two live-server tests size their workload to last seconds natively;
    # under TSan (5-15x slower) they outlast their own bounds: left out.
    labels=(-L concurrency -E 'Lifecycle[.](SigtermDrainsTheRequestsInFlight|OverloadGetsExactlyOneAnswerPerRequest)')
    # Suppressions: scripts/sanitizers/tsan.supp plus, below, the Debian
    # libraries (not built with TSan) that the binaries load.
    # TSAN_OPTIONS is exported after the build: gtest_discover_tests runs
    # the test binaries at build time, before the list below exists.
    tsan_options="halt_on_error=1:second_deadlock_stack=1:suppressions=$PWD/build-tsan/tsan.supp"
    ;;
  *)
    echo "usage: $0 asan|tsan [ctest arguments]" >&2
    exit 2
    ;;
esac
dir="build-$kind"
cmake -S . -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DLOGPROB_SANITIZE="$sanitizers" >/dev/null
if [ "$kind" = tsan ]; then
  # Only what the concurrency tests need (tests/CMakeLists.txt).
  cmake --build "$dir" -j "$(nproc)" --target concurrency_tests
  cp scripts/sanitizers/tsan.supp "$dir/tsan.supp"
  export TSAN_OPTIONS="$tsan_options"
  for b in "$dir"/bin/*; do ldd "$b" 2>/dev/null || true; done | awk '{print $1}' |
    grep -E '^lib(absl_|grpc|gpr|protobuf|upb|address_sorting|re2|cares|dnnl)' | sed -E 's/(\.so)\..*/\1./' | sort -u |
    sed 's/^/called_from_lib:/' >> "$dir/tsan.supp"
else
  cmake --build "$dir" -j "$(nproc)"
fi
cd "$dir"
echo "sanitize.sh: $kind: running ctest ${labels[*]} $*" >&2
ctest --output-on-failure -j "$(nproc)" --timeout 900 "${labels[@]}" "$@"
