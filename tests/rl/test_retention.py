"""Retention suites: domains and levels outside the training mix, scored against the initial policy's
scores of the same held-out tasks (stored with the run), paired deltas with intervals; config errors."""

from __future__ import annotations

import json

import pytest

from posttrain.orchestrator.rl import RLRun
from posttrain.orchestrator.rl.retention import RetentionSuites
from posttrain.telemetry import read_metrics

from .test_loop import _cfg, _run

RETAIN = ["curriculum.retention=[{name: math, difficulties: [1]}]", "curriculum.retention_size=3"]


def _letters(label: str | None = None) -> str:
    """A retention entry of math's letter_counting family at level 0 (math trains curated families)."""
    tail = "" if label is None else f", label: {label}"
    return f"{{name: math, difficulties: [0], options: {{datasets: [letter_counting]}}{tail}}}"


def test_metrics_pair_tasks_and_leave_infra_failures_out():
    suites = RetentionSuites.__new__(RetentionSuites)
    suites.seed, suites.base = 0, {"math:1": [1.0, 0.0, None]}
    out = suites.metrics({"math:1": [1.0, 1.0, 0.0]})
    assert out["retention/math:1"] == pytest.approx(2 / 3)
    assert out["retention_delta/math:1"] == 0.5  # tasks 0 and 1 only: (0 + 1) / 2
    assert out["retention_delta/math:1_lo"] == 0.0 and out["retention_delta/math:1_hi"] == 1.0


def test_a_run_scores_its_suites_against_the_stored_base_and_a_resume_reuses_it(tmp_path, monkeypatch):
    calls = []
    real = RetentionSuites.score
    monkeypatch.setattr(RetentionSuites, "score", lambda self, *a: calls.append(1) or real(self, *a))
    first = _run(_cfg(tmp_path, "orchestrator.steps=2", "curriculum.retention_every=1", *RETAIN), "r")
    first.close()
    assert len(calls) == 3  # the base, then after steps 1 and 2
    base = json.loads((first.run_dir.path / "retention_base.json").read_text())
    ident = base["ident"]
    assert {k: ident[k] for k in ("suites", "size", "seed")} == {"suites": ["math:1"], "size": 3, "seed": 0}
    assert len(ident["tasks"]) == 64 and len(base["scores"]["math:1"]) == 3  # a hash of the tasks scored
    rows = read_metrics(first.run_dir.metrics)
    # the tiny random policy does not move (equal rewards, zero advantages): the same greedy answers
    assert [r["retention_delta/math:1"] for r in rows] == [0.0, 0.0]
    assert rows[0]["retention/math:1"] == pytest.approx(sum(base["scores"]["math:1"]) / 3)
    resumed = _run(
        _cfg(tmp_path, "orchestrator.steps=3", "curriculum.retention_every=1", *RETAIN), "r", resume=True
    )
    assert len(calls) == 4  # step 3 only: the base came from the run directory
    assert [r["step"] for r in read_metrics(resumed.run_dir.metrics)] == [1, 2, 3]
    resumed.close()


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            ["curriculum.retention=[{name: math, difficulties: [0]}]", "curriculum.retention_every=1"],
            "math:0 is in the training mix",
        ),
        (
            ["curriculum.retention=[{name: math, difficulties: [9]}]", "curriculum.retention_every=1"],
            "'math' has no difficulty 9",
        ),
        (["curriculum.retention=[{name: math, difficulties: [1]}]"], "retention_every is 0"),
        (
            [*RETAIN, "curriculum.retention_every=1", "orchestrator.mode=async"],
            "needs orchestrator.mode=sync",
        ),
        (  # math trains the curated families: a family suite under math's name would read as math's
            [f"curriculum.retention=[{_letters()}]", "curriculum.retention_every=1"],
            "'math' is trained with other options .* give this suite a label",
        ),
        (
            [f"curriculum.retention=[{_letters('code.unit_tests')}]", "curriculum.retention_every=1"],
            "'code.unit_tests': the label is a domain's name",
        ),
        (
            [
                "curriculum.retention=[{name: math, difficulties: [1]}, {name: math, difficulties: [2]}]",
                "curriculum.retention_every=1",
            ],
            "'math' is listed twice: give each entry its own label",
        ),
        (
            ["curriculum.retention=[" + _letters("'a:b'") + "]", "curriculum.retention_every=1"],
            "label 'a:b' must be a non-empty name without ':'",
        ),
    ],
)
def test_bad_retention_config_fails_before_work(tmp_path, extra, message):
    with pytest.raises(ValueError, match=message):
        RLRun.check(_cfg(tmp_path, *extra))


