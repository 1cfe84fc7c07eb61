"""The long-context domains: references score 1.0, prompts fill their level in tokens of the tokenizer,
generators are deterministic with disjoint splits, spraying candidates does not pay, hard needles share
no content word with their question, and the generated repository's answers are what running it gives."""

from __future__ import annotations

import json
import random
import re
import subprocess
import sys

import pytest

from envs.conftest import run
from posttrain.envs import get_domain
from posttrain.envs.domains import longctx_codebase as cb
from posttrain.envs.domains import longctx_common as lc
from posttrain.envs.domains import longctx_hard as hard
from posttrain.envs.domains import longctx_ruler as ruler
from posttrain.envs.tokens import count_tokens


async def _episode(domain, task, text):
    env = domain.make_env()
    await env.reset(task)
    return await env.step(text)


def _reply(domain, task, text):
    return run(_episode(domain, task, text))


@pytest.mark.parametrize("name", ruler.TASKS)
def test_every_ruler_task_fills_1k_tokens_and_its_reference_scores_1(name):
    d = get_domain("longctx.ruler", tasks=[name])
    task = d.task("train", 0, 0)
    prompt = task.prompt[0].content
    assert task.meta["task"] == name
    assert task.meta["n_tokens"] == count_tokens(prompt, "smollm2-135m")
    assert 1024 * 0.9 < task.meta["n_tokens"] <= 1024
    res = _reply(d, task, d.reference(task)[0])
    assert (res.reward, res.rewards["success"]) == (1.0, 1.0)
    for gold in task.meta["answers"]:
        assert gold in prompt or name in ("cwe", "fwe")  # aggregation answers are counted, not quoted once
    wrong = _reply(d, task, "<answer>nothing here</answer>")
    assert wrong.rewards["success"] == 0.0 and wrong.reward == pytest.approx(0.1)


def test_the_levels_are_lengths_in_tokens_up_to_32k():
    d = get_domain("longctx.ruler", tasks=["niah_single_2"])
    assert d.difficulties == [0, 1, 2, 3, 4, 5]
    t = d.task("heldout", 2, 0)
    assert 4096 * 0.97 < t.meta["n_tokens"] <= 4096 == t.meta["target_tokens"]


@pytest.mark.parametrize(
    "name, level", [("longctx.ruler", 0), ("longctx.hard", 10), ("longctx.hard", 20), ("longctx.codebase", 0)]
)
def test_generators_are_deterministic_and_splits_disjoint(name, level):
    d = get_domain(name)

    def dump(t):
        return json.dumps(t.to_dict(), sort_keys=True, default=str)

    assert dump(d.task("train", level, 3, seed=1)) == dump(d.task("train", level, 3, seed=1))
    assert dump(d.task("train", level, 3, seed=1)) != dump(d.task("train", level, 3, seed=2))
    keys = {s: {d.task(s, level, i).meta["content_key"] for i in range(12)} for s in ("train", "heldout")}
    assert not keys["train"] & keys["heldout"]
    assert len(keys["train"]) == len(keys["heldout"]) == 12


def test_spraying_every_candidate_of_the_context_does_not_pay():
    # a haystack made of distractor needles: answering with every 7-digit number in it
    d = get_domain("longctx.ruler", tasks=["niah_multikey_2"])
    task = d.task("train", 0, 1)
    numbers = sorted(set(re.findall(r"(?<!\d)\d{7}(?!\d)", task.prompt[0].content)))
    assert len(numbers) > 10
    sprayed = _reply(d, task, f"<answer>{', '.join(numbers)}</answer>")
    assert sprayed.rewards["recall"] == 1.0  # RULER's string_match_all alone would give full marks
    assert sprayed.rewards["precision"] == pytest.approx(1 / len(numbers))
    assert sprayed.rewards["success"] == 0.0 and sprayed.reward < 0.2
    # one gold and one wrong candidate: half the score
    gold = task.meta["answers"][0]
    other = next(n for n in numbers if n != gold)
    half = _reply(d, task, f"<answer>{gold}, {other}</answer>")
    assert half.rewards["score"] == pytest.approx(0.5)
    # digits glued into a longer number are not a candidate: no precision, no score
    glued = _reply(d, task, f"<answer>{gold}1</answer>")
    assert glued.rewards["score"] == 0.0
    # every word of a common-words list, every city of a QA task
    for name in ("cwe", "qa_2"):
        d = get_domain("longctx.ruler", tasks=[name])
        task = d.task("train", 0, 0)
        vocab = task.meta["candidate_vocab"]
        res = _reply(d, task, f"<answer>{', '.join(vocab)}</answer>")
        assert res.rewards["recall"] == 1.0
        assert res.rewards["precision"] == pytest.approx(len(task.meta["answers"]) / len(set(vocab)))
        assert res.reward < 0.5


def test_codebase_callers_by_set_f1_and_spraying_every_function_is_low():
    d = get_domain("longctx.codebase", kinds=["callers"])
    task = d.task("train", 0, 0)
    gold = task.meta["answers"]
    defs = _qualified_defs(task.prompt[0].content)  # every function of the repository
    assert set(gold) < set(defs)
    res = _reply(d, task, f"<answer>{', '.join(defs)}</answer>")
    p = len(gold) / len(defs)
    assert res.rewards["f1"] == pytest.approx(2 * p / (p + 1))
    assert p <= 5 / 14 and res.rewards["f1"] < 0.55
    half = _reply(d, task, f"<answer>{gold[0]}</answer>")
    assert half.rewards["f1"] == pytest.approx(2 * (1 / len(gold)) / (1 / len(gold) + 1))


