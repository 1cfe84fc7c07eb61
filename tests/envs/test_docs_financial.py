"""docs.financial: deterministic reports of the asked length, disjoint splits, facts that the document
states (the restatement overriding the highlights table), reference answers scoring 1.0, and wrong,
malformed and hostile replies scoring lower without raising."""

from __future__ import annotations

import io
import json

import pytest

from posttrain.envs import get_domain, run_episode
from posttrain.envs.base import split_of
from posttrain.envs.domains import docs_financial as df
from posttrain.envs.tokens import count_tokens

from .conftest import run
from .test_domains_contract import HOSTILE


@pytest.fixture(scope="module")
def domain():
    return get_domain("docs.financial")


def test_report_is_deterministic_and_within_its_token_budget():
    a, b = df.generate_report(11, 2048), df.generate_report(11, 2048)
    assert a.markdown() == b.markdown()
    assert df.generate_report(12, 2048).markdown() != a.markdown()
    n = count_tokens(a.markdown(), "smollm2-135m")
    assert n == a.facts["n_tokens"] and 2048 - 150 < n <= 2048  # one filler paragraph is < 150 tokens
    big = df.generate_report(11, 8192)
    assert 8192 - 150 < count_tokens(big.markdown(), "smollm2-135m") <= 8192
    assert big.facts["revenue"] == a.facts["revenue"]  # the length changes filler only


def test_facts_are_consistent_and_the_restatement_overrides_the_table():
    f = df.generate_report(3, 2048).facts
    for i in range(df.N_YEARS):
        assert f["revenue"][i] == sum(f["segment_revenue"][s][i] for s in f["segments"])
        assert (
            f["operating_income"][i] == f["revenue"][i] - f["cost_of_revenue"][i] - f["operating_expenses"][i]
        )
    md = df.generate_report(3, 2048).markdown()
    ri = f["years"].index(f["restated_year"])
    assert f"{f['previously_reported_revenue']:,} (1)" in md  # the highlights table shows the old figure
    assert f"restated to {f['revenue'][ri]:,}" in md
    assert f["previously_reported_revenue"] != f["revenue"][ri]


def test_hand_computed_answers():
    facts = df.make_facts(__import__("random").Random(0))
    facts.update(
        years=[2020, 2021, 2022, 2023],
        segments=["A", "B"],
        segment_revenue={"A": [100, 110, 90, 120], "B": [50, 80, 60, 40]},
        revenue=[150, 190, 150, 160],
    )
    assert df._pct(150, 190) == 26.7 and df._pct(190, 150) == -21.1
    q = df.make_question(__import__("random").Random(1), facts, "largest_change")
    a, b = (int(y[2:]) for y in __import__("re").findall(r"FY\d{4}", q["question"]))
    ia, ib = a - 2020, b - 2020
    want = max(
        "AB", key=lambda s: (abs(facts["segment_revenue"][s][ib] - facts["segment_revenue"][s][ia]), s)
    )
    assert q["answer"] == want
    assert (
        df.gold_extraction(facts)["largest_segment"] == "A"
        and df.gold_extraction(facts)["total_revenue"] == 160
    )


def test_field_f1_hand_computed():
    gold = {"a": 1, "b": "X", "c": 3.5, "d": 10}
    assert df.field_scores(gold, gold)["field_f1"] == 1.0
    # 2 of 4 right, 1 wrong, 1 missing, 1 extra key: precision 2/4, recall 2/4
    s = df.field_scores({"a": "1", "b": "x", "c": 9, "e": 5}, gold)
    assert s == {"field_precision": 0.5, "field_recall": 0.5, "field_f1": 0.5}
    assert df.field_scores([1, 2], gold)["field_f1"] == 0.0
    assert df.value_matches("1,234.0", 1234) and df.value_matches("$1,234", 1234)
    assert not df.value_matches(True, 1) and not df.value_matches("1.5e308x", 1)
    assert df.value_matches("26.7", 26.7, 0.1) and not df.value_matches("26.9", 26.7, 0.1)


def test_splits_are_disjoint_by_report(domain):
    keys = {}
    for split in ("train", "heldout"):
        tasks = [domain.task(split, 0, i) for i in range(25)]
        assert all(split_of(t.meta["content_key"]) == split for t in tasks)
        keys[split] = {t.meta["report_seed"] for t in tasks}
    assert keys["train"] and keys["heldout"] and not keys["train"] & keys["heldout"]
    assert json.dumps(domain.task("train", 0, 4).to_dict()) == json.dumps(
        domain.task("train", 0, 4).to_dict()
    )


def test_every_kind_scores_one_on_its_reference_and_lower_on_hostile_text(domain):
    seen = set()
    i = 0
    while seen != set(df.QUESTION_KINDS):
        task = domain.task("train", 0, i)
        i += 1
        seen.add(task.meta["kind"])
        (ref,) = domain.reference(task)
        res = run(run_episode(domain.make_env(), task, [ref]))
        assert res.reward == 1.0 and res.rewards["success"] == 1.0, (task.meta, res.rewards)
        for bad in [*HOSTILE, "<answer>-1e9</answer>", '{"company": 7}']:
            res = run(run_episode(domain.make_env(), task, [bad]))
            assert res.reward < 1.0 and res.rewards["success"] == 0.0, (task.meta["kind"], bad[:40])
    assert i < 60


def test_extraction_partial_credit_is_field_f1():
    meta = {"kind": "extract", "answer": {"a": 1, "b": 2, "c": 3, "d": 4}}
    reward, rewards, _ = df.score_answer('```json\n{"a": 1, "b": 2, "c": 0}\n```', meta)
    # precision 2/3, recall 2/4 -> F1 = 4/7
    assert rewards["field_f1"] == pytest.approx(4 / 7) and rewards["success"] == 0.0
    assert reward == pytest.approx(0.9 * 4 / 7 + 0.1)


def test_pdf_has_the_tables_and_the_facts():
    import pypdf

    report = df.generate_report(7, 2048)
    pdf = df.render_pdf(report)
    assert pdf.startswith(b"%PDF-")
    text = "\n".join(p.extract_text() for p in pypdf.PdfReader(io.BytesIO(pdf)).pages)
    f = report.facts
    assert f["company"] in text
    for s in f["segments"]:
        assert f"{s} " + " ".join(f"{v:,}" for v in f["segment_revenue"][s]) in text
    assert "Employees at year end " + " ".join(f"{v:,}" for v in f["headcount"]) in text


def test_bad_options_are_refused():
    with pytest.raises(ValueError, match="unknown question kinds"):
        get_domain("docs.financial", kinds=["poetry"])
