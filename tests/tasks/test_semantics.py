"""Each rule of the design celery-threads implements (README.md, "The guarantees"), on real
workers."""

from __future__ import annotations

import time
from datetime import datetime, timedelta, timezone

import pytest

from celery_threads import Threads
from tests.support.helpers import assert_serial, gate_keys, starts, tid, wait_for


@pytest.fixture
def r(proj):
    return proj.history()


def test_members_run_one_at_a_time_in_arrival_order(proj, worker, r):
    thread = tid()
    results = [proj.record.delay(thread, f"m{i}", sleep=0.05) for i in range(6)]
    assert [x.get(timeout=30) for x in results] == [f"m{i}" for i in range(6)]
    assert starts(r, thread) == [f"m{i}" for i in range(6)]
    assert_serial(r, thread)


def test_thread_exists_only_while_it_has_members(proj, worker, r):
    thread = tid()
    threads = Threads(proj.app)
    proj.record.delay(thread, "a", sleep=0.5)
    proj.record.delay(thread, "b")
    info = wait_for(lambda: threads.get(thread), what="thread to exist")
    assert info.active is not None and [m.state for m in info.waiting] == ["WAITING"]
    wait_for(lambda: threads.get(thread) is None, what="thread to vanish")
    assert gate_keys(r, thread) == []
    assert thread not in set(threads.ids())


def test_earlier_scheduled_member_displaces_a_head_not_yet_released(proj, worker, r):
    thread = tid()
    now = datetime.now(timezone.utc)
    proj.record.delay(thread, "busy", sleep=1.0)
    wait_for(lambda: starts(r, thread) == ["busy"], what="busy to start")
    proj.record.apply_async((thread, "late"))
    proj.record.apply_async((thread, "early"), eta=now - timedelta(seconds=5))
    info = Threads(proj.app).get(thread)
    assert [m.name for m in info.waiting] == ["tests.support.proj.record"] * 2
    assert info.waiting[0].scheduled_at < info.waiting[1].scheduled_at
    wait_for(lambda: len(starts(r, thread)) == 3, what="all three to run")
    assert starts(r, thread) == ["busy", "early", "late"]
    assert_serial(r, thread)


def test_countdown_and_eta_are_read_as_celery_reads_them(proj, worker, r):
    """A countdown other than 0 wins over an eta given with it, and a negative countdown is an
    eta in the past (Celery's ``as_task_v2``): the gate held a countdown-and-eta call until its
    eta, and queued a negative countdown as 0, behind members due before it."""
    thread, go = tid(), f"go:{tid()}"
    now = datetime.now(timezone.utc)
    proj.record.apply_async((thread, "busy"), {"until": go})
    wait_for(lambda: starts(r, thread) == ["busy"], what="busy to start")
    now_call = proj.record.apply_async((thread, "now"))
    back = proj.record.apply_async((thread, "back"), countdown=-60)
    soon = proj.record.apply_async((thread, "soon"), countdown=1, eta=now + timedelta(hours=1))
    info = Threads(proj.app).get(thread)
    assert [m.task_id for m in info.waiting] == [back.id, now_call.id, soon.id]
    assert info.waiting[0].scheduled_at < now - timedelta(seconds=50)
    assert info.waiting[2].scheduled_at < now + timedelta(minutes=1)
    r.set(go, 1)
    assert soon.get(timeout=30) == "soon"
    assert starts(r, thread) == ["busy", "back", "now", "soon"]
    assert_serial(r, thread)


def test_equal_schedules_break_ties_by_arrival(proj, worker, r):
    thread = tid()
    when = datetime.now(timezone.utc) + timedelta(seconds=1)
    results = [proj.record.apply_async((thread, f"m{i}"), eta=when) for i in range(5)]
    [x.get(timeout=30) for x in results]
    assert starts(r, thread) == [f"m{i}" for i in range(5)]


def test_countdown_is_on_the_gate_clock_and_holds_the_member(proj, worker, r):
    thread = tid()
    t0 = time.time()
    result = proj.record.apply_async((thread, "later"), countdown=1.5)
    info = Threads(proj.app).get(thread)
    assert info.active is None and info.waiting[0].state == "WAITING"
    assert result.get(timeout=30) == "later"
    assert time.time() - t0 >= 1.4


def test_failed_head_with_retries_left_is_outprioritized_by_earlier_sibling(proj, worker, r):
    thread = tid()
    first = proj.record.delay(thread, "flaky", fail_times=1, countdown=1.0)
    second = proj.record.delay(thread, "sibling", sleep=0.1)
    assert second.get(timeout=30) == "sibling"
    assert first.get(timeout=30) == "flaky"
    assert starts(r, thread) == ["flaky", "sibling", "flaky"]
    assert_serial(r, thread)


