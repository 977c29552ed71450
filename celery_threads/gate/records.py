"""What the gate stores, as Python reads it: a member's field and record in its shard's tasks
hash, and the small values the calls carry (a direct release's queue, a call's id).
"""

from __future__ import annotations

import itertools
import os
import secrets
import uuid
from dataclasses import dataclass
from typing import Any, NamedTuple, Optional


def task_field(task_id: str) -> tuple[bytes, Optional[bytes]]:
    """A member's short field in the shard's tasks hash (``task_field`` in lua/_member.lua), and for
    a UUID the two bytes its record keeps: a lowercase UUID as its first 14 bytes, another id as
    written when shorter than 14 bytes, else behind ``\\1``."""
    if len(task_id) == 36 and task_id == task_id.lower():
        try:
            parsed = uuid.UUID(task_id)
        except ValueError:
            parsed = None
        if parsed is not None and str(parsed) == task_id:
            return parsed.bytes[:14], parsed.bytes[14:]
    raw = task_id.encode()
    return (raw if len(raw) < 14 else b"\x01" + raw), None


def find_record(client: Any, tasks_key: str, task_id: str) -> tuple[Optional[bytes], Optional[bytes]]:
    """``(field, record)`` of a member, or ``(None, None)`` (``find_member`` in lua/_member.lua):
    a UUID whose first 14 bytes another member held when it arrived is keyed by its long form."""
    field, tail = task_field(task_id)
    fields = [field] if tail is None else [field, b"\x01" + task_id.encode()]
    found = client.hmget(tasks_key, fields)
    for field, record in zip(fields, found):
        if record is not None and (len(field) != 14 or record[1:3] == tail):
            return field, record
    return None, None


def record_task(field: bytes, record: bytes) -> str:
    """The task id a tasks-hash field names (a 14-byte field's record holds the id's last bytes)."""
    if len(field) == 14:
        return str(uuid.UUID(bytes=field + record[1:3]))
    return (field if len(field) < 14 else field[1:]).decode()


def member_field(member: Any) -> bytes:
    """The tasks-hash field in a thread queue's member (``queue_member`` in lua/_member.lua): a
    length byte, the seq big-endian, then the field."""
    raw = member if isinstance(member, bytes) else str(member).encode()
    return raw[raw[0] + 1 :]


class Record(NamedTuple):
    """A member's record: its value in the shard's tasks hash (see ``make_record`` in Lua)."""

    seq: int  # arrival order (the shard counter)
    retries: int
    max_retries: int  # -1: unlimited
    retry_delay_ms: int
    thread_id: str
    envelope: bytes
    policy: str = ""  # the member's policies (policies.policy_text), "" for none


def parse_record(record: bytes) -> Record:
    """``[\\2 <two bytes>]seq|retries|max_retries|retry_delay_ms|<length of thread id>[|<policy>|]
    \\n<thread id><envelope>`` (the two bytes: the end of a UUID keyed by its first 14, see
    ``task_field``; the policy: see :func:`celery_threads.policies.policy_text`, and 'c' for a
    call with coalesce or debounce not released yet)."""
    if record[:1] == b"\x02":
        record = record[3:]
    header, _, rest = record.partition(b"\n")
    parts = header.split(b"|")
    seq, retries, max_retries, delay, tlen = (int(x) for x in parts[:5])
    policy = parts[5].decode() if len(parts) > 5 else ""
    return Record(seq, retries, max_retries, delay, rest[:tlen].decode(), rest[tlen:], policy)


#: A pause that ``on_death="hold"`` made is stored as ``HOLD_MARK + <dead task id> + HOLD_MARK +
#: <reason>`` (``hold_thread`` in lua/_common.lua); an operator's reason never starts with it.
HOLD_MARK = "\0"


def pause_reason(stored: str) -> str:
    """The reason a paused-hash value shows: a hold's without its mark."""
    if stored.startswith(HOLD_MARK):
        return stored.split(HOLD_MARK, 2)[-1]
    return stored


def held_by(stored: Optional[str]) -> Optional[str]:
    """The dead task id whose death holds the thread (``on_death="hold"``), or ``None`` for an
    operator's pause (or none)."""
    if stored is None or not stored.startswith(HOLD_MARK):
        return None
    return stored.split(HOLD_MARK, 2)[1]


@dataclass(frozen=True)
class ReleasePush:
    """Where the scripts push a released member's message themselves (direct release,
    ``threads_direct_release``): kombu's Redis transport on the gate's server.

    ``broker_db`` is the broker's database, ``gate_db`` the gate client's (a script switches to the
    first for the push and back), ``key_prefix`` kombu's ``global_keyprefix`` transport option.
    """

    gate_db: int
    broker_db: int
    key_prefix: str = ""

    def argument(self) -> str:
        return f"{self.gate_db}|{self.broker_db}|{self.key_prefix}"


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


#: A ``holder`` no claimant begins with: the kill of a message no worker process started ends
#: the member only while no one has claimed it.
NO_HOLDER = "\0"


def claimant_prefix(hostname: str, pid: int) -> str:
    """What every claimant a worker process makes begins with (``worker.lease.new_claimant``)."""
    return f"{hostname}/{pid}/"


def call_id(caller: Optional[str] = None) -> str:
    """``caller``, or a fresh id for a call that is its own (see ``Gate.finish``)."""
    return caller or unique_id()


def unique_id() -> str:
    """An id no other call of any process takes: this process's random nonce (drawn again in a
    forked child, whose counter starts over) and a counter.  Every ending takes one; the counter
    saves the hot path a random draw (a system call) per id."""
    return _ids.nonce + format(next(_ids.counter), "x")


class _Ids:
    def __init__(self) -> None:
        self.renew()

    def renew(self) -> None:
        # Fixed length: no nonce and counter of one id read as another's.
        self.nonce = secrets.token_hex(8)
        self.counter = itertools.count()


_ids = _Ids()
os.register_at_fork(after_in_child=_ids.renew)


def _max_retries(value: Optional[int]) -> int:
    return -1 if value is None else int(value)
