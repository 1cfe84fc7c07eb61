"""Held-out scoring: strict success as the task score (shaped reward and components reported apart),
the unbiased pass@k estimator against hand-computed numbers and brute-force enumeration, and pass@k
with intervals for a model, its baseline and their paired delta."""

from __future__ import annotations

import itertools
import json
from fractions import Fraction

import pytest
from typer.testing import CliRunner

from posttrain.cli import app
from posttrain.orchestrator.eval.evaluate import (
    EpisodeScore,
    EvalReport,
    check_pass_at,
    episode_score,
    episodes_of,
    paired_delta,
    parse_pass_at,
    pass_at_k,
    task_score,
)
from posttrain.types import Task, Trajectory, TrajectoryStatus


def _traj(
    rewards: dict[str, float], reward: float, status: TrajectoryStatus = TrajectoryStatus.OK
) -> Trajectory:
    task = Task(id="t", domain="code.unit_tests", difficulty=0, prompt=[])
    return Trajectory(task, [1, 2], [0, 1], [0.0, -0.5], 1, rewards=rewards, reward=reward, status=status)


def test_task_score_is_strict_success_not_the_shaped_reward():
    # code.unit_tests, 5 of 6 hidden tests passed, well formatted: shaped reward 0.85 * 5/6 + 0.15
    shaped = 0.85 * 5 / 6 + 0.15
    assert task_score({"passed": 5 / 6, "format": 1.0}, shaped) == 0.0
    assert task_score({"passed": 1.0, "format": 1.0}, 0.85 + 0.15) == 1.0
    # a domain's own success component wins over the reward, either way
    assert task_score({"success": 1.0, "passed": 1.0, "format": 0.0}, 0.85) == 1.0
    assert task_score({"success": 0.0}, 1.0) == 0.0
    # a custom domain with no success component: only full reward counts
    assert task_score({}, 0.999) == 0.0 and task_score({}, 1.0) == 1.0
    assert episode_score({"success": 0.0, "passed": 0.5, "format": 1.0}, 0.575) == EpisodeScore(
        0.0, 0.575, {"passed": 0.5, "format": 1.0}
    )


def test_hand_made_trajectories_give_accuracy_reward_and_components_apart():
    # two tasks, two samples each; task 1's second sample died in the sandbox (excluded, not 0)
    trajs = [
        _traj({"passed": 1.0, "format": 1.0}, 1.0),
        _traj({"passed": 4 / 6, "format": 1.0}, 0.85 * 4 / 6 + 0.15),
        _traj({"passed": 0.5, "format": 0.0}, 0.425),
        _traj({}, 0.0, TrajectoryStatus.SANDBOX_ERROR),
    ]
    per_task = episodes_of(trajs, samples=2)
    assert [len(eps) for eps in per_task] == [2, 1]
    report = EvalReport("m", per_task={})
    for eps in per_task:
        report.add("code.unit_tests", eps)
    report.add("code.unit_tests", [])  # a third task with every sample an infra failure
    report.summarise(seed=0)
    assert report.per_task["code.unit_tests"] == [0.5, 0.0, None]
    d = report.per_domain["code.unit_tests"]
    assert d["accuracy"] == 0.25 and d["n"] == 2 and d["infra_failures"] == 1 and d["samples"] == 3
    # mean over tasks of each task's mean: ((1 + 0.85*4/6 + 0.15) / 2 + 0.425) / 2
    assert d["mean_reward"] == pytest.approx(((1.0 + 0.85 * 4 / 6 + 0.15) / 2 + 0.425) / 2)
    assert d["mean_components"] == pytest.approx(
        {"passed": ((1 + 4 / 6) / 2 + 0.5) / 2, "format": (1.0 + 0.0) / 2}
    )
    assert "pass_at" not in d


