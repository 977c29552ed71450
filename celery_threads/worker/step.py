"""The worker side: claim on receipt, lease renewal, and the endings only the main process sees.

* :func:`threaded_strategy` checks the fencing token of a delivery that may be a duplicate
  (redelivered, or republished by the gate) before Celery even logs it as received, so a stale
  delivery, or a redelivery of a member already started, is acked and dropped without a
  ``task-received`` event or a result-backend write for the live task.  The claim itself
  happens when the task starts (``ThreadedTask.__call__``): a member prefetched by a worker that
  shuts down before starting it stays RELEASED, so its redelivery runs elsewhere.
* :class:`ThreadedRequest` ends members whose pool child could not: a killed child
  (``WorkerLostError``) and a hard time limit.
* :class:`ThreadsWorkerStep` renews the release deadlines of the members this worker holds
  unstarted (in a thread of the operating system, so it works under every pool, gevent's
  included) and runs the worker's dispatch loop.
* Deliveries the broker does not track are handled in :mod:`celery_threads.worker.noack`.
"""
from __future__ import annotations

import functools
import logging
import os
import select
import signal as _signal
import threading
import time
from typing import Any, Callable, Optional

import redis
from billiard.einfo import ExceptionWithTraceback
from celery import bootsteps, states
from celery.exceptions import (
    Ignore,
    NotRegistered,
    Reject,
    Retry,
    Terminated,
    TimeLimitExceeded,
    WorkerLostError,
)
from celery.utils.serialization import get_pickled_exception
from celery.worker import state as worker_state
from celery.worker.request import Request
from celery.worker.strategy import default as default_strategy

from .. import policies, seams
from ..config import read_config, sanitized_url
from ..errors import ConfigurationError
from ..gate import NO_HOLDER, STOPPING, Enqueue, Lapse, Outcome, Renewal, claimant_prefix
from ..protocol import REPUBLISHED_HEADER, THREAD_HEADER, TOKEN_HEADER, eta_ms, is_threaded, retry_settings
from ..publish import encode_envelope, request_member
from ..runtime import Runtime, get_runtime, unreachable
from . import handoff, lease, native
from .noack import CONSUMER_FLAG, hand_back_on_pool_close, mark_delivery

logger = logging.getLogger(__name__)


def threaded_strategy(task: Any, app: Any, consumer: Any, **kwargs: Any) -> Any:
    handle = default_strategy(task, app, consumer, **kwargs)
    runtime = get_runtime(app)
    connection_errors = consumer.connection_errors

    def drop(ack: Any) -> None:
        ack(logger, connection_errors)

    def task_message_handler(message: Any, body: Any, ack: Any, reject: Any, callbacks: Any,
                             **kw: Any) -> Any:
        if getattr(consumer, CONSUMER_FLAG, False):
            mark_delivery(message)      # untracked by the broker: no ack, no reject
        headers = message.headers or {}
        token = headers.get(TOKEN_HEADER)
        if not token:
            try:
                return _enter_gate_from_worker(task, runtime, message,
                                               lambda: drop(ack),
                                               lambda: reject(logger, connection_errors, False))
            except redis.RedisError as exc:
                # The gate is unreachable: the message goes back to the broker, for a worker
                # that reaches it (or this one, later).
                logger.warning("celery-threads: %s[%s] could not enter its thread: the gate at "
                               "%s did not answer (%s); requeued", task.name, headers.get("id"),
                               runtime.config.redis_url, exc)
                reject(logger, connection_errors, True)
                return None
        thread_id, task_id = str(headers.get(THREAD_HEADER)), str(headers.get("id"))
        try:
            state = (runtime.gate.reads.peek(thread_id, task_id, token) if may_be_duplicate(message)
                     else "RELEASED")
        except redis.RedisError as exc:
            # Unchecked, it goes on: its claim, when it starts, lets one delivery run.
            logger.warning("celery-threads: could not check %s[%s] of thread %s against the "
                           "gate (%s); its claim decides", task.name, task_id, thread_id, exc)
            state = "RELEASED"
        if state != "RELEASED":
            # RUNNING under this token: a redelivery of a member another attempt has started;
            # anything else: a stale release.  Either way the live task is not touched.
            why = "a duplicate delivery" if state == "RUNNING" else "a stale release"
            logger.info("celery-threads: dropped %s[%s] of thread %s: %s (token %s)",
                        task.name, task_id, thread_id, why, token)
            drop(ack)
            return None
        try:
            return handle(message, body, ack, reject, callbacks, **kw)
        except Exception as exc:   # undecodable body, refused content type, invalid message
            kill_unrunnable(runtime, headers, exc)
            raise                   # Celery rejects and logs the message as usual

    return task_message_handler


