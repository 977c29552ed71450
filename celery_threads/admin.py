"""The admin API, ``Threads(app)``: inspect and steer threads and the dead-letter store, and read
the gate's health and metrics."""

from __future__ import annotations

import functools
import heapq
import time
import uuid
from collections.abc import Iterator
from datetime import datetime, timezone
from typing import Any, Callable, NamedTuple, Optional, TypeVar

import redis
from celery import Celery, states

from .config import read_config
from .errors import InvalidArgument, UnknownTask
from .gate import (
    DEAD_CHUNK,
    ID_PAGE,
    OPERATOR_BATCH,
    DeadRecord,
    Pause,
    Record,
    Redriven,
    Restart,
    Resume,
    ThreadSnapshot,
    deadline,
    parse_record,
)
from .gate.eviction import Eviction, check_eviction, persistence_gaps
from .logs import get_logger
from .metrics import Counters, Metrics
from .protocol import RETRIED_COMMAND, normalize_task_id, normalize_thread_id, retry_settings
from .publish import arguments_repr, decode_arguments, route_of, task_name
from .runtime import get_runtime

T = TypeVar("T")
logger = get_logger(__name__)

NO_REASON = "paused"
"""The reason of a pause given none: ``ThreadInfo.paused`` is ``None`` only when not paused."""
#: The most a restart or redrive waits for a worker to take the announcement of its members
#: (and as long again for one that took it to send it).
ANNOUNCE_WAIT = 0.5


def _utc(ms: Optional[int]) -> Optional[datetime]:
    return None if ms is None else _at(ms)


class _MemberFields(NamedTuple):
    task_id: str
    name: str
    scheduled_at: datetime  # aware UTC
    state: str  # "WAITING", "RELEASED" or "RUNNING"
    retries: int


class MemberInfo(_MemberFields):
    """``MemberInfo(task_id, name, scheduled_at, state, retries)``: a tuple of those five, as
    the contract has it (code may unpack it), plus the attribute ``stopping``: deleted while it
    runs in a process its worker stops (prefork), it is still RUNNING, and the thread's next
    member starts once its code has stopped."""

    stopping: bool = False  # the class's default; an instance's own when given

    def __new__(
        cls, task_id: str, name: str, scheduled_at: datetime, state: str, retries: int, stopping: bool = False
    ) -> MemberInfo:
        member = super().__new__(cls, task_id, name, scheduled_at, state, retries)
        if stopping:
            member.stopping = True
        return member

    def _asdict(self) -> dict[str, Any]:
        return {**super()._asdict(), "stopping": self.stopping}


class ThreadInfo(NamedTuple):
    thread_id: str
    active: Optional[MemberInfo]  # released to the broker or running
    waiting: list[MemberInfo]  # in the order they would be released
    paused: Optional[str] = None  # the pause's reason (NO_REASON when given none), or None


class DeadTask(NamedTuple):
    """A task in the dead-letter store.  ``args`` and ``kwargs`` are empty when its stored
    message cannot be decoded here, or is of a content type the app's ``accept_content`` does not
    accept (such a message is never deserialized: an app that accepts only JSON does not unpickle
    a pickled one).  ``restart`` runs it all the same, on workers that accept it."""

    task_id: str
    thread_id: str
    name: str
    args: list[Any]
    kwargs: dict[str, Any]
    retries: int
    exception: str
    died_at: datetime  # aware UTC


def _admin(method: Callable[..., T]) -> Callable[..., T]:
    """An admin call gives up once the gate has not answered for ``threads_publish_timeout``
    (raising the client's error), however long it reads a gate that does answer: a person at a
    shell, or a health check, is not kept waiting out the worker's long retry budget."""

    @functools.wraps(method)
    def call(self: Threads, *args: Any, **kwargs: Any) -> T:
        with deadline.within(self.timeout, stall=True):
            return method(self, *args, **kwargs)

    return call


def _admin_iter(method: Callable[..., Iterator[T]]) -> Callable[..., Iterator[T]]:
    """:func:`_admin` for a method that returns an iterator: each item is read within the bound
    (the caller's own work between items is not counted)."""

    @functools.wraps(method)
    def call(self: Threads, *args: Any, **kwargs: Any) -> Iterator[T]:
        items = method(self, *args, **kwargs)
        while True:
            with deadline.within(self.timeout, stall=True):
                try:
                    item = next(items)
                except StopIteration:
                    return
            yield item

    return call


