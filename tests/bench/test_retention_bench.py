"""`posttrain bench retention`: the issue's targets read from hand-made figures, usage errors before
any work, and (slow) an end-to-end run on a tiny model that prints one JSON object with both settings."""

from __future__ import annotations

import json
import re

import pytest

from posttrain.bench.retention import parse_suites, spec_arms, suites_yaml, targets
from posttrain.cli.bench import run_bench


def _d(delta: float, lo: float, hi: float) -> dict:
    return {"delta": delta, "ci_low": lo, "ci_high": hi, "n_tasks": 32}


def test_targets_by_hand():
    off = {
        "trained_gain": _d(0.20, 0.1, 0.3),
        "trained_gain_sampled_pass1": _d(0.30, 0.2, 0.4),
        "outside_delta": {},
        "trained_pass16_delta": _d(0, -1, 1),
    }
    on = {
        "trained_gain": _d(0.17, 0.07, 0.27),
        "trained_gain_sampled_pass1": _d(0.27, 0.2, 0.34),
        "outside_delta": {"math:3": _d(-0.10, -0.2, -0.01), "code.unit_tests:2": _d(-0.05, -0.1, 0.02)},
        "trained_pass16_delta": _d(-0.02, -0.09, 0.04),
    }
    t = targets(off, on, 16)
    # only math:3's interval is entirely below 0; 0.17 / 0.20 = 0.85 >= 0.8; pass@16's interval holds 0
    assert t["outside_fell"] == ["math:3"] and t["no_outside_fell"] is False
    assert t["gain_kept"] == pytest.approx(0.85) and t["gain_kept_sampled_pass1"] == pytest.approx(0.9)
    assert t["gain_kept_ok"] is True and t["pass16_not_fallen"] is True
    on["trained_gain_sampled_pass1"] = _d(
        0.21, 0.15, 0.27
    )  # 0.7 of the sampled gain: greedy's 0.85 is not enough
    t = targets(off, on, 16)
    assert t["gain_kept_sampled_pass1"] == pytest.approx(0.7) and t["gain_kept_ok"] is False
    on["trained_gain_sampled_pass1"] = _d(0.27, 0.2, 0.34)
    on["trained_gain"] = _d(0.15, 0.05, 0.25)
    on["trained_pass16_delta"] = _d(-0.1, -0.2, -0.01)
    t = targets(off, on, 16)
    assert t["gain_kept"] == pytest.approx(0.75) and not t["gain_kept_ok"] and not t["pass16_not_fallen"]
    off["trained_gain"] = _d(0.0, -0.1, 0.1)  # nothing to keep: no ratio, no claim
    assert targets(off, on, 16)["gain_kept"] is None and not targets(off, on, 16)["gain_kept_ok"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--retention", "math:1"], "--trained and --retention share \\['math:1'\\]"),
        (["--outside", "math:9"], "--outside: 'math' has no difficulty 9"),
        (
            ["--control", "curriculum.retention_every=1", "--control", "algorithm.kl_control=drift"],
            "kl_control='drift' needs curriculum.drift_every",
        ),
        (["--control", "curriculum.drift_every=1"], "retention_every is 0"),
        (["--outside", "math{datasets: [letter_counting]}:0"], "has options: give it a label"),
        (["--outside", "w=math{datasets: [letter_counting:0"], "options must be a YAML mapping"),
        (["--retention", "=math:2"], "is not of the form \\[label=\\]name"),
        (["--retention", "math:x"], "levels must be integers"),
        (
            [
                "--outside",
                "letters=math{datasets: [letter_counting]}:0;letters=math{datasets: [word_sorting]}:0",
            ],
            "'letters' is given twice",
        ),
    ],
)
def test_bad_options_exit_2_before_any_work(args, message, capsys):
    with pytest.raises(SystemExit) as exc:
        run_bench("retention", ["--quick", "--model", "tiny:llama", *args])
    assert exc.value.code == 2
    assert re.search(message, capsys.readouterr().err)


def test_suite_specs_carry_options_and_labels_into_the_config_and_the_arms():
    entries = parse_suites("math:2,3; letters=math{datasets: [letter_counting]}:0;instruct=code.humaneval:0")
    assert entries == [
        {"name": "math", "difficulties": [2, 3], "options": {}},
        {
            "name": "math",
            "difficulties": [0],
            "options": {"datasets": ["letter_counting"]},
            "label": "letters",
        },
        {"name": "code.humaneval", "difficulties": [0], "options": {}, "label": "instruct"},
    ]
    domains, arms = spec_arms("math:2;letters=math{datasets: [letter_counting]}:0")
    assert [a.key for a in arms] == ["math:2", "letters:0"]
    assert domains["letters"].task("heldout", 0, 0).meta["dataset"] == "letter_counting"
    # the control run's config holds the labelled family suite; math trains levels 0-1 of its curated set
    from posttrain.config import load_config

    cfg = load_config(
        None, [f"curriculum.retention=[{suites_yaml('letters=math{datasets: [letter_counting]}:0')}]"]
    )
    (suite,) = cfg.curriculum.retention
    assert (suite.name, suite.label, suite.difficulties) == ("math", "letters", [0])
    assert suite.options == {"datasets": ["letter_counting"]}


