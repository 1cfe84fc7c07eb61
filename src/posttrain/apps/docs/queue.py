"""The job queue behind one interface: an embedded SQLite queue (the default) and Redis streams with a
consumer group. Both give at-least-once delivery with leases: a leased job that is not acknowledged
within `visibility_s` (its worker died) is leased again; a failed job is retried after an exponential
backoff and goes to the dead-letter table (list) after `max_attempts` deliveries.

Owns delivery only; exactly-once *results* are the database's job (a unique key per result).
"""

from __future__ import annotations

import functools
import json
import sqlite3
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlparse

from posttrain.apps.docs.store import UsageError


@dataclass
class Lease:
    job_id: str
    payload: dict[str, Any]
    attempt: int  # 1 for the first delivery
    token: str  # proves ownership to ack/fail/extend (SQLite: a random token; Redis: the stream entry id)


# called with (job id, attempts, error) when lease() dead-letters a job whose leases kept expiring
OnDead = Callable[[str, int, str], None]


@dataclass
class QueuePolicy:
    visibility_s: float = 60.0
    max_attempts: int = 3
    backoff_s: float = 2.0  # retry n waits backoff_s * 2**(n-1)

    def __post_init__(self) -> None:
        if self.visibility_s <= 0 or self.max_attempts < 1 or self.backoff_s < 0:
            raise UsageError(
                f"queue policy needs visibility_s > 0, max_attempts >= 1, backoff_s >= 0; got {self}"
            )

    def delay(self, attempt: int) -> float:
        return self.backoff_s * 2 ** max(0, attempt - 1)


class JobQueue(Protocol):
    policy: QueuePolicy

    def enqueue(self, payload: dict[str, Any], job_id: str | None = None) -> str: ...
    def lease(self, worker: str, on_dead: OnDead | None = None) -> Lease | None: ...
    def extend(self, lease: Lease) -> bool: ...
    def ack(self, lease: Lease) -> bool: ...
    def fail(self, lease: Lease, error: str) -> str: ...  # "retry" | "dead" | "lost" (re-leased meanwhile)
    def counts(self) -> dict[str, int]: ...
    def dead_letters(self) -> list[dict[str, Any]]: ...
    def close(self) -> None: ...


LOST_LEASE = (
    "lease expired {n} time(s) without an acknowledgement (the worker died or overran its visibility timeout)"
)


def _locked(method):
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)

    return wrapper


