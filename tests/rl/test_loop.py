"""The RL loop end to end on a tiny model: a short run with a code (sandbox) and a tool domain, exact
resume, sync == async with staleness 0, infrastructure failures excluded, phase order, bad configs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from posttrain.config import load_config
from posttrain.engine import Engine
from posttrain.orchestrator.checkpoint import list_checkpoints, verify
from posttrain.orchestrator.rl import RLRun
from posttrain.sandbox import ExecResult, ExecStatus
from posttrain.telemetry import RunDir, read_metrics

TINY = [
    "model.spec=tiny:llama",
    "engine.num_kv_blocks=512",
    "engine.max_new_tokens=24",
    "engine.max_num_seqs=16",
    "envs.max_episode_tokens=96",
    "envs.max_turns=2",
    "batch.samples_per_prompt=2",
    "batch.prompts_per_step=3",
    "orchestrator.checkpoint_every=2",
    "curriculum.probe_every=2",
    "curriculum.probe_size=2",
    "trainer.lr=1e-3",
    "telemetry.progress=false",
    "telemetry.tensorboard=false",
]
DOMAINS = [
    "envs.domains=[{name: math, difficulties: [0]}, {name: tools.apis, difficulties: [0]}]",
]
TIMING_PREFIXES = ("timeline/", "time", "rollout/wall_s", "rollout/tokens_per_s", "train/tokens_per_s")


def _cfg(tmp_path: Path, *extra: str):
    return load_config(None, [*TINY, *DOMAINS, f"telemetry.run_dir={tmp_path}", *extra])


def _run(cfg, name: str, resume: bool = False) -> RLRun:
    run_dir = (
        RunDir.open(Path(cfg.telemetry.run_dir) / name)
        if resume
        else RunDir.create(cfg.telemetry.run_dir, name)
    )
    if not resume:
        from posttrain.config import save_config

        save_config(cfg, run_dir.config)
    rl = RLRun(cfg, run_dir)
    if resume:
        rl.load()
    rl.train()
    return rl


def _untimed(rows):
    """Metrics without wall-clock figures (seconds, rates, timestamps), which no two runs share."""
    return [
        {
            k: v
            for k, v in r.items()
            if not any(k.startswith(p) for p in TIMING_PREFIXES) and not k.endswith(("_s", "_per_s"))
        }
        for r in rows
    ]


def test_resume_is_bit_exact(tmp_path):
    straight = _run(_cfg(tmp_path, "orchestrator.steps=4"), "straight")
    first = _run(_cfg(tmp_path, "orchestrator.steps=2"), "resumed")
    first.close()
    resumed = _run(_cfg(tmp_path, "orchestrator.steps=4"), "resumed", resume=True)
    # the run's config.yaml states what it was resumed with (steps=4, not the first leg's 2)
    assert load_config(resumed.run_dir.config) == resumed.cfg
    a, b = straight.learner.weights(), resumed.learner.weights()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    ma = _untimed(read_metrics(straight.run_dir.metrics))
    mb = _untimed(read_metrics(resumed.run_dir.metrics))
    assert [r["step"] for r in ma] == [1, 2, 3, 4]
    assert ma == mb
    straight.close()
    resumed.close()


def test_async_with_staleness_zero_equals_sync(tmp_path):
    sync = _run(_cfg(tmp_path, "orchestrator.steps=4"), "sync")
    asyn = _run(
        _cfg(tmp_path, "orchestrator.steps=4", "orchestrator.mode=async", "orchestrator.max_staleness=0"),
        "async",
    )
    a, b = sync.learner.weights(), asyn.learner.weights()
    assert all(torch.equal(a[k], b[k]) for k in a)
    # the same rows, probes (every 2 steps, the last one after the rollout thread ends) and signals included
    ra = _untimed(read_metrics(sync.run_dir.metrics))
    rb = [
        {k: v for k, v in r.items() if not k.startswith("staleness/")}
        for r in _untimed(read_metrics(asyn.run_dir.metrics))
    ]
    assert ra == rb
    assert "heldout/generated_tokens" in ra[-1] and any(k.startswith("curriculum/weight/") for k in ra[-1])
    sync.close()
    asyn.close()


@pytest.mark.parametrize("lag", ["fixed", "latest"])
def test_async_staleness_one_overlaps_and_respects_bound(tmp_path, lag):
    cfg = _cfg(
        tmp_path,
        "orchestrator.steps=3",
        "orchestrator.mode=async",
        "orchestrator.max_staleness=1",
        f"orchestrator.async_lag={lag}",
    )
    rl = _run(cfg, f"a1{lag}")
    rows = read_metrics(rl.run_dir.metrics)
    assert len(rows) == 3
    assert all(r["staleness/max"] <= 1 for r in rows)
    assert any(r["staleness/max"] == 1 for r in rows[1:])  # later batches were generated ahead
    rl.close()


def test_phase_order_frees_kv_before_every_update(tmp_path):
    rl = _run(_cfg(tmp_path, "orchestrator.steps=2"), "phases")
    ev = [e for e in rl.phases.events if e in ("generate", "release_kv", "update", "sync_weights")]
    # initial weight push, then per step: generate -> release_kv -> update -> sync_weights
    assert ev == ["sync_weights"] + ["generate", "release_kv", "update", "sync_weights"] * 2
    rl.close()


class FailingSandbox:
    """Every job fails as infrastructure."""

    async def run(self, job):
        return ExecResult(ExecStatus.SANDBOX_ERROR, error="worker died (test)")

    async def run_batch(self, jobs):
        return [await self.run(j) for j in jobs]

    async def close(self):
        return None


class FixedTextEngine(Engine):
    """Answers every request with one fixed text (plus EOS); weight calls go to the real engine. The other
    members are the Engine protocol's defaults (no prefix cache)."""

    def __init__(self, inner, tokenizer, text):
        self.inner, self.text = inner, text
        self.ids = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]

    @property
    def version(self):
        return self.inner.version

    def load_weights(self, weights, version=None):
        self.inner.load_weights(weights, version=version)

    def release_kv_cache(self):
        self.inner.release_kv_cache()

    async def agenerate(self, request):
        from posttrain.engine import Completion, GenerationOutput

        return GenerationOutput(
            "fixed",
            list(request.prompt_token_ids),
            [Completion(self.ids, [-1.0] * len(self.ids), self.text, "stop")],
            0.0,
        )


