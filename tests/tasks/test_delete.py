"""Deleting a running member: under prefork the next member starts only once the deleted
member's code has stopped; under the threads pool (which cannot stop a body) it starts at once.

Judged by what the bodies wrote: heartbeats every 10 ms and start/end records, stamped with the
Redis server's clock (tests/support/proj.py ``beater``, ``deaf``).
"""

from __future__ import annotations

import threading
import time
import uuid

import pytest

from celery_threads import Threads
from tests.support.helpers import (
    beats,
    events,
    gate_keys,
    last_beat,
    now_us,
    started_at,
    starts,
    tid,
    wait_for,
)


@pytest.fixture
def r(proj):
    return proj.history()


def ran_before(r, thread: str, deleted: str, nxt: str) -> None:
    """Everything ``deleted``'s body wrote (heartbeats, its end record if its unwinding wrote
    one) came before ``nxt``'s first heartbeat and its start."""
    first_next = min([started_at(r, thread, nxt), *beats(r, thread, nxt)])
    last_deleted = max(
        [
            *beats(r, thread, deleted),
            *[e.at_us for e in events(r, thread) if e.label == deleted and e.kind == "end"],
        ]
    )
    assert last_deleted < first_next, (
        f"{deleted}'s body wrote {(last_deleted - first_next) / 1000:.1f} ms after {nxt} started"
    )


def vanishes(proj, r, thread: str) -> None:
    wait_for(
        lambda: Threads(proj.app).get(thread) is None and not gate_keys(r, thread),
        what="the thread's keys to vanish",
    )


def test_the_next_member_starts_once_the_deleted_body_has_stopped(proj, make_deployment, r):
    """Prefork, two pool processes (the next member could run beside the deleted one): the
    deleted 20 s body is stopped; its last heartbeat precedes the next member's first, which
    comes well within a second or two; Threads.delete returns once the next is released."""
    d = make_deployment(CT_EVENTS="0")
    d.worker("del", concurrency=2)
    thread = tid("del")
    long = proj.beater.delay(thread, "long", seconds=20)
    nxt = proj.beater.delay(thread, "next", seconds=0.3)
    wait_for(lambda: len(beats(r, thread, "long")) > 3, what="the long member to beat")
    deleted_at, t0 = now_us(r), time.monotonic()
    assert Threads(proj.app).delete(long.id) is True
    returned_in = time.monotonic() - t0
    if returned_in < 4.5:  # it waited for the promotion (at most STOP_WAIT, 5 s)
        info = Threads(proj.app).get(thread)
        assert info is None or info.active is None or info.active.task_id != long.id
    assert nxt.get(timeout=20) == "next"
    wait_for(lambda: long.state == "REVOKED", what="the deleted member to be REVOKED")
    ran_before(r, thread, "long", "next")
    waited = (started_at(r, thread, "next") - deleted_at) / 1e6
    assert waited < 3, f"the next member started {waited:.2f}s after the delete"
    assert starts(r, thread) == ["long", "next"]
    vanishes(proj, r, thread)
    assert Threads(proj.app).delete(long.id) is False


