"""The benchmarks' Celery project: imported by ``celery -A bench.tasks worker|beat`` (and forked
pool children) and by the benchmark driver.

Configured from the environment (see :func:`bench.harness.celery_env`), so that each run points its
own workers at its own redis-server, broker, queue and key prefix:

``BENCH_REDIS_URL`` (gate and timings), ``BENCH_BROKER_URL``, ``BENCH_QUEUE``, ``BENCH_KEY_PREFIX``,
``BENCH_DISPATCH_INTERVAL``, ``BENCH_KEEPALIVE``, ``BENCH_RELEASE_TIMEOUT``, ``BENCH_PREFETCH``,
``BENCH_WORKER_DISPATCH``, ``BENCH_SHARDS``, ``BENCH_REDIS_OPTIONS`` (JSON: the gate client's
options, e.g. ``{"cluster": true}``), ``BENCH_PROBE_URL`` (the probes' own Redis, when the gate's
server must carry the gate's work alone; default ``BENCH_REDIS_URL``); ``BENCH_READY_KEY`` is set
in the probes' Redis when the worker or beat is ready.

Every probe is one Lua script stamped with the Redis server's ``TIME`` (:class:`Recorder`), and the
threaded and plain variants of a task run exactly the same body.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any, Optional

import redis
from celery import Celery, signals

from bench.harness import Recorder
from celery_threads import ThreadedTask

app = Celery("bench")
_state: dict[str, Any] = {}


def configure(env: Optional[dict[str, str]] = None) -> Celery:
    """Point ``app`` at the run described by ``env`` (default: ``os.environ``)."""
    env = dict(os.environ if env is None else env)
    redis_url = env.get("BENCH_REDIS_URL", "")
    app.conf.update(
        broker_url=env.get("BENCH_BROKER_URL") or redis_url or None,
        threads_redis_url=redis_url or None,
        threads_key_prefix=env.get("BENCH_KEY_PREFIX", "bench"),
        threads_dispatch_interval=float(env.get("BENCH_DISPATCH_INTERVAL", "1.0")),
        threads_keepalive=float(env.get("BENCH_KEEPALIVE", "30")),
        threads_release_timeout=float(env.get("BENCH_RELEASE_TIMEOUT", "60")),
        threads_worker_dispatch=env.get("BENCH_WORKER_DISPATCH", "1") == "1",
        threads_shards=int(env.get("BENCH_SHARDS", "1")),
        threads_redis_options=json.loads(env.get("BENCH_REDIS_OPTIONS") or "null"),
        threads_track_releases=env.get("BENCH_TRACK_RELEASES") == "1",
        worker_send_task_events=env.get("BENCH_EVENTS") == "1",
        task_default_queue=env.get("BENCH_QUEUE", "bench"),
        worker_prefetch_multiplier=int(env.get("BENCH_PREFETCH", "4")),
        task_ignore_result=True,
        broker_connection_retry_on_startup=True,
        worker_hijack_root_logger=True,
    )
    noack = env.get("BENCH_NOACK_QUEUE")
    if noack:
        # `throughput --threaded-no-ack`: threaded tasks on a queue of their own, consumed
        # without broker acknowledgements (the gate, not the broker, recovers a lost delivery).
        from kombu import Queue

        app.conf.task_queues = [Queue(app.conf.task_default_queue), Queue(noack, no_ack=True)]
        app.conf.task_routes = {"bench.noop_threaded": {"queue": noack}}
    else:
        app.conf.task_queues = None
        app.conf.task_routes = None
    # gatecpu --against: this process's gates run that revision's Lua.
    from bench.harness import use_lua_of

    use_lua_of(env.get("BENCH_LUA_REV") or None)
    # Drop what was built from earlier settings (gate runtime, broker pools).
    from celery_threads.runtime import reset

    reset(app)
    _state["probe_url"] = env.get("BENCH_PROBE_URL") or redis_url
    _state.pop("recorder", None)
    _state.pop("locks", None)
    return app


configure()


def recorder() -> Recorder:
    rec = _state.get("recorder")
    if rec is None or rec.pid != os.getpid():
        rec = _state["recorder"] = Recorder(_state["probe_url"])
    return rec


def locks() -> redis.Redis:
    """The users' own Redis client for their locks (on the same server, as most setups have it)."""
    client = _state.get("locks")
    if client is None or _state.get("locks_pid") != os.getpid():
        client = _state["locks"] = redis.Redis.from_url(app.conf.threads_redis_url)
        _state["locks_pid"] = os.getpid()
    return client


@signals.worker_ready.connect
def _worker_ready(sender: Any = None, **kwargs: Any) -> None:
    key = os.environ.get("BENCH_READY_KEY")
    if key:
        recorder().client.set(key, "1")


@signals.beat_init.connect
def _beat_ready(sender: Any = None, **kwargs: Any) -> None:
    key = os.environ.get("BENCH_READY_KEY")
    if key:
        recorder().client.set(key, "1")


# -- throughput: no-op tasks that count their completions ------------------------------------
@app.task(base=ThreadedTask, name="bench.noop_threaded", thread_key="thread")
def noop_threaded(thread: str, key: str, target: int) -> None:
    recorder().count(key, target)


