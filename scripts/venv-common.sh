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

# venv_free_gib VENV: the GiB free on the filesystem that holds VENV.
venv_free_gib() {
  df -P -BG "$(dirname "$1")" | awk 'NR == 2 { sub("G", "", $4); print $4 }'
}

# venv_pip_install WHO VENV NEEDED_BY PIP_ARGS...: pip install PIP_ARGS into
# VENV from PyPI, without pip's wheel cache (the environment is what is
# reused; a cached copy of every wheel would double the disk it takes); on
# failure removes VENV, says why (WHO: the script's name; NEEDED_BY: what
# needs the packages; the disk space left) and returns 1.
venv_pip_install() {
  local who="$1" venv="$2" needed_by="$3"
  shift 3
  if ! "$venv/bin/python" -m pip install --disable-pip-version-check --no-input --no-cache-dir --retries 5 \
    --timeout 60 "$@"; then
    echo "$who: FAILED: could not install $* from PyPI into $venv ($(venv_free_gib "$venv") GiB free there" \
      "now; is PyPI reachable, directly or through PIP_INDEX_URL / a proxy?). $needed_by need these" \
      "packages; they are downloaded once, then everything runs offline." >&2
    rm -rf "$venv"
    return 1
  fi
}

# venv_pip_install_one_by_one WHO VENV NEEDED_BY PIN...: each PIN on its own
# (--no-deps), so that the disk holds at most one downloaded wheel beside
# the environment: for the large ones (torch and its CUDA wheels, ~4 GB
# downloaded, ~6 GB installed), which pip would otherwise download all
# before it installs any.
venv_pip_install_one_by_one() {
  local who="$1" venv="$2" needed_by="$3" pin
  shift 3
  for pin in "$@"; do
    venv_pip_install "$who" "$venv" "$needed_by" --no-deps "$pin" || return 1
  done
}

# venv_stamp VENV WANT: records that VENV holds the pins whose sha256 is WANT.
venv_stamp() {
  echo "$2" > "$1/.requirements.sha256"
}
