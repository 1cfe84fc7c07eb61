"""`instruct.constraints`: each checker on hand-made passing and failing answers (at its boundaries),
the empty-answer rule, the conflict table, references meeting every constraint, exact partial credit,
and hostile answers scored as failures without raising."""

from __future__ import annotations

import itertools
import json

import pytest

from posttrain.envs import get_domain, run_episode
from posttrain.envs.domains import instruct
from posttrain.envs.domains.instruct import (
    ALL_KINDS,
    CONFLICT_PAIRS,
    EASY_KINDS,
    check_constraint,
    conflicts,
    contains_word,
    describe,
    highlights,
    prompt_text,
    score_instruct,
)
from posttrain.types import Message, Task

from .conftest import run, step_twice

NAME = "instruct.constraints"


def ok(kind: str, text: str, **params) -> bool:
    return check_constraint({"kind": kind, **params}, text)


def _task(constraints: list[dict], topic: str = "gardening") -> Task:
    meta = {"topic": topic, "request": f"Write a short paragraph about {topic}.", "constraints": constraints}
    meta["kinds"] = [c["kind"] for c in constraints]
    prompt = [Message(role="user", content=prompt_text(meta))]
    return Task(id="t", domain=NAME, difficulty=len(constraints) - 1, prompt=prompt, meta=meta)


def _episode(task: Task, text):
    d = get_domain(NAME)
    return run(run_episode(d.make_env(), task, [text]))


# ---- checkers ----


def test_word_limits_at_their_boundaries():
    ten = "one two three four five six seven eight nine ten"
    assert ok("max_words", ten, n=10) and not ok("max_words", ten + " eleven", n=10)
    assert ok("min_words", ten, n=10) and not ok("min_words", ten, n=11)
    # IFEval's tokenizer (\w+): "don't" is two words
    assert not ok("max_words", "I don't like this at all", n=6) and ok(
        "max_words", "I don't like this at all", n=7
    )


def test_letter_case():
    assert ok("lowercase", "all of these words are lower case.")
    assert not ok("lowercase", "all of these words are lower Case.")
    assert ok("uppercase", "ALL OF THESE WORDS ARE UPPER CASE 42.")
    assert not ok("uppercase", "ALL OF THESE WORDS ARE UPPER CASe.")


def test_no_commas():
    assert ok("no_commas", "There is not a single comma here.")
    assert not ok("no_commas", "There is one comma, right here.")
    assert not ok("no_commas", "A fullwidth comma\uff0c counts as well here.")


def test_keywords_and_forbidden_words_match_whole_words_case_insensitively():
    assert not contains_word("we concatenate two strings", "cat")
    assert contains_word("the Cat's bowl is empty", "cat") and contains_word("A CAT.", "cat")
    assert not ok("keywords", "We concatenate strings in this program.", words=["cat"])
    assert ok("keywords", "The River runs past the old lamp.", words=["river", "lamp"])
    assert not ok("keywords", "The river runs past the old lamps.", words=["river", "lamp"])
    assert ok("forbidden_word", "We concatenate strings in this program.", word="cat")
    assert not ok("forbidden_word", "My CAT sleeps all day long.", word="cat")


def test_letter_frequency_counts_either_case():
    assert ok("letter_frequency", "Eve sees three bees today.", letter="e", n=8)  # E,e,e,e,e,e,e,e
    assert not ok("letter_frequency", "Eve sees three bees today.", letter="e", n=9)


def test_start_word():
    assert ok("start_word", "  Today we walk to the river.", word="Today")
    assert ok("start_word", "today we walk to the river.", word="Today")
    assert not ok("start_word", '"Today we walk to the river."', word="Today")
    assert not ok("start_word", "Todays walk goes to the river.", word="Today")
    assert not ok("start_word", "<<Walk>> Today we walk to the river.", word="Today")


