"""Crashed workers, lost releases and duplicate deliveries."""

from __future__ import annotations

import signal
import time

import kombu.transport.redis
import pytest
import redis
from celery import Task, chord
from celery.exceptions import ChordError

from celery_threads import Threads
from celery_threads.gate import Gate
from celery_threads.runtime import get_runtime
from tests.conftest import free_port
from tests.support.helpers import assert_serial, events, starts, tid, wait_for


@pytest.fixture
def r(proj):
    return proj.history()


def test_sigkilled_worker_lease_lapses_and_member_reenters(proj, make_deployment, r):
    d = make_deployment(CT_KEEPALIVE="2", CT_DISPATCH_INTERVAL="0.2")
    victim = d.worker("victim", concurrency=1)
    thread = tid("crash")
    doomed = proj.record.delay(thread, "doomed", sleep=30)
    nxt = proj.record.delay(thread, "next")
    wait_for(lambda: starts(r, thread) == ["doomed"], what="doomed to start")
    d.worker("survivor", concurrency=1)
    seconds, micros = r.time()
    killed_at_us = seconds * 1_000_000 + micros
    victim.kill(signal.SIGKILL)
    assert nxt.get(timeout=30) == "next"
    # The lapsed attempt counted as a failure with retries left: doomed re-entered at
    # now + its retry delay, behind `next`, which arrived earlier.
    assert starts(r, thread)[:2] == ["doomed", "next"]
    next_start = [e for e in events(r, thread) if e.label == "next"][0].at_us
    moved_on = (next_start - killed_at_us) / 1e6
    # keepalive 2 s + tick 0.2 s + 3 s for a busy machine to publish, deliver and start `next`
    # (a lease left to its 30 s default, or a lost release, would take far longer)
    assert moved_on <= 2 + 0.2 + 3.0, f"took {moved_on:.2f}s (keepalive 2s + tick 0.2s + 3s)"
    wait_for(lambda: starts(r, thread)[2:3] == ["doomed"], what="doomed to run again")
    assert Threads(proj.app).get(thread).active.retries == 1
    Threads(proj.app).delete(doomed.id)


def test_lapsed_lease_without_retries_dies_naming_the_keepalive(proj, make_deployment, r):
    """...and ends as Celery ends a failed task: its errbacks are called, the chord it is a part
    of fails, the stored result names its task, and the rescuing worker sends ``task-failed``.
    ``FAILURE`` was stored without the member's request: none of that happened, and Flower showed
    it started for good."""
    from tests.worker.test_reject_on_worker_lost import task_events

    d = make_deployment(CT_KEEPALIVE="1.5", CT_DISPATCH_INTERVAL="0.2")
    victim = d.worker("victim", concurrency=2)
    thread = tid("crash")
    header = [
        proj.boom.s(thread, "doomed", sleep=30).set(link_error=proj.errback_log.s()),  # max_retries=0
        proj.plain.si(tid("other"), "part"),
    ]
    res = chord(header)(proj.plain.si(tid("body"), "body"))
    doomed, part = res.parent.results
    wait_for(lambda: starts(r, thread) == ["doomed"], what="doomed to start")
    assert part.get(timeout=30) == "part"  # the chord waits for doomed alone
    with task_events(proj.app) as seen:
        victim.kill(signal.SIGKILL)
        d.worker("rescuer", concurrency=1)
        nxt = proj.record.delay(thread, "next")
        wait_for(lambda: nxt.state == "SUCCESS", timeout=30, what="next to run")
        wait_for(
            lambda: [e for e in seen if e.get("uuid") == doomed.id and e["type"] == "task-failed"],
            what="the task-failed event",
        )
    [dead] = [x for x in Threads(proj.app).dead() if x.task_id == doomed.id]
    assert "LeaseExpired" in dead.exception and "1.5s" in dead.exception
    assert doomed.state == "FAILURE" and type(doomed.result).__name__ == "LeaseExpired"
    assert str(doomed.result).startswith("the worker running it"), doomed.result  # named once
    assert r.lrange(f"failure_signal:{doomed.id}", 0, -1) == [b"LeaseExpired"]  # task_failure
    wait_for(lambda: r.llen(f"errbacks:{doomed.id}"), what="the errback to run")
    res.get(timeout=30, propagate=False)
    assert res.state == "FAILURE" and isinstance(res.result, ChordError), (res.state, res.result)
    assert "LeaseExpired" in str(res.result)
    assert r.llen(f"errbacks:{doomed.id}") == 1