def test_a_body_that_ignores_the_signal_holds_its_thread_until_it_returns(proj, make_deployment, r):
    """A deleted member whose code ignores SIGTERM is not stopped: the thread waits for it (shown
    as stopping meanwhile), its own end ends it as deleted (REVOKED, not SUCCESS, no dead
    letter), and only then does the next member start."""
    d = make_deployment(CT_EVENTS="0")
    d.worker("deaf", concurrency=2)
    thread = tid("deaf")
    deaf = proj.deaf.delay(thread, "deaf", seconds=3)
    nxt = proj.beater.delay(thread, "next", seconds=0.3)
    wait_for(lambda: beats(r, thread, "deaf"), what="the deaf member to beat")
    threads = Threads(proj.app)
    deleting = threading.Thread(target=threads.delete, args=(deaf.id,))
    deleting.start()
    try:
        info = wait_for(
            lambda: (lambda i: i if i and i.active and i.active.stopping else None)(threads.get(thread)),
            what="the member to show as stopping",
        )
        assert info.active.task_id == deaf.id and info.active.state == "RUNNING"
        assert [m.task_id for m in info.waiting] == [nxt.id]
        # The contract's MemberInfo(task_id, name, scheduled_at, state, retries): five to unpack.
        task_id, _name, _scheduled_at, state, _retries = info.active
        assert (task_id, state) == (deaf.id, "RUNNING")
    finally:
        deleting.join(10)
    assert not deleting.is_alive(), "Threads.delete did not return within its bound"
    assert nxt.get(timeout=20) == "next"
    ran_before(r, thread, "deaf", "next")
    wait_for(lambda: deaf.state == "REVOKED", what="the deleted member to be REVOKED")
    assert deaf.id not in [t.task_id for t in threads.dead()]
    vanishes(proj, r, thread)


def test_under_the_threads_pool_the_next_member_starts_at_once(proj, make_deployment, r):
    """The threads pool cannot stop a member's body: the delete detaches it at once and the next
    member starts while the deleted body runs on to its end (README, caveats)."""
    d = make_deployment(CT_EVENTS="0")
    worker = d.worker("threads", pool="threads", concurrency=4)
    thread = tid("thr")
    long = proj.beater.delay(thread, "long", seconds=4)
    nxt = proj.beater.delay(thread, "next", seconds=0.3)
    wait_for(lambda: beats(r, thread, "long"), what="the long member to beat")
    t0 = time.monotonic()
    assert Threads(proj.app).delete(long.id) is True
    assert time.monotonic() - t0 < 4, "the delete waited for a body it cannot stop"
    assert nxt.get(timeout=20) == "next"
    assert last_beat(r, thread, "long", timeout=10) > started_at(r, thread, "next")
    # REVOKED, as under prefork, once its body has ended too (it stored SUCCESS over it, and
    # its worker logged the terminate the threads pool cannot do).
    wait_for(
        lambda: f"{long.id}] of thread {thread} was deleted while it ran" in worker.output(),
        what="the deleted body to end",
    )
    assert long.state == "REVOKED"
    assert "does not implement kill_job" not in worker.output()
    vanishes(proj, r, thread)


def test_members_ended_unrun_have_an_extended_result_that_names_them(proj, isolated_app):
    """With ``result_extended``, a member deleted or purged while it waits is stored REVOKED
    with its task's name, arguments and queue, as Celery stores a revoked task from its request
    (it was stored with none of them).  No worker: the first member holds the thread."""
    from tests.support.isolated import pointed_at

    with pointed_at(isolated_app, result_extended=True):
        thread = tid("extended")
        proj.record.apply_async((thread, "holder"))
        deleted = proj.record.apply_async((thread, "deleted"), {"sleep": 0.1}, queue="celery")
        purged = proj.record.apply_async((thread, "purged"))
        threads = Threads(isolated_app)
        assert threads.delete(deleted.id)
        assert threads.purge(thread) == 1
        for result, args, kwargs in (
            (deleted, [thread, "deleted"], {"sleep": 0.1}),
            (purged, [thread, "purged"], {}),
        ):
            meta = isolated_app.backend.get_task_meta(result.id, cache=False)
            assert meta["status"] == "REVOKED", meta
            assert meta.get("name") == proj.record.name, meta
            assert (list(meta.get("args") or []), meta.get("kwargs")) == (args, kwargs), meta
            assert meta.get("queue") == "celery", meta


