"""The chaos run's Celery app and tasks (importable by forked workers), configured from CHAOS_* vars.

CHAOS_GATE_URL (threads_redis_url), CHAOS_BROKER_URL, CHAOS_HISTORY_URL (a redis-server of its own
that the gate never reads), CHAOS_RUN (names the history list), CHAOS_KEY_PREFIX, CHAOS_QUEUE,
CHAOS_KEEPALIVE, CHAOS_DISPATCH_INTERVAL, CHAOS_RELEASE_TIMEOUT, CHAOS_RETRY_DELAY, CHAOS_ACKS_LATE,
CHAOS_VISIBILITY, CHAOS_PREFETCH, CHAOS_CONTROL_EXCHANGE, CHAOS_BACKEND_URL (none by default),
CHAOS_NOACK ("1": the queue is consumed without broker acknowledgements).

Every event goes to one Redis list through one Lua script that reads the history server's ``TIME``
and appends in the same step, so the list is in time order.  Rows are ``<µs> <json>``; see
:mod:`tests.support.checker` for what each kind means.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any, Optional

import redis
from celery import Celery, signals
from celery.exceptions import Retry
from kombu import Queue

from celery_threads import ThreadedTask
from celery_threads.runtime import reset

UNREACHABLE = "redis://127.0.0.1:1/0"  # never the shared Redis: a run must say where to go

app = Celery("chaos")


def settings(env: Any = os.environ) -> dict[str, Any]:
    """``app.conf`` settings from CHAOS_* variables."""
    gate = env.get("CHAOS_GATE_URL", UNREACHABLE)
    return {
        "broker_url": env.get("CHAOS_BROKER_URL", gate),
        "result_backend": env.get("CHAOS_BACKEND_URL") or None,
        "task_ignore_result": not env.get("CHAOS_BACKEND_URL"),
        "threads_redis_url": gate,
        "threads_key_prefix": env.get("CHAOS_KEY_PREFIX", "chaos"),
        "threads_keepalive": float(env.get("CHAOS_KEEPALIVE", "8")),
        "threads_dispatch_interval": float(env.get("CHAOS_DISPATCH_INTERVAL", "0.5")),
        "threads_release_timeout": float(env.get("CHAOS_RELEASE_TIMEOUT", "5")),
        "threads_publish_timeout": float(env.get("CHAOS_PUBLISH_TIMEOUT") or 0) or None,
        "task_default_queue": env.get("CHAOS_QUEUE", "chaos"),
        "task_acks_late": env.get("CHAOS_ACKS_LATE", "1") == "1",
        "worker_prefetch_multiplier": int(env.get("CHAOS_PREFETCH", "2")),
        "broker_transport_options": {
            "visibility_timeout": float(env.get("CHAOS_VISIBILITY", "3600")),
            "unacked_restore_interval": 1,
            "unacked_restore_throttle": 1,
        },
        "control_exchange": env.get("CHAOS_CONTROL_EXCHANGE", "chaos-control"),
        "task_queues": (
            [Queue(env.get("CHAOS_QUEUE", "chaos"), no_ack=True)] if env.get("CHAOS_NOACK") == "1" else None
        ),
        "broker_connection_retry_on_startup": True,
        "worker_cancel_long_running_tasks_on_connection_loss": False,
    }


def configure(env: Any = os.environ) -> None:
    """Point the app at a run (in a test process that talks to several runs in turn)."""
    app.conf.update(settings(env))
    reset(app)
    global HISTORY_URL, HISTORY_KEY, RETRY_DELAY, _client
    HISTORY_URL = env.get("CHAOS_HISTORY_URL", UNREACHABLE)
    HISTORY_KEY = f"chaos:{env.get('CHAOS_RUN', 'run')}:history"
    RETRY_DELAY = float(env.get("CHAOS_RETRY_DELAY", "0.3"))
    _client = None
    if "work" in globals():
        work.default_retry_delay = RETRY_DELAY


HISTORY_URL = UNREACHABLE
HISTORY_KEY = "chaos:run:history"
RETRY_DELAY = 0.3
_client: Optional[redis.Redis] = None
_client_pid = 0
configure()

_APPEND = """
local t = redis.call('TIME')
local us = t[1] .. string.format('%06d', tonumber(t[2]))
redis.call('RPUSH', KEYS[1], us .. ' ' .. ARGV[1])
return us
"""


def history() -> redis.Redis:
    """This process's client of the history server (a forked child makes its own)."""
    global _client, _client_pid
    if _client is None or _client_pid != os.getpid():
        _client = redis.Redis.from_url(HISTORY_URL, socket_timeout=10)
        _client_pid = os.getpid()
    return _client


