"""The Celery project the test workers run (importable by forked pool children).

Configured from the environment so that each test can point workers at its own Redis server and
broker: CT_REDIS_URL (gate and results), CT_BROKER_URL, and CT_* overrides of settings.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import sys
import time
from typing import Optional

import redis
from celery import Celery
from celery.exceptions import Ignore, Reject, Retry
from celery.signals import task_failure, task_retry, worker_process_init
from celery.worker.request import Request

from celery_threads import ThreadedTask
from celery_threads.keys import Keys

# A failed test's deployment asks every process for its threads' stacks (tests/conftest.py
# Deployment.dump_stacks): they go to the process's log.  Pool processes inherit the handler.
if f"{os.sep}celery{os.sep}" in sys.argv[0]:
    faulthandler.register(signal.SIGUSR2, file=sys.__stderr__, all_threads=True)

REDIS_URL = os.environ.get("CT_REDIS_URL", "redis://127.0.0.1:6379/15")
# Where the tasks write their history: the gate's Redis unless a test cuts the gate off.
HISTORY_URL = os.environ.get("CT_HISTORY_URL") or REDIS_URL
app = Celery(
    "ctproj",
    broker=os.environ.get("CT_BROKER_URL", REDIS_URL),
    backend=os.environ.get("CT_BACKEND_URL", REDIS_URL),
)
app.conf.update(
    threads_redis_url=REDIS_URL,
    threads_keepalive=float(os.environ.get("CT_KEEPALIVE", "30")),
    threads_dispatch_interval=float(os.environ.get("CT_DISPATCH_INTERVAL", "1")),
    threads_release_timeout=float(os.environ.get("CT_RELEASE_TIMEOUT", "60")),
    threads_dead_letter_queue=os.environ.get("CT_DLQ") or None,
    threads_key_prefix=os.environ.get("CT_KEY_PREFIX", "celery_threads"),
    threads_track_releases=os.environ.get("CT_TRACK_RELEASES") == "1",
    threads_direct_release=os.environ.get("CT_DIRECT_RELEASE", "1") == "1",
    threads_local_handoff=float(os.environ.get("CT_LOCAL_HANDOFF", "1.0")),
    threads_shards=int(os.environ.get("CT_SHARDS", "1")),
    threads_redis_options=dict(
        json.loads(os.environ.get("CT_REDIS_OPTIONS") or "{}"),
        **({"cluster": True} if os.environ.get("CT_CLUSTER") == "1" else {}),
    ),
    threads_wait_replicas=int(os.environ.get("CT_WAIT_REPLICAS", "0")),
    threads_dead_letter_max=os.environ.get("CT_DEAD_LETTER_MAX") or None,
    threads_dead_letter_ttl=os.environ.get("CT_DEAD_LETTER_TTL") or None,
    task_default_queue=os.environ.get("CT_QUEUE", "celery"),
    task_acks_late=os.environ.get("CT_ACKS_LATE") == "1",
    worker_cancel_long_running_tasks_on_connection_loss=os.environ.get("CT_CANCEL_ON_LOSS") == "1",
    worker_prefetch_multiplier=int(os.environ.get("CT_PREFETCH", "4")),
    broker_transport_options={
        "visibility_timeout": float(os.environ.get("CT_VISIBILITY", "3600")),
    },
    worker_send_task_events=os.environ.get("CT_EVENTS", "1") == "1",
    worker_soft_shutdown_timeout=float(os.environ.get("CT_SOFT_SHUTDOWN", "0")),  # Celery 5.5+
    task_send_sent_event=True,
    broker_connection_retry_on_startup=True,
)


def routing(env: dict[str, str] | os._Environ[str]) -> dict:
    """CT_NOACK_QUEUE: threaded tasks go to that queue, consumed without broker acknowledgements
    (CT_NOACK_PLAIN=1 sends the plain task there too); else Celery's default routing."""
    noack = env.get("CT_NOACK_QUEUE")
    if not noack:
        return {"task_queues": None, "task_routes": None}
    from kombu import Queue

    plain_too = env.get("CT_NOACK_PLAIN") == "1"

    def route(name, args, kwargs, options, task=None, **kw):
        if isinstance(task, ThreadedTask) or (plain_too and name == "tests.support.proj.plain"):
            return {"queue": noack}
        return None

    return {
        "task_queues": [Queue(env.get("CT_QUEUE", "celery")), Queue(noack, no_ack=True)],
        "task_routes": (route,),
    }


