"""In-process handoff: a pool process runs the member its own finish released (handoff.py).

The shared test deployment sends task events, which turns the handoff off; these tests run
workers without events (CT_EVENTS=0) unless they test the events rule.
"""

from __future__ import annotations

import re
import time

import pytest
from celery import chord
from celery.exceptions import ChordError

from tests.support.helpers import (
    assert_serial,
    collect_events,
    events,
    starts,
    the_event,
    tid,
    wait_for,
    within,
)


@pytest.fixture
def r(proj):
    return proj.history()


def received(worker, task_id: str) -> bool:
    """Whether the worker's main process received a broker delivery of `task_id`."""
    return re.search(rf"\[{re.escape(task_id)}\] received", worker.output()) is not None


def burst(proj, thread: str, n: int, **options):
    """A first member that runs until `n` members queue behind it (however long a busy machine
    takes to send them), and those members."""
    go = f"go:{thread}"
    first = proj.where.apply_async((thread, "first"), {"until": go}, **options)
    wait_for(lambda: starts(proj.history(), thread) == ["first"], what="the first member")
    rest = [proj.where.apply_async((thread, f"m{i}"), **options) for i in range(n)]
    proj.history().set(go, 1)
    return first, rest


def pids(r, thread: str) -> list[int]:
    return [int(x) for x in r.lrange(f"pid:{thread}", 0, -1)]


def test_the_next_members_run_in_the_finishing_pool_process(proj, make_deployment, r):
    d = make_deployment(CT_EVENTS="0")
    w = d.worker("handoff", concurrency=2)
    thread = tid("ho")
    first, rest = burst(proj, thread, 5)
    assert [x.get(timeout=30) for x in rest] == [f"m{i}" for i in range(5)]
    assert first.get(timeout=5) == "first"
    assert starts(r, thread) == ["first"] + [f"m{i}" for i in range(5)]
    assert_serial(r, thread)
    assert len(set(pids(r, thread))) == 1, pids(r, thread)
    assert received(w, first.id)
    assert not any(received(w, x.id) for x in rest), "a handed-off member went through the broker"
    wait_for(
        lambda: not list(r.scan_iter(match=f"*:t:{thread}:*")) or None, what="the thread's keys to vanish"
    )


def test_a_handed_off_member_that_rejects_without_requeue_fails_with_its_chord(proj, make_deployment, r):
    """Celery's tracer leaves a Reject's FAILURE to the worker's main process, which never hears
    of a member run by handoff: its result read PENDING for ever, its link_error never ran and
    its chord never ended.  Now as through the broker: FAILURE, the errback, the chord's error."""
    w = make_deployment(CT_EVENTS="0").worker("handoff", concurrency=2)
    thread = tid("ho-reject")
    go = f"go:{thread}"
    first = proj.where.apply_async((thread, "first"), {"until": go})
    wait_for(lambda: starts(r, thread) == ["first"], what="the first member")
    rejected = proj.rejecter.apply_async((thread, "rej"), link_error=proj.errback_log.s())
    joined = chord([proj.where.si(thread, "ok"), proj.rejecter.si(thread, "part")])(
        proj.plain.si(thread, "body")
    )
    r.set(go, 1)
    assert first.get(timeout=30) == "first"
    wait_for(lambda: proj.app.AsyncResult(rejected.id).state == "FAILURE", what="the rejected member FAILURE")
    wait_for(lambda: r.llen(f"errbacks:{rejected.id}") == 1, what="its link_error")
    wait_for(lambda: proj.app.AsyncResult(joined.id).state == "FAILURE", what="the chord's body FAILURE")
    assert isinstance(proj.app.AsyncResult(joined.id).result, ChordError)
    assert starts(r, thread) == ["first", "rej", "ok", "part"]
    assert r.llen(f"errbacks:{rejected.id}") == 1
    assert not received(w, rejected.id), "it went through the broker: not the handoff's way"
    assert_serial(r, thread)


