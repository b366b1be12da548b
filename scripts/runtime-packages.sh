#!/usr/bin/env bash
# Prints the Debian packages that ship the shared libraries the given binaries
# load (ldd), one per line, sorted: the runtime stage of the Dockerfile
# installs exactly these instead of the -dev packages of install-deps.sh.
# Exits 1 when a library is not found or no installed package ships it.
# The NVIDIA driver's libraries (libcuda, libnvidia-ml) are skipped: the
# NVIDIA container runtime mounts them from the host. CUDA toolkit libraries
# (cudart, cublasLt, NCCL) that no package ships (a toolkit installed from
# NVIDIA's runfile under /usr/local/cuda*) are named on stderr and skipped:
# the GPU image installs them from NVIDIA's repository, where dpkg finds them.
set -euo pipefail
if [ $# -eq 0 ]; then echo "usage: $0 BINARY..." >&2; exit 2; fi
fail=0
out=$(LC_ALL=C ldd "$@") || { echo "$0: ldd failed on $*" >&2; exit 1; }
if grep -q 'not found' <<<"$out"; then
  if grep 'not found' <<<"$out" | grep -v -E '^\s*lib(cuda|nvidia-ml)\.so' >&2; then fail=1; fi
fi
# "libfoo.so.1 => /lib/x86_64-linux-gnu/libfoo.so.1 (0x...)" and "/lib64/ld-linux-x86-64.so.2 (0x...)".
libs=$(awk '$2 == "=>" && $3 ~ /^\// {print $3} $1 ~ /^\// && $2 ~ /^\(0x/ {print $1}' <<<"$out" | sort -u)
pkgs=()
for lib in $libs; do
  base=$(basename "$lib")
  case "$base" in libcuda.so*|libnvidia-ml.so*) continue ;; esac
  real=$(readlink -f "$lib")
  pkg=""
  # Debian 12 has a merged /usr: a package may list the file under /lib or /usr/lib.
  for p in "$lib" "$real" "/usr$lib" "/usr$real" "${lib#/usr}" "${real#/usr}"; do
    pkg=$(dpkg-query -S "$p" 2>/dev/null | grep -v '^diversion' | head -n1 | sed 's/: .*//; s/,.*//; s/:.*//') || true
    if [ -n "$pkg" ]; then break; fi
  done
  if [ -z "$pkg" ]; then
    case "$real" in
      /usr/local/cuda*) echo "$0: $lib comes from the CUDA toolkit in /usr/local, not a package; skipped" >&2; continue ;;
    esac
    echo "$0: no installed Debian package ships $lib" >&2; fail=1; continue
  fi
  pkgs+=("$pkg")
done
if [ "$fail" != 0 ]; then exit 1; fi
printf '%s\n' "${pkgs[@]}" | sort -u