app.conf.update(routing(os.environ))
if os.environ.get("CT_UNACKED_RESTORE"):
    app.conf.broker_transport_options.update(unacked_restore_interval=1, unacked_restore_throttle=1)

_history: redis.Redis[bytes] | None = None


def history() -> redis.Redis[bytes]:
    global _history
    if _history is None or getattr(_history, "_pid", None) != os.getpid():
        _history = redis.Redis.from_url(HISTORY_URL)
        _history._pid = os.getpid()  # type: ignore[attr-defined]
    return _history


def _await_key(key: Optional[str], timeout: float = 30.0) -> None:
    """Until the history holds ``key`` (when given; at most ``timeout`` seconds): a member held
    until the test has sent what must queue behind it, however busy the machine."""
    deadline = time.monotonic() + timeout
    while key and not history().exists(key) and time.monotonic() < deadline:
        time.sleep(0.01)


def _record(thread: str, event: str, label: str, task_id: str) -> None:
    """Append an event stamped with the Redis server's clock; counts members running at once."""
    r = history()
    seconds, micros = r.time()
    stamp = seconds * 1_000_000 + micros
    pipe = r.pipeline()
    if event == "start":
        pipe.incr(f"running:{thread}")
    else:
        pipe.decr(f"running:{thread}")
    pipe.rpush(f"hist:{thread}", f"{event}|{label}|{task_id}|{stamp}")
    running = pipe.execute()[0]
    if event == "start" and running > 1:
        r.rpush("overlaps", f"{thread}|{label}|{task_id}")


class _Span:
    def __init__(self, task: ThreadedTask, thread: str, label: str) -> None:
        self.args = (thread, label, task.request.id)

    def __enter__(self) -> _Span:
        _record(self.args[0], "start", *self.args[1:])
        return self

    def __exit__(self, *exc: object) -> None:
        _record(self.args[0], "end", *self.args[1:])


@app.task(base=ThreadedTask, bind=True, thread_key="thread", max_retries=3, default_retry_delay=0.2)
def record(self, thread, label, sleep=0.0, fail_times=0, countdown=0.2, bare=False, until=None):
    """Waits until the key `until` exists (when given; at most 30 s), runs `sleep` seconds;
    fails (with self.retry) its first `fail_times` attempts (`bare`: self.retry without an
    exception)."""
    with _Span(self, thread, label):
        _await_key(until)
        time.sleep(sleep)
        if self.request.retries < fail_times:
            if bare:
                raise self.retry(countdown=countdown)
            raise self.retry(countdown=countdown, exc=RuntimeError(f"{label} attempt failed"))
    return label


@app.task(base=ThreadedTask, bind=True, thread_key=lambda args, kwargs: f"{args[0]}-{kwargs['suffix']}")
def keyed(self, thread, label, suffix):
    """Its thread id is from a callable thread_key: the call's ``thread`` and ``suffix`` joined."""
    with _Span(self, f"{thread}-{suffix}", label):
        pass
    return label


@app.task(base=ThreadedTask, bind=True, thread_key="thread")
def record_request(self, thread, label):
    """Returns its request's thread id and fencing token."""
    return [self.request.thread_id, self.request.thread_token]


@app.task(base=ThreadedTask, bind=True, thread_key="thread")
def header_types(self, thread, label, *names):
    """The type names of its request's custom headers ``names`` (they come back as sent)."""
    with _Span(self, thread, label):
        return [type(getattr(self.request, name, None)).__name__ for name in names]


@app.task(base=ThreadedTask, bind=True, thread_key="thread", debounce=1.0, debounce_max=30)
def debounced(self, thread, label):
    """Declared with debounce (and debounce_max): a burst of calls in a thread runs once."""
    with _Span(self, thread, label):
        pass
    return label


@app.task(base=ThreadedTask, bind=True, thread_key="thread", max_retries=3)
def retry_then_linger(self, thread, label, linger=0.3, until=None):
    """First attempt: waits until the key `until` exists (when given; at most 30 s), calls
    self.retry(throw=False), then keeps running `linger` seconds more."""
    with _Span(self, thread, label):
        if self.request.retries == 0:
            deadline = time.monotonic() + 30
            while until and not history().exists(until) and time.monotonic() < deadline:
                time.sleep(0.01)
            if until:
                # Past the millisecond of the awaited enqueue: an equal schedule would go by
                # arrival order, and this member arrived first.
                time.sleep(0.01)
            self.retry(countdown=0, throw=False)
            time.sleep(linger)
    return label


