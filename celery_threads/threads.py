"""``Threads(app)``: inspect and steer threads and the dead-letter store."""
from __future__ import annotations

from datetime import datetime, timezone
from typing import Any, Iterator, NamedTuple, Optional

from celery import Celery

from .gate import ThreadSnapshot, parse_record
from .publish import decode_arguments, task_name
from .runtime import get_runtime


def _utc(ms: Optional[int]) -> Optional[datetime]:
    return None if ms is None else datetime.fromtimestamp(ms / 1000.0, tz=timezone.utc)


class MemberInfo(NamedTuple):
    task_id: str
    name: str
    scheduled_at: datetime        # aware UTC
    state: str                    # "WAITING", "RELEASED" or "RUNNING"
    retries: int


class ThreadInfo(NamedTuple):
    thread_id: str
    active: Optional[MemberInfo]  # released to the broker or running
    waiting: list[MemberInfo]     # in the order they would be released


class DeadTask(NamedTuple):
    task_id: str
    thread_id: str
    name: str
    args: list[Any]
    kwargs: dict[str, Any]
    retries: int
    exception: str
    died_at: datetime             # aware UTC


class Threads:
    """Read and steer the gate of ``app``::

        threads = Threads(app)
        info = threads.get("acct-1")
        threads.delete(info.waiting[0].task_id)
    """

    def __init__(self, app: Celery) -> None:
        self.app = app
        self.runtime = get_runtime(app)
        self.gate = self.runtime.gate

    def get(self, thread_id: Any) -> Optional[ThreadInfo]:
        """The thread's active and waiting members, or ``None`` when the thread does not exist."""
        from .task import normalize_thread_id

        snapshot = self.gate.snapshot(normalize_thread_id(thread_id))
        return None if snapshot is None else self._info(snapshot)

    def _member(self, snapshot: ThreadSnapshot, task_id: str, scheduled_ms: int,
                state: str) -> MemberInfo:
        record = snapshot.records.get(task_id, b"0|0|-1|0\n{}\n")
        _, retries, _, _, envelope = parse_record(record)
        name = task_name(envelope) if envelope.startswith(b"{\"") else ""
        return MemberInfo(task_id, name, _utc(scheduled_ms), state, retries)  # type: ignore[arg-type]

    def _info(self, snapshot: ThreadSnapshot) -> ThreadInfo:
        active = None
        if snapshot.active:
            a = snapshot.active
            active = self._member(snapshot, a["task"], int(a.get("sched", 0)), a["state"])
        waiting = [self._member(snapshot, task_id, ms, "WAITING")
                   for task_id, ms in snapshot.waiting]
        return ThreadInfo(snapshot.thread_id, active, waiting)

    def ids(self) -> Iterator[str]:
        """The ids of existing threads (an incremental scan of the gate's indexes)."""
        return self.gate.thread_ids()

    def delete(self, task_id: str) -> bool:
        """Detach a member at once and promote the next; a running one is revoked with terminate.

        Returns ``True`` if ``task_id`` was a member.
        """
        outcome = self.runtime.apply(self.gate.delete(task_id))
        if not outcome.done:
            return False
        if outcome.info in ("RUNNING", "RELEASED"):
            self.app.control.revoke(task_id, terminate=outcome.info == "RUNNING")
        return True

    def dead(self) -> list[DeadTask]:
        """The dead-letter store, oldest first."""
        tasks = []
        for record in self.gate.dead_records():
            try:
                args, kwargs = decode_arguments(self.app, record.envelope)
            except Exception:
                args, kwargs = [], {}
            tasks.append(DeadTask(
                task_id=record.task_id,
                thread_id=str(record.meta.get("thread_id", "")),
                name=task_name(record.envelope),
                args=args,
                kwargs=kwargs,
                retries=int(record.meta.get("retries", 0)),
                exception=str(record.meta.get("exception", "")),
                died_at=_utc(record.died_at_ms),  # type: ignore[arg-type]
            ))
        return tasks

    def restart(self, task_id: str) -> Any:
        """Re-enqueue a dead task as a brand-new arrival (same task id, retries reset).

        Returns its ``AsyncResult``.  Raises :class:`celery_threads.errors.UnknownTask` when it is
        not in the dead-letter store.
        """
        from .errors import UnknownTask

        record = self.gate.dead_record(task_id)
        if record is None:
            raise UnknownTask(f"{task_id} is not in the dead-letter store (see Threads.dead())")
        task = self.app.tasks.get(task_name(record.envelope))
        outcome = self.gate.restart(
            task_id, max_retries=getattr(task, "max_retries", 3),
            retry_delay_ms=int(float(getattr(task, "default_retry_delay", 0) or 0) * 1000))
        if outcome.status == 2:
            raise UnknownTask(f"{task_id} is a live member again; it cannot be restarted twice")
        self.runtime.apply(outcome)
        return self.app.AsyncResult(task_id)

    def forget(self, task_id: str) -> bool:
        """Drop a dead task from the store; ``True`` if it was there."""
        return self.gate.forget(task_id)