@pytest.mark.parametrize(
    ("n", "c", "k", "expected"),
    [
        (4, 1, 1, 0.25),
        (4, 1, 2, 0.5),
        (4, 1, 3, 0.75),
        (4, 1, 4, 1.0),
        (4, 0, 4, 0.0),
        (4, 4, 1, 1.0),
        (5, 2, 2, 0.7),  # 1 - C(3,2)/C(5,2) = 1 - 3/10
        (10, 3, 4, 1 - 35 / 210),  # 1 - C(7,4)/C(10,4)
    ],
)
def test_pass_at_k_hand_computed(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_pass_at_k_equals_brute_force_enumeration_of_k_subsets():
    for n in range(1, 8):
        for c in range(n + 1):
            outcomes = [1] * c + [0] * (n - c)
            for k in range(1, n + 1):
                subsets = list(itertools.combinations(range(n), k))
                exact = Fraction(sum(any(outcomes[i] for i in s) for s in subsets), len(subsets))
                assert pass_at_k(n, c, k) == pytest.approx(float(exact), abs=1e-12), (n, c, k)


def test_pass_at_k_refuses_too_few_samples_and_bad_counts():
    with pytest.raises(ValueError, match="pass@5 needs at least 5 samples per task, got 4"):
        pass_at_k(4, 1, 5)
    with pytest.raises(ValueError, match="successes"):
        pass_at_k(4, 5, 1)
    with pytest.raises(ValueError, match="--pass-at 16 needs at least 16 samples per task.*--samples 16"):
        check_pass_at([1, 4, 16], 4)
    check_pass_at([1, 4], 4)
    assert parse_pass_at("16, 1,4,4") == [1, 4, 16]
    with pytest.raises(ValueError, match="--pass-at .*'0'"):
        parse_pass_at("1,0")


def _ok(success: int) -> EpisodeScore:
    return EpisodeScore(float(success), float(success))


def test_pass_at_with_intervals_for_model_baseline_and_delta():
    # 4 samples per task; successes per task: model [1, 4, 0], baseline [0, 2, 0]
    model, base = EvalReport("m", {}), EvalReport("b", {})
    for c in (1, 4, 0):
        model.add("math", [_ok(i < c) for i in range(4)])
    for c in (0, 2, 0):
        base.add("math", [_ok(i < c) for i in range(4)])
    for r in (model, base):
        r.summarise(seed=0, pass_at=[1, 2, 4])
    p = model.per_domain["math"]["pass_at"]
    # pass@1 = c/n per task: (0.25 + 1 + 0) / 3; pass@2: (0.5 + 1 + 0) / 3; pass@4: (1 + 1 + 0) / 3
    assert p["1"]["value"] == pytest.approx(1.25 / 3) and p["1"]["n"] == 3
    assert p["2"]["value"] == pytest.approx(1.5 / 3) and p["4"]["value"] == pytest.approx(2 / 3)
    assert p["1"]["value"] == pytest.approx(model.per_domain["math"]["accuracy"])  # pass@1 is the accuracy
    assert 0.0 <= p["4"]["ci_low"] <= p["4"]["value"] <= p["4"]["ci_high"] <= 1.0
    assert p["4"]["ci_low"] < p["4"]["ci_high"]
    # baseline pass@2 per task: 0, 1 - C(2,2)/C(4,2) = 5/6, 0
    assert base.per_domain["math"]["pass_at"]["2"]["value"] == pytest.approx((5 / 6) / 3)
    delta = paired_delta(model, base, seed=0, pass_at=[1, 2, 4])
    # per-task pass@2 differences: 0.5 - 0, 1 - 5/6, 0 - 0
    d2 = delta["per_domain"]["math"]["pass_at"]["2"]
    assert d2["delta"] == pytest.approx((0.5 + 1 / 6) / 3) and d2["n_tasks"] == 3
    assert delta["pass_at"]["4"]["delta"] == pytest.approx((1 + 0 + 0) / 3)  # baseline pass@4: 0, 1, 0
    assert delta["delta"] == pytest.approx((0.25 + 0.5 + 0) / 3)  # accuracy: (0.25 - 0, 1 - 0.5, 0)
    assert d2["ci_low"] <= d2["delta"] <= d2["ci_high"]


def _iou(success: float, iou: float | None, valid: float) -> EpisodeScore:
    parts = {"valid": valid} if iou is None else {"iou": iou, "valid": valid}
    return EpisodeScore(success, 0.9 * (iou or 0.0), parts)


def test_reward_components_get_intervals_and_paired_deltas_over_tasks():
    model, base = EvalReport("m", {}), EvalReport("b", {})
    model.add("cad", [_iou(1, 1.0, 1), _iou(0, 0.5, 1)])  # task means: iou 0.75, valid 1
    model.add("cad", [_iou(0, None, 0), _iou(0, 0.25, 1)])  # iou 0.25 (of the one that has it), valid 0.5
    model.add("cad", [])  # every sample an infrastructure failure: in no mean
    base.add("cad", [_iou(0, 0.5, 1), _iou(0, None, 0)])  # iou 0.5, valid 0.5
    base.add("cad", [_iou(0, None, 0), _iou(0, None, 0)])  # no iou, valid 0
    base.add("cad", [_iou(0, 0.0, 1)])
    assert model.component("cad", "iou") == [0.75, 0.25, None] and base.component("cad", "iou") == [
        0.5,
        None,
        0.0,
    ]
    model.summarise(seed=0)
    got = model.per_domain["cad"]["components"]
    assert got["iou"]["value"] == pytest.approx(0.5) and got["iou"]["n"] == 2
    assert (
        got["valid"]["value"] == pytest.approx(0.75)
        and got["valid"]["ci_low"] <= 0.75 <= got["valid"]["ci_high"]
    )
    assert model.per_domain["cad"]["mean_components"] == pytest.approx({"iou": 0.5, "valid": 0.75})
    comp = paired_delta(model, base, seed=0)["per_domain"]["cad"]["components"]
    assert comp["iou"]["delta"] == pytest.approx(0.25) and comp["iou"]["n_tasks"] == 1  # tasks scored in both
    assert comp["valid"]["delta"] == pytest.approx((0.5 + 0.5) / 2) and comp["valid"]["n_tasks"] == 2


def test_pass_at_skips_tasks_with_too_few_scored_samples():
    r = EvalReport("m", {})
    r.add("math", [_ok(1), _ok(0), _ok(0), _ok(0)])
    r.add("math", [_ok(1), _ok(1)])  # two of four samples were infrastructure failures
    assert r.pass_at("math", 2) == [pytest.approx(0.5), 1.0]
    assert r.pass_at("math", 4) == [1.0, None]
    r.summarise(pass_at=[4])
    assert r.per_domain["math"]["pass_at"]["4"]["n"] == 1 and r.per_domain["math"][
        "accuracy"
    ] == pytest.approx(0.625)


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (
            ["--temperature", "1.0", "--samples", "4", "--pass-at", "1,4,16"],
            "--pass-at 16 needs at least 16 samples",
        ),
        (["--pass-at", "4"], "--pass-at 4 needs at least 4 samples per task, but each task gets 1"),
        (["--pass-at", "two"], "--pass-at takes comma-separated integers"),
    ],
)
def test_cli_pass_at_needs_enough_samples(args, needle):
    result = CliRunner().invoke(app, ["eval", "tiny:llama", "--suite", "math", "--n", "1", *args])
    assert result.exit_code == 2, result.output
    assert needle in " ".join(result.output.split())


