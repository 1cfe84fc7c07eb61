"""`longctx.codebase`: a generated multi-module Python repository rendered into the context, and questions
that need its imports and call graph followed across files.

The repository has packages and modules with realistic names, functions that import and call each other
(an acyclic call graph), settings overridden along a chain of star imports, and a checks module; filler
modules (their own call graph, unrelated to the questions) are added until the prompt reaches the level's
length. Questions: `callers` (every function that calls a target directly or transitively; set F1 of
qualified names), `value` (the value a setting has at runtime where the app imports it: the last override
along its import chain, with a module off the chain and a shadowing local as traps; exact match) and
`fix` (a traceback ends in a check that rejects a setting; which module must change: the one defining the
bad value, which is in no frame; exact match). Levels 0-5 = 1k-32k tokens.

Reward = 0.9 * score + 0.1 * format; `success` = score 1.
"""

from __future__ import annotations

import random
import re
from typing import Any

from posttrain.envs.domains import longctx_common as lc
from posttrain.envs.registry import register_env
from posttrain.types import Task

KINDS = ("callers", "value", "fix")
PACKAGES = "billing accounts inventory shipping reports auth notify search storage scheduler".split()
MODULES = "core models service utils api tasks rules cache".split()
VERBS = "load compute apply build render sync fetch update validate resolve merge export".split()
QUALIFIERS = "pending daily remote cached primary partial legacy bulk signed local nightly draft".split()
NOUNS = "invoice ledger rate order customer report token batch quota address refund cart".split()
SETTINGS_PACKAGES = "config conf settings".split()
SETTINGS_MODULES = "defaults base common site prod local overrides deploy".split()
SETTINGS = "TIMEOUT_S RETRY_LIMIT BATCH_SIZE MAX_WORKERS CACHE_TTL_S PAGE_SIZE".split()
QUALIFIED = re.compile(r"[a-z_]+\.[a-z_]+\.[a-z_]+")


class Repo:
    """Modules (dotted name -> list of source lines) and functions (qualified name -> callees)."""

    def __init__(self) -> None:
        self.modules: dict[str, list[str]] = {}
        self.calls: dict[str, list[str]] = {}

    def add_graph(self, rng: random.Random, modules: list[str], n_funcs: int) -> list[str]:
        """Functions spread over `modules`, each calling up to two defined before it in its own module or an
        earlier one of `modules` (so the calls and the imports are acyclic)."""
        funcs: list[str] = []
        used: set[str] = set(self.calls)
        while len(funcs) < n_funcs:
            middle = f"{rng.choice(QUALIFIERS)}_" if rng.random() < 0.5 else ""
            name = f"{rng.choice(VERBS)}_{middle}{rng.choice(NOUNS)}"
            home = rng.randrange(len(modules))
            qual = f"{modules[home]}.{name}"
            if qual in used or any(q.rsplit(".", 1)[1] == name for q in funcs):
                continue  # unique bare names keep the imports unambiguous
            used.add(qual)
            # callees from this module or earlier ones: the imports between modules form no cycle
            allowed = [f for f in funcs if modules.index(f.rsplit(".", 1)[0]) <= home]
            callees = rng.sample(allowed, min(len(allowed), rng.choice((0, 1, 1, 2))))
            self.calls[qual] = callees
            funcs.append(qual)
        for qual in funcs:
            self._emit_function(qual)
        return funcs

    def _emit_function(self, qual: str) -> None:
        module, name = qual.rsplit(".", 1)
        lines = self.modules.setdefault(module, [])
        for callee in self.calls[qual]:
            cmod, cname = callee.rsplit(".", 1)
            if cmod != module:
                imp = f"from {cmod} import {cname}"
                if imp not in lines:
                    lines.insert(0, imp)
        verb, noun = name.split("_", 1)
        noun = noun.replace("_", " ")
        body = [f"def {name}(item, context=None):", f'    """{verb.capitalize()} the {noun} of an item."""']
        body.append("    result = []")
        for callee in self.calls[qual]:
            body.append(f"    result.append({callee.rsplit('.', 1)[1]}(item, context))")
        body.append(f"    return result or [item, {len(noun)}]")
        lines.extend(["", *body])

    def callers(self, target: str) -> list[str]:
        out: set[str] = set()
        changed = True
        while changed:
            changed = False
            for f, callees in self.calls.items():
                if f not in out and any(c == target or c in out for c in callees):
                    out.add(f)
                    changed = True
        return sorted(out)

    def render(self) -> str:
        parts = []
        for module in sorted(self.modules):
            path = module.replace(".", "/") + ".py"
            parts.append(f"# file: {path}\n" + "\n".join(self.modules[module]).strip() + "\n")
        return "\n".join(parts)


