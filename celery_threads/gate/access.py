"""The gate's Redis rights, checked once per process before its first use.

An ACL user limited to the gate's keys must still be allowed every command the gate runs, its
scripts' inner commands included (Redis checks each one).  Without one, the gate would fail deep
inside a transition, on the first member that needs it.  :func:`check_access` runs each command
on probe keys of the gate's prefix (``lua/access.lua`` for the scripts' commands, the others
from here) and turns every ``NOPERM`` into one :class:`ConfigurationError` that names the rights
to grant.  ``ACL DRYRUN`` would need rights such a user rarely has; trying needs none.

ACLs are per server (not replicated, not shared by a cluster's nodes), so the probe runs where the
gate's calls do: on a plain URL's server; on Sentinel, on the master the sentinels name now; on a
Cluster, on every master, each with probe keys of a slot it serves (``<prefix>:{access-<n>}:*``)
so that the scripts' commands run there too.  The error names the server that refused when the
URL does not (Sentinel's master, a cluster's node).

Optional rights are not probed: ``FUNCTION LOAD``/``FCALL`` (without them the gate runs its
scripts), ``CLIENT SETINFO`` (Redis 7.2+; redis-py ignores a refusal), and the releases the
scripts push onto the broker's queues (a refused push leaves the publish to kombu).
docs/redis-tls-acl.md lists them.
"""

from __future__ import annotations

import re
import threading
from importlib import resources
from typing import Any, NamedTuple, Optional

import redis
from kombu.utils.url import maybe_sanitize_url
from redis.backoff import NoBackoff
from redis.exceptions import SlotNotCoveredError
from redis.retry import Retry
from redis.sentinel import SentinelConnectionPool

from ..errors import MissingRights, ReadOnlyGate
from ..keys import Keys
from ..logs import get_logger
from .cluster import is_cluster
from .deadline import bounded_class

logger = get_logger(__name__)

#: Commands the gate needs, each on its own keys and channels (``<prefix>:*``).
REQUIRED_COMMANDS = (
    "ping",
    "select",
    "time",
    "evalsha",
    "script|load",
    "script|exists",
    "subscribe",
    "unsubscribe",
    "publish",
    "del",
    "exists",
    "get",
    "set",
    "getdel",
    "incr",
    "incrby",
    "pexpire",
    "persist",
    "pttl",
    "hget",
    "hgetall",
    "hmget",
    "hset",
    "hsetnx",
    "hincrby",
    "hdel",
    "hexists",
    "hlen",
    "zadd",
    "zcard",
    "zcount",
    "zrange",
    "zrangebyscore",
    "zrem",
    "zremrangebyrank",
    "zremrangebyscore",
    "zscore",
    "zscan",
    "multi",
    "exec",
)
#: Commands of the checks each process runs before its first use of the gate: ``INFO`` reads the
#: ``maxmemory-policy`` (:mod:`celery_threads.gate.eviction`); without it the check warns.
CHECK_COMMANDS = ("info",)
#: Commands the gate uses when it may (Redis 7+): its function library, cheaper per call.
OPTIONAL_COMMANDS = ("fcall", "function|load", "function|list")

#: Hash tags tried for a slot of each cluster master (a master with a slot is found in far fewer).
_TAG_TRIES = 1 << 17

_checked: set[tuple[Any, ...]] = set()
_lock = threading.Lock()


def acl_rules(prefix: str, user: str = "gate", password: str = "secret", optional: bool = True) -> str:
    """The ``ACL SETUSER`` line for a user that may do what the gate does and nothing else."""
    commands = REQUIRED_COMMANDS + CHECK_COMMANDS + (OPTIONAL_COMMANDS if optional else ())
    return f"ACL SETUSER {user} reset on >{password} resetchannels ~{prefix}:* &{prefix}:* " + " ".join(
        f"+{name}" for name in commands
    )


