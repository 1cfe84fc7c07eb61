"""`bench curriculum --real --layout many`: its 25 arms, their held-out tasks, and a tiny run's report."""

import json
from types import SimpleNamespace

import pytest

from posttrain.bench.curriculum_real import (
    MANY_MATH_LEVELS,
    domain_entries,
    layout_arms,
    macro_accuracy,
    run_overrides,
)
from posttrain.cli.bench import run_bench
from posttrain.config import load_config
from posttrain.envs import get_domain


def main(args: list[str]) -> dict:
    return run_bench("curriculum", args)


def test_many_layout_has_25_distinct_arms_with_disjoint_heldout_tasks():
    ns = SimpleNamespace(
        layout="many", domains=None, model="tiny:llama", quick=True, overrides=[], run_overrides=[]
    )
    sizes = dict.fromkeys(
        ["steps", "prompts_per_step", "samples_per_prompt", "max_new_tokens", "probe_every", "probe_size"], 1
    )
    cfg = load_config(None, run_overrides(ns, sizes))  # the entries pass the config's checks
    arms = [f"{d.name}:{lvl}" for d in cfg.envs.domains for lvl in d.difficulties]
    assert len(arms) == len(set(arms)) == len(MANY_MATH_LEVELS) + 3 + 4 == 25
    assert list(layout_arms("many")) == arms
    heldout: dict[str, set[str]] = {}  # arm -> content keys of its first held-out tasks
    train: set[str] = set()
    for d in cfg.envs.domains:
        domain = get_domain(d.name, **d.options)
        assert domain.difficulties == d.difficulties
        for lvl in d.difficulties:
            tasks = [domain.task("heldout", lvl, i) for i in range(4)]
            heldout[f"{d.name}:{lvl}"] = {t.meta["content_key"] for t in tasks}
            train |= {domain.task("train", lvl, i).meta["content_key"] for i in range(4)}
            if d.name == "math":
                ((family, _),) = MANY_MATH_LEVELS[lvl][1].items()
                assert {t.meta["dataset"] for t in tasks} == {family}
    for a in arms:
        others = set().union(*(heldout[b] for b in arms if b != a))
        assert not heldout[a] & others, f"{a} shares a held-out task with another arm"
    assert not train & set().union(*heldout.values())  # no held-out task is a training task of any arm
    assert {role for role, _ in MANY_MATH_LEVELS} == {"often", "sometimes", "never"}


def test_macro_accuracy_weighs_every_arm_the_same():
    m = macro_accuracy({"a": [1.0, 1.0, 1.0, 1.0], "b": [0.0, None], "c": []}, seed=0)
    assert m["accuracy"] == 0.5 and m["arms"] == 2  # (1 + 0) / 2; the empty arm and the None are left out
    assert m["ci_low"] == m["ci_high"] == 0.5  # no spread within either arm
    m = macro_accuracy({"a": [1.0, 0.0], "b": [1.0]}, seed=0)
    assert m["accuracy"] == 0.75 and 0.5 <= m["ci_low"] <= 0.75 <= m["ci_high"] <= 1.0


def test_bad_layouts_are_usage_errors(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--real", "--quick", "--model", "tiny:llama", "--layout", "manyy"])
    assert exc.value.code == 2
    assert "--real --layout: unknown layout 'manyy' (valid: default, many)" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["--real", "--quick", "--model", "tiny:llama", "--layout", "many", "--domains", "math:0"])
    assert exc.value.code == 2
    assert "--domains and --layout many both choose the arms" in capsys.readouterr().err
    with pytest.raises(ValueError, match="unknown layout 'x'"):
        domain_entries("x", "math:0")


def test_many_layout_tiny_run_reports_per_arm_zero_advantage_and_retention(tmp_path):
    out = main(
        [
            "--real",
            "--quick",
            "--layout",
            "many",
            "--model",
            "tiny:llama",
            *["--steps", "1", "--prompts-per-step", "2", "--samples-per-prompt", "2", "--n-eval", "1"],
            *["--max-new-tokens", "4", "--probe-every", "0", "--probe-size", "1", "--out", str(tmp_path)],
            *["--run-set", "curriculum.retention=[{name: scene.layout, difficulties: [0]}]"],
            *["--run-set", "curriculum.retention_every=1", "--run-set", "curriculum.retention_size=1"],
        ]
    )
    arms = list(layout_arms("many"))
    assert out["layout"] == "many" and out["domains"] == "layout many" and list(out["arms"]) == arms
    assert set(out["base"]) == {*arms, "all", "macro"} and out["base"]["macro"]["arms"] == 25
    for sampler in ("uniform_by_domain", "adaptive"):
        per_arm = out["per_domain"][sampler]
        assert set(per_arm) == {*arms, "all"} and all(per_arm[a]["n"] == 1 for a in arms)
        assert out["macro"][sampler]["arms"] == 25
        assert out["macro"][sampler]["accuracy"] == pytest.approx(
            sum(per_arm[a]["accuracy"] for a in arms) / 25
        )
        (row,) = out["per_seed"][sampler]
        z = out["zero_advantage_tokens"][sampler]
        assert z["tokens"] == row["zero_advantage_tokens"] <= row["generated_tokens"]
        assert z["share"] == pytest.approx(z["tokens"] / row["generated_tokens"])
        assert (
            "retention/scene.layout:0" in row["retention"]
            and "retention_delta/scene.layout:0" in row["retention"]
        )
    assert json.loads((tmp_path / "result.json").read_text()) == json.loads(json.dumps(out))
    again = main(["--pool", str(tmp_path)])
    assert again["layout"] == "many" and again["macro"] == out["macro"]
    # --reuse-uniform takes the saved layout: the adaptive run repeats on the same 25 arms and tasks
    same = main(["--real", "--reuse-uniform", str(tmp_path), "--out", str(tmp_path / "same")])
    assert same["layout"] == "many" and same["per_domain"] == out["per_domain"]
    assert same["zero_advantage_tokens"] == out["zero_advantage_tokens"]
