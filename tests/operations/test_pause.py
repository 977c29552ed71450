"""Pausing a thread on real prefork workers: its waiting members do not start (judged by the task
bodies' own start records) while other threads run; the running member finishes; new calls join;
``resume`` releases the head at once and the order is kept; the pause survives a worker restart and
a restart of the gate's Redis (append-only file).
"""

from __future__ import annotations

import uuid

from celery_threads import Threads
from tests.conftest import Deployment, RedisServer, configure_client, deployment_env
from tests.support.helpers import assert_serial, events, starts, tid, wait_for


def ended(r, thread: str) -> list[str]:
    return [e.label for e in events(r, thread) if e.kind == "end"]


def test_a_paused_thread_holds_its_waiting_members_while_other_threads_run(proj, make_deployment):
    d = make_deployment()
    d.worker("w1", concurrency=2)
    r = proj.history()
    held, other = tid("paused"), tid("running")
    threads = Threads(proj.app)

    proj.record.delay(held, "m0", sleep=1.5)
    second = proj.record.delay(held, "m1", sleep=1.0).id
    wait_for(lambda: starts(r, held) == ["m0"], what="m0 to start")
    assert threads.pause(held, "fixing a bug") is True
    assert threads.pause(held, "fixing bug 12") is False  # paused already: a new reason
    late = proj.record.delay(held, "m2").id  # a new call still joins

    # The running member goes on to its end; the others of its thread do not start, while
    # another thread's members run on the same workers after that end.
    wait_for(lambda: ended(r, held) == ["m0"], what="the running member to end")
    for i in range(3):
        proj.record.delay(other, f"o{i}")
    wait_for(lambda: ended(r, other) == ["o0", "o1", "o2"], what="the other thread to run")
    assert starts(r, held) == ["m0"]
    info = threads.get(held)
    assert info is not None
    assert (info.paused, info.active) == ("fixing bug 12", None)
    assert [m.state for m in info.waiting] == ["WAITING", "WAITING"]
    assert info.waiting[-1].task_id == late
    assert threads.get(other) is None and threads.stats().stuck == 0

    # resume releases the head in the same call (no dispatcher tick): it is active at once.
    assert threads.resume(held) is True
    info = threads.get(held)
    assert info is not None and info.paused is None
    assert info.active is not None and info.active.task_id == second
    wait_for(lambda: ended(r, held) == ["m0", "m1", "m2"], what="the thread to run on")
    assert starts(r, held) == ["m0", "m1", "m2"]
    assert_serial(r, held)
    assert threads.resume(held) is False
    assert threads.get(held) is None  # no member, no pause: gone


def test_a_pause_survives_a_worker_restart_and_a_gate_restart(proj, redis_server):
    """The pause lives in the gate's Redis with the members: a worker that starts again and a
    redis-server started again from its append-only file both find it."""
    gate = RedisServer(appendonly=True)
    gate.start()
    name = uuid.uuid4().hex[:8]
    env = {
        **deployment_env(redis_server),
        "CT_REDIS_URL": gate.url(0),
        "CT_HISTORY_URL": redis_server.url(0),
        "CT_DISPATCH_INTERVAL": "0.2",
        "CT_KEY_PREFIX": f"ct-{name}",
        "CT_QUEUE": f"q-{name}",
    }
    d = Deployment(env)
    configure_client(proj.app, **env)
    r = proj.history()
    held, other = tid("paused"), tid("running")
    try:
        threads = Threads(proj.app)
        # Pausing a thread that does not exist yet creates the pause; its members then join it.
        assert threads.pause(held) is True
        info = threads.get(held)
        assert info is not None and (info.paused, info.waiting) == ("paused", [])
        assert held in set(threads.ids())
        proj.record.delay(held, "m0")
        proj.record.delay(held, "m1")
        first = d.worker("w1", concurrency=2)
        proj.record.delay(other, "o0")
        wait_for(lambda: ended(r, other) == ["o0"], what="another thread to run")
        assert starts(r, held) == []

        first.stop()
        gate.stop()  # SIGTERM: redis-server flushes its append-only file
        gate.start()
        threads = Threads(proj.app)
        info = threads.get(held)
        assert info is not None and info.paused == "paused" and len(info.waiting) == 2
        d.worker("w2", concurrency=2)
        proj.record.delay(other, "o1")
        wait_for(lambda: ended(r, other) == ["o0", "o1"], what="the other thread after restarts")
        assert starts(r, held) == []
        assert [p.thread_id for p in threads.summaries(paused=True)] == [held]

        assert threads.resume(held) is True
        wait_for(lambda: ended(r, held) == ["m0", "m1"], what="the resumed thread to run")
        assert starts(r, held) == ["m0", "m1"]
        assert_serial(r, held)
    finally:
        d.stop()
        configure_client(proj.app, **deployment_env(redis_server))
        gate.stop(kill=True)
