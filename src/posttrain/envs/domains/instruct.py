"""`instruct.constraints`: IFEval-style instruction following. A writing request plus 1-4 plainly stated,
verifiable constraints (level + 1; level 0 from the easiest kinds), each checked strictly by a pure
checker here. Reward = `constraints_passed`, the fraction of constraints met; `success` = all met.
An answer under 5 words, over 50,000 characters, or repeating an instruction of the prompt passes no
constraint (else terse or parroted output would satisfy "no commas" or "include the keyword").
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable
from typing import Any

from posttrain.envs.base import Domain, Environment, SingleTurnEnv
from posttrain.envs.registry import register_env
from posttrain.types import Message, Task

MIN_ANSWER_WORDS = 5
MAX_ANSWER_CHARS = 50_000

# Words as IFEval counts them (nltk's RegexpTokenizer(r"\w+")): "don't" is two words, "P.S." two.
WORD_RE = re.compile(r"\w+")

# (noun phrase, activity, topic words): the topic words are what a `forbidden_word` forbids, so the
# forbidden word is one the model would naturally use. No reference building block uses a topic word.
TOPICS: list[tuple[str, str, tuple[str, str]]] = [
    ("gardening", "grow vegetables at home", ("garden", "plants")),
    ("learning a new language", "learn a new language", ("language", "grammar")),
    ("cycling to work", "cycle to work every day", ("bike", "commute")),
    ("public libraries", "use their local library more", ("library", "books")),
    ("rainy days", "enjoy a rainy day indoors", ("rain", "umbrella")),
    ("board games", "host a board game night", ("game", "dice")),
    ("cooking at home", "cook more meals at home", ("recipe", "kitchen")),
    ("morning routines", "build a better morning routine", ("morning", "coffee")),
    ("saving money", "save money each month", ("money", "budget")),
    ("running", "train for a first 5k race", ("run", "shoes")),
    ("camping", "go camping for the first time", ("tent", "campfire")),
    ("playing the guitar", "learn to play the guitar", ("guitar", "chords")),
    ("keeping a journal", "keep a daily journal", ("journal", "writing")),
    ("adopting a dog", "adopt a dog", ("dog", "puppy")),
    ("baking bread", "bake bread at home", ("bread", "flour")),
    ("visiting museums", "plan a museum visit", ("museum", "art")),
    ("drinking enough water", "drink more water", ("water", "thirst")),
    ("getting good sleep", "sleep better", ("sleep", "bed")),
    ("moving to a new city", "move to a new city", ("city", "apartment")),
    ("volunteering", "start volunteering", ("volunteer", "community")),
    ("learning to swim", "learn to swim", ("swim", "pool")),
    ("phone photography", "take better photos with a phone", ("photo", "camera")),
    ("hiking", "plan a day hike", ("trail", "mountain")),
    ("recycling", "recycle more at home", ("recycle", "plastic")),
    ("working from home", "work from home productively", ("office", "desk")),
    ("studying for exams", "study for an exam", ("exam", "notes")),
    ("birdwatching", "start birdwatching", ("birds", "binoculars")),
    ("painting with watercolors", "start painting with watercolors", ("paint", "brush")),
    ("learning to code", "learn to code", ("code", "computer")),
    ("meditation", "start meditating", ("breath", "calm")),
    ("planning a picnic", "plan a picnic", ("picnic", "basket")),
    ("growing houseplants", "keep houseplants alive", ("pot", "leaves")),
    ("making friends as an adult", "make new friends as an adult", ("friends", "conversation")),
    ("public speaking", "give a good speech", ("audience", "nervous")),
    ("traveling by train", "plan a long train journey", ("train", "ticket")),
    ("composting", "start composting", ("compost", "waste")),
    ("knitting", "learn to knit", ("yarn", "needles")),
    ("stargazing", "go stargazing", ("stars", "telescope")),
    ("fixing a flat tire", "fix a flat bicycle tire", ("tire", "pump")),
    ("writing letters by hand", "write more letters by hand", ("envelope", "pen")),
    ("eating more vegetables", "eat more vegetables", ("vegetables", "salad")),
    ("learning to drive", "learn to drive", ("car", "road")),
    ("decluttering a home", "declutter their home", ("clutter", "boxes")),
    ("playing chess", "get better at chess", ("chess", "board")),
    ("going to the beach", "plan a day at the beach", ("beach", "sand")),
    ("starting a new job", "prepare for the first day at a new job", ("job", "boss")),
    ("family dinners", "have more family dinners", ("family", "dinner")),
    ("local history", "learn about the history of their town", ("history", "past")),
    ("walking in the park", "walk more often", ("park", "walk")),
    ("fishing", "go fishing for the first time", ("fish", "lake")),
]

REQUESTS = [
    "Write a short paragraph about {noun}.",
    "Write a short blog post about {noun}.",
    "Write a friendly email to a friend about {noun}.",
    "Write a short story that involves {noun}.",
    "Write a short speech about {noun}.",
    "Write a diary entry about {noun}.",
    "Describe what people enjoy about {noun}.",
    "Give advice to someone who wants to {activity}.",
    "Write a short guide for someone who wants to {activity}.",
    "Explain how to {activity}.",
]

KEYWORDS = [
    "river", "lamp", "window", "orange", "mirror", "candle", "bridge", "silver", "whisper", "cloud",
    "ladder", "pepper", "forest", "violin", "blanket", "harbor", "pencil", "meadow", "anchor", "thunder",
    "velvet", "lantern", "marble", "compass", "feather", "canyon", "pillow", "rocket", "island", "kettle",
]  # fmt: skip
START_WORDS = [
    "Today", "Honestly", "Imagine", "Yes", "Well", "Remember", "Sometimes", "Listen", "Interestingly",
    "Surprisingly", "Ideally", "Often",
]  # fmt: skip
END_PHRASES = [
    "Is there anything else I can help with?",
    "Let me know if you have additional questions.",
    "Hope this helps.",
    "Any other questions?",
    "That is all for now.",
    "Thank you for reading.",
]
LETTERS = "eaotinsr"

# Reference building blocks: no commas, no double quotes, no topic word (tested).
FILLER = [
    "Small steps add up over time.",
    "Patience matters more than speed.",
    "It helps to set a simple goal.",
    "Everyone starts as a beginner.",
    "Mistakes are part of learning.",
    "A little planning goes a long way.",
    "Try to enjoy the process.",
    "Share the experience with others.",
    "Keep an open mind.",
    "Consistency beats intensity.",
]
TIPS = [
    "Start with small steps.",
    "Set a clear goal.",
    "Ask for help when needed.",
    "Keep track of progress.",
    "Celebrate every win.",
    "Rest when tired.",
]
HIGHLIGHT_WORDS = ["patience", "practice", "curiosity", "focus"]
LETTER_WORDS = {
    "e": ["eleven", "freeze", "degree", "between"],
    "a": ["banana", "alpaca", "cascade", "drama"],
    "o": ["cocoon", "tomorrow", "motto", "kangaroo"],
    "t": ["tattoo", "attitude", "tight", "total"],
    "i": ["initial", "mini", "bikini", "civilian"],
    "n": ["nine", "noon", "banner", "cannon"],
    "s": ["success", "sisters", "seasons", "assess"],
    "r": ["error", "mirror", "terror", "barrier"],
}
POSTSCRIPT = "P.S. Thanks for reading."
GENERIC_SUBJECT = "this subject"

ALL_KINDS = [
    "lowercase", "uppercase", "no_commas", "max_words", "min_words", "keywords", "forbidden_word",
    "letter_frequency", "start_word", "end_phrase", "bullets", "paragraphs", "title", "postscript",
    "highlights", "quotes", "json",
]  # fmt: skip
# Level 0 draws from these: each can be met by a plain, short answer that follows one instruction.
EASY_KINDS = [
    "lowercase", "no_commas", "max_words", "min_words", "keywords", "forbidden_word", "start_word", "quotes",
]  # fmt: skip

# The conflict table: pairs never drawn together, with the reason. Counts meet `max_words` without a
# conflict: its N is raised to at least the reference's word count when the task is drawn.
CONFLICT_PAIRS: list[tuple[str, str, str]] = [
    ("lowercase", "uppercase", "contradictory letter case"),
    ("max_words", "min_words", "one word-count limit per task, as in IFEval"),
    ("quotes", "start_word", "the answer must begin with a quotation mark"),
    ("quotes", "end_phrase", "the answer must end with a quotation mark"),
    ("json", "quotes", "a quoted answer is a JSON string, not an object or array"),
    ("json", "start_word", "a JSON answer begins with { [ or ```"),
    ("json", "end_phrase", "a JSON answer ends with } ] or ```"),
    ("json", "bullets", "no line of valid JSON starts with a bullet marker"),
    ("json", "paragraphs", "a line holding only *** is not valid JSON"),
    ("json", "postscript", "no line of valid JSON starts with P.S."),
    ("json", "title", "a title inside a JSON string is no title of the response"),
    ("json", "no_commas", "a JSON object of several fields needs commas"),
]
CONFLICTS: frozenset[frozenset[str]] = frozenset(frozenset((a, b)) for a, b, _ in CONFLICT_PAIRS)


def conflicts(a: str, b: str) -> bool:
    return frozenset((a, b)) in CONFLICTS


# ---- checkers: pure functions of (text, params) -> bool, linear in the text ----


def count_words(text: str) -> int:
    return sum(1 for _ in WORD_RE.finditer(text))


def contains_word(text: str, word: str) -> bool:
    """`word` as a whole word, case-insensitive: 'cat' is in "the cat's bowl", not in "concatenate"."""
    return re.search(rf"(?<!\w){re.escape(word)}(?!\w)", text, re.IGNORECASE) is not None


def parse_json_answer(text: str) -> Any:
    """The JSON object or array the whole answer holds (optionally in ``` or ```json fences); None if
    it holds anything else: invalid JSON, a bare scalar, text outside the fences."""
    s = text.strip()
    fenced = re.fullmatch(r"```(?:json)?[ \t]*\n?(.*?)\n?[ \t]*```", s, re.DOTALL | re.IGNORECASE)
    if fenced:
        s = fenced.group(1).strip()
    try:
        value = json.loads(s)
    except (ValueError, RecursionError):
        return None
    return value if isinstance(value, dict | list) else None


def _lowercase(text: str) -> bool:
    return text == text.lower()


def _uppercase(text: str) -> bool:
    return text == text.upper()


def _no_commas(text: str) -> bool:
    return "," not in text and "\uff0c" not in text  # ASCII and fullwidth commas


def _max_words(text: str, n: int) -> bool:
    return count_words(text) <= n


def _min_words(text: str, n: int) -> bool:
    return count_words(text) >= n


def _keywords(text: str, words: list[str]) -> bool:
    return all(contains_word(text, w) for w in words)


def _forbidden_word(text: str, word: str) -> bool:
    return not contains_word(text, word)


def _letter_frequency(text: str, letter: str, n: int) -> bool:
    return text.casefold().count(letter) >= n


def _start_word(text: str, word: str) -> bool:
    """The answer begins (after whitespace) with the word itself: no quote, markdown or title before it."""
    first = WORD_RE.match(text.lstrip())
    return first is not None and first.group().casefold() == word.casefold()


def _end_phrase(text: str, phrase: str) -> bool:
    """The answer ends with the phrase: letter case and runs of whitespace aside, nothing may follow it
    but whitespace, and it is not the tail of a longer word."""
    norm = " ".join(text.split()).casefold()
    target = " ".join(phrase.split()).casefold()
    if not norm.endswith(target):
        return False
    before = norm[: len(norm) - len(target)]
    return not (before and (before[-1].isalnum() or before[-1] == "_"))


def _bullets(text: str, n: int) -> bool:
    """Exactly n markdown bullet lines ("* ", "- " or "+ " and some text)."""
    return len(re.findall(r"^[ \t]*[*+-][ \t]+\S", text, re.MULTILINE)) == n


def _paragraphs(text: str, n: int) -> bool:
    """Exactly n non-empty paragraphs separated by lines that hold only the divider ***."""
    parts = re.split(r"^[ \t]*\*\*\*[ \t]*$", text, flags=re.MULTILINE)
    return len(parts) == n and all(WORD_RE.search(p) for p in parts)


def _title(text: str) -> bool:
    return any(WORD_RE.search(m.group(1)) for m in re.finditer(r"<<([^\n<>]*)>>", text))


def _postscript(text: str) -> bool:
    """A line starting with P.S. (any case, "P. S." too) with some text after the marker."""
    marker = re.search(r"^[ \t]*p\.[ \t]?s\.", text, re.MULTILINE | re.IGNORECASE)
    return marker is not None and WORD_RE.search(text, marker.end()) is not None


def highlights(text: str) -> int:
    """Markdown emphasis spans on one line, *x* or **x**, opened and closed next to non-space text
    (so a "* " bullet marker opens none)."""
    return len(re.findall(r"(?<!\*)(\*\*?)(?![\s*])[^\n*]+?(?<![\s*])\1(?!\*)", text))


def _highlights(text: str, n: int) -> bool:
    return highlights(text) >= n


def _quotes(text: str) -> bool:
    s = text.strip()
    return len(s) >= 2 and ((s[0] == s[-1] == '"') or (s[0] == "\u201c" and s[-1] == "\u201d"))


def _json(text: str) -> bool:
    return parse_json_answer(text) is not None


CHECKERS: dict[str, Callable[..., bool]] = {
    "lowercase": _lowercase,
    "uppercase": _uppercase,
    "no_commas": _no_commas,
    "max_words": _max_words,
    "min_words": _min_words,
    "keywords": _keywords,
    "forbidden_word": _forbidden_word,
    "letter_frequency": _letter_frequency,
    "start_word": _start_word,
    "end_phrase": _end_phrase,
    "bullets": _bullets,
    "paragraphs": _paragraphs,
    "title": _title,
    "postscript": _postscript,
    "highlights": _highlights,
    "quotes": _quotes,
    "json": _json,
}


def params_of(constraint: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in constraint.items() if k != "kind"}


def substantial(text: Any) -> bool:
    """The rule every constraint applies first: a str of at most MAX_ANSWER_CHARS characters holding at
    least MIN_ANSWER_WORDS words. Anything else (empty, whitespace, "ok", a non-str) passes no constraint."""
    if not isinstance(text, str) or len(text) > MAX_ANSWER_CHARS:
        return False
    for words, _ in enumerate(WORD_RE.finditer(text), start=1):
        if words >= MIN_ANSWER_WORDS:
            return True
    return False


def check_constraint(constraint: dict[str, Any], text: Any) -> bool:
    """Whether `text` meets one constraint ({"kind": ..., **params}); False for an unsubstantial answer."""
    return substantial(text) and CHECKERS[constraint["kind"]](text, **params_of(constraint))


# ---- prompt text ----


def _quoted_list(words: list[str]) -> str:
    quoted = [f"'{w}'" for w in words]
    return quoted[0] if len(quoted) == 1 else ", ".join(quoted[:-1]) + " and " + quoted[-1]


def describe(constraint: dict[str, Any]) -> str:
    """The instruction sentence(s) the prompt states for one constraint, IFEval's wording."""
    kind, p = constraint["kind"], params_of(constraint)
    return {
        "lowercase": lambda: (
            "Your entire response should be in English, and in all lowercase letters. "
            "No capital letters are allowed."
        ),
        "uppercase": lambda: "Your entire response should be in English, and in all capital letters.",
        "no_commas": lambda: "Do not include any commas in your response.",
        "max_words": lambda: f"Answer with at most {p['n']} words.",
        "min_words": lambda: f"Answer with at least {p['n']} words.",
        "keywords": lambda: (
            f"Include the keyword{'s' if len(p['words']) > 1 else ''} {_quoted_list(p['words'])} in the response."
        ),
        "forbidden_word": lambda: f"Do not include the word '{p['word']}' in the response.",
        "letter_frequency": lambda: (
            f"In your response, the letter '{p['letter']}' should appear at least {p['n']} times."
        ),
        "start_word": lambda: f"Your response must start with the word '{p['word']}'.",
        "end_phrase": lambda: (
            f"Finish your response with this exact phrase '{p['phrase']}'. "
            "No other words should follow this phrase."
        ),
        "bullets": lambda: (
            f"Your response should contain exactly {p['n']} bullet points. "
            "Use the markdown bullet points such as: * This is a point."
        ),
        "paragraphs": lambda: (
            f"There should be {p['n']} paragraphs. Paragraphs are separated with the markdown divider: ***"
        ),
        "title": lambda: (
            "Your answer must contain a title, wrapped in double angular brackets, such as <<poem of joy>>."
        ),
        "postscript": lambda: (
            "At the end of your response, please explicitly add a postscript starting with P.S."
        ),
        "highlights": lambda: (
            f"Highlight at least {p['n']} sections in your answer with markdown, i.e. *highlighted section*."
        ),
        "quotes": lambda: "Wrap your entire response with double quotation marks.",
        "json": lambda: (
            "Entire output should be wrapped in JSON format. You can use markdown ticks such as ```."
        ),
    }[kind]()


