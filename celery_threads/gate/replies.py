"""What the gate's transitions answer: each script's status as an enum, and the records the
replies carry (a release, an outcome, a scan, a snapshot, a dead record).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import Enum, IntEnum
from typing import Any, Optional


# Each script's reply status, named (the Lua scripts' headers say when each is returned).
class Done(IntEnum):
    """enqueue, release, finish, requeue (and replace), kill, delete: whether it happened."""

    NOOP = 0
    DONE = 1


class Enqueue(IntEnum):
    """enqueue: the task id is a member already (or ended lately), it was added, or
    ``max_waiting`` refused it (nothing stored)."""

    NOOP = 0
    DONE = 1
    FULL = 2


class Claim(IntEnum):
    """claim: the release no longer holds its thread, or it is now the caller's, or another
    delivery's."""

    STALE = 0
    CLAIMED = 1
    ALREADY_CLAIMED = 2


class Renewal(IntEnum):
    """renew: the token no longer holds the thread, or the lease (release deadline) is renewed,
    or the member is claimed by another delivery (or its claim is gone)."""

    STALE = 0
    RENEWED = 1
    NOT_YOURS = 2


class Lapse(IntEnum):
    """expire, fail, handback: what became of an active member whose release or lease lapsed, or
    whose attempt failed: nothing, published again under its token, re-entered for a retry,
    dead, or ended as deleted (it had been deleted while it ran: ``STOPPING``)."""

    NOOP = 0
    REPUBLISH = 2
    RETRIED = 3
    DIED = 4
    DELETED = 5


class Restart(IntEnum):
    """restart: not in the dead-letter store, back in its thread, or a member again already."""

    UNKNOWN = 0
    RESTARTED = 1
    ALREADY_MEMBER = 2


class Pause(IntEnum):
    """pause: the thread was paused already (its reason is replaced), or it is paused now."""

    ALREADY_PAUSED = 0
    PAUSED = 1


class Resume(IntEnum):
    """resume: the thread was not paused, or its releases go on (the reply may carry one)."""

    NOT_PAUSED = 0
    RESUMED = 1


class Redriven(str, Enum):
    """redrive's code per dead letter (lua/redrive.lua)."""

    AT_PLACE = "r"  # back at its original place (arrival number, scheduled_at)
    NEW_ARRIVAL = "n"  # back as a new arrival: its dead record kept no place (written before)
    MEMBER = "a"  # a member already: it stays in the store
    UNKNOWN = "-"  # not in the store, or of another thread


#: The statuses each script replies with (``Done`` for the others).
REPLIES: dict[str, type[IntEnum]] = {
    "enqueue": Enqueue,
    "claim": Claim,
    "renew": Renewal,
    "expire": Lapse,
    "fail": Lapse,
    "handback": Lapse,
    "restart": Restart,
    "pause": Pause,
    "resume": Resume,
}
#: delete's info when a replayed call finds the member already gone (it may have been RUNNING).
ENDED = "ENDED"
#: delete's info when the member runs in a process its worker can stop: it is marked deleted and
#: stays active until its code has stopped (lua/delete.lua, mode "3").
STOPPING = "STOPPING"
#: finish's, requeue's and kill's info when they ended a member marked deleted: it ends as
#: deleted (REVOKED), neither retried nor dead, and finish claimed nothing for its caller.
DELETED = "DELETED"


@dataclass(frozen=True)
class Release:
    """A member the gate has just released: publish its envelope with this fencing token (unless
    the script has already published it: then ``published`` is true and ``envelope`` empty)."""

    thread_id: str
    task_id: str
    token: str
    retries: int
    envelope: bytes
    published: bool = False  # the gate published it itself (Gate(direct=...)); nothing to send


@dataclass(frozen=True)
class Outcome:
    status: int  # the script's status, as its enum (:data:`REPLIES`)
    info: str
    release: Optional[Release]
    # The stored message of a member that left the gate in this call, for its chord and result
    # backend: the waiting member an enqueue superseded, the deleted one whose lease lapsed.
    gone_envelope: bytes = b""
    # That member's retries, from its record (its message's headers may say fewer: a lost
    # attempt re-enters with its stored message unchanged); None when no member left.
    gone_retries: Optional[int] = None
    # An enqueue's under coalesce or debounce, when its member is due later than now: its
    # scheduled_at (ms, the server's clock).
    due_ms: Optional[int] = None

    @property
    def done(self) -> bool:
        return self.status == Done.DONE

    @property
    def superseded(self) -> list[str]:
        """An enqueue's: the task ids it superseded (``coalesce``, ``debounce``), the first its
        own and any other its predecessor's (lua/enqueue.lua), for the caller to mark revoked."""
        return [task_id for task_id in self.info.split("\n") if task_id]


@dataclass(frozen=True)
class Scan:
    now_ms: int
    due: list[str]
    lapsed: list[str]
    next_ms: Optional[int]  # earliest future entry of either index; None when there is none


@dataclass(frozen=True)
class ThreadSnapshot:
    thread_id: str
    active: dict[str, str]
    waiting: list[tuple[str, int]]  # (task id, scheduled_at ms) in release order
    records: dict[str, bytes]
    due_at: Optional[int]
    paused: Optional[str] = None  # the pause's reason, when the thread is paused
    waiting_total: int = 0  # its waiting members, ``waiting`` the first of them when limited


@dataclass(frozen=True)
class DeadRecord:
    task_id: str
    meta: dict[str, Any]
    envelope: bytes
    died_at_ms: int

    @classmethod
    def parse(cls, task_id: str, raw: bytes) -> DeadRecord:
        """``died_at_ms[|caller] \n meta_json \n envelope`` (the caller: the call that killed
        it, lua/_common.lua ``kill_active``)."""
        died_at, meta, envelope = raw.split(b"\n", 2)
        return cls(task_id, json.loads(meta), envelope, int(died_at.split(b"|", 1)[0]))

    @property
    def retries(self) -> int:
        """The attempts it made before the one it died of."""
        return int(self.meta.get("retries", 0))
