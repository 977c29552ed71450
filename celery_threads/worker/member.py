"""A member's run in a worker process: the claim of its delivery, its body run under the lease,
and its ending applied to the gate once the body has unwound.

The process keeps the members running in it (:func:`running`), so that a call from inside a
body finds its member: ``self.retry()`` and ``self.replace(sig)`` leave their re-entry here
(:class:`Reentry`), and the ending applies it (:func:`reenter`).  ``ThreadedTask.__call__``
hands each delivery to :func:`run`; ``ThreadedTask.apply_async`` asks :func:`current` and
:func:`running` where a call comes from.
"""

from __future__ import annotations

import logging
import math
import numbers
import time
from datetime import datetime
from typing import Any, Callable, NamedTuple, Optional

import redis
from celery.exceptions import Ignore, Reject, Retry, WorkerTerminate
from celery.worker import state as worker_state

from ..gate import DELETED, Claim, Gate, Outcome, deadline
from ..logs import get_logger
from ..protocol import MAX_DELAY_MS, THREAD_HEADER, TOKEN_HEADER, eta_ms, foreign_gate, retry_settings
from ..runtime import Runtime, get_runtime
from . import handoff
from .lease import Keeper, Lease, new_claimant, stoppable
from .lease import keeper as lease_keeper

logger = get_logger(__name__)


class Replacement(NamedTuple):
    """What a replacement (``self.replace``) brings besides its message: its thread, its
    ``replaced_task_nesting`` and its retry settings."""

    thread_id: str
    nesting: int
    max_retries: Optional[int]
    retry_delay_ms: int
    policy: str = ""  # its task's policies (policies.policy_text); never max_waiting


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


def running(task_id: str, token: str) -> Optional[Running]:
    """The member (task id, token) when its body runs in this process, else ``None``."""
    return _running.get((task_id, token))


def cut_off_on_cold_shutdown(pool: Any) -> None:
    """The solo pool runs a task's body in the worker's main thread, where Celery's cold
    shutdown (SIGQUIT) runs too, inside the body: it cancels the running task with the pool's
    ``terminate_job``, which the solo pool does not have, and the ``NotImplementedError`` came
    out of the body as its own failure (the member died, its retries unused).  While a member
    runs here, it is cut off as the process going away instead (Celery's ``WorkerTerminate``,
    which its pool lets through and its worker terminates on): a lost attempt, which
    re-enters once its lease lapses while it has retries, as under any other pool."""
    original = pool.terminate_job
    if getattr(original, "_celery_threads", False):
        return

    def terminate_job(pid: Any, signal: Any = None) -> Any:
        if _running:
            raise WorkerTerminate("celery-threads: a cold shutdown cuts off the member this solo worker runs")
        return original(pid, signal)

    terminate_job._celery_threads = True  # type: ignore[attr-defined]
    pool.terminate_job = terminate_job


def current(app: Any) -> Optional[tuple[str, str]]:
    """(task id, token) of Celery's current task when it is a released member, else ``None``."""
    request = getattr(app.current_task, "request", None)
    token = (getattr(request, "headers", None) or {}).get(TOKEN_HEADER)
    task_id = getattr(request, "id", None)
    return (str(task_id), str(token)) if token and task_id else None


#: Celery's tasks that call a task's body as a function, one item after another (the canvas's
#: ``chunks``, ``xmap`` and ``xstarmap``; the task's own methods refuse before sending them).
_BATCHES = frozenset({"celery.map", "celery.starmap", "celery.chunks"})


def _not_inside_a_batch(task: Any) -> None:
    """Refuse a direct call from inside one of :data:`_BATCHES`: the body would run outside
    any thread, beside its thread's members.  That task fails with the error."""
    outer = task.app.current_worker_task
    if outer is not None and outer.name in _BATCHES:
        task._not_in_one_task(outer.name.rsplit(".", 1)[-1])


