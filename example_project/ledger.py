"""The Celery project of the example: ledger postings, one thread per account.

A posting may fail and retry (a flaky bank link), may be scheduled for later, may die (an account
frozen for good) and be restarted once the account is unfrozen.  Every attempt appends an event,
stamped with the Redis server's clock, to a timeline the demo reads afterwards.
"""

from __future__ import annotations

import json
import os
import time

import redis
from celery import Celery

from celery_threads import ThreadedTask
from celery_threads.signals import member_dead

REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
#: The namespace of the example's own keys (balances, timelines) as of the gate's: a second run on
#: the same Redis starts from clean data.
PREFIX = os.environ.get("LEDGER_PREFIX", "ledger")

app = Celery("ledger", broker=REDIS_URL, backend=REDIS_URL)
app.conf.update(
    threads_redis_url=REDIS_URL,
    threads_key_prefix=PREFIX,
    threads_keepalive=10.0,
    threads_dispatch_interval=0.5,
    task_default_queue=os.environ.get("LEDGER_QUEUE", "ledger"),
    worker_send_task_events=True,
    task_send_sent_event=True,
    broker_connection_retry_on_startup=True,
    # Its results under the prefix too, so that clear() leaves nothing of a run behind.
    result_backend_transport_options={"global_keyprefix": f"{PREFIX}:"},
)

_redis: redis.Redis[bytes] | None = None


def store() -> redis.Redis[bytes]:
    global _redis
    if _redis is None or getattr(_redis, "pid", None) != os.getpid():
        _redis = redis.Redis.from_url(REDIS_URL)
        _redis.pid = os.getpid()  # type: ignore[attr-defined]
    return _redis


def key(*parts: str) -> str:
    """A key of the example's data, under its prefix."""
    return ":".join((PREFIX, "data", *parts))


def clear() -> None:
    """Drop every key under the prefix (the data's and the gate's, once no member is left) and
    the queue's binding."""
    r = store()
    for pattern in (f"{PREFIX}:*", f"_kombu.binding*.{PREFIX}"):
        for found in r.scan_iter(match=pattern, count=500):
            r.delete(found)


def server_time() -> float:
    seconds, micros = store().time()
    return seconds + micros / 1e6


def log_event(account: str, entry: str, event: str, **fields: object) -> None:
    record = {"entry": entry, "event": event, "at": server_time(), **fields}
    store().rpush(key("timeline", account), json.dumps(record))


@app.task(
    base=ThreadedTask,
    bind=True,
    thread_key="account",
    max_retries=3,
    default_retry_delay=0.5,
    ignore_result=True,
)
def post(self, account: str, entry: str, amount: int, fail_times: int = 0, seconds: float = 0.2) -> int:
    """Post `amount` to `account`: read the balance, work, write it back (a lost update if two
    postings of one account ever overlapped)."""
    log_event(account, entry, "start", attempt=self.request.retries)
    if store().sismember(key("frozen"), account):
        log_event(account, entry, "failed", error="account frozen")
        raise RuntimeError(f"account {account} is frozen")
    balance = int(store().get(key("balance", account)) or 0)
    time.sleep(seconds)
    if self.request.retries < fail_times:
        log_event(account, entry, "retry", error="bank link down", next_in=0.5)
        raise self.retry(countdown=0.5, exc=ConnectionError("bank link down"))
    store().set(key("balance", account), balance + amount)
    log_event(account, entry, "end", balance=balance + amount)
    return balance + amount


@member_dead.connect
def _log_death(sender=None, task_id=None, thread_id=None, exception=None, **kwargs):
    entry = store().hget(key("entries"), task_id)
    log_event(thread_id, entry.decode() if entry else task_id, "died", error=exception)
