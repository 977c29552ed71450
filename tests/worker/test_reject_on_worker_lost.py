"""A threaded member declared ``acks_late=True, reject_on_worker_lost=True`` whose pool process is
killed: the gate decides what comes next (a retry, or its death), never a requeue of its broker
message.  A death reads FAILURE (WorkerLostError) and calls its errbacks once, as it does without
``reject_on_worker_lost``; a retry runs again, alone, and succeeds."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from celery import states
from celery.exceptions import WorkerLostError

from celery_threads import Threads
from tests.support.helpers import events, last_beat, starts, tid, wait_for


@pytest.fixture
def r(proj):
    return proj.history()


def stored_state(proj, task_id: str) -> str:
    """The state the result backend holds now, read afresh."""
    return proj.app.backend.get_task_meta(task_id, cache=False)["status"]


def start_of(r, thread: str, label: str, index: int = 0) -> int:
    """When `label` started (its `index`-th attempt), on the Redis server's clock."""
    return [e.at_us for e in events(r, thread) if e.kind == "start" and e.label == label][index]


def kill_running(r, thread: str, label: str) -> None:
    """SIGKILL the pool process running `label`'s first attempt, once it beats."""
    wait_for(lambda: r.llen(f"beats:{thread}"), what=f"{label} to start")
    os.kill(int(r.lindex(f"pid:{thread}", 0)), signal.SIGKILL)


@contextmanager
def task_events(app) -> Iterator[list[dict]]:
    """The events the workers send meanwhile, as they arrive (a receiver in a thread), from the
    first one it gets (a worker's heartbeat, at the latest: subscribed by then)."""
    seen: list[dict] = []
    with app.connection_for_read() as conn:
        receiver = app.events.Receiver(conn, handlers={"*": seen.append})
        runner = threading.Thread(target=receiver.capture, kwargs={"wakeup": False}, daemon=True)
        runner.start()
        try:
            wait_for(lambda: seen, what="the event receiver to get its first event")
            yield seen
        finally:
            receiver.should_stop = True
            runner.join(10)


def test_death_reads_failure_and_calls_errbacks_once(proj, make_deployment, r):
    d = make_deployment(CT_DISPATCH_INTERVAL="0.2")
    w = d.worker("w", concurrency=2)
    thread = tid("lost")
    with task_events(proj.app) as seen:
        doomed = proj.lost_rejected.apply_async((thread, "doomed"), link_error=proj.errback_log.s())
        _death_ends_as_failure(proj, w, r, thread, doomed)
        wait_for(
            lambda: [e for e in seen if e.get("uuid") == doomed.id and e["type"] == "task-failed"],
            what="the task-failed event",
        )
    mine = [e["type"] for e in seen if e.get("uuid") == doomed.id]
    assert mine.count("task-failed") == 1, mine
    assert "task-rejected" not in mine, mine


def _death_ends_as_failure(proj, w, r, thread, doomed) -> None:
    nxt = proj.record.delay(thread, "next")
    kill_running(r, thread, "doomed")
    assert nxt.get(timeout=30) == "next"
    # The body beat until its process was killed; the next member started after that.
    assert start_of(r, thread, "next") > last_beat(r, thread, "doomed")
    # Final, not left STARTED/PENDING with its message requeued: get() returns.
    assert isinstance(doomed.get(timeout=30, propagate=False), WorkerLostError)
    assert doomed.state == states.FAILURE
    assert stored_state(proj, doomed.id) == states.FAILURE
    [dead] = [x for x in Threads(proj.app).dead() if x.task_id == doomed.id]
    assert "WorkerLostError" in dead.exception
    wait_for(lambda: r.llen(f"errbacks:{doomed.id}"), what="the errback to run")
    # A second call would have been sent with the first: a plain task queued behind them has run
    # once it returns (its sleep outlasts any such call started beside it).
    proj.plain.delay(tid("barrier"), "barrier", sleep=0.5).get(timeout=30)
    assert r.llen(f"errbacks:{doomed.id}") == 1
    assert starts(r, thread) == ["doomed", "next"]
    # One delivery, acknowledged: none requeued to be received again.
    assert w.output().count(f"{doomed.id}] received") == 1
    assert f"{doomed.id}] succeeded" not in w.output()


def test_retry_runs_again_alone_and_succeeds(proj, make_deployment, r):
    d = make_deployment(CT_DISPATCH_INTERVAL="0.2")
    w = d.worker("w", concurrency=2)
    thread = tid("retried")
    go = f"go:{thread}"
    result = proj.lost_rejected_retried.delay(thread, "flaky", until=go)
    kill_running(r, thread, "flaky")
    wait_for(lambda: len(starts(r, thread)) == 2, what="the retry to start")
    # The lost attempt stored RETRY (no final state) while the retry runs.
    assert stored_state(proj, result.id) == states.RETRY
    r.set(go, 1)
    assert result.get(timeout=30) == "flaky"
    assert result.state == states.SUCCESS
    attempts = [x.decode() for x in r.lrange(f"attempts:{thread}", 0, -1)]
    assert attempts == ["0", "1", "1|ok"]
    # The retry started after the killed body's last beat: never two at once.
    assert start_of(r, thread, "flaky", 1) > last_beat(r, thread, "flaky")
    assert not [x for x in Threads(proj.app).dead() if x.thread_id == thread]
    # The retry's delivery only, besides the first: the lost delivery was not requeued.
    assert w.output().count(f"{result.id}] received") <= 2
    assert "a duplicate delivery" not in w.output()
    assert "claimed by another delivery" not in w.output()