@pytest.mark.parametrize("how", ["publish-failed", "message-lost"])
def test_release_that_never_reached_the_broker_is_republished(proj, make_deployment, r, how):
    """A released member whose message is in no broker queue: the producer's publish failed
    (its broker unreachable; direct release off, so the gate's script does not push it
    itself), or the broker lost the message before any worker took it.  The gate holds it
    RELEASED; once the release timeout lapses the dispatcher (the worker's own loop)
    republishes it, and it runs once."""
    direct = "0" if how == "publish-failed" else "1"
    d = make_deployment(CT_RELEASE_TIMEOUT="1", CT_DISPATCH_INTERVAL="0.2", CT_DIRECT_RELEASE=direct)
    broker = redis.Redis.from_url(d.env["CT_BROKER_URL"])
    queue = d.env["CT_QUEUE"]
    thread = tid("lost")
    if how == "publish-failed":
        with proj.app.connection_for_write(f"redis://127.0.0.1:{free_port()}/1") as dead:
            result = proj.record.apply_async(
                (thread, "lost"), producer=dead.Producer(auto_declare=False), retry_policy={"max_retries": 0}
            )
        assert broker.llen(queue) == 0
    else:
        result = proj.record.apply_async((thread, "lost"))
        assert broker.llen(queue) == 1  # the gate's script pushed it ...
        assert broker.delete(queue) == 1  # ... and the broker lost it
    info = Threads(proj.app).get(thread)
    assert info is not None and info.active.state == "RELEASED"
    w = d.worker("w", concurrency=1)
    assert result.get(timeout=20) == "lost"
    assert starts(r, thread) == ["lost"]
    assert "within its release deadline; republishing it" in w.output()
    assert w.output().count(f"{result.id}] received") == 1
    broker.close()


@pytest.mark.parametrize("track", [True, False], ids=["tracked", "untracked"])
def test_redelivered_message_never_runs_twice_at_once(proj, make_deployment, r, track):
    """Late acks and a one-second visibility timeout: kombu's Redis transport puts back a delivery
    still unacked after it, and plain Celery runs it again.  With ``threads_track_releases`` the
    threaded delivery is tracked the same way and the claim drops its redelivery; by default it
    is not tracked, so nothing is redelivered."""
    if not hasattr(kombu.transport.redis.Channel, "unacked_restore_interval"):
        pytest.skip(
            "this kombu restores unacked deliveries every 10 s at the earliest: plain "
            "Celery's control run is not redelivered within the test"
        )
    d = make_deployment(
        CT_ACKS_LATE="1",
        CT_VISIBILITY="1",
        CT_UNACKED_RESTORE="1",
        CT_PREFETCH="1",
        CT_TRACK_RELEASES="1" if track else "0",
    )
    d.worker("a", concurrency=2)
    d.worker("b", concurrency=2)
    thread, plain_thread = tid("dup"), tid("dup-plain")
    plain = proj.plain.delay(plain_thread, "plain", sleep=6)
    threaded = proj.record.delay(thread, "threaded", sleep=6)
    assert threaded.get(timeout=60) == "threaded"
    plain.get(timeout=60)
    # The control: plain Celery with these settings runs the redelivered task again while the
    # first run is still going.
    plain_events = events(r, plain_thread)
    assert [e.kind for e in plain_events][:2] == ["start", "start"], plain_events
    # Ours ran once: its redelivery, restored as the plain one was, is dropped (and said so)
    # when tracked; untracked, there is none.
    if track:
        wait_for(
            lambda: "a duplicate delivery" in "".join(p.output() for p in d.processes),
            timeout=30,
            what="the claim to drop the redelivery",
        )
    else:
        time.sleep(2)  # what a redelivery would take: none must come
        assert "a duplicate delivery" not in "".join(p.output() for p in d.processes)
    assert starts(r, thread) == ["threaded"]
    assert_serial(r, thread)


