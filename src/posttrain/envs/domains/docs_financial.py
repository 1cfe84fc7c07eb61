"""`docs.financial`: long synthetic company reports with controlled facts, and questions over them.

A report (narrative sections, a financial-highlights table, a segment table, a workforce table and notes
with one restatement) is generated from a seed; filler narrative is added until the document reaches the
level's length in tokens of the model's tokenizer (searched, not estimated). It renders as Markdown (the
prompt) and as PDF (`render_pdf`, real tables; the document pipeline reads it). Levels: 0 = 2k tokens,
1 = 8k, 2 = 32k, 3 = 64k. Questions: a located figure, a growth rate, the segment with the largest change,
a restated figure that overrides the highlights table, and structured extraction into `EXTRACTION_SCHEMA`.

Reward = 0.9 * score + 0.1 * format. QA: `score` = `correct`, 1 when the `<answer>` matches exactly
(names, case-insensitive) or within the question's numeric tolerance; `format` = answer in tags.
Extraction: `score` = `field_f1`, the F1 of the JSON object's fields against the gold fields (a field is a
true positive when its value matches; extra keys are false positives); `format` = a JSON object parsed.
`success` is strict: `correct` = 1, or every gold field right and none extra. Residual risk: none from
code; an answer that states several numbers is judged by what is inside the tags only.
"""

from __future__ import annotations

import json
import math
import random
import re
from dataclasses import dataclass, field
from typing import Any

from posttrain.envs.base import Domain, Environment, SingleTurnEnv, stable_hash
from posttrain.envs.extract import extract_answer, parse_json_object
from posttrain.envs.registry import register_env
from posttrain.envs.tokens import count_tokens
from posttrain.types import Message, Task

W_SCORE, W_FORMAT = 0.9, 0.1
LEVEL_TOKENS: dict[int, int] = {0: 2048, 1: 8192, 2: 32768, 3: 65536}
QUESTION_KINDS = ("lookup", "growth", "largest_change", "restated", "extract")
N_YEARS = 4
MAX_ANSWER_CHARS = 200_000

EXTRACTION_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "company": {"type": "string", "description": "the company's name"},
        "fiscal_year": {"type": "integer", "description": "the latest fiscal year reported"},
        "total_revenue": {"type": "number", "description": "total revenue of the latest year, $ millions"},
        "net_income": {"type": "number", "description": "net income of the latest year, $ millions"},
        "headcount": {"type": "integer", "description": "employees at the end of the latest year"},
        "largest_segment": {
            "type": "string",
            "description": "the segment with the most revenue, latest year",
        },
        "restated_year": {"type": "integer", "description": "the fiscal year whose revenue was restated"},
    },
    "required": [
        "company",
        "fiscal_year",
        "total_revenue",
        "net_income",
        "headcount",
        "largest_segment",
        "restated_year",
    ],
    "additionalProperties": False,
}

_NAME_A = [
    "Northwind",
    "Bluestone",
    "Harbor",
    "Silverline",
    "Cedar",
    "Granite",
    "Aurora",
    "Meridian",
    "Kestrel",
]
_NAME_B = ["Dynamics", "Holdings", "Industries", "Systems", "Group", "Technologies", "Partners", "Works"]
_NAME_C = ["plc", "Inc.", "AG", "Ltd.", "Corp."]
_SEGMENTS = [
    "Industrial",
    "Consumer",
    "Cloud Services",
    "Healthcare",
    "Energy",
    "Logistics",
    "Retail",
    "Financial Services",
]
_FILLER_SUBJECTS = [
    "The board",
    "Management",
    "The audit committee",
    "Our regional teams",
    "The supply organisation",
    "The research group",
    "The sustainability office",
    "Our customer operations",
]
_FILLER_VERBS = [
    "continued to review",
    "placed particular emphasis on",
    "strengthened its approach to",
    "reported regularly on",
    "invested steadily in",
    "reassessed the priorities of",
]
_FILLER_OBJECTS = [
    "the resilience of the supply chain",
    "data protection and information security",
    "the development of senior leaders",
    "customer satisfaction across all markets",
    "the integration of recent acquisitions",
    "energy efficiency at manufacturing sites",
    "the simplification of internal processes",
    "long-term relationships with key suppliers",
    "the quality of financial reporting",
    "the governance of new product launches",
]
_FILLER_TAILS = [
    "in line with the strategy set out in previous reports.",
    "with progress discussed at every scheduled meeting.",
    "while keeping capital discipline at the centre of decisions.",
    "and the results were shared with employees in town-hall sessions.",
    "so that the group remains well placed for the coming years.",
    "taking into account feedback from investors and regulators.",
]