def prompt_text(meta: dict[str, Any]) -> str:
    return " ".join([meta["request"], *(describe(c) for c in meta["constraints"])])


def _normalise(text: str) -> str:
    return " ".join(text.split()).casefold()


def echoes_prompt(text: str, meta: dict[str, Any]) -> bool:
    """Whether the answer repeats the request or any constraint's instruction verbatim (case and
    whitespace aside): parroting the prompt would otherwise meet keyword and letter constraints."""
    answer = _normalise(text)
    return any(
        _normalise(s) in answer for s in [meta["request"], *(describe(c) for c in meta["constraints"])]
    )


# ---- scoring ----


def score_instruct(text: Any, meta: dict[str, Any]) -> tuple[float, dict[str, float], dict[str, Any]]:
    """(reward, components, info) for one answer; never raises on any model output (a non-str scores as
    an empty answer). info: `failed` (kinds not met, in prompt order), `unparseable` (1 when the answer is
    not substantial, or a `json` constraint's JSON does not parse), `echoed_prompt`, `too_long`, `words`."""
    constraints = meta["constraints"]
    answer = text if isinstance(text, str) else ""
    too_long = len(answer) > MAX_ANSWER_CHARS
    echoed = not too_long and echoes_prompt(answer, meta)
    passed = [not echoed and check_constraint(c, answer) for c in constraints]
    frac = sum(passed) / len(constraints)
    kinds = [c["kind"] for c in constraints]
    info = {
        "failed": [k for k, ok in zip(kinds, passed, strict=True) if not ok],
        "unparseable": int(not substantial(answer) or ("json" in kinds and not _json(answer))),
        "echoed_prompt": int(echoed),
        "too_long": int(too_long),
        "words": count_words(answer),
    }
    return frac, {"constraints_passed": frac, "success": float(all(passed))}, info


