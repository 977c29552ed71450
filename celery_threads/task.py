"""``ThreadedTask``: the Celery task base class whose publications go through the gate."""
from __future__ import annotations

import inspect
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any, Callable, NamedTuple, Optional, Union

import redis
from celery import Task
from celery.exceptions import Ignore, Reject, Retry
from celery.utils import uuid
from celery.utils.saferepr import saferepr

from . import policies
from .config import ThreadsConfig, read_config
from .errors import ConfigurationError, GateUnavailable, InvalidThreadId, NotReplicated, ThreadFull
from .gate import DELETED, Claim, Enqueue, Gate, Outcome, deadline
from .install import install
from .protocol import (
    OUR_HEADERS,
    SUPERSEDE_OPTIONS,
    THREAD_HEADER,
    TOKEN_HEADER,
    eta_ms,
    normalize_thread_id,
    retry_settings,
    supersede_policy,
)
from .publish import CapturingProducer
from .runtime import Runtime, get_runtime
from .worker import handoff
from .worker.lease import Keeper, Lease, new_claimant, stoppable
from .worker.lease import keeper as lease_keeper

logger = logging.getLogger(__name__)

ThreadKey = Union[str, Callable[[tuple[Any, ...], dict[str, Any]], Any], None]


class ThreadedTask(Task):
    """A task whose calls join a thread: at most one member of a thread runs at a time.

    Give the thread with ``apply_async(..., thread_id=...)`` or declare ``thread_key`` (an argument
    name or a callable ``(args, kwargs) -> id``).  ``dead_letter = False`` drops members that die
    instead of keeping them in the dead-letter store.

    Policies (docs/policies.md), each also an ``apply_async`` option of the same name for one
    call: ``on_death = "hold"`` pauses the thread when a member dies; ``max_waiting = N`` refuses
    a call (:class:`~celery_threads.ThreadFull`) that finds N members waiting in its thread;
    ``thread_rate_limit = "10/s"`` spaces the releases of the thread's members;
    ``coalesce = "latest"``: a call supersedes its task's call in its
    thread that waits and has not run yet (it ends ``REVOKED``) and takes its place;
    ``debounce = S``: as ``coalesce``, and the call runs no earlier than S seconds after it
    reached the gate, so a burst runs once, S after its last call; ``debounce_max = M``: a burst
    that goes on runs no later than M seconds after its first call.
    """

    thread_key: ThreadKey = None
    dead_letter: bool = True
    on_death: Optional[str] = None          # None: "advance"
    max_waiting: Optional[int] = None
    thread_rate_limit: Optional[Union[str, int, float]] = None
    coalesce: Optional[str] = None
    debounce: Optional[float] = None
    debounce_max: Optional[float] = None

    Strategy = "celery_threads.worker.step:threaded_strategy"
    Request = "celery_threads.worker.step:ThreadedRequest"
    __celery_threads__ = True   # protocol.is_threaded: how lower layers recognise it

    # Celery's own worker-lost retry would publish from the main process; the gate does it instead.
    retry_on_worker_lost = False

    @classmethod
    def on_bound(cls, app: Any) -> None:
        _check_thread_key(cls)
        policies.check_task(cls)
        supersede_policy(cls.name, cls.coalesce, cls.debounce, cls.debounce_max)
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
        """Store the call as a member of its thread; it is published when the thread releases it.

        Calls from inside a running member (docs/internals.md, "Calls from inside a member"):
        Celery's ``self.retry()`` (it names the member's task id and passes its request's
        headers) re-enters the member once its body has unwound.  ``self.replace(sig)`` gives
        ``sig`` the member's task id; a threaded replacement is applied once the body has unwound
        as well: in the member's thread it takes the member's place (its arrival order and
        scheduled_at, retries 0), in another thread it joins as a new arrival once the member has
        ended.  Any other call carrying a member's headers (``headers=self.request.headers``) is a
        new member: the internal headers are dropped, and the copied ``thread_id`` counts only
        for a task without a ``thread_key``.
        """
        explicit = options.pop("thread_id", None)
        # Never seen by Celery (in eager mode too): the gate applies them.
        coalesce, debounce, debounce_max = (
            options.pop(option, getattr(self, option)) for option in SUPERSEDE_OPTIONS)
        policy = policies.resolve(self, options)
        app = self._get_app()
        if app.conf.task_always_eager:
            return super().apply_async(args, kwargs, task_id=task_id, producer=producer,
                                       link=link, link_error=link_error, shadow=shadow, **options)
        headers = dict(options.pop("headers", None) or {})
        token = headers.get(TOKEN_HEADER) or None
        header_thread = headers.get(THREAD_HEADER)
        for key in OUR_HEADERS:
            headers.pop(key, None)
        nesting = int(options.get("replaced_task_nesting") or 0)
        member = _current_member(app)   # called from inside a running member (a worker's call)
        current = member if token is not None or nesting else None
        if token is not None and not (task_id is not None and (
                (task_id, token) in _running or (task_id, token) == current)):
            # Not Celery's retry of the member holding the token (which names its task id, with
            # its request's headers): headers copied from a member's request into a new call
            # (headers=self.request.headers).  Their thread id is the gate's, not the caller's
            # choice, so it only counts for a task without a thread_key.
            token = None
            if self.thread_key is not None:
                header_thread = None
        if explicit is None:
            explicit = header_thread
        thread_id = self.resolve_thread_id(args, kwargs, explicit)
        # self.replace(sig) inside the running member: sig took the member's task id.
        replaced = (_running.get(current) if token is None and nesting and current is not None
                    and current[0] == task_id else None)
        max_retries, retry_delay_ms = retry_settings(self) if token is None else (None, 0)
        # A retry or a replacement is not a new call: it supersedes nothing.
        supersede = (supersede_policy(self.name, coalesce, debounce, debounce_max)
                     if token is None and replaced is None else None)
        if options.get("kwargsrepr") is None:
            # Flower shows kwargsrepr: the thread id is visible on every member there.
            options["kwargsrepr"] = f"{saferepr(kwargs or {}, 1024)} thread={thread_id!r}"
        countdown = options.pop("countdown", None)
        eta = options.pop("eta", None)
        task_id = task_id or uuid()
        config = read_config(app)
        # A producer's call waits for the gate threads_publish_timeout in all; a member's calls
        # ride out outages as the rest of its worker does (its lease covers the wait).
        bound = (nullcontext(None) if member is not None
                 else deadline.within(config.publish_timeout))
        with app.producer_or_acquire(producer) as real, bound as limit, \
                gate_errors(config, task_id, limit):
            runtime = get_runtime(app)
            capture = CapturingProducer(real)
            # countdown and eta reach Celery only for its task-sent event (Flower shows when the
            # member is due); the stored message leaves them out, and the gate schedules it.
            result = super().apply_async(args, kwargs, task_id=task_id, producer=capture,
                                         link=link, link_error=link_error, shadow=shadow,
                                         headers=headers, countdown=countdown, eta=eta, **options)
            assert capture.envelope is not None, "Celery published no task message"
            at_ms = eta_ms(eta) if eta is not None else None
            delay_ms = int(float(countdown or 0) * 1000)
            release = None
            added = False
            superseded: list[str] = []
            if replaced is not None:
                # Applied once the member's body has unwound (as a retry's re-entry), so that the
                # task id is never a member twice and at most one member of a thread runs.
                replaced.reentry = Reentry(0, 0, at_ms if at_ms is not None else (
                    replaced.server_now_ms(runtime.gate) + delay_ms if delay_ms else None), capture.envelope,
                    Replacement(thread_id, nesting, max_retries, retry_delay_ms, policy.text))
            elif token is not None:
                reentry = Reentry(int(options.get("retries") or 0), delay_ms, at_ms,
                                  capture.envelope)
                running = _running.get((task_id, token))
                if running is not None:
                    # self.retry() inside the running member: it re-enters once its body has
                    # unwound (ThreadedTask.__call__), so that nothing the body still runs on
                    # the way out (finally blocks, context managers) overlaps the next member;
                    # its schedule is fixed now, on the Redis server's clock.
                    running.reentry = reentry._replace(delay_ms=0, at_ms=at_ms or (
                        running.server_now_ms(runtime.gate) + delay_ms))
                else:
                    release = self._reenter(runtime, thread_id, task_id, token,
                                            reentry).release
            else:
                outcome = runtime.gate.enqueue(
                    thread_id, task_id, capture.envelope, delay_ms=delay_ms, at_ms=at_ms,
                    max_retries=max_retries, retry_delay_ms=retry_delay_ms, replaced=nesting,
                    policy=policy.text, max_waiting=policy.max_waiting,
                    coalesce=self.name if supersede is not None else None,
                    debounce_ms=supersede[0] if supersede else 0,
                    debounce_max_ms=supersede[1] if supersede else 0)
                if outcome.status == Enqueue.FULL:
                    # Nothing stored; leaving here also drops the held task-sent event.
                    raise ThreadFull(
                        f"thread {thread_id!r} already has {policy.max_waiting} waiting members "
                        f"(max_waiting of {self.name}): {task_id} was not stored nor sent; call "
                        "again later", thread_id, task_id)
                superseded = outcome.superseded
                if not outcome.done:
                    logger.info("celery-threads: %s[%s] is already a member of thread %s, or "
                                "ended less than 30 s ago; not enqueued twice", self.name,
                                task_id, thread_id)
                release, added = outcome.release, outcome.done
            capture.flush()
            # The caller's producer when given; else the runtime's kept one, which skips the
            # declare and retry wrapping Celery's way repeats on every publish.
            # Not when the member was there already: a release of it (an enqueue replayed after
            # its reply was lost) publishes the message stored then, not this call's.
            own = release is not None and release.task_id == task_id and added
            runtime.publish(release, producer, parts=capture.parts if own else None)
            if superseded:
                runtime.revoke_superseded(thread_id, superseded)
        return result

    def _reenter(self, runtime: Runtime, thread_id: str, task_id: str, token: str,
                 reentry: Reentry, caller: Optional[str] = None) -> Outcome:
        """The member (task, token) goes back to waiting with a retry's new message; returns the
        gate's outcome (its release, of the next member, for the caller to publish).  A
        replacement (``self.replace``) takes the member's place in its thread, or ends it and
        joins its own thread."""
        replacement = reentry.replacement
        if replacement is not None and replacement.thread_id != thread_id:
            return self._replace_elsewhere(runtime, thread_id, task_id, token, reentry,
                                           replacement, caller)
        if replacement is not None:
            outcome: Outcome = runtime.gate.replace(
                thread_id, task_id, token, reentry.envelope or b"", at_ms=reentry.at_ms,
                max_retries=replacement.max_retries, retry_delay_ms=replacement.retry_delay_ms,
                caller=caller)
            if not outcome.done:
                logger.warning("celery-threads: replacement of %s[%s] dropped: the member no "
                               "longer holds thread %s (deleted, or its lease lapsed)",
                               self.name, task_id, thread_id)
            return outcome
        outcome = runtime.gate.requeue(
            thread_id, task_id, token, retries=reentry.retries, delay_ms=reentry.delay_ms,
            at_ms=reentry.at_ms, envelope=reentry.envelope or b"", caller=caller)
        if not outcome.done:
            logger.warning(
                "celery-threads: retry of %s[%s] ignored: it no longer holds thread %s "
                "(deleted, or its lease lapsed)", self.name, task_id, thread_id)
        return outcome

    def _replace_elsewhere(self, runtime: Runtime, thread_id: str, task_id: str, token: str,
                           reentry: Reentry, replacement: Replacement,
                           caller: Optional[str] = None) -> Outcome:
        """The member ends, then its replacement joins the replacement's own thread as a new
        arrival under the same task id; returns that enqueue's outcome."""
        finished: Outcome = runtime.gate.finish(thread_id, task_id, token, caller=caller)
        if finished.info == DELETED:    # deleted while it ran: no replacement joins
            return finished             # (the caller publishes its successor's release)
        if not finished.done:
            logger.warning("celery-threads: replacement of %s[%s] dropped: the member no longer "
                           "holds thread %s (deleted, or its lease lapsed)", self.name, task_id,
                           thread_id)
            return finished
        runtime.publish(finished.release)
        outcome: Outcome = runtime.gate.enqueue(
            replacement.thread_id, task_id, reentry.envelope or b"", at_ms=reentry.at_ms,
            max_retries=replacement.max_retries, retry_delay_ms=replacement.retry_delay_ms,
            replaced=replacement.nesting, policy=replacement.policy)
        if not outcome.done:
            logger.warning("celery-threads: replacement %s of %s could not join thread %s: that "
                           "task id is a member there already", task_id, self.name,
                           replacement.thread_id)
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
        hostname = request.hostname or ""
        runtime = get_runtime(self._get_app())
        keeper = lease_keeper(runtime)
        claimed = handoff.take_claim(task_id, token)
        if claimed is None:     # else run by handoff: its predecessor's finish claimed it
            claimed = self._claim(runtime, keeper, thread_id, task_id, token, hostname)
        claimed_ms, lease = claimed
        try:
            retries = int(request.retries or 0)
            key = (task_id, token)
            with keeper.running(lease) as may_run:
                if not may_run:
                    logger.warning("celery-threads: not running %s[%s] of thread %s: its lease "
                                   "could not be confirmed with the gate", self.name, task_id,
                                   thread_id)
                    raise Ignore()
                running = _running[key] = Running(claimed_ms, lease.sent)
                failure: Optional[BaseException] = None
                try:
                    result = super().__call__(*args, **kwargs)
                except BaseException as exc:
                    failure = exc
                finally:
                    _running.pop(key, None)
            # The member's code has returned (its lease's end is no longer watched): its ending.
            ending = handoff.Ending(lease.claimant, new_claimant(hostname))
            deleted = _record_end(runtime, lease, lambda: self._ended(
                runtime, thread_id, task_id, token, retries, failure, running.reentry, ending))
            if deleted is None:
                # Its ending never reached the gate while the lease held: the gate counts this
                # attempt as failed and runs the member again, whose outcome is the member's.
                # Celery stores nothing of this one (what it stored last, STARTED or RETRY,
                # stays until then).
                raise Ignore()
            if deleted and not isinstance(failure, (SystemExit, KeyboardInterrupt)):
                # Deleted while it ran (Threads.delete): it ends REVOKED, whatever its body did,
                # and the tracer stores nothing over that.
                logger.info("celery-threads: %s[%s] of thread %s was deleted while it ran; "
                            "revoked", self.name, task_id, thread_id)
                runtime.mark_revoked(task_id)
                raise Ignore()
            if failure is not None:
                raise failure
            return result
        finally:
            keeper.drop(lease)

    def _claim(self, runtime: Runtime, keeper: Keeper, thread_id: str, task_id: str, token: str,
               hostname: str) -> tuple[int, Lease]:
        """Claim the member for this delivery: the claim's time (the Redis server's clock, ms)
        and its lease; :class:`Ignore` when another delivery has it, or its release is stale."""
        claimant = new_claimant(hostname)
        sent = time.monotonic()
        try:
            status, claimed_ms = runtime.gate.claim_with_time(
                thread_id, task_id, token, runtime.config.keepalive_ms, hostname, claimant,
                stoppable=stoppable())
        except redis.RedisError as exc:
            logger.warning("celery-threads: not running %s[%s] of thread %s: the gate at %s did "
                           "not answer its claim (%s); the gate hands it out again once its "
                           "release or lease lapses", self.name, task_id, thread_id,
                           runtime.config.redis_url, exc)
            raise Ignore() from exc
        if status != Claim.CLAIMED:
            # Another delivery of this release started first (or it went stale in between).
            logger.info("celery-threads: not running %s[%s] of thread %s: %s", self.name, task_id,
                        thread_id, "claimed by another delivery" if status == Claim.ALREADY_CLAIMED
                        else "stale release")
            raise Ignore()
        return claimed_ms, keeper.lease(thread_id, task_id, token, claimant, sent)

    def _ended(self, runtime: Runtime, thread_id: str, task_id: str, token: str, retries: int,
               exc: Optional[BaseException], reentry: Optional[Reentry],
               ending: handoff.Ending) -> bool:
        """Apply the member's ending to the gate, once its body has fully unwound.  Called again
        with the same arguments when the gate did not answer (see :func:`_record_end`).  Returns
        whether the gate ended it as deleted (it was deleted while it ran: no retry, no death)."""
        gate = runtime.gate
        outcome: Optional[Outcome] = None
        if reentry is not None:
            # self.retry() was called (also with throw=False): it wins however the body ended.
            outcome = self._reenter(runtime, thread_id, task_id, token, reentry, ending.caller)
            runtime.publish(outcome.release)
        elif exc is None or isinstance(exc, Ignore):
            return handoff.finish(runtime, self, thread_id, task_id, token, ending)
        elif isinstance(exc, Retry):
            # Retry raised by hand, without self.retry() publishing: re-enter now.
            outcome = runtime.apply(gate.requeue(thread_id, task_id, token, retries=retries + 1,
                                                 caller=ending.caller))
        elif isinstance(exc, Reject) and exc.requeue:
            outcome = runtime.apply(gate.requeue(thread_id, task_id, token, retries=retries,
                                                 caller=ending.caller))
        elif isinstance(exc, Reject):
            outcome = runtime.kill(thread_id, task_id, token, exc=exc, retries=retries,
                                   keep=self.dead_letter, reason=f"Rejected: {exc.reason!r}",
                                   caller=ending.caller, fenced=True)
        elif isinstance(exc, Exception):
            outcome = runtime.kill(thread_id, task_id, token, exc=exc, retries=retries,
                                   keep=self.dead_letter, caller=ending.caller, fenced=True)
        # Anything else (SystemExit, ...): the process is going away; the lease lapses and the
        # gate counts a failed attempt.
        return outcome is not None and outcome.info == DELETED