@dataclass
class Table:
    header: list[str]
    rows: list[list[str]]
    caption: str = ""


@dataclass
class Section:
    title: str
    blocks: list[str | Table] = field(default_factory=list)


@dataclass
class Report:
    """One generated report: its facts (the ground truth) and its sections (what is rendered)."""

    facts: dict[str, Any]
    sections: list[Section]

    def markdown(self) -> str:
        out = [f"# {self.facts['company']} - Annual Report FY{self.facts['years'][-1]}", ""]
        for sec in self.sections:
            out += [f"## {sec.title}", ""]
            for block in sec.blocks:
                if isinstance(block, Table):
                    if block.caption:
                        out += [f"**{block.caption}**", ""]
                    out.append("| " + " | ".join(block.header) + " |")
                    out.append("|" + "|".join("---" for _ in block.header) + "|")
                    out += ["| " + " | ".join(r) + " |" for r in block.rows]
                    out.append("")
                else:
                    out += [block, ""]
        return "\n".join(out).rstrip() + "\n"


def _money(x: int | float) -> str:
    return f"{x:,}"


def make_facts(rng: random.Random) -> dict[str, Any]:
    """The controlled facts of one report: segments' revenue per year, costs, headcount, a restatement."""
    company = f"{rng.choice(_NAME_A)} {rng.choice(_NAME_B)} {rng.choice(_NAME_C)}"
    first = rng.randrange(2014, 2022)
    years = list(range(first, first + N_YEARS))
    segments = rng.sample(_SEGMENTS, rng.choice([3, 4]))
    seg_rev: dict[str, list[int]] = {}
    for s in segments:
        v = rng.randrange(200, 2500)
        row = []
        for _ in years:
            row.append(v)
            v = max(50, round(v * (1 + rng.uniform(-0.12, 0.25))))
        seg_rev[s] = row
    revenue = [sum(seg_rev[s][i] for s in segments) for i in range(N_YEARS)]
    cost = [round(r * rng.uniform(0.45, 0.65)) for r in revenue]
    opex = [round(r * rng.uniform(0.12, 0.22)) for r in revenue]
    op_income = [r - c - o for r, c, o in zip(revenue, cost, opex, strict=True)]
    net_income = [round(oi * (1 - rng.uniform(0.18, 0.3))) for oi in op_income]
    h = rng.randrange(800, 40_000)
    headcount = []
    for _ in years:
        headcount.append(h)
        h = round(h * (1 + rng.uniform(-0.05, 0.12)))
    restated_index = rng.randrange(N_YEARS - 1)
    previously = round(revenue[restated_index] * (1 + rng.choice([-1, 1]) * rng.uniform(0.02, 0.07)))
    return {
        "company": company,
        "years": years,
        "segments": segments,
        "segment_revenue": seg_rev,
        "revenue": revenue,
        "cost_of_revenue": cost,
        "operating_expenses": opex,
        "operating_income": op_income,
        "net_income": net_income,
        "headcount": headcount,
        "restated_year": years[restated_index],
        "previously_reported_revenue": previously,
        "restatement_reason": rng.choice(
            [
                "the correction of revenue recognised ahead of delivery on long-term contracts",
                "the reclassification of a discontinued distribution business",
                "an error in the consolidation of a joint venture",
            ]
        ),
    }


def gold_extraction(facts: dict[str, Any]) -> dict[str, Any]:
    """The reference answer to the extraction question (and the pipeline's ground truth)."""
    last = facts["segment_revenue"]
    return {
        "company": facts["company"],
        "fiscal_year": facts["years"][-1],
        "total_revenue": facts["revenue"][-1],
        "net_income": facts["net_income"][-1],
        "headcount": facts["headcount"][-1],
        "largest_segment": max(facts["segments"], key=lambda s: (last[s][-1], s)),
        "restated_year": facts["restated_year"],
    }


def filler_paragraph(rng: random.Random) -> str:
    """Narrative without figures (filler must never contradict or repeat a fact)."""
    sentences = []
    for _ in range(rng.randrange(3, 6)):
        sentences.append(
            f"{rng.choice(_FILLER_SUBJECTS)} {rng.choice(_FILLER_VERBS)} {rng.choice(_FILLER_OBJECTS)} "
            f"{rng.choice(_FILLER_TAILS)}"
        )
    return " ".join(sentences)


