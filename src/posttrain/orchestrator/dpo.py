"""Preference-optimisation runs (`posttrain dpo`): the policy of `model.spec` (full or LoRA) trained on
`pairs.*` with the registered preference loss `dpo.loss` (dpo, ipo, simpo) on the RL Learner, against a
frozen reference (LoRA: the base with adapters off; full: a frozen copy); the policy is exported to
`RUN_DIR/policy/` as `posttrain sft` exports it. The losses are `algos`', the step `train`'s.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from posttrain.config import DPOConfig, RunConfig
from posttrain.orchestrator.pairs import Pair, PairRun
from posttrain.telemetry import RunDir

EXPORT_DIR = "policy"
LEARNER_DIR = "learner"


def loss_params(dpo: DPOConfig) -> dict[str, float]:
    """The keyword hyperparameters of `dpo.loss` from the dpo section."""
    if dpo.loss == "dpo":
        return {"beta": dpo.beta, "label_smoothing": dpo.label_smoothing}
    if dpo.loss == "ipo":
        return {"tau": dpo.tau}
    if dpo.loss == "simpo":
        return {"beta": dpo.simpo_beta, "gamma": dpo.simpo_gamma}
    return {}  # a plugin's loss: its own defaults


def pair_samples(pairs: list[Pair]) -> tuple[list[Any], list[Any]]:
    """(chosen, rejected) Learner samples; a pair's two share a group id (their common prompt prefix)."""
    from posttrain.train import Sample

    def sample(ids: list[int], mask: list[int], group: int) -> Sample:
        return Sample(ids, mask, [0.0] * len(ids), reward=0.0, group_id=group)

    return (
        [sample(p.chosen_ids, p.chosen_mask, i) for i, p in enumerate(pairs)],
        [sample(p.rejected_ids, p.rejected_mask, i) for i, p in enumerate(pairs)],
    )


class PreferenceTrainer:
    """`PairTrainer` over a `train.Learner`'s preference_step / preference_eval."""

    def __init__(self, cfg: RunConfig) -> None:
        from posttrain.algos import preference_needs_reference
        from posttrain.train import Learner

        self.cfg = cfg
        self.loss, self.params = cfg.dpo.loss, loss_params(cfg.dpo)
        self.learner = Learner(
            cfg.model,
            cfg.trainer,
            cfg.algorithm,
            seed=cfg.seed,
            batch_cfg=cfg.batch,
            keep_reference=preference_needs_reference(cfg.dpo.loss),
        )

    def step(self, pairs: list[Pair]) -> dict[str, float]:
        return self.learner.preference_step(*pair_samples(pairs), self.loss, **self.params)

    def evaluate(self, pairs: list[Pair]) -> dict[str, float]:
        return self.learner.preference_eval(*pair_samples(pairs), self.loss, **self.params)

    def save(self, directory: Path) -> None:
        self.learner.save(str(directory / LEARNER_DIR))

    def load(self, directory: Path) -> None:
        from posttrain.train.state import read_learner_state

        self.learner.load_state_dict(read_learner_state(directory / LEARNER_DIR)[1])

    def export(self, out: Path) -> Path:
        from posttrain.orchestrator.export import save_hf_folder

        return save_hf_folder(self.learner.weights(), self.cfg.model.spec, out)


def dpo_run(cfg: RunConfig, run_dir: RunDir, *, show_progress: bool | None = None) -> PairRun:
    """The preference-optimisation run of `cfg` in `run_dir` (`.train(train_pairs, heldout_pairs)`)."""
    return PairRun(
        cfg, run_dir, PreferenceTrainer(cfg), EXPORT_DIR, kind=cfg.dpo.loss, show_progress=show_progress
    )