@pytest.mark.parametrize("case", ["time_limit", "worker_time_limit", "off"])
def test_members_go_through_the_broker_when_the_handoff_cannot_run(proj, make_deployment, r, case):
    """With a time limit (the pool enforces it per job): the call's, or the worker's own
    (``--time-limit``, which the worker's pool applies to every job: it did not turn the handoff
    off, so a member handed off late in a job was killed within its own limit, reported as the
    first member's); or threads_local_handoff = 0: each member is a broker delivery of its own."""
    env = {"CT_EVENTS": "0", **({"CT_LOCAL_HANDOFF": "0"} if case == "off" else {})}
    d = make_deployment(**env)
    extra = ["--time-limit", "60"] if case == "worker_time_limit" else []
    w = d.worker("nohandoff", concurrency=2, extra=extra)
    thread = tid("nh")
    options = {"time_limit": 60} if case == "time_limit" else {}
    first, rest = burst(proj, thread, 3, **options)
    assert [x.get(timeout=30) for x in rest] == ["m0", "m1", "m2"]
    assert_serial(r, thread)
    assert all(received(w, x.id) for x in [first, *rest])


def test_a_claimed_member_that_cannot_run_here_is_given_back(proj, make_deployment, r):
    """finish claims the next member for the pool process at once; one that cannot run there
    after all (it carries expires, which only a broker delivery honours) is given back, RELEASED
    under its token, and published: it runs once, in order, as a broker delivery."""
    d = make_deployment(CT_EVENTS="0")
    w = d.worker("giveback", concurrency=2)
    thread = tid("gb")
    first = proj.where.apply_async((thread, "first"), {"until": f"go:{thread}"})
    wait_for(lambda: starts(r, thread) == ["first"], what="the first member")
    expiring = proj.where.apply_async((thread, "expiring"), expires=300)
    plain = proj.where.apply_async((thread, "plain"))
    r.set(f"go:{thread}", 1)  # first ends once both wait behind it
    assert [x.get(timeout=30) for x in (first, expiring, plain)] == ["first", "expiring", "plain"]
    assert starts(r, thread) == ["first", "expiring", "plain"]
    assert_serial(r, thread)
    assert received(w, expiring.id), "given back and delivered by the broker"
    assert not received(w, plain.id), "handed off by the given-back member's process"
    assert "could not give back" not in w.output()
    wait_for(
        lambda: not list(r.scan_iter(match=f"*:t:{thread}:*")) or None, what="the thread's keys to vanish"
    )


def handed_off_burst(proj, worker, n: int, thread: str):
    """A burst of `n` members behind a first one; all succeed, none a broker delivery."""
    _, rest = burst(proj, thread, n)
    assert [x.get(timeout=30) for x in rest] == [f"m{i}" for i in range(n)]
    assert not any(received(worker, x.id) for x in rest), "handed off, not delivered"
    return rest


def test_handed_off_members_send_task_events_when_the_worker_does(proj, make_deployment, r):
    """With task events on (Flower), the pool process sends a handed-off member's events:
    received (name, arguments), started, succeeded; and it is still not a broker delivery."""
    d = make_deployment(CT_EVENTS="1")
    w = d.worker("events", concurrency=2)
    got, stop = collect_events(proj.app)
    try:
        thread = tid("ev")
        rest = handed_off_burst(proj, w, 3, thread)
        for x in rest:
            wait_for(
                lambda x=x: (
                    [e["type"] for e in got if e.get("uuid") == x.id and e["type"] != "task-sent"]
                    == ["task-received", "task-started", "task-succeeded"]
                ),
                what=f"the events of {x.id}",
            )
            [rec] = [e for e in got if e.get("uuid") == x.id and e["type"] == "task-received"]
            assert rec["name"] == "tests.support.proj.where" and f"thread='{thread}'" in rec["kwargs"]
            assert rec["hostname"].startswith("events-")
    finally:
        stop()


def test_events_turned_off_and_on_at_runtime(proj, make_deployment, r):
    """The pool processes follow the worker's event setting within a second or two."""
    d = make_deployment(CT_EVENTS="0")
    w = d.worker("toggle", concurrency=2)
    got, stop = collect_events(proj.app)
    try:
        rest = handed_off_burst(proj, w, 2, tid("ev"))
        time.sleep(0.5)
        assert not [e for e in got if e.get("uuid") in {x.id for x in rest} and e["type"] != "task-sent"]
        proj.app.control.enable_events()

        def a_burst_sends_its_events() -> bool:
            # The worker passes the setting on to its pool processes within a second or two,
            # or more on a busy machine: a burst sent before then sends none.
            ids = {x.id for x in handed_off_burst(proj, w, 2, tid("ev"))}
            return within(
                lambda: ids <= {e.get("uuid") for e in got if e["type"] == "task-succeeded"}, timeout=5
            )

        wait_for(
            a_burst_sends_its_events,
            timeout=120,
            interval=0.5,
            what="the pool processes to send the handed-off members' events",
        )
    finally:
        stop()


