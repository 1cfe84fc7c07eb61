"""The contract every registered domain keeps: deterministic generators, disjoint splits, reference
solutions scoring 1.0 with a strict `success` of 1.0, and wrong, empty, malformed or hostile outputs
scoring below 1 with `success` 0.0, without raising. Runs over `list_domains()`: a new built-in or
entry-point domain is checked without being named here (one that needs options gets them in OPTIONS)."""

from __future__ import annotations

import json

import pytest

from posttrain.envs import get_domain, list_domains, run_episode
from posttrain.envs.base import split_of
from posttrain.envs.registry import domain_class

from .conftest import run

DOMAINS = list_domains()
SANDBOXED = [n for n in DOMAINS if domain_class(n).requires_sandbox]
TWO_SPLITS = [n for n in DOMAINS if set(domain_class(n).splits) == {"train", "heldout"}]
# tasks drawn per split and level for the overlap check: swe.ci_fix verifies each bug in the sandbox
SPLIT_SAMPLES = {"swe.ci_fix": 6}
# reference episodes per split and level: one where a task is a long document (up to seconds to build at
# the top levels; longctx.hard has 18 levels), so every level is still played
REFERENCE_SAMPLES = {"longctx.hard": 1, "longctx.ruler": 1, "longctx.codebase": 1, "docs.financial": 1}
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
DATASET_ROWS = 60


@pytest.fixture(scope="module")
def options(tmp_path_factory) -> dict[str, dict]:
    """Options of the domains that cannot be built without them (`required_options`)."""
    path = tmp_path_factory.mktemp("contract") / "rows.jsonl"
    path.write_text(
        "".join(
            json.dumps({"prompt": f"What is {i} + {i}?", "answer": str(2 * i)}) + "\n"
            for i in range(DATASET_ROWS)
        )
    )
    return {"dataset": {"path": str(path)}}


def _domain(name: str, options: dict[str, dict]):
    required = domain_class(name).required_options
    assert not required or name in options, (
        f"{name} needs options {required}: add them to the options fixture"
    )
    return get_domain(name, **options.get(name, {}))


def _dump(task) -> str:
    return json.dumps(task.to_dict(), sort_keys=True, default=str)


def _clear_caches():
    from posttrain.envs.domains import swe_ci_fix

    swe_ci_fix._verified_bug.cache_clear()


def test_every_built_in_domain_is_checked():
    assert len(DOMAINS) >= 17 and {"math", "dataset", "code.humaneval", "cad.modeling"} <= set(DOMAINS)
    assert set(SANDBOXED) == {"code.unit_tests", "code.humaneval", "swe.ci_fix", "cad.modeling"}
    assert set(DOMAINS) - set(TWO_SPLITS) == {"code.humaneval"}  # evaluation only: one split, "eval"


@pytest.mark.parametrize("name", DOMAINS)
def test_generators_are_deterministic_and_seeded(name, options):
    d = _domain(name, options)
    split = d.splits[0]
    for level in d.difficulties:
        first = _dump(d.task(split, level, 1, seed=3))
        _clear_caches()
        assert _dump(d.task(split, level, 1, seed=3)) == first
    assert _dump(d.task(split, 0, 0, seed=0)) != _dump(d.task(split, 0, 0, seed=1))
    assert _dump(d.task(split, 0, 0)) != _dump(d.task(split, 0, 1))


@pytest.mark.parametrize("name", TWO_SPLITS)
def test_train_and_heldout_never_overlap(name, options):
    d = _domain(name, options)
    n = SPLIT_SAMPLES.get(name, 40)
    for level in d.difficulties[:2]:
        keys = {}
        for split in ("train", "heldout"):
            tasks = [d.task(split, level, i) for i in range(n)]
            assert all(t.split == split and split_of(t.meta["content_key"]) == split for t in tasks)
            keys[split] = {t.meta["content_key"] for t in tasks}
        assert keys["train"] and keys["heldout"] and not keys["train"] & keys["heldout"]


@pytest.mark.parametrize("name", [n for n in DOMAINS if n not in SANDBOXED])
def test_reference_solutions_score_one(name, options):
    d = _domain(name, options)
    for level in d.difficulties:
        for split in d.splits:
            for i in range(REFERENCE_SAMPLES.get(name, 3)):
                task = d.task(split, level, i)
                res = run(run_episode(d.make_env(None), task, d.reference(task)))
                assert res.done and res.reward == 1.0, (task.id, res.rewards, res.info)
                assert res.rewards["success"] == 1.0, (task.id, res.rewards)


@pytest.mark.parametrize("name", SANDBOXED)
def test_sandboxed_reference_solutions_score_one(name, sandbox):
    d = get_domain(name)
    for level in d.difficulties:
        for split in d.splits:
            task = d.task(split, level, 0)
            res = run(run_episode(d.make_env(sandbox), task, d.reference(task)))
            assert res.done and res.reward == 1.0, (task.id, res.rewards, res.info)
            assert res.rewards["success"] == 1.0, (task.id, res.rewards)


@pytest.mark.parametrize("name", DOMAINS)
def test_wrong_empty_malformed_hostile_outputs_score_below_one(name, options, request):
    d = _domain(name, options)
    sandbox = request.getfixturevalue("sandbox") if name in SANDBOXED else None
    task = d.task(d.splits[0], 0, 2)
    texts = HOSTILE if name != "swe.ci_fix" else HOSTILE[:4] + HOSTILE[-1:]
    for text in texts:
        res = run(run_episode(d.make_env(sandbox), task, [text]))
        assert res.done and res.reward is not None and 0.0 <= res.reward < 1.0, (
            text[:40],
            res.rewards,
            res.info,
        )
        assert res.rewards["success"] == 0.0 and res.info["infra_failure"] is False