# ---- generation and the reference response ----


def _draw_kinds(rng: random.Random, level: int) -> list[str]:
    pool = EASY_KINDS if level == 0 else ALL_KINDS
    chosen: list[str] = []
    for _ in range(level + 1):
        options = [k for k in pool if k not in chosen and not any(conflicts(k, c) for c in chosen)]
        chosen.append(rng.choice(options))
    return chosen


def _draw_params(kind: str, rng: random.Random, topic_words: tuple[str, str]) -> dict[str, Any]:
    if kind == "max_words":
        return {"n": rng.randrange(15, 61, 5)}  # raised to the reference's length in `task`
    if kind == "min_words":
        return {"n": rng.randrange(30, 151, 10)}
    if kind == "keywords":
        return {"words": rng.sample(KEYWORDS, rng.choice([1, 2]))}
    if kind == "forbidden_word":
        return {"word": rng.choice(topic_words)}
    if kind == "letter_frequency":
        return {"letter": rng.choice(LETTERS), "n": rng.randrange(5, 16)}
    if kind == "start_word":
        return {"word": rng.choice(START_WORDS)}
    if kind == "end_phrase":
        return {"phrase": rng.choice(END_PHRASES)}
    if kind == "bullets":
        return {"n": rng.randrange(2, 6)}
    if kind == "paragraphs":
        return {"n": rng.randrange(2, 5)}
    if kind == "highlights":
        return {"n": rng.randrange(1, 4)}
    return {}