def test_infrastructure_failures_are_excluded_and_counted(tmp_path, monkeypatch):
    cfg = load_config(
        None,
        [
            *TINY,
            "envs.domains=[{name: code.unit_tests, difficulties: [0]}, {name: math, difficulties: [0]}]",
            f"telemetry.run_dir={tmp_path}",
            "orchestrator.steps=1",
            "curriculum.probe_every=0",
            "curriculum.sampler=uniform_by_domain",
        ],
    )
    run_dir = RunDir.create(cfg.telemetry.run_dir, "infra")
    rl = RLRun(cfg, run_dir)
    monkeypatch.setattr(rl, "make_sandbox", lambda: FailingSandbox())
    rl.build()
    # every answer carries a code block, so code episodes reach the (failing) sandbox
    rl.engine = FixedTextEngine(rl.engine, rl.tokenizer, "```python\ndef solve(x):\n    return x\n```")
    seen = []
    real_step = rl.learner.step

    def spy(samples, current_version=None, replay=None):
        seen.extend(samples)
        return real_step(samples, current_version=current_version, replay=replay)

    monkeypatch.setattr(rl.learner, "step", spy)
    rl.train()
    rows = read_metrics(run_dir.metrics)
    failures = rows[-1]["counters/infra_failures"]
    assert failures > 0
    # only math trajectories reached the learner: each is one group of batch.samples_per_prompt samples
    assert len(seen) + failures == cfg.batch.prompts_per_step * cfg.batch.samples_per_prompt
    assert "reward/code.unit_tests" not in rows[-1]
    rl.close()


def test_bad_domain_difficulty_fails_before_work(tmp_path):
    cfg = load_config(
        None, [*TINY, "envs.domains=[{name: math, difficulties: [99]}]", f"telemetry.run_dir={tmp_path}"]
    )
    rl = RLRun(cfg, RunDir.create(tmp_path, "bad"))
    with pytest.raises(ValueError, match="no difficulty 99"):
        rl.build()


