"""coalesce="latest" and debounce on real prefork workers, judged by the task bodies' own start
records (stamped with the Redis server's clock) and by ``AsyncResult`` states: a burst of calls
while the thread is busy runs only its last call, the others end REVOKED and their ``get()``
raises ``TaskRevokedError``; a running member of the same task is never touched; a debounced
burst runs once, no earlier than the debounce after its last call reached the gate; debounce_max
bounds how long a steady stream is put off; a member waiting for its retry is not superseded;
concurrent producers leave exactly one call; a replayed call supersedes nothing more; the same
on a Redis Cluster gate.
"""

from __future__ import annotations

import threading
import uuid
from datetime import datetime

import pytest
from celery.exceptions import TaskRevokedError

from celery_threads import Threads
from celery_threads.errors import ConfigurationError
from celery_threads.gate import Gate, make_client
from celery_threads.keys import Keys
from celery_threads.runtime import get_runtime
from tests.support.helpers import (
    assert_serial,
    collect_events,
    events,
    now_us,
    started_at,
    starts,
    the_event,
    tid,
    wait_for,
)

WAIT = 60  # condition waits on a busy 2-core machine


@pytest.fixture
def r(proj):
    return proj.history()


def state(proj, result) -> str:
    """The result backend's state, read afresh (an ``AsyncResult`` caches a final state)."""
    return proj.app.backend.get_task_meta(result.id, cache=False)["status"]


def assert_revoked(proj, results) -> None:
    for result in results:
        wait_for(
            lambda result=result: state(proj, result) == "REVOKED", timeout=WAIT, what=f"{result.id} REVOKED"
        )
        with pytest.raises(TaskRevokedError):
            result.get(timeout=WAIT)


def busy_thread(proj, make_deployment, r, prefix: str, **options) -> tuple[str, str]:
    """A worker, and a thread whose first member (a ``record`` call with ``options``) runs until
    the key ``go`` is set: (thread id, go)."""
    make_deployment().worker("w1", concurrency=2)
    thread = tid(prefix)
    go = f"go:{thread}"
    proj.record.apply_async((thread, "busy"), {"until": go}, **options)
    wait_for(lambda: starts(r, thread) == ["busy"], timeout=WAIT, what="the busy member to start")
    return thread, go


def pause(r, seconds: float) -> None:
    """Let ``seconds`` pass on the Redis server's clock."""
    before = now_us(r)
    wait_for(lambda: now_us(r) - before >= seconds * 1e6, interval=0.02, what=f"{seconds} s")


def test_a_burst_while_the_thread_is_busy_runs_only_its_last_call(proj, make_deployment, r):
    # The running member is a coalescing call of the same task: never touched.
    thread, go = busy_thread(proj, make_deployment, r, "coalesce", coalesce="latest")
    events_seen, stop = collect_events(proj.app)
    burst = [proj.record.apply_async((thread, f"c{i}"), coalesce="latest") for i in range(6)]
    # Another task's waiting call is not superseded.
    other = proj.where.apply_async((thread, "other"))
    info = Threads(proj.app).get(thread)
    assert info is not None and info.active is not None and info.active.name == proj.record.name
    assert [m.task_id for m in info.waiting] == [burst[-1].id, other.id]
    assert_revoked(proj, burst[:-1])
    # Flower's view: one task-revoked event each, sent by a worker.
    try:
        wait_for(
            lambda: (
                {b.id for b in burst[:-1]}
                <= {e.get("uuid") for e in events_seen if e.get("type") == "task-revoked"}
            ),
            timeout=WAIT,
            what="task-revoked events of the superseded calls",
        )
    finally:
        stop()

    r.set(go, 1)
    assert burst[-1].get(timeout=WAIT) == "c5"
    assert other.get(timeout=WAIT) == "other"
    wait_for(lambda: len(events(r, thread)) == 6, timeout=WAIT, what="every run to end")
    assert starts(r, thread) == ["busy", "c5", "other"]
    assert_serial(r, thread)


def test_the_newest_call_takes_the_superseded_calls_place(proj, make_deployment, r):
    """Members that arrived between two calls of a coalescing task do not push it back: the
    newest call runs where the first waiting one would have."""
    thread, go = busy_thread(proj, make_deployment, r, "place")
    first = proj.record.apply_async((thread, "sync1"), coalesce="latest")
    between = proj.where.apply_async((thread, "between"))
    last = proj.record.apply_async((thread, "sync2"), coalesce="latest")
    r.set(go, 1)
    assert between.get(timeout=WAIT) == "between" and last.get(timeout=WAIT) == "sync2"
    assert_revoked(proj, [first])
    assert starts(r, thread) == ["busy", "sync2", "between"]


