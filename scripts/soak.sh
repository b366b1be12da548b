#!/usr/bin/env bash
# Soak test (scripts/soak.py): a logprob-server with 2 CPU workers and an
# lm_head under mixed load (unary, ScoreStream, ScoreChunked, shared memory,
# asyncio with cancellations and expiring deadlines) for SECONDS while a
# worker is SIGKILLed and another SIGSTOPped each minute; then checks every
# outcome, the memory bound, the front-end's fds and threads, and /metrics.
#
#   bash scripts/soak.sh [SECONDS] [--no-faults]     SECONDS of load (default 60)
#   LOGPROB_BIN_DIR=DIR   the binaries (default build/bin); PYTHON (default /usr/bin/python3)
#
# Build first (bash scripts/build.sh). Prints a summary; exits 1 with the
# reasons on any violation. ctest runs the 60 s version (label "soak").
set -euo pipefail
cd "$(dirname "$0")/.."
export LOGPROB_BIN_DIR=${LOGPROB_BIN_DIR:-build/bin}
export PYTHONPATH=client/python:build/python${PYTHONPATH:+:$PYTHONPATH}
exec "${PYTHON:-/usr/bin/python3}" scripts/soak.py "$@"