def test_corrupt_checkpoint_falls_back_to_previous(tmp_path):
    rl = _run(
        _cfg(
            tmp_path,
            "orchestrator.steps=4",
            "orchestrator.checkpoint_every=2",
            "orchestrator.keep_checkpoints=3",
        ),
        "c",
    )
    ckpts = list_checkpoints(rl.run_dir.checkpoints)
    assert [c.name for c in ckpts] == ["step-000002", "step-000004"]
    victim = next(p for p in ckpts[-1].rglob("*") if p.is_file() and p.name != "manifest.json")
    victim.write_bytes(victim.read_bytes()[:-7] + b"garbage")
    assert not verify(ckpts[-1]) and verify(ckpts[0])
    rl.close()
    again = RLRun(rl.cfg, RunDir.open(rl.run_dir.path))
    warnings = again.load()
    assert again.step == 2 and any("corrupt" in w for w in warnings)
    again.close()


def _cli(*args: str, env=None, **kw) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "posttrain", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        **kw,
    )


def test_cli_train_three_steps_with_code_and_tool_domains(tmp_path):
    sets = [f"--set={s}" for s in TINY] + [
        "--set=envs.domains=[{name: code.unit_tests, difficulties: [0]}, {name: tools.apis, difficulties: [0]}]",
        f"--set=telemetry.run_dir={tmp_path}",
        "--set=orchestrator.steps=3",
    ]
    proc = _cli("train", "--name", "e2e", *sets)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out
    run = tmp_path / "e2e"
    rows = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    domains_seen = {
        k.split("/", 1)[1] for r in rows for k in r if k.startswith("reward/") and k != "reward/mean"
    }
    assert domains_seen <= {"code.unit_tests", "tools.apis"} and domains_seen
    assert (run / "policy" / "config.json").is_file()
    assert (run / "checkpoints" / "latest").read_text() == "step-000003"
    tokens = sum(r["rollout/generated_tokens"] + r.get("heldout/generated_tokens", 0.0) for r in rows)
    assert f"done: 3 steps, {tokens:.0f} generated tokens;" in " ".join(out.split())


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_sigterm_during_a_step_leaves_a_loadable_checkpoint(tmp_path, mode):
    sets = [f"--set={s}" for s in TINY + DOMAINS] + [
        f"--set=telemetry.run_dir={tmp_path}",
        "--set=orchestrator.steps=50",
        "--set=orchestrator.checkpoint_every=0",
        f"--set=orchestrator.mode={mode}",
        "--set=orchestrator.max_staleness=2",
    ]
    proc = _cli("train", "--name", "term", *sets)
    metrics = tmp_path / "term" / "metrics.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline and not (metrics.exists() and metrics.read_text().strip()):
        time.sleep(0.2)
    assert metrics.exists(), "the run never finished a step"
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 128 + signal.SIGTERM, out
    ckpts = list_checkpoints(tmp_path / "term" / "checkpoints")
    assert ckpts and verify(ckpts[-1])
    state = json.loads((ckpts[-1] / "run_state.json").read_text())
    assert 1 <= state["step"] < 50
    cfg = load_config(tmp_path / "term" / "config.yaml")
    again = RLRun(cfg, RunDir.open(tmp_path / "term"))
    again.load()
    assert again.step == state["step"]
    again.close()


def test_cli_bad_config_fails_before_work(tmp_path):
    proc = _cli(
        "train",
        "--set",
        "envs.domains=[{name: nosuchdomain}]",
        "--set",
        f"telemetry.run_dir={tmp_path}",
        "--set",
        "model.spec=tiny:llama",
        env={**os.environ},
    )
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 2, out
    assert "unknown domain 'nosuchdomain'" in out