class Threads:
    """Read and steer the gate of ``app``::

    threads = Threads(app)
    info = threads.get("acct-1")
    threads.delete(info.waiting[0].task_id)
    """

    def __init__(self, app: Celery) -> None:
        self.app = app
        self.timeout = read_config(app).publish_timeout
        with deadline.within(self.timeout, stall=True):
            self.runtime = get_runtime(app)
        self.gate = self.runtime.gate
        self.reads = self.gate.reads

    @_admin
    def get(self, thread_id: Any) -> Optional[ThreadInfo]:
        """The thread's active and waiting members and its pause, or ``None`` when the thread
        does not exist.  A paused thread exists while it is paused, even with no member left (an
        operator's pause is state to see: ``ThreadInfo(thread_id, None, [], reason)``)."""
        snapshot = self.reads.snapshot(normalize_thread_id(thread_id))
        return None if snapshot is None else self._info(snapshot)

    def _member(
        self, snapshot: ThreadSnapshot, task_id: str, scheduled_ms: int, state: str, stopping: bool = False
    ) -> MemberInfo:
        raw = snapshot.records.get(task_id)
        record = parse_record(raw) if raw is not None else None
        name = task_name(record.envelope) if record is not None else ""
        retries = record.retries if record is not None else 0
        return MemberInfo(
            task_id,
            name,
            _at(scheduled_ms),
            state,
            retries,
            stopping,
        )

    def _info(self, snapshot: ThreadSnapshot) -> ThreadInfo:
        active = None
        if snapshot.active:
            a = snapshot.active
            active = self._member(
                snapshot, a["task"], int(a.get("sched", 0)), a["state"], a.get("del") == "1"
            )
        waiting = [self._member(snapshot, task_id, ms, "WAITING") for task_id, ms in snapshot.waiting]
        return ThreadInfo(snapshot.thread_id, active, waiting, snapshot.paused)

    @_admin_iter
    def ids(self, page: int = ID_PAGE) -> Iterator[str]:
        """The ids of existing threads, paused ones included, in no particular order: a cursor
        reading about ``page`` ids per round trip, so the first ``n`` cost O(n) reads however
        many threads exist.

        Read while threads come and go, every thread that exists throughout the listing is
        listed at least once and none twice (but see :meth:`GateReads.thread_ids
        <celery_threads.gate.GateReads.thread_ids>` for the one exception); one created or ended
        meanwhile may or may not be."""
        return self.reads.thread_ids(page)

    @_admin
    def pause(self, thread_id: Any, reason: Optional[str] = None) -> bool:
        """Stop releasing the thread's members until :meth:`resume`: the member released or
        running goes on to its end, a retry of it waits in the thread, new calls still join.

        The pause is operator state, kept in the gate's Redis with the members (it survives
        worker and Redis restarts as they do), even while the thread has no member.  ``reason``
        shows in :meth:`get`, ``celery threads show`` and ``ls`` (:data:`NO_REASON` when none is
        given); pausing a paused thread replaces it.  Returns ``True`` when the thread was not
        paused already."""
        outcome = self.gate.pause(normalize_thread_id(thread_id), reason or NO_REASON)
        return outcome.status == Pause.PAUSED

    @_admin
    def resume(self, thread_id: Any) -> bool:
        """Release the thread's members again; its head, when due and nothing is active, is
        released at once.  Returns ``True`` if the thread was paused.  A thread held by a death
        (``on_death="hold"``) goes on without the dead member (it stays in the dead-letter
        store)."""
        outcome = self.runtime.publish_outcome(self.gate.resume(normalize_thread_id(thread_id)))
        return outcome.status == Resume.RESUMED

    @_admin
    def paused(self) -> dict[str, str]:
        """The paused threads and their reasons (read without a scan of the threads)."""
        found: dict[str, str] = {}
        for shard in self.gate.keys.all_shards():
            found.update(self.reads.paused(shard))
        return found

    @_admin
    def delete(self, task_id: str) -> bool:
        """Detach a member and promote the next; a running one is revoked with terminate.

        A waiting or released member (nothing of it runs) leaves at once.  A member running in a
        prefork pool process leaves once its worker has stopped that process, and the next
        member is released only then; this call waits for that, at most
        :data:`~celery_threads.runtime.STOP_WAIT` seconds (meanwhile :meth:`get` shows it
        RUNNING with ``stopping``).  A member running under the threads, solo or gevent pool,
        which cannot be stopped, leaves at once and its body runs on beside the next member.

        Returns ``True`` if ``task_id`` was a member.
        """
        task_id = normalize_task_id(task_id)
        return self.runtime.delete_member(task_id) is not None

    @_admin
    def dead(self, limit: Optional[int] = None) -> list[DeadTask]:
        """The dead-letter store, oldest first; with ``limit``, only the ``limit`` latest deaths
        (``celery threads stats`` counts them all).  Arguments are decoded only in a content type
        the app accepts (see :class:`DeadTask`)."""
        if limit is not None and limit < 0:
            raise InvalidArgument(f"limit must be 0 or more, not {limit}")
        return [self._dead_task(record) for record in self.reads.dead_records(limit)]

    @_admin
    def dead_task(self, task_id: str) -> Optional[DeadTask]:
        """The task ``task_id`` in the dead-letter store, or ``None`` when it is not there."""
        task_id = normalize_task_id(task_id)
        record = self.reads.dead_record(task_id)
        return None if record is None else self._dead_task(record)

    @_admin
    def dead_count(self) -> int:
        """How many tasks the dead-letter store holds: O(1) reads."""
        return self.reads.dead_count()

    @_admin
    def thread_of(self, task_id: str) -> Optional[str]:
        """The id of the thread ``task_id`` is a member of, or ``None`` when it is no member."""
        task_id = normalize_task_id(task_id)
        return self.reads.thread_of(task_id)

    @_admin
    def restart(self, task_id: str) -> Any:
        """Re-enqueue a dead task as a brand-new arrival (same task id, retries reset, its
        policies kept).  When its death holds its thread (``on_death="hold"``), the thread goes
        on: behind the members waiting there, since it arrives anew.

        Returns its ``AsyncResult``: ``PENDING`` until the new run ends (its stored FAILURE goes
        first).  In a process that sent the task, ``get()`` may still return the first run's
        result, which Celery's Redis result backend buffered there.  Raises
        :class:`celery_threads.errors.UnknownTask` when it is not in the dead-letter store,
        :class:`celery_threads.errors.ConfigurationError` (and keeps it there) when its task's
        ``max_retries`` or ``default_retry_delay`` is invalid.
        """
        task_id = normalize_task_id(task_id)
        record = self.reads.dead_record(task_id)
        if record is None:
            raise UnknownTask(f"{task_id} is not in the dead-letter store (see Threads.dead())")
        max_retries, retry_delay_ms = self._retry_settings(record)
        dropped = self._forget_result(task_id)
        self._announce_retried([record])
        outcome = self.gate.restart(
            task_id,
            max_retries=max_retries,
            retry_delay_ms=retry_delay_ms,
            thread_id=str(record.meta["thread_id"]),
        )
        if outcome.status != Restart.RESTARTED:
            # Another call took the letter meanwhile (forget, restart, redrive): not restarted.
            self._restore_result(task_id, dropped)
            raise UnknownTask(
                f"{task_id} was not restarted: it is a live member again"
                if outcome.status == Restart.ALREADY_MEMBER
                else f"{task_id} was not restarted: it left the dead-letter store meanwhile "
                "(forgotten, restarted or redriven by another call)"
            )
        self.runtime.publish_outcome(outcome)
        return self.app.AsyncResult(task_id)

    @_admin
    def forget(self, task_id: str) -> bool:
        """Drop a dead task from the store; ``True`` if it was there.  When its death holds its
        thread (``on_death="hold"``), the thread goes on without it."""
        task_id = normalize_task_id(task_id)
        return self.runtime.publish_outcome(self.gate.forget(task_id)).done

    # -- redrive and purge ------------------------------------------------------------------

    @_admin
    def redrivable(self, thread_id: Any = None, limit: Optional[int] = None) -> list[DeadTask]:
        """The dead letters :meth:`redrive` would put back (of ``thread_id``, or of every thread;
        oldest death first; at most ``limit``): a dry run, which changes nothing.  The store is
        read in death order, :data:`~celery_threads.gate.DEAD_CHUNK` letters per read; with a
        ``thread_id`` every letter is read (the store has no index by thread)."""
        return [self._dead_task(r) for r in self._redrivable(thread_id, limit)]

    def _redrivable(self, thread_id: Any, limit: Optional[int]) -> list[DeadRecord]:
        if limit is not None and limit < 0:
            raise InvalidArgument(f"limit must be 0 or more, not {limit}")
        wanted = None if thread_id is None else normalize_thread_id(thread_id)
        chosen: list[DeadRecord] = []
        # Each shard is in death order; merged by time across shards.
        shards = self.gate.keys.all_shards()
        for record in heapq.merge(*(self.reads.dead_in_order(s) for s in shards), key=lambda r: r.died_at_ms):
            if limit is not None and len(chosen) >= limit:
                break
            if wanted is None or str(record.meta.get("thread_id", "")) == wanted:
                chosen.append(record)
        return chosen

    @_admin
    def redrive(
        self,
        thread_id: Any = None,
        limit: Optional[int] = None,
        *,
        progress: Optional[Callable[[int], None]] = None,
    ) -> int:
        """Put dead letters (of ``thread_id``, or of every thread; oldest death first; at most
        ``limit``) back into their threads at their original place: the scheduled_at and
        arrival number they had, same task id, retries reset, policies kept.  A thread's
        redriven members run in their original order and before members that arrived after
        them; a thread that a letter's death holds (``on_death="hold"``) goes on, that letter
        first.  A letter that died
        before the store kept places re-enters as a new arrival (logged).

        The letters go back :data:`~celery_threads.gate.transitions.OPERATOR_BATCH` per script call, each
        thread's in their original order; ``progress(n)`` is told after each call.  Returns the
        number redriven."""
        by_thread: dict[str, list[DeadRecord]] = {}
        letters = self._redrivable(thread_id, limit)
        for record in letters:
            by_thread.setdefault(str(record.meta["thread_id"]), []).append(record)
        self._announce_retried(letters)
        redriven = 0
        for thread, records in by_thread.items():
            # By place, so that the head released after each call is the earliest of them all.
            records.sort(key=_place)
            for at in range(0, len(records), OPERATOR_BATCH):
                batch = records[at : at + OPERATOR_BATCH]
                settings = [(r.task_id, *self._retry_settings(r)) for r in batch]
                dropped = [self._forget_result(record.task_id) for record in batch]
                codes, release = self.gate.redrive(thread, settings)
                self.runtime.publish(release)
                done = sum(1 for c in codes if c in (Redriven.AT_PLACE, Redriven.NEW_ARRIVAL))
                for record, code, meta in zip(batch, codes, dropped):
                    if code not in (Redriven.AT_PLACE, Redriven.NEW_ARRIVAL):
                        self._restore_result(record.task_id, meta)  # another call took it
                    if code == Redriven.NEW_ARRIVAL:
                        logger.warning(
                            "celery-threads: dead letter %s of thread %s was stored "
                            "without its place; it re-entered as a new arrival",
                            record.task_id,
                            thread,
                        )
                redriven += done
                if progress is not None:
                    progress(len(batch))
        return redriven

    def _announce_retried(self, records: list[DeadRecord]) -> None:
        """Dead letters about to wait in the gate again (redrive, restart): one worker, the one
        that takes a note in the gate, sends their ``task-retried`` events
        (:func:`celery_threads.worker.revoke.announce_retried`), before the gate call that can
        release them, so that the new run's events come after.  A broadcast without replies (a
        reply's consumer would stay on a pooled broker connection); the note says when the
        events are out.  Not taken within :data:`ANNOUNCE_WAIT` (no worker up, none sends
        events), it is cancelled: Flower shows the first run's end until the new one ends."""
        try:
            for at in range(0, len(records), DEAD_CHUNK):
                note = uuid.uuid4().hex
                self.gate.note_announcement(note)
                members = [
                    [r.task_id, str(r.meta.get("exception", ""))] for r in records[at : at + DEAD_CHUNK]
                ]
                self.app.control.broadcast(RETRIED_COMMAND, arguments={"note": note, "members": members})
                state = self._wait_announced(note, "1")
                if state == "1":  # no worker took it: cancelled, unless one takes it just now
                    if self.gate.announcement_state(note, cancel=True) == "taken":
                        self._wait_announced(note, "cancelled")
                    return  # no worker takes the next ones either
                if state == "taken":
                    self._wait_announced(note, "taken")
        except Exception:  # the broker or the gate is down: the letters go back all the same
            logger.debug(
                "celery-threads: could not announce %d retried member(s)", len(records), exc_info=True
            )

    def _wait_announced(self, note: str, state: str) -> Optional[str]:
        """The note's state once it is no longer ``state``, or after :data:`ANNOUNCE_WAIT`."""
        end = time.monotonic() + ANNOUNCE_WAIT
        current: Optional[str] = state
        while current == state and time.monotonic() < end:
            time.sleep(0.01)
            current = self.gate.announcement_state(note)
        return current

    def _forget_result(self, task_id: str) -> Optional[dict[str, Any]]:
        """A dead letter about to wait in the gate again (redrive, restart): its stored FAILURE
        goes, so that its ``AsyncResult`` is ``PENDING`` until it runs.  It goes before the gate
        call that can release it: once released, a worker may run it and store its new result
        before a later forget, which would then drop that result (``PENDING`` for good).
        Returns what was stored (for :meth:`_restore_result`), ``None`` when nothing was."""
        backend = self.app.backend
        try:
            meta = backend.get_task_meta(task_id, cache=False)
            backend.forget(task_id)
        except Exception:  # no result backend, or it is down: its next run overwrites it
            logger.debug("celery-threads: could not forget the result of %s", task_id, exc_info=True)
            return None
        return meta if meta.get("status") in states.READY_STATES else None

    def _restore_result(self, task_id: str, meta: Optional[dict[str, Any]]) -> None:
        """A letter the gate refused after its stored result was forgotten (another operator's
        call took it first): that result back, unless one was stored since (the other call's run
        ended) or the task waits or runs again now (``PENDING`` is its truth then).  It read
        ``PENDING`` for good where the other call forgot the letter, or its run ended first."""
        if meta is None or self.reads.record(task_id) is not None:
            return
        backend = self.app.backend
        try:
            if backend.get_task_meta(task_id, cache=False).get("status") != states.PENDING:
                return
            backend.store_result(task_id, meta.get("result"), meta["status"], traceback=meta.get("traceback"))
        except Exception:
            logger.debug("celery-threads: could not restore the result of %s", task_id, exc_info=True)

    def _retry_settings(self, record: DeadRecord) -> tuple[Optional[int], int]:
        task = self.app.tasks.get(task_name(record.envelope))
        return retry_settings(task) if task is not None else (3, 0)

    def _dead_task(self, record: DeadRecord) -> DeadTask:
        try:
            args, kwargs = decode_arguments(self.app, record.envelope)
        except Exception:
            args, kwargs = [], {}
        return DeadTask(
            task_id=record.task_id,
            thread_id=str(record.meta.get("thread_id", "")),
            name=task_name(record.envelope),
            args=args,
            kwargs=kwargs,
            retries=record.retries,
            exception=str(record.meta.get("exception", "")),
            died_at=_utc(record.died_at_ms),  # type: ignore[arg-type]
        )

    @_admin
    def waiting_count(self, thread_id: Any = None) -> int:
        """How many members wait (not released nor running) in ``thread_id``, or in every
        thread: O(1) reads."""
        if thread_id is not None:
            return self.reads.waiting_count(normalize_thread_id(thread_id))
        return self.reads.waiting_total()

    @_admin
    def purge(self, thread_id: Any = None, *, progress: Optional[Callable[[int], None]] = None) -> int:
        """Drop the waiting members of ``thread_id``, or of every thread; a released or running
        member goes on.  Dropped members end as ``REVOKED`` in the result backend and leave the
        gate as any ending does; a thread's keys vanish with its last member.

        Members are dropped :data:`~celery_threads.gate.transitions.OPERATOR_BATCH` per script call, the
        last in release order first (so nothing is released meanwhile); every thread is found
        through the gate's indexes with a cursor.  ``progress(n)`` is told after each call.
        Members that arrive while a thread is being purged may be dropped too.  Returns the
        number dropped."""
        if thread_id is not None:
            return self._purge_thread(normalize_thread_id(thread_id), progress)
        return sum(self._purge_thread(t, progress) for t in self.reads.thread_ids())

    def _purge_thread(self, thread_id: str, progress: Optional[Callable[[int], None]]) -> int:
        # Bounded, so that producers adding members as fast as they go cannot keep it going.
        bound = 2 * self.reads.waiting_count(thread_id) + 1
        total = 0
        while total < bound:
            # Their stored messages, their requests in the result backend: a chord counts its
            # parts, an extended result names them, the rpc:// backend replies to their caller.
            records: dict[str, Record] = {}
            dropped, left = self.gate.purge(thread_id, records=records)
            for task_id in dropped:
                record = records.get(task_id)
                self.runtime.mark_revoked(
                    task_id,
                    "purged from its thread",
                    record.envelope if record is not None else None,
                    record.retries if record is not None else None,
                )
            if dropped:
                # task-revoked for Flower, sent by one worker per member (Runtime.revoke_unstarted)
                self.gate.note_deleted(thread_id, *dropped)
                self.app.control.revoke(dropped)
            total += len(dropped)
            if progress is not None and dropped:
                progress(len(dropped))
            if not dropped or not left:
                break
        return total

    def forget_all(self, batch: int = DEAD_CHUNK) -> Iterator[list[str]]:
        """Drop every task in the dead-letter store when the call starts, ``batch`` at a time
        (never one unbounded command: Redis serves others between batches), oldest first; yields
        each batch's task ids once it is dropped.  Forgetting goes on as the iterator is
        consumed: stop iterating to stop.  Tasks that die meanwhile stay."""
        if batch < 1:
            raise InvalidArgument(f"batch must be 1 or more, not {batch}")
        with deadline.within(self.timeout, stall=True):
            ends = [(shard, self.reads.last_death(shard)) for shard in self.gate.keys.all_shards()]
        for shard, up_to in ends:
            while up_to is not None:
                with deadline.within(self.timeout, stall=True):
                    forgotten = self.gate.forget_batch(shard, up_to, batch)
                if not forgotten:
                    break
                yield forgotten

    # -- health -----------------------------------------------------------------------------
    # Every "now" below is the Redis server's clock (TIME), the clock the gate's scripts use.

    @property
    def stuck_after(self) -> float:
        """Seconds past a deadline or a due head's scheduled_at after which a thread is stuck:
        :data:`STUCK_AFTER_TICKS` dispatcher ticks (``threads_dispatch_interval``)."""
        return STUCK_AFTER_TICKS * self.runtime.config.dispatch_interval

    @_admin
    def status(self, thread_id: Any, limit: Optional[int] = None) -> Optional[ThreadStatus]:
        """The thread's members with their health (lease expiry, worker, ages), or ``None`` when
        the thread does not exist.  ``limit``: of its waiting members, only the first that many
        in release order are read (their number is ``waiting_total``): Redis reads every record
        of the ones it returns, which for a thread of many thousands holds up the gate.  Their
        ``arrival`` then ranks them among those read."""
        if limit is not None and limit < 1:
            raise InvalidArgument(f"limit must be 1 or more (None: every waiting member), not {limit}")
        thread_id = normalize_thread_id(thread_id)
        now = self.reads.now_ms()
        snapshot = self.reads.snapshot(thread_id, limit)
        return None if snapshot is None else _status(snapshot, now)

    @_admin_iter
    def summaries(
        self, batch: int = ID_PAGE, limit: Optional[int] = None, paused: bool = False
    ) -> Iterator[ThreadSummary]:
        """One line of health per existing thread (``celery threads ls``), in :meth:`ids`' order,
        read ``batch`` threads per round trip.  Reads as many threads as the caller takes: the
        first ``n`` cost O(n) reads.  ``limit``: the caller takes at most that many (the pages
        read are sized to fit).  With ``paused``, only the paused threads: O(paused threads)."""
        if limit is not None:
            batch = max(1, min(batch, limit))
        pending: list[str] = []
        for thread_id in self.paused() if paused else self.ids(page=batch):
            pending.append(thread_id)
            if len(pending) >= batch:
                yield from self._summaries(pending)
                pending = []
        if pending:
            yield from self._summaries(pending)

    def _summaries(self, thread_ids: list[str]) -> Iterator[ThreadSummary]:
        now = self.reads.now_ms()
        reasons = self.reads.paused_reasons(thread_ids)
        for thread_id, (active, waiting, head, due), reason in zip(
            thread_ids, self.reads.thread_summaries(thread_ids), reasons
        ):
            if not active and head is None and reason is None:
                continue  # it ended between the scan and the read
            since = _int(active.get("since"))
            eligible = _eligible(head[1] if head else None, due, active)
            yield ThreadSummary(
                thread_id=thread_id,
                members=waiting + (1 if active else 0),
                active_task=active.get("task"),
                active_state=active.get("state"),
                active_for=None if since is None else (now - since) / 1000.0,
                next_eligible_at=_utc(eligible),
                head_age=None if eligible is None else (now - eligible) / 1000.0,
                paused=reason,
            )

    @_admin
    def stuck(self, grace: Optional[float] = None, limit: int = 100) -> list[StuckThread]:
        """Threads the dispatcher should have moved on but did not, most overdue first.

        * an active member whose deadline (a RUNNING member's lease, a RELEASED member's release
          timeout) lapsed more than ``grace`` seconds ago without being reclaimed or republished;
        * an idle thread whose head has been due for more than ``grace`` seconds without being
          released.

        Either means no dispatcher is running (no ``celery beat`` and no worker).  A paused thread
        is never stuck: an operator holds it (and its idle head is in no index).  ``grace``
        defaults to :attr:`stuck_after`.  Read through the index ZSETs by score: O(log n + stuck
        threads), at most ``limit`` of each kind per shard.
        """
        grace_ms = int((self.stuck_after if grace is None else grace) * 1000)
        now = self.reads.now_ms()
        cutoff = now - grace_ms
        found: list[StuckThread] = []
        for shard in self.gate.keys.all_shards():
            lapsed, due = self.reads.overdue(shard, cutoff, limit)
            paused = self.reads.paused(shard)
            lapsed = [(t, score) for t, score in lapsed if t not in paused]
            rows = self.reads.thread_summaries([t for t, _ in lapsed] + [t for t, _ in due])
            for (thread_id, score), (active, _, _, _) in zip(lapsed, rows[: len(lapsed)]):
                stuck = _stuck_active(thread_id, score, active, now, cutoff)
                if stuck is not None:
                    found.append(stuck)
            for (thread_id, _score), (active, _, head, _) in zip(due, rows[len(lapsed) :]):
                if active or head is None or head[1] > cutoff:
                    continue  # released, or displaced by a later head, since the read
                found.append(_stuck_head(thread_id, head[0], head[1], now))
        found.sort(key=lambda s: s.overdue_for, reverse=True)
        return found

    def eviction(self) -> list[Eviction]:
        """What the gate's Redis servers may evict (none listed for a ``noeviction`` server), as
        :func:`~celery_threads.gate.eviction.check_eviction` logs it once per process.  Never
        raises: a server that does not answer is not checked."""
        return check_eviction(self.runtime.client, self.runtime.config.redis_url)

    @_admin
    def persistence(self) -> list[str]:
        """A warning for each of the gate's Redis servers that keeps no append-only file (a
        restart loses the gate's members, or rolls them back); empty when each has one, or when
        none answers ``INFO``."""
        try:
            return persistence_gaps(self.runtime.client)
        except (redis.ConnectionError, redis.TimeoutError, OSError):
            return []

    @_admin
    def stats(self, grace: Optional[float] = None) -> Stats:
        """Counts of threads, members by state, paused threads and dead letters, the oldest
        waiting head, and how many threads are :meth:`stuck` (``grace`` as there).  Everything is
        read from the indexes in O(log n), except the RELEASED/RUNNING split (O(active members))
        and the paused threads (O(paused threads))."""
        now = self.reads.now_ms()
        totals = self._totals(now, grace)
        states: dict[str, int] = {}
        for shard in self.gate.keys.all_shards():
            for state, n in self.reads.active_states(shard).items():
                states[state] = states.get(state, 0) + n
        head = None
        if totals.oldest is not None:
            thread_id, scheduled = totals.oldest
            row = self.reads.thread_summaries([thread_id])[0][2]
            head = WaitingHead(thread_id, row[0] if row else "", _at(scheduled), (now - scheduled) / 1000.0)
        return Stats(
            now=_at(now),
            threads=totals.threads,
            members={
                "WAITING": max(0, totals.members - totals.active),
                "RELEASED": states.get("RELEASED", 0),
                "RUNNING": states.get("RUNNING", 0),
            },
            dead=totals.dead,
            oldest_waiting_head=head,
            stuck=totals.stuck,
            paused=totals.paused,
            dead_dropped=self.reads.dead_dropped(),
        )

    @_admin
    def metrics(self, top: int = 0, grace: Optional[float] = None) -> Metrics:
        """Every metric of ``celery threads metrics`` (docs/metrics.md), summed over the shards:
        the indexes' sizes and the counters the transitions keep, O(log n + paused threads), never
        a scan of threads or members.  ``top``: also the ``top`` threads with the most waiting
        members, which does read every thread (O(threads), in pages): opt-in.  ``stuck_threads``
        is :meth:`stats`' count (``grace`` as there)."""
        now = self.reads.now_ms()
        totals = self._totals(now, grace)
        counters = Counters()
        for shard in self.gate.keys.all_shards():
            counters += Counters.parse(self.reads.stats_counters(shard))
        # The RUNNING count is the transitions' own; it cannot exceed the active members.
        running = min(max(0, counters.running), totals.active)
        return Metrics(
            threads=totals.threads,
            members={
                "waiting": max(0, totals.members - totals.active),
                "released": totals.active - running,
                "running": running,
            },
            paused_threads=totals.paused,
            stuck_threads=totals.stuck,
            oldest_due_seconds=0.0 if totals.oldest is None else max(0, now - totals.oldest[1]) / 1000.0,
            dead_letters=totals.dead,
            counters=counters,
            thread_waiting=self._most_waiting(top) if top > 0 else [],
        )

    def _totals(self, now: int, grace: Optional[float]) -> _Totals:
        """The index counts of every shard, summed, and the stuck threads as :meth:`stuck` finds
        them (a paused thread is never stuck): O(log n + paused threads) per shard."""
        grace_ms = int((self.stuck_after if grace is None else grace) * 1000)
        threads = members = active = dead = stuck = paused = 0
        oldest: Optional[tuple[str, int]] = None
        for shard in self.gate.keys.all_shards():
            counts = self.reads.index_counts(shard, now, now - grace_ms)
            threads += counts["idle"] + counts["active"]
            members += counts["members"]
            active += counts["active"]
            dead += counts["dead"]
            stuck += counts["lapsed"] + counts["overdue_heads"]
            # A paused thread is never stuck; one with nothing active is in no index.
            held = self.reads.paused_leases(shard)
            paused += len(held)
            threads += sum(1 for score in held.values() if score is None)
            stuck -= sum(1 for score in held.values() if score is not None and score <= now - grace_ms)
            if counts["oldest_due"] is not None and (oldest is None or counts["oldest_due"][1] < oldest[1]):
                oldest = counts["oldest_due"]
        return _Totals(threads, members, active, dead, stuck, paused, oldest)

    def _most_waiting(self, top: int) -> list[tuple[str, int]]:
        """The ``top`` threads with the most waiting members, most first (ties in :meth:`ids`'
        order): every thread's queue length read, a page per round trip, ``top`` kept."""

        def waiting() -> Iterator[tuple[str, int]]:
            for page in _pages(self.ids(), ID_PAGE):
                for thread_id, n in zip(page, self.reads.waiting_counts(page)):
                    if n:
                        yield thread_id, n

        return heapq.nlargest(top, waiting(), key=lambda row: row[1])


