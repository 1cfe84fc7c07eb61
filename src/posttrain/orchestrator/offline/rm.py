"""Reward-model runs (`posttrain rm train`): a scalar head on `model.spec`'s causal LM trained with the
Bradley-Terry loss on `pairs.*` (`orchestrator.offline.pairs`), exported to `RUN_DIR/reward_model/` as a HF
folder that AutoModelForSequenceClassification, `reward.model` and `posttrain rm serve` load. The
model and its loss are `train`'s; this module wires them to the pair loop.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from posttrain.config import RunConfig
from posttrain.orchestrator.offline.pairs import Pair, PairRun
from posttrain.telemetry import RunDir

EXPORT_DIR = "reward_model"


class RewardTrainer:
    """`PairTrainer` over a `train.RewardLearner` (the pairs' token ids; their masks are not used)."""

    def __init__(self, cfg: RunConfig, tokenizer: Any) -> None:
        from posttrain.train import RewardLearner, new_reward_model

        if cfg.model.lora_rank > 0:
            raise ValueError("posttrain rm trains the whole model: set model.lora_rank=0")
        self.tokenizer = tokenizer
        self.margin = cfg.pairs.rm_margin
        model = new_reward_model(cfg.model.spec, cfg.model.dtype, cfg.seed, pad_id=tokenizer.pad_token_id)
        self.learner = RewardLearner(model, cfg.trainer, cfg.batch, seed=cfg.seed)

    def step(self, pairs: list[Pair]) -> dict[str, float]:
        return self.learner.step([p.chosen_ids for p in pairs], [p.rejected_ids for p in pairs], self.margin)

    def evaluate(self, pairs: list[Pair]) -> dict[str, float]:
        return self.learner.evaluate([p.chosen_ids for p in pairs], [p.rejected_ids for p in pairs])

    def save(self, directory: Path) -> None:
        self.learner.save(directory / EXPORT_DIR, self.tokenizer)

    def load(self, directory: Path) -> None:
        self.learner.load(directory / EXPORT_DIR)

    def export(self, out: Path) -> Path:
        return self.learner.model.save(out, self.tokenizer)


def rm_run(cfg: RunConfig, run_dir: RunDir, tokenizer: Any, *, show_progress: bool | None = None) -> PairRun:
    """The reward-model run of `cfg` in `run_dir` (train it with `.train(train_pairs, heldout_pairs)`)."""
    return PairRun(
        cfg, run_dir, RewardTrainer(cfg, tokenizer), EXPORT_DIR, kind="rm", show_progress=show_progress
    )
