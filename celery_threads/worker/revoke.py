"""Revoking threaded members: Celery's revoke command and its ``task_revoked`` signal.

* A plain ``revoke`` of a member still waiting in the gate deletes it from its thread, and a
  member ``Threads.delete`` deleted is announced (:func:`wrap_revoke_command`).
* A revoked member leaves its thread (:func:`on_task_revoked`); one terminated in a pool process
  leaves it only once that process has exited, so that nothing of its code runs beside the next
  member.
* ``revoke(terminate=True)`` also reaches a member a pool process runs by in-process handoff,
  which Celery's own revoke does not know of.
"""

from __future__ import annotations

import os
import signal as _signal
from typing import Any, Optional

from celery.worker import state as worker_state
from celery.worker.control import control_command

from .. import seams
from ..gate import STOPPING, deadline
from ..logs import get_logger
from ..protocol import RETRIED_COMMAND, THREAD_HEADER, TOKEN_HEADER, is_threaded
from ..runtime import Runtime, get_runtime
from . import handoff
from .processes import open_pidfd, pool_holder, process_of, when_gone

logger = get_logger(__name__)


def on_task_revoked(
    sender: Any = None, request: Any = None, terminated: bool = False, expired: bool = False, **kwargs: Any
) -> None:
    """A revoked member (revoke on receipt, terminate while running, expired) leaves its thread:
    at once, or, terminated in a pool process (prefork), once that process has exited."""
    if not is_threaded(sender) or request is None:
        return
    headers = request.headers or {}  # the request's context (Celery sends no Request)
    token = headers.get(TOKEN_HEADER)
    if not token:
        return
    runtime = get_runtime(sender.app)
    running = _terminating.pop(request.id, None) if terminated else None
    if running is not None:
        pid, holder = running
        _delete_once_stopped(
            runtime, str(headers.get(THREAD_HEADER) or ""), request.id, str(token), pid, holder
        )
        return
    runtime.publish_outcome(runtime.gate.delete(request.id, token=token))


#: The reason a member re-marked REVOKED by :func:`on_task_retry` is given.
LEFT_AS_IT_RETRIED = "left its thread unrun (deleted, purged, superseded or expired) as its retry was stored"


def on_task_retry(sender: Any = None, request: Any = None, **kwargs: Any) -> None:
    """After Celery stored a member's ``RETRY`` (``task_retry`` comes after it): the member had
    re-entered its thread before that (its ending, in ``member.run``), so a delete, purge,
    supersede or expiry that took it from its thread in between stored ``REVOKED`` first, which
    ``RETRY`` then overwrote: the result read RETRY for good.  A member that is no longer in the
    gate (nor dead) is marked ``REVOKED`` again; not counted again in its chord.  One read of the
    gate per retry."""
    if not is_threaded(sender) or request is None:
        return
    headers = request.headers or {}
    thread_id = str(headers.get(THREAD_HEADER) or "")
    if not thread_id or not headers.get(TOKEN_HEADER):
        return
    runtime = get_runtime(sender.app)
    try:
        if runtime.gate.reads.record(request.id, thread_id) is not None:
            return  # waiting for its retry (or released, running): RETRY holds until then
        if runtime.gate.reads.dead_record(request.id) is not None:
            return
    except Exception:
        logger.debug("celery-threads: could not check %s after its retry", request.id, exc_info=True)
        return
    logger.info(
        "celery-threads: %s[%s] of thread %s left its thread as its retry was stored; revoked",
        sender.name,
        request.id,
        thread_id,
    )
    runtime.mark_revoked(request.id, LEFT_AS_IT_RETRIED, count_in_chord=False, request=dict(vars(request)))


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
        pid = process_of(request)
        if request is not None and pid and pid != os.getpid():
            _terminating[task_id] = (pid, pool_holder(request))


def _handed_on(task_ids: list[str]) -> list[str]:
    """Those of ``task_ids`` whose body has returned while their pool job goes on, running the
    next member of their thread by handoff: Celery still holds their request, and its terminate
    would signal the process, killing that other member."""
    returned = []
    for task_id in task_ids:
        request = worker_state.requests.get(task_id)
        if request is not None and handoff.runs_another(getattr(request, "worker_pid", None), task_id):
            logger.info(
                "celery-threads: not terminating %s: its body has returned, and its pool process "
                "runs the next member of its thread by handoff",
                task_id,
            )
            returned.append(task_id)
    return returned


