"""A document worker: N concurrent slots that lease a job, read the object, parse it, run the analysis
and write the result in one transaction, then acknowledge. A lease is extended while its job runs (a
heartbeat thread, every third of the visibility timeout), so only a dead worker's jobs are re-leased.

A failure (unreadable object, parse error, unparseable model output, server down) is reported to the
queue, which retries with backoff and dead-letters after the last attempt; the job row says why.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

from posttrain.apps.docs.analyze import ChatModel, analyze
from posttrain.apps.docs.db import Database
from posttrain.apps.docs.parse import DEFAULT_MAX_BYTES, parse_document
from posttrain.apps.docs.queue import JobQueue, Lease
from posttrain.apps.docs.store import content_hash, read_url

log = logging.getLogger("posttrain.docs.worker")


@dataclass
class WorkerStats:
    done: int = 0
    duplicates: int = 0  # deliveries whose result already existed (acknowledged, nothing written)
    failed: int = 0
    dead: int = 0


class Worker:
    def __init__(
        self,
        queue: JobQueue,
        db: Database,
        model: ChatModel,
        concurrency: int = 1,
        s3_endpoint: str | None = None,
        max_bytes: int = DEFAULT_MAX_BYTES,
        max_new_tokens: int = 256,
        poll_s: float = 0.5,
        worker_id: str | None = None,
    ) -> None:
        if concurrency < 1:
            raise ValueError(f"--concurrency must be >= 1, got {concurrency}")
        self.queue, self.db, self.model = queue, db, model
        self.concurrency = concurrency
        self.s3_endpoint = s3_endpoint
        self.max_bytes = max_bytes
        self.max_new_tokens = max_new_tokens
        self.poll_s = poll_s
        self.id = worker_id or f"{socket.gethostname()}-{os.getpid()}"
        self.stats = WorkerStats()
        self._tasks: dict[str, dict[str, Any]] = {}

    def _task(self, key: str) -> dict[str, Any]:
        if key not in self._tasks:
            self._tasks[key] = self.db.task(key)
        return self._tasks[key]

    async def run(self, until_idle: bool = False, max_jobs: int | None = None) -> WorkerStats:
        """Work until stopped; with `until_idle`, return once the queue holds nothing ready, delayed or
        leased (so a dead worker's lease is waited out and taken over)."""
        taken = 0

        async def slot(i: int) -> None:
            nonlocal taken
            name = f"{self.id}/{i}"
            while max_jobs is None or taken < max_jobs:
                lease = await asyncio.to_thread(self.queue.lease, name, self._lost)
                if lease is None:
                    if until_idle:
                        c = await asyncio.to_thread(self.queue.counts)
                        if not (c.get("ready", 0) or c.get("leased", 0) or c.get("delayed", 0)):
                            return
                    await asyncio.sleep(self.poll_s)
                    continue
                taken += 1
                await self.process(lease, name)

        await asyncio.gather(*(slot(i) for i in range(self.concurrency)))
        return self.stats

    def _lost(self, job_id: str, attempts: int, error: str) -> None:
        """The queue dead-lettered a job whose workers kept dying: the job row says so too."""
        self.db.mark(job_id, "dead", attempts, error)
        self.stats.dead += 1

    def _heartbeat(self, lease: Lease, stop: threading.Event) -> None:
        """Extend the lease every third of the visibility timeout until `stop`. A thread, not a coroutine:
        a long engine step or a starved event loop must not let a live worker's lease expire."""
        every = self.queue.policy.visibility_s / 3
        while not stop.wait(every):
            if not self.queue.extend(lease):
                log.warning("job %s: lease lost (taken over after its visibility timeout)", lease.job_id)
                return

    async def process(self, lease: Lease, name: str) -> str:
        """Run one leased job to an outcome: "done", "duplicate", "retry" or "dead"."""
        t0 = time.perf_counter()
        p = lease.payload
        job_id, chash, key, url = lease.job_id, p["content_hash"], p["task_key"], p["url"]
        reprocess = bool(p.get("reprocess"))
        db, q = self.db, self.queue
        if not await asyncio.to_thread(db.job_known, job_id):  # an ingest that died before recording it
            await asyncio.to_thread(q.ack, lease)
            return "duplicate"
        if not reprocess and await asyncio.to_thread(db.has_result, chash, key):
            await asyncio.to_thread(q.ack, lease)
            await asyncio.to_thread(db.mark, job_id, "done", lease.attempt)
            self.stats.duplicates += 1
            return "duplicate"
        await asyncio.to_thread(db.mark, job_id, "running", lease.attempt, None, name)
        stop = threading.Event()
        threading.Thread(target=self._heartbeat, args=(lease, stop), daemon=True).start()
        try:
            data = await asyncio.to_thread(read_url, url, self.s3_endpoint)
            if content_hash(data) != chash:
                raise RuntimeError(f"object {url} changed since it was ingested (its content hash differs)")
            tp = time.perf_counter()
            doc = parse_document(data, url, self.max_bytes)
            parse_ms = (time.perf_counter() - tp) * 1000
            await asyncio.to_thread(db.set_document_info, chash, doc.kind, doc.n_pages, len(doc.text))
            task = await asyncio.to_thread(self._task, key)
            if task["model"] != self.model.name:
                raise RuntimeError(
                    f"job is for model '{task['model']}'; this worker runs '{self.model.name}'"
                )
            result = await analyze(doc, task["schema"], task["questions"], self.model, self.max_new_tokens)
            result.parse_ms = parse_ms
            latency_ms = (time.perf_counter() - t0) * 1000
            written = await asyncio.to_thread(
                db.write_result,
                job_id,
                chash,
                key,
                task["schema"],
                task["questions"],
                result,
                lease.attempt,
                latency_ms,
                reprocess,
            )
        except Exception as err:  # noqa: BLE001 - every failure becomes a queue outcome, never a dead worker
            stop.set()
            msg = f"{type(err).__name__}: {err}"[:2000]
            outcome = await asyncio.to_thread(q.fail, lease, msg)
            if outcome != "lost":
                await asyncio.to_thread(
                    db.mark, job_id, "dead" if outcome == "dead" else "queued", lease.attempt, msg
                )
            self.stats.dead += outcome == "dead"
            self.stats.failed += 1
            log.warning("job %s (%s) attempt %d: %s -> %s", job_id, url, lease.attempt, msg, outcome)
            return outcome
        stop.set()
        await asyncio.to_thread(q.ack, lease)
        if written:
            self.stats.done += 1
            return "done"
        self.stats.duplicates += 1
        return "duplicate"
