#!/usr/bin/env bash
# GPU checks, ready to run on one GPU (about 12 minutes): the gpu-marked tests (one iterate unit of
# tiny random models on CUDA, every model of the loop on the GPU), then a few GRPO steps of a
# ~0.4B random-init model in bf16 printing tokens/s, peak memory and MFU.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
timeout 240 "$PY" -m pytest -q -m gpu tests/test_gpu.py
# The same GRPO steps with each rollout backend (vLLM needs `pip install -e '.[vllm]'`).
timeout 300 "$PY" scripts/gpu_check.py --backend hf "$@"
if "$PY" -c "import vllm" 2>/dev/null; then
  timeout 300 "$PY" scripts/gpu_check.py --backend vllm "$@"
else
  echo "vllm is not installed: the vllm backend's check is skipped"
fi
