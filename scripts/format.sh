#!/usr/bin/env bash
# Formats every tracked C++/CUDA source with clang-format and the
# repository's .clang-format (Google style, 120 columns).
#   bash scripts/format.sh          rewrite the files in place
#   bash scripts/format.sh --check  list the files that differ; exit 1 if any
set -euo pipefail
cd "$(dirname "$0")/.."
command -v clang-format >/dev/null || { echo "clang-format not found (Debian: clang-format)" >&2; exit 2; }
mapfile -t files < <(git ls-files '*.cc' '*.h' '*.cu' '*.cuh')
if [ "${1:-}" = "--check" ]; then
  bad=0
  for f in "${files[@]}"; do
    if ! clang-format --style=file "$f" | cmp -s - "$f"; then echo "$f"; bad=1; fi
  done
  exit $bad
fi
clang-format --style=file -i "${files[@]}"