def test_a_pool_process_lost_during_a_handed_off_member(proj, make_deployment, r):
    """The worker's main process learns which member the lost process ran by handoff and fails
    that attempt at once (well before its 30 s lease would lapse): it re-enters and runs again.
    The member whose job it continued keeps its SUCCESS."""
    d = make_deployment(CT_EVENTS="0", CT_KEEPALIVE="30", CT_DISPATCH_INTERVAL="0.2")
    d.worker("lost", concurrency=2)
    thread = tid("lost")
    first = proj.where.apply_async((thread, "first"), {"until": f"go:{thread}"})
    wait_for(lambda: starts(r, thread) == ["first"], what="the first member")
    doomed = proj.suicide.delay(thread, f"suicide-{thread}")  # kills its process once
    after = proj.where.delay(thread, "after")
    r.set(f"go:{thread}", 1)  # first ends once both wait behind it: doomed is handed off
    assert after.get(timeout=15) == "after"
    assert doomed.get(timeout=15) == f"suicide-{thread}"
    assert first.get(timeout=5) == "first" and first.state == "SUCCESS"
    assert starts(r, thread)[:2] == ["first", f"suicide-{thread}"]
    assert sorted(starts(r, thread)) == sorted(["first", "after"] + [f"suicide-{thread}"] * 2)
    assert_serial_but_for_the_killed(r, thread)


def test_a_lost_handed_off_member_is_retried_with_its_event(proj, make_deployment, r):
    """With task events on, the lost attempt's retry sends ``task-retried`` (its RETRY was stored
    without one: Flower showed it started until the next attempt)."""
    from tests.worker.test_reject_on_worker_lost import task_events

    d = make_deployment(CT_EVENTS="1", CT_KEEPALIVE="30", CT_DISPATCH_INTERVAL="0.2")
    d.worker("lost", concurrency=2)
    thread = tid("lost")
    with task_events(proj.app) as seen:
        proj.where.apply_async((thread, "first"), {"until": f"go:{thread}"})
        wait_for(lambda: starts(r, thread) == ["first"], what="the first member")
        doomed = proj.suicide.delay(thread, f"suicide-{thread}")  # kills its process once
        r.set(f"go:{thread}", 1)  # first ends once doomed waits behind it: doomed is handed off
        assert doomed.get(timeout=15) == f"suicide-{thread}"
        wait_for(
            lambda: [e for e in seen if e.get("uuid") == doomed.id and e["type"] == "task-retried"],
            what="the task-retried event",
        )


def assert_serial_but_for_the_killed(r, thread: str) -> None:
    """As assert_serial, where the killed attempt has a start and no end."""
    evs = events(r, thread)
    killed = next(i for i, e in enumerate(evs) if e.label.startswith("suicide"))
    assert evs[killed].kind == "start" and evs[killed + 1].kind == "start", evs
    rest = evs[:killed] + evs[killed + 1 :]
    for i, e in enumerate(rest):
        assert e.kind == ("start" if i % 2 == 0 else "end"), f"overlap in {thread}: {evs}"


def test_a_terminated_handed_off_member_is_announced_revoked(proj, make_deployment, r):
    """With task events on (Flower), terminating a member run by handoff sends its task-revoked
    (terminated), as Celery announces a task it terminated: Flower showed it started for good."""
    d = make_deployment()
    d.worker("term-ev", concurrency=2, extra=["-E"])
    got, stop = collect_events(proj.app)
    try:
        thread = tid("term-ev")
        first = proj.where.apply_async((thread, "first"), {"until": f"go:{thread}"})
        wait_for(lambda: starts(r, thread) == ["first"], what="the first member")
        long = proj.where.apply_async((thread, "long"), {"sleep": 30})
        r.set(f"go:{thread}", 1)
        wait_for(lambda: starts(r, thread) == ["first", "long"], what="the handed-off member")
        assert len(set(pids(r, thread))) == 1, "long was not handed off"

        def first_succeeded() -> list:
            return [e for e in got if e.get("type") == "task-succeeded" and e.get("uuid") == first.id]

        # While long runs: first's ending came when it ended, not when the pool job ends (Flower
        # showed both started; and first started for good once long was terminated).
        wait_for(first_succeeded, timeout=30, what="first's task-succeeded while long runs")
        proj.app.control.revoke(long.id, terminate=True)
        revoked = the_event(got, "task-revoked", long.id)
        assert revoked.get("terminated") is True, revoked
        # As Celery's reason for a task it terminated (Celery's own revoke may store 'revoked'
        # first: it marks a running task REVOKED while its state reads PENDING; a fresh result
        # each time, a ready one is cached).
        wait_for(
            lambda: "terminated" in str(proj.app.AsyncResult(long.id).result),
            what="long to read REVOKED('terminated')",
        )
        assert proj.app.AsyncResult(long.id).state == "REVOKED"
        assert len(first_succeeded()) == 1
    finally:
        stop()


