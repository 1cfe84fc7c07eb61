"""`math`: math and logic questions from reasoning-gym (a dependency), scored by each dataset's own
scorer after robust answer extraction (`posttrain.envs.extract`). Single turn.

Default: a curated easy-to-hard family set (difficulty 0 = one-step addition/subtraction of numbers up
to 10). `get_domain("math", datasets=["gcd", "knights_knaves"])` or `datasets={"chain_sum": {"min_terms":
3}}` uses any reasoning-gym datasets by name instead (one difficulty level, 0). `levels=[...]` makes each
entry its own difficulty level, in order (level i = entry i, each a name, a list of names or a mapping of
name to config, as `datasets`): one domain entry then holds several families, each at several levels, as
separate curriculum arms (`math:0`, `math:1`, ...).

Reward = 0.85 * correct + 0.15 * format, where `correct` is the dataset scorer's value on the extracted
answer (a numeric answer equal after normalisation - "7.0" vs "7", "1,200" vs "1200" - counts as 1) and
`format` is 1 when the answer was given in `<answer>...</answer>` tags as instructed. `success` is
strict: 1 only when `correct` is exactly 1 (some scorers give partial credit, which stays in `correct`).
Residual risk: a scorer that accepts a loose answer (the dataset's own rules) accepts it here too.
"""

from __future__ import annotations

import threading
from functools import lru_cache
from typing import Any

from posttrain.envs.base import Domain, Environment, SingleTurnEnv, clip01
from posttrain.envs.extract import extract_answer, normalize_number
from posttrain.envs.registry import register_env
from posttrain.types import Message, Task

W_CORRECT, W_FORMAT = 0.85, 0.15
INSTRUCTION = "Put the final answer between <answer> and </answer>."
_INDEX_SPACE = 100_000  # some datasets (gsm_symbolic) precompute `size` items at construction

# difficulty -> [(reasoning-gym dataset, config overrides)], drawn uniformly within a level.
CURATED: dict[int, list[tuple[str, dict[str, Any]]]] = {
    0: [
        (
            "basic_arithmetic",
            {
                "min_terms": 2,
                "max_terms": 2,
                "min_digits": 1,
                "max_digits": 1,
                "operators": ("+", "-"),
                "allow_parentheses": False,
                "allow_negation": False,
            },
        )
    ],
    1: [
        (
            "basic_arithmetic",
            {
                "min_terms": 2,
                "max_terms": 2,
                "min_digits": 2,
                "max_digits": 2,
                "operators": ("+", "-"),
                "allow_parentheses": False,
                "allow_negation": False,
            },
        ),
        ("chain_sum", {"min_terms": 3, "max_terms": 3, "min_digits": 1, "max_digits": 1}),
    ],
    2: [
        (
            "basic_arithmetic",
            {
                "min_terms": 3,
                "max_terms": 3,
                "min_digits": 1,
                "max_digits": 2,
                "operators": ("+", "-", "*"),
                "allow_parentheses": False,
                "allow_negation": False,
            },
        ),
        ("products", {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}),
    ],
    3: [
        ("simple_equations", {"min_terms": 2, "max_terms": 2, "max_value": 20}),
        ("gcd", {"max_value": 100}),
        ("lcm", {"max_value": 20}),
        ("leg_counting", {"min_animals": 2, "max_animals": 3, "max_instances": 5}),
    ],
    4: [
        ("basic_arithmetic", {"min_terms": 3, "max_terms": 5, "min_digits": 1, "max_digits": 2}),
        ("letter_counting", {"min_words": 3, "max_words": 8}),
        ("fraction_simplification", {"max_value": 100, "max_factor": 10, "styles": ("plain",)}),
    ],
}

_RG_LOCK = threading.Lock()


def _freeze(config: dict[str, Any]) -> tuple:
    return tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in config.items()))


@lru_cache(maxsize=256)
def _dataset(name: str, frozen_config: tuple) -> Any:
    import reasoning_gym  # lazy: ~1 s import

    config = {k: tuple(v) if isinstance(v, tuple) else v for k, v in frozen_config}
    with _RG_LOCK:
        return reasoning_gym.create_dataset(name, seed=0, size=_INDEX_SPACE, **config)


def _entry(name: str, config: dict[str, Any], index: int) -> dict[str, Any]:
    return _dataset(name, _freeze(config))[index]