def test_debounce_runs_a_burst_once_after_its_last_call(proj, make_deployment, r):
    """``debounced`` is declared with debounce=1.0: five calls 0.3 s apart run once, at least
    1 s (the gate's clock) after the last call reached the gate."""
    d = make_deployment(CT_DISPATCH_INTERVAL="0.2")
    d.worker("w1", concurrency=2)
    thread = tid("debounce")
    calls = []
    for i in range(5):
        before = now_us(r)  # the last call reaches the gate after this reading
        calls.append(proj.debounced.delay(thread, f"d{i}"))
        pause(r, 0.3)
    assert calls[-1].get(timeout=WAIT) == "d4"
    assert_revoked(proj, calls[:-1])
    assert starts(r, thread) == ["d4"]
    assert started_at(r, thread, "d4") >= before + 1_000_000
    # The thread's keys: its policy hash lingers for replays, with an expiry (30 s).
    policy = Threads(proj.app).runtime.gate.keys.thread(thread).policy
    assert 0 < r.pttl(policy) <= 30_000


def test_a_debounced_calls_task_sent_event_says_when_it_is_due(proj, r):
    """Flower shows a waiting member's eta from its task-sent event: a debounced call is due a
    debounce (1 s) after it reached the gate, on the gate's clock, though its caller gave no
    countdown; a call superseding it is due as late again."""
    thread = tid("debounce-eta")
    got, stop = collect_events(proj.app)
    try:
        for label in ("d0", "d1"):
            before = now_us(r)
            call = proj.debounced.delay(thread, label)
            after = now_us(r)
            eta = datetime.fromisoformat(the_event(got, "task-sent", call.id)["eta"]).timestamp() * 1e6
            # scheduled_at is whole ms on the gate's clock
            assert before + 1_000_000 - 1_000 <= eta <= after + 1_000_000 + 1_000, (label, before, eta, after)
    finally:
        stop()
        Threads(proj.app).purge(thread)


def test_debounce_none_at_the_call_turns_the_tasks_debounce_off(proj, r):
    """``debounce=None`` at the call (documented to turn the task's option off) raised "debounce_max
    without a debounce", for the task's own debounce_max: it goes with the debounce."""
    thread = tid("no-debounce")
    call = proj.debounced.apply_async((thread, "now"), debounce=None)
    try:
        info = Threads(proj.app).get(thread)
        assert info is not None and info.active is not None and info.active.task_id == call.id  # due now
    finally:
        Threads(proj.app).delete(call.id)


def test_debounce_max_runs_a_steady_stream(proj, make_deployment, r):
    """debounce=1.0, debounce_max=1.5, a call every 0.2 s for 4 s: without the bound nothing
    would run until the stream stops; with it, a run starts within about 1.5 s of each burst's
    first call, and the stream's last call still runs."""
    d = make_deployment(CT_DISPATCH_INTERVAL="0.2")
    d.worker("w1", concurrency=2)
    thread = tid("stream")
    first, calls = now_us(r), []
    while now_us(r) - first < 4_000_000:
        calls.append(proj.debounced.apply_async((thread, f"s{len(calls)}"), debounce_max=1.5))
        pause(r, 0.2)
    assert calls[-1].get(timeout=WAIT) == f"s{len(calls) - 1}"
    ran = starts(r, thread)
    assert len(ran) >= 2, ran
    # The first run starts no later than 1.5 s after the first call, plus the dispatch loop's
    # wake-up on a busy machine.
    assert started_at(r, thread, ran[0]) - first < 1_500_000 + 3_000_000, ran
    labels = {f"s{i}": c for i, c in enumerate(calls)}
    assert_revoked(proj, [labels[x] for x in labels if x not in ran])
    assert_serial(r, thread)


def test_a_member_waiting_for_its_retry_is_not_superseded(proj, make_deployment, r):
    d = make_deployment()
    d.worker("w1", concurrency=2)
    thread = tid("retry")
    failing = proj.record.apply_async((thread, "r0"), {"fail_times": 1, "countdown": 2.0}, coalesce="latest")
    wait_for(
        lambda: [e.kind for e in events(r, thread)] == ["start", "end"],
        timeout=WAIT,
        what="the first attempt to end",
    )
    newer = proj.record.apply_async((thread, "r1"), coalesce="latest")
    assert failing.get(timeout=WAIT) == "r0" and newer.get(timeout=WAIT) == "r1"
    assert starts(r, thread) == ["r0", "r1", "r0"]


