"""`longctx.ruler`: RULER's 13 tasks as seeded generators, sized in tokens of the model's tokenizer.

Tasks: needle-in-a-haystack single 1/2/3 (noise or essay haystack, number or UUID values), multikey 1/2/3
(distractor keys; a haystack made of distractor needles), multivalue (every value of one key),
multiquery (the values of four keys), variable tracking (every variable bound to a value through a
chain), common-words and frequent-words extraction, and two QA tasks over generated documents with
distractors (one fact; two facts to join). The essay is "In the Year 2889" (shipped in reasoning-gym).
Levels 0-5 = 1k, 2k, 4k, 8k, 16k, 32k tokens: the most filler that keeps the prompt within the level.
Scoring: longctx_common.score_answer (RULER's string_match_all times a precision term).
"""

from __future__ import annotations

import random
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from posttrain.envs.base import stable_hash
from posttrain.envs.domains import longctx_common as lc
from posttrain.envs.registry import register_env
from posttrain.types import Task

TASKS = (
    "niah_single_1",
    "niah_single_2",
    "niah_single_3",
    "niah_multikey_1",
    "niah_multikey_2",
    "niah_multikey_3",
    "niah_multivalue",
    "niah_multiquery",
    "vt",
    "cwe",
    "fwe",
    "qa_1",
    "qa_2",
)
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
FIRST_NAMES = (
    "Amara Bruno Chiara Dmitri Elena Farid Greta Hiro Ines Jonas Kaveh Lena Mateo Nadia Oskar Priya "
    "Quentin Rosa Soren Tamar Umar Vera Wendell Ximena Yusuf Zofia Anton Beatriz Caspar Delphine"
).split()
SURNAMES = (
    "Abbott Bianchi Castillo Dubois Eriksen Fontaine Galloway Haddad Iversen Jansen Kowalski Lindqvist "
    "Moreau Novak Okafor Petrov Quinlan Rossi Santos Tanaka Ulrich Varga Whitfield Xu Yilmaz Zeller"
).split()
CITIES = (
    "Lisbon Oslo Nairobi Lima Hanoi Quito Tbilisi Dakar Kyoto Porto Tallinn Accra Bergen Cusco Dublin "
    "Gdansk Havana Izmir Jaipur Krakow Lyon Malmo Nantes Odessa Perth Riga Seville Tunis Utrecht Valencia"
).split()
COMPANY_A = (
    "Northwind Bluestone Harbor Silverline Cedar Granite Aurora Meridian Kestrel Juniper Falcon".split()
)
COMPANY_B = "Dynamics Holdings Industries Systems Robotics Logistics Analytics Foods Textiles Optics".split()


@dataclass
class Spec:
    """One drawn task before sizing: its prompt for k filler units, its gold answers and candidates."""

    render: Callable[[int], str]
    answers: list[str]
    candidate_kind: str
    vocab: Callable[[int], list[str]] = field(default=lambda k: [])
    key: str = ""  # the content that decides the split


def _word_key(rng: random.Random) -> str:
    words = lc.common_words()
    return f"{rng.choice(words)}-{rng.choice(words)}"


def _number(rng: random.Random) -> str:
    return str(rng.randint(1_000_000, 9_999_999))


def _uuid(rng: random.Random) -> str:
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def _needle(key: str, value: str, kind: str) -> str:
    return f"One of the special magic {kind} for {key} is: {value}."


def _join(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def _niah(
    rng: random.Random,
    haystack: str,
    key_kind: str,
    value_kind: str,
    n_keys: int,
    n_values: int,
    n_queries: int,
) -> Spec:
    make_key = _uuid if key_kind == "uuid" else _word_key
    make_value = _uuid if value_kind == "uuid" else _number
    kind = "uuids" if value_kind == "uuid" else "numbers"
    keys: list[str] = []
    while len(keys) < n_keys:
        k = make_key(rng)
        if k not in keys:
            keys.append(k)
    values = {k: [make_value(rng) for _ in range(n_values)] for k in keys}
    needles = [_needle(k, v, kind) for k in keys for v in values[k]]
    depths = [rng.random() for _ in needles]
    hay_seed = rng.randrange(2**31)
    queries = keys[:n_queries]

    def hay(k: int) -> list[str]:
        if haystack == "noise":
            return [NOISE] * k
        if haystack == "essay":
            return lc.essay(random.Random(hay_seed), k)
        out = []  # a haystack of distractor needles, none for a queried key
        for i in range(k):
            r = random.Random(stable_hash(hay_seed, i))
            key = make_key(r)
            out.append(_needle(key, make_value(r), kind) if key not in keys else NOISE)
        return out

    head = (
        f"Some special magic {kind} are hidden within the following text. Make sure to memorize it. "
        f"I will quiz you about the {kind} afterwards.\n"
    )
    question = f"What are all the special magic {kind} for {_join(queries)} mentioned in the provided text?"

    def render(k: int) -> str:
        return f"{head}{' '.join(lc.insert_at_depths(hay(k), needles, depths))}\n\n{question}\n{lc.ANSWER_INSTRUCTION}"

    answers = [v for q in queries for v in values[q]]
    return Spec(render, answers, value_kind, key=f"niah|{haystack}|{keys}|{values}|{hay_seed}")


def _var_name(rng: random.Random) -> str:
    return "".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5))


