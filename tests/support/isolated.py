"""A gate no dispatcher touches: the tests' app pointed at private databases of the test Redis.

The health and CLI tests write stale state on purpose (lapsed leases, unreleased heads) and count
members exactly.  The session's shared worker dispatches on database 0, so it would repair that
state, and other tests' threads would skew the counts; these tests use databases of their own,
flushed for each test, with no worker and no beat running on them.
"""

from __future__ import annotations

import gc
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Callable, Optional

import redis
from celery.bin.celery import celery as celery_command
from click.testing import CliRunner, Result

from celery_threads.gate import Gate
from celery_threads.publish import encode_envelope
from celery_threads.runtime import get_runtime, reset

GATE_DB, BROKER_DB, BACKEND_DB = 13, 14, 15
_SETTINGS = ("threads_redis_url", "broker_url", "result_backend")


def isolated_env(server: Any) -> dict[str, str]:
    """The CT_* environment of tests/support/proj.py for the private databases."""
    return {
        "CT_REDIS_URL": server.url(GATE_DB),
        "CT_BROKER_URL": server.url(BROKER_DB),
        "CT_BACKEND_URL": server.url(BACKEND_DB),
        "CT_KEEPALIVE": "30",
        "CT_DISPATCH_INTERVAL": "0.5",
    }


def point_app(app: Any, settings: dict[str, Any]) -> None:
    """Apply ``app.conf`` settings so that the gate, broker and backend clients use them.

    When the result backend changes, results the test dropped unsubscribe first, from the backend
    they were made with, while its server is still up: collected once it is gone (a test's private
    server), each would make Celery's result backend retry its reconnection for about 20 s, in
    whatever test ran then."""
    if "result_backend" in settings and settings["result_backend"] != app.conf.result_backend:
        gc.collect()
    app.conf.update(settings)
    reset(app)


@contextmanager
def pointed_at(app: Any, **settings: Any) -> Iterator[Any]:
    """``app`` with these ``app.conf`` settings for the duration, then as it was."""
    saved = {name: app.conf.get(name) for name in settings}
    point_app(app, settings)
    try:
        yield app
    finally:
        point_app(app, saved)


def own_server() -> Iterator[Any]:
    """A redis-server of a module's own (``yield from`` it in a fixture), for tests that fill its
    memory or change its users, which no other test may see; stopped and removed after."""
    from tests.conftest import RedisServer

    server = RedisServer()
    server.start()
    yield server
    server.stop()
    shutil.rmtree(server.dir, ignore_errors=True)


def run_cli(env: dict[str, str], *args: str, input: Optional[str] = None) -> Result:
    """``celery -A tests.support.proj threads ARGS`` in this process (click's CliRunner); an
    exception that escaped the command fails the test."""
    result = CliRunner().invoke(
        celery_command, ["-A", "tests.support.proj", "threads", *args], env=env, input=input
    )
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result


@contextmanager
def isolated(app: Any, server: Any) -> Iterator[Any]:
    """``app`` on freshly flushed private databases of ``server``."""
    for db in (GATE_DB, BROKER_DB, BACKEND_DB):
        redis.Redis(port=server.port, db=db).flushdb()
    env = isolated_env(server)
    with pointed_at(
        app,
        threads_redis_url=env["CT_REDIS_URL"],
        broker_url=env["CT_BROKER_URL"],
        result_backend=env["CT_BACKEND_URL"],
    ):
        yield app


def gate_in_the_past(app: Any, seconds: float) -> Gate:
    """A Gate on the app's Redis whose clock runs ``seconds`` behind the server's: what it writes
    (release times, deadlines, schedules) is that old as soon as it is written."""
    runtime = get_runtime(app)
    behind_ms = int(seconds * 1000)
    clock: Callable[[], int] = lambda: runtime.gate.reads.now_ms() - behind_ms  # noqa: E731
    return Gate(
        runtime.client,
        runtime.keys,
        release_timeout_ms=runtime.config.release_timeout_ms,
        keepalive_ms=runtime.config.keepalive_ms,
        clock=clock,
    )


def envelope(task_id: str, thread: str, label: str = "x", name: str = "tests.support.proj.record") -> bytes:
    """A stored task message, as ``apply_async`` would have captured it."""
    body = [[thread, label], {}, {"callbacks": None, "errbacks": None, "chain": None, "chord": None}]
    return encode_envelope(
        body,
        {
            "headers": {"task": name, "id": task_id, "lang": "py"},
            "serializer": "json",
            "exchange": "",
            "routing_key": "celery",
        },
    )


def kill_member(
    gate: Gate,
    thread: str,
    task_id: str,
    exception: str = "ValueError: boom",
    retries: int = 0,
    worker: str = "w-test@host",
) -> None:
    """Put ``task_id`` in the dead-letter store the way a worker would: enqueue, claim, kill."""
    outcome = gate.enqueue(thread, task_id, envelope(task_id, thread))
    assert outcome.release is not None, f"thread {thread} was not idle"
    assert gate.claim(thread, task_id, outcome.release.token, worker) == 1
    died = gate.kill(
        thread, task_id, outcome.release.token, {"retries": retries, "exception": exception, "traceback": ""}
    )
    assert died.done


def server_ms(app: Any) -> int:
    """The Redis server's clock, in milliseconds."""
    return get_runtime(app).gate.reads.now_ms()