def test_a_retry_takes_effect_when_the_body_has_unwound(proj, worker, r):
    """self.retry(throw=False) and the body goes on: the next member waits for the body to end
    (it would be released by the retry itself otherwise); the retried member, due when its body
    ended, runs again after it (the body calls self.retry once the next member is enqueued, and
    a few milliseconds later, so that the retry is scheduled after it: on the gate's millisecond
    clock an equal schedule goes by arrival, and the retried member arrived first)."""
    thread = tid()
    proj.retry_then_linger.delay(thread, "lingers", until=f"enqueued:{thread}")
    second = proj.record.delay(thread, "next")
    r.set(f"enqueued:{thread}", 1)
    assert second.get(timeout=30) == "next"
    wait_for(lambda: len(starts(r, thread)) == 3, what="the retried member's second run")
    assert starts(r, thread) == ["lingers", "next", "lingers"]
    assert_serial(r, thread)


def test_failed_head_competes_again_and_wins_when_it_is_earliest(proj, worker, r):
    thread = tid()
    first = proj.record.delay(thread, "flaky", fail_times=2, countdown=0.1)
    later = proj.record.apply_async((thread, "later"), countdown=3)
    assert first.get(timeout=30) == "flaky"
    assert later.get(timeout=30) == "later"
    assert starts(r, thread) == ["flaky", "flaky", "flaky", "later"]


def test_exhausted_head_dies_is_detached_and_the_thread_advances(proj, worker, r):
    thread = tid()
    dying = proj.boom.delay(thread, "dies")
    after = proj.record.delay(thread, "after")
    assert after.get(timeout=30) == "after"
    with pytest.raises(ValueError):
        dying.get(timeout=10)
    threads = Threads(proj.app)
    dead = [d for d in threads.dead() if d.thread_id == thread]
    assert [(d.task_id, d.name, d.args, d.retries) for d in dead] == [
        (dying.id, "tests.support.proj.boom", [thread, "dies"], 0)
    ]
    assert "ValueError" in dead[0].exception and dead[0].died_at.tzinfo is not None
    wait_for(lambda: threads.get(thread) is None, what="thread to vanish")
    assert r.lrange(f"dead_signal:{thread}", 0, -1)[0].decode().startswith(dying.id)


def test_restarted_dead_task_is_a_brand_new_arrival(proj, worker, r):
    thread = tid()
    dying = proj.boom.delay(thread, "dies")
    with pytest.raises(ValueError):
        dying.get(timeout=30)
    threads = Threads(proj.app)
    proj.record.delay(thread, "blocker", sleep=1.0)
    wait_for(lambda: "blocker" in starts(r, thread), what="blocker to start")
    queued = proj.record.delay(thread, "queued-before-restart")
    restarted = threads.restart(dying.id)
    assert restarted.id == dying.id
    assert dying.id not in [d.task_id for d in threads.dead()]
    info = threads.get(thread)
    assert [m.task_id for m in info.waiting] == [queued.id, dying.id]
    assert info.waiting[1].retries == 0
    wait_for(lambda: len(starts(r, thread)) == 4, what="restart to run")
    assert starts(r, thread) == ["dies", "blocker", "queued-before-restart", "dies"]
    wait_for(lambda: dying.id in [d.task_id for d in threads.dead()], what="second death")


def test_deleting_a_running_head_promotes_the_next_at_once(proj, worker, r):
    thread = tid()
    running = proj.record.delay(thread, "long", sleep=20)
    nxt = proj.record.delay(thread, "next")
    wait_for(lambda: starts(r, thread) == ["long"], what="long to start")
    t0 = time.time()
    assert Threads(proj.app).delete(running.id) is True
    assert nxt.get(timeout=15) == "next"
    assert time.time() - t0 < 10, "promotion waited for the keepalive"
    wait_for(lambda: running.state == "REVOKED", what="the running member to be revoked")
    assert Threads(proj.app).delete(running.id) is False


def test_deleting_a_waiting_member_removes_only_it(proj, worker, r):
    thread = tid()
    proj.record.delay(thread, "a", sleep=0.5)
    doomed = proj.record.delay(thread, "doomed")
    proj.record.delay(thread, "c")
    assert Threads(proj.app).delete(doomed.id)
    wait_for(lambda: len(starts(r, thread)) == 2 and Threads(proj.app).get(thread) is None, what="a and c")
    assert starts(r, thread) == ["a", "c"]


def test_threads_and_plain_tasks_share_a_queue(proj, worker, r):
    thread = tid()
    plain = [proj.plain.delay(thread + "-plain", f"p{i}", sleep=0.3) for i in range(3)]
    threaded = [proj.record.delay(thread, f"m{i}", sleep=0.1) for i in range(3)]
    assert [x.get(timeout=30) for x in plain + threaded] == ["p0", "p1", "p2", "m0", "m1", "m2"]
    assert_serial(r, thread)


def test_many_threads_run_side_by_side_each_serial(proj, worker, r):
    threads = [tid("many") for _ in range(40)]
    results = [proj.record.delay(t, f"m{i}", sleep=0.01) for i in range(5) for t in threads]
    for x in results:
        x.get(timeout=60)
    for t in threads:
        assert starts(r, t) == [f"m{i}" for i in range(5)]
        assert_serial(r, t)
    overlaps = [o for o in r.lrange("overlaps", 0, -1) if o.decode().split("|")[0] in threads]
    assert overlaps == []