def test_dynamic_sampling_drops_equal_reward_groups_and_bounds_refills(tmp_path, monkeypatch):
    # a tiny random policy scores 0 on every math task: every group is uninformative
    cfg = _cfg(
        tmp_path,
        "orchestrator.steps=1",
        "curriculum.probe_every=0",
        "algorithm.dynamic_sampling=true",
        "algorithm.max_resample_rounds=2",
        "envs.domains=[{name: math, difficulties: [0]}]",
    )
    run_dir = RunDir.create(cfg.telemetry.run_dir, "dyn")
    rl = RLRun(cfg, run_dir)
    rl.build()
    seen = []
    monkeypatch.setattr(
        rl.learner, "step", lambda samples, current_version=None, replay=None: seen.extend(samples) or {}
    )
    rl.train()
    row = read_metrics(run_dir.metrics)[-1]
    assert row["rollout/dropped_group_frac"] == 1.0
    # the first round plus at most max_resample_rounds refills, each of batch.prompts_per_step groups
    assert row["rollout/episodes"] == 3 * cfg.batch.prompts_per_step * cfg.batch.samples_per_prompt
    assert row["rollout/empty_after_filter"] == 1.0
    assert row["rollout/zero_advantage_groups"] == 3 * cfg.batch.prompts_per_step
    assert row["rollout/zero_advantage_tokens"] == row["rollout/generated_tokens"] > 0
    assert seen == []
    rl.close()


def test_rl_bench_floor_is_hand_computable():
    from posttrain.bench.rl import step_floor_s

    warm = {"rollout/max_response_tokens": 1000.0, "train/update_tokens": 1e6}  # the warm-up step is skipped
    row = {"rollout/max_response_tokens": 48.0, "train/update_tokens": 600.0, "train/shared_prefix_frac": 0.5}
    # decode: 48 x (1e8 params x 2 bytes) / 10 GB/s = 0.96 s; update: 6 x 1e8 x 300 / 100 GFLOP/s = 1.8 s
    assert step_floor_s([warm, row], int(1e8), "bfloat16", 10.0, 100.0) == pytest.approx(2.76)
    assert step_floor_s([row], int(1e8), "float32", 10.0, 100.0) == pytest.approx(1.92 + 1.8)


def test_token_budget_stops_at_the_step_that_reaches_it(tmp_path):
    """The run stops after the first step whose rollout + probe tokens reach orchestrator.token_budget,
    with the same steps as an unbudgeted run up to there; async stops at the same step. (The sampler's
    schedule reads the budget's spent share, so it is off here: with it a budgeted run samples otherwise.)"""
    off = ("curriculum.eps_end=null", "curriculum.domain_mix=0")
    full = _run(_cfg(tmp_path, "orchestrator.steps=5", *off), "full")
    rows = read_metrics(full.run_dir.metrics)
    spent = [r["rollout/generated_tokens"] + r.get("heldout/generated_tokens", 0.0) for r in rows]
    assert any("heldout/generated_tokens" in r for r in rows)  # probes ran and were charged
    assert full.counters["rollout_tokens"] + full.counters["probe_tokens"] == sum(spent)
    # every trained group's tokens reached the sampler (update(..., tokens=)); no infra failures here
    assert full.counters["infra_failures"] == 0
    assert sum(t for t, _ in full.sampler.state_dict()["stats"]["tokens"]) == full.counters["rollout_tokens"]
    budget = int(sum(spent[:2])) + 1  # not reached after step 2, reached after step 3
    full.close()
    for mode in ("sync", "async"):
        rl = _run(
            _cfg(
                tmp_path,
                "orchestrator.steps=5",
                f"orchestrator.token_budget={budget}",
                f"orchestrator.mode={mode}",
                "orchestrator.max_staleness=1",
                *off,
            ),
            f"budget-{mode}",
        )
        got = read_metrics(rl.run_dir.metrics)
        assert [r["step"] for r in got] == [1, 2, 3], mode
        assert rl.budget_spent()
        if mode == "sync":
            assert _untimed(got) == _untimed(rows[:3])
        # the last step was checkpointed with the counters, and a resumed run trains no further
        state = json.loads((list_checkpoints(rl.run_dir.checkpoints)[-1] / "run_state.json").read_text())
        assert state["step"] == 3 and state["counters"]["rollout_tokens"] == rl.counters["rollout_tokens"]
        rl.close()
        again = _run(
            _cfg(tmp_path, "orchestrator.steps=5", f"orchestrator.token_budget={budget}", *off),
            f"budget-{mode}",
            resume=True,
        )
        assert again.step == 3
        again.close()