@app.task(
    base=ThreadedTask,
    bind=True,
    thread_key="thread",
    autoretry_for=(KeyError,),
    max_retries=2,
    retry_backoff=0.1,
    retry_jitter=False,
)
def autoretry(self, thread, label, fail_times=0):
    with _Span(self, thread, label):
        if self.request.retries < fail_times:
            raise KeyError(label)
    return label


@app.task(base=ThreadedTask, bind=True, thread_key="thread", max_retries=0)
def boom(self, thread, label, sleep=0.0):
    """Fails for good on its first attempt."""
    with _Span(self, thread, label):
        time.sleep(sleep)
        raise ValueError(f"{label} exploded")


@app.task(base=ThreadedTask, bind=True, thread_key="thread", max_retries=0)
def flaky(self, thread, label):
    """Fails for good (no retries) while the key flaky:<thread> exists, else succeeds."""
    with _Span(self, thread, label):
        if history().exists(f"flaky:{thread}"):
            raise ValueError(f"{label} failed: flaky:{thread} is set")
    return label


@app.task(base=ThreadedTask, bind=True, thread_key="thread", max_retries=0, on_death="hold")
def ledger(self, thread, label, until=None):
    """on_death="hold": fails for good (holding its thread) while flaky:<thread> exists, else
    succeeds; first waits until the key `until` exists (when given)."""
    with _Span(self, thread, label):
        _await_key(until)
        if history().exists(f"flaky:{thread}"):
            raise ValueError(f"{label} failed: flaky:{thread} is set")
    return label


@app.task(base=ThreadedTask, bind=True, thread_key="thread", max_retries=0, ignore_result=True)
def fire_and_forget(self, thread, label, sleep=0.0):
    """ignore_result=True: Celery stores none of its endings."""
    with _Span(self, thread, label):
        time.sleep(sleep)
    return label


@app.task(thread_key="thread")
def unthreaded(thread, label):
    """A base=ThreadedTask left out: a plain task, in no thread."""
    return label


@app.task(base=ThreadedTask, bind=True, thread_key="thread", rate_limit="2/s")
def celery_rated(self, thread, label):
    """Celery's own rate_limit="2/s": the worker's token bucket holds its deliveries."""
    with _Span(self, thread, label):
        pass
    return label


@app.task(base=ThreadedTask, bind=True, thread_key="thread", thread_rate_limit="4/s")
def rated(self, thread, label):
    """thread_rate_limit="4/s": its thread's members are claimed at least 250 ms apart.  Keeps
    its claim's time on the gate's clock (its thread's active hash) in claims:<thread>."""
    with _Span(self, thread, label):
        conf = self.app.conf
        gate = redis.Redis.from_url(conf.threads_redis_url)
        claimed = gate.hget(Keys(conf.threads_key_prefix).thread(thread).active, "claimed")
        gate.close()
        history().rpush(f"claims:{thread}", f"{label}|{int(claimed)}")
    return label


@app.task(base=ThreadedTask, bind=True, thread_key="thread", dead_letter=False, max_retries=0)
def boom_quietly(self, thread, label):
    with _Span(self, thread, label):
        raise ValueError(f"{label} exploded")


@app.task(base=ThreadedTask, bind=True, thread_key="thread")
def rejecter(self, thread, label, requeue=False):
    with _Span(self, thread, label):
        pass
    if requeue and self.request.retries == 0 and not history().getset(f"rejected:{label}", 1):
        raise Reject("again", requeue=True)
    if not requeue:
        raise Reject("no thanks", requeue=False)
    return label


@app.task(base=ThreadedTask, bind=True, thread_key="thread")
def ignorer(self, thread, label):
    with _Span(self, thread, label):
        pass
    raise Ignore()


@app.task(base=ThreadedTask, bind=True, thread_key="thread", max_retries=2, default_retry_delay=0.05)
def retried_by_hand(self, thread, label, fail_times=0, when=None):
    """Raises Retry itself (not self.retry()) on its first `fail_times` attempts: `when` as
    Retry's (seconds, or None for default_retry_delay)."""
    with _Span(self, thread, label):
        pass
    if self.request.retries < fail_times:
        raise Retry(
            f"{label} by hand",
            exc=ValueError(label) if when == "exc" else None,
            when=None if when == "exc" else when,
        )
    return label


