#!/usr/bin/env bash
# Run THERE (a lent GPU machine; `scripts/gpu_prepare.sh` filled .gpu/ here and the device tool carried it):
# installs the carried wheels beside the image's PyTorch and runs the GPU checks, then prints one line per
# check: PASS, FAIL or SKIP with the reason.
#   cuda_engine_learner  the paged engine and the Learner on CUDA, their logprob agreement (scripts/gpu_smoke.py)
#   cuda_learner_fsdp    a Learner step under FSDP2 over NCCL (gpu_smoke.py check_fsdp)
#   rl_run_2_steps       a 2-step GRPO run with trainer.device and engine.device cuda, and a resume (check_rl_run)
#   vllm_cuda            engine.backend=vllm on CUDA: decode, logprobs against the Learner's, sleep, a push (check_vllm)
#   vlm                  a LLaVA-style VLM through the paged engine and the Learner (check_vlm)
#   nccl_weight_broadcast  weight_sync.Broadcast over NCCL, rank 0 to rank 1 on two GPUs: tensors arrive exact
# The JSON figures go to $OUT/gpu_smoke.json. Exit 1 if any check failed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/whl/*.whl
export PYTHONPATH="$PWD/src:/tmp/site" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true

timeout 420 python3 scripts/gpu_smoke.py --device cuda --dtype bfloat16 --model .gpu/smollm2-135m --random-init \
  --prompts 32 --tokens 128 > "$OUT/gpu_smoke.log" 2> "$OUT/gpu_smoke.err"
tail -n 1 "$OUT/gpu_smoke.log" > "$OUT/gpu_smoke.json"

timeout 120 python3 - > "$OUT/nccl_broadcast.txt" 2>> "$OUT/gpu_smoke.err" <<'PY'
import os
import torch
import torch.distributed as dist
import torch.multiprocessing as mp


class Sink:  # the engine side of a Receiver: keeps what arrives
    version = 0

    def load_weights(self, weights, version=None):
        self.got = {k: v.clone() for k, v in weights.items()}
        self.version = version


def rank(r: int, world: int, q) -> None:
    from posttrain.orchestrator.weight_sync import Broadcast, Receiver, full_update

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29541")
    torch.cuda.set_device(r)
    dist.init_process_group("nccl", rank=r, world_size=world)
    g = torch.Generator().manual_seed(0)
    ref = {f"layer{i}.weight": torch.randn(256, 256, generator=g) for i in range(4)}
    bc = Broadcast(src=0, device=f"cuda:{r}")
    if r == 0:
        bc.push(full_update({k: v.cuda() for k, v in ref.items()}, 3))
    else:
        sink = Sink()
        bc.push(None, Receiver(sink))
        exact = sink.version == 3 and all(torch.equal(sink.got[k].cpu(), v) for k, v in ref.items())
        q.put("PASS 4 tensors, version 3, bit-exact" if exact else "FAIL tensors or version differ")
    dist.destroy_process_group()


if __name__ == "__main__":
    if torch.cuda.device_count() < 2:
        print(f"SKIP needs 2 GPUs (NCCL refuses two ranks on one GPU); this machine has {torch.cuda.device_count()}")
    else:
        q = mp.get_context("spawn").Queue()
        mp.spawn(rank, args=(2, q), nprocs=2, join=True)
        print(q.get(timeout=10))
PY
[ -s "$OUT/nccl_broadcast.txt" ] || echo "FAIL crashed (see gpu_smoke.err)" > "$OUT/nccl_broadcast.txt"

python3 - "$OUT/gpu_smoke.json" "$OUT/nccl_broadcast.txt" <<'PY'
import json
import sys

try:
    out = json.load(open(sys.argv[1]))
except (OSError, ValueError) as err:
    out = {"failed": ["all"], "error": f"gpu_smoke.py printed no JSON ({err}): see gpu_smoke.err"}
checks = [
    ("cuda_engine_learner", "check_engine_and_learner", "paged_vs_learner_max_logprob_diff"),
    ("cuda_learner_fsdp", "check_fsdp", "fsdp_step_s"),
    ("rl_run_2_steps", "check_rl_run", "rl_weights_max_change"),
    ("vllm_cuda", "check_vllm", "vllm_vs_learner_max_logprob_diff"),
    ("vlm", "check_vlm", "vlm_greedy_tokens_equal_hf"),
]
bad = 0
for label, fn, key in checks:
    if "all" in out.get("failed", []):
        line, bad = f"FAIL {out['error']}", bad + 1
    elif fn in out.get("failed", []):
        line, bad = f"FAIL {out.get(fn + '_error', '?')}", bad + 1
    elif label == "vllm_cuda" and isinstance(out.get("vllm"), str):
        line = "SKIP vLLM is not installed in this image (its CUDA wheels are over the transfer limit)"
    elif key in out:
        line = f"PASS {key}={json.dumps(out[key])}"
    else:
        line = "PASS"
    print(f"{label:22s} {line}")
nccl = open(sys.argv[2]).read().strip()
print(f"{'nccl_weight_broadcast':22s} {nccl}")
sys.exit(1 if bad or nccl.startswith("FAIL") else 0)
PY