def check_access(client: Any, keys: Keys, url: str) -> bool:
    """Raise :class:`ConfigurationError` naming each right the gate's Redis user lacks, and on
    which server.  Once per process and gate; a server that does not answer is not checked now
    (the gate's calls report it).  Returns whether every server answered (or had before), so
    that a caller spends no more time on a gate that did not."""
    target = target_of(client, keys.prefix, url)
    if target is None or target in _checked:
        return True
    with _lock:
        if target in _checked:
            return True
        try:
            servers = servers_of(client, keys.prefix)
        except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
            logger.debug("celery-threads: the gate's rights were not checked: %s", exc)
            return False
        refused: dict[str, list[tuple[str, str]]] = {}
        unchecked = False
        for server in servers:
            try:
                found = _probe(server.client, f"{keys.prefix}:{{{server.tag}}}")
            finally:
                if server.own:
                    server.client.connection_pool.disconnect()
            state = _refused_for_state(found or [])
            if state == "READONLY":
                where = f" ({server.name})" if server.name else ""
                raise ReadOnlyGate(
                    f"celery-threads: the gate's Redis at {maybe_sanitize_url(url)}{where} is a "
                    "read-only replica: it refuses the gate's writes (READONLY). Point "
                    "threads_redis_url at its master, or use a sentinel:// URL "
                    "(docs/durability.md)."
                )
            if state == "OOM":
                # Not a right: the gate's writes fail until memory is freed; checked again then.
                logger.error(
                    "celery-threads: the gate's Redis at %s is out of memory (maxmemory): it "
                    "refuses the gate's writes, so no call can be stored until memory is freed "
                    "or maxmemory raised",
                    maybe_sanitize_url(url),
                )
                unchecked = True
            elif found is None:
                unchecked = True
            elif found:
                refused[server.name] = found
        if refused:
            user = str(target[-2] or "default")
            raise MissingRights(_message(refused, keys.prefix, user, url))
        if not unchecked:
            _checked.add(target)
        return not unchecked


def target_of(client: Any, prefix: str, url: str) -> Optional[tuple[Any, ...]]:
    """What the once-per-process check is keyed by, ending with the user and the prefix; ``None``
    for a client of no kind known here."""
    if is_cluster(client):  # the URL names a node, from which the others are found
        return ("cluster", url, client.nodes_manager.connection_kwargs.get("username"), prefix)
    pool = getattr(client, "connection_pool", None)
    if isinstance(pool, SentinelConnectionPool):  # the sentinels and the master's database
        return ("sentinel", url, pool.service_name, pool.connection_kwargs.get("username"), prefix)
    if type(pool) is redis.ConnectionPool:
        kwargs = pool.connection_kwargs
        return (
            pool.connection_class,
            kwargs.get("host"),
            kwargs.get("port"),
            kwargs.get("path"),
            kwargs.get("db"),
            kwargs.get("username"),
            prefix,
        )
    return None


class Server(NamedTuple):
    name: str  # how the error names it ("" for the one server of a plain URL)
    client: Any  # a client of it alone
    tag: str  # the hash tag of its probe keys: a slot it serves
    own: bool  # a client made for the probe, closed after it


def servers_of(client: Any, prefix: str, probe_keys: bool = True) -> list[Server]:
    """The servers the gate's calls run on: a plain URL's server; Sentinel's master now (ACLs are
    not replicated); every master of a cluster (ACLs are per node), each with probe keys of a
    slot it serves, so that the scripts' commands run there (without ``probe_keys``, every master,
    with no tag: for a check that reads the server, not its keys)."""
    if is_cluster(client):
        if not probe_keys:
            return [
                Server(node.name, client.get_redis_connection(node), "", False)
                for node in client.get_primaries()
            ]
        return [
            Server(node.name, client.get_redis_connection(node), tag, False)
            for node, tag in _cluster_tags(client, prefix)
        ]
    pool = client.connection_pool
    connection_class, kwargs, name = pool.connection_class, pool.connection_kwargs, ""
    if isinstance(pool, SentinelConnectionPool):
        host, port = client.connection_pool.get_master_address()  # asks the sentinels
        connection_class = bounded_class(
            redis.SSLConnection if issubclass(connection_class, redis.SSLConnection) else redis.Connection
        )
        kwargs = {**{k: v for k, v in kwargs.items() if k != "connection_pool"}, "host": host, "port": port}
        name = f"the master {host}:{port}"
    own = redis.ConnectionPool(
        connection_class=connection_class, max_connections=2, **{**kwargs, "retry": Retry(NoBackoff(), 0)}
    )
    return [Server(name, redis.Redis(connection_pool=own), "access", True)]


def _cluster_tags(client: Any, prefix: str) -> list[tuple[Any, str]]:
    """Each master of the cluster with a hash tag (``access-<n>``) of a slot it serves."""
    masters = {node.name for node in client.get_primaries()}
    found: dict[str, tuple[Any, str]] = {}
    for n in range(_TAG_TRIES):  # a master serving no slot is never found, and not probed
        tag = f"access-{n}"
        try:
            node = client.get_node_from_key(f"{prefix}:{{{tag}}}")
        except SlotNotCoveredError:
            continue
        if node.name in masters:
            found.setdefault(node.name, (node, tag))
            if len(found) == len(masters):
                break
    return list(found.values())