def test_a_labelled_suite_holds_a_family_of_a_trained_domain_at_a_trained_level(tmp_path):
    from posttrain.curriculum import Arm, make_sampler
    from posttrain.envs.domains.math import CURATED

    cfg = _cfg(
        tmp_path,
        f"curriculum.retention=[{_letters('letters')}, {{name: math, difficulties: [1]}}]",
        "curriculum.retention_every=1",
        "curriculum.retention_size=4",
    )
    suites = RetentionSuites.from_config(cfg)
    assert suites.arms == [Arm("letters", 0), Arm("math", 1)]
    datasets = [(arm.key, task.meta["dataset"]) for arm, _, task in suites.tasks]
    assert datasets[:4] == [("letters:0", "letter_counting")] * 4
    curated_1 = {name for name, _ in CURATED[1]}
    assert {k for k, _ in datasets[4:]} == {"math:1"} and {d for _, d in datasets[4:]} <= curated_1
    # the same options at a trained level is the trained arm itself, labelled or not
    same = "{name: math, difficulties: [0], label: again}"
    with pytest.raises(ValueError, match="math:0 is in the training mix"):
        RetentionSuites.check_config(
            _cfg(tmp_path, f"curriculum.retention=[{same}]", "curriculum.retention_every=1")
        )
    # in the curriculum a labelled family is no level of math: it moves the replay rate, not math's share
    sampler = make_sampler(cfg.curriculum, [Arm("math", 0), Arm("tools.apis", 0)], seed=0)
    before = sampler.weights()
    sampler.record_retention("letters:0", -0.5, 0.1)
    assert sampler.weights() == before and sampler.replay_fraction(0.1, 1.0) == pytest.approx(0.5)


def test_a_suite_that_falls_past_retention_stop_stops_the_run_and_keeps_the_checkpoint_before(
    tmp_path, monkeypatch
):
    from posttrain.orchestrator.checkpoint import checkpoint_step
    from posttrain.telemetry import RunDir

    planted = iter([[1.0, 1.0, 1.0]] * 3 + [[0.0, 0.0, 0.0]])  # base, steps 1 and 2 hold; step 3 falls
    monkeypatch.setattr(RetentionSuites, "score", lambda self, *a: ({"math:1": next(planted)}, 0.0))
    cfg = _cfg(
        tmp_path,
        "orchestrator.steps=5",
        "curriculum.retention_every=1",
        "curriculum.retention_stop=0.5",
        *RETAIN,
    )
    rl = RLRun(cfg, RunDir.create(cfg.telemetry.run_dir, "stop"))
    summary = rl.train()
    assert summary["step"] == 3 and summary["stopped"].startswith("retention suite math:1 fell by 1.000")
    assert "past curriculum.retention_stop=0.5" in summary["stopped"]
    best = rl.run_dir.checkpoints / "best"
    assert best.is_dir() and json.loads((best / "run_state.json").read_text())["step"] == 2
    assert checkpoint_step(sorted(p for p in rl.run_dir.checkpoints.glob("step-*"))[-1]) == 3  # resumable
    rl.close()


def test_a_config_saved_with_suites_as_domain_entries_still_loads_and_a_real_weight_is_refused():
    from posttrain.config import ConfigError, load_config

    old = load_config(None, ["curriculum.retention=[{name: math, difficulties: [1], weight: 1.0}]"])
    assert old.curriculum.retention[0].model_dump() == {
        "name": "math",
        "difficulties": [1],
        "options": {},
        "label": None,
    }
    with pytest.raises(ConfigError, match="a retention suite has no weight"):
        load_config(None, ["curriculum.retention=[{name: math, difficulties: [1], weight: 2.0}]"])


def test_the_default_set_leaves_out_what_the_run_trains():
    from posttrain.config import DEFAULT_RETENTION, load_config

    def suites(*extra: str) -> list[tuple[str, list[int]]]:
        cfg = load_config(None, ["curriculum.retention=default", *extra])
        return [(s.label or s.name, s.difficulties) for s in cfg.curriculum.retention]

    # the default mix is math 0-1 and code.unit_tests 0: nothing of the set is trained
    assert suites() == [(s.label or s.name, s.difficulties) for s in DEFAULT_RETENTION]
    assert suites() == [
        ("instruct.constraints", [0]),
        ("letters", [0]),
        ("math", [2]),
        ("code.unit_tests", [1]),
    ]
    # trained levels drop out; math trained with other options drops the unlabelled math:2, not the family
    mix = "envs.domains=[{name: math, difficulties: [0, 1, 2]}, {name: instruct.constraints, difficulties: [0]}]"
    assert suites(mix) == [("letters", [0]), ("code.unit_tests", [1])]
    assert suites("envs.domains=[{name: math, options: {datasets: [gcd]}}]") == [
        ("instruct.constraints", [0]),
        ("letters", [0]),
        ("code.unit_tests", [1]),
    ]
    family = "{name: math, options: {datasets: {letter_counting: {min_words: 6, max_words: 10}}}}"
    assert ("letters", [0]) not in suites(f"envs.domains=[{family}]")  # the family itself is trained
    # the resolved set passes the run's own checks
    RetentionSuites.check_config(
        load_config(None, ["curriculum.retention=default", "curriculum.retention_every=5"])
    )
