"""A worker in a warm shutdown takes no more work by the in-process handoff: the pool process that
finishes the running member does not run the thread's next one; that one goes through the broker,
to a worker that is not stopping, once.
"""

from __future__ import annotations

import os
import signal

import pytest
from celery.worker import WorkController

from celery_threads import Threads
from tests.support.helpers import assert_serial, starts, tid, wait_for
from tests.worker.test_handoff import pids


@pytest.mark.parametrize("how", ["warm", "soft"])
def test_a_stopping_worker_hands_off_no_member(proj, make_deployment, how):
    """``soft``: a cold shutdown (SIGQUIT) with worker_soft_shutdown_timeout (Celery 5.5+),
    which waits that long for the running tasks before it sends worker_shutting_down: the
    running member's pool process ran the next one by handoff meanwhile, and the shutdown then
    cut it off (a lost attempt, or a death)."""
    if how == "soft" and not hasattr(WorkController, "wait_for_soft_shutdown"):
        pytest.skip("this Celery has no soft shutdown")
    r = proj.history()
    # The handoff is on, with a budget longer than the first member's run.
    d = make_deployment(CT_EVENTS="0", CT_LOCAL_HANDOFF="30", CT_SOFT_SHUTDOWN="10" if how == "soft" else "0")
    stopping = d.worker("stopping", concurrency=2)
    thread = tid("warm")
    ended = f"ended:{thread}"
    first = proj.beater.apply_async((thread, "first"), {"seconds": 60, "until": ended})
    wait_for(lambda: starts(r, thread) == ["first"], what="the first member")
    nxt = proj.where.delay(thread, "next")
    wait_for(
        lambda: [m.task_id for m in Threads(proj.app).get(thread).waiting] == [nxt.id],
        what="the next member to wait",
    )
    pool = set(stopping.children())
    # The main process only: a warm shutdown, or a cold one that waits for the running member.
    os.kill(stopping.proc.pid, signal.SIGTERM if how == "warm" else signal.SIGQUIT)
    wait_for(
        lambda: "take no more members by handoff" in stopping.output(),
        what="the worker to begin its shutdown",
    )
    r.set(ended, 1)  # the first member ends now
    stopping.proc.wait(60)
    assert first.get(timeout=5) == "first"  # the running member ran to its end
    assert starts(r, thread) == ["first"], "the stopping worker ran the next member"
    info = Threads(proj.app).get(thread)
    assert info is not None and info.active is not None and info.active.task_id == nxt.id
    assert info.active.state == "RELEASED"  # sent through the broker, not lost

    d.worker("successor", concurrency=2)
    assert nxt.get(timeout=30) == "next"
    assert starts(r, thread) == ["first", "next"]
    assert pids(r, thread) and not set(pids(r, thread)) & pool
    assert_serial(r, thread)
    # The stopping worker may still receive it from the broker before its consumer stops; it
    # hands it back unstarted then.
    assert f"[{nxt.id}] succeeded" not in stopping.output()


def test_a_cold_shutdown_during_a_handoff_cancels_the_member_that_runs(proj, make_deployment):
    """SIGQUIT while a pool job runs a member by handoff: Celery cancels the job's request, whose
    member succeeded before; it announced that one as retried (on_retry, task_retry, RETRY
    over SUCCESS).  Only the process is stopped: the member it ran is a lost attempt."""
    r = proj.history()
    d = make_deployment(CT_EVENTS="0", CT_KEEPALIVE="3", CT_DISPATCH_INTERVAL="0.2")
    quitting = d.worker("quitting", concurrency=2)
    thread = tid("cold")
    go = f"go:{thread}"
    first = proj.where.apply_async((thread, "first"), {"until": go})
    wait_for(lambda: starts(r, thread) == ["first"], what="the first member")
    cut = proj.where.apply_async((thread, "cut"), {"sleep": 60})
    r.set(go, 1)
    wait_for(lambda: starts(r, thread) == ["first", "cut"], what="the handed-off member")
    assert len(set(pids(r, thread))) == 1, "cut was not handed off"
    os.kill(quitting.proc.pid, signal.SIGQUIT)
    quitting.proc.wait(60)
    assert first.state == "SUCCESS"
    assert r.lrange(f"retry_signal:{first.id}", 0, -1) == []
    d.worker("after", concurrency=2)

    def waits_again() -> bool:  # its lease lapsed: a lost attempt (its retry delay is Celery's 180 s)
        info = Threads(proj.app).get(thread)
        return info is not None and [m.task_id for m in info.waiting] == [cut.id]

    wait_for(waits_again, timeout=60, what="cut to wait for its retry")
