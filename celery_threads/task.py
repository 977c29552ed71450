"""``ThreadedTask``: the Celery task base class whose publications go through the gate."""
from __future__ import annotations

import inspect
import logging
import math
import time
from contextlib import contextmanager
from datetime import datetime, timezone
from typing import Any, Callable, Iterator, NamedTuple, Optional, Union

import redis

from celery import Task
from celery.exceptions import Ignore, Reject, Retry
from celery.utils import uuid
from celery.utils.saferepr import saferepr

from . import handoff
from .errors import ConfigurationError, GateUnavailable, InvalidThreadId
from .gate import ALREADY_CLAIMED, CLAIMED, Outcome
from .publish import OUR_HEADERS, THREAD_HEADER, TOKEN_HEADER, CapturingProducer
from .runtime import get_runtime

logger = logging.getLogger(__name__)

MAX_THREAD_ID_BYTES = 1024

ThreadKey = Union[str, Callable[[tuple[Any, ...], dict[str, Any]], Any], None]


def normalize_thread_id(value: Any) -> str:
    """A valid thread id as a string, or :class:`InvalidThreadId`."""
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise InvalidThreadId(
            f"thread id {value!r} is a {type(value).__name__}: use a non-empty str or an int")
    text = str(value)
    if not text:
        raise InvalidThreadId("thread id is empty: use a non-empty str or an int")
    if len(text.encode("utf-8")) > MAX_THREAD_ID_BYTES:
        raise InvalidThreadId(
            f"thread id is {len(text.encode('utf-8'))} bytes long; the limit is "
            f"{MAX_THREAD_ID_BYTES} bytes")
    return text


def retry_settings(task: Any) -> tuple[Optional[int], int]:
    """A threaded task's ``(max_retries, default_retry_delay in ms)`` as the gate stores them with
    each member, or :class:`ConfigurationError` when either cannot be: the gate keeps them in the
    member's record, which a negative delay or a fractional or negative retry count would make
    unreadable to every later transition of its thread."""
    max_retries = task.max_retries
    if max_retries is not None and (isinstance(max_retries, bool)
                                    or not isinstance(max_retries, int) or max_retries < 0):
        raise ConfigurationError(
            f"task {task.name} has max_retries={max_retries!r}: a threaded task needs an int of 0 "
            "or more, or None for unlimited retries. Fix the task's max_retries; nothing was "
            "stored or sent")
    delay = task.default_retry_delay
    if delay is None:
        delay = 0
    if (isinstance(delay, bool) or not isinstance(delay, (int, float)) or not math.isfinite(delay)
            or delay < 0):
        raise ConfigurationError(
            f"task {task.name} has default_retry_delay={delay!r}: a threaded task needs a number "
            "of seconds, 0 or more. Fix the task's default_retry_delay; nothing was stored or "
            "sent")
    return max_retries, int(float(delay) * 1000)


def _eta_ms(eta: Any) -> int:
    if isinstance(eta, str):
        eta = datetime.fromisoformat(eta)
    if eta.tzinfo is None:
        eta = eta.replace(tzinfo=timezone.utc)
    return int(eta.timestamp() * 1000)


