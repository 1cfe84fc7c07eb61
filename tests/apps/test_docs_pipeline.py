"""The document pipeline end to end with a scripted model (tests/apps/docs_scripted.py): generated
reports (Markdown + PDF) flow store -> queue -> 2 worker processes -> database and the rows equal the
ground truth, on SQLite and on real Redis + PostgreSQL, from a file store and from S3 (moto's server);
re-ingest enqueues nothing; a worker SIGKILLed mid-job leaves exactly one result per document; bad
documents and invalid model output end dead-lettered or repaired; bad input exits 2."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from posttrain.apps.docs import services
from posttrain.apps.docs.analyze import MAX_STRING_CHARS, Reply, analyze
from posttrain.apps.docs.db import Database, task_key
from posttrain.apps.docs.demo import score_batch, write_batch
from posttrain.apps.docs.parse import ParseError, parse_document
from posttrain.apps.docs.pipeline import export, html_report, ingest, status
from posttrain.apps.docs.queue import LOST_LEASE, QueuePolicy, open_queue
from posttrain.apps.docs.store import ObjectStore
from posttrain.apps.docs.worker import Worker
from posttrain.cli import app
from posttrain.envs.domains import docs_financial as df

from .docs_scripted import ScriptedModel
from .docs_services import postgres_url, redis_url  # noqa: F401 - fixtures

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = df.EXTRACTION_SCHEMA
MODEL = "scripted-oracle"


@pytest.fixture(scope="module")
def batch(tmp_path_factory):
    """4 reports of 2048 tokens: report-0000.md, report-0001.pdf, report-0002.md, report-0003.pdf."""
    return write_batch(tmp_path_factory.mktemp("docs") / "store", 4, [2048], seed=7)


def _workers(tmp_path, queue_url, db_url, golds, n=2, mode="oracle", delay=0.0, vis=30.0, until_idle=True):
    gpath = tmp_path / "golds.json"
    gpath.write_text(json.dumps(golds))
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'src'}"}
    args = [
        sys.executable,
        "-m",
        "tests.apps.docs_scripted",
        queue_url,
        db_url,
        str(gpath),
        mode,
        str(delay),
        "1",
        str(vis),
    ]
    return [
        subprocess.Popen(
            args + (["idle"] if until_idle else []),
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(n)
    ]


def _wait(procs, timeout=120):
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=timeout)
        assert p.returncode == 0, err[-2000:]
        outs.append(json.loads(out.strip().splitlines()[-1]))
    return outs


def _rows(db: Database) -> dict[str, dict]:
    cols, rows = db.select(
        "SELECT d.url, e.data_json FROM extractions e JOIN documents d ON d.content_hash = e.content_hash"
    )
    return {url: json.loads(data) for url, data in rows}


def _flow(tmp_path, batch, queue_url, db_url):
    q = open_queue(queue_url, QueuePolicy(visibility_s=30, backoff_s=0))
    db = Database(db_url)
    rep = ingest(ObjectStore(str(batch.store_dir)), q, db, SCHEMA, [], MODEL)
    assert (rep.listed, rep.enqueued, rep.read) == (4, 4, 4)
    stats = _wait(_workers(tmp_path, queue_url, db_url, list(batch.truth.values())))
    assert sum(s["done"] for s in stats) == 4 and all(s["failed"] == 0 for s in stats)
    assert _rows(db) == batch.truth  # the rows equal the generated facts, Markdown and PDF alike
    # the typed column table holds the same values
    table = db.field_table(task_key(SCHEMA, [], MODEL), SCHEMA)
    with db.engine.connect() as conn:
        revenue = sorted(r.total_revenue for r in conn.execute(db.sa.select(table)))
    assert revenue == sorted(g["total_revenue"] for g in batch.truth.values())
    assert score_batch(db, batch.truth, task_key(SCHEMA, [], MODEL)) == {
        "documents": 4,
        "results": 4,
        "dead": 0,
        "lost": 0,
        "duplicates": 0,
        "field_f1": 1.0,
        "exact": 4,
    }
    again = ingest(ObjectStore(str(batch.store_dir)), q, db, SCHEMA, [], MODEL)
    assert (again.enqueued, again.skipped, again.read) == (0, 4, 0)  # known versions are not downloaded
    assert status(db, q)["jobs"] == {"queued": 0, "running": 0, "done": 4, "dead": 0}
    return q, db


def test_sqlite_two_worker_processes(tmp_path, batch):
    q, db = _flow(tmp_path, batch, f"sqlite:///{tmp_path}/queue.db", f"sqlite:///{tmp_path}/docs.db")
    assert q.counts() == {"ready": 0, "leased": 0, "done": 4, "dead": 0}
    out = tmp_path / "out.csv"
    assert export(db, out, "csv") == 4
    import csv

    with out.open() as f:
        exported = {r["url"]: int(r["field.restated_year"]) for r in csv.DictReader(f)}
    assert exported == {url: g["restated_year"] for url, g in batch.truth.items()}
    import pyarrow.parquet as pq

    export(db, tmp_path / "out.parquet", "parquet")
    t = pq.read_table(tmp_path / "out.parquet").to_pylist()
    assert sorted(r["field.company"] for r in t) == sorted(g["company"] for g in batch.truth.values())
    page = html_report(db, q)
    assert page.startswith("<!doctype html>") and all(g["company"] in page for g in batch.truth.values())


def test_redis_and_postgres(tmp_path, batch, redis_url, postgres_url):  # noqa: F811 - fixtures
    q, _ = _flow(tmp_path, batch, redis_url, postgres_url)
    assert q.counts() == {"ready": 0, "delayed": 0, "leased": 0, "dead": 0}


def test_s3_store_through_moto_server(tmp_path, batch):
    with services.moto_s3("reports") as endpoint:
        store = ObjectStore("s3://reports/in", s3_endpoint=endpoint)
        truth = {}
        for url, gold in batch.truth.items():
            name = Path(url).name
            truth[store.write(name, ObjectStore(str(batch.store_dir)).read(url))] = gold
        assert [o.url for o in store.list()] == sorted(truth)
        q = open_queue(f"sqlite:///{tmp_path}/q.db", QueuePolicy(backoff_s=0))
        db = Database(f"sqlite:///{tmp_path}/d.db")
        assert ingest(store, q, db, SCHEMA, [], MODEL).enqueued == 4
        w = Worker(
            q, db, ScriptedModel(list(truth.values())), concurrency=2, s3_endpoint=endpoint, poll_s=0.05
        )
        assert asyncio.run(w.run(until_idle=True)).done == 4
        assert _rows(db) == truth
        assert ingest(store, q, db, SCHEMA, [], MODEL).enqueued == 0


def test_sigkill_mid_job_then_restart_gives_one_result_per_document(tmp_path, batch):
    qurl, dburl = f"sqlite:///{tmp_path}/queue.db", f"sqlite:///{tmp_path}/docs.db"
    q = open_queue(qurl, QueuePolicy(backoff_s=0))
    db = Database(dburl)
    ingest(ObjectStore(str(batch.store_dir)), q, db, SCHEMA, [], MODEL)
    golds = list(batch.truth.values())
    (victim,) = _workers(tmp_path, qurl, dburl, golds, n=1, delay=30.0, vis=1.5, until_idle=False)
    deadline = time.monotonic() + 60
    while db.job_counts().get("running", 0) == 0:
        assert time.monotonic() < deadline and victim.poll() is None
        time.sleep(0.1)
    os.kill(victim.pid, signal.SIGKILL)  # mid-job: its model call sleeps 30 s
    victim.wait()
    assert q.counts()["leased"] == 1
    stats = _wait(_workers(tmp_path, qurl, dburl, golds, n=2, vis=1.5))
    assert sum(s["done"] for s in stats) == 4
    cols, rows = db.select("SELECT content_hash, COUNT(*) FROM extractions GROUP BY content_hash")
    assert len(rows) == 4 and all(n == 1 for _, n in rows)
    assert _rows(db) == batch.truth
    cols, attempts = db.select("SELECT attempts FROM jobs ORDER BY attempts")
    assert [a for (a,) in attempts] == [1, 1, 1, 2]  # the killed job was re-leased once


def test_redelivery_after_a_written_result_writes_nothing(tmp_path, batch):
    """A worker that dies after committing but before acknowledging: the job comes back; no second row."""
    q = open_queue(f"sqlite:///{tmp_path}/q.db", QueuePolicy(visibility_s=0.5, backoff_s=0))
    db = Database(f"sqlite:///{tmp_path}/d.db")
    ingest(ObjectStore(str(batch.store_dir)), q, db, SCHEMA, [], MODEL, prefix="report-0000.md")
    w = Worker(q, db, ScriptedModel(list(batch.truth.values())))
    lease = q.lease("a")
    q.ack = lambda lease: True  # this delivery's acknowledgement is lost
    assert asyncio.run(w.process(lease, "a")) == "done"
    del q.ack
    time.sleep(0.6)
    again = q.lease("b")
    assert again.job_id == lease.job_id and again.attempt == 2
    assert asyncio.run(w.process(again, "b")) == "duplicate"
    assert db.select("SELECT COUNT(*) FROM extractions")[1] == [(1,)]
    assert q.lease("c") is None


class _BlockingModel(ScriptedModel):
    async def complete(self, messages, max_tokens, schema):
        time.sleep(3.0)  # holds the event loop, as a long synchronous step would
        return await super().complete(messages, max_tokens, schema)


def test_a_live_worker_keeps_its_lease_while_its_event_loop_is_blocked(tmp_path, batch):
    import threading

    q = open_queue(f"sqlite:///{tmp_path}/q.db", QueuePolicy(visibility_s=1.0, backoff_s=0))
    db = Database(f"sqlite:///{tmp_path}/d.db")
    ingest(ObjectStore(str(batch.store_dir)), q, db, SCHEMA, [], MODEL, prefix="report-0000.md")
    w = Worker(q, db, _BlockingModel(list(batch.truth.values()), "oracle"))
    t = threading.Thread(target=lambda: asyncio.run(w.run(until_idle=True)))
    t.start()
    while db.job_counts().get("running", 0) == 0:  # the worker holds its lease from here on
        time.sleep(0.02)
    stolen = []
    while t.is_alive():
        lease = q.lease("thief")
        if lease is not None:
            stolen.append(lease)
        time.sleep(0.05)
    assert stolen == [] and w.stats.done == 1
    assert db.select("SELECT attempts FROM jobs")[1] == [(1,)]


def test_a_job_whose_workers_keep_dying_is_dead_in_the_database_too(tmp_path, batch):
    q = open_queue(f"sqlite:///{tmp_path}/q.db", QueuePolicy(visibility_s=0.3, max_attempts=1))
    db = Database(f"sqlite:///{tmp_path}/d.db")
    ingest(ObjectStore(str(batch.store_dir)), q, db, SCHEMA, [], MODEL, prefix="report-0000.md")
    (job,) = [r[0] for r in db.select("SELECT job_id FROM jobs")[1]]
    q.lease("doomed")  # its worker dies without a word
    db.mark(job, "running", 1, None, "doomed")
    time.sleep(0.4)
    stats = asyncio.run(
        Worker(q, db, ScriptedModel(list(batch.truth.values())), poll_s=0.05).run(until_idle=True)
    )
    assert (stats.done, stats.dead) == (0, 1)
    assert db.select("SELECT state, error FROM jobs")[1] == [("dead", LOST_LEASE.format(n=1))]
    assert score_batch(db, {next(iter(sorted(batch.truth))): {}}, task_key(SCHEMA, [], MODEL))["lost"] == 0


def test_bad_documents_dead_letter_and_the_rest_goes_through(tmp_path, batch):
    store_dir = tmp_path / "store"
    store = ObjectStore(str(batch.store_dir))
    good = sorted(batch.truth)[1]  # a PDF
    out = ObjectStore(str(tmp_path))
    out.write("store/good.pdf", store.read(good))
    out.write("store/corrupt.pdf", b"%PDF-1.4\n" + os.urandom(2000))
    out.write("store/empty.txt", b"")
    out.write("store/huge.txt", b"a" * (50 * 1024 * 1024))
    q = open_queue(f"sqlite:///{tmp_path}/q.db", QueuePolicy(max_attempts=2, backoff_s=0))
    db = Database(f"sqlite:///{tmp_path}/d.db")
    assert ingest(ObjectStore(str(store_dir)), q, db, SCHEMA, [], MODEL).enqueued == 4
    stats = asyncio.run(Worker(q, db, ScriptedModel([batch.truth[good]]), poll_s=0.05).run(until_idle=True))
    assert (stats.done, stats.dead) == (1, 3)
    dead = {Path(d["payload"]["url"]).name: d for d in q.dead_letters()}
    assert set(dead) == {"corrupt.pdf", "empty.txt", "huge.txt"}
    assert all(d["attempts"] == 2 for d in dead.values())
    assert "corrupt PDF" in dead["corrupt.pdf"]["error"]
    assert "empty document (0 bytes)" in dead["empty.txt"]["error"]
    assert "52,428,800 bytes, over the limit" in dead["huge.txt"]["error"]
    assert db.job_counts() == {"done": 1, "dead": 3}


def test_invalid_json_is_repaired_once_or_dead_lettered(tmp_path, batch):
    url = sorted(batch.truth)[0]
    gold = batch.truth[url]
    for mode, want in (("repair", "done"), ("garbage", "dead")):
        q = open_queue(f"sqlite:///{tmp_path}/{mode}-q.db", QueuePolicy(max_attempts=2, backoff_s=0))
        db = Database(f"sqlite:///{tmp_path}/{mode}-d.db")
        ingest(
            ObjectStore(str(batch.store_dir)), q, db, SCHEMA, [], f"scripted-{mode}", prefix=Path(url).name
        )
        model = ScriptedModel([gold], mode)
        asyncio.run(Worker(q, db, model, poll_s=0.05).run(until_idle=True))
        assert db.job_counts() == {want: 1}
        if mode == "repair":
            assert db.select("SELECT repaired, valid FROM extractions")[1] == [(True, True)] or db.select(
                "SELECT repaired, valid FROM extractions"
            )[1] == [(1, 1)]
            assert _rows(db) == {url: gold} and model.calls == 2
        else:
            (d,) = q.dead_letters()
            assert (
                "not a JSON object after a repair turn" in d["error"] and model.calls == 4
            )  # 2 attempts x 2 turns


def test_long_document_is_map_reduced_with_page_citations(batch):
    url = sorted(batch.truth)[1]  # PDF, 3+ pages
    doc = parse_document(ObjectStore(str(batch.store_dir)).read(url), url)
    assert doc.kind == "pdf" and doc.n_pages >= 2
    model = ScriptedModel([batch.truth[url]], context_tokens=900)  # in words: the document has ~1,400
    result = asyncio.run(analyze(doc, SCHEMA, [], model, max_new_tokens=64))
    assert result.mode == "map_reduce" and result.n_chunks >= 2
    assert result.data == batch.truth[url] and result.valid
    pages = {b.page: b.text for b in doc.blocks}
    for c in result.citations:
        value = result.data[c.target]
        shown = (
            f"{value:,}"
            if isinstance(value, int) and c.target not in ("fiscal_year", "restated_year")
            else str(value)
        )
        assert shown in pages[c.page] and shown in c.quote, (c, shown)
    # the restated year is cited from the notes, which come after the table that shows the old figure
    assert next(c.page for c in result.citations if c.target == "restated_year") == doc.n_pages


class _FirstPartGarbage(ScriptedModel):
    async def complete(self, messages, max_tokens, schema):
        if "(part 1 of" in messages[1]["content"]:
            self.calls += 1
            return Reply("no json here", 1, 1)
        return await super().complete(messages, max_tokens, schema)


def test_map_reduce_survives_one_unparseable_chunk_and_bounds_strings(batch):
    url = sorted(batch.truth)[1]
    doc = parse_document(ObjectStore(str(batch.store_dir)).read(url), url)
    seen = []
    model = _FirstPartGarbage([batch.truth[url]], context_tokens=900)
    real = model.complete

    async def spy(messages, max_tokens, schema):
        seen.append(schema)
        return await real(messages, max_tokens, schema)

    model.complete = spy
    result = asyncio.run(analyze(doc, SCHEMA, [], model, max_new_tokens=64))
    assert result.mode == "map_reduce" and result.failed_chunks == 1 and result.repaired
    # the first part (title, highlights table) said nothing; the later parts still give what they state
    assert result.data["restated_year"] == batch.truth[url]["restated_year"]
    assert seen[0]["properties"]["company"]["anyOf"][0]["maxLength"] == MAX_STRING_CHARS
    assert "maxLength" not in SCHEMA["properties"]["company"]  # the user's schema is left alone


def test_parse_html_tables_and_sections():
    html = b"<html><body><h1>Report</h1><p>Intro.</p><h2>Revenue</h2><table><tr><th>Year</th><th>Rev</th></tr><tr><td>2020</td><td>1,234</td></tr></table></body></html>"
    doc = parse_document(html, "a.html")
    assert doc.kind == "html"
    assert "| Year | Rev" in doc.text and "| 2020 | 1,234" in doc.text
    assert [b.section for b in doc.blocks][-1] == "Revenue"
    with pytest.raises(ParseError, match="binary data"):
        parse_document(b"\x00\x01\x02", "x.bin")


def _cli(*args):
    return CliRunner().invoke(app, ["docs", *args])


def test_cli_bad_input_exits_2(tmp_path):
    home = ["--home", str(tmp_path / "h")]
    r = _cli("ingest", "ftp://host/x", *home)
    assert r.exit_code == 2 and "scheme 'ftp://'" in r.output
    r = _cli("ingest", str(tmp_path / "nope"), *home)
    assert r.exit_code == 2 and "no such folder" in r.output
    r = _cli("ingest", "s3://", *home)
    assert r.exit_code == 2 and "names no bucket" in r.output
    (tmp_path / "bad.json").write_text('{"type": "object", "properties": {"a": {"type": "strnig"}}}')
    r = _cli("ingest", str(tmp_path), "--schema", str(tmp_path / "bad.json"), *home)
    assert r.exit_code == 2 and "not a valid JSON Schema" in r.output
    (tmp_path / "arr.json").write_text("[1, 2]")
    r = _cli("ingest", str(tmp_path), "--schema", str(tmp_path / "arr.json"), *home)
    assert r.exit_code == 2 and "must hold a JSON object" in r.output
    r = _cli("ingest", str(tmp_path), "--queue", "amqp://x", *home)
    assert r.exit_code == 2 and "--queue 'amqp://x'" in r.output
    r = _cli("query", "DELETE FROM jobs", *home)
    assert r.exit_code == 2 and "one SELECT" in r.output
    r = _cli("query", "SELECT nope FROM jobs", *home)
    assert r.exit_code == 2 and "query failed" in r.output
    r = _cli("export", "--out", str(tmp_path / "x.xlsx"), "--format", "xlsx", *home)
    assert r.exit_code == 2 and "choose csv or parquet" in r.output
    (tmp_path / "keep.txt").write_text("mine")
    r = _cli("demo", "--home", str(tmp_path))
    assert r.exit_code == 2 and "is not a previous demo's folder" in r.output
    assert (tmp_path / "keep.txt").read_text() == "mine"


def test_cli_ingest_status_query(tmp_path, batch):
    home = ["--home", str(tmp_path / "h")]
    r = _cli("ingest", f"file://{batch.store_dir}", "--json", "--model", MODEL, *home)
    assert r.exit_code == 0, r.output
    assert json.loads(r.output.strip().splitlines()[-1]) == {
        "listed": 4,
        "enqueued": 4,
        "skipped": 0,
        "read": 4,
    }
    r = _cli("ingest", str(batch.store_dir), "--json", "--model", MODEL, *home)
    assert json.loads(r.output.strip().splitlines()[-1])["enqueued"] == 0
    r = _cli("status", "--json", *home)
    st = json.loads(r.output.strip().splitlines()[-1])
    assert st["jobs"]["queued"] == 4 and st["queue"]["ready"] == 4
    r = _cli("query", "SELECT COUNT(*) AS n FROM documents", "--json", *home)
    assert json.loads(r.output.strip().splitlines()[-1]) == [{"n": 4}]


def test_ingest_watch_picks_up_new_objects(tmp_path, batch):
    store = tmp_path / "store"
    store.mkdir()
    first, second = sorted(batch.truth)[:2]
    src = ObjectStore(str(batch.store_dir))
    (store / "a.md").write_bytes(src.read(first))
    home = tmp_path / "h"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    cmd = [
        sys.executable,
        "-m",
        "posttrain",
        "docs",
        "ingest",
        str(store),
        "--watch",
        "--interval",
        "0.2",
        "--home",
        str(home),
    ]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        db_url = f"sqlite:///{home.resolve()}/docs.db"
        deadline = time.monotonic() + 60

        def jobs() -> int:
            try:
                return Database(db_url).select("SELECT COUNT(*) FROM jobs")[1][0][0]
            except Exception:  # noqa: BLE001 - the database may not exist yet
                return 0

        while jobs() < 1:
            assert time.monotonic() < deadline and proc.poll() is None, (
                proc.stderr.read() if proc.poll() else ""
            )
            time.sleep(0.2)
        (store / "b.pdf").write_bytes(src.read(second))
        (store / "a-copy.md").write_bytes(src.read(first))  # same content: no new job
        while jobs() < 2:
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.2)
        time.sleep(1.0)
        assert jobs() == 2
    finally:
        proc.terminate()
        proc.wait(10)


def test_pdf_tables_come_through_as_table_rows():
    """Every row of every table of a generated report appears in the parsed PDF as one `| a | b |`
    line, cells in order, on the page it is printed on."""
    report = df.generate_report(5, 2048)
    doc = parse_document(df.render_pdf(report), "r.pdf")
    lines = {ln for b in doc.blocks for ln in b.text.splitlines()}
    tables = [blk for sec in report.sections for blk in sec.blocks if isinstance(blk, df.Table)]
    assert len(tables) >= 3
    for table in tables:
        for row in table.rows:
            assert "| " + " | ".join(row) + " |" in lines, row


def test_ingest_reads_only_new_or_changed_objects(tmp_path, batch):
    """The second listing hashes nothing it has seen at the same version; a rewritten object (new
    mtime, new content) is read and enqueued again; a rewrite with the same bytes is read but not
    enqueued (its hash is known)."""
    store_dir = tmp_path / "store"
    src = ObjectStore(str(batch.store_dir))
    out = ObjectStore(str(store_dir.mkdir() or store_dir))
    urls = [out.write(Path(u).name, src.read(u)) for u in sorted(batch.truth)[:2]]
    q = open_queue(f"sqlite:///{tmp_path / 'q.db'}", QueuePolicy(visibility_s=30, backoff_s=0))
    db = Database(f"sqlite:///{tmp_path / 'r.db'}")
    first = ingest(out, q, db, SCHEMA, [], MODEL)
    assert (first.read, first.enqueued) == (2, 2)
    assert (ingest(out, q, db, SCHEMA, [], MODEL).read, ingest(out, q, db, SCHEMA, [], MODEL).enqueued) == (
        0,
        0,
    )
    changed = Path(urls[0].removeprefix("file://"))
    time.sleep(0.01)
    changed.write_bytes(changed.read_bytes() + b"\n\nAppendix.\n")
    again = ingest(out, q, db, SCHEMA, [], MODEL)
    assert (again.read, again.enqueued, again.skipped) == (1, 1, 1)
    same = Path(urls[1].removeprefix("file://"))
    same.write_bytes(same.read_bytes())  # same bytes, new version tag
    third = ingest(out, q, db, SCHEMA, [], MODEL)
    assert (third.read, third.enqueued, third.skipped) == (1, 0, 2)


def test_status_watch_follows_the_queue_and_stops_on_ctrl_c(tmp_path, batch):
    """`docs status --watch` redraws as jobs arrive (a terminal: FORCE_COLOR), and SIGINT ends it with
    exit 0 and no traceback."""
    import re

    home = tmp_path / "home"
    home.mkdir()
    q = open_queue(f"sqlite:///{home}/queue.db", QueuePolicy(visibility_s=30, backoff_s=0))
    db = Database(f"sqlite:///{home}/docs.db")
    env = {**os.environ, "FORCE_COLOR": "1", "COLUMNS": "100", "PYTHONPATH": str(ROOT / "src")}
    cmd = [
        sys.executable,
        "-m",
        "posttrain",
        "docs",
        "status",
        "--watch",
        "--interval",
        "0.2",
        "--home",
        str(home),
    ]
    # started with SIGINT ignored, as a background job of a script is: Ctrl-C must still end the view
    proc = subprocess.Popen(
        cmd,
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )
    os.set_blocking(proc.stdout.fileno(), False)
    seen = b""

    def queued_counts() -> list[str]:
        plain = re.sub(rb"\x1b\[[0-9;?]*[A-Za-z]", b"", seen).decode(errors="replace")
        return re.findall(r"queued\s*│\s*(\d+)", plain)

    def read_until(pred, timeout=60.0) -> None:
        nonlocal seen
        end = time.monotonic() + timeout
        while time.monotonic() < end and not pred():
            seen += proc.stdout.read() or b""
            time.sleep(0.05)
        assert pred(), seen[-2000:]

    try:
        read_until(lambda: "0" in queued_counts())
        assert ingest(ObjectStore(str(batch.store_dir)), q, db, SCHEMA, [], MODEL).enqueued == 4
        read_until(lambda: "4" in queued_counts())
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            out, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:  # report what it printed, not only that it hung
            proc.kill()
            out, err = proc.communicate()
            pytest.fail(
                f"status --watch ignored SIGINT for 60 s; stdout {(seen + out)[-1500:]!r} stderr {err[-1500:]!r}"
            )
    assert proc.returncode == 0 and b"Traceback" not in err, err[-2000:]


def test_processes_opening_a_fresh_sqlite_database_at_once_all_succeed(tmp_path):
    """Workers, ingest and status may open a new database together: each gets the schema, and the
    version row is written once."""
    url = f"sqlite:///{tmp_path / 'fresh.db'}"
    code = (
        "import sys, time; from posttrain.apps.docs.db import Database; "
        "time.sleep(max(0.0, float(sys.argv[2]) - time.time())); Database(sys.argv[1])"
    )
    start = str(time.time() + 3.0)  # all import first, then open at the same moment
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    procs = [
        subprocess.Popen([sys.executable, "-c", code, url, start], env=env, stderr=subprocess.PIPE, text=True)
        for _ in range(4)
    ]
    errors = [p.communicate(timeout=60)[1] for p in procs]
    assert [p.returncode for p in procs] == [0] * 4, errors
    assert Database(url).select("SELECT COUNT(*) FROM schema_version")[1] == [(1,)]
