"""Celery's own ``rate_limit`` on a threaded task (``celery_rated``, "2/s"), as a Celery user sets
it to spare an outside service: the worker's token bucket spaces the members of one thread too
(a pool process ran the next one by handoff, past the bucket), also when ``celery control
rate_limit`` sets it at run time; and a member the bucket holds longer than
``threads_release_timeout`` keeps its release (it was published again, and received twice).
Judged by the bodies' start records on the Redis server's clock and by the worker's log.
"""

from __future__ import annotations

import re

from tests.support.helpers import assert_serial, started_at, starts, tid, wait_for

SPACING_US = 400_000  # 2/s: a token every 0.5 s; a start may lag its token a little


def queued_behind_a_blocker(proj, r, task, thread: str, n: int) -> list:
    go = f"go:{thread}"
    proj.where.apply_async((thread, "first"), {"until": go})
    wait_for(lambda: starts(r, thread) == ["first"], what="the first member")
    rest = [task.apply_async((thread, f"m{i}")) for i in range(n)]
    r.set(go, 1)
    return rest


def gaps(r, thread: str, labels: list[str]) -> list[int]:
    at = [started_at(r, thread, label) for label in labels]
    return [b - a for a, b in zip(at, at[1:])]


def test_a_rate_limit_spaces_one_threads_members(proj, make_deployment):
    r = proj.history()
    make_deployment(CT_EVENTS="0").worker("rated", concurrency=2)  # no events: the handoff is on
    thread = tid("rated")
    rest = queued_behind_a_blocker(proj, r, proj.celery_rated, thread, 4)
    labels = [f"m{i}" for i in range(4)]
    assert [x.get(timeout=60) for x in rest] == labels
    assert min(gaps(r, thread, labels)) >= SPACING_US, gaps(r, thread, labels)
    assert_serial(r, thread)


def test_a_rate_limit_set_at_run_time_spaces_one_threads_members(proj, make_deployment):
    r = proj.history()
    w = make_deployment(CT_EVENTS="0").worker("rated", concurrency=2)
    where = [w.nodename]
    replies = proj.app.control.rate_limit(proj.where.name, "2/s", destination=where, reply=True, timeout=10)
    assert replies and "ok" in replies[0][w.nodename], replies
    try:
        # The worker's tick (every second) turns its handoff off, and says so.
        wait_for(lambda: "in-process handoff off" in w.output(), what="the handoff to turn off")
        thread = tid("rated-now")
        labels = [f"m{i}" for i in range(4)]
        rest = queued_behind_a_blocker(proj, r, proj.where, thread, 4)
        assert [x.get(timeout=60) for x in rest] == labels
        assert min(gaps(r, thread, labels)) >= SPACING_US, gaps(r, thread, labels)
        assert_serial(r, thread)
    finally:
        proj.app.control.rate_limit(proj.where.name, None, destination=where, reply=True, timeout=10)
    wait_for(lambda: "in-process handoff on again" in w.output(), what="the handoff to turn on again")


def test_members_held_in_the_rate_limit_bucket_keep_their_releases(proj, make_deployment):
    """Ten threads' members wait up to 4.5 s in the bucket, the release timeout being 2 s: the
    worker renews their releases as it does its prefetched members'."""
    r = proj.history()
    d = make_deployment(CT_RELEASE_TIMEOUT="2", CT_KEEPALIVE="3")
    w = d.worker("bucket", concurrency=2)
    threads = [tid("bucket") for _ in range(10)]
    sent = [proj.celery_rated.apply_async((thread, "only")) for thread in threads]
    assert [x.get(timeout=60) for x in sent] == ["only"] * 10
    for thread in threads:
        assert starts(r, thread) == ["only"]
    output = w.output()
    assert "no worker claimed" not in output
    for x in sent:
        assert len(re.findall(rf"\[{x.id}\] received", output)) == 1, x.id