def test_end_phrase_allows_only_whitespace_after_it():
    body = "Here is my short answer for you."
    phrase = "Is there anything else I can help with?"
    assert ok("end_phrase", f"{body} {phrase}", phrase=phrase)
    assert ok("end_phrase", f"{body}\n{phrase}   \n\t ", phrase=phrase)
    assert ok("end_phrase", f"{body} is  there anything\nelse i can help with?", phrase=phrase)
    assert not ok("end_phrase", f"{body} {phrase} Thanks", phrase=phrase)
    assert not ok("end_phrase", f"{body} {phrase[:-1]}", phrase=phrase)
    assert not ok("end_phrase", f"{body} This{phrase}", phrase="is there anything else I can help with?")


def test_bullets_count_exactly():
    def bullets(k: int) -> str:
        return "Here is my list of points:\n" + "\n".join(f"* point number {i}" for i in range(k))

    assert ok("bullets", bullets(3), n=3)
    assert not ok("bullets", bullets(2), n=3) and not ok("bullets", bullets(4), n=3)
    assert ok("bullets", "Mixed markers are fine here:\n- one\n+ two\n  * three", n=3)
    # a divider, a line opening with a highlight, and a bare marker are no bullets
    assert ok("bullets", "Some text goes here\n***\n*bold* start\n* \n* one\n* two", n=2)


def test_paragraphs_split_on_divider_lines_only():
    assert ok("paragraphs", "First paragraph is here.\n***\nSecond paragraph is here.", n=2)
    assert not ok("paragraphs", "First paragraph is here.\n***\nSecond paragraph is here.", n=3)
    assert not ok("paragraphs", "***\nFirst paragraph is here.\n***\nSecond one.", n=3)  # an empty one
    assert not ok("paragraphs", "First paragraph is here *** second paragraph is here.", n=2)
    assert ok("paragraphs", "One paragraph with a few words.", n=1)


def test_title_postscript_highlights_quotes():
    assert ok("title", "<<poem of joy>>\nThe rest of the poem.")
    assert not ok("title", "<< >> and then the rest of the poem.")
    assert not ok("title", "No title anywhere in this answer.")
    assert ok("postscript", "Main body of the letter.\nP.S. see you soon")
    assert ok("postscript", "main body of the letter.\n\np.s. see you soon")
    assert not ok("postscript", "Main body of the letter. P.S. see you soon")  # not at a line start
    assert not ok("postscript", "Main body of the letter here.\nP.S.")  # nothing after the marker
    assert highlights("Some *first* and **second** parts.") == 2
    assert highlights("* a bullet point\n* this is * not one") == 0
    assert ok("highlights", "A *key idea* and **another one** too.", n=2)
    assert not ok("highlights", "A *key idea* and another one too.", n=2)
    assert ok("quotes", '  "Everything I say is quoted here."  ')
    assert ok("quotes", "\u201cEverything I say is quoted here.\u201d")
    assert not ok("quotes", '"Everything I say is quoted here.')


def test_json_answers():
    assert ok("json", '{"answer": "a b c d e"}')
    assert ok("json", '```json\n{"answer": "a b c d e"}\n```')
    assert ok("json", '```\n["a", "b", "c", "d", "e"]\n```')
    assert not ok("json", '{"answer": "a b c d e",}')  # invalid JSON
    assert not ok("json", '"a string is not an object or array"')
    assert not ok("json", 'Here it is: {"answer": "a b c d e"}')  # text outside the JSON
    assert not ok("json", '```json\n{"answer": "a b c d e"}\n```\nHope it helps.')
    assert not ok("json", "[" * 50_000 + " a b c d e")  # too deep for the parser: a failure, no raise


def test_every_kind_has_a_checker_and_an_instruction():
    assert set(instruct.CHECKERS) == set(ALL_KINDS) and set(EASY_KINDS) < set(ALL_KINDS)
    assert describe({"kind": "keywords", "words": ["river", "lamp"]}) == (
        "Include the keywords 'river' and 'lamp' in the response."
    )
    assert describe({"kind": "max_words", "n": 40}) == "Answer with at most 40 words."