@app.task(base=ThreadedTask, bind=True, thread_key="thread", soft_time_limit=0.5, max_retries=0)
def soft_limited(self, thread, label):
    with _Span(self, thread, label):
        time.sleep(5)


@app.task(base=ThreadedTask, bind=True, thread_key="thread", time_limit=1, max_retries=0)
def hard_limited(self, thread, label):
    _record(thread, "start", label, self.request.id)
    time.sleep(30)


class OwnRequest(Request):
    """A task's own Request class (``Request = OwnRequest``): notes each request it accepts
    (list own_request:<task id>)."""

    def on_accepted(self, pid, time_accepted):
        history().rpush(f"own_request:{self.id}", "accepted")
        super().on_accepted(pid, time_accepted)


@app.task(
    base=ThreadedTask,
    bind=True,
    thread_key="thread",
    time_limit=1,
    max_retries=1,
    default_retry_delay=0.1,
    Request=OwnRequest,
)
def own_request_limited(self, thread, label):
    """As `hard_limited`, with a Request class of its own and a retry left."""
    _record(thread, "start", label, self.request.id)
    time.sleep(30)


@app.task(base=ThreadedTask, bind=True, thread_key="thread", time_limit=1, max_retries=0)
def stubborn(self, thread, label):
    """Ignores SIGTERM and writes heartbeats (the Redis server's clock, in µs, at
    heartbeat:<thread>) until it is killed; records its pid (list pid:<thread>)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    r = history()
    r.rpush(f"pid:{thread}", os.getpid())
    _record(thread, "start", label, self.request.id)
    beat = r.register_script(
        "local t = redis.call('TIME') redis.call('SET', KEYS[1], t[1] .. string.format('%06d', t[2]))"
    )
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        beat(keys=[f"heartbeat:{thread}"])


@app.task(base=ThreadedTask, bind=True, thread_key="thread", default_retry_delay=-1)
def negative_retry_delay(self, thread, label):
    """Declared with a retry delay the gate cannot store: never enqueued."""
    return label


@app.task(base=ThreadedTask, bind=True, thread_key="thread", default_retry_delay=1e16)
def endless_retry_delay(self, thread, label):
    """Declared with a retry delay of 317 million years, past the gate's 100: never enqueued."""
    return label


@app.task(base=ThreadedTask, bind=True, thread_key="thread", max_retries=-2)
def negative_max_retries(self, thread, label):
    """Declared with a retry count the gate cannot store: never enqueued."""
    return label


@app.task(base=ThreadedTask, bind=True, thread_key="thread", max_retries=1, default_retry_delay=0.1)
def suicide(self, thread, label):
    """Kills its own pool child on the first attempt (WorkerLostError in the main process)."""
    with _Span(self, thread, label):
        if self.request.retries == 0 and not history().getset(f"killed:{label}", 1):
            os.kill(os.getpid(), signal.SIGKILL)
    return label


class RetriesOnFailure(ThreadedTask):
    def on_failure(self, exc, task_id, args, kwargs, einfo):
        self.retry(exc=exc, countdown=0, throw=False)


@app.task(base=RetriesOnFailure, bind=True, thread_key="thread", max_retries=2)
def retried_on_failure(self, thread, label):
    """Fails; its on_failure calls self.retry(), which comes after its death."""
    with _Span(self, thread, label):
        raise ValueError(label)


@app.task(base=ThreadedTask, bind=True, thread_key="thread", max_retries=1, default_retry_delay=0.1)
def doomed(self, thread, label, until=None):
    """Kills its own pool child on every attempt, the first once the key `until` exists."""
    with _Span(self, thread, label):
        _await_key(until if self.request.retries == 0 else None)
        os.kill(os.getpid(), signal.SIGKILL)


@app.task(base=ThreadedTask, bind=True, thread_key="thread")
def where(self, thread, label, sleep=0.0, until=None):
    """Records the pool process it ran in (list pid:<thread>); then waits until the key `until`
    exists (when given; at most 30 s) and sleeps `sleep` seconds."""
    with _Span(self, thread, label):
        history().rpush(f"pid:{thread}", os.getpid())
        _await_key(until)
        time.sleep(sleep)
    return label