def test_cli_eval_json_reports_pass_at_for_model_and_baseline(tmp_path):
    args = [
        "eval",
        "tiny:llama",
        "--baseline",
        "tiny:llama",
        "--suite",
        "math",
        "--n",
        "2",
        "--temperature",
        "1.0",
        "--samples",
        "2",
        "--pass-at",
        "1,2",
        "--json",
        "--set",
        "engine.max_new_tokens=4",
        "--set",
        "engine.num_kv_blocks=64",
    ]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    out = json.loads(result.output.strip().splitlines()[-1])
    assert out["pass_at_k"] == [1, 2] and out["samples_per_task"] == 2
    for per in (out["per_domain"]["math"], out["baseline_per_domain"]["math"]):
        assert set(per["pass_at"]) == {"1", "2"} and per["pass_at"]["1"]["n"] == per["n"] > 0
        assert per["pass_at"]["1"]["value"] == per["accuracy"]
        assert set(per["mean_components"]) == {"correct", "format"} and "mean_reward" in per
    # the same model on the same seeds: every paired difference is 0
    assert out["delta_pass_at"]["2"] == {
        "delta": 0.0,
        "ci_low": 0.0,
        "ci_high": 0.0,
        "n_tasks": out["per_domain"]["math"]["n"],
    }
    assert out["delta_per_domain"]["math"]["pass_at"]["1"]["delta"] == 0.0
    assert "pass@2" in result.output and "mean reward" in result.output