@app.task(name="bench.noop_plain")
def noop_plain(thread: str, key: str, target: int) -> None:
    recorder().count(key, target)


# -- gatecpu's floor: a threaded task's gate round trips, each to a function that does nothing ---
#: The function every floor call runs: it reads nothing, writes nothing and replies as a
#: transition does that released nothing.
FLOOR_LIBRARY = (
    "#!lua name=bench_floor\n"
    "redis.register_function('bench_floor', function(KEYS, ARGV) return {1, ''} end)\n"
)
#: The size of the message a threaded no-op task's enqueue stores (measured: 956 bytes).
FLOOR_ENVELOPE = b"x" * 950


def floor_call(thread: str, *args: Any) -> None:
    """One gate round trip without a transition: ``FCALL bench_floor`` with the 12 keys of
    ``thread`` and the common head of a transition's arguments, then ``args``."""
    from celery_threads.keys import Keys

    client = _state.get("floor")
    if client is None or _state.get("floor_pid") != os.getpid():
        client = _state["floor"] = redis.Redis.from_url(app.conf.threads_redis_url)
        _state["floor_pid"] = os.getpid()
    keys = Keys(app.conf.threads_key_prefix, app.conf.threads_shards).thread(thread).script_keys()
    client.execute_command("FCALL", "bench_floor", len(keys), *keys, "", thread, "60000", "wake", "", *args)


@app.task(bind=True, name="bench.noop_floor")
def noop_floor(self: Any, thread: str, key: str, target: int) -> None:
    """A plain task whose body makes a threaded one's two gate round trips (its claim's and its
    finish's arguments); its producer made the enqueue's (:func:`floor_enqueue`)."""
    task, token = self.request.id, "1796559196514608"
    claimant = f"{self.request.hostname}/{os.getpid()}/{task}"
    floor_call(thread, task, token, "30000", self.request.hostname, claimant, "1")
    floor_call(thread, task, token, "1", "30000", self.request.hostname, claimant, claimant, "1")
    recorder().count(key, target)


def floor_enqueue(thread: str, task: str) -> None:
    """The enqueue's round trip of a floor task, with its arguments and a message of its size."""
    floor_call(thread, task, "in", "0", "-1", "0", FLOOR_ENVELOPE)


# -- handoff: a start and an end stamp per member ---------------------------------------------
def _mark(key: str, label: str) -> None:
    rec = recorder()
    rec.stamp(key, f"s|{label}")
    rec.stamp(key, f"e|{label}")


@app.task(base=ThreadedTask, name="bench.mark_threaded", thread_key="thread")
def mark_threaded(thread: str, key: str, label: str) -> None:
    _mark(key, label)


@app.task(name="bench.mark_plain")
def mark_plain(thread: str, key: str, label: str) -> None:
    _mark(key, label)


@app.task(base=ThreadedTask, name="bench.block_threaded", thread_key="thread")
def block_threaded(thread: str, go_key: str, timeout: float, key: str) -> None:
    """Holds its thread until the driver pushes to ``go_key``, so the members behind it queue up."""
    recorder().client.blpop([go_key], timeout=timeout)
    recorder().stamp(key, "e|block")


# -- lockretry: 20 ms of work per member, three ways of (not) serializing a key --------------
LOCK_EXPIRE = 60  # seconds, as in the Celery cookbook's "one at a time" recipe (there: 10 minutes)


def _work(run: str, key: str, index: int, seconds: float) -> None:
    rec = recorder()
    began = rec.work_begin(run, key, str(index), f"{key}:{index}")
    time.sleep(seconds)
    rec.work_end(run, key, began)


def _executed(run: str) -> None:
    recorder().client.incr(f"{run}:executions")


@app.task(bind=True, name="bench.lock_work", max_retries=None)
def lock_work(self: Any, run: str, key: str, index: int, seconds: float) -> None:
    """Today's pattern: a Redis lock taken at task start, ``self.retry`` while it is held."""
    _executed(run)
    lock = locks().lock(f"{run}:lock:{key}", timeout=LOCK_EXPIRE)
    if not lock.acquire(blocking=False):
        raise self.retry(countdown=0.5)
    try:
        _work(run, key, index, seconds)
    finally:
        lock.release()


@app.task(base=ThreadedTask, name="bench.threaded_work", thread_key="key")
def threaded_work(run: str, key: str, index: int, seconds: float) -> None:
    _executed(run)
    _work(run, key, index, seconds)


@app.task(name="bench.free_work")
def free_work(run: str, key: str, index: int, seconds: float) -> None:
    """No serialization at all: what the workers can do with this load (a reference, not a side)."""
    _executed(run)
    _work(run, key, index, seconds)


# -- dispatch: lateness of members with a countdown -------------------------------------------
@app.task(base=ThreadedTask, name="bench.due_threaded", thread_key="thread")
def due_threaded(thread: str, key: str, label: str) -> None:
    from celery_threads.runtime import get_runtime

    active = get_runtime(app).keys.thread(thread).active
    recorder().due_start(key, active, label)


@app.task(bind=True, name="bench.due_plain")
def due_plain(self: Any, thread: str, key: str, label: str) -> None:
    recorder().stamp(key, f"{label}|{self.request.eta}")