# ---- the empty-answer rule ----

# params under which each kind accepts a terse, commaless, lowercase, bullet-free answer
PERMISSIVE = {
    "lowercase": {},
    "no_commas": {},
    "max_words": {"n": 50},
    "forbidden_word": {"word": "zebra"},
    "bullets": {"n": 0},
    "highlights": {"n": 0},
    "letter_frequency": {"letter": "e", "n": 0},
    "uppercase": {},
    "min_words": {"n": 0},
}
SAMPLE_PARAMS = {
    "keywords": {"words": ["ok"]},
    "start_word": {"word": "ok"},
    "end_phrase": {"phrase": "ok"},
    "paragraphs": {"n": 1},
}


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_an_empty_or_near_empty_answer_passes_no_constraint(kind):
    params = PERMISSIVE.get(kind) or SAMPLE_PARAMS.get(kind, {})
    for text in ["", "   \n\t", "...", '""', "{}", "ok", "ok ok ok ok", "<<ok>>", None, 42, b"bytes here"]:
        assert not check_constraint({"kind": kind, **params}, text), (kind, text)


def test_a_five_word_answer_is_substantial():
    assert ok("no_commas", "this answer has five words") and not ok("no_commas", "this has four words")


# ---- generation ----


def test_conflicting_or_repeated_kinds_are_never_drawn():
    assert all(a in ALL_KINDS and b in ALL_KINDS for a, b, _ in CONFLICT_PAIRS)
    assert (
        conflicts("lowercase", "uppercase")
        and conflicts("json", "bullets")
        and conflicts("quotes", "end_phrase")
    )
    d = get_domain(NAME)
    seen: set[str] = set()
    for level in d.difficulties:
        for i in range(300):
            task = d.task("train", level, i)
            kinds = [c["kind"] for c in task.meta["constraints"]]
            assert len(kinds) == level + 1 and len(set(kinds)) == len(kinds), kinds
            assert not any(conflicts(a, b) for a, b in itertools.combinations(kinds, 2)), kinds
            if level == 0:
                assert kinds[0] in EASY_KINDS
            seen.update(kinds)
            r, rewards, _ = score_instruct(d.reference(task)[0], task.meta)
            assert r == 1.0 and rewards["success"] == 1.0, (task.meta, d.reference(task))
    assert seen == set(ALL_KINDS)


@pytest.mark.parametrize("split", ["train", "heldout"])
def test_references_meet_every_constraint(split):
    d = get_domain(NAME)
    for level in d.difficulties:
        for i in range(50):
            task = d.task(split, level, i)
            res = _episode(task, d.reference(task)[0])
            assert (
                res.done and res.reward == 1.0 and res.rewards == {"constraints_passed": 1.0, "success": 1.0}
            )
            assert res.info["failed"] == [] and res.info["unparseable"] == 0 and res.info["turns"] == 1


def test_tasks_are_deterministic_with_serialisable_meta():
    d = get_domain(NAME)
    task = d.task("heldout", 3, 7, seed=5)
    assert json.dumps(task.to_dict(), sort_keys=True) == json.dumps(
        d.task("heldout", 3, 7, seed=5).to_dict(), sort_keys=True
    )
    assert json.loads(json.dumps(task.meta)) == task.meta
    assert task.prompt[0].content == prompt_text(task.meta)
    assert task.prompt[0].content.startswith(task.meta["request"] + " ")


def test_max_words_is_never_below_the_reference_length():
    d = get_domain(NAME)
    for i in range(200):
        task = d.task("train", 3, i)
        for c in task.meta["constraints"]:
            if c["kind"] == "max_words":
                assert c["n"] >= instruct.count_words(d.reference(task)[0]) and c["n"] >= 15


