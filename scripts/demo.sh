#!/usr/bin/env bash
# README command 1: installs dependencies, builds, starts logprob-server
# with 2 CPU workers and an lm_head, scores example files kept in the
# repository (logits, then hidden states) with logprob-client and prints
# the results, then stops the server.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
bash scripts/build.sh
PORT="${PORT:-50051}"
INPUT="${INPUT:-tests/data/golden/llama_vocab_bf16.safetensors}"
HIDDEN="${HIDDEN:-tests/data/golden/hidden_bf16.safetensors}"
LM_HEAD="${LM_HEAD:-tests/data/golden/hidden_bf16.lm_head.safetensors}"
DIR="$(mktemp -d)"
OUT="${DIR}/scores.safetensors"
build/bin/logprob-server --listen "127.0.0.1:${PORT}" --workers 2 --backend cpu --lm-head "$LM_HEAD" &
SERVER=$!
trap 'kill $SERVER 2>/dev/null; wait $SERVER 2>/dev/null || true' EXIT
build/bin/logprob-client health --server "127.0.0.1:${PORT}" --wait 60
echo "== scoring ${INPUT} (Llama vocabulary, bf16 logits [2, 96, 32000]) with 2 workers"
build/bin/logprob-client score --server "127.0.0.1:${PORT}" --input "$INPUT" --output "$OUT" \
  --entropy --topk 8
echo "== outputs written to ${OUT}"
echo "== scoring ${HIDDEN} (hidden states [2, 32, 256] bf16; the server holds lm_head [8192, 256])"
build/bin/logprob-client score --server "127.0.0.1:${PORT}" --input "$HIDDEN" --output "${DIR}/hidden_scores.safetensors" \
  --entropy
echo "== outputs written to ${DIR}/hidden_scores.safetensors"