# -- health types and helpers ---------------------------------------------------------------

STUCK_AFTER_TICKS = 3
"""A deadline lapsed, or a due head left unreleased, for this many dispatcher ticks is stuck."""

DISPATCHER_HINT = (
    "is a dispatcher running? Start `celery beat` or a worker of this app "
    "(each worker dispatches unless threads_worker_dispatch is False)"
)


class ActiveStatus(NamedTuple):
    """The active member of a thread, with its lease."""

    task_id: str
    name: str
    state: str  # "RELEASED" or "RUNNING"
    scheduled_at: datetime
    retries: int
    since: datetime  # when it was released to the broker
    active_for: float  # seconds since ``since``
    deadline: datetime  # lease expiry (RUNNING) or release deadline (RELEASED)
    expires_in: float  # seconds until ``deadline``; negative once it lapsed
    worker: Optional[str]  # hostname of the worker that claimed it (RUNNING)
    claimed_at: Optional[datetime]
    republished: int  # times its release was republished, unclaimed
    arguments: str = ""  # as Celery's argsrepr and kwargsrepr show them
    stopping: bool = False  # deleted; the next starts once its worker has stopped it
    route: str = ""  # the routing key its release is published with ("exchange/key" if any)


class WaitingStatus(NamedTuple):
    """A waiting member of a thread."""

    task_id: str
    name: str
    scheduled_at: datetime
    arrival: int  # arrival order among the thread's members, 1 = earliest
    retries: int
    arguments: str = ""  # as Celery's argsrepr and kwargsrepr show them


