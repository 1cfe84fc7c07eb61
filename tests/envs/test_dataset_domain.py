"""The `dataset` domain (your own rows + a reward function by Python path) and domain plugins
(`--plugin FILE.py`, the `posttrain.domains` entry point)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from posttrain.envs import get_domain
from posttrain.envs.base import HELDOUT, TRAIN
from posttrain.envs.domains.dataset import read_rows

ROOT = Path(__file__).resolve().parents[2]
POSTTRAIN = [sys.executable, "-m", "posttrain"]

REWARDS_PY = """
def exact(prompts, completions, answer, **columns):
    seen.append((prompts, completions, answer, sorted(columns)))
    return [1.0 if c.strip() == a else 0.25 for c, a in zip(completions, answer)]

def graded(prompts, completions, answer, **_):
    return [{"reward": 0.6, "success": completions[0].strip() == answer[0]}]

def too_big(prompts, completions, **_):
    return [1.5]

def broken(prompts, completions, **_):
    raise KeyError("no such column")

def penalty(prompts, completions, **_):
    return [-1.0]

def not_finite(prompts, completions, **_):
    return [float("nan")]

def chat(prompts, completions, **_):
    return [1.0 if prompts[0][-1]["role"] == "user" and completions[0][0]["role"] == "assistant" else 0.0]

