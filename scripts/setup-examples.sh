#!/usr/bin/env bash
# Makes the virtual environment of the examples (examples/*.py): Debian's
# /usr/bin/python3 with its own torch and numpy (python3 -m venv
# --system-site-packages; scripts/install-deps.sh installs them), plus the
# pinned PyPI packages of examples/requirements.txt (transformers). Needs
# PyPI once; afterwards it does nothing while the environment holds exactly
# those pins, and the examples run offline.
#
#   bash scripts/setup-examples.sh        # then: .venv-examples/bin/python examples/hf_logprobs.py
#
# LOGPROB_EXAMPLES_VENV=DIR puts the environment elsewhere (default:
# .venv-examples in the repository). The ctest example_* tests call this
# script first (fixture examples_venv), so scripts/test.sh sets it up too.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/venv-common.sh
venv="${LOGPROB_EXAMPLES_VENV:-$PWD/.venv-examples}"
req=examples/requirements.txt
want="$(sha256sum "$req" | cut -d' ' -f1)"
if venv_is_current "$venv" "$want"; then
  echo "setup-examples: $venv is up to date with $req"
  exit 0
fi
if ! /usr/bin/python3 -c 'import numpy, torch' 2>/dev/null; then
  echo "setup-examples: Debian's python3-torch and python3-numpy are missing: run scripts/install-deps.sh first" >&2
  exit 1
fi
venv_create "$venv"
echo "setup-examples: installing $req from PyPI into $venv" >&2
venv_pip_install setup-examples "$venv" "The examples and their tests (ctest -R example_)" -r "$req"
# The environment must use Debian's torch (no wheel of torch came in).
"$venv/bin/python" - <<'PY'
import sys
import torch, transformers
if not torch.__file__.startswith("/usr/lib/python3/"):
    sys.exit("setup-examples: torch comes from %s, not Debian's python3-torch" % torch.__file__)
print("setup-examples: transformers %s, torch %s (Debian)" % (transformers.__version__, torch.__version__))
PY
venv_stamp "$venv" "$want"