class SQLiteQueue:
    """Jobs in one SQLite file (WAL); every state change is one IMMEDIATE transaction, so any number of
    worker processes can share the file (and the threads of one process share a connection under a lock)."""

    def __init__(self, path: str | Path, policy: QueuePolicy | None = None) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.policy = policy or QueuePolicy()
        self._lock = threading.RLock()
        self._db = sqlite3.connect(str(self.path), timeout=60, isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA busy_timeout=60000")
        self._db.executescript(
            """
            CREATE TABLE IF NOT EXISTS jobs (
                id TEXT PRIMARY KEY, payload TEXT NOT NULL, state TEXT NOT NULL,
                attempts INTEGER NOT NULL DEFAULT 0, available_at REAL NOT NULL,
                lease_token TEXT, leased_by TEXT, lease_until REAL, last_error TEXT,
                created_at REAL NOT NULL, updated_at REAL NOT NULL);
            CREATE INDEX IF NOT EXISTS jobs_state ON jobs(state, available_at);
            CREATE TABLE IF NOT EXISTS dead_letter (
                id TEXT PRIMARY KEY, payload TEXT NOT NULL, attempts INTEGER NOT NULL,
                error TEXT NOT NULL, failed_at REAL NOT NULL);
            """
        )

    def _tx(self):
        self._db.execute("BEGIN IMMEDIATE")

    @_locked
    def enqueue(self, payload: dict[str, Any], job_id: str | None = None) -> str:
        job_id = job_id or uuid.uuid4().hex
        now = time.time()
        self._db.execute(
            "INSERT INTO jobs (id, payload, state, available_at, created_at, updated_at) VALUES (?,?,?,?,?,?)",
            (job_id, json.dumps(payload), "ready", now, now, now),
        )
        return job_id

    def _dead(self, job_id: str, payload: str, attempts: int, error: str, now: float) -> None:
        self._db.execute(
            "UPDATE jobs SET state='dead', last_error=?, updated_at=? WHERE id=?", (error, now, job_id)
        )
        self._db.execute(
            "INSERT OR REPLACE INTO dead_letter (id, payload, attempts, error, failed_at) VALUES (?,?,?,?,?)",
            (job_id, payload, attempts, error, now),
        )

    @_locked
    def lease(self, worker: str, on_dead: OnDead | None = None) -> Lease | None:
        while True:
            now = time.time()
            self._tx()
            try:
                row = self._db.execute(
                    "SELECT id, payload, attempts, state FROM jobs WHERE (state='ready' AND available_at<=?) "
                    "OR (state='leased' AND lease_until<?) ORDER BY available_at LIMIT 1",
                    (now, now),
                ).fetchone()
                if row is None:
                    self._db.execute("COMMIT")
                    return None
                job_id, payload, attempts, state = row
                if state == "leased" and attempts >= self.policy.max_attempts:
                    self._dead(job_id, payload, attempts, LOST_LEASE.format(n=attempts), now)
                    self._db.execute("COMMIT")
                    if on_dead is not None:
                        on_dead(job_id, attempts, LOST_LEASE.format(n=attempts))
                    continue
                token = uuid.uuid4().hex
                self._db.execute(
                    "UPDATE jobs SET state='leased', attempts=attempts+1, lease_token=?, leased_by=?, "
                    "lease_until=?, updated_at=? WHERE id=?",
                    (token, worker, now + self.policy.visibility_s, now, job_id),
                )
                self._db.execute("COMMIT")
                return Lease(job_id, json.loads(payload), attempts + 1, token)
            except BaseException:
                self._db.execute("ROLLBACK")
                raise

    @_locked
    def extend(self, lease: Lease) -> bool:
        cur = self._db.execute(
            "UPDATE jobs SET lease_until=? WHERE id=? AND lease_token=? AND state='leased'",
            (time.time() + self.policy.visibility_s, lease.job_id, lease.token),
        )
        return cur.rowcount == 1

    @_locked
    def ack(self, lease: Lease) -> bool:
        cur = self._db.execute(
            "UPDATE jobs SET state='done', lease_token=NULL, updated_at=? WHERE id=? AND lease_token=?",
            (time.time(), lease.job_id, lease.token),
        )
        return cur.rowcount == 1

    @_locked
    def fail(self, lease: Lease, error: str) -> str:
        now = time.time()
        self._tx()
        try:
            row = self._db.execute(
                "SELECT payload, attempts FROM jobs WHERE id=? AND lease_token=?", (lease.job_id, lease.token)
            ).fetchone()
            if row is None:  # the lease was lost meanwhile; whoever holds it now decides
                self._db.execute("COMMIT")
                return "lost"
            payload, attempts = row
            if attempts >= self.policy.max_attempts:
                self._dead(lease.job_id, payload, attempts, error, now)
                outcome = "dead"
            else:
                self._db.execute(
                    "UPDATE jobs SET state='ready', lease_token=NULL, available_at=?, last_error=?, updated_at=? "
                    "WHERE id=?",
                    (now + self.policy.delay(attempts), error, now, lease.job_id),
                )
                outcome = "retry"
            self._db.execute("COMMIT")
            return outcome
        except BaseException:
            self._db.execute("ROLLBACK")
            raise

    @_locked
    def counts(self) -> dict[str, int]:
        out = {"ready": 0, "leased": 0, "done": 0, "dead": 0}
        for state, n in self._db.execute("SELECT state, COUNT(*) FROM jobs GROUP BY state"):
            out[state] = n
        return out

    @_locked
    def dead_letters(self) -> list[dict[str, Any]]:
        rows = self._db.execute(
            "SELECT id, payload, attempts, error, failed_at FROM dead_letter ORDER BY failed_at"
        )
        return [
            {"job_id": i, "payload": json.loads(p), "attempts": a, "error": e, "failed_at": t}
            for i, p, a, e, t in rows
        ]

    @_locked
    def close(self) -> None:
        self._db.close()


class RedisQueue:
    """Redis streams: one stream and consumer group per namespace. A lease is a delivery to this consumer
    (XREADGROUP, or XAUTOCLAIM of an entry idle longer than the visibility timeout); retries wait in a
    sorted set until due; dead letters are a list."""

    GROUP = "workers"

    def __init__(
        self, url: str, policy: QueuePolicy | None = None, namespace: str = "posttrain:docs"
    ) -> None:
        try:
            import redis
        except ImportError:
            raise UsageError(
                "--queue redis:// needs the redis package: pip install 'posttrain[docs]'"
            ) from None
        self.policy = policy or QueuePolicy()
        self.r = redis.Redis.from_url(url, decode_responses=True, socket_timeout=30)
        try:
            self.r.ping()
        except redis.RedisError as err:
            raise RuntimeError(f"cannot reach Redis at {url}: {err}") from None
        self.ns = namespace
        self.stream, self.delayed, self.dead = (
            f"{namespace}:stream",
            f"{namespace}:delayed",
            f"{namespace}:dead",
        )
        try:
            self.r.xgroup_create(self.stream, self.GROUP, id="0", mkstream=True)
        except redis.ResponseError as err:
            if "BUSYGROUP" not in str(err):
                raise

    def _job(self, job_id: str) -> str:
        return f"{self.ns}:job:{job_id}"

    def enqueue(self, payload: dict[str, Any], job_id: str | None = None) -> str:
        job_id = job_id or uuid.uuid4().hex
        pipe = self.r.pipeline()
        pipe.hset(
            self._job(job_id), mapping={"payload": json.dumps(payload), "attempts": 0, "state": "ready"}
        )
        pipe.xadd(self.stream, {"job": job_id})
        pipe.execute()
        return job_id

    def _promote_due(self) -> None:
        for job_id in self.r.zrangebyscore(self.delayed, "-inf", time.time()):
            if self.r.zrem(self.delayed, job_id) == 1:  # exactly one worker wins the move
                self.r.hset(self._job(job_id), "state", "ready")
                self.r.xadd(self.stream, {"job": job_id})

    def _to_dead(self, job_id: str, attempts: int, error: str) -> None:
        payload = self.r.hget(self._job(job_id), "payload") or "{}"
        entry = {"job_id": job_id, "payload": json.loads(payload), "attempts": attempts, "error": error}
        self.r.rpush(self.dead, json.dumps({**entry, "failed_at": time.time()}))
        self.r.hset(self._job(job_id), "state", "dead")

    def lease(self, worker: str, on_dead: OnDead | None = None) -> Lease | None:
        self._promote_due()
        while True:
            entry = None
            _, claimed, _ = self.r.xautoclaim(
                self.stream, self.GROUP, worker, int(self.policy.visibility_s * 1000), "0-0", count=1
            )
            expired = bool(claimed)
            if claimed:
                entry = claimed[0]
            else:
                got = self.r.xreadgroup(self.GROUP, worker, {self.stream: ">"}, count=1)
                if got and got[0][1]:
                    entry = got[0][1][0]
            if entry is None:
                return None
            msg_id, fields = entry
            job_id = fields["job"]
            attempts = int(self.r.hget(self._job(job_id), "attempts") or 0)
            if expired and attempts >= self.policy.max_attempts:
                self._to_dead(job_id, attempts, LOST_LEASE.format(n=attempts))
                self.r.xack(self.stream, self.GROUP, msg_id)
                self.r.xdel(self.stream, msg_id)
                if on_dead is not None:
                    on_dead(job_id, attempts, LOST_LEASE.format(n=attempts))
                continue
            attempts = self.r.hincrby(self._job(job_id), "attempts", 1)
            token = f"{msg_id}|{uuid.uuid4().hex}"  # the entry id, plus who holds this delivery of it
            self.r.hset(self._job(job_id), mapping={"state": "leased", "leased_by": worker, "lease": token})
            payload = json.loads(self.r.hget(self._job(job_id), "payload") or "{}")
            return Lease(job_id, payload, attempts, token)

    def _holds(self, lease: Lease) -> bool:
        return self.r.hget(self._job(lease.job_id), "lease") == lease.token

    @staticmethod
    def _entry(lease: Lease) -> str:
        return lease.token.split("|", 1)[0]

    def extend(self, lease: Lease) -> bool:
        if not self._holds(lease):
            return False
        entry = self._entry(lease)
        pending = self.r.xpending_range(self.stream, self.GROUP, entry, entry, 1)
        if not pending:
            return False
        self.r.xclaim(self.stream, self.GROUP, pending[0]["consumer"], 0, [entry], justid=True)  # resets idle
        return True

    def ack(self, lease: Lease) -> bool:
        if not self._holds(lease):  # re-leased meanwhile: the new holder acknowledges
            return False
        entry = self._entry(lease)
        n = self.r.xack(self.stream, self.GROUP, entry)
        self.r.xdel(self.stream, entry)
        self.r.hset(self._job(lease.job_id), mapping={"state": "done", "lease": ""})
        return n == 1

    def fail(self, lease: Lease, error: str) -> str:
        if not self._holds(lease):
            return "lost"
        entry = self._entry(lease)
        self.r.xack(self.stream, self.GROUP, entry)
        self.r.xdel(self.stream, entry)
        self.r.hset(self._job(lease.job_id), "lease", "")
        if lease.attempt >= self.policy.max_attempts:
            self._to_dead(lease.job_id, lease.attempt, error)
            return "dead"
        self.r.hset(self._job(lease.job_id), mapping={"state": "delayed", "last_error": error})
        self.r.zadd(self.delayed, {lease.job_id: time.time() + self.policy.delay(lease.attempt)})
        return "retry"

    def counts(self) -> dict[str, int]:
        pending = self.r.xpending(self.stream, self.GROUP)["pending"]
        return {
            "ready": self.r.xlen(self.stream) - pending,
            "delayed": self.r.zcard(self.delayed),
            "leased": pending,
            "dead": self.r.llen(self.dead),
        }

    def dead_letters(self) -> list[dict[str, Any]]:
        return [json.loads(x) for x in self.r.lrange(self.dead, 0, -1)]

    def close(self) -> None:
        self.r.close()


def open_queue(url: str, policy: QueuePolicy | None = None) -> JobQueue:
    """`sqlite:///path/queue.db` (or a plain path) or `redis://host:port/db`."""
    parsed = urlparse(url)
    if parsed.scheme in ("redis", "rediss"):
        return RedisQueue(url, policy)
    if parsed.scheme == "sqlite":
        path = url[len("sqlite:///") :] if url.startswith("sqlite:///") else ""
        if not path:
            raise UsageError(f"--queue '{url}': write sqlite:///path/to/queue.db")
        return SQLiteQueue(path, policy)  # sqlite:///relative.db, sqlite:////absolute.db (SQLAlchemy's form)
    if parsed.scheme == "":
        return SQLiteQueue(url, policy)
    raise UsageError(f"--queue '{url}': supported are sqlite:///path/queue.db and redis://host:port/db")