def build_report(facts: dict[str, Any], fillers: list[str]) -> Report:
    """Lay the facts out in sections; `fillers` are spread round-robin over the narrative sections."""
    years, segs = facts["years"], facts["segments"]
    yh = [f"FY{y}" for y in years]
    ri = years.index(facts["restated_year"])
    rev_cells = [_money(v) for v in facts["revenue"]]
    rev_cells[ri] = f"{_money(facts['previously_reported_revenue'])} (1)"
    highlights = Table(
        ["$ millions", *yh],
        [
            ["Total revenue", *rev_cells],
            ["Cost of revenue", *map(_money, facts["cost_of_revenue"])],
            ["Operating expenses", *map(_money, facts["operating_expenses"])],
            ["Operating income", *map(_money, facts["operating_income"])],
            ["Net income", *map(_money, facts["net_income"])],
        ],
        "Financial highlights",
    )
    seg_table = Table(
        ["Segment revenue, $ millions", *yh],
        [[s, *map(_money, facts["segment_revenue"][s])] for s in segs],
        "Revenue by segment",
    )
    staff = Table(["", *yh], [["Employees at year end", *map(_money, facts["headcount"])]], "Workforce")
    sections = [
        Section(
            "Letter to shareholders",
            [
                f"{facts['company']} presents its annual report for the fiscal year FY{years[-1]}, covering "
                f"the fiscal years FY{years[0]} to FY{years[-1]}. All amounts are in millions of US dollars "
                "unless stated otherwise."
            ],
        ),
        Section("Financial highlights", [highlights]),
        Section(
            "Segment review",
            [
                f"The group reports {len(segs)} segments: {', '.join(segs)}. Segment figures below reflect "
                "any restatement described in the notes.",
                seg_table,
            ],
        ),
        Section("Workforce", [staff]),
        Section("Outlook and risk factors", []),
        Section(
            "Notes to the financial statements",
            [
                f"(1) Revenue for FY{facts['restated_year']} has been restated to "
                f"{_money(facts['revenue'][ri])} (previously reported {_money(facts['previously_reported_revenue'])}) "
                f"following {facts['restatement_reason']}. The restated figure supersedes the amount shown in "
                "the financial highlights."
            ],
        ),
    ]
    narrative = [sections[0], sections[2], sections[3], sections[4]]
    for i, para in enumerate(fillers):
        narrative[i % len(narrative)].blocks.append(para)
    return Report(facts, sections)


def generate_report(seed: int, target_tokens: int, tokenizer_spec: str = "smollm2-135m") -> Report:
    """The report of `seed`, with the most filler that keeps its Markdown within `target_tokens` tokens
    (the bare report is kept if it alone is longer).

    The filler count is searched: estimated from per-paragraph token counts (nearly additive), then
    moved one paragraph at a time against the exact count of the whole rendered document."""
    rng = random.Random(stable_hash("docs.financial", seed))
    facts = make_facts(rng)
    frng = random.Random(stable_hash("docs.financial.filler", seed))
    pool: list[str] = []
    cumulative = [0]

    def grow(k: int) -> None:
        while len(pool) < k:
            pool.append(filler_paragraph(frng))
            cumulative.append(cumulative[-1] + count_tokens(pool[-1] + "\n\n", tokenizer_spec))

    def tokens_with(k: int) -> int:
        grow(k)
        return count_tokens(build_report(facts, pool[:k]).markdown(), tokenizer_spec)

    base = tokens_with(0)
    k = 0
    while base + cumulative[-1] <= target_tokens:
        grow(len(pool) + 64)
    k = max(i for i, c in enumerate(cumulative) if base + c <= target_tokens) if base <= target_tokens else 0
    exact = tokens_with(k)
    while k > 0 and exact > target_tokens:
        k -= 1
        exact = tokens_with(k)
    while exact <= target_tokens and (nxt := tokens_with(k + 1)) <= target_tokens:
        k, exact = k + 1, nxt
    report = build_report(facts, pool[:k])
    report.facts["n_tokens"] = exact
    return report


