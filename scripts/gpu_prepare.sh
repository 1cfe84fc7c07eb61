#!/usr/bin/env bash
# Run HERE (the machine without a GPU) before `scripts/gpu_smoke.sh` runs on a lent GPU machine: fills the
# git-ignored folder .gpu/ with what that machine lacks - wheels (CPython 3.12) of the packages its image
# does not hold, and the embedded model's config and tokenizer (its weights are over the transfer limit:
# the smoke initialises them at random, which is what timings and engine/Learner agreement need).
# Then call the device tool with carry [".gpu"] and command "bash scripts/gpu_smoke.sh".
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
mkdir -p .gpu/whl .gpu/smollm2-135m
pin() { grep -i "^$1==" requirements.lock; }
PY=${PY:-.venv/bin/python}
for name in pydantic pydantic_core annotated-types typing-inspection llguidance; do
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .gpu/whl "$(pin "$name")"
done
"$PY" - <<'PY'
import shutil
from pathlib import Path
from posttrain.models.loading import ensure_embedded  # the cached conversion of the embedded GGUF
src = Path(ensure_embedded())
for f in src.iterdir():
    if f.suffix != ".safetensors":
        shutil.copy(f, Path(".gpu/smollm2-135m") / f.name)
PY
du -sh .gpu