def may_be_duplicate(message: Any) -> bool:
    """Whether a delivery may repeat one that was already received: the broker redelivered it
    (RabbitMQ's flag; kombu's Redis transport marks restored messages), or the gate published
    its release again (the dispatcher's republish of a lost release, a retried publish).

    Only those are checked against the gate on receipt; a first delivery of a first publish is
    the live release (or a stale one whose member was deleted, which the revoke that came with
    the deletion drops).  Whatever slips through is still stopped by the claim when the task
    starts: it ends as an ignored task instead of being dropped before Celery logs it.
    """
    headers = message.headers or {}
    if headers.get(REPUBLISHED_HEADER) or headers.get("redelivered"):
        return True
    return bool((message.delivery_info or {}).get("redelivered"))


def kill_unrunnable(runtime: Runtime, headers: dict[str, Any], exc: BaseException,
                    holder: Optional[str] = NO_HOLDER) -> None:
    """A released member whose message no worker can run dies now, instead of being republished
    forever: it goes to the dead letters with the reason, and its thread moves on.  ``holder``:
    the claimant prefix of the pool process that had the message (see :meth:`Gate.kill`); by
    default none did, and a member another delivery's claim runs is left alone."""
    token = headers.get(TOKEN_HEADER)
    if not token:
        return
    try:
        runtime.kill(str(headers.get(THREAD_HEADER)), str(headers.get("id")), str(token), exc=exc,
                     retries=int(headers.get("retries") or 0), holder=holder,
                     reason=f"{type(exc).__name__}: the worker cannot run this message: {exc}")
    except Exception:
        logger.exception("celery-threads: could not dead-letter unrunnable member %s",
                         headers.get("id"))


def on_unrunnable_message(sender: Any = None, message: Any = None, exc: Any = None,
                          **kwargs: Any) -> None:
    """``task_unknown`` / ``task_rejected``: a released member Celery refused before any strategy
    ran (a task name this worker does not know, an invalid message)."""
    headers = getattr(message, "headers", None) or {}
    if not headers.get(TOKEN_HEADER):
        return
    app = getattr(sender, "app", None)
    if app is None or not getattr(app, "_celery_threads_installed", False):
        return
    if kwargs.get("name"):
        exc = NotRegistered(kwargs["name"])
    kill_unrunnable(get_runtime(app), headers, exc or RuntimeError("message refused"))


def _enter_gate_from_worker(task: Any, runtime: Runtime, message: Any, ack: Any,
                            reject: Any) -> None:
    """A threaded task's message that did not come through the gate (``send_task`` by name from
    another program, a dead letter sent back): the worker enqueues it into its thread."""
    headers = dict(message.headers or {})
    try:
        max_retries, retry_delay_ms = retry_settings(task)
        policy = policies.resolve(task, {})     # the task's own: a call's options are not known
    except ConfigurationError as exc:
        logger.error("celery-threads: rejected %s[%s]: %s", task.name, headers.get("id"), exc)
        reject()
        return
    try:
        args, kwargs, _ = message.decode()
        thread_id = task.resolve_thread_id(args, kwargs, headers.get(THREAD_HEADER))
    except Exception as exc:
        logger.error("celery-threads: rejected %s[%s]: it came without a thread id (%s). Publish "
                     "it with apply_async(thread_id=...) or give the task a thread_key.",
                     task.name, headers.get("id"), exc)
        reject()
        return
    delivery = message.delivery_info or {}
    props = message.properties or {}
    envelope = encode_envelope(message.body, {
        "exchange": delivery.get("exchange") or "",
        "routing_key": delivery.get("routing_key"),
        "content_type": message.content_type,
        "content_encoding": message.content_encoding,
        "headers": {**headers, "eta": None},
        **{k: props.get(k) for k in ("correlation_id", "reply_to", "priority")},
    })
    eta = headers.get("eta")
    outcome = runtime.gate.enqueue(
        thread_id, headers["id"], envelope, at_ms=eta_ms(eta) if eta else None,
        max_retries=max_retries, retry_delay_ms=retry_delay_ms, policy=policy.text,
        max_waiting=policy.max_waiting)
    if outcome.status == Enqueue.FULL:
        logger.error("celery-threads: rejected %s[%s]: thread %s already has %s waiting members "
                     "(max_waiting)", task.name, headers["id"], thread_id, policy.max_waiting)
        reject()
        return
    runtime.publish(outcome.release)
    ack()