def _mark_deleted(
    runtime: Runtime, thread_id: Optional[str], task_id: str, token: str, holder: Optional[str] = None
) -> bool:
    """Mark a member this worker is about to stop as deleted in the gate; whether it was marked
    (``False``: it is gone, or was detached at once, since its claim did not say that its process
    can be stopped).  From then on, however else it ends (its own finish, a kill or fail, a
    retry, its lease's lapse), it ends as deleted, and its finish hands nothing to its process."""
    outcome = runtime.publish_outcome(
        runtime.gate.delete(task_id, token=token, stop=True, thread_id=thread_id or None, holder=holder)
    )
    return outcome.info == STOPPING


def _delete_once_stopped(
    runtime: Runtime,
    thread_id: Optional[str],
    task_id: str,
    token: str,
    pid: int,
    holder: Optional[str] = None,
    marked: bool = False,
) -> None:
    """A member terminated in pool process ``pid``: marked deleted at once (unless ``marked``
    already), and ended, which releases the next member, once that process has exited (a pidfd
    wait, as for the hard time limit): nothing of its code, ``finally`` blocks included, runs
    beside the next member.  A process still running ``threads_keepalive`` seconds later (code
    that ignores the signal) is left alone: its member leaves when its body returns (its finish
    ends it as deleted) or its lease lapses."""
    if not marked and not _mark_deleted(runtime, thread_id, task_id, token, holder):
        return

    def end() -> None:
        runtime.publish_outcome(
            runtime.gate.delete(task_id, token=token, thread_id=thread_id or None, holder=holder)
        )

    when_gone(pid, end, runtime.config.keepalive, what=task_id, anyway=False)


def _end_revoked_member(runtime: Runtime, consumer: Any, task_id: str) -> None:
    """A waiting member revoked by a plain ``revoke`` leaves its thread here; one deleted by
    ``Threads.delete`` is announced here.  Either way this worker sends ``task-revoked``."""
    # Its thread, and its message for its chord, read while it is a member (the delete drops it).
    record = runtime.gate.reads.record(task_id)
    deleted = False
    if record is not None:
        outcome = runtime.gate.delete(task_id, only_waiting=True, thread_id=record.thread_id)
        deleted = runtime.publish_outcome(outcome).done
        if deleted:
            runtime.mark_revoked(task_id, envelope=record.envelope, retries=record.retries)
    expired = None if deleted else runtime.gate.take_deleted_note(task_id)
    if deleted or expired is not None:
        dispatcher = consumer.event_dispatcher
        if dispatcher is not None and dispatcher.enabled:
            dispatcher.send(
                "task-revoked", uuid=task_id, terminated=False, signum=None, expired=bool(expired)
            )


@control_command(
    name=RETRIED_COMMAND,
    args=[("note", str), ("members", list)],
    signature="<note> [[task_id, exception], ...]",
    help="celery-threads: announce dead letters put back into their threads (task-retried)",
)
def announce_retried(state: Any, note: str, members: list[list[str]], **kwargs: Any) -> None:
    """``task-retried`` for dead letters an operator put back into their threads (``restart``,
    ``redrive``), sent by the one worker that takes the gate's note (Flower makes a worker of the
    sender of any task event but ``task-sent``), before they can be released: Flower shows them
    retried, then their new run, where it kept showing the first run's FAILURE until the new run
    ended (a ready state outranks ``task-received`` and ``task-started``; ``task-retried`` does
    not).  The note goes once the events are flushed out: ``Threads`` waits for that."""
    dispatcher = state.consumer.event_dispatcher
    if dispatcher is None or not dispatcher.enabled:
        return  # another worker, one that sends events, takes it
    gate = get_runtime(state.consumer.app).gate
    # The consumer's own thread: a gate that does not answer holds it up for a second at most
    # (the caller gives up on the note after half as long).
    try:
        with deadline.within(ANNOUNCE_BOUND, bound="the announcement of retried members"):
            if not gate.take_announcement(note):
                return
    except Exception:
        logger.debug("celery-threads: could not take announcement %s", note, exc_info=True)
        return
    try:
        for task_id, exception in members:
            dispatcher.send("task-retried", uuid=task_id, exception=exception, traceback="")
        dispatcher.flush()
    finally:
        try:
            with deadline.within(ANNOUNCE_BOUND, bound="the announcement of retried members"):
                gate.end_announcement(note)
        except Exception:  # its TTL drops it; its caller stops waiting for it
            logger.debug("celery-threads: could not end announcement %s", note, exc_info=True)


