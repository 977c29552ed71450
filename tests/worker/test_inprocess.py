"""pytest-celery's in-process worker (``celery_session_worker``) with the threads pool.

The renewer and the dispatch loop run as threads of the worker step, so they work under the threads
and solo pools as under prefork.
"""

from __future__ import annotations

import threading
import time

import pytest

from celery_threads import ThreadedTask, Threads
from tests.support.helpers import tid, wait_for

_running: dict[str, int] = {}
_order: dict[str, list[str]] = {}
_overlaps: list[str] = []
_lock = threading.Lock()


@pytest.fixture(scope="session")
def celery_config(redis_server):
    return {
        "broker_url": redis_server.url(6),
        "result_backend": redis_server.url(7),
        "threads_redis_url": redis_server.url(8),
        "threads_keepalive": 1.0,
        "threads_dispatch_interval": 0.2,
    }


@pytest.fixture(scope="session")
def celery_worker_pool():
    return "threads"


@pytest.fixture(scope="session")
def inproc_tasks(celery_session_app):
    @celery_session_app.task(
        base=ThreadedTask,
        bind=True,
        thread_key="thread",
        name="inproc.step",
        max_retries=2,
        default_retry_delay=0.05,
    )
    def step(self, thread, label, sleep=0.0, fail_times=0):
        with _lock:
            _running[thread] = _running.get(thread, 0) + 1
            if _running[thread] > 1:
                _overlaps.append(thread)
            _order.setdefault(thread, []).append(label)
        try:
            time.sleep(sleep)
            if self.request.retries < fail_times:
                raise self.retry()
            return label
        finally:
            with _lock:
                _running[thread] -= 1

    return {"step": step}


@pytest.fixture(scope="session")
def celery_worker_parameters(inproc_tasks):
    # Requesting the tasks here registers them before celery_session_worker starts.
    return {"concurrency": 4}


def test_threads_pool_serializes_and_renews_leases(celery_session_app, celery_session_worker, inproc_tasks):
    step = inproc_tasks["step"]
    threads = [tid("inproc") for _ in range(3)]
    results = [
        step.delay(t, f"m{i}", sleep=0.6 if i == 0 else 0.05, fail_times=1 if i == 1 else 0)
        for i in range(3)
        for t in threads
    ]
    results.append(step.delay(threads[0], "long", sleep=2.5))
    for x in results:
        x.get(timeout=60)
    for t in threads[1:]:
        assert _order[t] == ["m0", "m1", "m2", "m1"]
    # "long" arrived before m1's retry re-entered (at its failure + 0.05 s), so it goes first;
    # it runs once: had its lease not been renewed, the lapse would have run it again.
    assert _order[threads[0]] == ["m0", "m1", "m2", "long", "m1"]
    assert _overlaps == []
    wait_for(
        lambda: all(Threads(celery_session_app).get(t) is None for t in threads), what="threads to vanish"
    )