def run(task: Any, body: Callable[[], Any]) -> Any:
    """Run ``body`` (the task's own ``__call__`` with its arguments) for the delivery in
    ``task.request``.  A released member's delivery runs only once claimed, and only while its
    lease holds; its ending then reaches the gate.  Anything else (a direct or eager call) is
    just ``body()``, except a call from inside Celery's ``map``, ``starmap`` or ``chunks`` task."""
    request = task.request
    headers = request.headers or {}
    if request.called_directly:
        _not_inside_a_batch(task)
    if request.is_eager and not request.called_directly:
        # ThreadedTask.apply resolved its thread id; a worker's request has it from the headers.
        request.thread_id, request.thread_token = headers.get(THREAD_HEADER), None
        return body()
    token = headers.get(TOKEN_HEADER)
    if not token or request.called_directly:
        return body()
    thread_id = headers[THREAD_HEADER]
    task_id = request.id
    hostname = request.hostname or ""
    runtime = get_runtime(task._get_app())
    keeper = lease_keeper(runtime)
    claimed = handoff.take_claim(task_id, token)
    if claimed is None:  # else run by handoff: its predecessor's finish claimed it
        claimed = _claim(task, runtime, keeper, thread_id, task_id, token, hostname)
    claimed_ms, lease = claimed
    try:
        retries = int(request.retries or 0)
        key = (task_id, token)
        with keeper.running(lease) as may_run:
            if not may_run:
                logger.warning(
                    "celery-threads: not running %s[%s] of thread %s: its lease "
                    "could not be confirmed with the gate",
                    task.name,
                    task_id,
                    thread_id,
                )
                raise Ignore()
            member = _running[key] = Running(claimed_ms, lease.sent)
            failure: Optional[BaseException] = None
            try:
                result = body()
            except BaseException as exc:
                failure = exc
            finally:
                _running.pop(key, None)
        if not isinstance(failure, (SystemExit, KeyboardInterrupt)) and _deleted_meanwhile(
            runtime, thread_id, task_id
        ):
            # Threads.delete detached it while it ran where it could not be stopped (a threads,
            # solo or gevent pool): REVOKED, which its ending must not overwrite.
            logger.info(
                "celery-threads: %s[%s] of thread %s was deleted while it ran; revoked",
                task.name,
                task_id,
                thread_id,
            )
            raise Ignore()
        if isinstance(failure, Retry) and member.reentry is None:
            failure = _spent(task, failure, retries)
        # The member's code has returned (its lease's end is no longer watched): its ending.
        ending = handoff.Ending(lease.claimant, new_claimant(hostname))
        deleted = _record_end(
            runtime,
            lease,
            lambda: _ended(
                task, runtime, thread_id, task_id, token, retries, failure, member.reentry, ending
            ),
        )
        if deleted is None:
            # Its ending never reached the gate while the lease held: the gate counts this
            # attempt as failed and runs the member again, whose outcome is the member's.
            # Celery stores nothing of this one (what it stored last, STARTED or RETRY,
            # stays until then).
            raise Ignore()
        if deleted and not isinstance(failure, (SystemExit, KeyboardInterrupt)):
            # Deleted while it ran (Threads.delete): it ends REVOKED, whatever its body did,
            # and the tracer stores nothing over that.
            logger.info(
                "celery-threads: %s[%s] of thread %s was deleted while it ran; revoked",
                task.name,
                task_id,
                thread_id,
            )
            runtime.mark_revoked(task_id)
            raise Ignore()
        if failure is not None:
            raise failure
        return result
    finally:
        keeper.drop(lease)


def _claim(
    task: Any, runtime: Runtime, keeper: Keeper, thread_id: str, task_id: str, token: str, hostname: str
) -> tuple[int, Lease]:
    """Claim the member for this delivery: the claim's time (the Redis server's clock, ms)
    and its lease; :class:`Ignore` when another delivery has it, or its release is stale."""
    claimant = new_claimant(hostname)
    sent = time.monotonic()
    try:
        status, claimed_ms = runtime.gate.claim_with_time(
            thread_id, task_id, token, hostname, claimant, stoppable=stoppable()
        )
    except redis.RedisError as exc:
        logger.warning(
            "celery-threads: not running %s[%s] of thread %s: the gate at %s %s its "
            "claim (%s); the gate hands it out again once its release or lease lapses",
            task.name,
            task_id,
            thread_id,
            runtime.config.shown_url,
            "refused" if isinstance(exc, redis.ResponseError) else "did not answer",
            exc,
        )
        raise Ignore() from exc
    if status != Claim.CLAIMED:
        # Another delivery of this release started first (or it went stale in between).
        foreign = foreign_gate(task.request, runtime.config.key_prefix)
        if foreign is None and status == Claim.STALE and not _known(runtime, thread_id, task_id):
            foreign = (
                f"the gate at {runtime.config.shown_url} does not know it (no member of that "
                "id, nor one that ended in the last 30 s). If every threaded task says so, its "
                "producers use another gate (threads_redis_url's server or database, or "
                "threads_key_prefix, differ from this worker's), or this gate lost its data (a "
                "restart without persistence); a late copy of a member that ended long ago is "
                "dropped so too, and so is a message sent by name with a thread_token header "
                "copied from a member's request (send thread_id alone: a new call has no token)"
            )
        logger.log(
            logging.WARNING if foreign is not None else logging.INFO,
            "celery-threads: not running %s[%s] of thread %s: %s",
            task.name,
            task_id,
            thread_id,
            foreign
            or ("claimed by another delivery" if status == Claim.ALREADY_CLAIMED else "stale release"),
        )
        raise Ignore()
    return claimed_ms, keeper.lease(thread_id, task_id, token, claimant, sent)