class _SmallSpace:
    """A domain of `size` distinct questions: draw i asks question (i * 7) % size (repeats from draw size on)."""

    splits = ("train", "heldout")

    def __init__(self, size: int) -> None:
        self.size = size

    def task(self, split: str, difficulty: int, index: int, seed: int = 0) -> Task:
        from posttrain.types import Message

        q = (index * 7 + seed) % self.size
        return Task(f"t{index}", "small", difficulty, [Message("user", f"question {q}")], split=split)


def test_heldout_tasks_are_distinct_questions_and_a_small_space_gives_fewer():
    from posttrain.curriculum import Arm
    from posttrain.orchestrator.eval.evaluate import HELDOUT_DRAWS_PER_TASK, heldout_tasks, task_key

    arms = [Arm("small", 0), Arm("big", 1)]
    domains = {"small": _SmallSpace(3), "big": _SmallSpace(1000)}
    got = heldout_tasks(domains, arms, 5, seed=0)
    small = [t for arm, _, t in got if arm.domain == "small"]
    big = [t for arm, _, t in got if arm.domain == "big"]
    # draws 0, 1, 2 ask questions 0, 1, 2; every later draw repeats one of them: 3 tasks, not 5
    assert [t.prompt[0].content for t in small] == ["question 0", "question 1", "question 2"]
    assert [t.id for t in big] == ["t0", "t1", "t2", "t3", "t4"]  # nothing repeats: the first 5 draws
    assert len({task_key(t) for t in big}) == 5
    # the same tasks for every model (same seed); the search stops after 8 draws per task asked
    assert [t.id for _, _, t in heldout_tasks(domains, arms, 5, seed=0)] == [t.id for _, _, t in got]
    assert HELDOUT_DRAWS_PER_TASK == 8
    calls = []
    space = _SmallSpace(2)
    space.task = lambda split, d, i, seed=0: calls.append(i) or _SmallSpace.task(space, split, d, i, seed)
    assert len(heldout_tasks({"small": space}, [Arm("small", 0)], 4, seed=0)) == 2
    assert calls == list(range(32))


def test_tasks_that_ask_one_prompt_of_different_hidden_state_stay_apart():
    from posttrain.orchestrator.eval.evaluate import task_key
    from posttrain.types import Message

    def task(content_key: str | None) -> Task:
        meta = {} if content_key is None else {"content_key": content_key}
        return Task("t", "tools", 0, [Message("user", "Set the price of SKU-1 to 4.")], meta=meta)

    # the generator's content key is the identity: same prompt, different hidden state, two tasks
    assert task_key(task("a")) != task_key(task("b")) and task_key(task("a")) == "a"
    # without one, the prompt and tools identify the task
    assert task_key(task(None)) == task_key(task(None)) != task_key(task("a"))


def test_cli_eval_names_the_episodes_our_engine_could_not_run():
    # every math prompt is longer than a 16-token context: each episode is an engine failure, left out of
    # the figures (n = 0) and counted, and the CLI says how many and why instead of printing a bare table;
    # with nothing scored it exits 1 (a CI gate must not pass), the JSON still the last line of stdout
    args = ["eval", "tiny:llama", "--baseline", "tiny:llama", "--suite", "math", "--n", "2", "--json"]
    over = ["--set", "engine.max_model_len=16", "--set", "engine.max_new_tokens=4"]
    result = CliRunner().invoke(app, [*args, *over])
    assert result.exit_code == 1, result.output
    out = json.loads(result.stdout.strip().splitlines()[-1])
    for per in (out["per_domain"]["math"], out["baseline_per_domain"]["math"]):
        assert (per["n"], per["infra_failures"]) == (0, 4)  # math levels 0 and 1, 2 tasks each
    text = " ".join(result.output.split())
    assert text.count("4 episode(s) failed at the infrastructure level in our engine on tiny:llama") == 2
    assert "math:heldout:d0:s0:0: engine_error" in text
    assert "engine_error: BadRequestError: prompt of" in text and "max_model_len is 16" in text