def pool_holder(request: Any) -> Optional[str]:
    """The claimant prefix of the pool process a request went to (its claims begin with it), or
    ``None`` before the pool said which: the main process's endings are then fenced by token
    only."""
    pid = getattr(request, "worker_pid", None)
    return claimant_prefix(request.hostname or "", pid) if pid else None


class ThreadedRequest(Request):
    """Main-process endings of a threaded member that its pool child could not report, each
    fenced by the token and by that pool process's claims (``pool_holder``): after lost gate
    writes another worker may run the member under the same token."""

    def on_timeout(self, soft: bool, timeout: float) -> None:
        thread_id, token = request_member(self)
        if not soft and token and not worker_state.should_terminate:
            # billiard calls this before it signals the timed-out pool process (SIGTERM, then
            # SIGKILL 0.1 s later): the member leaves its thread, and the next one is released,
            # only once that process, still running the body, has exited.
            runtime = get_runtime(self.task.app)
            kill = functools.partial(
                runtime.kill, thread_id, self.id, token, exc=TimeLimitExceeded(timeout),
                retries=int(self.request_dict.get("retries") or 0), keep=self.task.dead_letter,
                reason=f"TimeLimitExceeded: hard time limit ({timeout}s)", holder=pool_holder(self))
            when_gone(self.worker_pid, kill, runtime.config.keepalive, what=self.id)
        super().on_timeout(soft, timeout)

    def on_failure(self, exc_info: Any, send_failed_event: bool = True,
                   return_ok: bool = False) -> None:
        thread_id, token = request_member(self)
        exc = get_pickled_exception(exc_info.exception)
        if isinstance(exc, ExceptionWithTraceback):   # as Celery unwraps it (not Retry.exc)
            exc = exc.exc
        lost = isinstance(exc, (WorkerLostError, SystemExit, KeyboardInterrupt))
        if token and lost and not seams.request_revoked(self):
            ended = self._end_lost_attempt(thread_id, token, exc, exc_info)
            _fail_handed_off(self, exc)
            if ended:
                return
        elif lost:
            _fail_handed_off(self, exc)
        elif token and not isinstance(exc, (Retry, Ignore, Reject, Terminated,
                                            TimeLimitExceeded)):
            # The pool child reports every failure of a task body it ran; one it never reported
            # (the message could not be decoded, the task never started) would hold the thread.
            # Fenced by the token: a no-op when the child did report it.  A hard time limit
            # (billiard reports it here, then calls on_timeout) is on_timeout's to end.
            kill_unrunnable(get_runtime(self.task.app), self.request_dict, exc,
                            pool_holder(self))
        super().on_failure(exc_info, send_failed_event=send_failed_event, return_ok=return_ok)

    def _end_lost_attempt(self, thread_id: str, token: str, exc: BaseException,
                          exc_info: Any) -> bool:
        """The pool process running this member was lost: a failed attempt, which the gate turns
        into a retry or a death.  Returns ``True`` when the attempt is ended here, ``False`` when
        the member died by this report and Celery's own handling stores the failure.

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
            outcome: Optional[Outcome] = runtime.apply(runtime.gate.fail(
                thread_id, self.id, token, f"WorkerLostError: {exc}; no retries were left",
                holder=pool_holder(self)))
        except redis.RedisError as error:
            logger.warning("celery-threads: could not report the lost attempt of %s[%s] of "
                           "thread %s to the gate at %s (%s); the gate counts it when its "
                           "lease lapses (it runs again while retries remain)", self.task.name,
                           self.id, thread_id, runtime.config.redis_url, error)
            outcome = None
        if outcome is not None and outcome.status == Lapse.DIED:
            runtime.announce_death(thread_id, self.id, f"WorkerLostError: {exc}", retries)
            return False
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
            logger.info("celery-threads: the lost attempt of %s[%s] of thread %s was reported "
                        "after the gate had moved on (its lease lapsed, or it ended)",
                        self.task.name, self.id, thread_id)
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
            backend.mark_as_failure(self.id, WorkerLostError(f"{exc}, after it died: {reason}"),
                                    request=seams.request_context(self))
        except Exception:
            logger.debug("celery-threads: could not store the death of %s", self.id,
                         exc_info=True)

    def _announce_lost_retry(self, exc: BaseException, exc_info: Any) -> None:
        """What Celery does for a retried task: RETRY state, ``task-retried`` event, ack."""
        from celery.utils.saferepr import saferepr

        if self.store_errors:
            self.task.backend.mark_as_retry(self.id, exc, exc_info.traceback,
                                            request=seams.request_context(self))
        if self.task.acks_late:
            self.acknowledge()
        self.send_event("task-retried", exception=saferepr(exc), traceback=exc_info.traceback)


def when_gone(pid: Optional[int], action: Callable[[], Any], timeout: float,
              what: str = "", anyway: bool = True) -> None:
    """Run ``action`` once the process ``pid`` has exited (in a thread of its own), or at once
    when ``pid`` is this process (a pool without processes) or no longer exists.  Past
    ``timeout`` seconds it runs anyway, with a warning: as when a lease lapses; not
    ``anyway``: it does not run then (the member ends otherwise, see :func:`_delete_once_stopped`)."""
    if not pid or pid == os.getpid():
        _run_logged(action, what)
        return
    try:
        fd: Optional[int] = os.pidfd_open(pid)
    except ProcessLookupError:
        _run_logged(action, what)
        return
    except (AttributeError, OSError):   # no pidfd (Linux before 5.3, another system): poll
        fd = None

    def wait() -> None:
        if _wait_exit(pid, fd, timeout):
            logger.debug("celery-threads: pool process %s exited; ending %s", pid, what)
        elif anyway:
            logger.warning("celery-threads: pool process %s still runs %ss after %s timed out; "
                           "ending it in its thread all the same", pid, timeout, what)
        else:
            logger.warning("celery-threads: pool process %s still runs %ss after deleted member "
                           "%s was signalled (its code ignores the signal?); it leaves its thread "
                           "when its body returns or its lease lapses", pid, timeout, what)
            return
        _run_logged(action, what)

    threading.Thread(target=wait, name="celery-threads-when-gone", daemon=True).start()


def _wait_exit(pid: int, fd: Optional[int], timeout: float) -> bool:
    """Whether process ``pid`` (``fd`` its pidfd, or ``None``) exited within ``timeout`` s."""
    if fd is not None:
        try:
            poll = select.poll()
            poll.register(fd, select.POLLIN)     # readable once the process has exited
            return bool(poll.poll(timeout * 1000))
        finally:
            os.close(fd)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)     # succeeds until the pool reaps its exited process
        except ProcessLookupError:
            return True
        except OSError:
            pass
        time.sleep(0.01)
    return False


def _run_logged(action: Callable[[], Any], what: str) -> None:
    try:
        action()
    except Exception:
        logger.exception("celery-threads: could not end %s in its thread; its lease will lapse",
                         what)


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
        outcome = runtime.apply(runtime.gate.fail(thread_id, task_id, token,
                                                  f"WorkerLostError: {exc}; no retries were left",
                                                  holder=pool_holder(request)))
        logger.warning("celery-threads: the pool process running %s of thread %s by handoff was "
                       "lost (%s)", task_id, thread_id, exc)
        # No request of it reaches Celery's handling in this process: its state is stored here,
        # final only when it died.
        if outcome.status == Lapse.DIED:
            runtime.announce_death(thread_id, task_id, f"WorkerLostError: {exc}", 0)
            request.task.backend.mark_as_failure(task_id, exc)
        elif outcome.status == Lapse.RETRIED:
            request.task.backend.mark_as_retry(task_id, exc)
    except Exception:
        logger.exception("celery-threads: could not fail %s of thread %s; its lease will lapse",
                         task_id, thread_id)


def on_task_revoked(sender: Any = None, request: Any = None, terminated: bool = False,
                    expired: bool = False, **kwargs: Any) -> None:
    """A revoked member (revoke on receipt, terminate while running, expired) leaves its thread:
    at once, or, terminated in a pool process (prefork), once that process has exited."""
    if not is_threaded(sender) or request is None:
        return
    headers = request.headers or {}      # the request's context (Celery sends no Request)
    token = headers.get(TOKEN_HEADER)
    if not token:
        return
    runtime = get_runtime(sender.app)
    running = _terminating.pop(request.id, None) if terminated else None
    if running is not None:
        pid, holder = running
        _delete_once_stopped(runtime, str(headers.get(THREAD_HEADER) or ""), request.id,
                             str(token), pid, holder)
        return
    runtime.apply(runtime.gate.delete(request.id, token=token))


#: task id -> (pid, claimant prefix) of the pool process (prefork) running it, noted by the revoke
#: command just before Celery's terminate signals that process; read by :func:`on_task_revoked`
#: (Celery forgets the request, and its pool process, before it sends ``task_revoked``).
_terminating: dict[str, tuple[int, Optional[str]]] = {}


def _note_terminating(task_ids: Any) -> None:
    """Before Celery's ``revoke(terminate=True)``: which pool process of this worker runs each of
    ``task_ids``.  Not one that runs in the worker's own process (threads, solo, gevent pools),
    which cannot be stopped."""
    _terminating.clear()
    for task_id in task_ids:
        request = worker_state.requests.get(task_id)
        pid = getattr(request, "worker_pid", None)
        if request is not None and pid and pid != os.getpid():
            _terminating[task_id] = (pid, pool_holder(request))


def _mark_deleted(runtime: Runtime, thread_id: Optional[str], task_id: str, token: str,
                  holder: Optional[str] = None) -> bool:
    """Mark a member this worker is about to stop as deleted in the gate; whether it was marked
    (``False``: it is gone, or was detached at once, since its claim did not say that its process
    can be stopped).  From then on, however else it ends (its own finish, a kill or fail, a
    retry, its lease's lapse), it ends as deleted, and its finish hands nothing to its process."""
    outcome = runtime.apply(runtime.gate.delete(task_id, token=token, stop=True,
                                                thread_id=thread_id or None, holder=holder))
    return outcome.info == STOPPING


def _delete_once_stopped(runtime: Runtime, thread_id: Optional[str], task_id: str, token: str,
                         pid: int, holder: Optional[str] = None, marked: bool = False) -> None:
    """A member terminated in pool process ``pid``: marked deleted at once (unless ``marked``
    already), and ended, which releases the next member, once that process has exited (a pidfd
    wait, as for the hard time limit): nothing of its code, ``finally`` blocks included, runs
    beside the next member.  A process still running ``threads_keepalive`` seconds later (code
    that ignores the signal) is left alone: its member leaves when its body returns (its finish
    ends it as deleted) or its lease lapses."""
    if not marked and not _mark_deleted(runtime, thread_id, task_id, token, holder):
        return

    def end() -> None:
        runtime.apply(runtime.gate.delete(task_id, token=token, thread_id=thread_id or None,
                                          holder=holder))

    when_gone(pid, end, runtime.config.keepalive, what=task_id, anyway=False)


def _end_revoked_member(runtime: Runtime, consumer: Any, task_id: str) -> None:
    """A waiting member revoked by a plain ``revoke`` leaves its thread here; one deleted by
    ``Threads.delete`` is announced here.  Either way this worker sends ``task-revoked``."""
    deleted = runtime.apply(runtime.gate.delete(task_id, only_waiting=True)).done
    if deleted:
        runtime.mark_revoked(task_id)
    if deleted or runtime.gate.take_deleted_note(task_id):
        dispatcher = consumer.event_dispatcher
        if dispatcher is not None and dispatcher.enabled:
            dispatcher.send("task-revoked", uuid=task_id, terminated=False, signum=None,
                            expired=False)


def _terminate_handed_off(runtime: Runtime, task_id: str, signal: Any) -> None:
    """``revoke(terminate=True)`` of a member a pool process runs by handoff (handoff.py), which
    Celery's own revoke does not know of.  As for a terminated task: the member is marked deleted
    (fenced by its token), its process gets the signal, the member leaves its thread once the
    process has exited (the next is promoted then), and the result backend marks it REVOKED.

    The signal is fenced too: it is sent only if, once the member is marked deleted in the gate,
    the process's slot still names that member under that token.  Until then the process may
    have finished it and be running a later member (its finish handed it one): that one is not
    signalled.  From the gate's mark on, the member's own finish can no longer hand the process
    a later member, so a slot that still names it after the mark means that the process is
    still in that member's pool job.  What remains is the time between the slot's last read and
    the signal: the process would have to end that job and start another one, which only this
    process (the worker's main process) gives it, from this same thread, and with Celery's
    default ``-O fair`` only to an idle process (``-O fast`` may have queued one in its pipe
    already, a window of the few microseconds before the signal).  Where the system has
    pidfds, the signal goes through one opened at the first read, so it never reaches another
    process that has taken the pid since."""
    from celery.platforms import signals as platform_signals
    from celery.worker.control import TERM_SIGNAME

    found = handoff.running(task_id)
    if found is None:
        return
    pid, (thread_id, _, token) = found
    pidfd = _open_pidfd(pid)      # from here on, the signal reaches that process or none
    try:
        marked = _mark_deleted(runtime, thread_id, task_id, token)
        if handoff.running(task_id) != found:
            logger.info("celery-threads: not terminating %s: pool process %s no longer runs it "
                        "by handoff (token %s)", task_id, pid, token)
            return
        signum = platform_signals.signum(signal or TERM_SIGNAME)
        logger.info("celery-threads: terminating %s, run by handoff in pool process %s (%s)",
                    task_id, pid, signal or TERM_SIGNAME)
        try:
            if pidfd is not None:
                _signal.pidfd_send_signal(pidfd, signum)
            else:
                os.kill(pid, signum)
        except ProcessLookupError:
            pass    # it has just exited: the main process fails its member as lost
        if marked:
            _delete_once_stopped(runtime, thread_id, task_id, token, pid, marked=True)
    finally:
        if pidfd is not None:
            os.close(pidfd)
    runtime.mark_revoked(task_id)


def _open_pidfd(pid: int) -> Optional[int]:
    """A pidfd of ``pid`` (Linux 5.3+), or ``None``."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


def wrap_revoke_command() -> None:
    """``app.control.revoke(id)`` of a member still waiting in the gate deletes it (a worker is the
    only place that sees a plain revoke).  A released or running member ends as usual when a
    worker discards or terminates it."""
    from celery.utils.functional import maybe_list

    if not seams.active("revoke-command"):
        return
    original, install = seams.revoke_command()
    if getattr(original, "_celery_threads", False):
        return

    def revoke(state: Any, task_id: Any, terminate: bool = False, signal: Any = None,
               **kwargs: Any) -> Any:
        if terminate:
            _note_terminating(maybe_list(task_id) or [])
        try:
            reply = original(state, task_id, terminate=terminate, signal=signal, **kwargs)
        finally:
            _terminating.clear()
        consumer = state.consumer
        if getattr(consumer.app, "_celery_threads_installed", False):
            runtime = get_runtime(consumer.app)
            for one in maybe_list(task_id) or []:
                try:
                    _end_revoked_member(runtime, consumer, one)
                    if terminate:
                        _terminate_handed_off(runtime, one, signal)
                except Exception:
                    logger.exception("celery-threads: could not end revoked member %s", one)
        return reply

    revoke._celery_threads = True  # type: ignore[attr-defined]
    revoke.__doc__ = original.__doc__
    install(revoke)


class LeaseRenewer:
    """Every keepalive/3, renews the release deadline of each threaded member this worker holds
    unclaimed in its prefetch buffer.  A claimed member's lease is renewed by the process that
    claimed it, with its claimant (:class:`celery_threads.worker.lease.Keeper`); the gate refuses this
    renewal for it.  A native thread (:mod:`celery_threads.worker.native`): under gevent, a member's code
    holding the hub does not hold up these renewals either."""

    def __init__(self, runtime: Runtime, tick: Any = None) -> None:
        self.runtime = runtime
        self.tick = tick
        self._stop = native.Flag()
        self._thread: Optional[native.NativeThread] = None

    def start(self) -> None:
        self._thread = native.NativeThread(self._run, "celery-threads-renew")
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def held(self) -> list[tuple[str, str, str]]:
        members = []
        for request in list(worker_state.reserved_requests):
            thread_id, token = request_member(request)
            if token:
                members.append((thread_id, request.id, token))
        return members

    def _run(self) -> None:
        period = self.runtime.config.keepalive / 3.0
        gate = self.runtime.own_gate() if native.green() else self.runtime.gate
        while True:
            members = self.held()
            if self._stop.is_set() and not members:
                return
            if members:
                try:
                    renewed = gate.renew_many(members, self.runtime.config.keepalive_ms)
                    for (thread_id, task_id, _), status in zip(members, renewed):
                        if status == Renewal.STALE:
                            logger.debug("celery-threads: %s no longer holds thread %s", task_id,
                                         thread_id)
                except Exception:
                    logger.exception("celery-threads: could not renew leases; retrying")
            if self._stop.is_set():
                self._stop.wait(0.2)
                continue
            # The tick (the handoff's flag) runs every second; renewals every keepalive/3.
            deadline = time.monotonic() + period
            while not self._stop.is_set() and time.monotonic() < deadline:
                tick = self.tick
                if tick is not None:
                    try:
                        tick()
                    except Exception:
                        logger.exception("celery-threads: worker tick failed")
                self._stop.wait(min(1.0, max(deadline - time.monotonic(), 0.0)))


class ThreadsWorkerStep(bootsteps.StartStopStep):
    """Installed in every worker of an app with threaded tasks: renewer, lease watchdog and
    dispatch loop."""

    label = "celery-threads"

    def __init__(self, worker: Any, **kwargs: Any) -> None:
        self.renewer: Optional[LeaseRenewer] = None
        self.watchdog: Optional[lease.Watchdog] = None
        self.loop: Any = None
        config = read_config(worker.app)
        problem = unreachable(config)
        if problem is not None:
            # As Celery's own "Cannot connect to ...": at once, then the dispatch loop goes on
            # saying so while the gate does not answer.
            logger.error("celery-threads: cannot reach the gate's Redis at %s (threads_redis_url): "
                         "%s. Check that the server runs and accepts connections from here, and "
                         "the URL's host, port, password and TLS options (threads_redis_options); "
                         "the worker starts and keeps trying", sanitized_url(config.redis_url),
                         f"{type(problem).__name__}: {problem}")
        # Before the consumer fetches a release; raises when a seam that cannot fall back does
        # not hold (the worker does not start), else logs which seams are in use.
        self.fallen = seams.check_worker(worker.app, get_runtime(worker.app).client)
        handoff.prepare(worker)   # before the pool forks
        lease.prepare(handoff.pool_size(worker))

    def start(self, worker: Any) -> None:
        from ..dispatcher import DispatchLoop

        runtime = get_runtime(worker.app)
        wrap_revoke_command()
        hand_back_on_pool_close(worker)
        self.renewer = LeaseRenewer(runtime, tick=lambda: handoff.sync(worker))
        self.renewer.start()
        self.watchdog = lease.Watchdog(runtime.config.keepalive)
        self.watchdog.start()
        if runtime.config.worker_dispatch:
            self.loop = DispatchLoop(runtime)
            self.loop.start()
        pool = type(getattr(worker, "pool", None)).__module__
        if "eventlet" in pool:
            logger.warning("celery-threads: the eventlet pool is not covered: a member that holds "
                           "its hub past threads_keepalive (%ss) loses its lease and may run beside "
                           "the next one. Use prefork, threads, solo or gevent", runtime.config.keepalive)
        logger.info("celery-threads: ready: gate %s, keepalive %ss, dispatch every %ss; %s",
                    sanitized_url(runtime.config.redis_url), runtime.config.keepalive,
                    runtime.config.dispatch_interval,
                    "every fast path available" if not self.fallen else
                    f"{self.fallen} fast path(s) fell back to Celery's public API (see the "
                    "warning above)")

    def stop(self, worker: Any) -> None:
        handoff.sync(worker, stopping=True)
        if self.renewer is not None:
            self.renewer.tick = None
        if self.loop is not None:
            self.loop.stop()
        if self.renewer is not None:
            self.renewer.stop()   # keeps renewing what is still held, then ends
        if self.watchdog is not None:
            self.watchdog.stop()

    def shutdown(self, worker: Any) -> None:
        self.stop(worker)