def _core_modules(rng: random.Random, n: int) -> list[str]:
    names: list[str] = []
    while len(names) < n:
        m = f"{rng.choice(PACKAGES)}.{rng.choice(MODULES)}"
        if m not in names:
            names.append(m)
    return names


def _settings_chain(
    rng: random.Random, repo: Repo, setting: str, bad: int | None = None
) -> tuple[str, str, int]:
    """A chain of 3-4 settings modules, each star-importing the one before and some overriding `setting`,
    plus a module off the chain and a shadowing local as traps. With `bad`, one module of the chain sets
    that value and none after it overrides. Returns (last module of the chain, the module whose value
    holds at its end, that value)."""
    package = rng.choice(SETTINGS_PACKAGES)
    chain = [f"{package}.{m}" for m in rng.sample(SETTINGS_MODULES, rng.randint(3, 4))]
    bad_at = rng.randrange(len(chain)) if bad is not None else -1
    value, holder = rng.randint(2, 90), chain[0]
    repo.modules[chain[0]] = [f"{setting} = {bad if bad_at == 0 else value}"]
    for i, mod in enumerate(chain[1:], start=1):
        lines = [f"from {chain[i - 1]} import *  # noqa: F403"]
        if i == bad_at or (bad_at < 0 or i < bad_at) and rng.random() < 0.6:
            value, holder = rng.randint(2, 90), mod
            lines.append(f"{setting} = {value}")
        repo.modules[mod] = lines
    if bad is not None:
        value, holder = bad, chain[bad_at]
        repo.modules[holder] = [ln for ln in repo.modules[holder] if not ln.startswith(setting)]
        repo.modules[holder].append(f"{setting} = {bad}")
    trap = rng.randint(91, 99)
    off_chain = f"{package}.staging"
    repo.modules[off_chain] = [f"from {chain[0]} import *  # noqa: F403", f"{setting} = {trap}"]
    repo.modules[chain[1]] += [
        "",
        "def legacy_defaults():",
        f"    {setting} = {trap - 1}",
        f"    return {setting}",
    ]
    return chain[-1], holder, value


def make_case(rng: random.Random, kind: str) -> dict[str, Any]:
    """The core repository and the question (filler modules are added when sized)."""
    while True:  # a graph where some function has 3-5 of the 14 as callers (listing all 14 scores low)
        repo = Repo()
        core = _core_modules(rng, 6)
        funcs = repo.add_graph(rng, core, 14)
        targets = [f for f in funcs if 3 <= len(repo.callers(f)) <= 5]
        if targets:
            break
    case: dict[str, Any] = {"kind": kind, "filler_seed": rng.randrange(2**31)}
    if kind == "callers":
        target = rng.choice(targets)
        case["question"] = (
            f"Which functions call `{target}` directly or transitively? List every one as a qualified name "
            "(package.module.function), separated by commas."
        )
        case["answers"] = repo.callers(target)
    elif kind == "value":
        setting = rng.choice(SETTINGS)
        last, _, value = _settings_chain(rng, repo, setting)
        repo.modules["app.main"] = [
            f"from {last} import {setting}",
            "",
            "def main():",
            f"    return {setting}",
        ]
        case["question"] = (
            f"What value does `{setting}` have at runtime inside `app.main.main()`? Give the number only."
        )
        case["answers"] = [str(value)]
    else:
        setting = rng.choice(SETTINGS)
        last, holder, value = _settings_chain(rng, repo, setting, bad=-rng.randint(1, 9))
        repo.modules["utils.checks"] = [
            "def require_positive(name, value):",
            "    if value <= 0:",
            '        raise ValueError(f"{name} must be positive, got {value}")',
            "    return value",
        ]
        caller_mod = rng.choice(core)
        runner = f"{caller_mod}.run_{rng.choice(NOUNS)}_job"
        repo.modules.setdefault(caller_mod, [])[:0] = [
            f"from {last} import {setting}",
            "from utils.checks import require_positive",
        ]
        repo.modules[caller_mod] += [
            "",
            f"def {runner.rsplit('.', 1)[1]}(item):",
            f'    require_positive("{setting}", {setting})',
            "    return item",
        ]
        repo.modules["app.main"] = [f"from {caller_mod} import {runner.rsplit('.', 1)[1]}", "", "def main():"]
        repo.modules["app.main"].append(f"    return {runner.rsplit('.', 1)[1]}(None)")
        path = caller_mod.replace(".", "/")
        case["traceback"] = (
            "Traceback (most recent call last):\n"
            '  File "app/main.py", in main\n'
            f"    return {runner.rsplit('.', 1)[1]}(None)\n"
            f'  File "{path}.py", in {runner.rsplit(".", 1)[1]}\n'
            f'    require_positive("{setting}", {setting})\n'
            '  File "utils/checks.py", in require_positive\n'
            '    raise ValueError(f"{name} must be positive, got {value}")\n'
            f"ValueError: {setting} must be positive, got {value}"
        )
        case["question"] = (
            f"Running the app fails with this traceback:\n{case['traceback']}\n"
            "Which module must change to fix it (the value is wrong, the check is right)? "
            "Give its dotted module name."
        )
        case["answers"] = [holder]
    case["repo"] = repo
    return case


