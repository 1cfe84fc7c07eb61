"""Preference-optimisation runs (`posttrain dpo`): the policy of `model.spec` (full or LoRA) trained on
`pairs.*` with the registered preference loss `dpo.loss` (dpo, ipo, simpo) on the RL Learner, against a
frozen reference (LoRA: the base with adapters off; full: a frozen copy); the policy is exported to
`RUN_DIR/policy/` as `posttrain sft` exports it. Online (dpo.rounds > 1): each round samples new pairs
from the policy as trained so far. The losses are `algos`', the step `train`'s.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from posttrain.config import DPOConfig, RunConfig
from posttrain.orchestrator.offline.pairs import Pair, PairRun
from posttrain.telemetry import RunDir

EXPORT_DIR = "policy"
LEARNER_DIR = "learner"


def loss_params(dpo: DPOConfig) -> dict[str, float]:
    """The keyword hyperparameters of `dpo.loss` from the dpo section, as the loss registered them
    (`algos.registry.register_preference_loss(knobs=...)`; a plugin's loss without knobs: its defaults)."""
    from posttrain.algos.registry import preference_knobs

    return {kw: getattr(dpo, field) for kw, field in preference_knobs(dpo.loss).items()}


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
        from posttrain.orchestrator.eval.export import save_hf_folder

        return save_hf_folder(self.learner.weights(), self.cfg.model.spec, out)


def check_online(cfg: RunConfig) -> None:
    """An online run (dpo.rounds > 1) samples from the policy it trains: it needs pairs.from_env and no
    other sampler."""
    if cfg.dpo.rounds > 1:
        if cfg.pairs.from_env is None:
            raise ValueError(
                f"dpo.rounds={cfg.dpo.rounds} samples pairs from an environment each round: set pairs.from_env "
                "(--from-env DOMAIN), not pairs.data"
            )
        if cfg.pairs.sampler_spec is not None:
            raise ValueError(
                f"dpo.rounds={cfg.dpo.rounds} samples from the policy being trained: unset pairs.sampler_spec"
            )


def dpo_run(
    cfg: RunConfig, run_dir: RunDir, *, show_progress: bool | None = None, sampler: Any = None
) -> PairRun:
    """The preference-optimisation run of `cfg` in `run_dir` (`.train(train_pairs, heldout_pairs)`).
    Online (dpo.rounds > 1): round r's pairs are those of training tasks r*n..(r+1)*n-1 sampled by
    `sampler` (a `pairs.PairSampler`, built when not given) after it loads the policy's weights."""
    check_online(cfg)
    trainer = PreferenceTrainer(cfg)
    refresh = None
    if cfg.dpo.rounds > 1:
        from posttrain.orchestrator.offline.pairs import PairSampler

        if sampler is None:
            from posttrain.models import load_tokenizer

            sampler = PairSampler(cfg, load_tokenizer(cfg.model.spec))
        n = cfg.pairs.n

        def refresh(r: int) -> tuple[list[Pair], dict[str, float]]:
            from posttrain.orchestrator.offline.pairs import drop_long

            sampler.load_weights(trainer.learner.weights())
            pairs, stats = sampler.sample("train", r * n, n, step=2 + r)
            pairs, skipped = drop_long(pairs, cfg.pairs.max_seq_tokens)
            return pairs, {**stats, "skipped_long": float(skipped)}

    return PairRun(
        cfg,
        run_dir,
        trainer,
        EXPORT_DIR,
        kind=cfg.dpo.loss,
        show_progress=show_progress,
        rounds=cfg.dpo.rounds,
        refresh=refresh,
    )
