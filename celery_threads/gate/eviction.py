"""Whether the gate's Redis may evict the gate's keys, checked once per process before its first use.

A member lives only in the gate until its thread releases it.  A Redis whose ``maxmemory-policy``
is ``allkeys-*`` evicts any key when it reaches ``maxmemory``: a thread's record, queue and
members vanish without an error anywhere, and their results stay ``PENDING`` for ever.  Only
``noeviction`` keeps them: a full Redis then refuses writes, and the gate's calls fail loudly.

``volatile-*`` evicts only keys with a TTL.  The gate gives one to a single kind of key: the
``ended`` index (recently ended task ids, docs/internals.md), which makes an enqueue replayed after
a lost reply a no-op; evicted, such a replay may run a member a second time.  That is a warning,
not the loss of every waiting member.

The check reads ``INFO memory`` (``maxmemory``, ``maxmemory_policy``), which managed services
allow, else ``CONFIG GET maxmemory*``, which they often refuse; a server that answers neither (an
ACL user without ``+info``, a renamed command) is named in a warning that says how to let the
check run.  It runs where the gate's calls do: a plain URL's server, Sentinel's master now, every
master of a Cluster (each evicts on its own), and says what it found in the log, once per process
and server set: an ERROR when members can be evicted now (``allkeys-*`` with a ``maxmemory``), a
WARNING for any other policy but ``noeviction``.  Nothing refuses to start: a policy can be fixed
on a running server (``CONFIG SET``) without restarting a worker, and a fleet that stopped on it
would lose every thread's progress to keep the members that memory pressure might evict.
``celery threads stats`` shows the same findings and exits with a status of its own.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable, NamedTuple, Optional, TypeVar

import redis

from ..logs import get_logger
from .access import Server, _text, servers_of, target_of

logger = get_logger(__name__)
T = TypeVar("T")

#: Every policy that evicts nothing.
SAFE_POLICY = "noeviction"

_FIX = (
    "Set it to noeviction: `CONFIG SET maxmemory-policy noeviction` on that server and "
    "`maxmemory-policy noeviction` in its redis.conf (on a managed Redis: its parameter group "
    "or configuration), or give the gate a Redis of its own."
)

_found: dict[tuple[Any, ...], list[Eviction]] = {}
_lock = threading.Lock()


class Eviction(NamedTuple):
    """What one of the gate's servers may do to the gate's keys when its memory is full.

    ``level``: ``"error"`` when it may evict waiting members now, or is full (``noeviction`` and
    at its ``maxmemory``: it refuses every write), ``"warning"`` otherwise (a
    policy that evicts only keys with a TTL, no ``maxmemory`` yet, or a policy that could not be
    read: ``policy`` is then ``""``).  ``message`` says what is wrong and what to set."""

    server: str  # host:port (or the socket's path)
    policy: str
    maxmemory: int  # bytes; 0: no limit
    level: str
    message: str


def check_eviction(client: Any, url: str) -> list[Eviction]:
    """Log what each of the gate's servers may evict, once per process and server set, and return
    it (the same list on later calls).  Never raises: a server that does not answer is not
    checked now (the gate's calls report it), and checked again on the next call."""
    target = target_of(client, "", url)
    if target is None:
        return []
    found = _found.get(target)
    if found is not None:
        return found
    with _lock:
        found = _found.get(target)
        if found is not None:
            return found
        try:
            found = eviction_risks(client)
        except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
            logger.debug("celery-threads: the gate's maxmemory-policy was not checked: %s", exc)
            return []
        for risk in found:
            logger.log(logging.ERROR if risk.level == "error" else logging.WARNING, "%s", risk.message)
        for gap in persistence_gaps(client):
            logger.warning("%s", gap)
        _found[target] = found
        return found


def persistence_gaps(client: Any) -> list[str]:
    """A warning for each of the gate's servers that keeps no append-only file (``INFO
    persistence``: ``aof_enabled:0``).  Restarted, such a server has lost the gate's state (no
    persistence: every member, silently) or rolled it back to its last snapshot (RDB), which may
    run members again, two of a thread at once.  A server that does not answer ``INFO`` is
    skipped (the maxmemory check names it).  Raises redis-py's connection errors."""
    return [gap for gap in _each_server(client, _persistence_gap) if gap is not None]


def _persistence_gap(server: Server) -> Optional[str]:
    try:
        if int(server.client.info("persistence").get("aof_enabled", 1)):
            return None
    except redis.ResponseError:
        return None
    return (
        f"celery-threads: the gate's Redis at {_address(server)} keeps no append-only file "
        "(appendonly no): restarted, it loses the gate's members without an error (no "
        "persistence), or rolls them back to its last RDB snapshot, which runs members "
        "again (two of a thread at once). Set `appendonly yes` (docs/durability.md)."
    )


def _each_server(client: Any, read: Callable[[Server], T]) -> list[T]:
    """``read(server)`` of each of the gate's servers (a plain URL's, Sentinel's master now, every
    master of a Cluster), closing the connections made for it."""
    found = []
    for server in servers_of(client, "", probe_keys=False):
        try:
            found.append(read(server))
        finally:
            if server.own:
                server.client.connection_pool.disconnect()
    return found


def eviction_risks(client: Any) -> list[Eviction]:
    """What each of the gate's servers may evict (nothing listed for a ``noeviction`` server),
    read now.  Raises redis-py's connection errors."""
    return [risk for risk in _each_server(client, _assess) if risk is not None]


def _assess(server: Server) -> Optional[Eviction]:
    where = _address(server)
    try:
        policy, maxmemory, used = _read(server.client)
    except _Unreadable as exc:
        return Eviction(
            where,
            "",
            0,
            "warning",
            (
                f"celery-threads: could not read the maxmemory-policy of the gate's Redis at {where} "
                f"({exc}). Make sure it is noeviction: a Redis that evicts keys loses the gate's "
                "waiting members without an error. Let the gate's Redis user run INFO "
                "(`ACL SETUSER <user> +info`) for this check to run."
            ),
        )
    if policy == SAFE_POLICY:
        if maxmemory and used >= maxmemory:
            return Eviction(
                where,
                policy,
                maxmemory,
                "error",
                (
                    f"celery-threads: the gate's Redis at {where} is full: it uses {_size(used)} of "
                    f"its maxmemory {_size(maxmemory)}, and with noeviction it refuses the gate's "
                    "writes: no call can be stored, and no member can end, until memory is freed or "
                    "maxmemory raised."
                ),
            )
        return None
    limit = (
        f"with maxmemory {_size(maxmemory)}"
        if maxmemory
        else "and no maxmemory yet (it evicts once a limit is set)"
    )
    head = f"celery-threads: the gate's Redis at {where} has maxmemory-policy '{policy}' {limit}"
    if policy.startswith("volatile-"):
        return Eviction(
            where,
            policy,
            maxmemory,
            "warning",
            (
                f"{head}: when full it evicts keys that have a TTL. The gate's members have none, but "
                "its index of recently ended members does, and without it a call replayed after a "
                f"lost reply may run a member a second time. {_FIX}"
            ),
        )
    return Eviction(
        where,
        policy,
        maxmemory,
        "error" if maxmemory else "warning",
        (
            f"{head}: when full it evicts any key, and the gate's waiting members with them, without "
            f"an error (their results stay PENDING for ever). {_FIX} With noeviction a full Redis "
            "refuses writes, and the gate's calls fail with an error instead."
        ),
    )


class _Unreadable(Exception):
    """The server answered neither INFO nor CONFIG GET with its policy; the message says why."""


def _read(client: Any) -> tuple[str, int, int]:
    """``(maxmemory-policy, maxmemory, used_memory)`` (0 when only CONFIG GET answered), or
    :class:`_Unreadable`."""
    refused = []
    try:
        info = client.info("memory")
    except redis.ResponseError as exc:  # NOPERM is one, and so is an unknown (renamed) command
        refused.append(f"INFO: {exc}")
    else:
        if "maxmemory_policy" in info:
            return (
                str(info["maxmemory_policy"]),
                int(info.get("maxmemory") or 0),
                int(info.get("used_memory") or 0),
            )
        refused.append("INFO memory has no maxmemory_policy")
    try:
        config = {_text(k): _text(v) for k, v in client.config_get("maxmemory*").items()}
    except redis.ResponseError as exc:
        refused.append(f"CONFIG GET: {exc}")
    else:
        if "maxmemory-policy" in config:
            return config["maxmemory-policy"], int(config.get("maxmemory") or 0), 0
        refused.append("CONFIG GET has no maxmemory-policy")
    raise _Unreadable("; ".join(refused))


def _address(server: Server) -> str:
    kwargs = server.client.connection_pool.connection_kwargs
    if kwargs.get("path"):
        return str(kwargs["path"])
    if kwargs.get("host"):
        return f"{kwargs['host']}:{kwargs.get('port') or 6379}"
    return server.name


def _size(n: int) -> str:
    """Bytes as redis.conf writes them (``1mb`` is 1024 * 1024 bytes)."""
    for unit, size in (("gb", 1 << 30), ("mb", 1 << 20), ("kb", 1 << 10)):
        if n >= size:
            return f"{n / size:.4g}{unit}"
    return f"{n}b"
