"""`posttrain docs ingest|worker|status|query|export|report|demo|sft-data`: the document-analysis pipeline of
`posttrain.apps.docs`. This module parses options, calls the app and prints; bad input exits 2."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import typer

from posttrain.cli.common import EXIT_RUNTIME, EXIT_USAGE, console, fail, print_json_last

app = typer.Typer(
    help="Document pipeline: object store -> queue -> model workers -> database.",
    no_args_is_help=True,
    rich_markup_mode=None,
)

HOME = Path(".posttrain-docs")
HomeOpt = typer.Option(HOME, "--home", help="folder of the default SQLite queue and database")
QueueOpt = typer.Option(
    None, "--queue", help="sqlite:///path/queue.db (default: HOME/queue.db) or redis://host:port/db"
)
DbOpt = typer.Option(
    None, "--db", help="sqlite:///path/docs.db (default: HOME/docs.db) or postgresql://user@host:port/db"
)
ModelOpt = typer.Option(
    "smollm2-135m", "--model", help="model spec for the in-process engine, or the model name at --api-base"
)
ApiOpt = typer.Option(
    None,
    "--api-base",
    help="an OpenAI-compatible server (e.g. http://127.0.0.1:8000/v1) instead of the in-process engine",
)
S3Opt = typer.Option(None, "--s3-endpoint", help="S3-compatible endpoint URL for s3:// objects")


def _urls(home: Path, queue: str | None, db: str | None) -> tuple[str, str]:
    home = home.resolve()
    return queue or f"sqlite:///{home}/queue.db", db or f"sqlite:///{home}/docs.db"


def _guard(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Run an app call: UsageError -> exit 2, other failures -> exit 1, each with its message."""
    from posttrain.apps.docs.store import UsageError

    try:
        return fn(*args, **kwargs)
    except UsageError as err:
        fail(str(err), EXIT_USAGE)
    except (RuntimeError, OSError) as err:
        fail(str(err), EXIT_RUNTIME)


def _open(home: Path, queue: str | None, db: str | None, policy: Any = None) -> tuple[Any, Any]:
    from posttrain.apps.docs.db import Database
    from posttrain.apps.docs.queue import open_queue

    q_url, db_url = _urls(home, queue, db)
    if q_url.startswith("sqlite:///") or db_url.startswith("sqlite:///"):
        home.mkdir(parents=True, exist_ok=True)
    return _guard(open_queue, q_url, policy), _guard(Database, db_url)


def _schema(path: Path | None) -> dict[str, Any]:
    from posttrain.apps.docs.analyze import check_schema
    from posttrain.envs.domains.docs_financial import EXTRACTION_SCHEMA

    if path is None:
        return EXTRACTION_SCHEMA
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        fail(f"--schema: no such file '{path}'", EXIT_USAGE)
    except json.JSONDecodeError as err:
        fail(f"--schema '{path}' is not JSON: {err}", EXIT_USAGE)
    return _guard(check_schema, raw)


def _model_name(model: str, api_base: str | None) -> str:
    return f"{api_base}#{model}" if api_base else model


@app.command("ingest")
def ingest_cmd(
    url: str = typer.Argument(..., help="file:///folder, a local folder, or s3://bucket/prefix"),
    prefix: str = typer.Option("", "--prefix", help="only objects under this prefix"),
    schema: Path = typer.Option(
        None, "--schema", help="JSON Schema of the extraction (default: docs.financial's)"
    ),
    question: list[str] = typer.Option(
        None, "--question", help="a question to answer over each document (repeatable)"
    ),
    model: str = ModelOpt,
    api_base: str = ApiOpt,
    reprocess: bool = typer.Option(False, "--reprocess", help="enqueue documents that already have a result"),
    watch: bool = typer.Option(False, "--watch", help="keep polling the store for new objects"),
    interval_s: float = typer.Option(5.0, "--interval", min=0.1, help="seconds between polls with --watch"),
    s3_endpoint: str = S3Opt,
    home: Path = HomeOpt,
    queue: str = QueueOpt,
    db: str = DbOpt,
    json_out: bool = typer.Option(False, "--json"),
) -> None:
    """Enqueue one job per new document (new = content hash not seen for this schema and model)."""
    from posttrain.apps.docs.pipeline import ingest
    from posttrain.apps.docs.store import ObjectStore

    sch = _schema(schema)
    store = _guard(ObjectStore, url, s3_endpoint)
    q, database = _open(home, queue, db)
    while True:
        rep = _guard(
            ingest,
            store,
            q,
            database,
            sch,
            list(question or []),
            _model_name(model, api_base),
            prefix,
            reprocess,
        )
        line = {"listed": rep.listed, "enqueued": rep.enqueued, "skipped": rep.skipped, "read": rep.read}
        if json_out:
            print_json_last(line)
        else:
            console.print(
                f"{rep.listed} object(s) listed, {rep.read} read, {rep.enqueued} enqueued, "
                f"{rep.skipped} already known"
            )
        if not watch:
            return
        reprocess = False  # --reprocess applies to the first pass only
        time.sleep(interval_s)