def _families(datasets: Any, where: str) -> list[tuple[str, dict[str, Any]]]:
    """[(reasoning-gym dataset, config)] of one level given as a list of names or a mapping of name to
    config; ValueError names `where` (the option) and what is wrong, a config the dataset refuses included."""
    import reasoning_gym

    if not isinstance(datasets, list | tuple | dict):
        raise ValueError(
            f"math: '{where}' must be a list of reasoning-gym dataset names or a mapping of "
            f"name to config, got {type(datasets).__name__} {datasets!r} (e.g. datasets=[gcd])"
        )
    if not all(isinstance(n, str) for n in datasets):
        raise ValueError(f"math: '{where}' names must be strings, got {list(datasets)!r}")
    chosen = {n: {} for n in datasets} if isinstance(datasets, list | tuple) else dict(datasets)
    if not chosen:
        raise ValueError(f"math: '{where}' is empty; give reasoning-gym dataset names")
    valid = sorted(reasoning_gym.factory.DATASETS)
    for n, cfg in chosen.items():
        if n not in valid:
            raise ValueError(
                f"math: {where}: unknown reasoning-gym dataset '{n}' (valid: {', '.join(valid)})"
            )
        if not isinstance(cfg, dict):
            raise ValueError(
                f"math: {where}: config for dataset '{n}' must be a mapping, got {type(cfg).__name__}"
            )
        try:
            with _RG_LOCK:
                reasoning_gym.create_dataset(n, seed=0, size=1, **dict(_freeze(cfg)))
        except Exception as err:  # noqa: BLE001 - each dataset validates its config its own way
            raise ValueError(f"math: {where}: dataset '{n}' refuses config {cfg!r}: {err}") from None
    return list(chosen.items())


def score_math(text: str, meta: dict[str, Any]) -> tuple[float, dict[str, float], dict[str, Any]]:
    """(reward, components, info) for one answer text; never raises on any text."""
    extracted = extract_answer(text)
    fmt = 1.0 if extracted.method == "tags" else 0.0
    correct = 0.0
    if extracted.text:
        answer = extracted.text[:2000]
        if normalize_number(answer) == normalize_number(str(meta["answer"])):
            correct = 1.0
        else:
            entry = _entry(meta["dataset"], meta["config"], meta["index"])
            ds = _dataset(meta["dataset"], _freeze(meta["config"]))
            try:
                correct = clip01(float(ds.score_answer(answer, entry)))
            except Exception:  # noqa: BLE001 - a dataset scorer choking on odd text scores 0, not a crash
                correct = 0.0
    reward = W_CORRECT * correct + W_FORMAT * fmt
    info = {
        "extracted": extracted.text,
        "extract_method": extracted.method,
        "unparseable": int(extracted.text is None),
    }
    return reward, {"correct": correct, "format": fmt, "success": float(correct == 1.0)}, info


@register_env("math")
class MathDomain(Domain):
    description = "reasoning-gym math/logic questions; answer in <answer></answer> tags"

    def __init__(
        self,
        datasets: list[str] | dict[str, dict[str, Any]] | None = None,
        levels: list[str | list[str] | dict[str, dict[str, Any]]] | None = None,
    ) -> None:
        if datasets is not None and levels is not None:
            raise ValueError("math: give 'datasets' (one level) or 'levels' (one entry per level), not both")
        if levels is not None:
            if not isinstance(levels, list | tuple) or not levels:
                raise ValueError(
                    f"math: 'levels' must be a non-empty list, one entry per difficulty level, got {levels!r} "
                    "(e.g. levels=[gcd, {chain_sum: {min_terms: 3}}])"
                )
            self.families = {
                i: _families([e] if isinstance(e, str) else e, f"levels[{i}]") for i, e in enumerate(levels)
            }
        elif datasets is not None:
            self.families = {0: _families(datasets, "datasets")}
        else:
            self.families = CURATED
        self.difficulties = sorted(self.families)

    def task(self, split: str, difficulty: int, index: int, seed: int = 0) -> Task:
        def make(rng):
            name, config = self.families[difficulty][rng.randrange(len(self.families[difficulty]))]
            idx = rng.randrange(_INDEX_SPACE)
            entry = _entry(name, config, idx)
            question = str(entry["question"]).strip()

            def build() -> Task:
                prompt = [Message(role="user", content=f"{question}\n{INSTRUCTION}")]
                meta = {
                    "dataset": name,
                    "config": dict(config),
                    "index": idx,
                    "answer": str(entry["answer"]),
                    "question": question,
                }
                return Task(id="", domain=self.name, difficulty=difficulty, prompt=prompt, meta=meta)

            return f"{name}|{question}", build

        return self.draw(split, difficulty, index, seed, make)

    def reference(self, task: Task) -> list[str]:
        return [f"<answer>{task.meta['answer']}</answer>"]

    def make_env(self, sandbox: Any = None, chat_format: str = "smollm2") -> Environment:
        return SingleTurnEnv(score_math)
