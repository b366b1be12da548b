# Sourced by scripts/setup-examples.sh and scripts/setup-trl.sh: the one rule
# their virtual environments share. An environment is Debian's
# /usr/bin/python3 with --system-site-packages (Debian's grpcio, protobuf
# and, unless pinned otherwise, numpy and torch serve it) plus pinned PyPI
# packages; a stamp file holds the sha256 of the pins it was made from, so
# a later call does nothing while the pins are unchanged, and everything
# runs offline.

# venv_is_current VENV WANT: true when VENV exists and was made from the
# pins whose sha256 is WANT.
venv_is_current() {
  [ -x "$1/bin/python" ] && [ "$(cat "$1/.requirements.sha256" 2>/dev/null || true)" = "$2" ]
}

# venv_create VENV: a fresh environment at VENV (an old one is removed).
venv_create() {
  rm -rf "$1"
  /usr/bin/python3 -m venv --system-site-packages "$1"
}

# venv_pip_install WHO VENV NEEDED_BY PIP_ARGS...: pip install PIP_ARGS into
# VENV from PyPI; on failure removes VENV, says why (WHO: the script's name;
# NEEDED_BY: what needs the packages) and returns 1.
venv_pip_install() {
  local who="$1" venv="$2" needed_by="$3"
  shift 3
  if ! "$venv/bin/python" -m pip install --disable-pip-version-check --no-input --retries 2 --timeout 60 "$@"; then
    rm -rf "$venv"
    echo "$who: FAILED: could not install $* from PyPI (is PyPI reachable, directly or through" \
      "PIP_INDEX_URL / a proxy?). $needed_by need these packages; they are downloaded once, then" \
      "everything runs offline." >&2
    return 1
  fi
}

# venv_stamp VENV WANT: records that VENV holds the pins whose sha256 is WANT.
venv_stamp() {
  echo "$2" > "$1/.requirements.sha256"
}