def test_reference_blocks_hold_no_topic_word_and_no_comma():
    blocks = [
        *instruct.FILLER,
        *instruct.TIPS,
        *instruct.KEYWORDS,
        *instruct.START_WORDS,
        *instruct.END_PHRASES,
        *instruct.HIGHLIGHT_WORDS,
        *(w for ws in instruct.LETTER_WORDS.values() for w in ws),
        instruct.POSTSCRIPT,
        instruct.GENERIC_SUBJECT,
        "This is a short note on. It reminds me of. Remember. Here are some tips: A note on response",
    ]
    text = "\n".join(blocks)
    assert "," not in text and '"' not in text
    for _, _, words in instruct.TOPICS:
        for w in words:
            assert not contains_word(text, w), w


def test_a_forbidden_topic_word_is_avoided_by_the_reference():
    task = _task([{"kind": "forbidden_word", "word": "chess"}], topic="playing chess")
    ref = get_domain(NAME).reference(task)[0]
    assert not contains_word(ref, "chess") and "this subject" in ref
    assert _episode(task, ref).rewards["success"] == 1.0


# ---- scoring ----


def test_partial_credit_is_the_exact_fraction_of_constraints_met():
    task = _task(
        [
            {"kind": "lowercase"},
            {"kind": "no_commas"},
            {"kind": "keywords", "words": ["river"]},
        ]
    )
    res = _episode(task, "gardening by the river is calm, quiet and slow.")
    assert res.reward == pytest.approx(2 / 3)
    assert res.rewards == {"constraints_passed": pytest.approx(2 / 3), "success": 0.0}
    assert res.info["failed"] == ["no_commas"] and res.info["unparseable"] == 0
    assert res.info["turns"] == 1 and res.info["infra_failure"] is False

    task4 = _task(
        [
            {"kind": "uppercase"},
            {"kind": "json"},
            {"kind": "max_words", "n": 8},
            {"kind": "highlights", "n": 1},
        ]
    )
    res = _episode(task4, "I LIKE TO GROW *TOMATOES* IN SUMMER AND IN AUTUMN")
    assert res.rewards == {"constraints_passed": 0.5, "success": 0.0}
    assert res.info["failed"] == ["json", "max_words"] and res.info["unparseable"] == 1


def test_echoing_the_prompt_scores_zero():
    d = get_domain(NAME)
    for level in d.difficulties:
        for i in range(20):
            task = d.task("train", level, i)
            prompt = task.prompt[0].content
            for text in (prompt, prompt.lower(), f"Sure! {prompt}\n{d.reference(task)[0]}"):
                res = _episode(task, text)
                assert res.reward == 0.0 and res.rewards["success"] == 0.0, (task.meta, text)
                assert res.info["echoed_prompt"] == 1


def test_hostile_answers_score_failures_without_raising():
    d = get_domain(NAME)
    task = _task([{"kind": "lowercase"}, {"kind": "no_commas"}, {"kind": "max_words", "n": 10**7}])
    good = "gardening is a quiet and patient joy."
    assert _episode(task, good).rewards["success"] == 1.0
    megabyte = "word " * 200_000
    for text in [None, 42, b"gardening is a quiet joy", ["a list"], megabyte, good * 10_000, "\ud800" * 10]:
        res = _episode(task, text)
        assert res.done and res.reward == 0.0 and res.rewards["success"] == 0.0, str(text)[:40]
        assert res.info["infra_failure"] is False
    assert _episode(task, megabyte).info["too_long"] == 1
    json_task = d.task(
        "train", 1, next(i for i in range(200) if "json" in d.task("train", 1, i).meta["kinds"])
    )
    for text in ["[" * 40_000, "```json\n" + "{" * 40_000 + "\n```", "\x00\xff\ufffd" * 50]:
        res = _episode(json_task, text)
        assert res.rewards["success"] == 0.0 and res.info["unparseable"] == 1


def test_step_after_done_repeats_the_result():
    d = get_domain(NAME)
    task = d.task("train", 1, 0)
    first, again = step_twice(d, task, "")
    assert first.done and first.reward == again.reward == 1.0