def render_pdf(report: Report) -> bytes:
    """The report as a PDF (fpdf2): headings, paragraphs and ruled tables; page numbers in the footer."""
    from fpdf import FPDF

    class _PDF(FPDF):
        def footer(self) -> None:
            self.set_y(-12)
            self.set_font("Helvetica", size=8)
            self.cell(0, 8, f"Page {self.page_no()}", align="C")

    pdf = _PDF(format="A4")
    pdf.set_auto_page_break(True, margin=15)
    pdf.add_page()
    pdf.set_font("Helvetica", "B", 16)
    pdf.multi_cell(
        0,
        8,
        f"{report.facts['company']} - Annual Report FY{report.facts['years'][-1]}",
        new_x="LMARGIN",
        new_y="NEXT",
    )
    for sec in report.sections:
        pdf.ln(3)
        pdf.set_font("Helvetica", "B", 13)
        pdf.multi_cell(0, 7, sec.title, new_x="LMARGIN", new_y="NEXT")
        for block in sec.blocks:
            if isinstance(block, Table):
                pdf.set_font("Helvetica", "B", 10)
                if block.caption:
                    pdf.multi_cell(0, 6, block.caption, new_x="LMARGIN", new_y="NEXT")
                pdf.set_font("Helvetica", size=9)
                with pdf.table(first_row_as_headings=True, text_align="LEFT") as t:
                    for r in [block.header, *block.rows]:
                        row = t.row()
                        for c in r:
                            row.cell(c)
                pdf.ln(2)
            else:
                pdf.set_font("Helvetica", size=10)
                pdf.multi_cell(0, 5, block, new_x="LMARGIN", new_y="NEXT")
                pdf.ln(1)
    return bytes(pdf.output())


# ----------------------------------------------------------------------------------------------
# questions and scoring


def _pct(a: float, b: float) -> float:
    return round((b / a - 1) * 100, 1)


def make_question(rng: random.Random, facts: dict[str, Any], kind: str) -> dict[str, Any]:
    """{kind, question, answer, tol_abs} for one question kind over `facts` (restated values are true)."""
    years, segs = facts["years"], facts["segments"]
    if kind == "lookup":
        s, i = rng.choice(segs), rng.randrange(N_YEARS)
        return {
            "question": f"What was the revenue of the {s} segment in FY{years[i]}, in $ millions?",
            "answer": facts["segment_revenue"][s][i],
            "tol_abs": 0.5,
        }
    if kind == "growth":
        a, b = sorted(rng.sample(range(N_YEARS), 2))
        return {
            "question": f"By what percentage did total revenue change from FY{years[a]} to FY{years[b]}? "
            "Use restated figures where the report restates them; give a percentage with one decimal "
            "(negative for a decline), without the % sign.",
            "answer": _pct(facts["revenue"][a], facts["revenue"][b]),
            "tol_abs": 0.1,
        }
    if kind == "largest_change":
        a, b = sorted(rng.sample(range(N_YEARS), 2))
        sr = facts["segment_revenue"]
        best = max(segs, key=lambda s: (abs(sr[s][b] - sr[s][a]), s))
        return {
            "question": f"Which segment's revenue changed the most in absolute terms from FY{years[a]} to "
            f"FY{years[b]}? Give the segment name.",
            "answer": best,
            "tol_abs": None,
        }
    if kind == "restated":
        return {
            "question": f"What was total revenue in FY{facts['restated_year']}, in $ millions, taking any "
            "restatement into account?",
            "answer": facts["revenue"][years.index(facts["restated_year"])],
            "tol_abs": 0.5,
        }
    if kind == "extract":
        return {
            "question": "Extract the key data of this report as one JSON object matching this JSON Schema "
            f"(amounts in $ millions, restated figures where restated):\n{json.dumps(EXTRACTION_SCHEMA)}\n"
            "Reply with the JSON object only.",
            "answer": gold_extraction(facts),
            "tol_abs": None,
        }
    raise ValueError(f"unknown question kind '{kind}' (valid: {', '.join(QUESTION_KINDS)})")


_NUM = re.compile(r"^[-+]?\$?\s*[\d,]*\.?\d+\s*%?$")


def parse_number(text: Any) -> float | None:
    """'1,234' -> 1234.0, '$5.5' -> 5.5, '-3.2%' -> -3.2; None for anything else (bool included)."""
    if isinstance(text, bool):
        return None
    if isinstance(text, int | float):
        return float(text) if math.isfinite(text) else None
    if not isinstance(text, str) or len(text) > 64 or not _NUM.match(text.strip()):
        return None
    try:
        value = float(text.strip().replace("$", "").replace(",", "").replace("%", "").replace(" ", ""))
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def value_matches(predicted: Any, gold: Any, tol_abs: float | None = 0.5) -> bool:
    """Numbers within `tol_abs` (or 0.05% relative, whichever is larger); strings equal ignoring case and
    surrounding space."""
    if isinstance(gold, bool) or gold is None:
        return predicted == gold
    if isinstance(gold, int | float):
        p = parse_number(predicted)
        if p is None:
            return False
        return abs(p - gold) <= max(tol_abs or 0.0, abs(gold) * 5e-4)
    return isinstance(predicted, str) and predicted.strip().casefold() == str(gold).strip().casefold()