def test_member_prefetched_by_a_worker_shutting_down_runs_elsewhere(proj, make_deployment, r):
    """A warm shutdown hands back prefetched messages; the gate still holds them RELEASED (the
    claim happens when a task starts), so the redelivery runs at once and burns no retry."""
    d = make_deployment(CT_PREFETCH="4")
    leaving = d.worker("leaving", concurrency=1)
    busy, waiting = tid("busy"), tid("prefetched")
    proj.record.delay(busy, "busy", sleep=2)
    wait_for(lambda: starts(r, busy) == ["busy"], what="busy to start")
    prefetched = proj.record.delay(waiting, "prefetched")
    wait_for(lambda: f"{prefetched.id}] received" in leaving.output(), what="the prefetch")
    info = Threads(proj.app).get(waiting)
    assert info is not None, (starts(r, waiting), leaving.output()[-2000:])
    assert info.active.state == "RELEASED"
    leaving.proc.send_signal(signal.SIGTERM)  # warm shutdown: finishes busy, returns the rest
    d.worker("staying", concurrency=1)
    leaving.proc.wait(30)
    assert f"{prefetched.id}] succeeded" not in leaving.output()
    assert prefetched.get(timeout=20) == "prefetched"
    assert starts(r, waiting) == ["prefetched"]
    assert starts(r, busy) == ["busy"]  # finished by the leaving worker, once


def _released_but_unpublished(proj, thread: str, label: str, sleep: float = 0.0):
    """A member stored and released by the gate that nobody has published yet: (result, release).
    (The runtime's gate would publish the release itself on this Redis broker: this one does not.)"""
    from celery_threads.publish import CapturingProducer

    runtime = get_runtime(proj.app)
    gate = Gate(runtime.client, runtime.keys, release_timeout_ms=runtime.config.release_timeout_ms)
    with proj.app.producer_or_acquire() as real:
        capture = CapturingProducer(real)
        result = Task.apply_async(proj.record, (thread, label), {"sleep": sleep}, producer=capture)
    outcome = gate.enqueue(thread, result.id, capture.envelope)
    assert outcome.release is not None
    return result, outcome.release


def _first_copy_running(proj, make_deployment, r, prefix: str, sleep: float):
    """A worker, and a member whose release this process published by hand, now running."""
    w = make_deployment().worker("w", concurrency=2)
    thread = tid(prefix)
    runtime = get_runtime(proj.app)
    result, release = _released_but_unpublished(proj, thread, "once", sleep=sleep)
    runtime.publish(release)
    wait_for(lambda: starts(r, thread) == ["once"], what="the first copy to start")
    return w, thread, runtime, result, release


def test_republished_copy_of_a_running_member_is_dropped_on_receipt(proj, make_deployment, r):
    """A copy the gate published again (header thread_republished) is checked on receipt: while
    the first copy runs, the second is acked and dropped before Celery logs it as received."""
    w, thread, runtime, result, release = _first_copy_running(
        proj, make_deployment, r, "republished", sleep=2
    )
    runtime.publish(release, republish=True)
    wait_for(lambda: "a duplicate delivery" in w.output(), what="the copy to be dropped")
    assert result.get(timeout=20) == "once"
    assert starts(r, thread) == ["once"]
    assert w.output().count(f"{result.id}] received") == 1