class ThreadedTask(Task):
    """A task whose calls join a thread: at most one member of a thread runs at a time.

    Give the thread with ``apply_async(..., thread_id=...)`` or declare ``thread_key`` (an argument
    name or a callable ``(args, kwargs) -> id``).  ``dead_letter = False`` drops members that die
    instead of keeping them in the dead-letter store.
    """

    thread_key: ThreadKey = None
    dead_letter: bool = True

    Strategy = "celery_threads.worker:threaded_strategy"
    Request = "celery_threads.worker:ThreadedRequest"

    # Celery's own worker-lost retry would publish from the main process; the gate does it instead.
    retry_on_worker_lost = False

    @classmethod
    def on_bound(cls, app: Any) -> None:
        from .install import install

        install(app)

    # -- publishing ---------------------------------------------------------------------------
    def resolve_thread_id(self, args: Any, kwargs: Any, explicit: Any = None) -> str:
        if explicit is not None:
            return normalize_thread_id(explicit)
        key = self.thread_key
        args, kwargs = tuple(args or ()), dict(kwargs or {})
        if callable(key):
            return normalize_thread_id(key(args, kwargs))
        if isinstance(key, str):
            if key in kwargs:
                return normalize_thread_id(kwargs[key])
            try:
                bound = _signature(self.run).bind_partial(*args, **kwargs)
            except TypeError:
                bound = None
            if bound is not None and key in bound.arguments:
                return normalize_thread_id(bound.arguments[key])
            raise InvalidThreadId(
                f"task {self.name} takes its thread id from argument {key!r}, which this call "
                "does not pass")
        raise InvalidThreadId(
            f"task {self.name} needs a thread id: pass apply_async(..., thread_id=...) or declare "
            "the task with thread_key='<argument name>'")

    def apply_async(self, args: Any = None, kwargs: Any = None, task_id: Optional[str] = None,
                    producer: Any = None, link: Any = None, link_error: Any = None,
                    shadow: Any = None, **options: Any) -> Any:
        explicit = options.pop("thread_id", None)
        app = self._get_app()
        if app.conf.task_always_eager:
            return super().apply_async(args, kwargs, task_id=task_id, producer=producer,
                                       link=link, link_error=link_error, shadow=shadow, **options)
        headers = dict(options.pop("headers", None) or {})
        token = headers.get(TOKEN_HEADER) or None
        if explicit is None:
            explicit = headers.get(THREAD_HEADER)
        for key in OUR_HEADERS:
            headers.pop(key, None)
        thread_id = self.resolve_thread_id(args, kwargs, explicit)
        max_retries, retry_delay_ms = retry_settings(self) if token is None else (None, 0)
        if options.get("kwargsrepr") is None:
            # Flower shows kwargsrepr: the thread id is visible on every member there.
            options["kwargsrepr"] = f"{saferepr(kwargs or {}, 1024)} thread={thread_id!r}"
        countdown = options.pop("countdown", None)
        eta = options.pop("eta", None)
        task_id = task_id or uuid()
        runtime = get_runtime(app)
        with app.producer_or_acquire(producer) as real, gate_errors(runtime, task_id):
            capture = CapturingProducer(real)
            result = super().apply_async(args, kwargs, task_id=task_id, producer=capture,
                                         link=link, link_error=link_error, shadow=shadow,
                                         headers=headers, **options)
            assert capture.envelope is not None, "Celery published no task message"
            at_ms = _eta_ms(eta) if eta is not None else None
            delay_ms = int(float(countdown or 0) * 1000)
            release = None
            if token is not None:
                reentry = Reentry(int(options.get("retries") or 0), delay_ms, at_ms,
                                  capture.envelope)
                running = _running.get((task_id, token))
                if running is not None:
                    # self.retry() inside the running member: it re-enters once its body has
                    # unwound (ThreadedTask.__call__), so that nothing the body still runs on
                    # the way out (finally blocks, context managers) overlaps the next member;
                    # its schedule is fixed now, on the Redis server's clock.
                    running.reentry = reentry._replace(delay_ms=0, at_ms=at_ms or (
                        running.server_now_ms() + delay_ms))
                else:
                    release = self._reenter(runtime, thread_id, task_id, token,
                                            reentry).release
            else:
                outcome = runtime.gate.enqueue(
                    thread_id, task_id, capture.envelope, delay_ms=delay_ms, at_ms=at_ms,
                    max_retries=max_retries, retry_delay_ms=retry_delay_ms)
                if not outcome.done:
                    logger.info("celery-threads: %s[%s] is already a member of thread %s, or "
                                "ended less than a minute ago; not enqueued twice", self.name,
                                task_id, thread_id)
                release = outcome.release
            capture.flush()
            # The caller's producer when given; else the runtime's kept one, which skips the
            # declare and retry wrapping Celery's way repeats on every publish.
            own = release is not None and release.task_id == task_id and token is None
            runtime.publish(release, producer, parts=capture.parts if own else None)
        return result

    def _reenter(self, runtime: Any, thread_id: str, task_id: str, token: str,
                 reentry: "Reentry") -> Outcome:
        """The member (task, token) goes back to waiting with a retry's new message; returns the
        gate's outcome (its release, of the next member, for the caller to publish)."""
        outcome: Outcome = runtime.gate.requeue(
            thread_id, task_id, token, retries=reentry.retries, delay_ms=reentry.delay_ms,
            at_ms=reentry.at_ms, envelope=reentry.envelope)
        if not outcome.done:
            logger.warning(
                "celery-threads: retry of %s[%s] ignored: it no longer holds thread %s "
                "(deleted, or its lease lapsed)", self.name, task_id, thread_id)
        return outcome

    # -- running ------------------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        request = self.request
        headers = request.headers or {}
        token = headers.get(TOKEN_HEADER)
        if not token or request.called_directly or request.is_eager:
            return super().__call__(*args, **kwargs)
        thread_id = headers[THREAD_HEADER]
        task_id = request.id
        runtime = get_runtime(self._get_app())
        gate = runtime.gate
        hostname = request.hostname or ""
        claimed_ms = handoff.take_claim(task_id, token)
        if claimed_ms is not None:      # run by handoff: its predecessor's finish claimed it
            status = CLAIMED
        else:
            status, claimed_ms = gate.claim_at(thread_id, task_id, token,
                                               runtime.config.keepalive_ms, hostname)
        if status != CLAIMED:
            # Another delivery of this release started first (or it went stale in between).
            logger.info("celery-threads: not running %s[%s] of thread %s: %s", self.name, task_id,
                        thread_id, "claimed by another delivery" if status == ALREADY_CLAIMED
                        else "stale release")
            raise Ignore()
        retries = int(request.retries or 0)
        key = (task_id, token)
        running = _running[key] = Running(claimed_ms, time.monotonic())
        try:
            result = super().__call__(*args, **kwargs)
        except BaseException as exc:
            _running.pop(key, None)
            _record_end(runtime, lambda: self._ended(runtime, thread_id, task_id, token, retries,
                                                     exc, running.reentry))
            raise
        _running.pop(key, None)
        _record_end(runtime, lambda: self._ended(runtime, thread_id, task_id, token, retries,
                                                 None, running.reentry))
        return result

    def _ended(self, runtime: Any, thread_id: str, task_id: str, token: str, retries: int,
               exc: Optional[BaseException], reentry: Optional["Reentry"]) -> None:
        """Apply the member's ending to the gate, once its body has fully unwound."""
        gate = runtime.gate
        if reentry is not None:
            # self.retry() was called (also with throw=False): it wins however the body ended.
            runtime.publish(self._reenter(runtime, thread_id, task_id, token, reentry).release)
        elif exc is None or isinstance(exc, Ignore):
            handoff.finish(runtime, self, thread_id, task_id, token)
        elif isinstance(exc, Retry):
            # Retry raised by hand, without self.retry() publishing: re-enter now.
            runtime.apply(gate.requeue(thread_id, task_id, token, retries=retries + 1))
        elif isinstance(exc, Reject) and exc.requeue:
            runtime.apply(gate.requeue(thread_id, task_id, token, retries=retries))
        elif isinstance(exc, Reject):
            runtime.kill(thread_id, task_id, token, exc=exc, retries=retries,
                         keep=self.dead_letter, reason=f"Rejected: {exc.reason!r}")
        elif isinstance(exc, Exception):
            runtime.kill(thread_id, task_id, token, exc=exc, retries=retries,
                         keep=self.dead_letter)
        # Anything else (SystemExit, ...): the process is going away; the lease lapses and the
        # gate counts a failed attempt.


