"""Memory shared between a prefork worker's main process and its pool processes.

All of it is made here, in the main process before its pool forks (:func:`prepare`), with one
entry per pool process by the pool's process index, which a pool process finds here once, when
it starts (:func:`on_pool_process_start`).  A process that is not a prefork pool process (the
main process, a worker of the threads, solo or gevent pool) has no index, and writes nothing.

* **Lease ends** (:class:`LeaseEnds`): while a member's code runs, its pool process publishes
  the end of that member's lease (:func:`publish_lease_end`); the main process's watchdog
  (:class:`celery_threads.worker.lease.Watchdog`) reads them and stops a process whose lease
  ends within the margin.
* **Handoff slots** (:class:`Slots`): each pool process names the member it runs by in-process
  handoff (:mod:`celery_threads.worker.handoff`), for the main process to terminate it
  (``revoke(terminate=True)``, ``Threads.delete``) or to fail it at once when the process is
  lost.
* **The handoff's flag** (:func:`handoff_flag`): one byte the main process sets and every pool
  process reads (its values are the handoff's).

A handoff slot must hold every valid identity: a thread id of any characters (``"\\x00"``
included) up to :data:`~celery_threads.protocol.MAX_THREAD_ID_BYTES`, a task id of any length, a
token.  So its fields are length-prefixed, with no separators, and a task id longer than the room
left is kept as its SHA-256 digest (:attr:`Member.digest`): the main process matches a task id it
is asked about against it, and reads the id itself from the gate when it must fail the member
(``handoff.lost_member``).

Only its pool process writes a slot; the main process reads it at any time, also while the pool
process rewrites it for its next member.  So each slot is a seqlock: a sequence number made odd
before a write and even after it, and a reader that retries while it is odd or has changed.  A
CRC of the contents catches what the sequence number alone would not on a CPU that may make the
stores visible out of order.  Layout of a slot (little-endian)::

    <seq 8><pid 8><crc 4><thread id bytes 2><token bytes 2><task id bytes 4><digest 1>
    <thread id><token><task id, or its 32-byte digest>

pid 0: the process runs no member by handoff.  Texts are UTF-8 with surrogates passed through,
so any ``str`` comes back as it went in.
"""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import struct
import time
import zlib
from collections.abc import Iterator
from typing import Any, NamedTuple, Optional

from .. import seams
from ..errors import ThreadsError
from ..logs import get_logger

#: Bytes per slot: a thread id of the maximum length, a token, and a task id of about 3,000
#: bytes fit in full; a longer task id is kept as its digest.
SIZE = 4096
_SEQ = struct.Struct("<Q")
_HEAD = struct.Struct("<QIHHIB")  # pid, crc, thread id, token and task id lengths, digest
_BODY = _SEQ.size + _HEAD.size  # where the texts start
ROOM = SIZE - _BODY
_DIGEST = hashlib.sha256().digest_size

logger = get_logger(__name__)


class Member(NamedTuple):
    """What a slot names: ``task_id`` is ``""`` when only its ``digest`` fit."""

    thread_id: str
    task_id: str
    token: str
    digest: bytes = b""

    def matches(self, task_id: str) -> bool:
        """Whether this is the member with ``task_id``."""
        if self.digest:
            return digest(task_id) == self.digest
        return self.task_id == task_id


class Unreadable(ThreadsError):
    """A slot that stayed mid-write for the whole patience of its reader (its writer died in
    the middle of a write, or is held up)."""


def encode(text: str) -> bytes:
    return text.encode("utf-8", "surrogatepass")


def decode(data: bytes) -> str:
    return data.decode("utf-8", "surrogatepass")


def digest(task_id: str) -> bytes:
    return hashlib.sha256(encode(task_id)).digest()


def pack(pid: int, member: Optional[Member]) -> bytes:
    """A slot's contents after its sequence number (``None``: empty).  Raises ``ValueError`` for
    a member whose thread id and token leave no room for a digest: never a valid thread id."""
    if member is None or not pid:
        return _sealed(0, b"", b"", b"", False)
    thread, token, task = encode(member.thread_id), encode(member.token), encode(member.task_id)
    if len(thread) + len(token) + _DIGEST > ROOM:
        raise ValueError(
            f"a thread id of {len(thread)} bytes and a token of {len(token)} do "
            f"not fit a handoff slot ({ROOM} bytes)"
        )
    if len(thread) + len(token) + len(task) > ROOM:
        return _sealed(pid, thread, token, digest(member.task_id), True)
    return _sealed(pid, thread, token, task, False)


def _sealed(pid: int, thread: bytes, token: bytes, task: bytes, hashed: bool) -> bytes:
    texts = thread + token + task
    lengths = (len(thread), len(token), len(task), int(hashed))
    crc = zlib.crc32(_HEAD.pack(pid, 0, *lengths) + texts)
    return _HEAD.pack(pid, crc, *lengths) + texts


def unpack(contents: bytes) -> Optional[tuple[int, Optional[Member]]]:
    """``(pid, member or None)`` from a slot's contents (as :func:`pack` wrote them, possibly
    followed by stale bytes), or ``None`` when they are torn."""
    if len(contents) < _HEAD.size:
        return None
    pid, crc, thread_n, token_n, task_n, hashed = _HEAD.unpack_from(contents)
    end = _HEAD.size + thread_n + token_n + task_n
    if end > len(contents) or hashed > 1:
        return None
    texts = contents[_HEAD.size : end]
    if zlib.crc32(_HEAD.pack(pid, 0, thread_n, token_n, task_n, hashed) + texts) != crc:
        return None
    if not pid:
        return 0, None
    thread, token = texts[:thread_n], texts[thread_n : thread_n + token_n]
    task = texts[thread_n + token_n :]
    try:
        if hashed:
            return pid, Member(decode(thread), "", decode(token), task)
        return pid, Member(decode(thread), decode(task), decode(token))
    except UnicodeDecodeError:
        return None