def test_reuse_needs_out_and_finished_runs_there(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        run_bench("retention", ["--quick", "--model", "tiny:llama", "--reuse"])
    assert exc.value.code == 2 and "--reuse scores the runs under --out DIR" in capsys.readouterr().err
    (tmp_path / "off-seed0" / "policy").mkdir(parents=True)  # a policy without its bench_run.json
    with pytest.raises(SystemExit) as exc:
        run_bench("retention", ["--quick", "--model", "tiny:llama", "--reuse", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and f"{tmp_path / 'off-seed0'} holds no finished run" in err


def test_reuse_off_needs_a_folder_with_the_finished_runs_without_control(tmp_path, capsys):
    args = ["--quick", "--model", "tiny:llama", "--out", str(tmp_path / "kl")]
    with pytest.raises(SystemExit) as exc:
        run_bench("retention", [*args, "--reuse-off", str(tmp_path / "missing")])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and f"--reuse-off: {tmp_path / 'missing'} is not a folder" in err
    (tmp_path / "off-seed0").mkdir()
    with pytest.raises(SystemExit) as exc:
        run_bench("retention", [*args, "--reuse-off", str(tmp_path)])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and f"--reuse-off: {tmp_path / 'off-seed0'} holds no finished run" in err
    assert "scoring" not in err  # refused before the base model is scored


@pytest.mark.slow
def test_a_tiny_run_prints_both_settings_and_reuse_scores_it_again(tmp_path, capsys):
    args = ["--quick", "--model", "tiny:llama", "--steps", "2", "--n-eval", "2", "--samples", "2", "--json"]
    out = run_bench("retention", [*args, "--out", str(tmp_path)])
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last == json.loads(json.dumps(out))
    for name in ("off", "on"):
        s = out["settings"][name]
        assert set(s["outside_delta"]) == {
            "math:3",
            "code.unit_tests:2",
            "instruct.constraints:0",
            "instruct.constraints:1",
            "letters:0",
            "spell:0",
            "legs:0",
        }
        assert set(s["retention_delta"]) == {"math:2", "code.unit_tests:1"}
        assert s["trained_gain"]["n_tasks"] == 6  # 3 trained arms x 2 tasks
    off, on = out["settings"]["off"]["runs"][0], out["settings"]["on"]["runs"][0]
    # the control run stops at the tokens the run without control generated
    assert on["generated_tokens"] >= off["generated_tokens"] and on["replay_fraction_end"] == 0.125
    assert off["replay_fraction_end"] is None and on["drift_kl_end"] is not None
    # --reuse scores the saved runs again, training nothing: the same figures
    again = run_bench("retention", [*args, "--out", str(tmp_path), "--reuse"])
    assert "training" not in capsys.readouterr().err
    assert again["settings"] == out["settings"] and again["targets"] == out["targets"]
    with pytest.raises(SystemExit) as exc:  # a saved run trained with another control is not pooled
        run_bench(
            "retention",
            [*args, "--out", str(tmp_path), "--reuse", "--control", "curriculum.retention_every=1"],
        )
    assert exc.value.code == 2 and "differs in" in capsys.readouterr().err
    # --reuse-off: the saved run without control, and only another control setting trained
    control = (
        "curriculum.retention_every=2",
        "curriculum.retention_size=2",
        "algorithm.replay_fraction=0.25",
    )
    other = [f"--control={c}" for c in control]
    kl = run_bench("retention", [*args, *other, "--reuse-off", str(tmp_path), "--out", str(tmp_path / "b")])
    err = capsys.readouterr().err
    assert "training on-seed0" in err and "training off-seed0" not in err
    assert kl["settings"]["off"] == out["settings"]["off"] and kl["config"]["off_from"] == str(tmp_path)
    assert kl["settings"]["on"]["runs"][0]["steps"] >= 1
    assert kl["settings"]["on"]["runs"][0]["replay_fraction_end"] == 0.25


def test_the_demo_recipe_is_the_default_config_plus_the_measured_control():
    from pathlib import Path

    from posttrain.bench.retention import CONTROL, RETENTION
    from posttrain.config import load_config

    configs = Path(__file__).parents[2] / "configs"
    measured = [f"curriculum.retention=[{suites_yaml(RETENTION)}]", *CONTROL]
    assert load_config(configs / "demo.yaml") == load_config(configs / "default.yaml", measured)