class ThreadStatus(NamedTuple):
    """One thread in detail (``celery threads show``)."""

    thread_id: str
    now: datetime  # the Redis server's clock when it was read
    active: Optional[ActiveStatus]
    waiting: list[WaitingStatus]  # in the order they would be released; the first, when limited
    next_eligible_at: Optional[datetime]  # the head's scheduled_at, or later under a rate limit
    head_age: Optional[float]  # seconds since the head became eligible; negative: not yet
    paused: Optional[str] = None  # the pause's reason, or None
    waiting_total: int = 0  # the waiting members, ``waiting`` or more

    @property
    def members(self) -> int:
        return max(self.waiting_total, len(self.waiting)) + (1 if self.active else 0)


class ThreadSummary(NamedTuple):
    """One thread in a line (``celery threads ls``)."""

    thread_id: str
    members: int
    active_task: Optional[str]
    active_state: Optional[str]
    active_for: Optional[float]  # seconds the active member has been active
    next_eligible_at: Optional[datetime]  # the head's scheduled_at, or later under a rate limit
    head_age: Optional[float]  # seconds since the head became eligible; negative: not yet
    paused: Optional[str] = None  # the pause's reason, or None


class StuckThread(NamedTuple):
    """A thread the dispatcher did not move on (see :meth:`Threads.stuck`)."""

    thread_id: str
    kind: str  # "lease", "release" (an active member) or "head"
    task_id: str
    state: str  # "RUNNING", "RELEASED" or "WAITING"
    overdue_since: datetime  # the lapsed deadline, or the head's scheduled_at
    overdue_for: float  # seconds
    worker: Optional[str]
    reason: str