def now_us() -> int:
    seconds, micros = history().time()
    return int(seconds) * 1_000_000 + int(micros)


def record(kind: str, **fields: Any) -> int:
    """Append an event stamped with the history server's clock; returns the stamp (µs)."""
    row = json.dumps({"k": kind, **fields}, separators=(",", ":"))
    return int(history().eval(_APPEND, 1, HISTORY_KEY, row))


def read_history(client: redis.Redis, key: str) -> list[dict[str, Any]]:
    rows = []
    for raw in client.lrange(key, 0, -1):
        stamp, _, body = raw.decode().partition(" ")
        rows.append({"t": int(stamp), **json.loads(body)})
    return rows


class ChaosTask(ThreadedTask):
    """Writes ``fin`` once ``ThreadedTask.__call__`` has returned: the gate recorded the success
    (or gave up trying, which the task logs); a process killed before this line leaves a
    success without ``fin``, the at-least-once window the checker knows about.

    Writes ``landed`` once the gate has taken a ``self.retry``'s re-entry: it is applied when the
    body has unwound, and a process killed before (or a gate unreachable until then) leaves the
    member to its lapsing lease instead, scheduled at the lapse plus the retry delay."""

    def _reenter(
        self, runtime: Any, thread_id: str, task_id: str, token: str, reentry: Any, *rest: Any, **kwargs: Any
    ) -> Any:
        outcome = super()._reenter(runtime, thread_id, task_id, token, reentry, *rest, **kwargs)
        if outcome.done:
            record("landed", task=task_id, thread=thread_id, n=int(reentry.retries))
        return outcome

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        result = super().__call__(*args, **kwargs)
        headers = self.request.headers or {}
        if headers.get("thread_token"):
            record("fin", **_ids(self))
        return result


def _ids(task: Any) -> dict[str, Any]:
    request = task.request
    headers = request.headers or {}
    return {
        "task": request.id,
        "thread": headers.get("thread_id", ""),
        "n": int(request.retries or 0),
        "tok": str(headers.get("thread_token", "")),
        "pid": os.getpid(),
    }


@app.task(base=ChaosTask, bind=True, thread_key="thread", max_retries=3, default_retry_delay=RETRY_DELAY)
def work(
    self: Any,
    thread: str,
    label: str,
    sleep: float = 0.0,
    fails: int = 0,
    die: bool = False,
    retry_ms: int = 0,
) -> str:
    """Sleeps; retries (``self.retry(countdown=retry_ms)``) while ``retries < fails``; raises for
    good when ``die`` or when retries are exhausted.  ``end`` is recorded before the gate hears of
    the outcome, and each retry's new attempt is logged with the time around ``self.retry``."""
    ids = _ids(self)
    record("start", sleep=sleep, **ids)
    time.sleep(sleep)
    n = ids["n"]
    if n < fails:
        if self.max_retries is not None and n >= self.max_retries:
            record("end", outcome="die", **ids)
            raise RuntimeError(f"{label}: attempt {n} failed and no retries are left")
        record("end", outcome="retry", **ids)
        lo = now_us()
        try:
            self.retry(countdown=retry_ms / 1000.0)
        except Retry:
            record("enq", task=ids["task"], thread=thread, n=n + 1, cd=retry_ms * 1000, lo=lo)
            raise
    if die:
        record("end", outcome="die", **ids)
        raise ValueError(f"{label} dies")
    record("end", outcome="success", **ids)
    return label


@signals.task_received.connect
def _on_received(sender: Any = None, request: Any = None, **kwargs: Any) -> None:
    """In a worker's main process, after the claim: the member is active from here."""
    if request is None or request.name != work.name:
        return
    headers = request.request_dict or {}
    record(
        "recv",
        task=request.id,
        thread=headers.get("thread_id", ""),
        n=int(headers.get("retries") or 0),
        tok=str(headers.get("thread_token", "")),
        pid=os.getpid(),
    )