def _ended(
    task: Any,
    runtime: Runtime,
    thread_id: str,
    task_id: str,
    token: str,
    retries: int,
    exc: Optional[BaseException],
    reentry: Optional[Reentry],
    ending: handoff.Ending,
) -> bool:
    """Apply the member's ending to the gate, once its body has fully unwound.  Called again
    with the same arguments when the gate did not answer (see :func:`_record_end`).  Returns
    whether the gate ended it as deleted (it was deleted while it ran: no retry, no death)."""
    gate = runtime.gate
    outcome: Optional[Outcome] = None
    if reentry is not None:
        # self.retry() was called (also with throw=False): it wins however the body ended.
        outcome = task._reenter(runtime, thread_id, task_id, token, reentry, ending.caller)
        runtime.publish(outcome.release)
    elif exc is None or isinstance(exc, Ignore):
        return handoff.finish(runtime, task, thread_id, task_id, token, ending)
    elif isinstance(exc, Retry):
        # Retry raised by hand (self.retry() was not called, so no re-entry is held): it
        # re-enters as self.retry() would, after the Retry's `when` or default_retry_delay.
        delay_ms, at_ms = _retry_when(task, exc.when)
        outcome = runtime.publish_outcome(
            gate.requeue(
                thread_id,
                task_id,
                token,
                retries=retries + 1,
                delay_ms=delay_ms,
                at_ms=at_ms,
                caller=ending.caller,
            )
        )
    elif isinstance(exc, Reject) and exc.requeue:
        outcome = runtime.publish_outcome(
            gate.requeue(thread_id, task_id, token, retries=retries, caller=ending.caller)
        )
    elif isinstance(exc, Exception):  # a Reject without requeue too: it dies, saying why
        outcome = runtime.kill(
            thread_id,
            task_id,
            token,
            exc=exc,
            retries=retries,
            keep=task.dead_letter,
            reason=f"Rejected: {exc.reason!r}" if isinstance(exc, Reject) else None,
            caller=ending.caller,
            fenced=True,
        )
    # Anything else (SystemExit, ...): the process is going away; the lease lapses and the
    # gate counts a failed attempt.
    return outcome is not None and outcome.info == DELETED


def _known(runtime: Runtime, thread_id: str, task_id: str) -> bool:
    """Whether the gate knows ``task_id`` (``True`` when it does not say)."""
    try:
        return runtime.gate.reads.knows(thread_id, task_id)
    except redis.RedisError:
        return True


def _deleted_meanwhile(runtime: Runtime, thread_id: str, task_id: str) -> bool:
    """Whether a member running where it cannot be stopped was deleted meanwhile: its worker
    (this process, outside a prefork pool) took the delete's revoke, and it no longer holds its
    thread.  A plain revoke leaves it holding its thread, to finish."""
    if stoppable() or task_id not in worker_state.revoked:
        return False
    try:
        return not runtime.gate.reads.holds(thread_id, task_id)
    except redis.RedisError:
        return False


def _spent(task: Any, exc: Retry, retries: int) -> BaseException:
    """A ``Retry`` raised by hand, as ``self.retry()`` would have ended: the ``Retry`` itself
    while ``max_retries`` allows one more attempt, else what ``self.retry()`` raises then (the
    Retry's own exception, or ``MaxRetriesExceededError``), with which the member dies."""
    limit: Optional[int] = task.max_retries
    kept: BaseException = exc
    if limit is None or retries < limit:
        return kept
    own: Any = exc.exc
    if isinstance(own, BaseException):
        return own
    request = task.request
    spent: BaseException = task.MaxRetriesExceededError(
        f"Can't retry {task.name}[{request.id}] args:{request.args} kwargs:{request.kwargs}",
        task_args=request.args,
        task_kwargs=request.kwargs,
    )
    return spent