def _vt(rng: random.Random) -> Spec:
    hops, n_chains = 4, 2
    names: list[str] = []
    while len(names) < (hops + 1) * n_chains:
        n = _var_name(rng)
        if n not in names:
            names.append(n)
    values = rng.sample(range(10000, 99999), n_chains)
    statements, depths = [], []
    for c in range(n_chains):
        chain = names[c * (hops + 1) : (c + 1) * (hops + 1)]
        stmts = [f"VAR {chain[0]} = {values[c]}."] + [
            f"VAR {b} = VAR {a}." for a, b in zip(chain, chain[1:], strict=False)
        ]
        statements += stmts
        depths += sorted(rng.random() for _ in stmts)  # each link after the one it copies
    question = f"Find all variables that are assigned the value {values[0]} in the text above."
    head = "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"

    def render(k: int) -> str:
        body = " ".join(lc.insert_at_depths([NOISE] * k, statements, depths))
        return f"{head}{body}\n\nQuestion: {question}\n{lc.ANSWER_INSTRUCTION}"

    return Spec(render, names[: hops + 1], "var", key=f"vt|{names}|{values}")


def _vocab_words(rng: random.Random, n: int, exclude: set[str] = frozenset()) -> list[str]:
    words = lc.common_words()
    out: list[str] = []
    seen = set(exclude)
    while len(out) < n:
        w = rng.choice(words)
        if w not in seen:
            seen.add(w)
            out.append(w)
    return out


def _cwe(rng: random.Random, level: int) -> Spec:
    n_common, freq_common, freq_rare = 10, 4 + 2 * level, 2
    common = _vocab_words(rng, n_common)
    seed = rng.randrange(2**31)

    def rare(k: int) -> list[str]:
        return _vocab_words(random.Random(seed), k, set(common))

    def render(k: int) -> str:
        words = common * freq_common + rare(k) * freq_rare
        random.Random(seed + k).shuffle(words)
        listing = " ".join(f"{i + 1}. {w}" for i, w in enumerate(words))
        return (
            f"Below is a numbered list of words. In these words, some appear more often than others. "
            f"Memorize the ones that appear most often.\n{listing}\n\nQuestion: What are the {n_common} most "
            f"common words in the above list?\n{lc.ANSWER_INSTRUCTION}"
        )

    return Spec(render, common, "vocab", vocab=lambda k: common + rare(k), key=f"cwe|{common}|{seed}")


def _coded_word(rng: random.Random) -> str:
    return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(4, 6)))


