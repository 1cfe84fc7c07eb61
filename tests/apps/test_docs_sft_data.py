"""`posttrain docs sft-data` and `bench docs --compare-model`: the supervised rows are the worker's own
extraction chat on reports no benchmark batch uses, with the gold object as the reply; the comparison's
paired difference is hand-checked; bad input exits 2."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import pytest
from typer.testing import CliRunner

from posttrain.apps.docs.analyze import Reply, analyze
from posttrain.apps.docs.demo import SFT_SEED_BASE, report_seed, sft_rows
from posttrain.apps.docs.parse import parse_document
from posttrain.bench.docs import _comparison
from posttrain.cli import app
from posttrain.envs.domains import docs_financial as df


class _Recorder:
    """A chat model that records what it is asked and answers with a fixed object."""

    name = "recorder"
    context_tokens = 100_000

    def __init__(self, reply: dict) -> None:
        self.reply, self.asked = reply, []

    def count_tokens(self, text: str) -> int:
        return len(text.split())

    async def complete(self, messages, max_tokens, schema) -> Reply:
        self.asked.append(messages)
        return Reply(json.dumps(self.reply), 10, 10)


def test_training_seeds_never_meet_a_batch_seed():
    assert report_seed(0, 0) == 0 and report_seed(3, 5) == 3 * 100_003 + 5
    assert report_seed(0, 0, training=True) == SFT_SEED_BASE
    # the largest batch seed is below the smallest training seed
    assert report_seed((1 << 20) - 1, 100_002) < report_seed(0, 0, training=True)
    with pytest.raises(ValueError, match="seed must be in"):
        report_seed(1 << 20, 0)
    with pytest.raises(ValueError, match="index"):
        report_seed(0, 100_003)


def test_rows_are_the_workers_own_chat_with_the_gold_reply():
    rows = sft_rows(2, [1024], seed=0)
    assert len(rows) == 2
    for i, row in enumerate(rows):
        report = df.generate_report(report_seed(0, i, training=True), 1024)
        data = report.markdown().encode() if i % 2 == 0 else df.render_pdf(report)
        doc = parse_document(data, f"r.{'md' if i % 2 == 0 else 'pdf'}")
        gold = df.gold_extraction(report.facts)
        model = _Recorder(gold)
        result = asyncio.run(analyze(doc, df.EXTRACTION_SCHEMA, [], model, 160))
        assert result.mode == "whole" and len(model.asked) == 1
        system, user, assistant = row["messages"]
        assert [system, user] == model.asked[0]  # exactly what a worker sends for this document
        assert assistant["role"] == "assistant"
        reply = json.loads(assistant["content"])
        assert reply == gold and list(reply) == list(df.EXTRACTION_SCHEMA["properties"])
        jsonschema.validate(reply, df.EXTRACTION_SCHEMA)
        assert assistant["content"] == json.dumps(reply)  # the separators constrained decoding allows


def test_cli_writes_rows_and_refuses_bad_input(tmp_path):
    runner = CliRunner()
    out = tmp_path / "d.jsonl"
    res = runner.invoke(app, ["docs", "sft-data", "--out", str(out), "--n", "3", "--tokens", "700"])
    assert res.exit_code == 0, res.output
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 3 and all(len(r["messages"]) == 3 for r in rows)
    again = runner.invoke(app, ["docs", "sft-data", "--out", str(out), "--n", "1"])
    assert again.exit_code == 2 and "exists" in again.output
    bad = runner.invoke(app, ["docs", "sft-data", "--out", str(tmp_path / "e.jsonl"), "--tokens", "1k"])
    assert bad.exit_code == 2 and "not a comma list of integers" in bad.output
    short = runner.invoke(app, ["docs", "sft-data", "--out", str(tmp_path / "f.jsonl"), "--tokens", "100"])
    assert short.exit_code == 2 and ">= 256" in short.output


def test_comparison_is_the_paired_difference_over_documents():
    class Opts:
        model, compare_model, seed = "base", "tuned", 0

    base = {"field_f1": 0.3, "exact": 0, "f1_by_url": {"a": 0.2, "b": 0.4}}
    other = {"field_f1": 0.7, "exact": 1, "f1_by_url": {"a": 1.0, "b": 0.4}}
    out = _comparison(Opts, base, other)
    assert out["field_f1"] == {"base": 0.3, "tuned": 0.7} and out["exact"] == {"base": 0, "tuned": 1}
    d = out["field_f1_delta"]
    # differences 0.8 and 0.0: the mean is 0.4; resampled means are 0, 0.4 or 0.8
    assert d["delta"] == pytest.approx(0.4) and d["n_documents"] == 2
    assert d["ci_low"] == pytest.approx(0.0) and d["ci_high"] == pytest.approx(0.8)


@pytest.mark.parametrize(
    ("spec", "message"),
    [("smollm2-135m", "is --model"), ("/nonexistent/policy", "--compare-model: model '/nonexistent/policy'")],
)
def test_bench_refuses_a_bad_compare_model(spec, message):
    res = CliRunner().invoke(app, ["bench", "docs", "--n", "1", "--compare-model", spec])
    assert res.exit_code == 2 and message in res.output
