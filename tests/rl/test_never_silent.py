"""A run never fails silently: any finite reward trains, a reward function that raises stops the run as
the user's error, a step of infrastructure failures only stops it, `eval` with nothing scored exits 1;
clipped completions are counted; without a terminal `train` prints one line per step."""

from __future__ import annotations

import asyncio
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from posttrain.cli import app
from posttrain.engine import Completion, GenerationOutput, SamplingParams
from posttrain.envs import get_domain
from posttrain.orchestrator.rl.guard import AllEpisodesFailed, RewardFunctionError, StepHealth, check_step
from posttrain.rollout import EpisodeLimits, rollout_stats, run_episode
from posttrain.telemetry import read_metrics
from posttrain.types import Task, Trajectory, TrajectoryStatus

TINY = [
    "model.spec=tiny:llama",
    "engine.num_kv_blocks=256",
    "engine.max_new_tokens=8",
    "engine.max_num_seqs=8",
    "envs.max_episode_tokens=32",
    "envs.max_turns=1",
    "batch.samples_per_prompt=2",
    "batch.prompts_per_step=2",
    "orchestrator.checkpoint_every=0",
    "curriculum.probe_every=0",
    "telemetry.tensorboard=false",
]

REWARDS_PY = """
def penalty(prompts, completions, **columns):
    # TRL style: -1 for an odd-length completion, 0 otherwise
    return [-1.0 if len(c) % 2 else 0.0 for c in completions]

def wrong_argument(prompts, completions, solution, **columns):
    return [1.0 for _ in completions]
"""


def _traj(domain: str, clipped: bool, status=TrajectoryStatus.OK, info=None) -> Trajectory:
    task = Task(id=f"{domain}:t", domain=domain, difficulty=0, prompt=[])
    return Trajectory(
        task, [1, 2, 3], [0, 1, 1], [0.0, -0.1, -0.1], 1, status=status, info=info or {}, clipped=clipped
    )


def test_clipped_ratio_of_a_constructed_step_equals_the_hand_count():
    trajs = [
        _traj("math", True),
        _traj("math", False),
        _traj("math", True),
        _traj("tools.apis", False),
        _traj("tools.apis", True, TrajectoryStatus.TRUNCATED),
    ]
    stats = rollout_stats(trajs, wall_s=1.0)
    assert stats["rollout/clipped_ratio"] == 3 / 5
    assert stats["rollout/clipped_ratio/math"] == 2 / 3
    assert stats["rollout/clipped_ratio/tools.apis"] == 1 / 2
    # cut short: the three clipped ones (one of them also out of budget); nothing else
    assert stats["rollout/truncated"] == 3.0


class _LengthEngine:
    """Answers every request with `n` tokens cut at max_tokens (finish_reason "length")."""

    version = 0

    async def agenerate(self, request):
        ids = [42] * request.params.max_tokens
        return GenerationOutput(
            "0", list(request.prompt_token_ids), [Completion(ids, [-0.5] * len(ids), "", "length")], 0.0
        )


def test_a_completion_cut_at_max_new_tokens_is_clipped_and_counted_truncated(tokenizer):
    domain = get_domain("math")
    task = domain.task("train", 0, 0)
    params = SamplingParams(max_tokens=5, stop_token_ids=[tokenizer.eos_token_id])
    traj = asyncio.run(
        run_episode(_LengthEngine(), tokenizer, domain, task, None, params, EpisodeLimits(1, 4096, 5))
    )
    # the environment scored the cut answer (done after one turn): the status alone said nothing
    assert traj.status is TrajectoryStatus.OK and traj.num_generated == 5 and traj.clipped
    stats = rollout_stats([traj], wall_s=1.0)
    assert (stats["rollout/clipped_ratio"], stats["rollout/truncated"]) == (1.0, 1.0)


def test_step_guard_stops_on_reward_fn_errors_and_all_infra_and_warns_past_the_share():
    user = "reward function f.py:g failed on row 3 of d.jsonl: TypeError: g() missing 'solution'"
    trajs = [
        _traj("d", False, TrajectoryStatus.REWARD_FN_ERROR, {"reward_fn_error": user}),
        _traj("d", False),
    ]
    health = StepHealth.of(trajs)
    assert (health.episodes, health.reward_fn_errors, health.infra_failures) == (2, 1, 0)
    with pytest.raises(RewardFunctionError) as err:
        check_step(health, 1, 0, 0, 0.25)
    assert err.value.exit_code == 2 and f"the first: {user}" in str(err.value)
    assert "step 1: the reward function failed on 1 of 2 episodes" in str(err.value)
    check_step(health, 1, 0, 1, 0.25)  # tolerated: 1 error, max 1
    with pytest.raises(RewardFunctionError):
        check_step(health, 2, 1, 1, 0.25)  # the run's second

    engine = {"error": "BadRequestError: prompt too long"}
    infra = [_traj("m", False, TrajectoryStatus.ENGINE_ERROR, engine) for _ in range(3)]
    with pytest.raises(AllEpisodesFailed) as err:
        check_step(StepHealth.of(infra), 4, 0, 0, 0.25)
    assert err.value.exit_code == 1
    assert str(err.value) == (
        "step 4: all 3 episodes were infrastructure failures, nothing to train on; the first: "
        "m:t: engine_error: BadRequestError: prompt too long"
    )
    stream = io.StringIO()
    check_step(StepHealth.of([*infra[:1], _traj("m", False), _traj("m", False)]), 5, 0, 0, 0.25, stream)
    assert stream.getvalue() == (
        "warning: step 5: 1 of 3 episodes (33%) were infrastructure failures (not trained on); the first: "
        "m:t: engine_error: BadRequestError: prompt too long\n"
    )
    quiet = io.StringIO()
    check_step(StepHealth.of([*infra[:1], *[_traj("m", False)] * 3]), 6, 0, 0, 0.25, quiet)  # 25%: not more
    assert quiet.getvalue() == ""


