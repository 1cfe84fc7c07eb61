"""The contract every domain keeps: deterministic generators, disjoint splits, reference solutions
scoring 1.0 with a strict `success` of 1.0, and wrong, empty, malformed or hostile outputs scoring below
1 with `success` 0.0, without raising."""

from __future__ import annotations

import json

import pytest

from posttrain.envs import get_domain, run_episode
from posttrain.envs.base import split_of

from .conftest import run

CPU = ["math", "tools.apis", "scene.layout", "instruct.constraints"]
SANDBOXED = ["code.unit_tests", "swe.ci_fix"]
HOSTILE = [
    "",
    "I don't know.",
    "\x00\xff\ufffd" * 50,
    "<tool_call>",
    "<tool_call>" + "[" * 50_000 + "</tool_call>",
    '<tool_call>[{"name": "' + "x" * 20_000 + '", "arguments": {}}]</tool_call>',
    "<answer></answer>",
    "```python\nimport os\nos.system('rm -rf /')\n```",
    "```python\nwhile True:\n    pass\n```",
    "z" * 300_000,
]


def _dump(task) -> str:
    return json.dumps(task.to_dict(), sort_keys=True, default=str)


def _clear_caches():
    from posttrain.envs.domains import swe_ci_fix

    swe_ci_fix._verified_bug.cache_clear()


@pytest.mark.parametrize("name", CPU + SANDBOXED)
def test_generators_are_deterministic_and_seeded(name):
    d = get_domain(name)
    for level in d.difficulties:
        first = _dump(d.task("train", level, 1, seed=3))
        _clear_caches()
        assert _dump(d.task("train", level, 1, seed=3)) == first
    assert _dump(d.task("train", 0, 0, seed=0)) != _dump(d.task("train", 0, 0, seed=1))
    assert _dump(d.task("train", 0, 0)) != _dump(d.task("train", 0, 1))


@pytest.mark.parametrize(
    "name, n",
    [
        ("math", 40),
        ("tools.apis", 40),
        ("scene.layout", 40),
        ("instruct.constraints", 40),
        ("code.unit_tests", 40),
        ("swe.ci_fix", 6),
    ],
)
def test_train_and_heldout_never_overlap(name, n):
    d = get_domain(name)
    for level in d.difficulties[:2]:
        keys = {}
        for split in ("train", "heldout"):
            tasks = [d.task(split, level, i) for i in range(n)]
            assert all(t.split == split and split_of(t.meta["content_key"]) == split for t in tasks)
            keys[split] = {t.meta["content_key"] for t in tasks}
        assert keys["train"] and keys["heldout"] and not keys["train"] & keys["heldout"]


@pytest.mark.parametrize("name", CPU)
def test_reference_solutions_score_one(name):
    d = get_domain(name)
    for level in d.difficulties:
        for split in d.splits:
            for i in range(3):
                task = d.task(split, level, i)
                res = run(run_episode(d.make_env(None), task, d.reference(task)))
                assert res.done and res.reward == 1.0, (task.id, res.rewards, res.info)
                assert res.rewards["success"] == 1.0, (task.id, res.rewards)


@pytest.mark.parametrize("name", [*SANDBOXED, "code.humaneval"])
def test_sandboxed_reference_solutions_score_one(name, sandbox):
    d = get_domain(name)
    for level in d.difficulties:
        for split in d.splits:
            task = d.task(split, level, 0)
            res = run(run_episode(d.make_env(sandbox), task, d.reference(task)))
            assert res.done and res.reward == 1.0, (task.id, res.rewards, res.info)
            assert res.rewards["success"] == 1.0, (task.id, res.rewards)


@pytest.mark.parametrize("name", CPU + SANDBOXED)
def test_wrong_empty_malformed_hostile_outputs_score_below_one(name, request):
    d = get_domain(name)
    sandbox = request.getfixturevalue("sandbox") if name in SANDBOXED else None
    task = d.task("train", 0, 2)
    texts = HOSTILE if name != "swe.ci_fix" else HOSTILE[:4] + HOSTILE[-1:]
    for text in texts:
        res = run(run_episode(d.make_env(sandbox), task, [text]))
        assert res.done and res.reward is not None and 0.0 <= res.reward < 1.0, (
            text[:40],
            res.rewards,
            res.info,
        )
        assert res.rewards["success"] == 0.0 and res.info["infra_failure"] is False
