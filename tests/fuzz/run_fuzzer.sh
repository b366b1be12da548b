#!/usr/bin/env bash
# Runs a libFuzzer binary for a bounded time over a scratch copy of its seed
# corpus; exits non-zero on any crash, leak, timeout or OOM. Crash inputs are
# kept in ARTIFACTS_DIR (default: the binary's directory/artifacts).
# Usage: run_fuzzer.sh BINARY SECONDS SEED_DIR... [-- LIBFUZZER_FLAGS...]
# Seed files over 64 KiB are skipped (the golden logits files are MBs).
# FUZZ_CORPUS_DIR, when set, is the corpus directory (kept, and grown, across
# runs); otherwise a scratch directory is used and removed.
set -euo pipefail
bin=$1 secs=$2
shift 2
seeds=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do seeds+=("$1"); shift; done
[ "${1:-}" = "--" ] && shift
name=$(basename "$bin")
artifacts=${ARTIFACTS_DIR:-$(dirname "$bin")/artifacts}
mkdir -p "$artifacts"
work=$(mktemp -d "${TMPDIR:-/tmp}/$name.XXXXXX")
trap 'rm -rf "$work"' EXIT
corpus=${FUZZ_CORPUS_DIR:-$work/corpus}
mkdir -p "$corpus" "$work/tmp"
for d in "${seeds[@]}"; do
  if [ -d "$d" ]; then
    find "$d" -maxdepth 1 -type f -size -65k -exec cp {} "$corpus"/ \;
  fi
done
echo "$name: $(ls "$corpus" | wc -l) seed inputs, ${secs}s" >&2
rc=0
TMPDIR=$work/tmp "$bin" -max_total_time="$secs" -timeout=10 -rss_limit_mb=2048 -max_len=65536 \
  -print_final_stats=1 -print_funcs=0 -artifact_prefix="$artifacts/$name-" "$@" "$corpus" || rc=$?
if [ $rc -ne 0 ]; then echo "$name: FAILED (exit $rc); the input is in $artifacts/" >&2; fi
exit $rc