def _dataset(tmp_path: Path, fn: str) -> str:
    rows = [{"prompt": f"Say something about {w}.", "split": "train"} for w in "abcdefgh"]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "rewards.py").write_text(REWARDS_PY)
    domain = f"{{name: dataset, difficulties: [0], options: {{path: '{tmp_path / 'rows.jsonl'}', "
    domain += f"reward_fn: '{tmp_path / 'rewards.py'}:{fn}', split_key: split}}}}"
    return f"envs.domains=[{domain}]"


def _train(tmp_path: Path, name: str, *sets: str) -> subprocess.CompletedProcess:
    args = [f"--set={s}" for s in [*TINY, f"telemetry.run_dir={tmp_path}", *sets]]
    return subprocess.run(
        [sys.executable, "-m", "posttrain", "train", "--name", name, *args],
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_a_penalty_reward_trains_and_a_piped_run_prints_a_line_per_step(tmp_path):
    proc = _train(tmp_path, "penalty", _dataset(tmp_path, "penalty"), "orchestrator.steps=2")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = read_metrics(tmp_path / "penalty" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:  # every episode scored, none an infrastructure failure, and the learner stepped on them
        assert (r["rollout/episodes"], r["rollout/infra_failures"], r["rollout/reward_fn_errors"]) == (
            4,
            0,
            0,
        )
        assert -1.0 <= r["reward/mean"] <= 0.0 and "train/loss" in r
    assert any(r["reward/mean"] < 0 for r in rows)
    # stdout is a pipe here: one plain line per step, with the step's figures
    lines = [line for line in proc.stdout.splitlines() if line.startswith("step ")]
    assert [line.split()[1] for line in lines] == ["1/2", "2/2"]
    for line, r in zip(lines, rows, strict=True):
        assert f"reward {r['reward/mean']:.4g}  " in line
        assert (
            f"clipped {r['rollout/clipped_ratio']:.3g}  tokens {r['rollout/generated_tokens']:.0f}  " in line
        )


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_raising_reward_function_stops_the_run_as_a_user_error(tmp_path, mode):
    sets = [_dataset(tmp_path, "wrong_argument"), "orchestrator.steps=3", f"orchestrator.mode={mode}"]
    proc = _train(tmp_path, "raises", *sets)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    err = " ".join(proc.stderr.split())
    spec = f"{tmp_path / 'rewards.py'}:wrong_argument"
    assert "error: step 1: the reward function failed on 4 of 4 episodes" in err
    assert (
        f"reward function {spec} failed on row " in err
        and f" of {tmp_path / 'rows.jsonl'}: TypeError: " in err
    )
    assert "TypeError: wrong_argument() missing 1 required positional argument: 'solution'" in err
    # the step that stopped the run is in metrics.jsonl, its episodes counted as the user's errors
    (row,) = read_metrics(tmp_path / "raises" / "metrics.jsonl")
    assert (row["step"], row["rollout/reward_fn_errors"], row["rollout/infra_failures"]) == (1, 4, 0)
    assert "sandbox_error" not in err and "infrastructure" not in err


def test_a_step_of_infrastructure_failures_only_fails_the_run(tmp_path):
    # every prompt is longer than a 16-token context: each episode is an engine failure
    proc = _train(
        tmp_path, "infra", _dataset(tmp_path, "penalty"), "orchestrator.steps=2", "engine.max_model_len=16"
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    err = " ".join(proc.stderr.split())
    assert (
        "error: step 1: all 4 episodes were infrastructure failures, nothing to train on; the first: " in err
    )
    assert "engine_error: BadRequestError" in err
    (row,) = read_metrics(tmp_path / "infra" / "metrics.jsonl")
    assert (row["step"], row["rollout/infra_failures"], row["counters/infra_failures"]) == (1, 4, 4)


def test_eval_against_an_unreachable_server_scores_nothing_and_exits_1():
    args = ["eval", "--api-base", "http://127.0.0.1:9/v1", "--model", "m", "--suite", "math", "--n", "1"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 1, result.output
    text = " ".join(result.output.split())
    assert "error: nothing was scored for http://127.0.0.1:9/v1#m: every episode failed (the first: " in text
    assert "nan" not in text