_signatures: dict[tuple[Any, bool], inspect.Signature] = {}


def _check_thread_key(cls: Any) -> None:
    """A ``thread_key`` naming no argument of the task is a typo: refused where the task is
    declared, not at its first call."""
    key, run = cls.thread_key, cls.__dict__.get("run")
    if not isinstance(key, str) or run is None:
        return
    try:
        parameters = inspect.signature(getattr(run, "__func__", run)).parameters
    except (TypeError, ValueError):
        return
    if key in parameters or any(p.kind == p.VAR_KEYWORD for p in parameters.values()):
        return
    raise ConfigurationError(
        f"task {cls.name} declares thread_key={key!r}, but it takes no argument of that name "
        f"(its arguments: {', '.join(parameters) or 'none'}): name one of them, or give a "
        "callable (args, kwargs) -> thread id")


def _signature(run: Any) -> inspect.Signature:
    """``inspect.signature`` of a task's ``run``, computed once per function (about 20 µs)."""
    key = (getattr(run, "__func__", run), hasattr(run, "__self__"))
    found = _signatures.get(key)
    if found is None:
        found = _signatures[key] = inspect.signature(run)
    return found


def _record_end(runtime: Runtime, lease: Lease, end: Callable[[], bool]) -> Optional[bool]:
    """Apply a member's ending to the gate.  While the gate does not answer, the ending is kept
    and tried again for as long as the member's lease can hold (the keeper goes on renewing it),
    so a member that ended is not run again because its ending came late: every transition gives
    the same outcome when a call whose reply was lost is sent again.  No attempt waits past the
    lease: from then on the gate counts the attempt as failed (it runs again if retries remain).
    Returns what ``end`` returned, or ``None`` when it could not be applied while the lease
    held.  An ending that may have reached the gate all the same (a call went out and its reply
    never came) returns ``False``: the gate may hold it, and the member's result is stored as
    usual."""
    warned = False
    maybe_sent = False
    while True:
        # Never past the lease: once it has lapsed the gate has counted the attempt as failed
        # (and may have run it again), and a late ending must not count it a second time.
        with deadline.within(max(lease.remaining(), 0.0), bound="the member's lease") as limit:
            try:
                return end()
            except redis.RedisError as exc:
                error = exc
                maybe_sent = maybe_sent or limit.unanswered
        remaining = lease.remaining()
        if lease.lost or remaining <= 0:
            logger.error("celery-threads: could not record the end of %s of thread %s in the "
                         "gate at %s (%s) while its lease held; the gate counts the attempt as "
                         "failed%s", lease.task_id, lease.thread_id, runtime.config.redis_url,
                         error, " (unless a call that went out reached it)" if maybe_sent else
                         " and runs the member again while retries remain")
            return False if maybe_sent else None
        if not warned:
            warned = True
            logger.warning("celery-threads: the gate at %s did not answer (%s); the end of %s "
                           "of thread %s is kept and sent again while its lease holds "
                           "(%.1fs)", runtime.config.redis_url, error, lease.task_id,
                           lease.thread_id, remaining)
        time.sleep(min(0.5, remaining))