def test_unmarked_duplicate_copy_is_stopped_by_the_claim(proj, make_deployment, r):
    """A copy that carries no duplicate mark passes the receipt check unread; the claim at task
    start stops it, its body never runs, and the thread moves on."""
    w, thread, runtime, result, release = _first_copy_running(proj, make_deployment, r, "unmarked", sleep=1)
    runtime.publish(release)  # the same message, unmarked
    nxt = proj.record.delay(thread, "next")
    assert nxt.get(timeout=20) == "next"
    assert result.get(timeout=20) == "once"
    assert starts(r, thread) == ["once", "next"]
    assert_serial(r, thread)
    wait_for(
        lambda: "claimed by another delivery" in w.output() or "stale release" in w.output(),
        what="the copy to lose its claim",
    )


def test_pool_processes_that_exit_after_each_member_still_release_the_next(proj, make_deployment, r):
    """The next member's release goes out from a background thread of the pool process that ended
    its predecessor; a process that leaves right after (``--max-tasks-per-child 1``) publishes it
    first, so the thread never waits for the release timeout (120 s here)."""
    d = make_deployment(CT_RELEASE_TIMEOUT="120")
    d.worker("recycler", concurrency=1, extra=["--max-tasks-per-child", "1"])
    thread = tid("recycled")
    labels = [f"m{i}" for i in range(4)]
    results = [proj.record.delay(thread, label) for label in labels]
    assert [x.get(timeout=40) for x in results] == labels
    assert starts(r, thread) == labels
    assert_serial(r, thread)


def test_a_release_no_worker_consumes_says_its_routing_key(proj, make_deployment, r):
    """A member sent to a queue no worker consumes (``apply_async(queue=...)``) holds its thread,
    released and republished: the dispatcher's warning and ``celery threads show`` name the
    routing key it goes to, so that an operator finds the queue nobody consumes."""
    from celery.bin.celery import celery as celery_command
    from click.testing import CliRunner

    d = make_deployment(CT_RELEASE_TIMEOUT="1", CT_DISPATCH_INTERVAL="0.2")
    w = d.worker("w", concurrency=1)
    thread, nobody = tid("route"), f"nobody-{tid()}"
    proj.record.apply_async((thread, "lost"), queue=nobody)
    wait_for(lambda: f"routing key {nobody}" in w.output(), what="the republish warning")
    assert "does a worker consume its queue?" in w.output()
    wait_for(lambda: Threads(proj.app).status(thread).active.republished >= 1, what="a republish in the gate")
    shown = CliRunner().invoke(celery_command, ["-A", "tests.support.proj", "threads", "show", thread])
    assert "routing key" in shown.output and nobody in shown.output, shown.output
    assert "does a worker consume the queue of its routing key?" in shown.output
    Threads(proj.app).purge(thread)


def test_a_worker_on_another_gate_than_its_producers_says_so(proj, make_deployment, redis_server, r):
    """Its gate's database is not the producers' (a typo): every threaded task was dropped as a
    'stale release' at INFO, and nothing ran, with nothing to say why."""
    d = make_deployment()
    elsewhere = d.worker("elsewhere", concurrency=1, env={"CT_REDIS_URL": redis_server.url(7)})
    lost = proj.record.delay(tid("elsewhere"), "x")
    wait_for(
        lambda: f"{lost.id}] of thread" in elsewhere.output() and "does not know it" in elsewhere.output(),
        what="the worker to say its gate does not know the member",
    )
    assert "WARNING" in next(line for line in elsewhere.output().splitlines() if "does not know it" in line)
    Threads(proj.app).delete(lost.id)