def render(case: dict[str, Any], k: int) -> str:
    repo: Repo = case["repo"]
    full = Repo()
    full.modules = {m: list(lines) for m, lines in repo.modules.items()}
    full.calls = dict(repo.calls)
    if k:
        frng = random.Random(case["filler_seed"])
        pkgs = [f"{p}_{suffix}" for p in PACKAGES for suffix in ("legacy", "extra", "ops")]
        filler = [f"{frng.choice(pkgs)}.{frng.choice(MODULES)}" for _ in range(max(1, k // 4))]
        full.add_graph(frng, sorted(set(filler)), k)
    return (
        "Here is the source code of a Python repository, one file after another.\n\n"
        f"{full.render()}\n\nQuestion: {case['question']}\n"
        "Put the answer between <answer> and </answer>."
    )


def score_answer(reply: str, meta: dict[str, Any]) -> tuple[float, dict[str, float], dict[str, Any]]:
    """Set F1 of qualified names (callers) or exact match (value, fix); never raises on any text."""
    text, tagged = lc.answer_text(reply)
    gold = set(meta["answers"])
    if meta["kind"] == "callers":
        predicted = set(QUALIFIED.findall(text))
        tp = len(predicted & gold)
        precision = tp / len(predicted) if predicted else 0.0
        recall = tp / len(gold)
        score = 2 * precision * recall / (precision + recall) if tp else 0.0
        rewards = {"precision": precision, "recall": recall, "f1": score}
    else:
        score = float(text.strip().strip("`").strip().casefold() in {g.casefold() for g in gold})
        rewards = {"exact_match": score}
    fmt = 1.0 if tagged else 0.0
    rewards.update(score=score, format=fmt, success=float(score == 1.0))
    return lc.W_SCORE * score + lc.W_FORMAT * fmt, rewards, {"unparseable": int(not tagged)}


@register_env("longctx.codebase")
class CodebaseDomain(lc.LongContextDomain):
    score = staticmethod(score_answer)

    description = (
        "a generated multi-module repository in the context: callers, runtime values, which module to fix"
    )

    def __init__(self, tokenizer: str = "smollm2-135m", kinds: list[str] | None = None) -> None:
        self.tokenizer = tokenizer
        self.kinds = lc.check_options("longctx.codebase", kinds, KINDS)
        self.difficulties = sorted(lc.LEVEL_TOKENS)

    def split_tasks(self) -> list[tuple[str, lc.LongContextDomain]]:
        return [(kind, CodebaseDomain(self.tokenizer, [kind])) for kind in self.kinds]

    def task(self, split: str, difficulty: int, index: int, seed: int = 0) -> Task:
        def make(rng: random.Random):
            kind = self.kinds[rng.randrange(len(self.kinds))]
            case = make_case(random.Random(rng.randrange(2**63)), kind)
            meta = {"kind": kind, "answers": case["answers"], "question": case["question"]}

            def build() -> Task:
                target = lc.level_tokens(difficulty)
                return self.sized(difficulty, target, lambda n: render(case, n), lambda k: meta)

            key = f"longctx.codebase|{kind}|{case['repo'].render()}|{case['question']}"
            return key, build

        return self.draw(split, difficulty, index, seed, make)