@contextmanager
def gate_errors(config: ThreadsConfig, task_id: str,
                limit: Optional[deadline.Deadline] = None) -> Iterator[None]:
    """Turn a gate that does not answer into :class:`GateUnavailable`.  ``limit``: the call's
    deadline, which knows whether a script call went out without its reply (it may have run);
    without one, the message allows for that."""
    try:
        yield
    except redis.RedisError as exc:
        where = (f"could not reach the gate's Redis at {config.redis_url} (threads_redis_url)"
                 + (f" within {limit.seconds:g}s (threads_publish_timeout)" if limit else "")
                 + f" to publish task {task_id}: {exc}. Nothing was sent to the broker.")
        if limit is not None and not limit.unanswered and not isinstance(exc, NotReplicated):
            raise GateUnavailable(
                f"{where} Nothing was stored in the gate either: call again once it is back."
            ) from exc
        raise GateUnavailable(
            f"{where} If Redis received the call before the connection broke, the member may be "
            "stored whole and will run; calling again with the same task_id is safe either way "
            "(a member is never stored twice, nor again within 30 s of its end)."
        ) from exc


class Replacement(NamedTuple):
    """What a replacement (``self.replace``) brings besides its message: its thread, its
    ``replaced_task_nesting`` and its retry settings."""

    thread_id: str
    nesting: int
    max_retries: Optional[int]
    retry_delay_ms: int
    policy: str = ""        # its task's policies (policies.policy_text); never max_waiting


