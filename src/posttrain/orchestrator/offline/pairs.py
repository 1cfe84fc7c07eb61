"""Preference pairs and the runs that train on them (`posttrain rm train`, `posttrain dpo`): pairs from a
JSONL file or sampled from an environment (k completions per task, a verifier success paired with a
failure), their held-out split, and `PairRun`, the loop that feeds a trainer batches of pairs and
writes the run directory (config.yaml, metrics.jsonl, checkpoints/, the exported model).

A pair's sequences are token ids laid out as the RL loop lays out a trajectory: JSONL rows are encoded
by `train.encode_chat`, environment pairs are the trajectories' own ids. The losses are `train`'s.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from posttrain.config import RunConfig, save_config
from posttrain.orchestrator.checkpoint import save_checkpoint
from posttrain.orchestrator.offline.sft import SFTDataError, batches, jsonl_rows, parse_row
from posttrain.orchestrator.signals import stop_on_signals
from posttrain.telemetry import MetricsLogger, Progress, RunDir
from posttrain.types import Pick, Trajectory

PAIR_STATE = "pairs_state.json"
PAIRS_FILE = "pairs.json"
ROW_SHAPE = (
    '{"prompt": "..." or [messages], "chosen": "..." or [assistant messages], "rejected": likewise} '
    '(optional "system" and "tools" as in sft data)'
)


class PairDataError(ValueError):
    """Bad pair data; the message names the file and line (or the domain) and what a row must look like."""


@dataclass
class Pair:
    """A preferred and a dispreferred response to one prompt, each as token ids with its loss mask (1 on
    the response tokens); `source` says where it came from (`file:line` or a task id)."""

    chosen_ids: list[int]
    chosen_mask: list[int]
    rejected_ids: list[int]
    rejected_mask: list[int]
    source: str = ""

    @property
    def max_len(self) -> int:
        return max(len(self.chosen_ids), len(self.rejected_ids))


# ------------------------------------------------------------------------------------------------
# JSONL pairs


def parse_pair(row: Any, where: str, tokenizer: Any, chat_format: str = "smollm2") -> Pair:
    """One JSONL row -> a `Pair` (the prompt rendered with the chat template, each response as the
    assistant turn after it, as `posttrain sft` encodes a prompt/completion row)."""
    from posttrain.train import encode_chat

    if not isinstance(row, dict):
        raise PairDataError(f"{where}: a row must be a JSON object: {ROW_SHAPE}")
    missing = [k for k in ("prompt", "chosen", "rejected") if k not in row]
    if missing:
        raise PairDataError(f"{where}: the row has no {', '.join(repr(k) for k in missing)}: {ROW_SHAPE}")
    sides = []
    for side in ("chosen", "rejected"):
        extra = {k: row[k] for k in ("system", "tools") if k in row}
        try:
            ex = parse_row(
                {"prompt": row["prompt"], "completion": row[side], **extra}, f"{where}: {side}", chat_format
            )
            ids, mask = encode_chat(tokenizer, ex.messages, ex.tools)
        except (SFTDataError, ValueError) as err:
            raise PairDataError(
                str(err) if str(err).startswith(where) else f"{where}: {side}: {err}"
            ) from None
        sides.append((ids, mask))
    (c_ids, c_mask), (r_ids, r_mask) = sides
    if c_ids == r_ids:
        raise PairDataError(f"{where}: chosen and rejected are the same response; a pair needs two")
    return Pair(c_ids, c_mask, r_ids, r_mask, where)


def load_pairs_jsonl(path: str | Path, tokenizer: Any, chat_format: str = "smollm2") -> list[Pair]:
    """Every non-blank line of `path` as a `Pair`; the first bad line raises `PairDataError`."""
    rows = jsonl_rows(path, PairDataError, "pair", ROW_SHAPE)
    return [parse_pair(row, where, tokenizer, chat_format) for row, where in rows]


# ------------------------------------------------------------------------------------------------
# pairs from an environment, by verifier outcome


def _succeeded(t: Trajectory) -> bool:
    return bool(t.rewards.get("success", t.reward))


def pair_by_outcome(
    trajectories: list[Trajectory], pairs_per_task: int = 1
) -> tuple[list[Pair], dict[str, float]]:
    """Per group (one task's samples): its i-th success paired with its i-th failure, for i below
    `pairs_per_task` and both counts; infrastructure failures are left out. Returns (pairs, stats)."""
    groups: dict[int, list[Trajectory]] = {}
    for t in trajectories:
        groups.setdefault(t.group_id, []).append(t)
    pairs: list[Pair] = []
    infra = paired_tasks = successes = scored = 0
    for _, members in sorted(groups.items()):
        ok = [t for t in members if t.status.is_scored]
        infra += len(members) - len(ok)
        good = [t for t in ok if _succeeded(t)]
        bad = [t for t in ok if not _succeeded(t)]
        scored += len(ok)
        successes += len(good)
        k = min(len(good), len(bad), pairs_per_task)
        paired_tasks += k > 0
        for c, r in zip(good[:k], bad[:k], strict=True):
            pairs.append(Pair(c.token_ids, c.loss_mask, r.token_ids, r.loss_mask, c.task.id))
    stats = {
        "tasks": float(len(groups)),
        "tasks_paired": float(paired_tasks),
        "success_rate": successes / scored if scored else 0.0,
        "infra_failures": float(infra),
        "pairs": float(len(pairs)),
    }
    return pairs, stats


async def asample_pairs(
    engine: Any,
    tokenizer: Any,
    domain: Any,
    levels: list[int],
    n: int,
    samples_per_task: int,
    split: str,
    seed: int,
    sandbox: Any,
    sampling: Any,
    limits: Any,
    pairs_per_task: int = 1,
    start: int = 0,
    step: int | None = None,
) -> tuple[list[Pair], dict[str, float]]:
    """Tasks start..start+n-1 of `split` (round-robin over `levels`), `samples_per_task` episodes each
    through the agent loop, paired by `pair_by_outcome`. `step` seeds the sampling (default: 0 for the
    train split, 1 for the others)."""
    from posttrain.rollout import collect_groups

    bad = [lvl for lvl in levels if lvl not in domain.difficulties]
    if bad:
        raise PairDataError(
            f"domain '{domain.name}' has no difficulty {bad[0]} (valid: {domain.difficulties})"
        )
    picks = [
        Pick(None, domain, domain.task(split, levels[i % len(levels)], i // len(levels), seed), i)
        for i in range(start, start + n)
    ]
    out = await collect_groups(
        engine,
        tokenizer,
        picks,
        samples_per_task,
        sandbox,
        sampling,
        limits,
        policy_version=0,
        run_seed=seed,
        step=(0 if split == "train" else 1) if step is None else step,
        share_prefill=getattr(engine, "caches_prefixes", False),
    )
    return pair_by_outcome(out.trajectories, pairs_per_task)


def split_pairs(pairs: list[Pair], frac: float, seed: int) -> tuple[list[Pair], list[Pair]]:
    """(train, heldout) by a seeded shuffle: round(frac x len) pairs held out (at least one when frac > 0
    and there are two or more)."""
    k = round(frac * len(pairs))
    if frac > 0 and len(pairs) >= 2:
        k = max(k, 1)
    k = min(k, max(len(pairs) - 1, 0))
    order = list(range(len(pairs)))
    random.Random(seed).shuffle(order)
    held = set(order[:k])
    return [p for i, p in enumerate(pairs) if i not in held], [p for i, p in enumerate(pairs) if i in held]


class PairSampler:
    """Samples pairs from `cfg.pairs.from_env` by verifier outcome: the domain, an engine of cfg.engine
    on the sampler's weights (pairs.sampler_spec, default model.spec), the sampling settings and episode
    limits; a sandbox is opened per call where the domain runs code. `load_weights` swaps the policy
    the engine samples from (online DPO samples from the policy being trained)."""

    def __init__(self, cfg: RunConfig, tokenizer: Any) -> None:
        from posttrain.engine import SamplingParams, make_engine
        from posttrain.envs import get_domain
        from posttrain.models import load_policy, load_tokenizer
        from posttrain.rollout import EpisodeLimits
        from posttrain.train import tokenizer_fingerprint

        s = self.pairs = cfg.pairs
        self.cfg, self.tokenizer = cfg, tokenizer
        options = {d.name: d.options for d in cfg.envs.domains}.get(s.from_env, {})
        self.domain = get_domain(s.from_env, **options)
        spec = s.sampler_spec or cfg.model.spec
        sampler_tok = load_tokenizer(spec)
        if tokenizer_fingerprint(sampler_tok) != tokenizer_fingerprint(tokenizer):
            raise PairDataError(
                f"pairs.sampler_spec={spec} has another tokenizer than model.spec={cfg.model.spec}; the pairs' "
                "token ids must be the trained model's"
            )
        e = cfg.engine
        stop = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        self.sampling = SamplingParams(
            temperature=s.temperature,
            top_p=e.top_p,
            top_k=e.top_k,
            max_tokens=e.max_new_tokens,
            stop_token_ids=stop,
        )
        self.limits = EpisodeLimits(cfg.envs.max_turns, cfg.envs.max_episode_tokens, e.max_new_tokens)
        self.engine = make_engine(e, load_policy(spec, dtype=e.dtype, seed=cfg.seed), sampler_tok)

    def load_weights(self, weights: dict[str, Any]) -> None:
        self.engine.load_weights(weights)

    def sample(
        self, split: str, start: int, n: int, step: int | None = None
    ) -> tuple[list[Pair], dict[str, float]]:
        """Pairs of tasks start..start+n-1 of `split` (`asample_pairs`)."""
        s, domain = self.pairs, self.domain

        async def run() -> tuple[list[Pair], dict[str, float]]:
            sandbox = None
            if domain.requires_sandbox:
                from posttrain.sandbox import make_sandbox

                sandbox = make_sandbox(self.cfg.sandbox)
            try:
                return await asample_pairs(
                    self.engine,
                    self.tokenizer,
                    domain,
                    s.levels,
                    n,
                    s.samples_per_task,
                    split,
                    self.cfg.seed,
                    sandbox,
                    self.sampling,
                    self.limits,
                    s.pairs_per_task,
                    start=start,
                    step=step,
                )
            finally:
                if sandbox is not None:
                    await sandbox.close()

        return asyncio.run(run()) if n else ([], {})

    def heldout_tasks(self) -> int:
        """Held-out tasks to sample: ceil(pairs.heldout_frac x pairs.n) from the domain's heldout split
        (0 when it has none: training pairs are held out instead)."""
        s = self.pairs
        if s.heldout_frac > 0 and "heldout" in self.domain.splits:
            return math.ceil(s.heldout_frac * s.n)
        return 0


def build_pairs(
    cfg: RunConfig, tokenizer: Any, sampler: PairSampler | None = None
) -> tuple[list[Pair], list[Pair], dict[str, float]]:
    """(train, heldout, stats) pairs of `cfg.pairs`' source. Environment pairs are sampled by a
    `PairSampler` (the one given, else a new one) from pairs.n training tasks."""
    s = cfg.pairs
    if s.data is not None:
        train, held = split_pairs(
            load_pairs_jsonl(s.data, tokenizer, s.chat_format), s.heldout_frac, cfg.seed
        )
        return train, held, {}
    if s.from_env is None:
        raise PairDataError(
            "no pairs: give --data FILE.jsonl or --from-env DOMAIN (pairs.data / pairs.from_env)"
        )
    sampler = sampler or PairSampler(cfg, tokenizer)
    train, st = sampler.sample("train", 0, s.n)
    held, sh = sampler.sample("heldout", 0, sampler.heldout_tasks())
    stats = {f"env/train_{k}": v for k, v in st.items()} | {f"env/heldout_{k}": v for k, v in sh.items()}
    if not train:
        raise PairDataError(
            f"{s.from_env}: no task of {s.n} had both a success and a failure in {s.samples_per_task} samples "
            f"(success rate {stats.get('env/train_success_rate', 0.0):.2f}); try other pairs.levels, more "
            "pairs.n or pairs.samples_per_task, or a higher pairs.temperature"
        )
    if not held and s.heldout_frac > 0:  # no heldout split (or no pair in it): hold out training pairs
        train, held = split_pairs(train, s.heldout_frac, cfg.seed)
    return train, held, stats


def drop_long(pairs: list[Pair], max_tokens: int) -> tuple[list[Pair], int]:
    kept = [p for p in pairs if p.max_len <= max_tokens]
    return kept, len(pairs) - len(kept)


def save_pairs(path: Path, train: list[Pair], heldout: list[Pair], stats: dict[str, float]) -> None:
    """The run's pairs (token ids and masks) and their sampling stats as JSON, atomically: a resumed run
    trains on these, not on pairs sampled again."""
    import os

    def rows(pairs: list[Pair]) -> list[list[Any]]:
        return [[p.chosen_ids, p.chosen_mask, p.rejected_ids, p.rejected_mask, p.source] for p in pairs]

    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump({"train": rows(train), "heldout": rows(heldout), "stats": stats}, fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def load_saved_pairs(path: Path) -> tuple[list[Pair], list[Pair], dict[str, float]]:
    """(train, heldout, stats) as `save_pairs` wrote them; a missing or unreadable file raises
    `PairDataError` naming it."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        train, held = ([Pair(*row) for row in data[k]] for k in ("train", "heldout"))
        return train, held, dict(data["stats"])
    except FileNotFoundError:
        raise PairDataError(f"{path}: no such file; this run directory holds no pairs to resume on") from None
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        raise PairDataError(f"{path}: not the pairs file a pair run writes ({err})") from None


# ------------------------------------------------------------------------------------------------
# the run


class PairTrainer(Protocol):
    """What `PairRun` trains: a step and an evaluation on pairs, checkpoint contents (`save` writes
    what `load` restores exactly: weights, optimizer, RNG), the exported model."""

    def step(self, pairs: list[Pair]) -> dict[str, float]: ...

    def evaluate(self, pairs: list[Pair]) -> dict[str, float]: ...

    def save(self, directory: Path) -> None: ...

    def load(self, directory: Path) -> None: ...

    def export(self, out: Path) -> Path: ...


def pair_steps(cfg: RunConfig, n_train: int) -> int:
    """Optimizer steps of a pair run on `n_train` pairs: pairs.steps, or epochs x batches per epoch."""
    s = cfg.pairs
    return s.steps or s.epochs * math.ceil(n_train / s.batch_size)


def resolve_lr_decay(cfg: RunConfig, n_train: int, rounds: int = 1) -> None:
    """trainer.lr_decay_steps defaults to the run's steps (of all its `rounds`) under a cosine or linear
    schedule."""
    if cfg.trainer.lr_schedule != "constant" and cfg.trainer.lr_decay_steps == 0:
        cfg.trainer.lr_decay_steps = pair_steps(cfg, n_train) * rounds


class PairRun:
    """`PairRun(cfg, run_dir, trainer, export_name).train(train, heldout)` -> summary: trains for
    pairs.steps (or epochs), logs train/* every step and heldout/* every pairs.eval_every steps and at
    the end, checkpoints, and exports the model to `run_dir/export_name`. Stops checkpointed (no
    export) on SIGINT/SIGTERM. To resume, `load()` first and train on the pairs it returns: the run
    goes on from its newest valid checkpoint as the uninterrupted run would have.

    With `rounds` > 1 (online preference optimisation) the run trains the same number of steps on each
    round's pairs: round 0's are the ones given, round r's are `refresh(r)`'s, sampled after round r-1's
    steps; a round without pairs is logged and trains nothing."""

    def __init__(
        self,
        cfg: RunConfig,
        run_dir: RunDir,
        trainer: PairTrainer,
        export_name: str,
        *,
        kind: str = "pairs",
        show_progress: bool | None = None,
        rounds: int = 1,
        refresh: Callable[[int], tuple[list[Pair], dict[str, float]]] | None = None,
    ) -> None:
        if rounds > 1 and refresh is None:
            raise ValueError("a pair run of several rounds needs the refresh that samples each round's pairs")
        self.cfg, self.run_dir, self.trainer = cfg, run_dir, trainer
        self.rounds, self.refresh = rounds, refresh
        self.export_name, self.kind = export_name, kind
        self.show_progress = cfg.telemetry.progress if show_progress is None else show_progress
        self.step = 0
        self.stop_signal: int | None = None
        self.heldout_start: dict[str, float] | None = None

    def _record_stop(self, signum: int) -> None:
        self.stop_signal = signum

    @property
    def pairs_path(self) -> Path:
        return self.run_dir.path / PAIRS_FILE

    def load(self) -> tuple[tuple[list[Pair], list[Pair], dict[str, float]], list[str]]:
        """Restore the newest valid checkpoint (trainer state, step, the held-out figures at the start)
        and drop the metrics logged after it; returns ((train, heldout, stats) of the run, warnings
        about corrupt checkpoints skipped). Raises CheckpointError when no checkpoint is usable."""
        from posttrain.orchestrator.checkpoint import keep_metrics_until, latest_valid

        if self.rounds > 1:
            raise PairDataError(
                "an online run does not resume: each round's pairs are sampled from the policy of that moment"
            )
        pairs = load_saved_pairs(self.pairs_path)
        path, warnings = latest_valid(self.run_dir.checkpoints)
        state = json.loads((path / PAIR_STATE).read_text())
        self.trainer.load(path)
        self.step = int(state["step"])
        self.heldout_start = dict(state.get("heldout_start", {}))
        keep_metrics_until(self.run_dir.metrics, self.step)
        return pairs, warnings

    def save(self, steps: int) -> Path:
        def write(tmp: Path) -> None:
            self.trainer.save(tmp)
            state = {"step": self.step, "steps": steps, "heldout_start": self.heldout_start or {}}
            (tmp / PAIR_STATE).write_text(json.dumps(state))

        return save_checkpoint(
            self.run_dir.checkpoints, self.step, write, keep=self.cfg.orchestrator.keep_checkpoints
        )

    def train(
        self, train: list[Pair], heldout: list[Pair], extra: dict[str, float] | None = None
    ) -> dict[str, Any]:
        cfg, s = self.cfg, self.cfg.pairs
        if not train:
            raise PairDataError("no training pairs")
        per_round = pair_steps(cfg, len(train))
        steps = per_round * self.rounds
        save_config(cfg, self.run_dir.config)
        resumed = self.step > 0
        if not resumed:
            save_pairs(self.pairs_path, train, heldout, extra or {})
        logger = MetricsLogger(
            self.run_dir.metrics if cfg.telemetry.jsonl else None,
            self.run_dir.tb if cfg.telemetry.tensorboard else None,
        )

        def held() -> dict[str, float]:
            return {f"heldout/{k}": v for k, v in self.trainer.evaluate(heldout).items()} if heldout else {}

        if self.heldout_start is None:
            self.heldout_start = held()
        initial = self.heldout_start
        last: dict[str, float] = {}
        pairs, round_extra = (
            train,
            {
                **(extra or {}),
                **{k.replace("heldout/", "heldout_start/"): v for k, v in initial.items()},
            },
        )
        t0 = time.perf_counter()
        with (
            stop_on_signals(self._record_stop),
            Progress(steps, self.kind, enabled=self.show_progress) as progress,
        ):
            progress.set_completed(self.step)
            try:
                for r in range(self.step // per_round, self.rounds):
                    if r > 0:  # online: pairs sampled from the policy as it is now
                        assert self.refresh is not None
                        pairs, stats = self.refresh(r)
                        round_extra = {f"online/{k}": v for k, v in stats.items()}
                        if not pairs:  # no task had a success and a failure: nothing to train on
                            logger.log(self.step, {**round_extra, "online/round": float(r)})
                            progress.advance(per_round)
                            continue
                    plan = batches(len(pairs), s.batch_size, per_round, cfg.seed + r)
                    done = self.step if r == 0 else 0  # steps of the round already taken (a resume)
                    for i, rows in enumerate(plan[done:], done):
                        m = self.trainer.step([pairs[j] for j in rows])
                        self.step += 1
                        metrics = {f"train/{k}": v for k, v in m.items()}
                        metrics["epoch"] = (i + 1) * s.batch_size / len(pairs)
                        if i == 0:
                            metrics.update(round_extra)
                        if self.rounds > 1:
                            metrics["online/round"] = float(r)
                        final = r == self.rounds - 1 and i == per_round - 1
                        if s.eval_every and (self.step % s.eval_every == 0 or final):
                            metrics.update(held())
                        metrics["time/elapsed_s"] = time.perf_counter() - t0
                        logger.log(self.step, metrics)
                        last = metrics
                        due = s.checkpoint_every and self.step % s.checkpoint_every == 0
                        if due or final or self.stop_signal is not None:
                            self.save(steps)
                        figures = {"loss": m["loss"], "acc": m["accuracy"]}
                        if "heldout/accuracy" in metrics:
                            figures["heldout acc"] = metrics["heldout/accuracy"]
                        progress.advance(1, figures)
                        if self.stop_signal is not None:
                            break
                    if self.stop_signal is not None:
                        break
            finally:
                logger.close()
        exported = None
        if self.stop_signal is None:
            exported = self.trainer.export(self.run_dir.path / self.export_name)
        return {
            "step": self.step,
            "steps": steps,
            "interrupted": self.stop_signal is not None,
            "signal": self.stop_signal,
            "train_pairs": len(train),
            "heldout_pairs": len(heldout),
            "heldout_start": initial,
            "last": last,
            "exported": exported,
            "wall_s": time.perf_counter() - t0,
        }