@pytest.mark.parametrize("how", ["delete", "purge"])
def test_a_member_dropped_after_a_lost_attempt_is_revoked_with_its_retries(proj, isolated_app, how):
    """A member whose attempt was lost (its pool process died: the gate's ``fail`` re-enters it,
    its stored message unchanged) and that is deleted or purged while it waits for its retry is
    stored REVOKED with the retries it spent, as its next run's request would carry them (its
    extended result said 0).  No worker: the test claims and fails the member as a worker
    would."""
    from celery_threads.gate import Lapse
    from celery_threads.runtime import get_runtime
    from tests.support.isolated import pointed_at

    with pointed_at(isolated_app, result_extended=True):
        thread = tid("lost-then-deleted")
        result = proj.record.apply_async((thread, "lost"))
        gate = get_runtime(isolated_app).gate
        snapshot = gate.reads.snapshot(thread)
        assert snapshot is not None and snapshot.active["task"] == result.id, snapshot
        token = snapshot.active["token"]
        assert gate.claim(thread, result.id, token, "test-worker") == 1
        assert gate.fail(thread, result.id, token, "the pool process was lost").status == Lapse.RETRIED
        record = gate.reads.record(result.id, thread)
        assert record is not None and record.retries == 1, record
        threads = Threads(isolated_app)
        assert threads.delete(result.id) if how == "delete" else threads.purge(thread) == 1
        meta = isolated_app.backend.get_task_meta(result.id, cache=False)
        assert meta["status"] == "REVOKED", meta
        assert meta.get("retries") == 1, meta


def _dispatch_until(runtime, condition, what):
    """Dispatcher ticks until ``condition()`` holds."""
    from celery_threads.dispatcher import Dispatcher

    def ticked():
        Dispatcher(runtime).run_until_idle()
        return condition()

    wait_for(ticked, what=what)


def _lose_an_attempt(app, result, thread):
    """Claim ``result``'s member and fail it as a worker whose pool process was lost: it
    re-enters with its stored message unchanged (retries 1 in the gate's record, 0 in its
    message's headers).  Returns once the dispatcher has released it again (its retry delay,
    ``record``'s, is 0.2 s): its new token."""
    from celery_threads.gate import Lapse
    from celery_threads.runtime import get_runtime

    runtime = get_runtime(app)
    gate = runtime.gate
    snapshot = gate.reads.snapshot(thread)
    assert snapshot is not None and snapshot.active["task"] == result.id, snapshot
    token = snapshot.active["token"]
    assert gate.claim(thread, result.id, token, "test-worker", "test-claimant") == 1
    assert gate.fail(thread, result.id, token, "the pool process was lost").status == Lapse.RETRIED

    def new_token() -> str:
        again = gate.reads.snapshot(thread)
        return again.active["token"] if again and again.active and again.active["token"] != token else ""

    _dispatch_until(runtime, new_token, "the lost attempt's retry to be released")
    return new_token()


def test_a_member_deleted_while_it_runs_after_a_lost_attempt_is_revoked_with_its_retries(proj, isolated_app):
    """A member whose attempt was lost, running again, is deleted and its lease lapses (no
    worker left to end it): the dispatcher stores it REVOKED with the retries it spent (the
    expire's record, as the delete's and purge's above)."""
    from celery_threads.gate import STOPPING
    from celery_threads.runtime import get_runtime
    from tests.support.isolated import pointed_at

    with pointed_at(isolated_app, result_extended=True):
        thread = tid("lost-then-lapsed")
        result = proj.record.apply_async((thread, "lost"))
        runtime = get_runtime(isolated_app)
        gate = runtime.gate
        token = _lose_an_attempt(isolated_app, result, thread)
        # Claimed by a pool that stops members: the delete marks it, for its worker to stop.
        assert gate.claim(thread, result.id, token, "test-worker", "again", stoppable=True) == 1
        assert gate.delete(result.id, stop=True, thread_id=thread).info == STOPPING
        gate.renew(thread, result.id, token, "again", for_ms=1)  # its worker is gone
        _dispatch_until(
            runtime, lambda: gate.reads.snapshot(thread) is None, "the deleted member's lease to lapse"
        )
        meta = isolated_app.backend.get_task_meta(result.id, cache=False)
        assert meta["status"] == "REVOKED", meta
        assert meta.get("retries") == 1, meta


