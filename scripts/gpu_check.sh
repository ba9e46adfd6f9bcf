#!/usr/bin/env bash
# GPU checks, ready to run on one GPU (about 8 minutes): the gpu-marked tests (one iterate unit of
# tiny random models on CUDA, every model of the loop on the GPU), then a few GRPO steps of a
# ~0.4B random-init model in bf16 printing tokens/s, peak memory and MFU.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
timeout 240 "$PY" -m pytest -q -m gpu tests/test_gpu.py
timeout 300 "$PY" scripts/gpu_check.py "$@"
