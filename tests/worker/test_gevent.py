"""Real workers under ``-P gevent`` (monkey-patched): the seed's semantics, and leases held while a
member's code holds the hub."""

from __future__ import annotations

import pytest

from celery_threads import Threads
from tests.support.helpers import assert_serial, events, starts, tid, wait_for
from tests.tasks import test_semantics as semantics

pytest.importorskip("gevent")


@pytest.fixture
def r(proj):
    return proj.history()


def test_members_of_several_threads_run_one_at_a_time_in_order(proj, make_deployment, r):
    d = make_deployment()
    d.worker("green", pool="gevent", concurrency=8)
    threads = [tid() for _ in range(4)]
    results = [proj.record.delay(thread, f"m{i}", sleep=0.05) for i in range(5) for thread in threads]
    assert sorted(x.get(timeout=60) for x in results) == sorted(f"m{i}" for i in range(5) for _ in threads)
    for thread in threads:
        assert starts(r, thread) == [f"m{i}" for i in range(5)]
        assert_serial(r, thread)


def test_a_failed_head_retries_behind_an_earlier_sibling(proj, make_deployment, r):
    green = make_deployment().worker("green", pool="gevent", concurrency=4)
    semantics.test_failed_head_with_retries_left_is_outprioritized_by_earlier_sibling(proj, green, r)


def test_a_dead_member_leaves_its_thread_and_the_next_runs(proj, make_deployment, r):
    d = make_deployment()
    d.worker("green", pool="gevent", concurrency=4)
    thread = tid()
    doomed = proj.boom.delay(thread, "doomed")
    nxt = proj.record.delay(thread, "next")
    assert nxt.get(timeout=30) == "next"
    assert [x.task_id for x in Threads(proj.app).dead()] == [doomed.id]
    assert starts(r, thread) == ["doomed", "next"]
    assert_serial(r, thread)
    wait_for(lambda: Threads(proj.app).get(thread) is None, what="the thread to vanish")


@pytest.mark.parametrize("how", ["sleep", "spin"])
def test_a_member_holding_the_hub_past_its_keepalive_keeps_its_lease(proj, make_deployment, r, how):
    """A body that does not yield to gevent's hub for 5 s (an unpatched ``time.sleep``, a CPU
    loop) under a keepalive of 2 s: its lease is renewed all the same, so the next member does
    not start before it ends, and it is not counted as a failed attempt.  Another worker's
    dispatch loop expires lapsed leases meanwhile, and takes the thread's next member once the
    gate releases it."""
    d = make_deployment(CT_KEEPALIVE="2")
    queue = d.env["CT_QUEUE"]
    green = d.worker("green", pool="gevent", concurrency=4)
    other = d.worker("other", concurrency=1, extra=["-Q", f"{queue}-idle"])
    thread = tid()
    hog = proj.hog.delay(thread, "hog", seconds=5.0, how=how)
    wait_for(lambda: starts(r, thread) == ["hog"], what="the hog to start")
    nxt = proj.record.delay(thread, "next")
    assert proj.app.control.add_consumer(queue, destination=[other.nodename], reply=True, timeout=10)
    assert hog.get(timeout=30) == "hog"
    assert nxt.get(timeout=30) == "next"
    assert_serial(r, thread)
    assert starts(r, thread) == ["hog", "next"]
    assert Threads(proj.app).dead() == []
    assert "keeps running although" not in green.output()


def test_a_prefetched_member_stays_with_its_worker_while_a_member_holds_the_hub(proj, make_deployment, r):
    """The worker renews the release of a member it has received but not started (its prefetch)
    although a member's code holds the hub: the release does not lapse, so it is not published
    again for another worker; it runs here once the hub is free."""
    d = make_deployment(CT_KEEPALIVE="2")
    queue = d.env["CT_QUEUE"]
    green = d.worker("green", pool="gevent", concurrency=1)
    other = d.worker("other", concurrency=1, extra=["-Q", f"{queue}-idle"])
    busy, waiting = tid(), tid()
    hog = proj.hog.delay(busy, "hog", seconds=5.0, lead=2.0)
    wait_for(lambda: starts(r, busy) == ["hog"], what="the hog to start")
    prefetched = proj.where.delay(waiting, "prefetched")
    wait_for(lambda: f"[{prefetched.id}] received" in green.output(), what="its receipt")
    assert proj.app.control.add_consumer(queue, destination=[other.nodename], reply=True, timeout=10)
    assert hog.get(timeout=30) == "hog"
    assert prefetched.get(timeout=30) == "prefetched"
    assert starts(r, waiting) == ["prefetched"]
    assert events(r, waiting)[0].at_us > events(r, busy)[-1].at_us  # after the hog, here
    assert "republishing it" not in other.output()


def test_a_hard_time_limit_kills_the_member_and_the_next_runs(proj, make_deployment, r):
    """Under gevent a request's ``worker_pid`` is a greenlet's id: the member's end waited for a
    process of that number (``pidfd_open`` raised OverflowError), Celery's own timeout handling
    never ran, and the member was retried until its lease lapsed, then died as LeaseExpired.  It
    dies of its time limit, at once, and the thread moves on."""
    d = make_deployment()
    green = d.worker("green", pool="gevent", concurrency=4)
    thread = tid()
    limited = proj.hard_limited.delay(thread, "limited")  # time_limit=1, max_retries=0
    nxt = proj.record.delay(thread, "next")
    assert nxt.get(timeout=30) == "next"
    [dead] = [x for x in Threads(proj.app).dead() if x.task_id == limited.id]
    assert "TimeLimitExceeded" in dead.exception
    assert limited.state == "FAILURE" and type(limited.result).__name__ == "TimeLimitExceeded"
    assert starts(r, thread) == ["limited", "next"]
    assert "OverflowError" not in green.output()


def test_a_terminated_member_leaves_its_thread_at_once(proj, make_deployment, r):
    """revoke(terminate=True) kills the greenlet: the member leaves its thread at once (nothing of
    a greenlet can be waited for).  It was taken for a pool process whose exit never came: it held
    its thread until its lease lapsed, and then ran again, or died as LeaseExpired over its
    REVOKED state."""
    d = make_deployment(CT_KEEPALIVE="30")
    d.worker("green", pool="gevent", concurrency=4)
    thread = tid()
    doomed = proj.beater.delay(thread, "doomed", seconds=30)  # max_retries=0
    wait_for(lambda: r.llen(f"beats:{thread}"), what="doomed to beat")
    nxt = proj.record.delay(thread, "next")
    proj.app.control.revoke(doomed.id, terminate=True)
    assert nxt.get(timeout=15) == "next"  # within its lease: it was not waited out
    wait_for(lambda: doomed.state == "REVOKED", what="doomed to be REVOKED")
    assert Threads(proj.app).dead() == []
    assert starts(r, thread) == ["doomed", "next"]
    wait_for(lambda: Threads(proj.app).get(thread) is None, what="the thread to vanish")
    assert doomed.state == "REVOKED"
