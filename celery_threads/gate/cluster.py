"""The gate on a Redis Cluster, and the shard count a gate's members were stored with.

With ``threads_redis_options={"cluster": True}`` the gate's client is redis-py's
:class:`~redis.cluster.RedisCluster`.  Every script call names only keys of one shard, so one hash
tag and one slot (:mod:`celery_threads.keys`), and redis-py sends it to the master of that slot:
``EVALSHA`` is routed by its first key, ``SCRIPT LOAD`` goes to every master, and a ``NOSCRIPT``
reply (a master that joined, or one that restarted) loads the script on every master and runs the
call again.  redis-py follows ``MOVED`` and ``ASK`` itself.  While a slot moves, a script whose keys
are not all on one side (some of a gate's keys never exist, so the slot's scripts wait for the
move to finish) is answered ``TRYAGAIN``: :class:`GateCluster` waits and sends it again, within
the client's retry budget, as redis-py's own few quick tries can run out before the slot is moved.
A refused call never ran, so sending it again is safe; a call whose reply was lost is recognized
by its script (lua/_common.lua ``replayed``).

The hot path's calls do not go through redis-py's cluster client: its way costs the caller about
four times the CPU of the call itself (it packs every argument, computes the slot of each of the
call's twelve keys, checks out a pooled connection and parses the reply generically), and its
work between calls leaves the master's caches colder, so that the same ``FCALL`` costs the master
more too.  :class:`ClusterScriptLine` keeps the single Redis's script line to each master instead:
the master of each shard is looked up once in the client's slot map and kept until a call misses;
a call the master refuses (``MOVED``, ``ASK``, ``TRYAGAIN``, ``CLUSTERDOWN``), or one on a new or
broken connection, goes the cluster client's way, which follows the redirect and updates the map.

What a cluster turns off: direct releases (scripts pushing into kombu's queue on the gate's
server): kombu's broker is not a cluster, so releases are published through kombu.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any, Callable, Optional

import redis
from redis.cluster import RedisCluster
from redis.exceptions import ClusterDownError, ClusterError, SlotNotCoveredError, TryAgainError

from ..errors import ConfigurationError
from ..keys import Keys, ShardKeys
from . import deadline
from .library import Library
from .wire import _MISSED, ScriptLine

#: Errors of a call that did not run because its slot was moving or unassigned.
_NOT_RUN = (TryAgainError, ClusterDownError, SlotNotCoveredError)


def is_cluster(client: Any) -> bool:
    return isinstance(client, RedisCluster)


def not_run(error: BaseException) -> bool:
    """Whether a call's error says it never ran: its slot was moving or being served elsewhere
    (``TRYAGAIN``, ``CLUSTERDOWN``, redis-py's redirections run out), or the script was not loaded
    on the master that holds the slot now (``NOSCRIPT``)."""
    return isinstance(error, (_NOT_RUN, redis.exceptions.NoScriptError)) or (
        type(error) is ClusterError and "TTL exhausted" in str(error)
    )


def rerun_unrun(replies: Sequence[Any], rerun: Callable[[int], Any]) -> list[Any]:
    """A pipeline's replies, each call a cluster's master refused unrun (NOSCRIPT from a master
    without the script: a cluster's pipeline does not load scripts; TRYAGAIN while its slot
    moves) run again on its own (``rerun(index)``), which loads the script where needed."""
    results = list(replies)
    for i, reply in enumerate(results):
        if isinstance(reply, Exception):
            if not not_run(reply):
                raise reply
            results[i] = rerun(i)
    return results


class GateCluster(RedisCluster):
    """redis-py's cluster client, which sends a call refused while its slot moves again, backing
    off, for at most ``budget`` seconds."""

    def __init__(self, *args: Any, budget: float = 15.0, **kwargs: Any) -> None:
        self.budget = budget
        super().__init__(*args, **kwargs)

    def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        def run() -> Any:
            return super(GateCluster, self).execute_command(  # type: ignore[no-untyped-call]
                *args, **kwargs
            )

        return _until_run(run, self.budget)


def _until_run(call: Callable[[], Any], budget: float) -> Any:
    started, pause = time.monotonic(), 0.02
    while True:
        try:
            return call()
        except (ClusterError, *_NOT_RUN) as exc:
            if (
                not not_run(exc) or time.monotonic() - started > budget or deadline.backoff(pause) < pause
            ):  # the caller's bound (.deadline)
                raise
        time.sleep(pause)
        pause = min(pause * 2, 0.5)


class ClusterScriptLine:
    """The hot path's line on a cluster: a :class:`~celery_threads.gate.wire.ScriptLine` to each
    master, the shard's master cached.  Its :meth:`call` returns ``_MISSED`` where the caller is
    to go the cluster client's way (the single Redis's line does the same), and forgets the
    shard's master then: the next call looks it up again in the client's slot map, which that
    way has brought up to date."""

    def __init__(self, client: RedisCluster, library: Optional[Library], shards: Sequence[ShardKeys]) -> None:
        self.client, self.library = client, library
        self._slot_keys = [shard.seq for shard in shards]  # a key of each shard: its slot
        self._shard_lines: list[Optional[ScriptLine]] = [None] * len(shards)
        self._lines: dict[str, ScriptLine] = {}  # by master (host:port)
        self._lock = threading.Lock()

    def call(self, command: Callable[[bool], bytes], shard: int = 0) -> Any:
        line = self._shard_lines[shard] or self._line(shard)
        if line is None:
            return _MISSED
        reply = line.call(command)
        if reply is _MISSED:
            self._shard_lines[shard] = None
        return reply

    def _line(self, shard: int) -> Optional[ScriptLine]:
        try:
            node = self.client.get_node_from_key(self._slot_keys[shard])  # type: ignore[no-untyped-call]
            connection = node and self.client.get_redis_connection(node)
        except (redis.RedisError, KeyError, IndexError):  # no map yet, or the slot uncovered
            return None
        if not node or connection is None:
            return None
        with self._lock:
            line = self._lines.get(node.name)
            if line is None:
                line = self._lines[node.name] = ScriptLine(connection, self.library)
        self._shard_lines[shard] = line
        return line


class Functions:
    """The transitions as ``FCALL`` of the gate's function library on a cluster (a third of the
    Redis time of ``EVALSHA``, which defines the prelude again on every call): when a master
    answers that it lacks a function (one that joined or restarted), the library is loaded on
    every master (``FUNCTION LOAD REPLACE``: the library's name carries its code's digest) and
    the call sent again.  Servers that cannot load it (Redis before 7, an ACL user without
    ``FUNCTION``) get ``EVALSHA`` (``fallback``) from then on."""

    def __init__(self, client: Any, source: str, functions: dict[str, str]) -> None:
        self.client, self.source, self.functions = client, source, functions
        self.usable = True

    def call(self, name: str, keys: list[str], args: list[Any], fallback: Callable[[], Any]) -> Any:
        if self.usable:
            for attempt in (0, 1):
                try:
                    return self.client.fcall(self.functions[name], len(keys), *keys, *args)
                except redis.ResponseError as exc:
                    message = str(exc).lower()
                    if attempt or not ("function not found" in message or "unknown command" in message):
                        raise
                if not self._load():
                    self.usable = False
                    break
        return fallback()

    def _load(self) -> bool:
        try:
            self.client.function_load(self.source, replace=True)
        except redis.ResponseError:
            return False
        return True


def make_cluster_client(url: str, kwargs: dict[str, Any], budget: float) -> GateCluster:
    """A cluster client from one node's URL (the others are discovered), with the gate client's
    socket settings.  redis-py's cluster client takes no ``retry_on_error`` (it retries on
    connection errors and timeouts itself); ``db`` must be 0 on a cluster."""
    kwargs = {k: v for k, v in kwargs.items() if k not in ("cluster", "retry_on_error")}
    # Each node's connections wait within the caller's bound, as a single Redis's do (.deadline):
    # a large call's longer wait included.
    tls = url.lower().startswith("rediss:") or bool(kwargs.get("ssl"))
    base = kwargs.get("connection_class") or (redis.SSLConnection if tls else redis.Connection)
    kwargs["connection_class"] = deadline.bounded_class(base)
    client: GateCluster = GateCluster.from_url(url, budget=budget, **kwargs)  # type: ignore[assignment]
    return client


def check_shards(client: Any, keys: Keys) -> None:
    """Record the shard count in the gate (``keys.meta``) the first time, and refuse a different
    one from then on.  An empty gate did take a new count: a process started with it during a
    rolling deploy flipped the count while processes with the old one ran on, and each layout
    then held an active member of the same thread.  Changing the count is an operator's act,
    once no process uses the old one: the message says how."""
    stored = _stored_shards(client, keys)
    if stored is None:
        # A gate from before the count was recorded has its members under one shard.
        if keys.shards != 1 and _holds_members(client, Keys(keys.prefix, 1)):
            stored = 1
        else:
            client.set(keys.meta, keys.shards, nx=True)
            stored = _stored_shards(client, keys)
    if stored is None or stored == keys.shards:
        return
    if _holds_members(client, Keys(keys.prefix, stored)):
        raise ConfigurationError(
            f"threads_shards={keys.shards}, but the gate under prefix {keys.prefix!r} holds "
            f"members or dead letters stored with threads_shards={stored}. Set threads_shards "
            f"back to {stored}, or let the gate drain (no members, dead letters forgotten) "
            "before changing it; members are not moved between shards."
        )
    raise ConfigurationError(
        f"threads_shards={keys.shards}, but the gate under prefix {keys.prefix!r} records "
        f"threads_shards={stored}, which other processes may still use (two counts at once would "
        f"let two members of a thread run together). Set threads_shards back to {stored}; or, to "
        f"change the count, stop every worker, beat and producer that uses {stored}, then delete "
        f"the key {keys.meta!r} from the gate's Redis (it is empty: no members, no dead letters) "
        f"and start them with {keys.shards}."
    )


def _stored_shards(client: Any, keys: Keys) -> Optional[int]:
    value = client.get(keys.meta)
    return None if value is None else int(value)


def _holds_members(client: Any, keys: Keys) -> bool:
    return any(int(client.hlen(shard.tasks)) or int(client.zcard(shard.dead)) for shard in keys.all_shards())