def test_token_budget_must_be_positive(tmp_path):
    from posttrain.config import ConfigError

    with pytest.raises(ConfigError, match="token_budget"):
        _cfg(tmp_path, "orchestrator.token_budget=0")


def test_progress_is_the_further_of_steps_and_tokens(tmp_path):
    """The share of the run the loop reports to the sampler's schedule (RLRun.progress)."""
    cfg = _cfg(tmp_path, "orchestrator.steps=10", "orchestrator.token_budget=1000")
    rl = RLRun(cfg, RunDir.create(cfg.telemetry.run_dir, "progress"))
    assert rl.progress(0) == 0.0
    assert rl.progress(4) == pytest.approx(0.4)  # no tokens yet: steps lead
    rl.counters["rollout_tokens"], rl.counters["probe_tokens"] = 500.0, 100.0
    assert rl.progress(4) == pytest.approx(0.6)  # 600 of 1000 tokens: tokens lead, probes counted
    rl.counters["rollout_tokens"] = 5000.0
    assert rl.progress(4) == 1.0  # capped
    plain = RLRun(_cfg(tmp_path, "orchestrator.steps=8"), RunDir.create(cfg.telemetry.run_dir, "plain"))
    plain.counters["rollout_tokens"] = 1e9  # no budget: tokens do not count
    assert plain.progress(2) == pytest.approx(0.25)
    rl.close()
    plain.close()


def _parity_rewards(rollout):
    """RLRun.rollout with every reward replaced by the parity of the sum of the sampled ids: rewards that vary
    within a group on a random tiny model, so the updates move the weights and the policy version matters."""

    def scored(self, *args, **kwargs):
        batch = rollout(self, *args, **kwargs)
        for t in batch.trajectories:
            t.reward = float(sum(i for i, m in zip(t.token_ids, t.loss_mask, strict=True) if m) % 2)
        return batch

    return scored


@pytest.mark.parametrize(("k", "budget"), [(1, None), (2, None), (2, 1000)])
def test_async_run_does_not_depend_on_which_thread_is_faster(tmp_path, monkeypatch, k, budget):
    """Batch b is generated by the weights after b - k updates and picked by a sampler fed the batches
    before b - k, however the threads interleave: a run whose learner is slow and one whose rollouts are
    slow give the same weights, rewards, curriculum signals and probes. With a token budget, they stop at
    the same step (the schedule reads the tokens too)."""
    monkeypatch.setattr(RLRun, "rollout", _parity_rewards(RLRun.rollout))
    runs = {}
    for name, slow in (("slow_learner", "update"), ("slow_rollouts", "rollout")):
        with monkeypatch.context() as m:
            inner = getattr(RLRun, slow)

            def delayed(self, *args, _inner=inner, **kwargs):
                time.sleep(0.25)
                return _inner(self, *args, **kwargs)

            m.setattr(RLRun, slow, delayed)
            cfg = _cfg(
                tmp_path,
                "orchestrator.steps=5",
                "orchestrator.mode=async",
                f"orchestrator.max_staleness={k}",
                "batch.samples_per_prompt=4",
                f"orchestrator.token_budget={budget or 'null'}",
                "orchestrator.checkpoint_every=0",
            )  # no periodic checkpoint restarts the pipeline
            runs[name] = _run(cfg, f"{name}{k}{budget}")
    a, b = runs["slow_learner"], runs["slow_rollouts"]
    ra, rb = _untimed(read_metrics(a.run_dir.metrics)), _untimed(read_metrics(b.run_dir.metrics))
    # 3 batches of 12 x 24 tokens and a probe of at most 2 arms x 2 prompts x 24 tokens stay under 1000; a 4th passes it
    steps = 5 if budget is None else 4
    assert len(ra) == steps and a.counters == b.counters
    last = ra[-1]["rollout/generated_tokens"] + ra[-1].get(
        "heldout/generated_tokens", 0.0
    )  # its batch, its probe
    assert budget is None or a.tokens_spent() >= budget > a.tokens_spent() - last
    assert all(r["train/grad_norm"] > 0 for r in ra)  # the weights move at every step
    assert ra == rb
    wa, wb = a.learner.weights(), b.learner.weights()
    assert all(torch.equal(wa[key], wb[key]) for key in wa)
    # batch s is k versions behind the learner that trains on it (fewer at the start: version 0 is the oldest)
    assert [r["staleness/max"] for r in ra] == [float(min(s, k)) for s in range(steps)]
    assert any(
        key.startswith("heldout/") for r in ra for key in r
    )  # probes ran (every 2 steps) and are logged
    assert any(key.startswith("curriculum/weight/") for r in ra for key in r)
    a.close()
    b.close()


