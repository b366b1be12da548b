#!/usr/bin/env bash
# Makes the TRL environment (.venv-trl): Debian's /usr/bin/python3 in a
# virtual environment with --system-site-packages, so that Debian's
# python3-grpcio and python3-protobuf (scripts/install-deps.sh) serve the
# client's gRPC stubs, plus the pinned PyPI packages of
# client/python/requirements-trl.txt (TRL 1.16, transformers, torch, numpy
# 2.x, ...), and verl 0.9.1 without its dependencies
# (requirements-trl-nodeps.txt: only its fused PPO seam is used). It is
# what logprob_client.trl and .verl are tested with (ctest py_trl_*) and
# what docs/rl-frameworks.md's TRL example runs in. Needs PyPI once (2-5
# minutes, 6 GB: torch comes with its CUDA wheels, installed one
# at a time so that no more than ~7 GB is ever taken); afterwards it
# does nothing while the environment holds exactly those pins, and
# everything runs offline.
#
#   bash scripts/setup-trl.sh     # then: PYTHONPATH=client/python:build/python .venv-trl/bin/python ...
#
# LOGPROB_TRL_VENV=DIR puts the environment elsewhere (default: .venv-trl in
# the repository). The ctest py_trl_* tests call this script first
# (fixture trl_venv), so scripts/test.sh sets it up too.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/venv-common.sh
venv="${LOGPROB_TRL_VENV:-$PWD/.venv-trl}"
req=client/python/requirements-trl.txt
nodeps=client/python/requirements-trl-nodeps.txt
want="$(cat "$req" "$nodeps" | sha256sum | cut -d' ' -f1)"
if venv_is_current "$venv" "$want"; then
  echo "setup-trl: $venv is up to date with $req"
  exit 0
fi
if ! /usr/bin/python3 -c 'import grpc, google.protobuf' 2>/dev/null; then
  echo "setup-trl: Debian's python3-grpcio and python3-protobuf are missing: run scripts/install-deps.sh first" >&2
  exit 1
fi
venv_create "$venv"
echo "setup-trl: installing $req from PyPI into $venv ($(venv_free_gib "$venv") GiB free there; it takes ~7)" >&2
# torch and the nvidia-* CUDA wheels first, one at a time; then the rest,
# which finds them installed.
mapfile -t large < <(grep -E '^(torch|nvidia-[a-z0-9-]+|triton)==' "$req")
venv_pip_install_one_by_one setup-trl "$venv" "logprob_client.trl's tests (ctest -R py_trl_)" "${large[@]}"
venv_pip_install setup-trl "$venv" "logprob_client.trl's tests (ctest -R py_trl_)" -r "$req"
venv_pip_install setup-trl "$venv" "logprob_client.verl's seam test" --no-deps -r "$nodeps"
# The environment must hold the pinned TRL, torch and numpy (not Debian's),
# and Debian's grpcio / protobuf must work with that numpy.
"$venv/bin/python" - <<'PY'
import sys
import google.protobuf, grpc, numpy, torch, transformers, trl
if not numpy.__version__.startswith("2."):
    sys.exit("setup-trl: numpy %s from %s, not the pinned 2.x" % (numpy.__version__, numpy.__file__))
if torch.__file__.startswith("/usr/lib/python3/"):
    sys.exit("setup-trl: torch comes from Debian (%s), not from the requirements" % torch.__file__)
print("setup-trl: trl %s, transformers %s, torch %s, numpy %s; grpcio %s, protobuf %s (Debian)"
      % (trl.__version__, transformers.__version__, torch.__version__, numpy.__version__, grpc.__version__,
         google.protobuf.__version__))
PY
venv_stamp "$venv" "$want"