@app.task(base=ThreadedTask, bind=True, thread_key="thread", max_retries=0)
def beater(self, thread, label, seconds=30.0, until=None):
    """Runs up to `seconds`, writing a heartbeat (the Redis server's clock) into list
    beats:<thread> every 10 ms; ends early once the key `until` exists."""
    _beat(self, thread, label, seconds, until)
    return label


def _beat(task, thread, label, seconds, until):
    r = history()
    with _Span(task, thread, label):
        end = time.monotonic() + seconds
        while time.monotonic() < end and not (until and r.exists(until)):
            seconds_, micros = r.time()
            r.rpush(f"beats:{thread}", f"{label}|{seconds_ * 1_000_000 + micros}")
            time.sleep(0.01)


@app.task(base=ThreadedTask, bind=True, thread_key="thread", max_retries=0)
def deaf(self, thread, label, seconds=3.0):
    """As `beater`, for `seconds`, ignoring SIGTERM (Celery's default terminate signal)."""
    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        _beat(self, thread, label, seconds, None)
    finally:
        signal.signal(signal.SIGTERM, previous)
    return label


@app.task(base=ThreadedTask, bind=True, thread_key="thread", max_retries=1, default_retry_delay=0.1)
def outlast(self, thread, label, seconds=30.0):
    """Its first attempt beats (list beats:<thread>, as `beater`) for `seconds`; a later attempt
    returns at once.  Each attempt's retries count is appended to list attempts:<thread> when it
    starts, and again with "|ok" when it returns."""
    r = history()
    r.rpush(f"attempts:{thread}", str(self.request.retries))
    with _Span(self, thread, label):
        end = time.monotonic() + (seconds if not self.request.retries else 0.0)
        while time.monotonic() < end:
            seconds_, micros = r.time()
            r.rpush(f"beats:{thread}", f"{label}|{seconds_ * 1_000_000 + micros}")
            time.sleep(0.01)
    r.rpush(f"attempts:{thread}", f"{self.request.retries}|ok")
    return label


def _unpatched_sleep(seconds: float) -> None:
    """``time.sleep`` as it was before gevent patched it: it does not yield to gevent's hub."""
    monkey = sys.modules.get("gevent.monkey")
    if monkey is not None and monkey.is_module_patched("time"):
        monkey.get_original("time", "sleep")(seconds)
    else:
        time.sleep(seconds)


@app.task(base=ThreadedTask, bind=True, thread_key="thread", max_retries=3, default_retry_delay=0.2)
def hog(self, thread, label, seconds=5.0, how="sleep", lead=0.0):
    """Holds its process for `seconds` without yielding to gevent's hub: `how` "sleep" calls the
    unpatched time.sleep (a blocking C call), "spin" loops on the CPU.  First sleeps `lead`
    seconds as usual (yielding)."""
    with _Span(self, thread, label):
        time.sleep(lead)
        if how == "spin":
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                pass
        else:
            _unpatched_sleep(seconds)
    return label


class SlowTail(ThreadedTask):
    """A threaded task whose trace ends slowly: after_return takes `tail` seconds (kwargs)."""

    def after_return(self, status, retval, task_id, args, kwargs, einfo):
        time.sleep(float((kwargs or {}).get("tail", 0.0)))


@app.task(base=SlowTail, bind=True, thread_key="thread", max_retries=3)
def slow_tail(self, thread, label, tail=0.0):
    with _Span(self, thread, label):
        pass
    return label


@app.task(base=ThreadedTask, bind=True)
def free(self, label, sleep=0.0):
    """No thread_key: the thread id comes from apply_async(thread_id=...)."""
    thread = self.request.headers["thread_id"]
    with _Span(self, thread, label):
        time.sleep(sleep)
    return label


@app.task(bind=True)
def plain(self, thread, label, sleep=0.0):
    """A plain Celery task, to compare with."""
    with _Span(self, thread, label):
        time.sleep(sleep)
    return label


def _replacement(how: str, thread: str, label: str, target: str | None) -> object:
    from celery import chain, group

    if how == "same":
        return record.si(thread, f"{label}-r")
    if how == "other":
        return record.si(target, f"{label}-o")
    if how == "plain":
        return plain.si(thread, f"{label}-p")
    if how == "group":
        return group(record.si(thread, f"{label}-g1"), record.si(thread, f"{label}-g2"))
    if how == "chain":
        return chain(record.si(thread, f"{label}-c1"), record.si(thread, f"{label}-c2"))
    raise ValueError(how)