class Slots:
    """The handoff's slots: one per pool process (by its index)."""

    def __init__(self, count: int) -> None:
        self.memory: Any = multiprocessing.RawArray("c", max(count, 1) * SIZE)
        for index in range(len(self)):
            self.write(index, 0, None)

    def __len__(self) -> int:
        return len(self.memory) // SIZE

    def write(self, index: int, pid: int, member: Optional[Member]) -> None:
        """Name ``member`` (or none) in slot ``index``: only that slot's pool process writes it."""
        at = index * SIZE
        contents = pack(pid, member)
        seq = _SEQ.unpack(self.memory[at : at + _SEQ.size])[0]
        odd = seq | 1  # already odd when a dead predecessor stopped in mid-write
        self.memory[at : at + _SEQ.size] = _SEQ.pack(odd)
        self.memory[at + _SEQ.size : at + _SEQ.size + len(contents)] = contents
        self.memory[at : at + _SEQ.size] = _SEQ.pack(odd + 1)

    def read(self, index: int, patience: float) -> tuple[int, int, Optional[Member]]:
        """``(seq, pid, member or None)`` of slot ``index``, as one write left it; retries for up
        to ``patience`` seconds while a write is under way, then raises :class:`Unreadable`."""
        at = index * SIZE
        deadline = time.monotonic() + patience
        tries = 0
        while True:
            seq = _SEQ.unpack(self.memory[at : at + _SEQ.size])[0]
            if not seq % 2:
                head = self.memory[at + _SEQ.size : at + _BODY]
                _, _, thread_n, token_n, task_n, _ = _HEAD.unpack(head)
                end = min(at + _BODY + thread_n + token_n + task_n, at + SIZE)
                contents = head + self.memory[at + _BODY : end]
                read = unpack(contents)
                if read is not None and _SEQ.unpack(self.memory[at : at + _SEQ.size])[0] == seq:
                    return seq, read[0], read[1]
            tries += 1
            if time.monotonic() >= deadline:
                raise Unreadable(f"slot {index} is being written (sequence {seq})")
            # A write takes microseconds; a writer preempted in the middle of one, longer.
            time.sleep(0 if tries < 100 else 0.001)

    def members(self, patience: float) -> Iterator[tuple[int, int, int, Member]]:
        """``(index, seq, pid, member)`` of each slot naming a member; a slot that stays
        unreadable for ``patience`` seconds is left out, with a warning."""
        for index in range(len(self)):
            try:
                seq, pid, member = self.read(index, patience)
            except Unreadable as exc:
                logger.warning(
                    "celery-threads: %s; the member its pool process runs by handoff "
                    "is not seen this time (a lost process's member then waits for "
                    "its lease to lapse)",
                    exc,
                )
                continue
            if pid and member is not None:
                yield index, seq, pid, member


class LeaseEnds:
    """Per pool process (by its index): the end of the lease of the member its code runs, on the
    monotonic clock (0: none), and the process's pid while one is published.  Written by the pool
    process; read, and cleared once acted on, by the main process's watchdog."""

    def __init__(self, count: int) -> None:
        self.expiries: Any = multiprocessing.RawArray("d", max(count, 1))
        self.pids: Any = multiprocessing.RawArray("q", max(count, 1))

    def __len__(self) -> int:
        return len(self.expiries)


# -- made by the main process before the fork; inherited by every pool process -----------------
_lease_ends: Optional[LeaseEnds] = None
_slots: Optional[Slots] = None
_flag: Any = None  # multiprocessing.RawValue('b'): the handoff's flag
_index: Optional[int] = None  # this pool process's index into all of them


def pool_size(worker: Any) -> int:
    """How many pool processes the worker may run at once (autoscale included)."""
    return max(
        int(getattr(worker, "concurrency", 0) or 0), int(getattr(worker, "max_concurrency", 0) or 0), 1
    )


def prepare(processes: int) -> None:
    """In the worker's main process, before its pool forks: the entries of ``processes`` pool
    processes, and the handoff's flag (0 until the handoff sets it)."""
    global _lease_ends, _slots, _flag
    _lease_ends = LeaseEnds(processes)
    _slots = Slots(processes)
    _flag = multiprocessing.RawValue("b", 0)


def on_pool_process_start() -> None:
    """In a prefork pool process: find its index (billiard numbers its pool processes)."""
    global _index
    index = seams.pool_process_index()
    if _lease_ends is not None and index is not None and 0 <= index < len(_lease_ends):
        _index = index


def index() -> Optional[int]:
    """This pool process's index, or ``None`` (not a prefork pool process, or no memory made)."""
    return _index


def lease_ends() -> Optional[LeaseEnds]:
    """The lease ends, once made."""
    return _lease_ends


def publish_lease_end(expires: float) -> None:
    """In a pool process: the end of the running member's lease (0.0: none runs)."""
    if _index is None or _lease_ends is None:
        return
    _lease_ends.pids[_index] = os.getpid()
    _lease_ends.expiries[_index] = expires


def handoff_slots() -> Optional[Slots]:
    """The handoff's slots, once made."""
    return _slots


def handoff_flag() -> Any:
    """The handoff's flag (a ``RawValue`` with a ``value``), once made, else ``None``."""
    return _flag
