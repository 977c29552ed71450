"""The gate's Redis rights, checked once per process before its first use.

An ACL user limited to the gate's keys must still be allowed every command the gate runs, its
scripts' inner commands included (Redis checks each one).  Without one, the gate would fail deep
inside a transition, on the first member that needs it.  :func:`check_access` runs each command
on probe keys of the gate's prefix (``lua/access.lua`` for the scripts' commands, the others
from here) and turns every ``NOPERM`` into one :class:`ConfigurationError` that names the rights
to grant.  ``ACL DRYRUN`` would need rights such a user rarely has; trying needs none.

Optional rights are not probed: ``FUNCTION LOAD``/``FCALL`` (without them the gate runs its
scripts), ``CLIENT SETINFO`` (Redis 7.2+; redis-py ignores a refusal), and the releases the
scripts push onto the broker's queues (a refused push leaves the publish to kombu).
docs/redis-tls-acl.md lists them.
"""
from __future__ import annotations

import logging
import threading
from importlib import resources
from typing import Any, Optional

import redis
from kombu.utils.url import maybe_sanitize_url
from redis.backoff import NoBackoff
from redis.retry import Retry

from ..errors import ConfigurationError
from ..keys import Keys

logger = logging.getLogger(__name__)

#: Commands the gate needs, each on its own keys and channels (``<prefix>:*``).
REQUIRED_COMMANDS = (
    "ping", "select", "time", "evalsha", "script|load", "script|exists", "subscribe",
    "unsubscribe", "publish", "del", "exists", "get", "set", "getdel", "incr", "pexpire", "persist",
    "hget", "hgetall", "hmget", "hset", "hsetnx", "hdel", "hexists", "hlen",
    "zadd", "zcard", "zcount", "zrange", "zrangebyscore", "zrem", "zremrangebyscore", "zscore",
    "zscan")
#: Commands the gate uses when it may (Redis 7+): its function library, cheaper per call.
OPTIONAL_COMMANDS = ("fcall", "function|load", "function|list")

_checked: set[tuple[Any, ...]] = set()
_lock = threading.Lock()


def acl_rules(prefix: str, user: str = "gate", password: str = "secret",
              optional: bool = True) -> str:
    """The ``ACL SETUSER`` line for a user that may do what the gate does and nothing else."""
    commands = REQUIRED_COMMANDS + (OPTIONAL_COMMANDS if optional else ())
    return (f"ACL SETUSER {user} reset on >{password} resetchannels ~{prefix}:* &{prefix}:* "
            + " ".join(f"+{name}" for name in commands))


def check_access(client: redis.Redis, keys: Keys, url: str) -> None:
    """Raise :class:`ConfigurationError` naming each right the gate's Redis user lacks.  Once per
    process and server; an unreachable server is not checked now (the gate's calls report it)."""
    pool = getattr(client, "connection_pool", None)
    if type(pool) is not redis.ConnectionPool:   # Sentinel, Cluster: not probed here
        return
    kwargs = pool.connection_kwargs
    target = (pool.connection_class, kwargs.get("host"), kwargs.get("port"), kwargs.get("path"),
              kwargs.get("db"), kwargs.get("username"), keys.prefix)
    if target in _checked:
        return
    with _lock:
        if target in _checked:
            return
        refused = _probe(pool, keys)
        if refused is None:
            return
        if refused:
            raise ConfigurationError(_message(refused, keys.prefix,
                                              str(kwargs.get("username") or "default"), url))
        _checked.add(target)


def _probe(pool: redis.ConnectionPool, keys: Keys) -> Optional[list[tuple[str, str]]]:
    """The ``(command, error)`` pairs Redis refused, or ``None`` when it could not be asked."""
    own = redis.ConnectionPool(connection_class=pool.connection_class, max_connections=2,
                               **{**pool.connection_kwargs, "retry": Retry(NoBackoff(), 0)})
    client: Any = redis.Redis(connection_pool=own)
    refused: list[tuple[str, str]] = []
    base = f"{keys.prefix}:{{access}}"
    z, h, s, channel = f"{base}:z", f"{base}:h", f"{base}:s", f"{base}:probe"

    def run(name: str, *args: Any) -> Any:
        try:
            return client.execute_command(*args)
        except redis.exceptions.NoPermissionError as exc:
            if name == "ping" and "'select'" in str(exc):
                name = "select"             # refused as the connection chose the database
            refused.append((name, str(exc)))
        except redis.ResponseError:          # NOSCRIPT and the like: allowed, then
            pass
        return None

    try:
        if run("ping", "PING") is None:
            return refused or None           # no connection: AUTH or SELECT refused
        run("evalsha", "EVALSHA", "0" * 40, 0)
        run("script|exists", "SCRIPT", "EXISTS", "0" * 40)
        sha = run("script|load", "SCRIPT", "LOAD", _PROBE)
        if sha is not None:
            inner = run("evalsha", "EVALSHA", sha, 3, z, h, s, channel) or []
            refused.extend((_text(name), _text(error))
                           for name, error in zip(inner[::2], inner[1::2]))
        run("zscan", "ZSCAN", z, 0)
        run("zcount", "ZCOUNT", z, "-inf", "+inf")
        run("hlen", "HLEN", h)
        run("set", "SET", s, 1, "PX", 1000)
        run("get", "GET", s)
        run("getdel", "GETDEL", s)
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
    finally:
        own.disconnect()
    return refused


def _message(refused: list[tuple[str, str]], prefix: str, user: str, url: str) -> str:
    grants: dict[str, str] = {}
    for name, error in refused:
        if "channel" in error:
            grants.setdefault(f"&{prefix}:*", f"channels matching '{prefix}:*' (resetchannels "
                                              f"first when the user has allchannels)")
        elif "key" in error:
            grants.setdefault(f"~{prefix}:*", f"keys matching '{prefix}:*'")
        else:
            grants.setdefault(f"+{name}", f"command '{name}'")
    return (f"celery-threads: the Redis user '{user}' at {maybe_sanitize_url(url)} may not do what "
            f"the gate needs: {'; '.join(grants.values())}.  Grant it, for example "
            f"`ACL SETUSER {user} {' '.join(grants)}`; docs/redis-tls-acl.md lists every rule "
            f"the gate needs.")


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


_PROBE = resources.files(__package__).joinpath("lua/access.lua").read_text(encoding="utf-8")