def reference_response(meta: dict[str, Any]) -> str:
    """A response meeting every constraint of the task: built from blocks that hold no comma and no
    topic word, padded only as far as `min_words` and `letter_frequency` need (so the `max_words` N,
    drawn no lower than this response's length, always holds)."""
    c = {x["kind"]: params_of(x) for x in meta["constraints"]}
    forbidden = c.get("forbidden_word", {}).get("word")
    subject = meta["topic"]
    if forbidden and contains_word(subject, forbidden):
        subject = GENERIC_SUBJECT
    lead = f"This is a short note on {subject}."
    if "start_word" in c:
        lead = f"{c['start_word']['word']} this is a short note on {subject}."
    first = [lead]
    if "keywords" in c:
        first.append(f"It reminds me of {' and '.join(c['keywords']['words'])}.")
    if "highlights" in c:
        first.append(
            "Remember " + " and ".join(f"*{w}*" for w in HIGHLIGHT_WORDS[: c["highlights"]["n"]]) + "."
        )
    letter_words: list[str] = []
    padding: list[str] = []

    def assemble() -> str:
        sentences = first + ([" ".join(letter_words).capitalize() + "."] if letter_words else [])
        if "json" in c:  # conflicts keep bullets, paragraphs, title, postscript and fixed ends out
            inner = " ".join(sentences + padding)
            inner = inner.upper() if "uppercase" in c else inner.lower() if "lowercase" in c else inner
            return json.dumps({"RESPONSE" if "uppercase" in c else "response": inner})
        opening = " ".join(sentences)
        if "title" in c:
            title = f"<<A note on {subject}>>"
            opening = (
                f"{lead}\n{title}\n{' '.join(sentences[1:])}" if "start_word" in c else f"{title}\n{opening}"
            )
        blocks = [opening.strip()]
        if "bullets" in c:
            blocks.append("\n".join(["Here are some tips:"] + [f"* {t}" for t in TIPS[: c["bullets"]["n"]]]))
        if padding:
            blocks.append(" ".join(padding))
        closing = POSTSCRIPT if "postscript" in c else None
        if closing and "end_phrase" in c:
            closing = f"{closing} {c['end_phrase']['phrase']}"
        if "paragraphs" in c:
            n = c["paragraphs"]["n"] - (1 if closing else 0)
            while len(blocks) > n:
                blocks[0:2] = [f"{blocks[0]}\n\n{blocks[1]}"]
            for filler in FILLER[: n - len(blocks)]:
                blocks.insert(1, filler)
            out = "\n***\n".join(blocks + ([closing] if closing else []))
        else:
            out = "\n\n".join(blocks + ([closing] if closing else []))
        if "end_phrase" in c and not closing:
            out = f"{out}\n{c['end_phrase']['phrase']}"
        out = out.upper() if "uppercase" in c else out.lower() if "lowercase" in c else out
        return f'"{out}"' if "quotes" in c else out

    for _ in range(400):  # padding is bounded: min_words <= 150, letter count <= 15
        text = assemble()
        if "letter_frequency" in c and not _letter_frequency(text, **c["letter_frequency"]):
            words = LETTER_WORDS[c["letter_frequency"]["letter"]]
            letter_words.append(words[len(letter_words) % len(words)])
        elif "min_words" in c and not _min_words(text, **c["min_words"]):
            padding.append(FILLER[len(padding) % len(FILLER)])
        else:
            return text
    raise RuntimeError(f"instruct: reference padding did not converge: {meta}")


