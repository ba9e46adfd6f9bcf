#!/usr/bin/env bash
# GPU checks on every GPU this machine has (not yet timed on a GPU; each part has a time limit):
# first the real-architecture check (one GRPO iteration of the 1.5B recipe on a random model of
# Qwen2.5-Math-1.5B's real configuration, hf backend, one GPU: each memory phase's measured peak
# beside `igrpo plan`'s, tokens/s, MFU); the gpu-marked tests; each GPU config's path (tiny
# stand-in model, one GRPO iteration killed mid-way and resumed) with the hf and the vLLM backend
# on all GPUs, printing tokens/s, weight-push seconds and peak memory per GPU, and the 1.5B
# config's path with a LoRA policy (rank 16); then a ~0.4B
# model's GRPO step speed. Keep its output: docs/distributed.md records what ran.
# `bash scripts/gpu_check.sh --cpu` runs the real check at a small size and the iterate checks
# on 2 gloo processes instead (smoke).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
export WANDB_MODE=disabled PYTHONUNBUFFERED=1
# Seconds each part may take (lower them to fit a short lease).
T_REAL=${T_REAL:-420} T_TESTS=${T_TESTS:-240} T_ITERATE=${T_ITERATE:-420} T_SPEED=${T_SPEED:-300}
git log -1 --format='tree at %H' 2>/dev/null
if [ "${1:-}" = "--cpu" ]; then
  NGPU=2; CPU=--cpu; SPEED=--small
  timeout "$T_REAL" "$PY" scripts/gpu_check.py real --cpu
else
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || exit 1
  NGPU=$(nvidia-smi -L | wc -l); CPU=; SPEED=${SPEED_ARGS:-}  # e.g. "--steps 3 --max-new-tokens 128"
  "$PY" -c "import torch, transformers, deepspeed; print('torch', torch.__version__, \
'transformers', transformers.__version__, 'deepspeed', deepspeed.__version__)"
  timeout "$T_REAL" "$PY" scripts/gpu_check.py real
  timeout "$T_TESTS" "$PY" -m pytest -q -m gpu tests/test_gpu.py
fi
BACKENDS="hf"
if "$PY" -c "import vllm" 2>/dev/null; then BACKENDS="hf vllm"; else
  echo "vllm is not installed (pip install -e '.[vllm]'): only the hf backend is checked"; fi
for config in qwen25_math_1p5b.yaml deepseekmath_7b.yaml; do
  for backend in $BACKENDS; do
    timeout "$T_ITERATE" "$PY" scripts/gpu_check.py iterate --config "$config" \
      --backend "$backend" --nproc "$NGPU" --timeout $((T_ITERATE - 20)) $CPU
  done
done
# A LoRA policy (model.lora.rank=16): the same path, killed in GRPO and resumed, its vLLM push
# the merged weights.
for backend in $BACKENDS; do
  timeout "$T_ITERATE" "$PY" scripts/gpu_check.py iterate --config qwen25_math_1p5b.yaml \
    --backend "$backend" --nproc "$NGPU" --timeout $((T_ITERATE - 20)) --lora 16 $CPU
done
for backend in $BACKENDS; do
  timeout "$T_SPEED" "$PY" scripts/gpu_check.py speed --backend "$backend" $SPEED
done