def test_async_sampler_is_fed_each_trained_batch_once(tmp_path):
    """k = 2: the sampler hears of batch j when it picks batch j + 3, and of the rest when the run ends: every
    trained batch once, in order, whatever the timing."""
    cfg = _cfg(
        tmp_path,
        "orchestrator.steps=4",
        "orchestrator.mode=async",
        "orchestrator.max_staleness=2",
        "orchestrator.checkpoint_every=0",
    )
    rl = _run(cfg, "fed")
    stats = rl.sampler.state_dict()["stats"]
    assert sum(stats["n_groups"]) == 4 * 3 and stats["last_step"] == 3  # 4 batches of 3 groups, fed in order
    rl.close()


def test_checkpoint_keeps_the_sampler_feedback_held_back(tmp_path):
    """A checkpoint written while the async rollout thread holds back trained batches' groups (on a signal,
    mid-interval) saves them; loading feeds them. Batches not trained on yet are left out."""
    from posttrain.config import save_config

    cfg = _cfg(tmp_path, "orchestrator.steps=4")
    run_dir = RunDir.create(cfg.telemetry.run_dir, "held")
    save_config(cfg, run_dir.config)
    rl = RLRun(cfg, run_dir)
    rl.build()
    math0 = rl.arms[0]
    rl.step = 2
    rl.tasks.unfed = {
        1: [(math0, 0, [1.0, 0.0], 10), (math0, 1, [0.0, 0.0], 12)],
        2: [(math0, 2, [1.0, 1.0], 9)],
    }
    path = rl.save()
    state = json.loads((path / "run_state.json").read_text())
    assert state["sampler_pending"] == [[1, [["math:0", 0, [1.0, 0.0], 10], ["math:0", 1, [0.0, 0.0], 12]]]]
    rl.close()
    again = RLRun(cfg, RunDir.open(rl.run_dir.path))
    again.load()
    stats = again.sampler.state_dict()["stats"]
    assert (
        again.step == 2
        and stats["n_groups"][0] == 2
        and sum(stats["n_groups"]) == 2
        and stats["last_step"] == 1
    )
    again.close()