def _probe(client: Any, base: str) -> Optional[list[tuple[str, str]]]:
    """The ``(command, error)`` pairs the server refused, or ``None`` when it could not be asked.
    ``base``: the probe keys' prefix, ``<prefix>:{<tag>}``."""
    refused: list[tuple[str, str]] = []
    z, h, s, channel = f"{base}:z", f"{base}:h", f"{base}:s", f"{base}:probe"

    def run(name: str, *args: Any) -> Any:
        try:
            return client.execute_command(*args)
        except redis.exceptions.NoPermissionError as exc:
            if name == "ping" and "'select'" in str(exc):
                name = "select"  # refused as the connection chose the database
            refused.append((name, str(exc)))
        except redis.ResponseError:  # NOSCRIPT and the like: allowed, then
            pass
        return None

    try:
        if run("ping", "PING") is None:
            return refused or None  # no connection: AUTH or SELECT refused
        run("evalsha", "EVALSHA", "0" * 40, 0)
        run("script|exists", "SCRIPT", "EXISTS", "0" * 40)
        sha = run("script|load", "SCRIPT", "LOAD", _PROBE)
        if sha is not None:
            inner = run("evalsha", "EVALSHA", sha, 3, z, h, s, channel) or []
            refused.extend((_text(name), _text(error)) for name, error in zip(inner[::2], inner[1::2]))
        run("zscan", "ZSCAN", z, 0)
        run("zcount", "ZCOUNT", z, "-inf", "+inf")
        run("hlen", "HLEN", h)
        run("set", "SET", s, 1, "PX", 1000)
        run("get", "GET", s)
        run("getdel", "GETDEL", s)
        try:  # stats and metrics read a shard's indexes in one transaction (GateReads.index_counts)
            pipe = client.pipeline(transaction=True)
            pipe.exists(s)
            pipe.execute()
        except redis.exceptions.NoPermissionError as exc:
            named = re.search(r"'([a-z|]+)' command", str(exc))
            refused.append((named.group(1) if named else "multi", str(exc)))
        except redis.ResponseError as exc:
            # A refused MULTI leaves EXEC alone ("EXEC without MULTI"); a refused EXEC
            # discards the transaction (NOPERM).
            text = str(exc)
            if "EXEC without MULTI" in text:
                refused.append(("multi", text))
            elif "NOPERM" in text or "no permissions" in text:
                named = re.search(r"'([a-z|]+)' command", text)
                refused.append((named.group(1) if named else "exec", text))
        pubsub = client.pubsub()
        try:
            pubsub.subscribe(channel)
            pubsub.get_message(timeout=1.0)  # the confirmation, or the refusal raised
        except redis.exceptions.NoPermissionError as exc:
            refused.append(("subscribe", str(exc)))
        finally:
            pubsub.close()
    except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
        logger.debug("celery-threads: the gate's rights were not checked: %s", exc)
        return None
    return refused


def _refused_for_state(refused: list[tuple[str, str]]) -> Optional[str]:
    """``"READONLY"`` or ``"OOM"`` when the server refused a probe for its state, not for the
    user's rights: a replica refuses every write, a server over its maxmemory too."""
    for _, error in refused:
        for state in ("READONLY", "OOM"):
            if error.startswith(state) or f"-{state} " in error or f": {state} " in error:
                return state
    return None


def _message(refused: dict[str, list[tuple[str, str]]], prefix: str, user: str, url: str) -> str:
    """One server (``""``): what it refused and the grant; several: the same for each, named."""
    needs, grants = [], []
    for server, pairs in refused.items():
        rights = _rights(pairs, prefix)
        needs.append(f"on {server}: {', '.join(rights.values())}" if server else "; ".join(rights.values()))
        grants.append(f"`ACL SETUSER {user} {' '.join(rights)}`" + (f" on {server}" if server else ""))
    return (
        f"celery-threads: the Redis user '{user}' at {maybe_sanitize_url(url)} may not do what "
        f"the gate needs: {'; '.join(needs)}.  Grant it, for example {', '.join(grants)}; "
        f"docs/redis-tls-acl.md lists every rule the gate needs."
    )


def _rights(refused: list[tuple[str, str]], prefix: str) -> dict[str, str]:
    """The ACL rules to grant for the refusals, each with how the error says it."""
    rights: dict[str, str] = {}
    for name, error in refused:
        if "channel" in error:
            rights.setdefault(
                f"&{prefix}:*",
                f"channels matching '{prefix}:*' (resetchannels first when the user has allchannels)",
            )
        elif "key" in error:
            rights.setdefault(f"~{prefix}:*", f"keys matching '{prefix}:*'")
        else:
            rights.setdefault(f"+{name}", f"command '{name}'")
    return rights


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


_PROBE = resources.files(__package__).joinpath("lua/access.lua").read_text(encoding="utf-8")
