"""Every Redis key name of the gate, built from one prefix.

All keys of one shard share one hash tag, so each script touches a single Redis Cluster slot.  A
thread's keys carry the tag of the shard its id hashes to (crc32 of the id, modulo the shard count).
With one shard the tag is ``{0}``; with ``n`` shards, shard ``i``'s tag is the first ``i.k`` whose
Cluster slot lies in the ``i``-th of ``n`` equal ranges of the 16,384 slots (:func:`shard_tag`), so
the shards spread over a cluster's masters as evenly as its slot ranges do.
"""

from __future__ import annotations

import functools
import zlib
from dataclasses import dataclass

from redis.crc import REDIS_CLUSTER_HASH_SLOTS, key_slot


@functools.cache
def shard_tag(shard: int, shards: int) -> str:
    """The hash tag's content of shard ``shard`` of ``shards``: ``0`` for a single shard, else the
    first ``<shard>.<k>`` whose slot is in the shard's range (a few dozen tries at most)."""
    if shards == 1:
        return "0"
    low = shard * REDIS_CLUSTER_HASH_SLOTS // shards
    high = (shard + 1) * REDIS_CLUSTER_HASH_SLOTS // shards
    k = 0
    while not low <= key_slot(f"{shard}.{k}".encode()) < high:
        k += 1
    return f"{shard}.{k}"


@dataclass(frozen=True)
class ShardKeys:
    """The index keys of one shard."""

    prefix: str
    shard: int
    shards: int = 1

    @property
    def tag(self) -> str:
        return f"{self.prefix}:{{{shard_tag(self.shard, self.shards)}}}"

    @property
    def seq(self) -> str:
        """String counter: arrival order of members and fencing tokens."""
        return f"{self.tag}:seq"

    @property
    def due(self) -> str:
        """ZSET thread id -> head's scheduled_at (ms), for threads with no active member."""
        return f"{self.tag}:due"

    @property
    def leases(self) -> str:
        """ZSET thread id -> deadline (ms) of its active member's release or lease."""
        return f"{self.tag}:leases"

    @property
    def tasks(self) -> str:
        """HASH task id (its field: ``gate.task_field``) -> record, for every member:
        ``[\\2 <a UUID's last two bytes>]seq|retries|max_retries|retry_delay_ms|<length of thread
        id>\\n<thread id><envelope>`` (see :func:`celery_threads.gate.parse_record`).

        One entry per member is both the index of task ids and the store of their messages."""
        return f"{self.tag}:tasks"

    @property
    def dead(self) -> str:
        """ZSET task id -> death order (a shard counter value): the dead-letter store's order."""
        return f"{self.tag}:dead"

    @property
    def dead_records(self) -> str:
        """HASH task id -> ``died_at_ms \\n meta_json \\n envelope`` of each dead task."""
        return f"{self.tag}:dead:records"

    @property
    def dead_dropped(self) -> str:
        """STRING counter: dead letters dropped by retention (``threads_dead_letter_max`` and
        ``threads_dead_letter_ttl``), ever."""
        return f"{self.tag}:dead:dropped"

    @property
    def ended(self) -> str:
        """ZSET task id -> ended_at (ms) of the members that left in the last 30 s: an enqueue
        of one of them (a replay after a lost reply) is a duplicate, not a new member.  A UUID
        member keyed by its long form is here at +inf until it ends (lua/_common.lua,
        add_member)."""
        return f"{self.tag}:ended"

    @property
    def paused(self) -> str:
        """HASH thread id -> reason of each paused thread (``Threads.pause``): operator state,
        kept until ``resume`` whether or not the thread has members.  A paused thread with no
        active member sits in neither the due nor the leases index."""
        return f"{self.tag}:paused"

    @property
    def stats(self) -> str:
        """HASH of the shard's counters, kept by the transitions themselves (``celery threads
        metrics`` reads them; never a scan of threads or members)."""
        return f"{self.tag}:stats"

    @property
    def wake_channel(self) -> str:
        """Pub/sub channel told when a future head becomes the shard's earliest."""
        return f"{self.tag}:wake"

    def deleted_note(self, task_id: str) -> str:
        """STRING (short-lived): a member deleted by ``Threads.delete`` that a worker should
        announce as revoked (the ``task-revoked`` event Flower shows)."""
        return f"{self.tag}:deleted:{task_id}"

    def announcement(self, note_id: str) -> str:
        """STRING (short-lived): dead letters put back into their threads that one worker
        announces with ``task-retried`` (``Threads.restart`` and ``redrive``): '1' until a
        worker takes it, 'taken' while it sends, gone once they are sent."""
        return f"{self.tag}:announce:{note_id}"

    def thread(self, thread_id: str) -> ThreadKeys:
        return ThreadKeys(self, thread_id)


@dataclass(frozen=True)
class ThreadKeys:
    """The keys of one thread, plus its shard's index keys, in the order every script takes them."""

    shard: ShardKeys
    thread_id: str

    @property
    def base(self) -> str:
        return f"{self.shard.tag}:t:{self.thread_id}"

    @property
    def queue(self) -> str:
        """ZSET of waiting members scored by scheduled_at (ms): seq and task id (lua/_member.lua)."""
        return f"{self.base}:q"

    @property
    def active(self) -> str:
        """HASH describing the active member (task, token, state, since, deadline, worker, n,
        l: whether it is keyed by its long form)."""
        return f"{self.base}:a"

    @property
    def policy(self) -> str:
        """HASH of the thread's policy state (task options ``thread_rate_limit``, ``coalesce``,
        ``debounce``): it outlives the thread's last member only as long as a policy needs it."""
        return f"{self.base}:p"

    def script_keys(self) -> list[str]:
        s = self.shard
        return [
            s.seq,
            s.due,
            s.leases,
            s.tasks,
            s.dead,
            s.dead_records,
            self.queue,
            self.active,
            s.ended,
            s.paused,
            s.stats,
            self.policy,
        ]


@dataclass(frozen=True)
class Keys:
    prefix: str
    shards: int = 1

    def shard_of(self, thread_id: str) -> int:
        if self.shards == 1:
            return 0
        return zlib.crc32(thread_id.encode()) % self.shards

    def shard(self, index: int) -> ShardKeys:
        return ShardKeys(self.prefix, index, self.shards)

    @property
    def meta(self) -> str:
        """STRING: the shard count the gate's members were stored with (see
        :func:`celery_threads.gate.cluster.check_shards`)."""
        return f"{self.prefix}:shards"

    def all_shards(self) -> list[ShardKeys]:
        return [self.shard(i) for i in range(self.shards)]

    def thread(self, thread_id: str) -> ThreadKeys:
        return self.shard(self.shard_of(thread_id)).thread(thread_id)
