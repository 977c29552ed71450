"""The main process's endings of what its pool processes ran: the request class of threaded
tasks.

:class:`ThreadedRequest` ends members whose pool process could not: a killed process
(``WorkerLostError``), including the member it ran by in-process handoff, and a hard time limit.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Optional

import redis
from billiard.einfo import ExceptionWithTraceback
from celery import states
from celery.exceptions import (
    Ignore,
    Reject,
    Retry,
    Terminated,
    TimeLimitExceeded,
    WorkerLostError,
)
from celery.utils.saferepr import saferepr
from celery.utils.serialization import get_pickled_exception
from celery.worker import state as worker_state
from celery.worker.request import Request

from .. import seams
from ..gate import Lapse, Outcome
from ..logs import get_logger
from ..publish import request_member
from ..runtime import Runtime, get_runtime
from . import handoff
from .processes import pool_holder, process_of, when_gone
from .strategy import kill_unrunnable

logger = get_logger(__name__)


class ThreadedRequest(Request):
    """Main-process endings of a threaded member that its pool child could not report, each
    fenced by the token and by that pool process's claims (``pool_holder``): after lost gate
    writes another worker may run the member under the same token."""

    _ending_sent = False

    def on_success(self, failed__retval__runtime: Any, **kwargs: Any) -> Any:
        # A pool job that went on to run members by handoff sent its own member's ending event
        # when that member ended (handoff.EventSent): not again, a handed-off run later.
        runtime = failed__retval__runtime[2] if isinstance(failed__retval__runtime, tuple) else None
        self._ending_sent = isinstance(runtime, handoff.EventSent)
        return super().on_success(failed__retval__runtime, **kwargs)

    def send_event(self, type: str, **fields: Any) -> None:
        if self._ending_sent and type == "task-succeeded":
            return
        super().send_event(type, **fields)

    def terminate(self, pool: Any, signal: Any = None) -> None:
        """Celery's terminate of this request (``revoke(terminate=True)``, ``celery control
        terminate``, ``revoke_by_stamped_headers(..., terminate=True)``, which matches the
        requests Celery holds as active): where this member's body has returned and its pool job
        goes on running the next member of its thread by handoff, its signal would kill that
        other member.  It is not sent, as for a task that has ended."""
        if handoff.runs_another(self.worker_pid, self.id):
            logger.info(
                "celery-threads: not terminating %s: its body has returned, and its pool process "
                "runs the next member of its thread by handoff",
                self.id,
            )
            return
        super().terminate(pool, signal)

    def cancel(self, pool: Any, signal: Any = None, *args: Any, **kwargs: Any) -> None:
        """Celery's cold shutdown cancels the running tasks.  A pool job that has gone on to run
        a member by handoff still holds this request, whose member succeeded: Celery announced
        that one as cancelled (RETRY over its success, ``on_retry``, ``task_retry``).  Only the
        process is stopped then: the member it runs is failed as lost once the process has exited
        (or when its lease lapses)."""
        if not handoff.runs_by_handoff(self.worker_pid):
            thread_id, token = request_member(self)
            pid, running = process_of(self), bool(self.time_start)
            super().cancel(pool, signal, *args, **kwargs)
            if token and running:
                # Celery stored RETRY and leaves the message to the broker, whose redelivery the
                # claim refuses: the gate hears of it now, once its process has exited.
                ended = functools.partial(self._end_cancelled_attempt, thread_id, token)
                when_gone(pid, ended, get_runtime(self.task.app).config.keepalive, what=self.id)
            return
        from celery.platforms import signals as platform_signals
        from celery.worker.control import TERM_SIGNAME

        pool.terminate_job(self.worker_pid, platform_signals.signum(signal or TERM_SIGNAME))
        worker_state.task_ready(self)

    def _end_cancelled_attempt(self, thread_id: str, token: str) -> None:
        """A running member Celery cancelled (``worker_cancel_long_running_tasks_on_connection_loss``
        when the broker connection is lost, or a cold shutdown), its process now gone: a failed
        attempt, as for a lost process, reported at once (its lease would lapse only after
        ``threads_keepalive``).  Celery announced a retry; a death is stored as one."""
        runtime = get_runtime(self.task.app)
        reason = "WorkerLostError: cancelled by Celery (its worker lost the broker, or shut down cold)"
        try:
            outcome = runtime.publish_outcome(
                runtime.gate.fail(
                    thread_id, self.id, token, f"{reason}; no retries were left", holder=pool_holder(self)
                )
            )
        except redis.RedisError as error:
            logger.warning(
                "celery-threads: could not report the cancelled attempt of %s[%s] of thread %s to the "
                "gate (%s); it counts when its lease lapses",
                self.task.name,
                self.id,
                thread_id,
                error,
            )
            return
        if outcome.status == Lapse.DIED:
            retries = int(self.request_dict.get("retries") or 0)
            runtime.end_death(thread_id, self.id, WorkerLostError(reason), reason, retries)
        elif outcome.status == Lapse.DELETED:
            runtime.mark_revoked(
                self.id, envelope=outcome.gone_envelope or None, retries=outcome.gone_retries
            )

    def on_timeout(self, soft: bool, timeout: float) -> None:
        thread_id, token = request_member(self)
        if not soft and token and not worker_state.should_terminate:
            # billiard calls this before it signals the timed-out pool process (SIGTERM, then
            # SIGKILL 0.1 s later): the member leaves its thread, and the next one is released,
            # only once that process, still running the body, has exited.
            runtime = get_runtime(self.task.app)
            kill = functools.partial(
                runtime.kill,
                thread_id,
                self.id,
                token,
                exc=TimeLimitExceeded(timeout),
                retries=int(self.request_dict.get("retries") or 0),
                keep=self.task.dead_letter,
                reason=f"TimeLimitExceeded: hard time limit ({timeout}s)",
                holder=pool_holder(self),
            )
            when_gone(process_of(self), kill, runtime.config.keepalive, what=self.id)
        super().on_timeout(soft, timeout)

    def on_failure(self, exc_info: Any, send_failed_event: bool = True, return_ok: bool = False) -> None:
        thread_id, token = request_member(self)
        exc = get_pickled_exception(exc_info.exception)
        if isinstance(exc, ExceptionWithTraceback):  # as Celery unwraps it (not Retry.exc)
            exc = exc.exc
        lost = isinstance(exc, (WorkerLostError, SystemExit, KeyboardInterrupt))
        if token and lost and not seams.request_revoked(self):
            ended = self._end_lost_attempt(thread_id, token, exc, exc_info)
            _fail_handed_off(self, exc)
            if ended:
                return
        elif lost:
            _fail_handed_off(self, exc)
        elif token and not isinstance(exc, (Retry, Ignore, Reject, Terminated, TimeLimitExceeded)):
            # The pool child reports every failure of a task body it ran; one it never reported
            # (the message could not be decoded, the task never started) would hold the thread.
            # Fenced by the token: a no-op when the child did report it.  A hard time limit
            # (billiard reports it here, then calls on_timeout) is on_timeout's to end.
            kill_unrunnable(
                get_runtime(self.task.app), self.request_dict, exc, pool_holder(self), report=False
            )
        super().on_failure(exc_info, send_failed_event=send_failed_event, return_ok=return_ok)

    def _end_lost_attempt(self, thread_id: str, token: str, exc: BaseException, exc_info: Any) -> bool:
        """The pool process running this member was lost: a failed attempt, which the gate turns
        into a retry or a death.  Returns ``True`` when the attempt is ended here, ``False`` when
        the member died by this report and Celery's own handling stores the failure (ended here
        too under ``reject_on_worker_lost``, which has Celery requeue the message instead).

        Only a death may show ``FAILURE`` in the result backend.  Any other answer stores no
        final state: ``RETRY`` when this report put the member back in its thread, nothing when
        the gate had moved on before it arrived (the report came late, the gate having been
        unreachable: the dispatcher retried the member, or killed it and stored ``LeaseExpired``,
        when its lease lapsed; or the member was deleted, or its process reported its end
        before it was lost).  Celery would store ``WorkerLostError`` there, over what the member's
        next attempt, its death or its deletion stores, and a client that read it keeps it."""
        runtime = get_runtime(self.task.app)
        retries = int(self.request_dict.get("retries") or 0)
        try:
            outcome: Optional[Outcome] = runtime.publish_outcome(
                runtime.gate.fail(
                    thread_id,
                    self.id,
                    token,
                    f"WorkerLostError: {exc}; no retries were left",
                    holder=pool_holder(self),
                )
            )
        except redis.RedisError as error:
            logger.warning(
                "celery-threads: could not report the lost attempt of %s[%s] of "
                "thread %s to the gate at %s (%s); the gate counts it when its "
                "lease lapses (it runs again while retries remain)",
                self.task.name,
                self.id,
                thread_id,
                runtime.config.shown_url,
                error,
            )
            outcome = None
        if outcome is not None and outcome.status == Lapse.DIED:
            runtime.announce_death(thread_id, self.id, f"WorkerLostError: {exc}", retries)
            if not (self.task.acks_late and self.task.reject_on_worker_lost):
                return False
            # Celery would requeue the message and store nothing (reject_on_worker_lost): the
            # member would read STARTED forever, its errbacks never called.  The gate decided,
            # so it ends as a death does without that setting.
            worker_state.task_ready(self)
            self._announce_lost_death(exc, exc_info)
            return True
        worker_state.task_ready(self)
        if outcome is not None and outcome.status == Lapse.RETRIED:
            self._announce_lost_retry(exc, exc_info)
            return True
        if outcome is not None and outcome.status == Lapse.DELETED:
            # Deleted while it ran (Threads.delete): it ends as REVOKED, whatever ended its process.
            runtime.mark_revoked(self.id)
            if self.task.acks_late:
                self.acknowledge()
            return True
        if outcome is not None:
            logger.info(
                "celery-threads: the lost attempt of %s[%s] of thread %s was reported "
                "after the gate had moved on (its lease lapsed, or it ended)",
                self.task.name,
                self.id,
                thread_id,
            )
            self._store_death_left_unstored(runtime, exc)
        if self.task.acks_late:
            self.acknowledge()
        return True

    def _store_death_left_unstored(self, runtime: Runtime, exc: BaseException) -> None:
        """The member is dead in the gate but its result holds no final state: the process was
        lost between its body's death (recorded in the gate) and Celery's store of the failure.
        FAILURE is stored with the recorded reason (the exception itself went with the process).
        A dispatcher that killed it stored its own FAILURE (``LeaseExpired``): left as it is."""
        if not self.store_errors:
            return
        try:
            record = runtime.gate.reads.dead_record(self.id)
            if record is None:
                return
            backend = self.task.backend
            if backend.get_task_meta(self.id, cache=False)["status"] in states.READY_STATES:
                return
            reason = record.meta.get("exception", "")
            backend.mark_as_failure(
                self.id,
                WorkerLostError(f"{exc}, after it died: {reason}"),
                request=seams.request_context(self),
            )
        except Exception:
            logger.debug("celery-threads: could not store the death of %s", self.id, exc_info=True)

    def _announce_lost_death(self, exc: BaseException, exc_info: Any) -> None:
        """What Celery does for a lost task without ``reject_on_worker_lost``: FAILURE stored and
        errbacks called, ``task_failure`` signal, ack, ``task-failed`` event."""
        from celery import signals

        if not isinstance(exc, WorkerLostError):  # billiard's report of the exit (SystemExit)
            exc = WorkerLostError(f"Worker exited prematurely: {type(exc).__name__}.")
        context = seams.request_context(self)
        self.task.backend.mark_as_failure(self.id, exc, request=context, store_result=self.store_errors)
        with self._current(context):
            signals.task_failure.send(
                sender=self.task,
                task_id=self.id,
                exception=exc,
                args=self.args,
                kwargs=self.kwargs,
                traceback=exc_info.traceback,
                einfo=exc_info,
            )
        self.acknowledge()
        if not worker_state.should_terminate:  # cold shutdown: Celery sends no event either
            self.send_event("task-failed", exception=saferepr(exc), traceback=exc_info.traceback)

    @contextmanager
    def _current(self, context: Any) -> Iterator[None]:
        """The member's request as its task's current one, for its handlers and signal
        receivers, as Celery runs them (``context``: ``None`` leaves the stack alone)."""
        if context is not None:
            self.task.request_stack.push(context)
        try:
            yield
        finally:
            if context is not None:
                self.task.request_stack.pop()

    def _announce_lost_retry(self, exc: BaseException, exc_info: Any) -> None:
        """What Celery does for a retried task: a log line, RETRY state, ``on_retry`` and the
        ``task_retry`` signal, ``task-retried`` event, ack."""
        from celery import signals

        logger.warning(
            "celery-threads: %s[%s] of thread %s lost its pool process (%s); it runs again "
            "(its retries allow it)",
            self.task.name,
            self.id,
            request_member(self)[0],
            exc,
        )
        context = seams.request_context(self)
        if self.store_errors:
            self.task.backend.mark_as_retry(self.id, exc, exc_info.traceback, request=context)
        try:
            with self._current(context):
                self.task.on_retry(exc, self.id, self.args, self.kwargs, exc_info)
                signals.task_retry.send(sender=self.task, request=context, reason=exc, einfo=exc_info)
        except Exception:
            logger.exception("celery-threads: on_retry or a task_retry handler of %s failed", self.id)
        if self.task.acks_late:
            self.acknowledge()
        self.send_event("task-retried", exception=saferepr(exc), traceback=exc_info.traceback)


def _fail_handed_off(request: Any, exc: BaseException) -> None:
    """The lost pool process was running a member by in-process handoff (handoff.py), unknown to
    this process until now: a failed attempt of that member, at once rather than when its lease
    lapses."""
    member = handoff.lost_member(getattr(request, "worker_pid", None))
    if member is None:
        return
    thread_id, task_id, token = member
    runtime = get_runtime(request.task.app)
    try:
        outcome = runtime.publish_outcome(
            runtime.gate.fail(
                thread_id,
                task_id,
                token,
                f"WorkerLostError: {exc}; no retries were left",
                holder=pool_holder(request),
            )
        )
        logger.warning(
            "celery-threads: the pool process running %s of thread %s by handoff was lost (%s)",
            task_id,
            thread_id,
            exc,
        )
        # No request of it reaches Celery's handling in this process: its state is stored here,
        # final only when it died.
        if outcome.status == Lapse.DIED:
            runtime.end_death(thread_id, task_id, exc, f"WorkerLostError: {exc}")
        elif outcome.status == Lapse.RETRIED:
            request.task.backend.mark_as_retry(task_id, exc)
            if runtime.send_task_event is not None:  # as for the member's own request
                runtime.send_task_event("task-retried", uuid=task_id, exception=saferepr(exc), traceback="")
    except Exception:
        logger.exception(
            "celery-threads: could not fail %s of thread %s; its lease will lapse", task_id, thread_id
        )
