#!/usr/bin/env bash
# Run THERE (a lent GPU machine; `scripts/gpu_prepare.sh` filled .gpu/ here and the device tool carried it):
# installs the carried wheels beside the image's PyTorch and runs scripts/gpu_smoke.py on CUDA - the paged
# engine and the Learner on the GPU, their logprob agreement, an FSDP2 step over NCCL, a 2-step GRPO run with
# trainer.device and engine.device cuda, and vLLM where the
# image has it. The JSON figures go to $OUT/gpu_smoke.json.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/whl/*.whl
export PYTHONPATH="$PWD/src:/tmp/site" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
OUT=${OUT:-/tmp}
python3 scripts/gpu_smoke.py --device cuda --dtype bfloat16 --model .gpu/smollm2-135m --random-init \
  --prompts 32 --tokens 128 | tee "$OUT/gpu_smoke.log"
tail -n 1 "$OUT/gpu_smoke.log" > "$OUT/gpu_smoke.json"
