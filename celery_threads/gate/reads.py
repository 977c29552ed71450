"""The gate's plain reads: what a thread holds, which threads exist, the dead-letter store, the
paused threads, and the indexes' sizes and counters that health and metrics report.  Nothing here
changes the gate (its read-only scripts included); the transitions are :mod:`.transitions`'.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, Callable, Optional, cast

import redis

from ..keys import Keys, ShardKeys
from .cluster import rerun_unrun
from .library import _load_lua
from .records import Record, _text, find_record, parse_record, pause_reason
from .replies import DeadRecord, Scan, ThreadSnapshot

DEAD_CHUNK = 500  # dead records read per HMGET
ID_PAGE = 500  # thread ids asked of each index per round trip (ZSCAN's COUNT)
SCAN_END = 1 << 64  # the position of a finished ZSCAN (cursor 0), past every other


def clock_argument(clock: Optional[Callable[[], int]]) -> str:
    """The scripts' "now" argument: empty (the Redis server's ``TIME``), or the model's clock."""
    return "" if clock is None else str(int(clock()))


class GateReads:
    """Plain reads of the gate for one Redis client and key prefix (see :class:`~.transitions.Gate`,
    which holds one as ``reads``).  ``clock``: as the gate's, the time in milliseconds to use
    instead of the Redis server's ``TIME`` (only the model-based test sets it)."""

    def __init__(self, client: redis.Redis, keys: Keys, clock: Optional[Callable[[], int]] = None) -> None:
        self.client = client
        self.keys = keys
        self.clock = clock
        self._scan = client.register_script(_load_lua("_clock.lua") + "\n" + _load_lua("scan.lua"))
        self._snapshot = client.register_script(_load_lua("_member.lua") + "\n" + _load_lua("snapshot.lua"))
        self._summaries = client.register_script(_load_lua("_member.lua") + "\n" + _load_lua("summaries.lua"))
        self._ids = client.register_script(_load_lua("ids.lua"))

    # -- one thread -------------------------------------------------------------------------
    def thread_of(self, task_id: str) -> Optional[str]:
        found = self.record(task_id)
        return None if found is None else found.thread_id

    def record(self, task_id: str, thread_id: Optional[str] = None) -> Optional[Record]:
        """The record of member ``task_id`` (its thread, its stored message...), looked for in
        ``thread_id``'s shard when it is known, else in every shard; ``None`` for no member."""
        shards = [self.keys.thread(thread_id).shard] if thread_id is not None else self.keys.all_shards()
        for shard in shards:
            _, value = find_record(self.client, shard.tasks, task_id)
            if value is not None:
                return parse_record(value)
        return None

    def knows(self, thread_id: str, task_id: str) -> bool:
        """Whether ``task_id`` is a member of ``thread_id``'s shard, or ended there within the
        ended window (lua/_common.lua ``ENDED_WINDOW``, 30 s; longer for one whose id is
        remembered so)."""
        shard = self.keys.thread(thread_id).shard
        if self.record(task_id, thread_id) is not None:
            return True
        return self.client.zscore(shard.ended, task_id) is not None

    def snapshot(self, thread_id: str, limit: Optional[int] = None) -> Optional[ThreadSnapshot]:
        """A consistent read of one thread (a read-only script: its members' records live in the
        shard's tasks hash, under ids the thread's own keys name); of its waiting members, the
        first ``limit`` in release order (all when ``None``), and their number."""
        keys = self.keys.thread(thread_id)
        active, queue, records, due_at, paused, total = self._snapshot(
            keys=[keys.active, keys.queue, keys.shard.tasks, keys.shard.due, keys.shard.paused],
            args=[thread_id, limit or 0],
        )
        if not active and not queue and not paused:
            return None
        return ThreadSnapshot(
            thread_id=thread_id,
            active=_active_fields(active),
            waiting=[(_text(t), int(score)) for t, score in zip(queue[::2], queue[1::2])],
            records={_text(t): r for t, r in zip(records[::2], records[1::2])},
            due_at=None if due_at in (b"", "", None) else int(due_at),
            paused=pause_reason(_text(paused[0])) if paused else None,
            waiting_total=int(total),
        )

    def peek(self, thread_id: str, task_id: str, token: str) -> Optional[str]:
        """The state of (task, token) when it is the thread's active member, else ``None``.

        A plain read (no script): a worker's cheap filter of stale deliveries on receipt.
        """
        task, current, state = self.client.hmget(
            self.keys.thread(thread_id).active, ["task", "token", "state"]
        )
        if task is None or _text(task) != task_id or _text(current) != token:
            return None
        return _text(state)

    def holds(self, thread_id: str, task_id: str) -> bool:
        """Whether ``task_id`` is the active member of its thread (a plain read)."""
        task = self.client.hget(self.keys.thread(thread_id).active, "task")
        return task is not None and _text(task) == task_id

    # -- every thread -----------------------------------------------------------------------
    def thread_ids(self, page: int = ID_PAGE) -> Iterator[str]:
        """Every existing thread, a cursor over the shards' due and leases indexes (each thread
        with no pause is in exactly one of them): about ``page`` ids per round trip, so the first
        ``n`` ids cost O(n) reads whatever the gate's size.  Then each shard's paused threads
        with no active member, which sit in neither index (one with no member at all exists for
        its pause alone): O(paused threads).

        Each round reads both indexes of a shard from one ZSCAN cursor in one MULTI, so a thread
        moving between them is seen in one or the other.  A thread that exists throughout the
        listing is yielded at least once, and once only, unless Redis shrinks an index's hash
        table during the listing (an index lost 90% of its threads meanwhile: SCAN's own
        caveat), when one may come twice.  Threads created or ended meanwhile may or may not
        appear (docs/internals.md, "Listing threads").
        """
        for shard in self.keys.all_shards():
            yield from self._shard_thread_ids(shard, page)

    def _shard_thread_ids(self, shard: ShardKeys, page: int) -> Iterator[str]:
        # ZSCAN's cursor is a position in one order of hashes shared by both indexes (the bucket
        # in bit-reversed order, whatever each table's size), so a cursor one index returned
        # resumes the other.  The round's next cursor is the nearer of the two; what the other
        # index returned past it may come again, from either index, until the cursor passes the
        # position it returned: ``recent`` keeps those ids (about a page or two) to skip them.
        cursor = 0
        recent: dict[str, int] = {}  # id -> position past which it cannot come again
        while True:
            # One script (not MULTI, which a gate's ACL user may lack, nor a cluster pipeline):
            # both indexes from the same cursor in one atomic step.
            replies = self._ids(keys=[shard.due, shard.leases], args=[cursor, page])
            rounds = [(_scan_position(int(after)), rows[::2]) for after, rows in replies]
            reached = min(position for position, _ in rounds)
            for position, members in rounds:
                for member in members:
                    thread_id = _text(member)
                    if thread_id not in recent:
                        yield thread_id
                    recent[thread_id] = max(position, recent.get(thread_id, 0))
            if reached == SCAN_END:
                # A paused thread with an active member is in leases: listed above.
                yield from (t for t, lease in self.paused_leases(shard).items() if lease is None)
                return
            # A smaller table resumes from the start of its bucket holding ``reached``: ids just
            # behind it may come again, so the nearest ones behind are kept too (bounded).
            behind = sorted((p, t) for t, p in recent.items() if p <= reached)[-(page + 1024) :]
            recent = {t: p for t, p in recent.items() if p > reached}
            recent.update((t, p) for p, t in behind)
            cursor = _reverse_bits(reached)

    # -- the dead-letter store ------------------------------------------------------------
    def dead_record(self, task_id: str) -> Optional[DeadRecord]:
        for shard in self.keys.all_shards():
            raw: Optional[bytes] = self.client.hget(shard.dead_records, task_id)  # type: ignore[assignment]
            if raw is not None:
                return DeadRecord.parse(task_id, raw)
        return None

    def dead_records(self, limit: Optional[int] = None) -> list[DeadRecord]:
        """The dead-letter store, oldest first; with ``limit``, only the ``limit`` latest deaths.
        Records are read ``DEAD_CHUNK`` at a time, so a large store is never one huge reply."""
        records: list[DeadRecord] = []
        for shard in self.keys.all_shards():
            start = -limit if limit is not None else 0
            ids: list[Any] = self.client.zrange(shard.dead, start, -1) if limit != 0 else []
            for at in range(0, len(ids), DEAD_CHUNK):
                chunk = ids[at : at + DEAD_CHUNK]
                raws: list[Any] = self.client.hmget(shard.dead_records, chunk)
                records.extend(
                    DeadRecord.parse(_text(task_id), raw)
                    for task_id, raw in zip(chunk, raws)
                    if raw is not None
                )
        if self.keys.shards > 1:  # each shard is in death order; merge them by time
            records.sort(key=lambda r: r.died_at_ms)
            if limit is not None:
                records = records[-limit:] if limit else []
        return records

    def dead_dropped(self) -> int:
        """Dead letters dropped by retention, ever, over every shard."""
        return sum(int(self.client.get(shard.dead_dropped) or 0) for shard in self.keys.all_shards())

    def dead_ids(self, shard: ShardKeys, start: int, count: int) -> list[str]:
        """Task ids of ``shard``'s dead-letter store in death order, ``count`` from ``start``."""
        return [_text(t) for t in self.client.zrange(shard.dead, start, start + count - 1)]

    def last_death(self, shard: ShardKeys) -> Optional[int]:
        """The score (its shard's sequence number) of ``shard``'s latest death, ``None`` when its
        dead-letter store is empty."""
        latest = self.client.zrange(shard.dead, -1, -1, withscores=True)
        return int(latest[0][1]) if latest else None

    def dead_count(self) -> int:
        return sum(int(self.client.zcard(shard.dead)) for shard in self.keys.all_shards())

    def dead_in_order(self, shard: ShardKeys, chunk: int = DEAD_CHUNK) -> Iterator[DeadRecord]:
        """``shard``'s dead letters in death order, read ``chunk`` at a time as the caller takes
        them (never one huge reply)."""
        start = 0
        while True:
            ids = self.dead_ids(shard, start, chunk)
            if not ids:
                return
            raws: list[Any] = self.client.hmget(shard.dead_records, ids)
            for task_id, raw in zip(ids, raws):
                if raw is not None:
                    yield DeadRecord.parse(task_id, raw)
            start += len(ids)

    # -- paused threads -------------------------------------------------------------------
    def paused(self, shard: ShardKeys) -> dict[str, str]:
        """The paused threads of ``shard`` and their reasons: O(paused threads), an operator's
        handful, never a scan of the threads."""
        return {_text(k): pause_reason(_text(v)) for k, v in self.client.hgetall(shard.paused).items()}

    def paused_leases(self, shard: ShardKeys) -> dict[str, Optional[int]]:
        """The paused threads of ``shard``, each with its active member's deadline (ms), or
        ``None`` when nothing is active (then the thread is in no index): O(paused threads)."""
        thread_ids = list(self.paused(shard))
        if not thread_ids:
            return {}
        scores = self.client.zmscore(shard.leases, thread_ids)
        return {t: None if score is None else int(score) for t, score in zip(thread_ids, scores)}

    def paused_reasons(self, thread_ids: Sequence[str]) -> list[Optional[str]]:
        """Each thread's pause reason, or ``None`` when it is not paused (one round trip)."""
        pipe = self.client.pipeline(transaction=False)
        for thread_id in thread_ids:
            pipe.hget(self.keys.thread(thread_id).shard.paused, thread_id)
        return [None if r is None else pause_reason(_text(r)) for r in pipe.execute()] if thread_ids else []

    # -- the dispatcher's reads -----------------------------------------------------------
    def now_ms(self) -> int:
        if self.clock is not None:
            return int(self.clock())
        seconds, micros = self.client.time()
        return int(seconds) * 1000 + int(micros) // 1000

    def scan_due(self, shard: ShardKeys, limit: int) -> Scan:
        """Threads with a due head and threads with a lapsed deadline (at most ``limit`` of each),
        the earliest future entry of either index, and the server's time: one read-only script,
        O(log n + limit)."""
        now, due, lapsed, next_due, next_lease = self._scan(
            keys=[shard.due, shard.leases], args=[clock_argument(self.clock), limit]
        )
        future = [int(float(x)) for x in (next_due, next_lease) if x not in (b"", "")]
        return Scan(
            now_ms=int(now),
            due=[_text(t) for t in due],
            lapsed=[_text(t) for t in lapsed],
            next_ms=min(future, default=None),
        )

    # -- counts and health (for Threads' health API, the command line and the metrics) --------
    def stats_counters(self, shard: ShardKeys) -> dict[Any, Any]:
        """``shard``'s stats hash, the counters the transitions keep (celery_threads.metrics)."""
        return cast(dict[Any, Any], self.client.hgetall(shard.stats))

    def waiting_counts(self, thread_ids: Sequence[str]) -> list[int]:
        """How many members wait in each thread's queue (one round trip)."""
        pipe = self.client.pipeline(transaction=False)
        for thread_id in thread_ids:
            pipe.zcard(self.keys.thread(thread_id).queue)
        return [int(n) for n in pipe.execute()] if thread_ids else []

    def waiting_count(self, thread_id: str) -> int:
        """How many members wait in ``thread_id``'s queue: O(1)."""
        return int(self.client.zcard(self.keys.thread(thread_id).queue))

    def waiting_total(self) -> int:
        """How many members wait (neither released nor running) in every thread: O(1) per shard."""
        return sum(
            max(0, int(self.client.hlen(s.tasks)) - int(self.client.zcard(s.leases)))
            for s in self.keys.all_shards()
        )

    def thread_summaries(
        self, thread_ids: Sequence[str]
    ) -> list[tuple[dict[str, str], int, Optional[tuple[str, int]], Optional[int]]]:
        """For each thread: its active hash, how many members wait, its head as ``(task id,
        scheduled_at ms)`` (``None`` when none waits), and when an idle thread's head is released
        (its due index score: the head's scheduled_at, or later under a thread_rate_limit;
        ``None`` while a member is active or the thread is paused); a read-only script per shard
        (a head's task id needs its record), pipelined."""
        if not thread_ids:
            return []
        by_shard: dict[int, list[int]] = {}
        for i, thread_id in enumerate(thread_ids):
            by_shard.setdefault(self.keys.shard_of(thread_id), []).append(i)
        pipe = self.client.pipeline(transaction=False)
        calls: list[tuple[list[str], list[str]]] = []
        for shard, indexes in by_shard.items():
            keys = [self.keys.shard(shard).tasks, self.keys.shard(shard).due]
            for i in indexes:
                thread = self.keys.thread(thread_ids[i])
                keys += [thread.active, thread.queue]
            calls.append((keys, [thread_ids[i] for i in indexes]))
            self._summaries(keys=keys, args=calls[-1][1], client=pipe)
        rows: list[Any] = [None] * len(thread_ids)
        results = rerun_unrun(
            pipe.execute(raise_on_error=False), lambda n: self._summaries(keys=calls[n][0], args=calls[n][1])
        )
        for indexes, replies in zip(by_shard.values(), results):
            for i, (active, waiting, head, at, due) in zip(indexes, replies):
                rows[i] = (
                    _active_fields(active),
                    int(waiting),
                    (_text(head), int(at)) if at not in (b"", "") else None,
                    int(float(due)) if due not in (b"", "") else None,
                )
        return rows

    def overdue(
        self, shard: ShardKeys, before_ms: int, limit: int
    ) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
        """Threads of ``shard`` whose active member's deadline (leases index), or whose idle head's
        scheduled_at (due index), is at or before ``before_ms``: at most ``limit`` of each, earliest
        first, as ``(thread id, ms)``.  O(log n + limit): never a scan of all threads."""
        pipe = self.client.pipeline(transaction=False)
        pipe.zrangebyscore(shard.leases, "-inf", before_ms, start=0, num=limit, withscores=True)
        pipe.zrangebyscore(shard.due, "-inf", before_ms, start=0, num=limit, withscores=True)
        lapsed, due = pipe.execute()
        return ([(_text(m), int(score)) for m, score in lapsed], [(_text(m), int(score)) for m, score in due])

    def index_counts(self, shard: ShardKeys, now_ms: int, overdue_before_ms: int) -> dict[str, Any]:
        """Sizes of ``shard``'s indexes, each O(1) or O(log n): ``idle`` and ``active`` threads,
        ``members``, ``dead`` tasks, ``lapsed`` deadlines and ``overdue_heads`` at or before
        ``overdue_before_ms``, and ``oldest_due``, the idle thread whose head has been due the
        longest at ``now_ms`` as ``(thread id, scheduled_at ms)`` or ``None``."""

        def read(transaction: bool) -> list[Any]:
            pipe = self.client.pipeline(transaction=transaction)
            pipe.zcard(shard.due)
            pipe.zcard(shard.leases)
            pipe.hlen(shard.tasks)
            pipe.zcard(shard.dead)
            pipe.zcount(shard.leases, "-inf", overdue_before_ms)
            pipe.zcount(shard.due, "-inf", overdue_before_ms)
            pipe.zrangebyscore(shard.due, "-inf", now_ms, start=0, num=1, withscores=True)
            return list(pipe.execute())

        try:
            counts = read(True)  # one snapshot
        except redis.exceptions.OutOfMemoryError:
            # A server at its maxmemory refuses whatever a MULTI queues, reads too: the health
            # check is wanted most then.
            counts = read(False)
        idle, active, members, dead, lapsed, overdue_heads, oldest = counts
        return {
            "idle": int(idle),
            "active": int(active),
            "members": int(members),
            "dead": int(dead),
            "lapsed": int(lapsed),
            "overdue_heads": int(overdue_heads),
            "oldest_due": (_text(oldest[0][0]), int(oldest[0][1])) if oldest else None,
        }

    def active_states(self, shard: ShardKeys, batch: int = 1000) -> dict[str, int]:
        """How many active members of ``shard`` are in each state (``RELEASED``, ``RUNNING``).

        O(active threads): the leases index is walked incrementally, each batch's states read in
        one pipelined round trip."""
        counts: dict[str, int] = {}
        pending: list[str] = []
        seen: set[str] = set()  # ZSCAN may return an entry twice while the ZSET is rehashed

        def count(thread_ids: list[str]) -> None:
            pipe = self.client.pipeline(transaction=False)
            for thread_id in thread_ids:
                pipe.hget(self.keys.thread(thread_id).active, "state")
            for state in pipe.execute():
                if state is not None:
                    counts[_text(state)] = counts.get(_text(state), 0) + 1

        for member, _ in self.client.zscan_iter(shard.leases, count=batch):
            thread_id = _text(member)
            if thread_id in seen:
                continue
            seen.add(thread_id)
            pending.append(thread_id)
            if len(pending) >= batch:
                count(pending)
                pending = []
        if pending:
            count(pending)
        return counts


def _reverse_bits(value: int) -> int:
    """``value``'s 64 bits in reverse order: a ZSCAN cursor to its position and back."""
    return int(f"{value:064b}"[::-1], 2)


def _scan_position(cursor: int) -> int:
    """Where the ZSCAN that returned ``cursor`` stopped, in the order it walks hashes (the
    bit-reversed bucket: the same order for tables of any size)."""
    return SCAN_END if cursor == 0 else _reverse_bits(cursor)


def _active_fields(flat: Any) -> dict[str, str]:
    """An active hash as HGETALL gives it, as text, without 'f' (the member's tasks-hash field,
    bytes a UUID's is kept as: lua/_common.lua, activate)."""
    return {_text(k): _text(v) for k, v in zip(flat[::2], flat[1::2]) if k not in (b"f", "f")}