def _make_model(model: str, api_base: str | None, context_tokens: int, api_key: str | None) -> Any:
    from posttrain.apps.docs.analyze import ApiModel, EngineModel

    if api_base:
        return _guard(ApiModel, api_base, model, context_tokens, api_key=api_key)
    return _guard(EngineModel, model, context_tokens)


@app.command("worker")
def worker_cmd(
    concurrency: int = typer.Option(1, "--concurrency", min=1, help="jobs in flight in this worker"),
    model: str = ModelOpt,
    api_base: str = ApiOpt,
    api_key: str = typer.Option(None, "--api-key", envvar="OPENAI_API_KEY"),
    context_tokens: int = typer.Option(
        8192, "--context-tokens", min=256, help="the model's context (documents longer are map-reduced)"
    ),
    max_new_tokens: int = typer.Option(256, "--max-new-tokens", min=16),
    visibility_s: float = typer.Option(
        120.0, "--visibility-timeout", min=0.1, help="seconds before a dead worker's job is re-leased"
    ),
    max_attempts: int = typer.Option(
        3, "--max-attempts", min=1, help="deliveries before a job goes to the dead-letter table"
    ),
    backoff_s: float = typer.Option(
        2.0, "--backoff", min=0.0, help="first retry delay in seconds (doubles each retry)"
    ),
    max_bytes: int = typer.Option(
        20 * 1024 * 1024, "--max-bytes", min=1, help="larger documents are refused"
    ),
    until_idle: bool = typer.Option(False, "--until-idle", help="exit once the queue is empty"),
    s3_endpoint: str = S3Opt,
    home: Path = HomeOpt,
    queue: str = QueueOpt,
    db: str = DbOpt,
) -> None:
    """Lease jobs, parse, analyze with the model, write results; retries and dead letters via the queue."""
    from posttrain.apps.docs.queue import QueuePolicy
    from posttrain.apps.docs.worker import Worker

    q, database = _open(home, queue, db, QueuePolicy(visibility_s, max_attempts, backoff_s))
    m = _make_model(model, api_base, context_tokens, api_key)
    m.name = _model_name(model, api_base)
    w = Worker(q, database, m, concurrency, s3_endpoint, max_bytes, max_new_tokens)
    stats = asyncio.run(w.run(until_idle=until_idle))
    console.print(
        f"worker {w.id}: {stats.done} done, {stats.duplicates} duplicate deliveries, {stats.failed} failures ({stats.dead} dead-lettered)"
    )


def _status_table(st: dict[str, Any]) -> Any:
    from rich.table import Table

    t = Table(title="posttrain docs")
    t.add_column("jobs")
    t.add_column("count", justify="right")
    for k, v in st["jobs"].items():
        t.add_row(k, str(v))
    t.add_row("docs/min", str(st["docs_per_min"]))
    t.add_row("latency p50 / p99 ms", f"{st['latency_ms_p50']} / {st['latency_ms_p99']}")
    if "dead_letters" in st:
        t.add_row("dead letters", str(st["dead_letters"]))
    for e in st["errors"][:3]:
        t.add_row(f"error ({e['state']})", f"{Path(e['url']).name}: {e['error'][:100]}")
    return t


@app.command("status")
def status_cmd(
    watch: bool = typer.Option(False, "--watch", help="a live view, refreshed every --interval seconds"),
    interval_s: float = typer.Option(2.0, "--interval", min=0.1),
    home: Path = HomeOpt,
    queue: str = QueueOpt,
    db: str = DbOpt,
    json_out: bool = typer.Option(False, "--json"),
) -> None:
    """Jobs by state, throughput, latency and the latest errors."""
    from posttrain.apps.docs.pipeline import status

    q, database = _open(home, queue, db)
    if watch:
        import signal

        from rich.live import Live

        # Ctrl-C (SIGINT) ends the view even when the process was started with SIGINT ignored (a
        # background job of a non-interactive shell inherits SIG_IGN, and Python then keeps it)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        try:
            with Live(
                _status_table(_guard(status, database, q)), console=console, refresh_per_second=4
            ) as live:
                while True:
                    time.sleep(interval_s)
                    live.update(_status_table(_guard(status, database, q)), refresh=True)
        except KeyboardInterrupt:  # Ctrl-C ends the view; the last table stays on screen
            return
    st = _guard(status, database, q)
    if json_out:
        print_json_last(st)
    else:
        console.print(_status_table(st))


@app.command("query")
def query_cmd(
    sql: str = typer.Argument(..., help='one SELECT, e.g. "SELECT url, kind FROM documents"'),
    home: Path = HomeOpt,
    db: str = DbOpt,
    json_out: bool = typer.Option(False, "--json"),
) -> None:
    """Run a read-only SQL query against the results database."""
    from posttrain.apps.docs.db import Database

    database = _guard(Database, _urls(home, None, db)[1])
    cols, rows = _guard(database.select, sql)
    if json_out:
        print_json_last([dict(zip(cols, r, strict=True)) for r in rows])
        return
    from rich.table import Table

    t = Table()
    for c in cols:
        t.add_column(c)
    for r in rows:
        t.add_row(*("" if v is None else str(v) for v in r))
    console.print(t)


