"""The two queues keep one contract (SQLite and a real redis-server): a job is delivered again after
its visibility timeout unless acknowledged, an old holder can neither acknowledge nor fail it once
re-leased, a failed job waits out its backoff (hand-computed), and dead-letters after max_attempts,
with its error, while other jobs keep flowing."""

from __future__ import annotations

import time

import pytest

from posttrain.apps.docs.queue import LOST_LEASE, QueuePolicy, RedisQueue, SQLiteQueue, open_queue
from posttrain.apps.docs.store import UsageError

from .docs_services import redis_url  # noqa: F401 - a fixture


@pytest.fixture(params=["sqlite", "redis"])
def make_queue(request, tmp_path):
    made = []

    def make(**policy):
        if request.param == "sqlite":
            q = SQLiteQueue(tmp_path / f"q{len(made)}.db", QueuePolicy(**policy))
        else:
            ns = f"test:{request.node.name}:{len(made)}"  # one fresh stream per queue
            q = RedisQueue(request.getfixturevalue("redis_url"), QueuePolicy(**policy), namespace=ns)
        made.append(q)
        return q

    yield make
    for q in made:
        q.close()


def test_backoff_is_exponential():
    p = QueuePolicy(backoff_s=0.5)
    assert [p.delay(n) for n in (1, 2, 3, 4)] == [0.5, 1.0, 2.0, 4.0]
    with pytest.raises(UsageError):
        QueuePolicy(max_attempts=0)


def test_retry_with_backoff_then_dead_letter(make_queue):
    q = make_queue(visibility_s=30, max_attempts=3, backoff_s=0.3)
    job = q.enqueue({"n": 1})
    other = q.enqueue({"n": 2})
    first = q.lease("w")
    assert (first.job_id, first.attempt, first.payload) == (job, 1, {"n": 1})
    assert q.fail(first, "boom 1") == "retry"
    second = q.lease("w")
    assert second.job_id == other  # the failed job waits out its backoff; the other one flows
    assert q.ack(second)
    assert q.lease("w") is None
    time.sleep(0.35)
    again = q.lease("w")
    assert (again.job_id, again.attempt) == (job, 2)
    assert q.fail(again, "boom 2") == "retry"
    time.sleep(0.3)
    assert q.lease("w") is None  # second retry waits 0.6 s
    time.sleep(0.35)
    last = q.lease("w")
    assert last.attempt == 3 and q.fail(last, "boom 3") == "dead"
    (dead,) = q.dead_letters()
    assert (dead["job_id"], dead["attempts"], dead["error"], dead["payload"]) == (job, 3, "boom 3", {"n": 1})
    time.sleep(1.3)
    assert q.lease("w") is None


def test_expired_lease_is_released_and_the_old_holder_loses_it(make_queue):
    q = make_queue(visibility_s=0.3, max_attempts=2, backoff_s=0)
    job = q.enqueue({"n": 1})
    a = q.lease("a")
    assert q.lease("b") is None
    time.sleep(0.4)
    b = q.lease("b")
    assert (b.job_id, b.attempt) == (job, 2)
    assert not q.ack(a) and q.fail(a, "late") == "lost" and not q.extend(a)
    time.sleep(0.4)  # b dies too: after max_attempts lost leases the job is dead-lettered
    told = []
    assert q.lease("c", lambda *args: told.append(args)) is None
    assert told == [(job, 2, LOST_LEASE.format(n=2))]
    (dead,) = q.dead_letters()
    assert dead["error"] == LOST_LEASE.format(n=2)


def test_extend_keeps_a_live_lease(make_queue):
    q = make_queue(visibility_s=2.0, max_attempts=3, backoff_s=0)  # wide margins: loaded machines oversleep
    q.enqueue({"n": 1})
    a = q.lease("a")
    for _ in range(4):
        time.sleep(0.6)  # 2.4 s in all: past the visibility timeout, so only the extensions keep the lease
        assert q.extend(a)
        assert q.lease("b") is None
    assert q.ack(a) and q.lease("b") is None


def test_bad_queue_urls():
    with pytest.raises(UsageError, match="amqp"):
        open_queue("amqp://host/q")
    with pytest.raises(UsageError, match="sqlite:///path"):
        open_queue("sqlite://")