#: The most the announcement's gate calls hold up the worker's consumer (seconds each).
ANNOUNCE_BOUND = 1.0


def _terminate_handed_off(runtime: Runtime, task_id: str, signal: Any) -> bool:
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
        return False
    pid, (thread_id, _, token) = found
    pidfd = open_pidfd(pid)  # from here on, the signal reaches that process or none
    try:
        marked = _mark_deleted(runtime, thread_id, task_id, token)
        if handoff.running(task_id) != found:
            logger.info(
                "celery-threads: not terminating %s: pool process %s no longer runs it by handoff (token %s)",
                task_id,
                pid,
                token,
            )
            return False
        signum = platform_signals.signum(signal or TERM_SIGNAME)
        logger.info(
            "celery-threads: terminating %s, run by handoff in pool process %s (%s)",
            task_id,
            pid,
            signal or TERM_SIGNAME,
        )
        signalled = False
        try:
            if pidfd is not None:
                _signal.pidfd_send_signal(pidfd, signum)
            else:
                os.kill(pid, signum)
        except ProcessLookupError:
            pass  # it has just exited: the main process fails its member as lost
        else:
            signalled = True
            # As Celery announces a task it terminated (Request._announce_revoked): Flower
            # showed the member started for good.
            if runtime.send_task_event is not None:
                runtime.send_task_event(
                    "task-revoked", uuid=task_id, terminated=True, signum=signum, expired=False
                )
        if marked:
            _delete_once_stopped(runtime, thread_id, task_id, token, pid, marked=True)
    finally:
        if pidfd is not None:
            os.close(pidfd)
    runtime.mark_revoked(task_id, "terminated")
    return signalled


def _terminated_reply(reply: Any, task_ids: list[str]) -> Any:
    """Celery's ``terminate: ...`` reply with ``task_ids`` (run by handoff) named too."""
    from celery.worker.control import ok

    prefix = "terminate: "
    said = reply.get("ok", "") if isinstance(reply, dict) else ""
    known = [said[len(prefix) :]] if said.startswith(prefix) and said != prefix + "tasks unknown" else []
    return ok(prefix + ", ".join([*known, *task_ids]))


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

    def revoke(state: Any, task_id: Any, terminate: bool = False, signal: Any = None, **kwargs: Any) -> Any:
        ids = list(maybe_list(task_id) or [])
        returned = _handed_on(ids) if terminate else []
        if returned:
            # Flagged as revoked, as Celery flags a task that has ended: no signal.
            reply = original(state, returned, terminate=False, signal=signal, **kwargs)
            ids = [one for one in ids if one not in returned]
        if ids or not returned:
            if terminate:
                _note_terminating(ids)
            try:
                reply = original(state, ids, terminate=terminate, signal=signal, **kwargs)
            finally:
                _terminating.clear()
        consumer = state.consumer
        if getattr(consumer.app, "_celery_threads_installed", False):
            runtime = get_runtime(consumer.app)
            handed_off = []
            for one in maybe_list(task_id) or []:
                try:
                    _end_revoked_member(runtime, consumer, one)
                    if terminate and _terminate_handed_off(runtime, one, signal):
                        handed_off.append(one)
                except Exception:
                    logger.exception("celery-threads: could not end revoked member %s", one)
            if handed_off:  # Celery's reply knew only of the tasks it terminated itself
                reply = _terminated_reply(reply, handed_off)
        return reply

    revoke._celery_threads = True  # type: ignore[attr-defined]
    revoke.__doc__ = original.__doc__
    install(revoke)