def _retry_when(task: Any, when: Any) -> tuple[int, Optional[int]]:
    """``(delay ms, scheduled_at ms or None)`` of a Retry's ``when``: seconds (at most
    :data:`~celery_threads.protocol.MAX_DELAY_MS`, 100 years), an eta (a datetime or its ISO
    text), or ``None`` for the task's ``default_retry_delay``."""
    if isinstance(when, (datetime, str)):
        return 0, eta_ms(when)
    if isinstance(when, numbers.Real) and not isinstance(when, bool) and math.isfinite(when):
        return min(MAX_DELAY_MS, max(0, int(float(when) * 1000))), None
    return retry_settings(task)[1], None


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
            logger.error(
                "celery-threads: could not record the end of %s of thread %s in the "
                "gate at %s (%s) while its lease held; the gate counts the attempt as "
                "failed%s",
                lease.task_id,
                lease.thread_id,
                runtime.config.shown_url,
                error,
                " (unless a call that went out reached it)"
                if maybe_sent
                else " and runs the member again while retries remain",
            )
            return False if maybe_sent else None
        if not warned:
            warned = True
            logger.warning(
                "celery-threads: the gate at %s did not answer (%s); the end of %s "
                "of thread %s is kept and sent again while its lease holds "
                "(%.1fs)",
                runtime.config.shown_url,
                error,
                lease.task_id,
                lease.thread_id,
                remaining,
            )
        time.sleep(min(0.5, remaining))


def reenter(
    task: Any,
    runtime: Runtime,
    thread_id: str,
    task_id: str,
    token: str,
    reentry: Reentry,
    caller: Optional[str] = None,
) -> Outcome:
    """The member (task, token) goes back to waiting with a retry's new message; returns the
    gate's outcome (its release, of the next member, for the caller to publish).  A
    replacement (``self.replace``) takes the member's place in its thread, or ends it and
    joins its own thread."""
    replacement = reentry.replacement
    if replacement is not None and replacement.thread_id != thread_id:
        return _replace_elsewhere(task, runtime, thread_id, task_id, token, reentry, replacement, caller)
    if replacement is not None:
        outcome: Outcome = runtime.gate.replace(
            thread_id,
            task_id,
            token,
            reentry.envelope or b"",
            at_ms=reentry.at_ms,
            max_retries=replacement.max_retries,
            retry_delay_ms=replacement.retry_delay_ms,
            caller=caller,
        )
        if not outcome.done:
            logger.warning(
                "celery-threads: replacement of %s[%s] dropped: the member no "
                "longer holds thread %s (deleted, or its lease lapsed)",
                task.name,
                task_id,
                thread_id,
            )
        return outcome
    outcome = runtime.gate.requeue(
        thread_id,
        task_id,
        token,
        retries=reentry.retries,
        delay_ms=reentry.delay_ms,
        at_ms=reentry.at_ms,
        envelope=reentry.envelope or b"",
        caller=caller,
    )
    if not outcome.done:
        if _died(runtime, task_id):
            logger.warning(
                "celery-threads: retry of %s[%s] ignored: it died already in thread %s (an "
                "on_failure or task_failure handler runs once the exception has ended it). Retry "
                "from the task's body or with autoretry_for; `celery -A <app> threads restart %s` "
                "runs it again",
                task.name,
                task_id,
                thread_id,
                task_id,
            )
        else:
            logger.warning(
                "celery-threads: retry of %s[%s] ignored: it no longer holds thread %s "
                "(deleted, or its lease lapsed)",
                task.name,
                task_id,
                thread_id,
            )
    return outcome


def _died(runtime: Runtime, task_id: str) -> bool:
    """Whether ``task_id`` is in the dead-letter store (``False`` when the gate does not say)."""
    try:
        return runtime.gate.reads.dead_record(task_id) is not None
    except redis.RedisError:
        return False


def _replace_elsewhere(
    task: Any,
    runtime: Runtime,
    thread_id: str,
    task_id: str,
    token: str,
    reentry: Reentry,
    replacement: Replacement,
    caller: Optional[str] = None,
) -> Outcome:
    """The member ends, then its replacement joins the replacement's own thread as a new
    arrival under the same task id; returns that enqueue's outcome."""
    finished: Outcome = runtime.gate.finish(thread_id, task_id, token, caller=caller)
    if finished.info == DELETED:  # deleted while it ran: no replacement joins
        return finished  # (the caller publishes its successor's release)
    if not finished.done:
        logger.warning(
            "celery-threads: replacement of %s[%s] dropped: the member no longer "
            "holds thread %s (deleted, or its lease lapsed)",
            task.name,
            task_id,
            thread_id,
        )
        return finished
    runtime.publish(finished.release)
    outcome: Outcome = runtime.gate.enqueue(
        replacement.thread_id,
        task_id,
        reentry.envelope or b"",
        at_ms=reentry.at_ms,
        max_retries=replacement.max_retries,
        retry_delay_ms=replacement.retry_delay_ms,
        replaced=replacement.nesting,
        policy=replacement.policy,
    )
    if not outcome.done:
        logger.warning(
            "celery-threads: replacement %s of %s could not join thread %s: that "
            "task id is a member there already",
            task_id,
            task.name,
            replacement.thread_id,
        )
    return outcome