class WaitingHead(NamedTuple):
    thread_id: str
    task_id: str
    scheduled_at: datetime
    age: float  # seconds it has been due


class _Totals(NamedTuple):
    threads: int
    members: int
    active: int
    dead: int
    stuck: int
    paused: int
    oldest: Optional[tuple[str, int]]  # (thread id, scheduled_at ms) of the oldest due head


def _pages(items: Iterator[str], size: int) -> Iterator[list[str]]:
    page: list[str] = []
    for item in items:
        page.append(item)
        if len(page) >= size:
            yield page
            page = []
    if page:
        yield page


class Stats(NamedTuple):
    now: datetime  # the Redis server's clock
    threads: int
    members: dict[str, int]  # by state: WAITING, RELEASED, RUNNING
    dead: int  # tasks in the dead-letter store
    oldest_waiting_head: Optional[WaitingHead]  # the idle thread's head due the longest
    stuck: int  # threads :meth:`Threads.stuck` would list
    paused: int = 0  # paused threads (never stuck)
    dead_dropped: int = 0  # dead letters dropped by retention, ever


def _place(record: DeadRecord) -> tuple[int, int, int]:
    """A dead letter's place in its thread (scheduled_at, arrival number); one whose record kept
    none sorts last."""
    seq, sched = record.meta.get("seq"), record.meta.get("sched")
    if isinstance(seq, int) and isinstance(sched, int):
        return 0, sched, seq
    return 1, record.died_at_ms, 0


