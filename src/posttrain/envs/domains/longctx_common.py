"""What the long-context domains (`longctx.ruler`, `longctx.hard`, `longctx.codebase`) share: the length
levels, the prose they hide facts in (a Jules Verne story that ships inside `reasoning-gym`), the scorer
and the one-turn environment. Does not draw any task itself.

Scoring is RULER's `string_match_all` (the fraction of gold strings the answer contains, case-insensitive)
times a precision term: the fraction of the answer's *candidates* (strings of the kind the task asks for:
7-digit numbers, UUIDs, variable names, or words of the task's vocabulary) that are gold. Listing every
candidate of the context therefore scores about 1 / (number of candidates), not 1. Reward = 0.9 * score +
0.1 * format (the answer inside `<answer>` tags); `success` = score 1 (every gold string, nothing else).
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from functools import lru_cache
from importlib.resources import files
from typing import Any

from posttrain.envs.base import Domain, Environment, SingleTurnEnv
from posttrain.envs.tokens import fit_to_tokens
from posttrain.types import Message, Task

LEVEL_TOKENS: dict[int, int] = {0: 1024, 1: 2048, 2: 4096, 3: 8192, 4: 16384, 5: 32768}
W_SCORE, W_FORMAT = 0.9, 0.1
MAX_ANSWER_CHARS = 100_000
ANSWER_INSTRUCTION = "Put the answer between <answer> and </answer>, several values separated by commas."

CANDIDATE_PATTERNS = {
    "number": r"(?<!\d)\d{7}(?!\d)",
    "uuid": r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}",
    "var": r"(?<![A-Za-z])[A-Z]{5}(?![A-Za-z])",
}
_TAGS = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)


def level_tokens(level: int) -> int:
    return LEVEL_TOKENS[level]


def parse_lengths(text: str, option: str = "--lengths") -> list[int]:
    """'1k,4k,16384' -> [1024, 4096, 16384] (k = 1024 tokens); ValueError naming the bad entry."""
    out = []
    for part in text.split(","):
        part = part.strip().lower()
        try:
            out.append(int(float(part[:-1]) * 1024) if part.endswith("k") else int(part))
        except ValueError:
            raise ValueError(f"{option}: '{part}' is not a length (e.g. 1k,4k,16k or 4096)") from None
    if not out or min(out) < 16:
        raise ValueError(f"{option} must be lengths of at least 16 tokens, got {text!r}")
    return out


def length_levels(text: str, option: str = "--lengths") -> list[int]:
    """'1k,2k,8k' -> the length levels [0, 1, 3] (sorted, distinct); a length that is not a level is
    refused, naming the levels there are."""
    by_tokens = {n: level for level, n in LEVEL_TOKENS.items()}
    levels = []
    for n in parse_lengths(text, option):
        if n not in by_tokens:
            valid = ", ".join(f"{t // 1024}k" for t in sorted(by_tokens))
            raise ValueError(f"{option}: {n} tokens is not a long-context level (the levels: {valid})")
        levels.append(by_tokens[n])
    return sorted(set(levels))


@lru_cache(maxsize=1)
def story_sentences() -> tuple[str, ...]:
    """The sentences of "In the Year 2889" (Project Gutenberg's header and licence cut off)."""
    text = (files("reasoning_gym") / "data" / "in_the_year_2889.txt").read_text(encoding="utf-8")
    start = text.index("Little though they seem")
    end = text.index("*** END OF THE PROJECT GUTENBERG")
    body = re.sub(r"\s+", " ", text[start:end].replace("_", "")).strip()
    sentences = re.split(r"(?<=[.!?])\s+(?=[A-Z\"])", body)
    return tuple(s for s in sentences if 20 <= len(s) <= 600 and "Gutenberg" not in s)


@lru_cache(maxsize=1)
def common_words() -> tuple[str, ...]:
    """Lower-case English words of 4-8 letters (reasoning-gym's word list), for keys and vocabularies."""
    text = (files("reasoning_gym") / "data" / "words3to10.txt").read_text(encoding="utf-8")
    return tuple(w for w in text.split() if 4 <= len(w) <= 8 and w.isalpha() and w.islower())


def essay(rng: random.Random, n: int) -> list[str]:
    """n sentences of the story from a random start, wrapping around (RULER repeats its essays too)."""
    sents = story_sentences()
    start = rng.randrange(len(sents))
    return [sents[(start + i) % len(sents)] for i in range(n)]


def insert_at_depths(units: list[str], needles: list[str], depths: list[float]) -> list[str]:
    """`units` with each needle inserted before the unit at its depth (0 = first, 1 = last)."""
    out = list(units)
    for needle, depth in sorted(zip(needles, depths, strict=True), key=lambda p: -p[1]):
        out.insert(round(depth * len(units)), needle)
    return out


def answer_text(reply: str) -> tuple[str, bool]:
    """The text inside the last `<answer>` tags (and True), else the whole reply (and False)."""
    reply = reply[-MAX_ANSWER_CHARS:] if isinstance(reply, str) else ""
    tags = _TAGS.findall(reply)
    return (tags[-1], True) if tags else (reply, False)


def candidates(text: str, meta: dict[str, Any]) -> set[str]:
    """The distinct strings of the kind the task asks for in `text` (casefolded)."""
    kind = meta["candidate_kind"]
    if kind in CANDIDATE_PATTERNS:
        return {m.casefold() for m in re.findall(CANDIDATE_PATTERNS[kind], text)}
    # the vocabularies are single words: the reply's words that belong to it
    return set(re.findall(r"[\w-]+", text.casefold())) & {v.casefold() for v in meta["candidate_vocab"]}


def score_answer(reply: str, meta: dict[str, Any]) -> tuple[float, dict[str, float], dict[str, Any]]:
    """(reward, components, info) of one reply; never raises on any text."""
    text, tagged = answer_text(reply)
    gold = [g.casefold() for g in meta["answers"]]
    folded = text.casefold()
    recall = sum(1 for g in gold if g in folded) / len(gold)  # RULER's string_match_all
    found = candidates(text, meta)
    precision = len(found & set(gold)) / len(found) if found else 0.0
    score = recall * precision
    fmt = 1.0 if tagged else 0.0
    rewards = {
        "recall": recall,
        "precision": precision,
        "score": score,
        "format": fmt,
        "success": float(score == 1.0),
    }
    info = {"candidates": len(found), "unparseable": int(not tagged)}
    return W_SCORE * score + W_FORMAT * fmt, rewards, info


def reference_reply(meta: dict[str, Any]) -> str:
    return f"<answer>{', '.join(meta['answers'])}</answer>"


def check_options(domain: str, chosen: list[Any] | None, valid: tuple[Any, ...]) -> tuple[Any, ...]:
    """The chosen subset of `valid` (all of it for None); an unknown or empty choice is refused by name."""
    picked = tuple(chosen) if chosen is not None else valid
    bad = [t for t in picked if t not in valid]
    if bad or not picked:
        raise ValueError(
            f"{domain}: unknown tasks {bad or '(none given)'} (valid: {', '.join(map(str, valid))})"
        )
    return picked


class LongContextDomain(Domain):
    """What the long-context domains share: a drawn case's prompt sized to its level's tokens, the
    reference reply (the gold answers in tags), and the one-turn environment scored by `score`."""

    score: Callable[..., Any] = staticmethod(score_answer)
    tokenizer: str = "smollm2-135m"

    def sized(
        self,
        difficulty: int,
        target_tokens: int,
        render: Callable[[int], str],
        meta: Callable[[int], dict[str, Any]],
    ) -> Task:
        """The task whose prompt is `render(k)` for the largest k within `target_tokens`; `meta(k)` its meta."""
        k, n_tokens = fit_to_tokens(render, target_tokens, self.tokenizer)
        full = {**meta(k), "target_tokens": target_tokens, "n_tokens": n_tokens, "tokenizer": self.tokenizer}
        return Task(
            id="", domain=self.name, difficulty=difficulty, prompt=[Message("user", render(k))], meta=full
        )

    def reference(self, task: Task) -> list[str]:
        return [reference_reply(task.meta)]

    def split_tasks(self) -> list[tuple[str, LongContextDomain]]:
        """The domain as (task name, a domain drawing only that task) pairs, for tables per task."""
        return [("all", self)]

    def difficulty_at(self, level: int) -> int:
        """The difficulty of this domain's tasks at length level `level`."""
        return level

    def make_env(self, sandbox: Any = None, chat_format: str = "smollm2") -> Environment:
        return SingleTurnEnv(type(self).score)
