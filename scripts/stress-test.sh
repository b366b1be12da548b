#!/usr/bin/env bash
# Runs the test suite (ctest in ./build) ROUNDS times in a row while busy
# loops load the CPU (one per core by default, as a busy CI machine or a
# neighbour would), to show that no test depends on timing. Not run by CI.
#
#   bash scripts/stress-test.sh [ROUNDS] [ctest arguments...]
#     ROUNDS                 rounds (default 3)
#     ctest arguments        e.g. -R 'Batching|Lifecycle|Cluster' to stress a subset
#                            (the "soak" label is always left out)
#   STRESS_LOOPS=N           busy loops (default: nproc)
#
# Build first (bash scripts/build.sh). Prints PASS/FAIL per round (with the
# failed tests) and exits non-zero if any round failed; each round's full
# output is in build/stress-test/round-K.log. The busy loops are stopped on
# exit, Ctrl-C included.
set -euo pipefail
cd "$(dirname "$0")/.."

rounds=3
if [[ $# -gt 0 && $1 =~ ^[0-9]+$ ]]; then
  rounds=$1
  shift
fi
loops=${STRESS_LOOPS:-$(nproc)}
if [[ ! -f build/CTestTestfile.cmake ]]; then
  echo "stress-test: no build/CTestTestfile.cmake; run bash scripts/build.sh first" >&2
  exit 2
fi
logs=build/stress-test
mkdir -p "$logs"

busy=()
stop_loops() {
  for pid in "${busy[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${busy[@]}"; do wait "$pid" 2>/dev/null || true; done
  busy=()
}
trap stop_loops EXIT
trap 'exit 130' INT TERM
for ((i = 0; i < loops; i++)); do
  bash -c 'while :; do :; done' &
  busy+=("$!")
done
echo "stress-test: $rounds round(s) of ctest $* with $loops busy loop(s) on $(nproc) core(s)"

failed_rounds=0
for ((r = 1; r <= rounds; r++)); do
  log="$logs/round-$r.log"
  start=$(date +%s)
  # -LE soak: the soak test (scripts/soak.sh) is a minute of load of its own.
  if (cd build && ctest --output-on-failure -j "$(nproc)" --timeout 600 -LE soak "$@") >"$log" 2>&1; then
    status=PASS
  else
    status=FAIL
    failed_rounds=$((failed_rounds + 1))
  fi
  summary=$(grep -E '^[0-9]+% tests passed' "$log" || echo "no ctest summary")
  echo "round $r/$rounds: $status in $(($(date +%s) - start)) s ($summary)"
  if [[ $status == FAIL ]]; then
    # ctest lists the failed tests after "The following tests FAILED:".
    sed -n '/The following tests FAILED:/,$p' "$log" | sed '1d;s/^/    /'
  fi
done
echo "stress-test: $((rounds - failed_rounds)) of $rounds round(s) passed (logs in $logs)"
[[ $failed_rounds -eq 0 ]]
