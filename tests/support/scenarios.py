"""The semantics every gate topology must keep (one Redis, shards, Sentinel, Cluster, TLS with an
ACL user), as scenarios run by real workers of a deployment; each topology's tests call them."""

from __future__ import annotations

import signal
from typing import Any

from celery.exceptions import TimeoutError as ResultTimeout

from celery_threads import Threads
from tests.conftest import Deployment
from tests.support.helpers import assert_serial, starts, tid, wait_for


def mixed_load(proj: Any, r: Any, threads: list[str]) -> dict[str, Any]:
    """Per thread: three ordered members (the second fails once and retries), one that dies and
    one that is deleted while it waits; returns the threads listed meanwhile and each thread's
    dead member's task id.  Each thread's first member is held until every call was sent: the
    order the retry takes its place in is then the same however fast the calls go out."""
    results = {}
    go = f"go:{tid('mixed')}"
    for thread in threads:
        results[thread] = [
            proj.record.delay(thread, "a", sleep=0.05, until=go),
            proj.record.delay(thread, "b", fail_times=1, countdown=0.1),
            proj.record.delay(thread, "c"),
        ]
    dead = {thread: proj.boom.delay(thread, "d") for thread in threads}
    deleted = {thread: proj.record.apply_async((thread, "x"), countdown=60) for thread in threads}
    t = Threads(proj.app)
    listed = set(t.ids())
    for thread in threads:
        assert t.delete(deleted[thread].id)
    r.set(go, 1)
    for thread in threads:
        assert [x.get(timeout=60) for x in results[thread]] == ["a", "b", "c"]
    wait_for(lambda: all(len(starts(r, thread)) == 5 for thread in threads), timeout=60, what="the deaths")
    for thread in threads:
        # b's retry waits its countdown, behind c and d, which arrived before it re-entered.
        assert starts(r, thread) == ["a", "b", "c", "d", "b"]
        assert_serial(r, thread)
    dead_ids = {x.task_id: x.thread_id for x in t.dead()}
    assert all(dead_ids.get(dead[thread].id) == thread for thread in threads), dead_ids
    return {"listed": listed, "dead": {thread: dead[thread].id for thread in threads}}


#: The release timeout of a deployment that runs :func:`crash_recovery`: a release the victim
#: had just received when it was killed (before its renewer counted it held) comes back after
#: threads_release_timeout, which the scenario's 30 s waits must cover (the tests' default is 60 s).
RECOVERY_RELEASE_TIMEOUT = "5"


def crash_recovery(d: Deployment, proj: Any, r: Any) -> None:
    """A worker SIGKILLed while it runs a member (``d``'s keepalive short, e.g. CT_KEEPALIVE=2):
    the member waiting behind it runs on another worker once the lease lapses, then the lost
    member runs again (a lost worker's member is retried), never two at once.  ``d``'s workers
    are stopped first, so that the victim is the one to run the member."""
    for proc in d.processes:
        proc.stop()
    victim = d.worker("victim", concurrency=1)
    thread = tid("crash")
    doomed = proj.record.delay(thread, "doomed", sleep=30)
    nxt = proj.record.delay(thread, "next")
    wait_for(lambda: starts(r, thread) == ["doomed"], what="doomed to start")
    d.worker("survivor", concurrency=1)
    victim.kill(signal.SIGKILL)
    try:
        assert nxt.get(timeout=30) == "next"
    except ResultTimeout:
        raise AssertionError(
            f"next did not run: {starts(r, thread)}, {Threads(proj.app).get(thread)}\n{d.log_tails()}"
        ) from None
    wait_for(
        lambda: starts(r, thread)[:3] == ["doomed", "next", "doomed"],
        timeout=30,
        what=lambda: (
            f"doomed to run again: {starts(r, thread)}, "
            f"{Threads(proj.app).get(thread)}, {Threads(proj.app).dead()}"
        ),
    )
    Threads(proj.app).delete(doomed.id)
    wait_for(lambda: Threads(proj.app).get(thread) is None, what="the thread to end")