@app.command("export")
def export_cmd(
    out: Path = typer.Option(..., "--out", help="output file"),
    fmt: str = typer.Option("csv", "--format", help="csv or parquet"),
    home: Path = HomeOpt,
    db: str = DbOpt,
) -> None:
    """Write every result (one row per document, a column per extracted field)."""
    from posttrain.apps.docs.db import Database
    from posttrain.apps.docs.pipeline import export

    database = _guard(Database, _urls(home, None, db)[1])
    n = _guard(export, database, out, fmt)
    console.print(f"{n} row(s) -> {out}")


@app.command("report")
def report_cmd(
    out: Path = typer.Option(Path("docs-report.html"), "--out"),
    home: Path = HomeOpt,
    queue: str = QueueOpt,
    db: str = DbOpt,
) -> None:
    """A small HTML report of the batch: counts, throughput, results, errors."""
    from posttrain.apps.docs.pipeline import html_report

    q, database = _open(home, queue, db)
    out.write_text(_guard(html_report, database, q))
    console.print(f"report -> {out}")


@app.command("demo")
def demo_cmd(
    n: int = typer.Option(4, "--n", min=1, help="generated reports"),
    tokens: int = typer.Option(2048, "--tokens", min=256, help="length of each report in tokens"),
    model: str = ModelOpt,
    workers: int = typer.Option(2, "--workers", min=1),
    home: Path = typer.Option(
        Path("runs/docs-demo"), "--home", help="folder for the store, queue, database and report"
    ),
    json_out: bool = typer.Option(False, "--json"),
) -> None:
    """The whole pipeline on embedded defaults: generated reports (Markdown + PDF) in a file store, the
    SQLite queue, two workers on the in-process engine, the SQLite database, an HTML report."""
    import shutil

    from posttrain.apps.docs.db import Database
    from posttrain.apps.docs.demo import run_batch, write_batch
    from posttrain.apps.docs.pipeline import html_report
    from posttrain.apps.docs.queue import QueuePolicy, SQLiteQueue

    home = home.resolve()
    marker = home / ".posttrain-docs-demo"
    if home.exists() and any(home.iterdir()):
        if not marker.is_file():
            fail(
                f"--home {home} exists and is not a previous demo's folder; give a new or empty folder",
                EXIT_USAGE,
            )
        shutil.rmtree(home)  # a previous demo: start over
    home.mkdir(parents=True, exist_ok=True)
    marker.touch()
    with console.status(f"generating {n} reports of {tokens} tokens"):
        batch = write_batch(home / "store", n, [tokens])
    q = SQLiteQueue(home / "queue.db", QueuePolicy(visibility_s=600, backoff_s=1.0))
    database = Database(f"sqlite:///{home}/docs.db")
    m = _make_model(model, None, 8192, None)
    with console.status(f"{workers} workers on {model}"):
        t = time.perf_counter()
        summary = run_batch(batch, q, database, m, workers=workers)
        summary["wall_s"] = round(time.perf_counter() - t, 1)
    (home / "report.html").write_text(html_report(database, q, f"posttrain docs demo ({model})"))
    summary["report"] = str(home / "report.html")
    if json_out:
        print_json_last(summary)
        return
    console.print(
        f"{summary['results']}/{summary['documents']} documents extracted in {summary['wall_s']} s; "
        f"field F1 {summary['field_f1']:.3f}; lost {summary['lost']}, duplicates {summary['duplicates']}, "
        f"dead-lettered {summary['dead']}\nreport: {summary['report']}\n"
        f'try: posttrain docs query --home {home} "SELECT url, kind, n_pages FROM documents"'
    )


@app.command("sft-data")
def sft_data_cmd(
    out: Path = typer.Option(..., "--out", help="JSONL file to write (chat rows for `posttrain sft --data`)"),
    n: int = typer.Option(64, "--n", min=1, help="examples (generated reports)"),
    tokens: str = typer.Option("768,1024", "--tokens", help="report lengths in tokens, cycled"),
    seed: int = typer.Option(0, "--seed", min=0, max=(1 << 20) - 1),
) -> None:
    """Supervised extraction data from generated `docs.financial` reports that no benchmark batch or demo
    uses: each report parsed as a worker parses it (Markdown and PDF alternately), the worker's exact
    extraction prompt, and the gold JSON object as the reply."""
    from posttrain.apps.docs.demo import sft_rows

    try:
        lengths = [int(t) for t in tokens.split(",")]
    except ValueError:
        fail(f"--tokens '{tokens}' is not a comma list of integers", EXIT_USAGE)
    if any(t < 256 for t in lengths):
        fail("--tokens: each length must be >= 256", EXIT_USAGE)
    if out.exists():
        fail(f"--out {out} exists; give a new file", EXIT_USAGE)
    with console.status(f"generating {n} reports of {tokens} tokens"):
        rows = sft_rows(n, lengths, seed=seed)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tmp.replace(out)
    console.print(f"wrote {len(rows)} examples to {out}; train with: posttrain sft --data {out}")
