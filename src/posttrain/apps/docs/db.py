"""The results database through SQLAlchemy: SQLite (the default) or PostgreSQL (`postgresql://...`).

Tables: documents (by content hash), tasks (schema + questions + model, hashed into `task_key`), jobs
(one per enqueued document and task), extractions (the JSON, unique per (content hash, task key)),
a typed column table per flat schema (`fields_<key>`), citations, answers and usage (tokens, latency),
and object_versions (an object's URL and version tag -> its content hash, so ingest reads only new or
changed objects).
A result is written in ONE transaction guarded by the unique key, so a job delivered twice (a worker
killed after writing, a re-lease) leaves exactly one row set and never half of one. The schema is
versioned (`schema_version`); a database from a newer version is refused.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from posttrain.apps.docs.store import UsageError

SCHEMA_VERSION = 2  # 2: object_versions


def task_key(schema: dict[str, Any], questions: list[str], model: str) -> str:
    """The identity of an analysis task: what is extracted, what is asked, and by which model."""
    blob = json.dumps({"schema": schema, "questions": questions, "model": model}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


def flat_columns(schema: dict[str, Any]) -> dict[str, str] | None:
    """{property: json type} when every property of the object schema is a scalar; None otherwise."""
    props = schema.get("properties") if isinstance(schema, dict) else None
    if schema.get("type") != "object" or not isinstance(props, dict) or not props:
        return None
    out = {}
    for name, sub in props.items():
        t = sub.get("type") if isinstance(sub, dict) else None
        if t not in ("string", "integer", "number", "boolean") or not name.isidentifier():
            return None
        out[name] = t
    return out


def extraction_ref(**kw: Any) -> Any:
    """The `extraction_id` column of a table that belongs to an extraction (deleted with it)."""
    import sqlalchemy as sa

    return sa.Column("extraction_id", sa.Integer, sa.ForeignKey("extractions.id", ondelete="CASCADE"), **kw)


@dataclass
class Citation:
    target: str  # a field name, or "answer:<i>" for the i-th question
    page: int | None
    section: str | None
    quote: str = ""


@dataclass
class AnalysisResult:
    data: dict[str, Any]
    valid: bool
    repaired: bool
    mode: str  # "whole" | "map_reduce"
    n_chunks: int
    failed_chunks: int = 0  # map-reduce chunks whose reply stayed unparseable after the repair turn
    answers: list[str] = field(default_factory=list)
    citations: list[Citation] = field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    model_calls: int = 0
    model_ms: float = 0.0
    parse_ms: float = 0.0


class Database:
    def __init__(self, url: str) -> None:
        import sqlalchemy as sa

        self.sa = sa
        if not isinstance(url, str) or "://" not in url:
            raise UsageError(
                f"--db '{url}': give sqlite:///path/docs.db or postgresql://user@host:port/dbname"
            )
        scheme = url.split("://", 1)[0].split("+", 1)[0]
        if scheme not in ("sqlite", "postgresql"):
            raise UsageError(f"--db '{url}': supported are sqlite:/// and postgresql:// URLs")
        kwargs: dict[str, Any] = {}
        if url.startswith("postgresql://"):
            url = "postgresql+psycopg2://" + url[len("postgresql://") :]  # the driver the docs extra pins
        if scheme == "sqlite":
            kwargs["connect_args"] = {"timeout": 60}
        try:
            self.engine = sa.create_engine(url, future=True, **kwargs)
        except Exception as err:  # noqa: BLE001 - a malformed URL or a missing driver
            raise UsageError(f"--db '{url}': {err}") from None
        if scheme == "sqlite":

            @sa.event.listens_for(self.engine, "connect")
            def _wal(conn, _record) -> None:
                conn.execute("PRAGMA journal_mode=WAL")
                conn.execute("PRAGMA busy_timeout=60000")

        self.url = url
        self.dialect = scheme
        md = self.meta = sa.MetaData()
        self.schema_version = sa.Table("schema_version", md, sa.Column("version", sa.Integer, nullable=False))
        self.documents = sa.Table(
            "documents",
            md,
            sa.Column("content_hash", sa.String(64), primary_key=True),
            sa.Column("url", sa.Text, nullable=False),
            sa.Column("size", sa.BigInteger, nullable=False),
            sa.Column("kind", sa.String(16)),
            sa.Column("n_pages", sa.Integer),
            sa.Column("n_chars", sa.Integer),
            sa.Column("first_seen_at", sa.Float, nullable=False),
        )
        self.object_versions = sa.Table(
            "object_versions",
            md,
            sa.Column("url", sa.Text, primary_key=True),
            sa.Column("version", sa.Text, nullable=False),
            sa.Column("size", sa.BigInteger, nullable=False),
            sa.Column("content_hash", sa.String(64), nullable=False),
            sa.Column("seen_at", sa.Float, nullable=False),
        )
        self.tasks = sa.Table(
            "tasks",
            md,
            sa.Column("task_key", sa.String(24), primary_key=True),
            sa.Column("schema_json", sa.Text, nullable=False),
            sa.Column("questions_json", sa.Text, nullable=False),
            sa.Column("model", sa.Text, nullable=False),
            sa.Column("created_at", sa.Float, nullable=False),
        )
        self.jobs = sa.Table(
            "jobs",
            md,
            sa.Column("job_id", sa.String(32), primary_key=True),
            sa.Column("content_hash", sa.String(64), nullable=False),
            sa.Column("task_key", sa.String(24), nullable=False),
            sa.Column("generation", sa.Integer, nullable=False),
            sa.Column("url", sa.Text, nullable=False),
            sa.Column("state", sa.String(16), nullable=False),  # queued | running | done | dead
            sa.Column("attempts", sa.Integer, nullable=False, default=0),
            sa.Column("error", sa.Text),
            sa.Column("worker", sa.Text),
            sa.Column("enqueued_at", sa.Float, nullable=False),
            sa.Column("started_at", sa.Float),
            sa.Column("finished_at", sa.Float),
            sa.UniqueConstraint("content_hash", "task_key", "generation", name="jobs_once"),
        )
        self.extractions = sa.Table(
            "extractions",
            md,
            sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
            sa.Column("content_hash", sa.String(64), nullable=False),
            sa.Column("task_key", sa.String(24), nullable=False),
            sa.Column("job_id", sa.String(32), nullable=False),
            sa.Column("data_json", sa.Text, nullable=False),
            sa.Column("valid", sa.Boolean, nullable=False),
            sa.Column("repaired", sa.Boolean, nullable=False),
            sa.Column("mode", sa.String(16), nullable=False),
            sa.Column("n_chunks", sa.Integer, nullable=False),
            sa.Column("failed_chunks", sa.Integer, nullable=False),
            sa.Column("created_at", sa.Float, nullable=False),
            sa.UniqueConstraint("content_hash", "task_key", name="extractions_once"),
        )
        self.citations = sa.Table(
            "citations",
            md,
            sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
            extraction_ref(nullable=False),
            sa.Column("target", sa.Text, nullable=False),
            sa.Column("page", sa.Integer),
            sa.Column("section", sa.Text),
            sa.Column("quote", sa.Text),
        )
        self.answers = sa.Table(
            "answers",
            md,
            sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
            extraction_ref(nullable=False),
            sa.Column("question", sa.Text, nullable=False),
            sa.Column("answer", sa.Text, nullable=False),
        )
        self.usage = sa.Table(
            "usage",
            md,
            sa.Column("job_id", sa.String(32), primary_key=True),
            extraction_ref(),
            sa.Column("attempt", sa.Integer, nullable=False),
            sa.Column("prompt_tokens", sa.Integer, nullable=False),
            sa.Column("completion_tokens", sa.Integer, nullable=False),
            sa.Column("model_calls", sa.Integer, nullable=False),
            sa.Column("parse_ms", sa.Float, nullable=False),
            sa.Column("model_ms", sa.Float, nullable=False),
            sa.Column("latency_ms", sa.Float, nullable=False),  # lease to commit
        )
        self._field_tables: dict[str, Any] = {}
        self._migrate()

    # ------------------------------------------------------------------ schema

    def _schema_lock(self, conn: Any) -> None:
        """Serialise schema changes of concurrent processes on PostgreSQL (CREATE TABLE races otherwise)."""
        if self.dialect == "postgresql":
            conn.execute(self.sa.text("SELECT pg_advisory_xact_lock(7305020101)"))

    def _sqlite_file_lock(self) -> contextlib.AbstractContextManager[Any]:
        """An exclusive lock on `<database>.schema-lock` for a file SQLite database: pysqlite runs DDL
        outside a transaction, so two processes opening a fresh database would both create its tables."""
        db = self.engine.url.database
        if self.dialect != "sqlite" or not db or db == ":memory:":
            return contextlib.nullcontext()

        @contextlib.contextmanager
        def locked() -> Iterator[None]:
            with open(f"{db}.schema-lock", "a") as fh:
                fcntl.flock(fh, fcntl.LOCK_EX)
                try:
                    yield
                finally:
                    fcntl.flock(fh, fcntl.LOCK_UN)

        return locked()

    def _migrate(self) -> None:
        sa = self.sa
        try:
            with self._sqlite_file_lock(), self.engine.begin() as conn:
                self._schema_lock(conn)
                self.meta.create_all(conn, checkfirst=True)
                row = conn.execute(sa.select(self.schema_version.c.version)).first()
                if row is None:
                    conn.execute(self.schema_version.insert().values(version=SCHEMA_VERSION))
                elif row[0] < SCHEMA_VERSION:  # the new tables were just created; nothing else changed
                    conn.execute(self.schema_version.update().values(version=SCHEMA_VERSION))
                elif row[0] > SCHEMA_VERSION:
                    raise RuntimeError(
                        f"database {self.url} has schema version {row[0]}; this posttrain knows up to "
                        f"{SCHEMA_VERSION}: upgrade posttrain"
                    )
        except sa.exc.OperationalError as err:
            raise RuntimeError(f"cannot open database {self.url}: {err.orig}") from None

    def field_table(self, key: str, schema: dict[str, Any]) -> Any:
        """The typed column table of a flat schema (created on first use), or None for nested schemas."""
        if key in self._field_tables:
            return self._field_tables[key]
        cols = flat_columns(schema)
        table = None
        if cols is not None:
            sa = self.sa
            types = {"string": sa.Text, "integer": sa.BigInteger, "number": sa.Float, "boolean": sa.Boolean}
            table = sa.Table(
                f"fields_{key[:12]}",
                self.meta,
                extraction_ref(primary_key=True),
                *(sa.Column(name, types[t]) for name, t in cols.items()),
                extend_existing=True,
            )
            with self.engine.begin() as conn:
                self._schema_lock(conn)
                table.create(conn, checkfirst=True)
        self._field_tables[key] = table
        return table

    # ------------------------------------------------------------------ ingest side

    def register_task(self, key: str, schema: dict[str, Any], questions: list[str], model: str) -> None:
        sa = self.sa
        with self.engine.begin() as conn:
            if conn.execute(sa.select(self.tasks.c.task_key).where(self.tasks.c.task_key == key)).first():
                return
            try:
                conn.execute(
                    self.tasks.insert().values(
                        task_key=key,
                        schema_json=json.dumps(schema),
                        questions_json=json.dumps(questions),
                        model=model,
                        created_at=time.time(),
                    )
                )
            except sa.exc.IntegrityError:
                pass

    def claim_job(
        self, job_id: str, content_hash: str, key: str, url: str, size: int, reprocess: bool
    ) -> bool:
        """Record the document and a job for (content hash, task) unless one exists (then False).
        With `reprocess` a new generation is always recorded."""
        sa = self.sa
        now = time.time()
        j = self.jobs
        try:
            with self.engine.begin() as conn:
                if not conn.execute(
                    sa.select(self.documents.c.content_hash).where(
                        self.documents.c.content_hash == content_hash
                    )
                ).first():
                    conn.execute(
                        self.documents.insert().values(
                            content_hash=content_hash, url=url, size=size, first_seen_at=now
                        )
                    )
                gen = conn.execute(
                    sa.select(sa.func.max(j.c.generation)).where(
                        j.c.content_hash == content_hash, j.c.task_key == key
                    )
                ).scalar()
                if gen is not None and not reprocess:
                    return False
                conn.execute(
                    j.insert().values(
                        job_id=job_id,
                        content_hash=content_hash,
                        task_key=key,
                        generation=0 if gen is None else gen + 1,
                        url=url,
                        state="queued",
                        attempts=0,
                        enqueued_at=now,
                    )
                )
            return True
        except sa.exc.IntegrityError:  # a concurrent ingest recorded it first
            return False

    # ------------------------------------------------------------------ worker side

    def task(self, key: str) -> dict[str, Any]:
        row = self._one(self.sa.select(self.tasks).where(self.tasks.c.task_key == key))
        if row is None:
            raise RuntimeError(f"task {key} is not registered in {self.url}")
        return {
            "schema": json.loads(row.schema_json),
            "questions": json.loads(row.questions_json),
            "model": row.model,
        }

    def _one(self, stmt: Any) -> Any:
        with self.engine.connect() as conn:
            return conn.execute(stmt).first()

    def job_known(self, job_id: str) -> bool:
        return self._one(self.sa.select(self.jobs.c.job_id).where(self.jobs.c.job_id == job_id)) is not None

    def known_hash(self, url: str, version: str, size: int) -> str | None:
        """The content hash recorded for `url` at this version and size, or None (new or changed)."""
        v = self.object_versions
        row = self._one(
            self.sa.select(v.c.content_hash).where(v.c.url == url, v.c.version == version, v.c.size == size)
        )
        return None if row is None else row[0]

    def remember_object(self, url: str, version: str, size: int, content_hash: str) -> None:
        """Record what `url` held at this version; a concurrent ingest recording it first wins."""
        v = self.object_versions
        try:
            with self.engine.begin() as conn:
                conn.execute(v.delete().where(v.c.url == url))
                conn.execute(
                    v.insert().values(
                        url=url, version=version, size=size, content_hash=content_hash, seen_at=time.time()
                    )
                )
        except self.sa.exc.IntegrityError:
            pass

    def job_exists(self, content_hash: str, key: str) -> bool:
        j = self.jobs
        return (
            self._one(self.sa.select(j.c.job_id).where(j.c.content_hash == content_hash, j.c.task_key == key))
            is not None
        )

    def has_result(self, content_hash: str, key: str) -> bool:
        e = self.extractions
        return (
            self._one(self.sa.select(e.c.id).where(e.c.content_hash == content_hash, e.c.task_key == key))
            is not None
        )

    def mark(
        self,
        job_id: str,
        state: str,
        attempts: int | None = None,
        error: str | None = None,
        worker: str | None = None,
    ) -> None:
        values: dict[str, Any] = {"state": state}
        if state == "running":
            values["started_at"] = time.time()
        if state in ("done", "dead"):
            values["finished_at"] = time.time()
        for k, v in (("attempts", attempts), ("error", error), ("worker", worker)):
            if v is not None:
                values[k] = v
        with self.engine.begin() as conn:
            conn.execute(self.jobs.update().where(self.jobs.c.job_id == job_id).values(**values))

    def set_document_info(self, content_hash: str, kind: str, n_pages: int, n_chars: int) -> None:
        with self.engine.begin() as conn:
            conn.execute(
                self.documents.update()
                .where(self.documents.c.content_hash == content_hash)
                .values(kind=kind, n_pages=n_pages, n_chars=n_chars)
            )

    def write_result(
        self,
        job_id: str,
        content_hash: str,
        key: str,
        schema: dict[str, Any],
        questions: list[str],
        result: AnalysisResult,
        attempt: int,
        latency_ms: float,
        replace: bool,
    ) -> bool:
        """Write the whole result of a job in one transaction; False when a result for (content hash,
        task) already exists (a duplicate delivery) and `replace` is off. `replace` swaps an older result
        for this one (reprocessing)."""
        sa = self.sa
        fields = self.field_table(key, schema)
        e = self.extractions
        try:
            with self.engine.begin() as conn:
                if replace:
                    old = [
                        r[0]
                        for r in conn.execute(
                            sa.select(e.c.id).where(e.c.content_hash == content_hash, e.c.task_key == key)
                        )
                    ]
                    if old:
                        for t in (self.citations, self.answers):
                            conn.execute(t.delete().where(t.c.extraction_id.in_(old)))
                        conn.execute(
                            self.usage.update()
                            .where(self.usage.c.extraction_id.in_(old))
                            .values(extraction_id=None)
                        )
                        if fields is not None:
                            conn.execute(fields.delete().where(fields.c.extraction_id.in_(old)))
                        conn.execute(e.delete().where(e.c.id.in_(old)))
                ext_id = conn.execute(
                    e.insert().values(
                        content_hash=content_hash,
                        task_key=key,
                        job_id=job_id,
                        data_json=json.dumps(result.data, sort_keys=True),
                        valid=result.valid,
                        repaired=result.repaired,
                        mode=result.mode,
                        n_chunks=result.n_chunks,
                        failed_chunks=result.failed_chunks,
                        created_at=time.time(),
                    )
                ).inserted_primary_key[0]
                if fields is not None and result.valid:
                    cols = flat_columns(schema) or {}
                    conn.execute(
                        fields.insert().values(extraction_id=ext_id, **{c: result.data.get(c) for c in cols})
                    )
                for c in result.citations:
                    conn.execute(
                        self.citations.insert().values(
                            extraction_id=ext_id,
                            target=c.target,
                            page=c.page,
                            section=c.section,
                            quote=c.quote[:500],
                        )
                    )
                for q, a in zip(questions, result.answers, strict=False):
                    conn.execute(self.answers.insert().values(extraction_id=ext_id, question=q, answer=a))
                conn.execute(self.usage.delete().where(self.usage.c.job_id == job_id))
                conn.execute(
                    self.usage.insert().values(
                        job_id=job_id,
                        extraction_id=ext_id,
                        attempt=attempt,
                        prompt_tokens=result.prompt_tokens,
                        completion_tokens=result.completion_tokens,
                        model_calls=result.model_calls,
                        parse_ms=result.parse_ms,
                        model_ms=result.model_ms,
                        latency_ms=latency_ms,
                    )
                )
                conn.execute(
                    self.jobs.update()
                    .where(self.jobs.c.job_id == job_id)
                    .values(state="done", attempts=attempt, finished_at=time.time(), error=None)
                )
            return True
        except sa.exc.IntegrityError:
            return False

    # ------------------------------------------------------------------ reading

    def select(self, sql: str) -> tuple[list[str], list[tuple]]:
        """Run one read-only query (SELECT or WITH); anything else is a UsageError. The transaction is
        rolled back, so even a writing CTE leaves nothing behind."""
        head = sql.strip().split(None, 1)[0].upper() if sql.strip() else ""
        if head not in ("SELECT", "WITH") or ";" in sql.strip().rstrip(";"):
            raise UsageError("query: give one SELECT (or WITH ... SELECT) statement")
        sa = self.sa
        with self.engine.connect() as conn:
            trans = conn.begin()
            try:
                res = conn.execute(sa.text(sql))
                return list(res.keys()), [tuple(r) for r in res.fetchall()]
            except sa.exc.DBAPIError as err:
                raise UsageError(f"query failed: {str(err.orig).strip()}") from None
            finally:
                trans.rollback()

    def job_counts(self) -> dict[str, int]:
        sa = self.sa
        with self.engine.connect() as conn:
            rows = conn.execute(sa.select(self.jobs.c.state, sa.func.count()).group_by(self.jobs.c.state))
            return {s: n for s, n in rows}

    def results(self) -> list[dict[str, Any]]:
        """One row per extraction with its document, latency and tokens (what export and the report show)."""
        sa = self.sa
        e, d, u = self.extractions, self.documents, self.usage
        stmt = (
            sa.select(
                e.c.id,
                e.c.content_hash,
                d.c.url,
                d.c.kind,
                d.c.n_pages,
                e.c.task_key,
                e.c.job_id,
                e.c.data_json,
                e.c.valid,
                e.c.repaired,
                e.c.mode,
                e.c.n_chunks,
                e.c.failed_chunks,
                u.c.attempt,
                u.c.latency_ms,
                u.c.model_ms,
                u.c.prompt_tokens,
                u.c.completion_tokens,
                u.c.model_calls,
            )
            .join(d, d.c.content_hash == e.c.content_hash)
            .outerjoin(u, u.c.extraction_id == e.c.id)
            .order_by(d.c.url)
        )
        with self.engine.connect() as conn:
            return [dict(r._mapping) for r in conn.execute(stmt)]

    def dispose(self) -> None:
        self.engine.dispose()
