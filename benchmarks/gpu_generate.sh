#!/usr/bin/env bash
# The decoding engine's figures on a CUDA GPU: benchmarks/generate_speed.py in bfloat16 on the GPU,
# the same four ratios as on the CPU plus the batch-1 decode bandwidth utilisation (bytes of weights and KV
# cache read per step over the step time, against the card's memory bandwidth).
#
#   bash benchmarks/gpu_generate.sh [generate_speed.py flags...]     e.g. --streams 1,8,32,128
#
# Install: nothing from a registry, so it runs on a machine without network access. The machine needs torch,
# transformers, tokenizers and numpy; memlm runs from this tree (PYTHONPATH), and wheels of what the machine
# lacks are taken from ./.wheels when present (gguf, to read SmolLM2's GGUF).
# Weights: SmolLM2 when $MEMLM_CACHE holds the fetched GGUF; else random weights of SmolLM2's shape,
# --synthetic, and the output says so: the same shapes and the same work per token, so the speed figures
# hold, the tokens mean nothing.
# PEAK_GBS: the card's memory bandwidth in GB/s (default 4800, an H200's HBM3e).
# The result: generate_speed_gpu.json in docs/results/data (benchmarks/harness.py; MEMLM_RESULTS_DIR moves it).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ -d .wheels ]; then
  "$PY" -m pip install --quiet --no-index --find-links .wheels gguf
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0))"
flags=()
if ! "$PY" -c "from memlm.model.weights import model_path; import sys; sys.exit(not model_path('smollm2-135m').is_file())"; then
  flags+=(--synthetic)
fi
out=${OUT:-/tmp}
# The GPU tests first (CUDA graphs replay = the eager step, the engine on the device = on the CPU), where the
# image has pytest; their output goes beside the figures.
if "$PY" -c "import pytest" 2>/dev/null; then
  "$PY" -m pytest -q -m gpu tests/memlm/engine 2>&1 | tail -15 | tee "$out/gpu_tests.txt" || true
fi
"$PY" benchmarks/generate_speed.py --device cuda --dtype bfloat16 --peak-gbs "${PEAK_GBS:-4800}" --result-name generate_speed_gpu \
  --repeats 3 --figures 1,2,3,4,6 "${flags[@]}" "$@" 2>&1 | tee "$out/generate_speed_gpu.txt"