def test_a_running_member_deleted_while_its_worker_is_gone_ends_its_chord(proj, make_deployment, r):
    """Threads.delete of a running member whose worker was SIGKILLed marks it deleted; no worker
    is left to stop it, so it ends as deleted when its lease lapses.  It was marked REVOKED
    without its request: its chord waited for it for ever (and rpc://, which needs the request,
    stored nothing).  Now its chord fails as for any revoked part."""
    d = make_deployment(CT_KEEPALIVE="1.5", CT_DISPATCH_INTERVAL="0.2")
    victim = d.worker("victim", concurrency=2)
    thread = tid("deleted-lapse")
    header = [proj.record.si(thread, "doomed", sleep=30), proj.plain.si(tid("other"), "part")]
    res = chord(header)(proj.plain.si(tid("body"), "body"))
    doomed, part = res.parent.results
    wait_for(lambda: starts(r, thread) == ["doomed"], what="doomed to start")
    assert part.get(timeout=30) == "part"  # the chord waits for doomed alone
    victim.kill(signal.SIGKILL)
    Threads(proj.app).delete(doomed.id)  # marked deleted: no worker is left to stop it
    d.worker("rescuer", concurrency=1)
    res.get(timeout=30, propagate=False)
    assert res.state == "FAILURE" and isinstance(res.result, ChordError), (res.state, res.result)
    assert proj.app.AsyncResult(doomed.id).state == "REVOKED"
    assert Threads(proj.app).get(thread) is None


def test_a_lapsed_lease_of_a_task_that_ignores_results_stores_nothing(proj, make_deployment, r):
    """As Celery's worker decides for any ending (``Request.store_errors``): a task with
    ``ignore_result=True`` has no FAILURE stored when its lease lapses (LeaseExpired was stored,
    where a plain twin stores nothing); its errback is still called."""
    d = make_deployment(CT_KEEPALIVE="1.5", CT_DISPATCH_INTERVAL="0.2")
    victim = d.worker("victim", concurrency=2)
    thread = tid("ignored")
    doomed = proj.fire_and_forget.apply_async(
        (thread, "doomed"), {"sleep": 30}, link_error=proj.errback_log.s()
    )
    wait_for(lambda: starts(r, thread) == ["doomed"], what="doomed to start")
    victim.kill(signal.SIGKILL)
    d.worker("rescuer", concurrency=1)
    wait_for(lambda: [x for x in Threads(proj.app).dead() if x.task_id == doomed.id], what="its death")
    wait_for(lambda: r.llen(f"errbacks:{doomed.id}") == 1, what="its errback")
    backend = proj.app.backend
    assert backend.get(backend.get_key_for_task(doomed.id)) is None


def _cut_connections(pid: int, port: int) -> int:
    """Close, on the Redis server's side, every connection process ``pid`` holds to ``port``
    (its broker's among them); how many."""
    import subprocess

    listing = subprocess.run(["ss", "-tnpH", "state", "established"], capture_output=True, text=True).stdout
    admin = redis.Redis(port=port)
    cut = 0
    for line in listing.splitlines():
        fields = line.split()
        if f"pid={pid}," in line and fields[-2].endswith(f":{port}"):
            cut += admin.client_kill_filter(addr=fields[-3], skipme=False)
    return cut


def test_a_member_celery_cancels_on_a_lost_broker_connection_is_reported_at_once(
    proj, make_deployment, redis_server, r
):
    """``worker_cancel_long_running_tasks_on_connection_loss`` (Celery 6's planned default), with
    acks_late: Celery terminates a running member when its worker loses the broker, stores RETRY
    and leaves the message to the broker (whose redelivery the claim refuses).  The gate heard of
    it only when its lease lapsed: its thread stood still for threads_keepalive.  It is a failed
    attempt once its process has exited, retried as a lost one is."""
    d = make_deployment(CT_KEEPALIVE="120", CT_ACKS_LATE="1", CT_CANCEL_ON_LOSS="1")
    w = d.worker("cancel", concurrency=2)
    thread = tid("cancel")
    proj.record.apply_async((thread, "long"), {"sleep": 60})
    nxt = proj.record.delay(thread, "next")
    wait_for(lambda: starts(r, thread) == ["long"], what="long to start")
    assert w.proc is not None and _cut_connections(w.proc.pid, redis_server.port) > 0
    assert nxt.get(timeout=60) == "next"  # its lease alone would have held the thread 120 s
    wait_for(lambda: starts(r, thread)[:3] == ["long", "next", "long"], what="long's retry", timeout=60)
    assert_serial(r, thread)
