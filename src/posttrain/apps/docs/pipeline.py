"""Ingest, status, export and the batch report: the pieces of `posttrain docs` around the workers.

`ingest` lists the store, hashes every object and enqueues one job per (content hash, task) not seen
before (`reprocess` enqueues again); `status` counts jobs by state with throughput and the latest
errors; `export` writes the results as CSV or Parquet; `html_report` renders one batch as a page.
"""

from __future__ import annotations

import csv
import html
import json
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from posttrain.apps.docs.db import Database, task_key
from posttrain.apps.docs.queue import JobQueue
from posttrain.apps.docs.store import ObjectStore, UsageError, content_hash


@dataclass
class IngestReport:
    listed: int = 0
    enqueued: int = 0
    skipped: int = 0  # already known for this task
    read: int = 0  # objects downloaded to hash them (new or changed since the last listing)
    job_ids: list[str] = field(default_factory=list)


def ingest(
    store: ObjectStore,
    queue: JobQueue,
    db: Database,
    schema: dict[str, Any],
    questions: list[str],
    model: str,
    prefix: str = "",
    reprocess: bool = False,
) -> IngestReport:
    """Enqueue one job per new object. The queue entry is added first and the database row second, and
    a worker drops an entry that has no row; so an ingest killed between the two loses nothing (the
    object is still new the next time) and enqueues no job that would be processed twice."""
    key = task_key(schema, questions, model)
    db.register_task(key, schema, questions, model)
    report = IngestReport()
    for obj in store.list(prefix):
        report.listed += 1
        h = db.known_hash(obj.url, obj.version, obj.size) if obj.version else None
        if h is None:
            data = store.read(obj.url)
            h = content_hash(data)
            report.read += 1
            if obj.version and len(data) == obj.size:
                db.remember_object(obj.url, obj.version, obj.size, h)
        if not reprocess and db.job_exists(h, key):
            report.skipped += 1
            continue
        job_id = uuid.uuid4().hex
        payload = {"content_hash": h, "task_key": key, "url": obj.url, "reprocess": reprocess}
        queue.enqueue(payload, job_id=job_id)
        if db.claim_job(job_id, h, key, obj.url, obj.size, reprocess):
            report.enqueued += 1
            report.job_ids.append(job_id)
        else:
            report.skipped += 1  # a concurrent ingest won; our queue entry is dropped by the worker
    return report


def status(db: Database, queue: JobQueue | None = None) -> dict[str, Any]:
    """Counts by state, throughput over the finished jobs, latency percentiles and the latest errors."""
    sa = db.sa
    j, u = db.jobs, db.usage
    counts = {s: 0 for s in ("queued", "running", "done", "dead")}
    counts.update(db.job_counts())
    with db.engine.connect() as conn:
        first, last = conn.execute(
            sa.select(sa.func.min(j.c.enqueued_at), sa.func.max(j.c.finished_at)).where(j.c.state == "done")
        ).first()
        lat = sorted(
            r[0] for r in conn.execute(sa.select(u.c.latency_ms).where(u.c.extraction_id.is_not(None)))
        )
        errors = [
            {"job_id": r.job_id, "url": r.url, "state": r.state, "attempts": r.attempts, "error": r.error}
            for r in conn.execute(
                sa.select(j).where(j.c.error.is_not(None)).order_by(j.c.enqueued_at.desc()).limit(10)
            )
        ]
    span = (last - first) if first is not None and last is not None else 0.0
    out: dict[str, Any] = {
        "jobs": counts,
        "docs_per_min": round(counts["done"] / span * 60, 3) if span > 0 else None,
        "latency_ms_p50": round(percentile(lat, 50), 1) if lat else None,
        "latency_ms_p99": round(percentile(lat, 99), 1) if lat else None,
        "errors": errors,
    }
    if queue is not None:
        out["queue"] = queue.counts()
        out["dead_letters"] = len(queue.dead_letters())
    return out


def percentile(sorted_values: list[float], q: float) -> float:
    """Linear-interpolation percentile (numpy's default) of an ascending list."""
    if not sorted_values:
        raise ValueError("percentile of no values")
    pos = (len(sorted_values) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def result_rows(db: Database) -> list[dict[str, Any]]:
    """The results flattened: one row per extraction, each schema field as a `field.<name>` column."""
    rows = []
    for r in db.results():
        data = json.loads(r.pop("data_json"))
        r.update(
            {f"field.{k}": (json.dumps(v) if isinstance(v, dict | list) else v) for k, v in data.items()}
        )
        rows.append(r)
    return rows


def export(db: Database, path: Path, fmt: str) -> int:
    """Write the results to `path` as csv or parquet; returns the number of rows."""
    if fmt not in ("csv", "parquet"):
        raise UsageError(f"--format '{fmt}': choose csv or parquet")
    rows = result_rows(db)
    columns = list(dict.fromkeys(k for r in rows for k in r))
    path.parent.mkdir(parents=True, exist_ok=True)
    if fmt == "csv":
        with path.open("w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=columns)
            w.writeheader()
            w.writerows(rows)
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        table = pa.Table.from_pylist([{c: r.get(c) for c in columns} for r in rows]) if rows else pa.table({})
        pq.write_table(table, path)
    return len(rows)


def html_report(db: Database, queue: JobQueue | None = None, title: str = "posttrain docs batch") -> str:
    """One self-contained HTML page: counts, throughput, latencies, the results table and the errors."""
    st = status(db, queue)
    rows = result_rows(db)
    cols = [c for c in dict.fromkeys(k for r in rows for k in r) if c.startswith("field.")]
    e = html.escape

    def cell(v: Any) -> str:
        return f"<td>{e('' if v is None else str(v))}</td>"

    head = "".join(f"<th>{e(c)}</th>" for c in ["document", "kind", "mode", "valid", "latency ms", *cols])
    body = "".join(
        "<tr>"
        + "".join(
            cell(v)
            for v in [Path(r["url"]).name, r["kind"], r["mode"], r["valid"], round(r["latency_ms"] or 0)]
        )
        + "".join(cell(r.get(c)) for c in cols)
        + "</tr>"
        for r in rows
    )
    errs = "".join(
        f"<tr>{cell(Path(x['url']).name)}{cell(x['state'])}{cell(x['attempts'])}{cell(x['error'])}</tr>"
        for x in st["errors"]
    )
    summary = ", ".join(f"{k}: {v}" for k, v in st["jobs"].items())
    return f"""<!doctype html><html><head><meta charset="utf-8"><title>{e(title)}</title>
<style>body{{font-family:sans-serif;margin:2em}}table{{border-collapse:collapse}}td,th{{border:1px solid #ccc;padding:3px 6px;font-size:13px}}</style>
</head><body><h1>{e(title)}</h1><p>generated {time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}</p>
<p>jobs - {e(summary)}; documents/min: {st["docs_per_min"]}; latency p50 {st["latency_ms_p50"]} ms, p99 {st["latency_ms_p99"]} ms</p>
<h2>Results ({len(rows)})</h2><table><tr>{head}</tr>{body}</table>
<h2>Errors ({len(st["errors"])})</h2><table><tr><th>document</th><th>state</th><th>attempts</th><th>error</th></tr>{errs}</table>
</body></html>
"""