@app.task(base=ThreadedTask, bind=True, thread_key="thread")
def replacer(self, thread, label, how, target=None, until=None, linger=0.3):
    """Replaces itself (self.replace) with the signature `how` names (_replacement), once the key
    `until` exists (when given; at most 30 s), then keeps running `linger` seconds."""
    with _Span(self, thread, label):
        deadline = time.monotonic() + 30
        while until and not history().exists(until) and time.monotonic() < deadline:
            time.sleep(0.01)
        try:
            return self.replace(_replacement(how, thread, label, target))
        finally:
            time.sleep(linger)


@app.task(base=ThreadedTask, bind=True, thread_key="thread")
def caller(self, thread, label, callee_thread=None, linger=0.3):
    """Calls `record` (thread `callee_thread`, default its own) with its own request's headers,
    as code propagating headers does, then keeps running `linger` seconds."""
    with _Span(self, thread, label):
        record.apply_async((callee_thread or thread, f"{label}-called"), headers=self.request.headers)
        free.apply_async((f"{label}-free",), headers=self.request.headers)
        time.sleep(linger)
    return label


from celery_threads.signals import member_dead  # noqa: E402


@member_dead.connect
def _remember_death(sender=None, task_id=None, thread_id=None, exception=None, retries=None, **kwargs):
    history().rpush(f"dead_signal:{thread_id}", f"{task_id}|{exception}")
    history().rpush(f"dead_retries:{task_id}", str(retries))


@app.task(base=ThreadedTask, bind=True, thread_key="thread", default_retry_delay=60)
def retry_slow_to_store(self, thread, label):
    """Retries (in 60 s); the pool process stores its RETRY only once ``say:<thread>`` exists
    (at most 30 s): a result backend slow to answer, after the member re-entered its thread."""
    with _Span(self, thread, label):
        pass
    raise self.retry(exc=RuntimeError(f"{label} retries"))


@worker_process_init.connect
def _slow_retry_store(**kwargs):
    backend = app.backend
    mark_as_retry = backend.mark_as_retry

    def slow(task_id, *args, request=None, **kw):
        if getattr(request, "task", None) == retry_slow_to_store.name:
            _await_key(f"say:{request.args[0]}")
        return mark_as_retry(task_id, *args, request=request, **kw)

    backend.mark_as_retry = slow


@task_retry.connect
def _remember_retry(sender=None, request=None, reason=None, **kwargs):
    history().rpush(f"retry_signal:{getattr(request, 'id', None)}", type(reason).__name__)


@task_failure.connect
def _remember_failure(sender=None, task_id=None, exception=None, **kwargs):
    history().rpush(f"failure_signal:{task_id}", type(exception).__name__)


@app.task(
    base=ThreadedTask,
    bind=True,
    thread_key="thread",
    acks_late=True,
    reject_on_worker_lost=True,
    max_retries=0,
)
def lost_rejected(self, thread, label, seconds=30.0):
    """acks_late and reject_on_worker_lost, no retries: records its pool process (list
    pid:<thread>), then beats (list beats:<thread>, as `beater`) for `seconds`, to be killed."""
    history().rpush(f"pid:{thread}", os.getpid())
    _beat(self, thread, label, seconds, None)
    return label


@app.task(
    base=ThreadedTask,
    bind=True,
    thread_key="thread",
    acks_late=True,
    reject_on_worker_lost=True,
    max_retries=1,
    default_retry_delay=0.1,
)
def lost_rejected_retried(self, thread, label, seconds=30.0, until=None):
    """As `lost_rejected` with a retry left: its first attempt records its pool process and beats
    for `seconds`; a later one waits until the key `until` exists (when given; at most 30 s) and
    returns.  Each attempt's retries count goes to list attempts:<thread> when it starts, and
    again with "|ok" when it returns."""
    r = history()
    r.rpush(f"attempts:{thread}", str(self.request.retries))
    if not self.request.retries:
        r.rpush(f"pid:{thread}", os.getpid())
        _beat(self, thread, label, seconds, None)
    else:
        with _Span(self, thread, label):
            _await_key(until)
    r.rpush(f"attempts:{thread}", f"{self.request.retries}|ok")
    return label


@app.task
def errback_log(task_id):
    """A plain link_error callback (called with the failed task's id): appends its pool process to
    list errbacks:<task_id>."""
    history().rpush(f"errbacks:{task_id}", os.getpid())
