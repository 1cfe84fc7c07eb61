"""`longctx.hard`: needles that share no content word with the question (NoLiMa-style), near-duplicate
distractors, and two-hop chains spread across the context, at controlled depths.

The needle says where a character lives by a landmark ("Actually, Yuki lives next to the Semper Opera
House."); the question names the city ("Which character has been to Dresden?"), so finding the needle
takes a one-hop inference, not string matching. Hardness 0: that needle alone in the essay. 1: plus
near-duplicate needles (other characters by landmarks of other cities) and literal-match traps that
mention the asked city. 2: a two-hop chain: the landmark needle and a second link ("Omar spent the
previous July as Yuki's house guest."), asked "Who visited someone in Dresden?", the links in different
halves of the context. Difficulty = 10 * hardness + length level (0-5 = 1k-32k tokens). The needle's
depth (0-100%) is drawn from `depths` and recorded. Scoring: longctx_common (the candidates are the
context's character names).
"""

from __future__ import annotations

import random
from typing import Any

from posttrain.envs.domains import longctx_common as lc
from posttrain.envs.registry import register_env
from posttrain.types import Task

LANDMARKS: dict[str, str] = {
    "the Semper Opera House": "Dresden",
    "the Eiffel Tower": "Paris",
    "the Colosseum": "Rome",
    "the Sagrada Familia": "Barcelona",
    "the Acropolis": "Athens",
    "the Brandenburg Gate": "Berlin",
    "the Little Mermaid statue": "Copenhagen",
    "the Atomium": "Brussels",
    "the Rijksmuseum": "Amsterdam",
    "the Prado Museum": "Madrid",
    "the Charles Bridge": "Prague",
    "the Hofburg Palace": "Vienna",
    "the Blue Mosque": "Istanbul",
    "the Kremlin": "Moscow",
    "the Forbidden City": "Beijing",
    "the Space Needle": "Seattle",
    "the Alhambra": "Granada",
    "the Rialto Bridge": "Venice",
    "the Wawel Castle": "Krakow",
    "the Burj Khalifa": "Dubai",
    "the Gateway of India": "Mumbai",
    "the CN Tower": "Toronto",
}
CHARACTERS = (
    "Yuki Omar Mina Kenji Ines Lars Nadia Tomas Aiko Bilal Chen Dara Emil Fatima Goran Hana Ivo Jalen "
    "Kaito Leila Mateo Nika Olek Priya Rafa Sanna Teo Uma Wren Yara Zane Arlo Bea Cyrus Dalia Eero Faye"
).split()
HARDNESS = (0, 1, 2)
DEPTHS = tuple(i / 10 for i in range(11))
STOPWORDS = frozenset(
    "a an the to of in on at by for as is was has have been who which what someone character actually".split()
)


def content_words(text: str) -> set[str]:
    """Lower-case words of `text` minus function words (what a lexical match would latch on to)."""
    words = "".join(c.lower() if c.isalnum() or c == "'" else " " for c in text).split()
    return {w.removesuffix("'s") for w in words} - STOPWORDS


def make_case(rng: random.Random, hardness: int, depth: float) -> dict[str, Any]:
    """The needles, distractors, question and answer of one task (any length)."""
    landmark, city = rng.choice(sorted(LANDMARKS.items()))
    names = rng.sample(CHARACTERS, 12)
    who, guest = names[0], names[1]
    needles = [f"Actually, {who} lives next to {landmark}."]
    if hardness < 2:
        question, answer = f"Which character has been to {city}?", who
        depths = [depth]
    else:
        needles.append(f"{guest} spent the previous July as {who}'s house guest.")
        question, answer = f"Who visited someone in {city}?", guest
        other = (depth + 0.5) % 1.0  # the second link in the other half of the context
        depths = [depth, other]
    distractors: list[str] = []
    if hardness >= 1:
        others = [lm for lm, c in sorted(LANDMARKS.items()) if c != city]
        for name, lm in zip(names[2:8], rng.sample(others, 6), strict=True):
            distractors.append(f"Actually, {name} lives next to {lm}.")
        for name in names[8:10]:  # they mention the city, and have not been there
            distractors.append(f"{name} has been dreaming of a trip to {city} for years.")
        if hardness == 2:
            host = rng.choice(names[2:8])  # a guest of someone in another city
            distractors.append(f"{names[10]} spent the previous July as {host}'s house guest.")
    return {
        "needles": needles,
        "depths": depths,
        "distractors": distractors,
        "distractor_depths": [rng.random() for _ in distractors],
        "question": question,
        "answer": answer,
        "names": names,
        "city": city,
        "landmark": landmark,
        "hay_seed": rng.randrange(2**31),
    }


def render(case: dict[str, Any], k: int) -> str:
    hay = lc.essay(random.Random(case["hay_seed"]), k)
    hay = lc.insert_at_depths(hay, case["distractors"], case["distractor_depths"])
    body = " ".join(lc.insert_at_depths(hay, case["needles"], case["depths"]))
    return (
        "Read the following story carefully; some of its sentences matter later.\n\n"
        f"{body}\n\nQuestion: {case['question']}\n{lc.ANSWER_INSTRUCTION}"
    )


@register_env("longctx.hard")
class HardRetrievalDomain(lc.LongContextDomain):
    description = "needles with no lexical overlap, near-duplicate distractors, two-hop chains (1k-32k)"

    def __init__(
        self,
        tokenizer: str = "smollm2-135m",
        depths: list[float] | None = None,
        hardness: list[int] | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.depths = tuple(depths) if depths is not None else DEPTHS
        if not self.depths or any(not 0.0 <= d <= 1.0 for d in self.depths):
            raise ValueError(f"longctx.hard: depths must be fractions in [0, 1], got {list(self.depths)}")
        self.hardness = lc.check_options("longctx.hard", hardness, HARDNESS)  # type: ignore[arg-type]
        self.difficulties = [10 * h + n for h in self.hardness for n in sorted(lc.LEVEL_TOKENS)]

    def split_tasks(self) -> list[tuple[str, lc.LongContextDomain]]:
        return [
            (f"hardness_{h}", HardRetrievalDomain(self.tokenizer, list(self.depths), [h]))
            for h in self.hardness
        ]

    def difficulty_at(self, level: int) -> int:
        if len(self.hardness) != 1:
            raise ValueError(
                f"longctx.hard with hardness {list(self.hardness)}: a length level is a difficulty only at one "
                "hardness (split_tasks gives one domain per hardness)"
            )
        return 10 * self.hardness[0] + level

    def task(self, split: str, difficulty: int, index: int, seed: int = 0) -> Task:
        hardness, level = divmod(difficulty, 10)

        def make(rng: random.Random):
            depth = self.depths[rng.randrange(len(self.depths))]
            case = make_case(random.Random(rng.randrange(2**63)), hardness, depth)
            meta = {
                "answers": [case["answer"]],
                "candidate_kind": "vocab",
                "candidate_vocab": case["names"],
                "question": case["question"],
                "needles": case["needles"],
                "depth": depth,
                "hardness": hardness,
            }

            def build() -> Task:
                return self.sized(
                    difficulty, lc.level_tokens(level), lambda n: render(case, n), lambda k: meta
                )

            key = f"longctx.hard|{hardness}|{case['needles']}|{case['distractors']}|{case['hay_seed']}"
            return key, build

        return self.draw(split, difficulty, index, seed, make)