def test_a_member_expired_after_a_lost_attempt_is_revoked_with_its_retries(proj, isolated_app):
    """A member whose attempt was lost and whose ``expires`` passes before its retry is
    released ends REVOKED ('expired') with the retries it spent."""
    from celery_threads.runtime import get_runtime
    from tests.support.isolated import pointed_at

    with pointed_at(isolated_app, result_extended=True):
        thread = tid("lost-then-expired")
        expires = time.time() + 1.0
        result = proj.record.apply_async((thread, "lost"), expires=1.0)
        runtime = get_runtime(isolated_app)
        token = _lose_an_attempt(isolated_app, result, thread)
        # Its retry was released (and published: no worker here claims it); once its expires has
        # passed, its release lapses and the dispatcher, about to publish it again, ends it.
        wait_for(lambda: time.time() > expires + 0.1, what="its expires to pass")
        runtime.gate.renew(thread, result.id, token, for_ms=1)
        _dispatch_until(
            runtime, lambda: runtime.gate.reads.snapshot(thread) is None, "the expired member to leave"
        )
        meta = isolated_app.backend.get_task_meta(result.id, cache=False)
        assert meta["status"] == "REVOKED", meta
        assert meta.get("retries") == 1, meta


def test_a_member_deleted_as_its_retry_is_stored_reads_revoked(proj, make_deployment, r):
    """A member re-enters its thread for its retry before Celery stores its RETRY (the tracer
    stores it once the task's call has returned): deleted in between, its REVOKED was
    overwritten by RETRY for good (a chaos run's operator hit it).  Here the pool process stores
    the RETRY once the test has deleted the member."""
    d = make_deployment()
    worker = d.worker("w", concurrency=1)
    thread = tid("retry-deleted")
    result = proj.retry_slow_to_store.delay(thread, "r")
    threads = Threads(proj.app)

    def reentered() -> bool:
        info = threads.get(thread)
        return info is not None and info.active is None and [m.task_id for m in info.waiting] == [result.id]

    wait_for(reentered, what="the retry to re-enter the thread")
    assert threads.delete(result.id)
    assert result.state == "REVOKED"
    r.set(f"say:{thread}", 1)
    wait_for(
        lambda: f"[{result.id}] retry: Retry in 60s" in worker.output(), what="the worker to log the retry"
    )
    meta = proj.app.backend.get_task_meta(result.id, cache=False)
    assert meta["status"] == "REVOKED", meta
    assert threads.get(thread) is None


def test_a_member_removed_unrun_is_revoked_to_an_rpc_caller(proj, isolated_app):
    """The ``rpc://`` result backend replies to the caller's queue (the message's ``reply_to``,
    ``correlation_id``): a member deleted or purged while it waits raises TaskRevokedError in the
    caller's ``get()``, as a plain task revoked while it waits does.  Its request had neither
    property, so the backend refused it and ``get()`` waited for good.  No worker: the first
    member holds the thread (its message waits in a queue of the test's own, deleted after)."""
    from celery.exceptions import TaskRevokedError
    from kombu import Connection

    from tests.conftest import rabbitmq_url
    from tests.support.isolated import pointed_at

    queue = f"ct-rpc-{uuid.uuid4().hex[:8]}"
    settings = {"broker_url": rabbitmq_url(), "result_backend": "rpc://", "task_default_queue": queue}
    try:
        with pointed_at(isolated_app, **settings):
            thread = tid("rpc")
            proj.record.apply_async((thread, "holder"))
            deleted = proj.record.apply_async((thread, "deleted"))
            purged = proj.record.apply_async((thread, "purged"))
            threads = Threads(isolated_app)
            assert threads.delete(deleted.id)
            assert threads.purge(thread) == 1
            for result in (deleted, purged):
                with pytest.raises(TaskRevokedError):
                    result.get(timeout=20)
    finally:
        with Connection(rabbitmq_url()) as conn:
            conn.default_channel.queue_delete(queue)
