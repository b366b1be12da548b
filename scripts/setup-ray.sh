#!/usr/bin/env bash
# Makes the Ray environment (.venv-ray): Debian's /usr/bin/python3 in a
# virtual environment with --system-site-packages, so that Debian's
# python3-grpcio, python3-protobuf and python3-numpy
# (scripts/install-deps.sh) serve the client, plus Ray core and its
# dependencies pinned in client/python/requirements-ray.txt. It is what
# logprob_client.ray is tested with (ctest py_ray_*) and what
# docs/deployment.md's Ray section runs in. Needs PyPI once (about 1
# minute, 80 MB); afterwards it does nothing while the environment holds
# exactly those pins, and everything runs offline.
#
#   bash scripts/setup-ray.sh     # then: PYTHONPATH=client/python:build/python .venv-ray/bin/python ...
#
# LOGPROB_RAY_VENV=DIR puts the environment elsewhere (default: .venv-ray in
# the repository). The ctest py_ray_* tests call this script first
# (fixture ray_venv), so scripts/test.sh sets it up too.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/venv-common.sh
venv="${LOGPROB_RAY_VENV:-$PWD/.venv-ray}"
req=client/python/requirements-ray.txt
want="$(sha256sum < "$req" | cut -d' ' -f1)"
if venv_is_current "$venv" "$want"; then
  echo "setup-ray: $venv is up to date with $req"
  exit 0
fi
if ! /usr/bin/python3 -c 'import grpc, google.protobuf, numpy' 2>/dev/null; then
  echo "setup-ray: Debian's python3-grpcio, python3-protobuf or python3-numpy is missing:" \
    "run scripts/install-deps.sh first" >&2
  exit 1
fi
venv_create "$venv"
echo "setup-ray: installing $req from PyPI into $venv" >&2
venv_pip_install setup-ray "$venv" "logprob_client.ray's tests (ctest -R py_ray_)" -r "$req"
# Ray must come from the pins, and import with Debian's grpcio / protobuf.
"$venv/bin/python" - <<'PY'
import sys
import google.protobuf, grpc, numpy, ray
if ray.__version__ != "2.60.0":
    sys.exit("setup-ray: ray %s from %s, not the pinned 2.60.0" % (ray.__version__, ray.__file__))
print("setup-ray: ray %s; grpcio %s, protobuf %s, numpy %s (Debian)"
      % (ray.__version__, grpc.__version__, google.protobuf.__version__, numpy.__version__))
PY
venv_stamp "$venv" "$want"