@pytest.mark.parametrize("k", [1, 2])
def test_async_resume_from_a_periodic_checkpoint_is_bit_exact(tmp_path, monkeypatch, k):
    """With the fixed lag the pipeline restarts at each periodic checkpoint (every 3 steps here): batch s is
    generated with the weights of max(s - k, 3 * (s // 3)) steps. So a run resumed from such a checkpoint is the
    run that went on: same weights, same rows (probes and curriculum signals included)."""
    import shutil

    monkeypatch.setattr(RLRun, "rollout", _parity_rewards(RLRun.rollout))
    base = (
        "orchestrator.mode=async",
        f"orchestrator.max_staleness={k}",
        "batch.samples_per_prompt=4",
        "orchestrator.checkpoint_every=3",
    )
    straight = _run(_cfg(tmp_path, "orchestrator.steps=6", *base), "straight")
    shutil.copytree(straight.run_dir.path, tmp_path / "mid")
    shutil.rmtree(tmp_path / "mid" / "checkpoints" / "step-000006")  # resume from step 3's
    mid = _run(_cfg(tmp_path, "orchestrator.steps=6", *base), "mid", resume=True)
    rows = _untimed(read_metrics(straight.run_dir.metrics))
    assert [r["staleness/max"] for r in rows] == [float(s - max(s - k, 3 * (s // 3))) for s in range(6)]
    assert all(r["train/grad_norm"] > 0 for r in rows)
    assert any(
        key.startswith("heldout/") for key in rows[3]
    )  # the probe after the resume point (every 2 steps)
    assert _untimed(read_metrics(mid.run_dir.metrics)) == rows
    w, wm = straight.learner.weights(), mid.learner.weights()
    assert all(torch.equal(w[key], wm[key]) for key in w)
    straight.close()
    mid.close()


def _fsync_recorder(monkeypatch) -> list[str]:
    """Record the path of every fd that os.fsync is called on."""
    seen: list[str] = []
    real = os.fsync

    def spy(fd):
        seen.append(os.readlink(f"/proc/self/fd/{fd}"))
        return real(fd)

    monkeypatch.setattr(os, "fsync", spy)
    return seen


def test_checkpoint_files_and_directories_are_fsynced_before_publishing(tmp_path, monkeypatch):
    from posttrain.config import AlgorithmConfig, ModelConfig, TrainerConfig
    from posttrain.orchestrator.checkpoint import save_checkpoint
    from posttrain.train import Learner

    learner = Learner(ModelConfig(spec="tiny:llama"), TrainerConfig(), AlgorithmConfig(), seed=0)
    published: dict[str, list[str]] = {}

    def write(tmp: Path) -> None:
        learner.save(tmp / "learner")
        (tmp / "run_state.json").write_text("{}")
        published["tmp"] = [str(tmp)]

    seen = _fsync_recorder(monkeypatch)
    final = save_checkpoint(tmp_path / "ckpts", 1, write)
    tmp = published["tmp"][0]
    rel = {os.path.relpath(p, tmp) for p in seen if p.startswith(tmp)}
    want = {os.path.relpath(p, final) for p in map(str, [final, *final.rglob("*")])}
    assert "learner" in want and "learner/policy.safetensors" in want
    assert want <= rel, f"not fsynced before the rename: {sorted(want - rel)}"


def test_replacing_a_checkpoint_never_leaves_its_step_without_a_valid_one(tmp_path, monkeypatch):
    import shutil

    from posttrain.orchestrator.checkpoint import latest_valid, save_checkpoint

    root = tmp_path / "ckpts"

    def write(tag: str):
        def fill(tmp: Path) -> None:
            (tmp / "sub").mkdir()
            (tmp / "sub" / "weights.bin").write_bytes(tag.encode() * 1000)
            (tmp / "run_state.json").write_text(json.dumps({"tag": tag}))

        return fill

    first = save_checkpoint(root, 5, write("old"), keep=1)
    assert first.name == "step-000005"
    checks: list[str] = []

    def valid_step_5_exists(what: str) -> None:
        path, _ = latest_valid(root)
        assert json.loads((path / "manifest.json").read_text())["step"] == 5, what
        checks.append(what)

    for mod, name in ((os, "rename"), (os, "replace"), (shutil, "rmtree")):
        real = getattr(mod, name)

        def guarded(*args, _real=real, _name=name, **kw):
            if Path(args[0]).parent == root or Path(args[0]) == root:
                valid_step_5_exists(f"before {_name}({args[0]})")
            out = _real(*args, **kw)
            if Path(args[0]).parent == root:
                valid_step_5_exists(f"after {_name}({args[0]})")
            return out

        monkeypatch.setattr(mod, name, guarded)
    second = save_checkpoint(root, 5, write("new"), keep=1)
    monkeypatch.undo()
    assert checks  # the publication went through the guarded calls
    path, warnings = latest_valid(root)
    assert path == second and not warnings
    assert json.loads((path / "run_state.json").read_text()) == {"tag": "new"}
    assert list_checkpoints(root) == [second]  # the superseded one is gone once the new one is published
    third = save_checkpoint(root, 5, write("newer"), keep=1)
    assert third != second and list_checkpoints(root) == [third]


def test_dapo_filter_only_filters_in_the_real_loop_and_domain_weights_reach_the_sampler(
    tmp_path, monkeypatch
):
    # dynamic_sampling is off: the sampler alone asks for DAPO's filter; the tiny policy scores 0 on math
    cfg = _cfg(
        tmp_path,
        "orchestrator.steps=1",
        "curriculum.probe_every=0",
        "curriculum.sampler=dapo_filter_only",
        "algorithm.max_resample_rounds=2",
        "envs.domains=[{name: math, difficulties: [0]}, {name: tools.apis, difficulties: [0], weight: 3}]",
    )
    run_dir = RunDir.create(cfg.telemetry.run_dir, "dapo")
    rl = RLRun(cfg, run_dir)
    rl.build()
    w = rl.sampler.weights()
    assert [w[a] for a in rl.arms] == pytest.approx(
        [0.25, 0.75]
    )  # uniform_by_domain's shares, weighted 1 : 3
    rl.arms = rl.arms[:1]
    rl.sampler = type(rl.sampler)(cfg.curriculum, rl.arms, cfg.seed)  # math alone: every group all-zero
    seen = []
    monkeypatch.setattr(
        rl.learner, "step", lambda samples, current_version=None, replay=None: seen.extend(samples) or {}
    )
    rl.train()
    row = read_metrics(run_dir.metrics)[-1]
    assert row["rollout/dropped_group_frac"] == 1.0 and seen == []
    assert row["rollout/episodes"] == 3 * cfg.batch.prompts_per_step * cfg.batch.samples_per_prompt
    rl.close()


def test_a_group_left_with_one_member_is_dropped_and_counted(tmp_path, monkeypatch):
    from posttrain.types import TrajectoryStatus

    cfg = _cfg(
        tmp_path,
        "orchestrator.steps=1",
        "curriculum.probe_every=0",
        "envs.domains=[{name: math, difficulties: [0]}]",
    )
    run_dir = RunDir.create(cfg.telemetry.run_dir, "lone")
    rl = RLRun(cfg, run_dir)
    rl.build()
    real_rollout = rl.rollout

    def lose_one(picks, step, group_offset):
        batch = real_rollout(picks, step, group_offset)
        victim = next(t for t in batch.trajectories if t.group_id == group_offset)  # group 0 keeps one member
        victim.status = TrajectoryStatus.SANDBOX_ERROR
        return batch

    monkeypatch.setattr(rl, "rollout", lose_one)
    seen = []
    monkeypatch.setattr(
        rl.learner, "step", lambda samples, current_version=None, replay=None: seen.extend(samples) or {}
    )
    rl.train()
    row = read_metrics(run_dir.metrics)[-1]
    assert row["rollout/dropped_singleton_groups"] == 1.0 and row["counters/dropped_singleton_groups"] == 1.0
    assert {t.group_id for t in seen} == {1, 2}  # the lone member's group never reaches the learner
    # the tiny policy scores 0 on math: groups 1 and 2 have zero advantage; the lone member is not a group
    assert row["rollout/zero_advantage_groups"] == 2.0
    assert row["rollout/zero_advantage_tokens"] == sum(sum(s.loss_mask) for s in seen)
    assert len(seen) == 2 * cfg.batch.samples_per_prompt
    rl.close()


def test_the_run_s_sandbox_gets_the_configured_per_job_limits(tmp_path, monkeypatch):
    import asyncio

    import posttrain.sandbox as sandbox_mod
    from posttrain.sandbox import Job, Limits

    jobs = []

    class Recorder:
        async def run(self, job):
            jobs.append(job)
            return ExecResult(ExecStatus.OK)

        async def run_batch(self, batch):
            return [await self.run(j) for j in batch]

        async def close(self):
            pass

    monkeypatch.setattr(sandbox_mod, "LocalSandbox", lambda cfg=None: Recorder())  # make_sandbox wraps it
    cfg = _cfg(tmp_path, "sandbox.wall_time_s=3", "sandbox.memory_mb=100")
    sb = RLRun(cfg, RunDir.create(tmp_path, "limits")).make_sandbox()
    asyncio.run(sb.run(Job(code="", limits=Limits(wall_time_s=20.0, cpu_time_s=20.0))))
    asyncio.run(sb.run_batch([Job(code="", limits=Limits(wall_time_s=1.0, cpu_time_s=1.5))]))
    a, b = (j.limits for j in jobs)
    assert (a.wall_time_s, a.cpu_time_s, a.memory_bytes) == (3.0, 3.0, 100 << 20)  # capped
    assert (b.wall_time_s, b.cpu_time_s, b.memory_bytes) == (1.0, 1.5, 100 << 20)  # below the cap: its own