def field_scores(predicted: Any, gold: dict[str, Any]) -> dict[str, float]:
    """Field-level precision, recall and F1 of a predicted object against the gold fields."""
    if not isinstance(predicted, dict):
        return {"field_precision": 0.0, "field_recall": 0.0, "field_f1": 0.0}
    tp = sum(1 for k, g in gold.items() if k in predicted and value_matches(predicted[k], g))
    n_pred = sum(1 for v in predicted.values() if v is not None)
    precision = tp / n_pred if n_pred else 0.0
    recall = tp / len(gold) if gold else 0.0
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    return {"field_precision": precision, "field_recall": recall, "field_f1": f1}


def score_answer(text: str, meta: dict[str, Any]) -> tuple[float, dict[str, float], dict[str, Any]]:
    """(reward, components, info) for one reply; never raises on any text."""
    text = text if isinstance(text, str) else ""
    if meta["kind"] == "extract":
        obj = parse_json_object(text[:MAX_ANSWER_CHARS])
        scores = field_scores(obj, meta["answer"])
        fmt = 1.0 if obj is not None else 0.0
        exact = float(scores["field_f1"] == 1.0)
        rewards = {**scores, "format": fmt, "success": exact}
        return W_SCORE * scores["field_f1"] + W_FORMAT * fmt, rewards, {"unparseable": int(obj is None)}
    extracted = extract_answer(text[-MAX_ANSWER_CHARS:])
    fmt = 1.0 if extracted.method == "tags" else 0.0
    correct = float(
        extracted.text is not None and value_matches(extracted.text, meta["answer"], meta["tol_abs"])
    )
    info = {"extracted": extracted.text, "unparseable": int(extracted.text is None)}
    return W_SCORE * correct + W_FORMAT * fmt, {"correct": correct, "format": fmt, "success": correct}, info


@register_env("docs.financial")
class DocsFinancialDomain(Domain):
    description = "long synthetic financial reports (2k-64k tokens): locate, compare, compute, extract JSON"

    def __init__(self, tokenizer: str = "smollm2-135m", kinds: list[str] | None = None) -> None:
        self.tokenizer = tokenizer
        self.kinds = tuple(kinds) if kinds is not None else QUESTION_KINDS
        bad = [k for k in self.kinds if k not in QUESTION_KINDS]
        if bad or not self.kinds:
            raise ValueError(
                f"docs.financial: unknown question kinds {bad or '(none given)'} (valid: {', '.join(QUESTION_KINDS)})"
            )
        self.difficulties = sorted(LEVEL_TOKENS)

    def task(self, split: str, difficulty: int, index: int, seed: int = 0) -> Task:
        def make(rng: random.Random):
            report_seed = rng.randrange(2**31)
            kind = self.kinds[rng.randrange(len(self.kinds))]
            qrng = random.Random(rng.randrange(2**31))
            # the facts alone decide the question, so rejected draws cost no filler search
            facts = make_facts(random.Random(stable_hash("docs.financial", report_seed)))
            q = make_question(qrng, facts, kind)

            def build() -> Task:
                report = generate_report(report_seed, LEVEL_TOKENS[difficulty], self.tokenizer)
                prompt = f"{report.markdown()}\n---\n{q['question']}" + (
                    "" if kind == "extract" else "\nPut the final answer between <answer> and </answer>."
                )
                meta = {
                    "kind": kind,
                    "question": q["question"],
                    "answer": q["answer"],
                    "tol_abs": q["tol_abs"],
                    "report_seed": report_seed,
                    "target_tokens": LEVEL_TOKENS[difficulty],
                    "n_tokens": report.facts["n_tokens"],
                    "tokenizer": self.tokenizer,
                }
                return Task(
                    id="",
                    domain=self.name,
                    difficulty=difficulty,
                    prompt=[Message("user", prompt)],
                    meta=meta,
                )

            # keyed by the report alone: a report (its facts) belongs to one split, whatever is asked of it
            return f"docs.financial|report|{report_seed}", build

        return self.draw(split, difficulty, index, seed, make)

    def reference(self, task: Task) -> list[str]:
        if task.meta["kind"] == "extract":
            return [json.dumps(task.meta["answer"])]
        return [f"<answer>{task.meta['answer']}</answer>"]

    def make_env(self, sandbox: Any = None, chat_format: str = "smollm2") -> Environment:
        return SingleTurnEnv(score_answer)  # one turn, scored like the other long-context domains' replies