def _qualified_defs(source: str) -> list[str]:
    out, module = [], ""
    for line in source.splitlines():
        if line.startswith("# file: "):
            module = line.removeprefix("# file: ").removesuffix(".py").replace("/", ".")
        elif line.startswith("def "):
            out.append(f"{module}.{line[4:].split('(')[0]}")
    return out


def _write_repo(repo: cb.Repo, root) -> None:
    for module, lines in repo.modules.items():
        path = root.joinpath(*module.split(".")).with_suffix(".py")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("\n".join(lines) + "\n")


def _python(root, code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_codebase_answers_are_what_running_the_repository_gives(tmp_path, seed):
    value = cb.make_case(random.Random(seed), "value")
    _write_repo(value["repo"], tmp_path / "v")
    out = _python(tmp_path / "v", "from app.main import main; print(main())")
    assert out.stdout.strip() == value["answers"][0]

    fix = cb.make_case(random.Random(seed), "fix")
    _write_repo(fix["repo"], tmp_path / "f")
    out = _python(tmp_path / "f", "from app.main import main; main()")
    assert out.stderr.strip().splitlines()[-1] == fix["traceback"].splitlines()[-1]
    # editing the answer's module (the bad value made positive) fixes the run
    holder = tmp_path.joinpath("f", *fix["answers"][0].split(".")).with_suffix(".py")
    holder.write_text(re.sub(r"= -(\d)$", r"= \1", holder.read_text(), flags=re.M))
    assert _python(tmp_path / "f", "from app.main import main; main()").returncode == 0

    callers = cb.make_case(random.Random(seed), "callers")
    _write_repo(callers["repo"], tmp_path / "c")
    target = re.search(r"call `([\w.]+)`", callers["question"]).group(1)
    probe = (
        "import importlib, sys\n"
        f"target = {target.rsplit('.', 1)[1]!r}; target_mod = {target.rsplit('.', 1)[0]!r}\n"
        f"funcs = {sorted(callers['repo'].calls)!r}\n"
        "hit = set()\n"
        "for q in funcs:\n"
        "    mod, name = q.rsplit('.', 1)\n"
        "    seen = []\n"
        "    def prof(frame, event, arg):\n"
        "        if event == 'call' and frame.f_code.co_name == target and frame.f_globals['__name__'] == target_mod:\n"
        "            seen.append(1)\n"
        "    sys.setprofile(prof)\n"
        "    getattr(importlib.import_module(mod), name)(0)\n"
        "    sys.setprofile(None)\n"
        "    if seen and q != target_mod + '.' + target:\n"
        "        hit.add(q)\n"
        "print(','.join(sorted(hit)))\n"
    )
    out = _python(tmp_path / "c", probe)
    assert out.stdout.strip().split(",") == callers["answers"], out.stderr


@pytest.mark.parametrize("hardness", hard.HARDNESS)
def test_hard_needles_share_no_content_word_with_the_question(hardness):
    for seed in range(20):
        case = hard.make_case(random.Random(seed), hardness, 0.5)
        question = hard.content_words(case["question"])
        for needle in case["needles"]:
            assert not question & hard.content_words(needle), (case["question"], needle)
        assert case["answer"] not in case["question"]
        if hardness >= 1:  # near-duplicates of the needle and literal traps naming the asked city
            assert sum(s.startswith("Actually, ") for s in case["distractors"]) == 6
            assert sum(case["city"] in s for s in case["distractors"]) == 2


def test_hard_depths_are_controlled_and_references_score_1():
    d = get_domain("longctx.hard", depths=[0.0, 1.0])
    assert d.difficulties == [0, 1, 2, 3, 4, 5, 10, 11, 12, 13, 14, 15, 20, 21, 22, 23, 24, 25]
    for level in (0, 10, 20):
        task = d.task("train", level, 0)
        assert task.meta["depth"] in (0.0, 1.0)
        prompt = task.prompt[0].content
        first = task.meta["needles"][0]
        pos = prompt.index(first) / len(prompt)
        assert pos < 0.1 if task.meta["depth"] == 0.0 else pos > 0.85
        assert _reply(d, task, d.reference(task)[0]).reward == 1.0
    with pytest.raises(ValueError, match="depths must be fractions"):
        get_domain("longctx.hard", depths=[1.5])


def test_unknown_options_are_refused_by_name():
    with pytest.raises(ValueError, match="unknown tasks \\['niah_single_9'\\]"):
        get_domain("longctx.ruler", tasks=["niah_single_9"])
    with pytest.raises(ValueError, match="unknown tasks \\['poetry'\\]"):
        get_domain("longctx.codebase", kinds=["poetry"])


def test_hostile_replies_score_below_1_without_raising():
    for name in ("longctx.ruler", "longctx.hard", "longctx.codebase"):
        d = get_domain(name)
        task = d.task("train", d.difficulties[0], 0)
        for text in ("", "\x00\xff" * 50, "<answer></answer>", "z" * 300_000, "<answer>" * 1000):
            res = _reply(d, task, text)
            assert res.rewards["success"] == 0.0 and res.reward <= 0.1
    assert lc.answer_text("a <answer>x</answer> b <answer>y</answer>") == ("y", True)