@pytest.mark.parametrize("how", ["revoke", "terminate", "delete"])
def test_terminating_a_handed_off_member(proj, make_deployment, r, how):
    """revoke(terminate=True), the terminate command (``celery control terminate SIGTERM ID``,
    which went past the package's revoke), or Threads.delete, of a member run by handoff (which
    Celery's own revoke cannot find): its process is signalled, it ends REVOKED, once, and the
    next runs."""
    from celery_threads import Threads

    d = make_deployment(CT_EVENTS="0")
    d.worker("term", concurrency=2)
    thread = tid("term")
    proj.where.apply_async((thread, "first"), {"until": f"go:{thread}"})
    wait_for(lambda: starts(r, thread) == ["first"], what="the first member")
    long = proj.where.apply_async((thread, "long"), {"sleep": 30})
    nxt = proj.where.delay(thread, "next")
    r.set(f"go:{thread}", 1)  # first ends once long waits behind it: long is handed off
    wait_for(lambda: starts(r, thread) == ["first", "long"], what="the handed-off member")
    assert len(set(pids(r, thread))) == 1, "long was not handed off"
    t0 = time.time()
    if how == "revoke":
        replies = proj.app.control.revoke(long.id, terminate=True, reply=True, timeout=10)
        # The reply names it, as for a task Celery terminated itself (it said "tasks unknown").
        assert [x for x in replies if f"terminate: {long.id}" in str(x)], replies
    elif how == "terminate":  # as the CLI sends it
        proj.app.control.broadcast("terminate", arguments={"signal": "SIGTERM", "task_id": long.id})
    else:
        assert Threads(proj.app).delete(long.id) is True
    assert nxt.get(timeout=20) == "next"
    assert time.time() - t0 < 15
    wait_for(lambda: long.state == "REVOKED", what="long to be marked REVOKED")
    assert starts(r, thread) == ["first", "long", "next"]
    # Stopped, not run to its end (the child's SIGTERM handler unwinds the body, as for any
    # terminated task, so its span may close).
    [start] = [e.at_us for e in events(r, thread) if e.label == "long" and e.kind == "start"]
    ends = [e.at_us for e in events(r, thread) if e.label == "long" and e.kind == "end"]
    assert all(end - start < 10_000_000 for end in ends), "long ran on after its terminate"
    # The next member starts once long's process has exited: after its unwinding wrote its end.
    [next_start] = [e.at_us for e in events(r, thread) if e.label == "next" and e.kind == "start"]
    assert all(end < next_start for end in ends), "next started while long was unwinding"
    wait_for(lambda: Threads(proj.app).get(thread) is None, what="the thread to vanish")


@pytest.mark.parametrize("how", ["revoke", "stamped"])
def test_terminating_a_member_that_has_returned_leaves_the_one_handed_off_after_it(
    proj, make_deployment, r, how
):
    """revoke(terminate=True) of a member that has succeeded while its pool job goes on with the
    next member by handoff (GroupResult.revoke over a batch that is partly done): Celery still
    holds the first member's request, and its terminate signalled the process, killing the next
    member, whose lease then lapsed and which ran again after the one behind it.  Nothing is
    signalled: as for any task that has ended, the revoke only flags it.  ``stamped``: the same
    by ``revoke_by_stamped_headers(..., terminate=True)`` of the first member's stamp."""
    d = make_deployment(CT_EVENTS="0")
    w = d.worker("term", concurrency=2)
    thread = tid("term")
    stamp = {"batch": thread}
    signature = proj.where.si(thread, "first", until=f"go:{thread}")
    if how == "stamped":
        signature.stamp(**stamp)
    first = signature.apply_async()
    wait_for(lambda: starts(r, thread) == ["first"], what="the first member")
    second = proj.where.apply_async((thread, "second"), {"until": f"go2:{thread}"})
    third = proj.where.delay(thread, "third")
    r.set(f"go:{thread}", 1)  # first ends once second waits behind it: second is handed off
    wait_for(lambda: starts(r, thread) == ["first", "second"], what="the handed-off member")
    assert len(set(pids(r, thread))) == 1, "second was not handed off"
    assert first.get(timeout=1) == "first"  # stored before the handed-off run starts
    if how == "stamped":
        replies = proj.app.control.revoke_by_stamped_headers(stamp, terminate=True, reply=True, timeout=10)
    else:
        replies = proj.app.control.revoke(first.id, terminate=True, reply=True, timeout=10)  # done by then
    assert replies
    r.set(f"go2:{thread}", 1)
    assert third.get(timeout=30) == "third"
    assert second.get(timeout=5) == "second"
    assert first.state == "SUCCESS"
    assert starts(r, thread) == ["first", "second", "third"]
    assert_serial(r, thread)
    assert f"not terminating {first.id}: its body has returned" in w.output()