_signatures: dict[tuple[Any, bool], inspect.Signature] = {}


def _signature(run: Any) -> inspect.Signature:
    """``inspect.signature`` of a task's ``run``, computed once per function (about 20 µs)."""
    key = (getattr(run, "__func__", run), hasattr(run, "__self__"))
    found = _signatures.get(key)
    if found is None:
        found = _signatures[key] = inspect.signature(run)
    return found


def _record_end(runtime: Any, end: Callable[[], Any]) -> None:
    """Apply a member's ending to the gate.  The client already rides out a short Redis outage;
    past that the task's own outcome must not change: its lease lapses and the gate treats the
    attempt as failed (it runs again if retries remain)."""
    try:
        end()
    except redis.RedisError:
        logger.exception("celery-threads: could not record the end of a member in the gate at "
                         "%s; its lease will lapse and the attempt will count as failed",
                         runtime.config.redis_url)


@contextmanager
def gate_errors(runtime: Any, task_id: str) -> Iterator[None]:
    try:
        yield
    except redis.RedisError as exc:
        raise GateUnavailable(
            f"could not reach the gate's Redis at {runtime.config.redis_url} "
            f"(threads_redis_url) to publish task {task_id}: {exc}. Nothing was sent to the "
            "broker. If the connection broke after Redis received the call, the member may be "
            "stored whole and will run; calling again with the same task_id is safe either way "
            "(a member is never stored twice, nor again within a minute of its end)."
        ) from exc


class Reentry(NamedTuple):
    """A retry's re-entry into the thread, held until the member's body has unwound."""

    retries: int
    delay_ms: int
    at_ms: Optional[int]
    envelope: Optional[bytes]


class Running:
    """A member running in this process: when it was claimed (the Redis server's clock, and this
    process's monotonic clock at the reply), and its re-entry once self.retry() was called."""

    __slots__ = ("claimed_ms", "claimed_mono", "reentry")

    def __init__(self, claimed_ms: int, claimed_mono: float) -> None:
        self.claimed_ms = claimed_ms
        self.claimed_mono = claimed_mono
        self.reentry: Optional[Reentry] = None

    def server_now_ms(self) -> int:
        """The Redis server's time now, as the claim's plus the time elapsed here since."""
        return self.claimed_ms + int((time.monotonic() - self.claimed_mono) * 1000)


# (task id, token) of each member running in this process (a dict: a thread pool runs several).
_running: dict[tuple[str, str], Running] = {}