class Reentry(NamedTuple):
    """A retry's re-entry into the thread, or the member's replacement, held until the member's
    body has unwound.  A replacement's ``at_ms`` is ``None`` when it keeps the member's
    scheduled_at."""

    retries: int
    delay_ms: int
    at_ms: Optional[int]
    envelope: Optional[bytes]
    replacement: Optional[Replacement] = None


class Running:
    """A member running in this process: when it was claimed (the Redis server's clock, and this
    process's monotonic clock when the claiming call was first sent), and its re-entry once
    self.retry() was called."""

    __slots__ = ("claimed_ms", "claimed_mono", "reentry")

    def __init__(self, claimed_ms: int, claimed_mono: float) -> None:
        self.claimed_ms = claimed_ms
        self.claimed_mono = claimed_mono
        self.reentry: Optional[Reentry] = None

    def server_now_ms(self, gate: Optional[Gate] = None) -> int:
        """The Redis server's time now (a retry's or a replacement's schedule is fixed on it):
        asked of ``gate`` (one ``TIME`` call).  The claim's time says little about it: the call
        that claimed the member (for a handed-off member, its predecessor's ``finish``) may have
        run anywhere between its first send and its reply, seconds apart across an outage.  When
        the gate does not answer: the claim's time plus the time elapsed here since that first
        send, which the server's clock cannot be behind (a countdown is never cut short)."""
        asked = time.monotonic()
        if gate is not None:
            try:
                return gate.reads.now_ms()
            except redis.RedisError:
                pass
        return self.claimed_ms + int((asked - self.claimed_mono) * 1000)


# (task id, token) of each member running in this process (a dict: a thread pool runs several).
_running: dict[tuple[str, str], Running] = {}


def _current_member(app: Any) -> Optional[tuple[str, str]]:
    """(task id, token) of Celery's current task when it is a released member, else ``None``."""
    request = getattr(app.current_task, "request", None)
    token = (getattr(request, "headers", None) or {}).get(TOKEN_HEADER)
    task_id = getattr(request, "id", None)
    return (str(task_id), str(token)) if token and task_id else None