def _fwe(rng: random.Random) -> Spec:
    seed = rng.randrange(2**31)

    def words_of(k: int) -> tuple[list[str], list[str]]:
        r = random.Random(seed)
        vocab_size = max(8, k // 6)
        vocab: list[str] = []
        while len(vocab) < vocab_size:
            w = _coded_word(r)
            if w not in vocab:
                vocab.append(w)
        weights = [1.0 / (i + 1) ** 2 for i in range(vocab_size)]
        total = sum(weights)
        # the three most frequent words stay strictly ahead of the fourth at every size
        counts = [max(1, round(max(k, 40) * w / total)) for w in weights]
        text = [w for w, c in zip(vocab, counts, strict=True) for _ in range(c)]
        random.Random(seed + k).shuffle(text)
        return text, vocab

    def render(k: int) -> str:
        text, _ = words_of(k)
        return (
            "Read the following coded text and track the frequency of each coded word. Find the three most "
            f"frequently appeared coded words.\n{' ... '.join(text)}\n\nQuestion: Do not provide any "
            "explanation. What are the three most frequently appeared words in the above coded text?\n"
            f"{lc.ANSWER_INSTRUCTION}"
        )

    top = words_of(0)[1][:3]
    return Spec(render, top, "vocab", vocab=lambda k: words_of(k)[1], key=f"fwe|{seed}")


def _person(rng: random.Random) -> str:
    return f"{rng.choice(FIRST_NAMES)} {rng.choice(SURNAMES)}"


def _company(rng: random.Random) -> str:
    return f"{rng.choice(COMPANY_A)} {rng.choice(COMPANY_B)}"


def _document(rng: random.Random, fact: str) -> str:
    prose = lc.essay(rng, 3)
    return " ".join(prose[:2] + [fact] + prose[2:])


def _qa(rng: random.Random, hops: int) -> Spec:
    person, company = _person(rng), _company(rng)
    city = rng.choice(CITIES)
    seed = rng.randrange(2**31)
    if hops == 1:
        gold = [_document(rng, f"{person} was born in {city}.")]
        question = f"In which city was {person} born?"
    else:
        gold = [
            _document(rng, f"{person} works for {company}."),
            _document(rng, f"{company} has its headquarters in {city}."),
        ]
        question = f"In which city are the headquarters of the company that {person} works for?"
    depths = sorted(rng.random() for _ in gold)

    def distractor(i: int) -> str:
        r = random.Random(stable_hash(seed, i))
        other, other_city = _person(r), r.choice([c for c in CITIES if c != city])
        if other == person:
            return _document(r, "The archive kept no record of this.")
        if hops == 1:
            return _document(r, f"{other} was born in {other_city}.")
        other_company = _company(r)
        if other_company == company:
            return _document(r, f"{other} once visited {other_city}.")
        fact = (
            f"{other} works for {other_company}."
            if i % 2
            else f"{other_company} has its headquarters in {other_city}."
        )
        return _document(r, fact)

    def render(k: int) -> str:
        docs = lc.insert_at_depths([distractor(i) for i in range(k)], gold, depths)
        body = "\n\n".join(f"Document {i + 1}:\n{d}" for i, d in enumerate(docs))
        return (
            f"Answer the question based on the given documents.\n\n{body}\n\nQuestion: {question}\n"
            f"{lc.ANSWER_INSTRUCTION}"
        )

    return Spec(
        render, [city], "vocab", vocab=lambda k: list(CITIES), key=f"qa{hops}|{person}|{company}|{city}"
    )


def make_spec(task: str, rng: random.Random, level: int) -> Spec:
    """The drawn content of one RULER task (any length)."""
    table: dict[str, Callable[[], Spec]] = {
        "niah_single_1": lambda: _niah(rng, "noise", "word", "number", 1, 1, 1),
        "niah_single_2": lambda: _niah(rng, "essay", "word", "number", 1, 1, 1),
        "niah_single_3": lambda: _niah(rng, "essay", "word", "uuid", 1, 1, 1),
        "niah_multikey_1": lambda: _niah(rng, "essay", "word", "number", 4, 1, 1),
        "niah_multikey_2": lambda: _niah(rng, "needle", "word", "number", 1, 1, 1),
        "niah_multikey_3": lambda: _niah(rng, "needle", "uuid", "uuid", 1, 1, 1),
        "niah_multivalue": lambda: _niah(rng, "essay", "word", "number", 1, 4, 1),
        "niah_multiquery": lambda: _niah(rng, "essay", "word", "number", 4, 1, 4),
        "vt": lambda: _vt(rng),
        "cwe": lambda: _cwe(rng, level),
        "fwe": lambda: _fwe(rng),
        "qa_1": lambda: _qa(rng, 1),
        "qa_2": lambda: _qa(rng, 2),
    }
    if task not in table:
        raise ValueError(f"longctx.ruler: unknown task '{task}' (valid: {', '.join(TASKS)})")
    return table[task]()


def spec_meta(spec: Spec, k: int) -> dict[str, Any]:
    """The scoring meta of a spec rendered with k filler units."""
    meta: dict[str, Any] = {"answers": spec.answers, "candidate_kind": spec.candidate_kind}
    if spec.candidate_kind == "vocab":
        meta["candidate_vocab"] = spec.vocab(k)
    return meta


@register_env("longctx.ruler")
class RulerDomain(lc.LongContextDomain):
    description = "RULER's 13 long-context tasks (retrieval, tracing, aggregation, QA), 1k-32k tokens"

    def __init__(self, tokenizer: str = "smollm2-135m", tasks: list[str] | None = None) -> None:
        self.tokenizer = tokenizer
        self.tasks = lc.check_options("longctx.ruler", tasks, TASKS)
        self.difficulties = sorted(lc.LEVEL_TOKENS)

    def split_tasks(self) -> list[tuple[str, lc.LongContextDomain]]:
        return [(name, RulerDomain(self.tokenizer, [name])) for name in self.tasks]

    def task(self, split: str, difficulty: int, index: int, seed: int = 0) -> Task:
        def make(rng: random.Random):
            name = self.tasks[rng.randrange(len(self.tasks))]
            spec = make_spec(name, random.Random(rng.randrange(2**63)), difficulty)

            def build() -> Task:
                target = lc.level_tokens(difficulty)
                return self.sized(
                    difficulty, target, spec.render, lambda k: {**spec_meta(spec, k), "task": name}
                )

            return f"longctx.ruler|{name}|{spec.key}", build

        return self.draw(split, difficulty, index, seed, make)
