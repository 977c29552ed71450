"""The same threads under each worker pool (prefork, threads, solo, gevent), on each broker: one
shared body, as the compatibility table in README.md states."""

from __future__ import annotations

import pytest

from celery_threads import Threads
from tests.conftest import rabbitmq_url
from tests.support.helpers import assert_serial, starts, tid, wait_for

CONCURRENCY = {"prefork": 2, "threads": 4, "solo": 1, "gevent": 8}


@pytest.mark.parametrize("broker", ["redis", "amqp"])
@pytest.mark.parametrize("pool", sorted(CONCURRENCY))
def test_threads_run_serially_in_order_with_retries_and_deaths(
    proj, make_deployment, redis_server, pool, broker
):
    if pool == "gevent":
        pytest.importorskip("gevent")
    # A Redis broker on the gate's server: the gate pushes releases onto the queue itself.
    url = redis_server.url(3) if broker == "redis" else rabbitmq_url()
    d = make_deployment(broker=url, CT_KEEPALIVE="2", CT_DISPATCH_INTERVAL="0.2")
    d.worker(pool, pool=pool, concurrency=CONCURRENCY[pool])
    r = proj.history()
    threads = [tid(f"{pool}-{broker}") for _ in range(3)]
    ends, doomed = [], []
    go = f"go:{threads[0]}"  # each m0 held until every call was sent, however slowly
    for t in threads:
        ends.append(proj.record.delay(t, "m0", sleep=0.05, fail_times=1, countdown=0.3, until=go))
        ends.append(proj.record.delay(t, "m1", sleep=0.05))
        doomed.append(proj.boom.delay(t, "x").id)
        ends.append(proj.record.delay(t, "m2", sleep=0.05))
    r.set(go, 1)
    for x in ends:
        x.get(timeout=60)
    threads_api = Threads(proj.app)
    dead = {task.task_id for task in threads_api.dead()}
    assert set(doomed) <= dead
    for t in threads:
        # m0's retry re-enters at now + 0.3 s, after its siblings' arrival times.
        assert starts(r, t) == ["m0", "m1", "x", "m2", "m0"]
        assert_serial(r, t)
        wait_for(lambda t=t: threads_api.get(t) is None, what="thread to vanish")
    for task_id in doomed:
        threads_api.forget(task_id)


def test_a_cold_shutdown_of_a_solo_worker_is_a_lost_attempt(proj, make_deployment):
    """SIGQUIT runs Celery's cold shutdown inside the member's body (the solo pool runs it in the
    main thread); its cancel of the running task raised NotImplementedError there, which ended
    the member as its own failure: dead, its retries unused.  It is a lost attempt: it runs
    again on the next worker."""
    import os
    import signal

    r = proj.history()
    d = make_deployment(CT_KEEPALIVE="2", CT_DISPATCH_INTERVAL="0.2")
    solo = d.worker("solo-quit", pool="solo", concurrency=1)
    thread = tid("solo-quit")
    go = f"go:{thread}"
    cut = proj.record.delay(thread, "cut", until=go)  # max_retries=3; waits for go
    wait_for(lambda: starts(r, thread) == ["cut"], what="the member to start")
    os.kill(solo.proc.pid, signal.SIGQUIT)
    solo.proc.wait(60)
    assert cut.id not in {x.task_id for x in Threads(proj.app).dead()}
    # Still its thread's member: active until its lease lapses, then waiting for its retry.
    info = Threads(proj.app).get(thread)
    assert info is not None
    assert cut.id in [m.task_id for m in info.waiting] + ([info.active.task_id] if info.active else [])
    r.set(go, 1)
    d.worker("solo-next", pool="solo", concurrency=1)
    assert cut.get(timeout=60) == "cut"
    assert starts(r, thread) == ["cut", "cut"]
