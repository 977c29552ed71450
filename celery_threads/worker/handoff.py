"""In-process handoff: a pool process runs the member that its own ``finish`` released.

When a member succeeds, the next member of its thread is usually due at once. Publishing it
would send it through the broker and the worker's main process only to reach a pool process
again, and on RabbitMQ that round trip costs more than the task itself. So a prefork pool
process that has just finished a member asks the gate to hand it the release instead of
publishing it (``finish`` with ``keep_release``), and runs that member itself. The run starts once
the first member's own trace has ended, with its result stored and its signals sent, and it
continues the same pool job.

The fencing is unchanged. The same ``finish`` releases the member under a new token and
claims it for this process (one round trip where a release and a claim took two), and its run
starts under that token (``ThreadedTask.__call__`` takes the claim instead of making one). If
the member cannot run here after all (the conditions below), it is given back, RELEASED under
the same token, and published. From the claim on, this process's slot (:mod:`.shared`) names
the member, whatever its thread id and task id, so that the worker's main process fails it at
once if the process is lost (a failed attempt, as for any member whose process dies).  While it
runs, this process holds its lease (:mod:`celery_threads.worker.lease`) from the moment of the
claim, through the rest of the previous member's trace, and starts it only while that lease
holds.  The main process learns of it only from the slot, to fail it or to terminate it on
``revoke(terminate=True)``.

A member runs here only where a broker delivery would have brought it to this worker with
nothing more to it. Otherwise its release is published as before. The conditions are:

* the worker is a prefork worker and not shutting down (from the moment its main process is told
  to stop: :func:`shutting_down`; a member claimed before, and not started yet, is given back).
  While it sends task events, the pool process sends a handed-off member's events itself, so
  Flower and ``celery events`` see it as any task (:class:`_Events`);
* the pool job has run for less than ``threads_local_handoff`` seconds (default 1.0; 0 turns the
  handoff off). The job, and the report of its first member to the worker's main process, never
  outlast that budget by more than one member's run;
* neither member has a time limit, nor the worker (``--time-limit``, ``task_time_limit``: the pool
  enforces limits per job);
* the next member's task has no ``rate_limit`` (the worker's main process holds its deliveries in
  Celery's bucket); a limit set at run time (``celery control rate_limit``) on any threaded task
  turns the handoff off while it lasts;
* the next member's task is a threaded task registered here, with the package's own
  ``Request`` class (a task's own is for its worker to make), its queue is one this worker
  consumes, its content type is accepted, and it carries no ``expires``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Any, Callable, NamedTuple, Optional

from .. import seams
from ..errors import UndecodableEnvelope
from ..gate import DELETED, Release
from ..logs import get_logger
from ..protocol import THREAD_HEADER, THREADED_REQUEST, TOKEN_HEADER, is_threaded
from ..publish import decode_envelope
from ..runtime import Runtime, get_runtime
from . import shared
from .lease import Lease, keeper
from .shared import Member

logger = get_logger(__name__)

#: Set in the worker's main process before its pool forks; read by every pool process.
_app: Any = None
_allowed: Any = None  # the shared flag (:func:`.shared.handoff_flag`): OFF, ON, EVENTS
OFF, ON, EVENTS = 0, 1, 2  # EVENTS: on, and the pool process sends the task events
_stopping = False
_limited = False  # in the main process: whether a rate limit set at run time turned it off
_main_pid = 0  # the worker's main process (prepare's)
#: In the main process: the slots (index -> sequence number) whose member it has failed as lost,
#: so that a later read does not report that member again (a slot is written by its pool process
#: only, so the main process does not clear it).
_reported: dict[int, int] = {}
#: How long the main process waits for a slot that its pool process is rewriting (a write takes
#: microseconds; a process preempted in the middle of one, longer), and for one whose process died
#: (it may have stopped in mid-write: then that member's lease lapses instead).
_PATIENCE = 0.5
_PATIENCE_LOST = 0.05


class Taken(NamedTuple):
    """A release this process runs itself: the pool job's arguments for it, and when ``finish``
    claimed it for this process (the Redis server's clock, ms)."""

    release: Release
    name: str
    request: dict[str, Any]
    body: bytes
    content_type: str
    content_encoding: str
    claimed_ms: int = 0
    lease: Optional[Lease] = None


class _Job:
    """The pool job running in this process, and the release it runs next."""

    __slots__ = ("started", "pending")

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.pending: Optional[Taken] = None


_job: Optional[_Job] = None
#: (task id, token, claim time in ms, lease) of the member this process is about to run by
#: handoff, claimed by its predecessor's ``finish``: its ``ThreadedTask.__call__`` takes it instead
#: of claiming (:func:`take_claim`).
_claimed: Optional[tuple[str, str, int, Lease]] = None


class Ending:
    """What a member's ending keeps across its attempts (the gate may not answer one, and the
    ending is sent again): the call's id (``caller``: the member's claimant), the claimant the
    next member is claimed for, when the first attempt sent (monotonic), and whether it took the
    handoff's way.  A replay must be the same call."""

    __slots__ = ("caller", "claimant", "sent", "handoff")

    def __init__(self, caller: str, claimant: str) -> None:
        self.caller = caller
        self.claimant = claimant
        self.sent: Optional[float] = None
        self.handoff: Optional[bool] = None


# -- the worker's main process ----------------------------------------------------------------
def prepare(worker: Any) -> None:
    """Before the pool forks, once the shared memory is made (:func:`.shared.prepare`): the
    flag its processes read."""
    global _app, _allowed, _stopping, _main_pid, _worker_time_limit
    _app, _stopping, _main_pid = worker.app, False, os.getpid()
    # The worker's own limits (--time-limit, --soft-time-limit, or task_time_limit and
    # task_soft_time_limit as the worker read them), which its pool applies to every job.
    _worker_time_limit = bool(getattr(worker, "time_limit", None) or getattr(worker, "soft_time_limit", None))
    _allowed = shared.handoff_flag()
    _allowed.value = EVENTS if getattr(worker, "task_events", False) else ON
    _reported.clear()
    _stop_before_soft_shutdown(worker)


def _stop_before_soft_shutdown(worker: Any) -> None:
    """A cold shutdown (SIGQUIT) with ``worker_soft_shutdown_timeout`` (Celery 5.5+) first waits
    that long for the running tasks, and only then sends ``worker_shutting_down``: meanwhile a
    pool process would take the next member by handoff, which the shutdown then cuts off (a
    lost attempt, or a death).  The flag is lowered as that wait begins."""
    soft = getattr(worker, "wait_for_soft_shutdown", None)
    if soft is None or getattr(soft, "_celery_threads", False):
        return

    def wait_for_soft_shutdown(*args: Any, **kwargs: Any) -> Any:
        shutting_down()
        return soft(*args, **kwargs)

    wait_for_soft_shutdown._celery_threads = True  # type: ignore[attr-defined]
    worker.wait_for_soft_shutdown = wait_for_soft_shutdown


def _slot_members(patience: float = _PATIENCE) -> Iterator[tuple[int, int, int, Member]]:
    """``(index, seq, pid, member)`` of each pool process running a member by handoff, but for
    members already failed as lost."""
    slots = shared.handoff_slots()
    if slots is None:
        return
    for index, seq, pid, member in slots.members(patience):
        if _reported.get(index) != seq:
            yield index, seq, pid, member


def running(task_id: str) -> Optional[tuple[int, tuple[str, str, str]]]:
    """``(pid, (thread id, task id, token))`` of the pool process running ``task_id`` by
    handoff, if any."""
    for _, _, pid, member in _slot_members():
        if member.matches(task_id):
            return pid, (member.thread_id, task_id, member.token)
    return None


def runs_another(pid: Any, task_id: str) -> bool:
    """Whether pool process ``pid`` runs, by handoff, a member other than ``task_id``: then
    ``task_id``'s body, whose pool job this continues, has returned (its finish claimed that
    member), and a signal for ``task_id`` would reach the other member."""
    if not pid:
        return False
    return any(found == int(pid) and not member.matches(task_id) for _, _, found, member in _slot_members())


def runs_by_handoff(pid: Any) -> bool:
    """Whether pool process ``pid`` runs a member by handoff now (its job's own member ended)."""
    return bool(pid) and any(found == int(pid) for _, _, found, _ in _slot_members())


def lost_member(pid: Any) -> Optional[tuple[str, str, str]]:
    """``(thread id, task id, token)`` of the member the dead pool process ``pid`` was running by
    handoff, if any (reported once)."""
    if not pid:
        return None
    for index, seq, found, member in _slot_members(_PATIENCE_LOST):
        if found == int(pid):
            _reported[index] = seq
            task_id = member.task_id or _active_task_id(member)
            return None if task_id is None else (member.thread_id, task_id, member.token)
    return None


def _active_task_id(member: Member) -> Optional[str]:
    """The task id of a member whose slot holds only its digest (a task id too long for the
    slot): the thread's active member in the gate, when it is that member under that token
    (else it is no longer active there, and there is nothing to fail)."""
    try:
        [(active, _, _, _)] = get_runtime(_app).gate.reads.thread_summaries([member.thread_id])
    except Exception:
        logger.exception(
            "celery-threads: could not read the active member of thread %s from "
            "the gate; its lease will lapse",
            member.thread_id,
        )
        return None
    task_id = active.get("task")
    if task_id is None or active.get("token") != member.token or not member.matches(task_id):
        return None
    return task_id


def shutting_down() -> None:
    """``worker_shutting_down``: the worker's main process has just been told to stop (warm or
    cold), before any of its steps stops.  From now on no pool process takes a member by
    handoff: it goes through the broker, to a worker that is not stopping.  The steps stop later,
    and Celery stops the pool, which waits for the running tasks (whose successes would hand
    off members), before this package's step: so the flag is lowered here, at once."""
    global _stopping
    if _allowed is None or os.getpid() != _main_pid:
        return
    _stopping = True
    _allowed.value = OFF
    logger.info(
        "celery-threads: the worker is shutting down; its pool processes take no more "
        "members by handoff (the broker delivers them)"
    )


def sync(worker: Any, stopping: bool = False) -> None:
    """Keep the flag in step with the worker: off once it stops; EVENTS while it sends task
    events (which ``celery control enable_events``, or Flower, can turn on at any time)."""
    global _stopping, _limited
    if _allowed is None:
        return
    # A stop that sends no worker_shutting_down (SIGHUP's restart) sets Celery's flags only.
    _stopping = _stopping or stopping or _told_to_stop()
    dispatcher = getattr(getattr(worker, "consumer", None), "event_dispatcher", None)
    events = getattr(worker, "task_events", False)
    if dispatcher is not None:
        groups = getattr(dispatcher, "groups", None)
        events = bool(dispatcher.enabled) and (not groups or "task" in groups)
    limited = _limited_at_run_time(_app) if _app is not None else []
    if bool(limited) != _limited:
        _limited = bool(limited)
        if limited:
            logger.info(
                "celery-threads: in-process handoff off while a rate limit set at run time holds (%s)",
                ", ".join(limited),
            )
        else:
            logger.info("celery-threads: in-process handoff on again: no rate limit set at run time")
    _allowed.value = OFF if _stopping or limited else (EVENTS if events else ON)
    if _stopping:  # set meanwhile by shutting_down, in the main thread: it wins
        _allowed.value = OFF


def _told_to_stop() -> bool:
    """Whether Celery's worker state says the worker stops (warm, cold, or restarting)."""
    from celery.worker import state

    return any(flag is not None and flag is not False for flag in (state.should_stop, state.should_terminate))


# -- a pool process -----------------------------------------------------------------------------
def on_pool_process_start() -> None:
    """``worker_process_init``: wrap the functions pool jobs run, in this process only (the main
    process names them; a pool process looks them up by name when it unpickles a job)."""
    if _app is None or _allowed is None:
        return
    if get_runtime(_app).config.local_handoff <= 0 or not seams.active("handoff"):
        return
    for name, original in seams.trace_functions():
        if not getattr(original, "_celery_threads", False):
            seams.wrap_trace_function(name, _wrap(original))


def _wrap(original: Callable[..., Any]) -> Callable[..., Any]:
    def run_job(*args: Any, **kwargs: Any) -> Any:
        global _job
        job = _job = _Job()
        try:
            result = original(*args, **kwargs)
            if job.pending is not None and len(args) > 1:
                result = _ended_now(str(args[1]), result)
            # A member claimed before the worker began to stop, but not started yet, is given
            # back (below) once it is: it goes through the broker.
            while job.pending is not None and _allowed.value != OFF:
                taken, job.pending = job.pending, None
                _run(original, taken)
            return result
        finally:
            _job = None
            if job.pending is not None:  # the job ended abnormally: the member goes out
                _give_back(job.pending.release, job.pending.lease)
            if shared.index() is not None:
                _note(None)
            if _dispatchers:
                _flush_events()

    run_job._celery_threads = True  # type: ignore[attr-defined]
    run_job.__name__ = getattr(original, "__name__", "run_job")
    return run_job


class EventSent(float):
    """A pool job's runtime, when this pool process has sent the job's own member's ending
    event already (see :func:`_ended_now`): the worker's main process sends none."""


def _ended_now(task_id: str, result: Any) -> Any:
    """The job's own member ended, and the job goes on to run the next member of its thread:
    its ending event is sent now (while the worker sends task events), not when the job ends,
    a handed-off run later (Flower showed both members started meanwhile, and the first one
    started for good when the next was terminated).  Returns the job's result, its runtime
    marked :class:`EventSent`."""
    if _allowed is None or _allowed.value != EVENTS or _app is None:
        return result
    try:
        failed, retval, runtime = result
    except (TypeError, ValueError):
        return result
    if failed or not isinstance(runtime, (int, float)):
        return result  # an Ignore (a replaced member's): its worker says it as before
    dispatcher = _dispatcher(None)
    _Events(dispatcher, task_id).ended(result)
    _flush_events()
    return (failed, retval, EventSent(runtime))


def finish(runtime: Runtime, task: Any, thread_id: str, task_id: str, token: str, ending: Ending) -> bool:
    """``finish`` of a member that ended in this process: the next member runs here when it can,
    else its release is published (or the gate has published it).  Returns whether the member
    ended as deleted (deleted while it ran): its successor then goes through the broker, since
    the worker's main process is about to stop this process."""
    job = _job
    if ending.handoff is None:
        ending.handoff = job is not None and _may_take(runtime, task, job)
    if ending.sent is None:
        ending.sent = time.monotonic()
    if not ending.handoff or job is None:
        return (
            runtime.publish_outcome(runtime.gate.finish(thread_id, task_id, token, caller=ending.caller)).info
            == DELETED
        )
    # One round trip: the next member is released and claimed for this process at once.
    outcome = runtime.gate.finish(
        thread_id,
        task_id,
        token,
        keep_release=True,
        claim=(task.request.hostname or "", ending.claimant),
        caller=ending.caller,
    )
    if outcome.info == DELETED:  # nothing was claimed for this process
        runtime.publish(outcome.release)
        return True
    release = outcome.release
    if release is None:
        return False
    # Held (renewed) from now on: the rest of this member's trace may take a while.
    lease = keeper(runtime).lease(
        release.thread_id, release.task_id, release.token, ending.claimant, ending.sent
    )
    taken = _runnable(runtime, release)
    if taken is None:
        _give_back(release, lease)
        return False
    job.pending = taken._replace(claimed_ms=int(outcome.info or 0), lease=lease)
    _note(release)  # from now on, the worker fails it at once if this process is lost
    return False


def take_claim(task_id: str, token: str) -> Optional[tuple[int, Lease]]:
    """The claim time (ms) and lease of ``(task_id, token)`` when its predecessor's ``finish``
    claimed it for this process (it runs by handoff), else ``None``: the caller claims it."""
    global _claimed
    claimed = _claimed
    if claimed is None or claimed[0] != task_id or claimed[1] != token:
        return None
    _claimed = None
    return claimed[2], claimed[3]


def _give_back(release: Release, lease: Optional[Lease]) -> None:
    """A member ``finish`` claimed for this process, which will not run it: RELEASED again under
    its token, and published."""
    runtime = get_runtime(_app)
    if lease is not None:
        keeper(runtime).drop(lease)
    try:
        runtime.publish_outcome(runtime.gate.unclaim(release.thread_id, release.task_id, release.token))
    except Exception:
        logger.exception(
            "celery-threads: could not give back %s of thread %s; its lease will "
            "lapse and the attempt will count as failed",
            release.task_id,
            release.thread_id,
        )


def _may_take(runtime: Runtime, task: Any, job: _Job) -> bool:
    return (
        _allowed is not None
        and _allowed.value != OFF
        and time.monotonic() - job.started < runtime.config.local_handoff
        and not _time_limited(task, task.request.timelimit)
    )


class _Facts(NamedTuple):
    """What this pool process needs to know of its worker, read once (``app.conf`` lookups cost
    microseconds each, on every member)."""

    conf_time_limit: bool  # the worker's limit, or task_time_limit or task_soft_time_limit, set
    accepted: frozenset[str]  # content types the worker accepts
    routes: frozenset[tuple[str, str]]  # (exchange, routing key) reaching a consumed queue


_facts: Optional[_Facts] = None
_worker_time_limit = False  # set by prepare() in the worker's main process, inherited by the pool


def _worker_facts(app: Any) -> _Facts:
    global _facts
    if _facts is None:
        from kombu.serialization import prepare_accept_content

        routes = set()
        for queue in app.amqp.queues.consume_from.values():
            routes.add(("", queue.name))  # the default exchange: the queue's own name
            if queue.exchange is not None and queue.exchange.type == "direct":
                routes.add((queue.exchange.name, queue.routing_key))
        accepted = prepare_accept_content(app.conf.accept_content)  # type: ignore[no-untyped-call]
        _facts = _Facts(
            bool(_worker_time_limit or app.conf.task_time_limit or app.conf.task_soft_time_limit),
            frozenset(accepted),
            frozenset(routes),
        )
    return _facts


def _time_limited(task: Any, timelimit: Any) -> bool:
    if _worker_facts(task.app).conf_time_limit or task.time_limit or task.soft_time_limit:
        return True
    return bool(timelimit) and any(timelimit)


def _rate_limited(task: Any) -> bool:
    """Whether the worker's main process would hold the task in Celery's rate-limit bucket: a
    member run here would skip it.  A limit set at run time (``celery control rate_limit``)
    reaches the main process only: :func:`sync` turns the handoff off for it."""
    return bool(task.rate_limit) and not task.app.conf.worker_disable_rate_limits


def _limited_at_run_time(app: Any) -> list[str]:
    """The threaded tasks with a rate limit other than their own (``celery control rate_limit``,
    which sets it in the worker's main process, not in its pool processes)."""
    if app.conf.worker_disable_rate_limits:
        return []
    return [
        task.name
        for task in list(app.tasks.values())
        if is_threaded(task) and task.rate_limit and task.rate_limit != type(task).rate_limit
    ]


def _runnable(runtime: Runtime, release: Release) -> Optional[Taken]:
    """The pool job's arguments for running ``release`` here, or ``None`` when a broker delivery
    must take it (see the module's conditions)."""
    app = runtime.app
    try:
        header, body = decode_envelope(release.envelope)
    except UndecodableEnvelope:
        return None  # published, and the publish kills it with the reason
    headers = dict(header["headers"])
    name = str(headers.get("task") or "")
    task = app.tasks.get(name)
    content_type = header.get("content_type")
    if (
        not is_threaded(task)
        or task.Request != THREADED_REQUEST  # a Request class of the task's own: its worker's to make
        or headers.get("expires")
        or header.get("compression")
        or not isinstance(content_type, str)
        or content_type not in _worker_facts(app).accepted
        or _time_limited(task, headers.get("timelimit"))
        or _rate_limited(task)
        or (header.get("exchange") or "", header.get("routing_key")) not in _worker_facts(app).routes
    ):
        return None
    headers.update(
        {
            "retries": release.retries,
            "eta": None,
            THREAD_HEADER: release.thread_id,
            TOKEN_HEADER: release.token,
        }
    )
    properties = dict(header.get("properties") or {})
    headers.update(
        {
            "properties": properties,
            "reply_to": properties.get("reply_to"),
            "correlation_id": properties.get("correlation_id"),
            "delivery_info": {
                "exchange": header.get("exchange") or "",
                "routing_key": header.get("routing_key"),
                "priority": properties.get("priority"),
                "redelivered": False,
            },
        }
    )
    return Taken(release, name, headers, body, content_type, str(header.get("content_encoding") or "utf-8"))


def _run(original: Callable[..., Any], taken: Taken) -> None:
    global _claimed
    release = taken.release
    lease = taken.lease
    assert lease is not None, "a handed-off member is run under the lease of its claim"
    logger.debug(
        "celery-threads: running %s[%s] of thread %s in this pool process",
        taken.name,
        release.task_id,
        release.thread_id,
    )
    events = _events(taken)
    _claimed = (release.task_id, release.token, taken.claimed_ms, lease)
    try:
        if events is not None:
            events.received()
        result = original(
            taken.name, release.task_id, taken.request, taken.body, taken.content_type, taken.content_encoding
        )
        _rejected(release, result)
        if events is not None:
            events.ended(result)
    except Exception:
        # Celery's tracer reports the task's own errors; this is one outside it.  The member is
        # RELEASED (its release deadline lapses) or RUNNING (its lease lapses): either way the
        # gate recovers it.
        logger.exception(
            "celery-threads: could not run %s[%s] of thread %s in this pool process",
            taken.name,
            release.task_id,
            release.thread_id,
        )
    finally:
        _claimed = None
        keeper(get_runtime(_app)).drop(lease)  # when the trace never reached the task's call


def _rejected(release: Release, result: Any) -> None:
    """A member run here that raised ``Reject(requeue=False)`` died (its ending killed it), but
    Celery's tracer leaves that failure to the worker's main process (``Request.on_failure``),
    which never hears of a member run here: marked ``FAILURE`` here, with its stored message as
    the request (its errbacks run, its chord fails), and the ``task_failure`` signal sent.  Its
    ``task-failed`` event is :class:`_Events`'s (a pool process sends none through the runtime)."""
    from billiard.einfo import ExceptionWithTraceback
    from celery.exceptions import Reject

    failed, retval, _ = result
    exc = getattr(retval, "exception", None) if failed else None
    if isinstance(exc, ExceptionWithTraceback):
        exc = exc.exc
    if isinstance(exc, Reject) and not exc.requeue:
        get_runtime(_app).mark_failed(release.task_id, exc, release.envelope, release.retries)


def _note(release: Optional[Release]) -> None:
    """Write (or clear) this process's slot: the member it runs by handoff."""
    index, slots = shared.index(), shared.handoff_slots()
    if index is None or slots is None:
        return
    member = None if release is None else Member(release.thread_id, release.task_id, release.token)
    try:
        slots.write(index, os.getpid(), member)
    except ValueError as exc:  # not a valid thread id: its lease lapse recovers it
        logger.warning(
            "celery-threads: %s of thread %s is not named in this process's handoff "
            "slot (%s); if the process is lost, it waits for its lease to lapse",
            member and member.task_id,
            member and member.thread_id,
            exc,
        )
        slots.write(index, os.getpid(), None)


class _Events:
    """The task events the worker's main process would send for a member it received, sent by
    this pool process for one it runs by handoff (while the worker sends task events: Flower and
    ``celery events`` then see it as any task): task-received, task-started, then task-succeeded,
    task-failed or task-retried."""

    def __init__(self, dispatcher: Any, taken: Any) -> None:
        """``taken``: the :class:`Taken` member, or the task id of the job's own member (whose
        ending alone is sent here)."""
        self.dispatcher = dispatcher
        self.taken = taken
        self.uuid = taken if isinstance(taken, str) else taken.release.task_id

    def send(self, kind: str, **fields: Any) -> None:
        try:
            self.dispatcher.send(kind, uuid=self.uuid, **fields)
        except Exception:  # best effort, as in Celery
            logger.warning("celery-threads: could not send %s of %s", kind, self.uuid, exc_info=True)

    def received(self) -> None:
        headers = self.taken.request
        self.send(
            "task-received",
            name=self.taken.name,
            args=headers.get("argsrepr", ""),
            kwargs=headers.get("kwargsrepr", ""),
            root_id=headers.get("root_id"),
            parent_id=headers.get("parent_id"),
            retries=headers.get("retries", 0),
            eta=None,
            expires=None,
        )
        self.send("task-started")
        # One message: these two, and the previous handed-off member's ending (held until now,
        # microseconds after it happened; the job's end flushes the last one).
        _flush_events()

    def ended(self, result: Any) -> None:
        """From the pool job's result, as ``Request.on_success`` / ``on_failure`` read it."""
        from billiard.einfo import ExceptionWithTraceback
        from celery.exceptions import Ignore, Reject, Retry
        from celery.utils.saferepr import saferepr
        from celery.utils.serialization import get_pickled_exception

        failed, retval, runtime = result
        if not failed:
            self.send("task-succeeded", result=retval, runtime=runtime)
            return
        exc = retval.exception
        if isinstance(exc, ExceptionWithTraceback):
            exc = exc.exc
        if isinstance(exc, Retry):
            self.send("task-retried", exception=saferepr(exc.exc), traceback=str(retval.traceback))
        elif isinstance(exc, Ignore) or (isinstance(exc, Reject) and exc.requeue):
            return
        else:
            self.send(
                "task-failed", exception=saferepr(get_pickled_exception(exc)), traceback=retval.traceback
            )


_dispatchers: list[Any] = []


def _events(taken: Taken) -> Optional[_Events]:
    """The events of ``taken``, when the worker sends task events and its task sends them."""
    if _allowed is None or _allowed.value != EVENTS or _app is None:
        return None
    task = _app.tasks.get(taken.name)
    if task is None or not getattr(task, "send_events", True):
        return None
    return _Events(_dispatcher(taken.request.get("hostname")), taken)


def _dispatcher(hostname: Any) -> Any:
    """This pool process's event dispatcher, made at its first use."""
    assert _app is not None
    if not _dispatchers:
        _dispatchers.append(
            _app.events.Dispatcher(
                _app.connection_for_write(),
                hostname=seams.pool_hostname(hostname),
                enabled=True,
                buffer_group=["task"],
                buffer_limit=1000,
            )
        )
    return _dispatchers[0]


def _flush_events() -> None:
    """Send the buffered task events as one message (a list: Celery's receivers take both)."""
    for dispatcher in _dispatchers:
        try:
            dispatcher.flush()
        except Exception:
            logger.warning("celery-threads: could not send task events", exc_info=True)