seen = []
"""


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _play(domain, task, text: str):
    async def go():
        env = domain.make_env()
        await env.reset(task)
        return await env.step(text)

    return asyncio.run(go())


@pytest.fixture()
def rows() -> list[dict]:
    return [
        {
            "prompt": f"What is {i} + {i}?",
            "answer": str(2 * i),
            "split": "test" if i % 4 == 0 else "train",
            "level": i % 2,
        }
        for i in range(12)
    ]


def test_split_key_and_levels_are_read_from_the_rows(tmp_path, rows):
    d = get_domain(
        "dataset", path=str(_jsonl(tmp_path / "d.jsonl", rows)), split_key="split", difficulty_key="level"
    )
    assert d.difficulties == [0, 1]
    heldout0 = {d.task(HELDOUT, 0, i).meta["row_index"] for i in range(10)}
    train1 = {d.task(TRAIN, 1, i).meta["row_index"] for i in range(10)}
    assert heldout0 == {0, 4, 8}  # i % 4 == 0 rows are "test" and have level 0
    assert train1 == {1, 3, 5, 7, 9, 11}
    # the same arguments give the same task; another seed walks the rows in another order
    assert d.task(TRAIN, 1, 2, seed=0).meta["row_index"] == d.task(TRAIN, 1, 2, seed=0).meta["row_index"]
    orders = {tuple(d.task(TRAIN, 1, i, seed=s).meta["row_index"] for i in range(6)) for s in range(5)}
    assert len(orders) > 1


def test_hash_split_is_disjoint_and_covers_every_row(tmp_path):
    rows = [{"prompt": f"q{i}", "answer": str(i)} for i in range(200)]
    d = get_domain("dataset", path=str(_jsonl(tmp_path / "d.jsonl", rows)))
    train = {d.task(TRAIN, 0, i).meta["row_index"] for i in range(2000)}
    heldout = {d.task(HELDOUT, 0, i).meta["row_index"] for i in range(2000)}
    assert not train & heldout
    assert train | heldout == set(range(200))
    assert 20 <= len(heldout) <= 60  # 20% in expectation


def test_default_scorer_strict_success_and_format(tmp_path):
    d = get_domain(
        "dataset", path=str(_jsonl(tmp_path / "d.jsonl", [{"prompt": "2+5?", "answer": "7.0"}] * 30))
    )
    task = d.task(TRAIN, 0, 0)
    assert task.prompt[-1].content == "2+5?\nPut the final answer between <answer> and </answer>."
    tagged = _play(d, task, "so <answer>7</answer>")
    assert (tagged.reward, tagged.rewards) == (1.0, {"correct": 1.0, "format": 1.0, "success": 1.0})
    phrase = _play(d, task, "The answer is 7")
    assert phrase.reward == pytest.approx(0.85) and phrase.rewards["success"] == 1.0
    wrong = _play(d, task, "<answer>8</answer>")
    assert wrong.reward == pytest.approx(0.15) and wrong.rewards["success"] == 0.0
    garbage = _play(d, task, "\x00" * 50)
    assert garbage.reward == 0.0 and garbage.info["infra_failure"] is False


def test_reward_fn_from_a_file_with_trl_signature(tmp_path, rows):
    (tmp_path / "rewards.py").write_text(REWARDS_PY)
    path = str(_jsonl(tmp_path / "d.jsonl", rows))
    d = get_domain("dataset", path=path, split_key="split", reward_fn=f"{tmp_path}/rewards.py:exact")
    task = d.task(TRAIN, 0, 0)
    assert task.prompt[-1].content == task.meta["raw_prompt"]  # no instruction added for a user reward
    answer = task.meta["answer"]
    good, bad = _play(d, task, f" {answer} "), _play(d, task, "nope")
    assert (good.reward, good.rewards["success"]) == (1.0, 1.0)
    assert (bad.reward, bad.rewards["success"]) == (0.25, 0.0)
    seen = sys.modules[d.reward_fn.__module__].seen
    assert seen[0] == ([task.meta["raw_prompt"]], [f" {answer} "], [answer], ["level", "prompt", "split"])
    graded = get_domain("dataset", path=path, split_key="split", reward_fn=f"{tmp_path}/rewards.py:graded")
    res = _play(graded, task, answer)
    assert (res.reward, res.rewards["success"]) == (0.6, 1.0)


def test_any_finite_reward_is_a_score_and_success_stays_strict(tmp_path, rows):
    (tmp_path / "rewards.py").write_text(REWARDS_PY)
    path = str(_jsonl(tmp_path / "d.jsonl", rows))
    for fn, reward, success in (("penalty", -1.0, 0.0), ("too_big", 1.5, 1.0)):
        d = get_domain("dataset", path=path, reward_fn=f"{tmp_path}/rewards.py:{fn}")
        res = _play(d, d.task(TRAIN, 0, 0), "4")
        assert (res.reward, res.rewards, res.info["infra_failure"]) == (
            reward,
            {"reward": reward, "success": success},
            False,
        )
        assert "reward_fn_error" not in res.info


@pytest.mark.parametrize(
    ("fn", "message"),
    [
        ("broken", "KeyError: 'no such column'"),
        ("not_finite", "ValueError: reward function returned nan; expected a finite number"),
    ],
)
def test_a_failing_reward_fn_is_a_user_error_never_a_score_nor_infra(tmp_path, rows, fn, message):
    (tmp_path / "rewards.py").write_text(REWARDS_PY)
    path = str(_jsonl(tmp_path / "d.jsonl", rows))
    d = get_domain("dataset", path=path, reward_fn=f"{tmp_path}/rewards.py:{fn}")
    task = d.task(TRAIN, 0, 0)
    res = _play(d, task, "4")
    assert res.reward is None and res.info["infra_failure"] is False
    spec = f"{tmp_path}/rewards.py:{fn}"
    row = task.meta["row_index"]
    assert res.info["reward_fn_error"] == f"reward function {spec} failed on row {row} of {path}: {message}"


def test_conversational_prompts(tmp_path):
    (tmp_path / "rewards.py").write_text(REWARDS_PY)
    rows = [
        {"prompt": [{"role": "system", "content": "be brief"}, {"role": "user", "content": f"say {i}"}]}
        for i in range(20)
    ]
    d = get_domain(
        "dataset", path=str(_jsonl(tmp_path / "d.jsonl", rows)), reward_fn=f"{tmp_path}/rewards.py:chat"
    )
    task = d.task(TRAIN, 0, 0)
    assert [m.role for m in task.prompt] == ["system", "user"]
    assert _play(d, task, "3").reward == 1.0


def test_parquet_csv_and_json_read_the_same_rows(tmp_path, rows):
    import csv

    import pyarrow as pa
    import pyarrow.parquet as pq

    flat = [{k: str(v) for k, v in r.items()} for r in rows]
    pq.write_table(pa.Table.from_pylist(flat), tmp_path / "d.parquet")
    (tmp_path / "d.json").write_text(json.dumps(flat))
    with (tmp_path / "d.csv").open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(flat[0]))
        w.writeheader()
        w.writerows(flat)
    assert (
        read_rows(tmp_path / "d.parquet")
        == read_rows(tmp_path / "d.json")
        == read_rows(tmp_path / "d.csv")
        == flat
    )


@pytest.mark.parametrize(
    ("content", "options", "message"),
    [
        (None, {}, "no such file"),
        ('{"prompt": "a", "answer": "1"}\n{"prompt": oops}\n', {}, "d.jsonl:2 is not valid JSON"),
        ('{"question": "a", "answer": "1"}\n', {}, "has no 'prompt' column (columns: answer, question)"),
        ('{"prompt": "a"}\n', {}, "has no 'answer' column, which the default scorer needs"),
        ('{"prompt": "a", "answer": "1", "s": "later"}\n', {"split_key": "s"}, "'s' is 'later'; use 'train'"),
        (
            '{"prompt": "a", "answer": "1", "lv": "hard"}\n',
            {"difficulty_key": "lv"},
            "'lv' must be an integer level",
        ),
        (
            '{"prompt": [{"role": "robot", "content": "x"}], "answer": "1"}\n',
            {},
            "each prompt message needs a role",
        ),
        (
            '{"prompt": "a", "answer": "1"}\n',
            {"reward_fn": "nosuchmodule_xyz:f"},
            "cannot import module 'nosuchmodule_xyz'",
        ),
        (
            '{"prompt": "a", "answer": "1"}\n',
            {"reward_fn": "json:nosuchfn"},
            "'json' has no function 'nosuchfn'",
        ),
        ('{"prompt": "a", "answer": "1"}\n', {"reward_fn": "nocolon"}, "must be 'module:function'"),
    ],
)
def test_bad_data_and_options_get_errors_that_name_the_problem(tmp_path, content, options, message):
    path = tmp_path / "d.jsonl"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ValueError, match=None) as err:
        get_domain("dataset", path=str(path), **options)
    assert message in str(err.value)


def _cli(*args: str, cwd: Path = ROOT, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*POSTTRAIN, *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "COLUMNS": "200", **(env or {})},
    )


def test_cli_plugin_file_registers_a_domain_and_bad_plugin_is_a_usage_error(tmp_path):
    ok = _cli("--plugin", "examples/custom_domain.py", "tasks", "check", "reverse.words", "--n", "2")
    assert ok.returncode == 0, ok.stderr
    assert "reverse.words" in ok.stdout
    missing = _cli("--plugin", str(tmp_path / "nope.py"), "tasks", "list")
    assert missing.returncode == 2 and "plugin: no such file '" in missing.stderr
    (tmp_path / "bad.py").write_text("raise RuntimeError('boom')\n")
    bad = _cli("--plugin", str(tmp_path / "bad.py"), "tasks", "list")
    assert bad.returncode == 2 and "failed on import: RuntimeError: boom" in bad.stderr


def test_cli_samples_a_dataset_and_lists_it_as_needing_a_path(tmp_path, rows):
    path = _jsonl(tmp_path / "d.jsonl", rows)
    out = _cli(
        "tasks",
        "sample",
        "dataset",
        "--option",
        f"path={path}",
        "--option",
        "split_key=split",
        "--n",
        "2",
        "--json",
    )
    assert out.returncode == 0, out.stderr
    tasks = json.loads(out.stdout.strip().splitlines()[-1])
    assert [t["reference"] for t in tasks] == [
        [f"<answer>{t['task']['meta']['answer']}</answer>"] for t in tasks
    ]
    check = _cli(
        "tasks", "check", "dataset", "--option", f"path={path}", "--option", "split_key=split", "--n", "2"
    )
    assert check.returncode == 0, check.stdout + check.stderr
    listed = _cli("tasks", "list", "--json")
    row = next(r for r in json.loads(listed.stdout.strip().splitlines()[-1]) if r["domain"] == "dataset")
    assert row["required_options"] == ["path"]


def test_entry_point_domains_are_found_by_name(tmp_path):
    pkg = tmp_path / "site"
    (pkg / "mydomains").mkdir(parents=True)
    (pkg / "mydomains" / "__init__.py").write_text(
        (ROOT / "examples" / "custom_domain.py").read_text().replace("reverse.words", "ep.reverse")
    )
    dist = pkg / "mydomains-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: mydomains\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[posttrain.domains]\nep.reverse = mydomains\n")
    env = {"PYTHONPATH": f"{pkg}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    listed = _cli("tasks", "list", "--json", env=env)
    assert listed.returncode == 0, listed.stderr
    assert "ep.reverse" in [r["domain"] for r in json.loads(listed.stdout.strip().splitlines()[-1])]
    check = _cli("tasks", "check", "ep.reverse", "--n", "1", env=env)
    assert check.returncode == 0, check.stdout + check.stderr
