"""`posttrain docs demo` and the batch the benchmark runs: generate `docs.financial` reports (Markdown
and PDF alternately) into a store folder, ingest them, run workers until the queue is empty, and
compare the rows with the generated ground truth (field-level F1, lost and duplicate results). Also the
supervised data `posttrain docs sft-data` writes: other reports, parsed and prompted as a worker does.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from posttrain.apps.docs.analyze import ChatModel, extraction_messages
from posttrain.apps.docs.db import Database, task_key
from posttrain.apps.docs.parse import parse_document
from posttrain.apps.docs.pipeline import ingest
from posttrain.apps.docs.queue import JobQueue
from posttrain.apps.docs.store import ObjectStore
from posttrain.apps.docs.worker import Worker
from posttrain.envs.domains import docs_financial as df


@dataclass
class Batch:
    store_dir: Path
    truth: dict[str, dict[str, Any]]  # object URL -> gold extraction


def write_batch(
    store_dir: Path, n: int, tokens: list[int], seed: int = 0, tokenizer: str = "smollm2-135m"
) -> Batch:
    """`n` reports, the i-th of `tokens[i % len(tokens)]` tokens, even ones as Markdown, odd ones as PDF;
    the ground truth is saved beside them as truth.json (outside the store folder)."""
    store_dir.mkdir(parents=True, exist_ok=True)
    store = ObjectStore(str(store_dir))
    truth = {}
    for i in range(n):
        report = df.generate_report(report_seed(seed, i), tokens[i % len(tokens)], tokenizer)
        if i % 2 == 0:
            url = store.write(f"report-{i:04d}.md", report.markdown().encode())
        else:
            url = store.write(f"report-{i:04d}.pdf", df.render_pdf(report))
        truth[url] = df.gold_extraction(report.facts)
    (store_dir.parent / "truth.json").write_text(json.dumps(truth, indent=1))
    return Batch(store_dir, truth)


# reports of a batch use seeds seed * 100_003 + i; training reports start past every such seed
SFT_SEED_BASE = 1 << 40


def report_seed(seed: int, i: int, training: bool = False) -> int:
    """The generator seed of the i-th report of a batch (or of the supervised data) with `seed`."""
    if not 0 <= seed < 1 << 20 or not 0 <= i < 100_003:
        raise ValueError(f"seed must be in [0, 2^20) and index in [0, 100003) (got {seed}, {i})")
    return (SFT_SEED_BASE if training else 0) + seed * 100_003 + i


def sft_rows(
    n: int, tokens: list[int], seed: int = 0, tokenizer: str = "smollm2-135m"
) -> list[dict[str, Any]]:
    """`n` supervised extraction examples: the i-th report (of `tokens[i % len(tokens)]` tokens, Markdown
    or PDF alternately, seeds disjoint from every benchmark batch's) parsed as a worker parses it, the
    worker's extraction chat for the whole document, and the gold JSON object as the assistant's reply
    (keys in the schema's order, json.dumps' separators: what constrained decoding lets the model write)."""
    rows = []
    for i in range(n):
        report = df.generate_report(report_seed(seed, i, training=True), tokens[i % len(tokens)], tokenizer)
        if i % 2 == 0:
            doc = parse_document(report.markdown().encode(), f"report-{i}.md")
        else:
            doc = parse_document(df.render_pdf(report), f"report-{i}.pdf")
        gold = df.gold_extraction(report.facts)
        reply = json.dumps({k: gold[k] for k in df.EXTRACTION_SCHEMA["properties"]})
        rows.append(
            {
                "messages": [
                    *extraction_messages(doc.text, df.EXTRACTION_SCHEMA),
                    {"role": "assistant", "content": reply},
                ]
            }
        )
    return rows


def score_batch(
    db: Database, truth: dict[str, dict[str, Any]], key: str, per_document: bool = False
) -> dict[str, Any]:
    """Field-level F1 of the stored extractions against the truth (a missing result scores 0), and the
    counts the pipeline promises to keep at zero: `lost` (no result and not dead-lettered) and
    `duplicates` (more than one result row for a document and task). With `per_document`, also
    `f1_by_url` (object URL -> that document's field F1)."""
    sa = db.sa
    e, d, j = db.extractions, db.documents, db.jobs
    with db.engine.connect() as conn:
        rows = conn.execute(
            sa.select(d.c.url, e.c.data_json)
            .join(e, e.c.content_hash == d.c.content_hash)
            .where(e.c.task_key == key)
        ).all()
        dup = conn.execute(
            sa.select(sa.func.count()).select_from(
                sa.select(e.c.content_hash)
                .where(e.c.task_key == key)
                .group_by(e.c.content_hash)
                .having(sa.func.count() > 1)
                .subquery()
            )
        ).scalar()
        dead = {
            r[0] for r in conn.execute(sa.select(j.c.url).where(j.c.task_key == key, j.c.state == "dead"))
        }
    got = {url: json.loads(data) for url, data in rows}
    f1 = [
        df.field_scores(got.get(url), gold)["field_f1"] if url in got else 0.0 for url, gold in truth.items()
    ]
    return {
        "documents": len(truth),
        "results": len(got),
        "dead": len(dead),
        "lost": sum(1 for url in truth if url not in got and url not in dead),
        "duplicates": int(dup or 0),
        "field_f1": sum(f1) / len(f1) if f1 else 0.0,
        "exact": sum(1 for x in f1 if x == 1.0),
        **({"f1_by_url": dict(zip(truth, f1, strict=True))} if per_document else {}),
    }


def run_batch(
    batch: Batch,
    queue: JobQueue,
    db: Database,
    model: ChatModel,
    workers: int = 2,
    concurrency: int = 1,
    max_new_tokens: int = 160,
) -> dict[str, Any]:
    """Ingest the batch and run `workers` in-process workers (sharing the model) until the queue is empty."""
    schema = df.EXTRACTION_SCHEMA
    rep = ingest(ObjectStore(str(batch.store_dir)), queue, db, schema, [], model.name)

    async def go() -> None:
        ws = [
            Worker(
                queue,
                db,
                model,
                concurrency=concurrency,
                max_new_tokens=max_new_tokens,
                poll_s=0.2,
                worker_id=f"demo-{i}",
            )
            for i in range(workers)
        ]
        await asyncio.gather(*(w.run(until_idle=True) for w in ws))

    asyncio.run(go())
    return {"enqueued": rep.enqueued, **score_batch(db, batch.truth, task_key(schema, [], model.name))}