def _at(ms: int) -> datetime:
    return datetime.fromtimestamp(ms / 1000.0, tz=timezone.utc)


def _int(value: Optional[str]) -> Optional[int]:
    return None if value is None or value == "" else int(value)


def _status(snapshot: ThreadSnapshot, now: int) -> ThreadStatus:
    parsed = {task_id: parse_record(record) for task_id, record in snapshot.records.items()}
    arrival = {
        task_id: rank for rank, task_id in enumerate(sorted(parsed, key=lambda t: parsed[t].seq), start=1)
    }

    def name_of(task_id: str) -> str:
        return task_name(parsed[task_id].envelope) if task_id in parsed else ""

    def retries_of(task_id: str) -> int:
        return parsed[task_id].retries if task_id in parsed else 0

    def arguments_of(task_id: str) -> str:
        return arguments_repr(parsed[task_id].envelope) if task_id in parsed else ""

    active = None
    a = snapshot.active
    if a:
        since, deadline = int(a.get("since", now)), int(a.get("deadline", now))
        claimed = _int(a.get("claimed"))
        active = ActiveStatus(
            task_id=a["task"],
            name=name_of(a["task"]),
            state=a.get("state", ""),
            scheduled_at=_at(int(a.get("sched", since))),
            retries=retries_of(a["task"]),
            since=_at(since),
            active_for=(now - since) / 1000.0,
            deadline=_at(deadline),
            expires_in=(deadline - now) / 1000.0,
            worker=a.get("worker") or None,
            claimed_at=_utc(claimed),
            republished=int(a.get("n", 0) or 0),
            arguments=arguments_of(a["task"]),
            stopping=a.get("del") == "1",
            route=route_of(parsed[a["task"]].envelope) if a["task"] in parsed else "",
        )
    waiting = [
        WaitingStatus(
            task_id,
            name_of(task_id),
            _at(ms),
            arrival.get(task_id, 0),
            retries_of(task_id),
            arguments_of(task_id),
        )
        for task_id, ms in snapshot.waiting
    ]
    head_ms = _eligible(
        snapshot.waiting[0][1] if snapshot.waiting else None, snapshot.due_at, snapshot.active
    )
    return ThreadStatus(
        thread_id=snapshot.thread_id,
        now=_at(now),
        active=active,
        waiting=waiting,
        next_eligible_at=_utc(head_ms),
        head_age=None if head_ms is None else (now - head_ms) / 1000.0,
        paused=snapshot.paused,
        waiting_total=snapshot.waiting_total,
    )