def _stand_in_pool_process(conn) -> None:
    """A forked process that writes its handoff slot as a pool process does (handoff._note), for
    each release the test sends, and answers each message once done."""
    from celery_threads.worker import handoff, shared

    shared._index = 0
    while True:
        release = conn.recv()
        if release is not None:
            handoff._note(release)
        conn.send("done")


def test_terminate_signals_a_handed_off_member_only_while_its_process_runs_it(proj):
    """_terminate_handed_off reads the pool process from its handoff slot, deletes the member in
    the gate, then signals the process.  While the delete waits on Redis (held here by CLIENT
    PAUSE), the process may finish that member and run a later one its finish handed it: that
    process is not signalled.  A process whose slot still names the member is."""
    import multiprocessing
    import shutil
    import threading
    from types import SimpleNamespace

    import redis

    from celery_threads.gate import Release
    from celery_threads.runtime import get_runtime
    from celery_threads.worker import handoff, shared
    from celery_threads.worker.revoke import _terminate_handed_off
    from tests.conftest import RedisServer
    from tests.support.isolated import envelope, pointed_at

    server = RedisServer()
    server.start()
    saved = (handoff._app, handoff._allowed, handoff._stopping)
    saved_shared = (shared._lease_ends, shared._slots, shared._flag, shared._index)
    fork = multiprocessing.get_context("fork")
    try:
        with pointed_at(
            proj.app, threads_redis_url=server.url(0), broker_url=server.url(1), result_backend=server.url(2)
        ):
            shared.prepare(1)
            handoff.prepare(SimpleNamespace(app=proj.app, task_events=False, concurrency=1))
            runtime = get_runtime(proj.app)
            thread = tid("fence")
            released = runtime.gate.enqueue(thread, "x", envelope("x", thread)).release
            assert released is not None
            assert runtime.gate.claim(thread, "x", released.token, "w") == 1
            ours, theirs = fork.Pipe()
            process = fork.Process(target=_stand_in_pool_process, args=(theirs,), daemon=True)
            process.start()
            theirs.close()

            def tell(message):
                try:
                    ours.send(message)
                    assert ours.recv() == "done"
                except (EOFError, BrokenPipeError):
                    raise AssertionError("the stand-in pool process was signalled") from None

            tell(released)  # its slot names (x, token)
            client = redis.Redis(port=server.port)
            client.client_pause(10_000, all=False)  # writes wait: the delete below waits
            try:
                terminating = threading.Thread(target=_terminate_handed_off, args=(runtime, "x", None))
                terminating.start()
                wait_for(
                    lambda: any("b" in c["flags"] for c in client.client_list()),
                    what="the terminate's delete to wait on Redis",
                )
                tell(Release(thread, "later", "99", 0, b""))  # x ended; a later one runs
            finally:
                client.client_unpause()
            terminating.join(20)
            assert not terminating.is_alive()
            assert runtime.gate.reads.snapshot(thread) is None  # x left its thread all the same
            tell(None)  # alive: it was not signalled
            _terminate_handed_off(runtime, "later", None)  # its slot names it: signalled
            process.join(10)
            assert process.exitcode == -15
    finally:
        handoff._app, handoff._allowed, handoff._stopping = saved
        shared._lease_ends, shared._slots, shared._flag, shared._index = saved_shared
        server.stop()
        shutil.rmtree(server.dir, ignore_errors=True)