def test_concurrent_producers_leave_one_call(proj, make_deployment, r):
    thread, go = busy_thread(proj, make_deployment, r, "producers")
    sent: list = []
    lock = threading.Lock()

    def produce(p: int) -> None:
        for i in range(5):
            result = proj.record.apply_async((thread, f"p{p}-{i}"), coalesce="latest")
            with lock:
                sent.append(result)

    producers = [threading.Thread(target=produce, args=(p,)) for p in range(4)]
    for t in producers:
        t.start()
    for t in producers:
        t.join()
    info = Threads(proj.app).get(thread)
    assert info is not None and len(info.waiting) == 1
    survivor = info.waiting[0].task_id
    r.set(go, 1)
    wait_for(lambda: len(starts(r, thread)) == 2, timeout=WAIT, what="the survivor to start")
    [kept] = [s for s in sent if s.id == survivor]
    assert kept.get(timeout=WAIT) == starts(r, thread)[1]
    assert_revoked(proj, [s for s in sent if s.id != survivor])


def test_a_replayed_call_supersedes_nothing_more(proj, make_deployment, r):
    """The same task id sent again (a producer whose reply was lost): the newer call is not
    superseded by the replay of an older one, nor twice by its own replay, and a superseded id
    never comes back.  The replay is told what the first send superseded: a call whose reply
    was lost (here: whose producer never marked what it superseded) still leaves it REVOKED."""
    thread, go = busy_thread(proj, make_deployment, r, "replay")
    a = proj.record.apply_async((thread, "a"), coalesce="latest")
    runtime = get_runtime(proj.app)
    runtime.revoke_superseded = lambda *args: None  # the first send's reply is lost
    try:
        b = proj.record.apply_async((thread, "b"), coalesce="latest")
    finally:
        del runtime.revoke_superseded
    assert state(proj, a) == "PENDING"
    for again in (b, a, b):
        proj.record.apply_async((thread, "again"), coalesce="latest", task_id=again.id)
        info = Threads(proj.app).get(thread)
        assert info is not None and [m.task_id for m in info.waiting] == [b.id]
    r.set(go, 1)
    assert b.get(timeout=WAIT) == "b"
    assert_revoked(proj, [a])
    assert starts(r, thread) == ["busy", "b"]


def test_bad_policy_values_are_refused_and_nothing_is_stored(proj, make_deployment):
    make_deployment()
    thread = tid("bad")
    for options in (
        {"coalesce": "first"},
        {"debounce": -1},
        {"debounce": "2s"},
        {"debounce_max": 3},
        {"debounce": 2, "debounce_max": 1},
    ):
        with pytest.raises(ConfigurationError, match=next(iter(options))):
            proj.record.apply_async((thread, "x"), **options)
    assert Threads(proj.app).get(thread) is None


def test_coalescing_on_a_cluster_gate(redis_cluster):
    """On a Redis Cluster each thread's policy hash lives in its thread's slot: calls superseding
    each other in threads spread over the masters, as functions and as scripts."""
    for functions in (True, False):
        gate = Gate(
            make_client(redis_cluster.url(), {"cluster": True}),
            Keys(f"co-{uuid.uuid4().hex[:6]}", 3),
            release_timeout_ms=60_000,
            functions=functions,
        )
        for shard in range(3):
            thread = next(t for t in (f"c{i}" for i in range(100)) if gate.keys.shard_of(t) == shard)
            assert gate.enqueue(thread, str(uuid.uuid4()), b"busy").release is not None
            calls = [str(uuid.uuid4()) for _ in range(3)]
            outcomes = [gate.enqueue(thread, c, b"sync", coalesce="sync") for c in calls]
            assert [o.superseded for o in outcomes] == [[], [calls[0]], [calls[1], calls[0]]]
            # The superseded member's stored message, for its chord (mark_revoked).
            assert [o.gone_envelope for o in outcomes] == [b"", b"sync", b"sync"]
            assert gate.enqueue(thread, calls[2], b"sync", coalesce="sync").superseded == [
                calls[1],
                calls[0],
            ]  # a replay is told again
            snapshot = gate.reads.snapshot(thread)
            assert snapshot is not None and [t for t, _ in snapshot.waiting] == [calls[2]]
