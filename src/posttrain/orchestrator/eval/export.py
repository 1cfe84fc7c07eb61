"""Export a run's trained policy as a standard Hugging Face folder (LoRA merged; config, tokenizer and
chat template included) that transformers and vLLM load as is. Written atomically."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from posttrain.config import load_config
from posttrain.orchestrator.checkpoint import latest_valid
from posttrain.telemetry import RunDir


def save_hf_folder(weights: dict[str, Any], spec: str, out: Path) -> Path:
    """Write `weights` (HF names) into the architecture of `spec`, with its tokenizer, at `out`."""
    from posttrain.models import load_policy, load_tokenizer
    from posttrain.models.loading import quiet_transformers, save_hf_folder_atomically
    from posttrain.models.vision import image_inputs, save_vision_folder

    model = load_policy(spec)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    missing = [k for k in missing if not k.endswith("lm_head.weight")]  # tied to the embeddings
    if missing or unexpected:
        raise ValueError(
            f"policy weights do not match {spec}: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    tokenizer = load_tokenizer(spec)
    with quiet_transformers():
        if image_inputs(tokenizer) is not None:  # a VLM: with its processor, so it loads as one
            return save_vision_folder(model, tokenizer, Path(out))
        return save_hf_folder_atomically(model, tokenizer, Path(out))


def export_run(run_dir: str | Path, out: str | Path) -> Path:
    """The latest valid checkpoint's policy of `run_dir` as a HF folder at `out`."""
    from posttrain.train import Learner

    run = RunDir.open(run_dir)
    cfg = load_config(run.config)
    ckpt, _ = latest_valid(run.checkpoints)
    learner = Learner.load(str(ckpt / "learner"))
    return save_hf_folder(learner.weights(), cfg.model.spec, Path(out))