@register_env("instruct.constraints")
class InstructDomain(Domain):
    description = "IFEval-style writing requests with 1-4 verifiable constraints (case, words, format, ...)"
    difficulties = [0, 1, 2, 3]

    def task(self, split: str, difficulty: int, index: int, seed: int = 0) -> Task:
        def make(rng):
            noun, activity, topic_words = TOPICS[rng.randrange(len(TOPICS))]
            request = rng.choice(REQUESTS).format(noun=noun, activity=activity)
            constraints = [
                {"kind": k, **_draw_params(k, rng, topic_words)} for k in _draw_kinds(rng, difficulty)
            ]
            meta: dict[str, Any] = {"topic": noun, "request": request, "constraints": constraints}
            for con in constraints:
                if con["kind"] == "max_words":  # no lower than the reference needs: always satisfiable
                    need = count_words(reference_response(meta))
                    con["n"] = max(con["n"], -(-need // 5) * 5)
            meta["kinds"] = [con["kind"] for con in constraints]

            def build() -> Task:
                prompt = [Message(role="user", content=prompt_text(meta))]
                return Task(id="", domain=self.name, difficulty=difficulty, prompt=prompt, meta=dict(meta))

            return json.dumps([request, constraints], sort_keys=True), build

        return self.draw(split, difficulty, index, seed, make)

    def reference(self, task: Task) -> list[str]:
        return [reference_response(task.meta)]

    def make_env(self, sandbox: Any = None, chat_format: str = "smollm2") -> Environment:
        return SingleTurnEnv(score_instruct)