def _eligible(head_ms: Optional[int], due_ms: Optional[int], active: Any) -> Optional[int]:
    """When a thread's head is eligible: its scheduled_at, or, for an idle thread, its due index
    score when later (a thread_rate_limit holds the head until then)."""
    if head_ms is None or active or due_ms is None:
        return head_ms
    return max(head_ms, due_ms)


def _stuck_active(
    thread_id: str, score: int, active: dict[str, str], now: int, cutoff: int
) -> Optional[StuckThread]:
    if not active:
        return StuckThread(
            thread_id,
            "lease",
            "",
            "",
            _at(score),
            (now - score) / 1000.0,
            None,
            "in the leases index without an active member, past its "
            f"deadline by {_seconds(now - score)}: {DISPATCHER_HINT}",
        )
    deadline = int(active.get("deadline", score))
    if deadline > cutoff:
        return None  # renewed, republished or reclaimed since the read
    state, worker = active.get("state", ""), active.get("worker") or None
    late = _seconds(now - deadline)
    if state == "RUNNING":
        kind = "lease"
        reason = (
            f"lease expired {late} ago (worker {worker} stopped renewing it) and the "
            f"member was not reclaimed: {DISPATCHER_HINT}"
        )
    else:
        kind = "release"
        reason = (
            f"released but unclaimed {late} past its release deadline, and not republished: {DISPATCHER_HINT}"
        )
    return StuckThread(
        thread_id,
        kind,
        active.get("task", ""),
        state,
        _at(deadline),
        (now - deadline) / 1000.0,
        worker,
        reason,
    )


def _stuck_head(thread_id: str, task_id: str, scheduled_ms: int, now: int) -> StuckThread:
    return StuckThread(
        thread_id,
        "head",
        task_id,
        "WAITING",
        _at(scheduled_ms),
        (now - scheduled_ms) / 1000.0,
        None,
        f"head due {_seconds(now - scheduled_ms)} ago and not released: {DISPATCHER_HINT}",
    )


def _seconds(ms: int) -> str:
    return f"{ms / 1000.0:.1f}s"
