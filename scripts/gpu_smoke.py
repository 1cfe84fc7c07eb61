"""The GPU checks, one short run (`scripts/gpu_smoke.sh` on a lent GPU machine; `--device cpu` runs the
same code here): our paged engine on the device (greedy decode tok/s, its logprobs against the
Learner's forward on the same device), Learner GRPO steps on the device, one FSDP2 step over NCCL
(gloo on CPU), a 2-step GRPO run with trainer.device and engine.device on it (check_rl_run), the vLLM backend where vLLM is installed (its logprobs against the Learner's), a
LLaVA-style VLM through the paged engine and the Learner (check_vlm), and the engine's weights released
and restored on the device (check_weight_offload).
Prints one JSON object, the last line."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
import traceback
from typing import Any

import torch

RANDOM_INIT = False  # --random-init: the spec is a folder with config and tokenizer only (no weights travel)


def _policy_and_tok(spec: str, device: str, dtype: str) -> tuple[Any, Any]:
    if RANDOM_INIT:
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(spec))
        tok = AutoTokenizer.from_pretrained(spec)
    else:
        from posttrain.models import load_policy, load_tokenizer

        model, tok = load_policy(spec), load_tokenizer(spec)
    return model.to(device=device, dtype=getattr(torch, dtype)), tok


def _prompts(tok: Any, n: int) -> list[list[int]]:
    from posttrain.models import encode_messages
    from posttrain.types import Message

    qs = [f"What is {i} + {2 * i}? Answer briefly." for i in range(n)]
    return [encode_messages(tok, [Message("user", q)]) for q in qs]


def _learner_logprobs(learner: Any, prompts: list[list[int]], outs: list[Any]) -> list[list[float]]:
    from posttrain.train.batch import Sample

    samples = []
    for p, o in zip(prompts, outs, strict=True):
        gen = o.completions[0].token_ids
        samples.append(Sample(p + gen, [0] * len(p) + [1] * len(gen), [0.0] * (len(p) + len(gen)), 0.0, 0))
    lp, _, mask = learner.score_tokens(samples)
    return [lp[i][mask[i].bool()].tolist() for i in range(len(samples))]


def _max_diff(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True))


def _decode(engine: Any, prompts: list[list[int]], max_tokens: int) -> tuple[list[Any], float]:
    from posttrain.engine import GenerationRequest, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    outs = engine.generate([GenerationRequest(list(p), params) for p in prompts])
    dt = time.perf_counter() - t0
    return outs, sum(len(o.completions[0].token_ids) for o in outs) / dt


def check_engine_and_learner(args: argparse.Namespace, out: dict[str, Any]) -> None:
    from posttrain.config import load_config
    from posttrain.engine import make_engine
    from posttrain.train.batch import Sample
    from posttrain.train.learner import Learner

    cfg = load_config(
        None,
        [
            f"model.spec={args.model}",
            f"engine.device={args.device}",
            f"engine.dtype={args.dtype}",
            f"trainer.device={args.device}",
        ],
    )
    model, tok = _policy_and_tok(args.model, args.device, args.dtype)
    engine = make_engine(cfg.engine, model, tok)
    prompts = _prompts(tok, args.prompts)
    _decode(engine, prompts[:2], 4)  # warm-up
    outs, tps = _decode(engine, prompts, args.tokens)
    out["paged_decode_tok_s"] = round(tps, 1)
    learner = Learner(cfg.model, cfg.trainer, cfg.algorithm, model=model)
    out["paged_vs_learner_max_logprob_diff"] = _max_diff(
        [list(o.completions[0].logprobs) for o in outs], _learner_logprobs(learner, prompts, outs)
    )
    samples = []
    for i, (p, o) in enumerate(zip(prompts, outs, strict=True)):
        gen = o.completions[0].token_ids
        lps = list(o.completions[0].logprobs)
        samples.append(
            Sample(p + gen, [0] * len(p) + [1] * len(gen), [0.0] * len(p) + lps, float(i % 2), i // 4)
        )
    times = []
    for _ in range(2):
        t0 = time.perf_counter()
        metrics = learner.step(samples)
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    out["learner_step_s"] = [round(t, 3) for t in times]
    out["learner_loss_finite"] = all(v == v and abs(v) != float("inf") for v in metrics.values())
    engine.load_weights(dict(learner.model.state_dict()))
    out["weights_reloaded_version"] = engine.version
    check_weight_offload(engine, prompts[:4], dict(learner.model.state_dict()), args.device, out)


def check_weight_offload(
    engine: Any, prompts: list[list[int]], weights: dict[str, Any], device: str, out: dict[str, Any]
) -> None:
    """placement.offload_engine_weights on the device: release_weights frees the engine's weights and KV
    pool (on CUDA into torch's caching allocator: memory_allocated drops by them), and a full load brings
    them back: the same greedy tokens as before the release."""
    before, _ = _decode(engine, prompts, 8)
    held = engine.runner.weight_storage_bytes()
    cuda = device.startswith("cuda")
    allocated = torch.cuda.memory_allocated() if cuda else 0
    kv = engine.runner.kv_cache_bytes() if engine.runner.k_cache is not None else 0
    engine.release_weights()
    out["offload_weight_bytes_held"] = held
    out["offload_weight_bytes_after_release"] = engine.runner.weight_storage_bytes()
    if cuda:
        out["offload_cuda_allocated_drop_bytes"] = allocated - torch.cuda.memory_allocated()
        out["offload_cuda_expected_drop_bytes"] = held + kv
    engine.load_weights(weights)
    after, _ = _decode(engine, prompts, 8)
    out["offload_restored_greedy_equal"] = [o.completions[0].token_ids for o in after] == [
        o.completions[0].token_ids for o in before
    ]


def check_fsdp(args: argparse.Namespace, out: dict[str, Any]) -> None:
    import torch.distributed as dist

    from posttrain.config import load_config
    from posttrain.train.distributed import shard_learner
    from posttrain.train.learner import Learner

    backend = "nccl" if args.device.startswith("cuda") else "gloo"
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group(backend, rank=0, world_size=1)
    try:
        cfg = load_config(None, [f"model.spec={args.model}", f"trainer.device={args.device}"])
        model, tok = _policy_and_tok(args.model, args.device, "float32")
        learner = Learner(cfg.model, cfg.trainer, cfg.algorithm, model=model)
        shard_learner(learner)
        from posttrain.bench.learner import make_samples

        samples = make_samples(8, 128, model.config.vocab_size, fixed=False, group=4)
        t0 = time.perf_counter()
        metrics = learner.step(samples)
        out["fsdp_backend"] = backend
        out["fsdp_step_s"] = round(time.perf_counter() - t0, 3)
        out["fsdp_loss_finite"] = all(v == v for v in metrics.values())
    finally:
        dist.destroy_process_group()


def check_rl_run(args: argparse.Namespace, out: dict[str, Any]) -> None:
    """A 2-step GRPO run of the tiny random model (`RLRun`, one math domain) with trainer.device and
    engine.device both the device: where the learner's policy, reference and critic live, that its
    weights moved, that the engine got the last push (its version), and a resume onto the device."""
    import tempfile

    from posttrain.config import load_config
    from posttrain.models import loading
    from posttrain.orchestrator.rl import RLRun
    from posttrain.telemetry import RunDir, read_metrics

    with tempfile.TemporaryDirectory() as tmp:
        embedded = loading.cache_dir() / "models" / loading.DEFAULT_SPEC
        if os.path.isdir(args.model) and not (embedded / "config.json").is_file():
            # tiny models take the embedded tokenizer: the --model folder holds it
            os.makedirs(os.path.join(tmp, "cache", "models"))
            os.symlink(
                os.path.abspath(args.model), os.path.join(tmp, "cache", "models", loading.DEFAULT_SPEC)
            )
            os.environ["POSTTRAIN_CACHE"] = os.path.join(tmp, "cache")
        sets = [
            "model.spec=tiny:llama",
            f"trainer.device={args.device}",
            f"engine.device={args.device}",
            "engine.dtype=float32",
            "engine.num_kv_blocks=256",
            "engine.max_new_tokens=16",
            "envs.domains=[{name: math, difficulties: [0]}]",
            "batch.samples_per_prompt=4",
            "batch.prompts_per_step=2",
            "algorithm.kl_coef=0.05",  # a reference copy, on the device too
            "trainer.critic=copy",
            "algorithm.advantage=gae",
            "trainer.lr=1e-3",
            "curriculum.probe_every=0",
            "orchestrator.steps=2",
            "orchestrator.checkpoint_every=1",
            "telemetry.progress=false",
            "telemetry.tensorboard=false",
            f"telemetry.run_dir={tmp}",
        ]
        cfg = load_config(None, sets)
        run_dir = RunDir.create(cfg.telemetry.run_dir, "rl")
        rl = RLRun(cfg, run_dir, show_progress=False)
        t0 = time.perf_counter()
        try:
            rl.build()
            start = {k: v.detach().clone() for k, v in rl.learner.weights().items()}
            rl.train()
            learner = rl.learner
            out["rl_devices"] = sorted(
                {str(p.device) for p in learner.model.parameters()}
                | {str(p.device) for p in learner.reference.parameters()}
                | {str(p.device) for p in learner.critic.parameters()}
            )
            moved = max((v - start[k]).abs().max().item() for k, v in learner.weights().items())
            out["rl_weights_max_change"] = moved
            out["rl_engine_version"] = rl.engine.version
            out["rl_learner_version"] = learner.version
            rows = read_metrics(run_dir.metrics)
            out["rl_steps_logged"] = len(rows)
            out["rl_loss_finite"] = all(r["train/loss"] == r["train/loss"] for r in rows)
            out["rl_s"] = round(time.perf_counter() - t0, 2)
        finally:
            rl.close()
        again = RLRun(cfg, RunDir.open(run_dir.path), show_progress=False)
        try:
            again.build()
            again.load()  # the step-2 checkpoint, read back onto the device
            out["rl_resumed_step"] = again.step
            out["rl_resumed_device"] = str(next(again.learner.model.parameters()).device)
        finally:
            again.close()


def check_vllm(args: argparse.Namespace, out: dict[str, Any]) -> None:
    try:
        import vllm  # noqa: F401
    except ImportError:
        out["vllm"] = "not installed: skipped"
        return
    from posttrain.config import load_config
    from posttrain.engine import GenerationRequest, SamplingParams, make_engine
    from posttrain.train.learner import Learner

    cfg = load_config(
        None,
        [
            f"model.spec={args.model}",
            "engine.backend=vllm",
            "engine.dtype=bfloat16",
            f"trainer.device={args.device}",
        ],
    )
    model, tok = _policy_and_tok(args.model, "cpu", "float32")
    engine = make_engine(cfg.engine, model, tok)
    prompts = _prompts(tok, args.prompts)
    _decode(engine, prompts[:2], 4)
    outs, tps = _decode(engine, prompts, args.tokens)
    out["vllm_decode_tok_s"] = round(tps, 1)
    learner = Learner(cfg.model, cfg.trainer, cfg.algorithm, model=model.to(args.device))
    out["vllm_vs_learner_max_logprob_diff"] = _max_diff(
        [list(o.completions[0].logprobs) for o in outs], _learner_logprobs(learner, prompts, outs)
    )
    engine.release_kv_cache()
    engine.load_weights(dict(learner.model.state_dict()), version=5)
    again = asyncio.run(engine.agenerate(GenerationRequest(prompts[0], SamplingParams(max_tokens=8))))
    out["vllm_after_sleep_and_push"] = {
        "version": engine.version,
        "tokens": len(again.completions[0].token_ids),
    }
    engine.close()


def check_vlm(args: argparse.Namespace, out: dict[str, Any]) -> None:
    """A LLaVA-style VLM (the --model language model, random-initialised, + a from-scratch SigLIP-style
    encoder, saved and loaded as an HF folder) through the same path on the device: the paged engine's
    greedy tokens against transformers' generate with the image, and its logprobs against the Learner's
    (images replayed by hash)."""
    import tempfile

    from transformers import AutoConfig

    from posttrain.config import load_config
    from posttrain.engine import GenerationRequest, SamplingParams, make_engine
    from posttrain.envs import get_domain
    from posttrain.models import load_policy, load_tokenizer
    from posttrain.models.loading import ensure_embedded
    from posttrain.models.vision import (
        ImageStore,
        encode_with_images,
        image_inputs,
        random_llava,
        save_vision_folder,
    )
    from posttrain.train.batch import Sample
    from posttrain.train.learner import Learner

    src = args.model if os.path.isdir(args.model) else str(ensure_embedded())
    with tempfile.TemporaryDirectory() as tmp:
        vlm, vtok = random_llava(AutoConfig.from_pretrained(src), load_tokenizer(src), seed=0)
        folder = str(save_vision_folder(vlm, vtok, os.path.join(tmp, "vlm")))
        cfg = load_config(
            None,
            [
                f"model.spec={folder}",
                f"engine.device={args.device}",
                f"engine.dtype={args.dtype}",
                f"trainer.device={args.device}",
            ],
        )
        model = load_policy(folder).to(device=args.device, dtype=getattr(torch, args.dtype))
        tok = load_tokenizer(folder)
        engine = make_engine(cfg.engine, model, tok)
        task = get_domain("vision.shapes").task("heldout", 0, 0)
        ids, images = encode_with_images(tok, task.prompt)
        params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
        t0 = time.perf_counter()
        got = engine.generate([GenerationRequest(ids, params, images=images)])[0].completions[0]
        out["vlm_paged_generate_s"] = round(time.perf_counter() - t0, 3)
        pixels = image_inputs(tok).hf_inputs(images)["pixel_values"]
        pixels = pixels.to(device=args.device, dtype=getattr(torch, args.dtype))
        with torch.inference_mode():
            ref = model.generate(
                input_ids=torch.tensor([ids], device=args.device),
                pixel_values=pixels,
                max_new_tokens=16,
                do_sample=False,
            )[0, len(ids) :].tolist()
        out["vlm_greedy_tokens_equal_hf"] = (
            f"{sum(a == b for a, b in zip(got.token_ids, ref, strict=False))}/{len(ref)}"
        )
        learner = Learner(cfg.model, cfg.trainer, cfg.algorithm, model=model)
        learner.vision.store = ImageStore()
        gen = got.token_ids
        sample = Sample(
            ids + gen,
            [0] * len(ids) + [1] * len(gen),
            [0.0] * (len(ids) + len(gen)),
            0.0,
            0,
            images=[learner.vision.store.put(img) for img in images],
        )
        lp, _, mask = learner.score_tokens([sample])
        out["vlm_paged_vs_learner_max_logprob_diff"] = _max_diff(
            [list(got.logprobs)], [lp[0][mask[0].bool()].tolist()]
        )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--random-init", action="store_true", help="--model is a config + tokenizer folder")
    args = ap.parse_args()
    global RANDOM_INIT
    RANDOM_INIT = args.random_init
    out: dict[str, Any] = {"device": args.device, "torch": torch.__version__}
    if args.device.startswith("cuda"):
        out["gpu"] = torch.cuda.get_device_name(0)
    failed = []
    for check in (check_engine_and_learner, check_fsdp, check_rl_run, check_vllm, check_vlm):
        try:
            check(args, out)
        except Exception as err:  # noqa: BLE001 - each check reports its own failure and the others still run
            failed.append(check.__name__)
            out[f"{check.__name__}_error"] = f"{type(err).__name__}: {err}"
            traceback.print_exc(file=sys.stderr)
    out["failed"] = failed
    print(json.dumps(out))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
