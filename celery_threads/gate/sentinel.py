"""The gate's client on a Redis Sentinel deployment: ``threads_redis_url`` in kombu's form.

``sentinel://[[user]:password@]host:26379[;sentinel://host2:26379...]/db`` names the sentinels
(kombu's Redis transport reads the same URL for a Sentinel broker); ``threads_redis_options``
carries ``master_name`` (required), ``sentinel_kwargs`` (the options of the connections to the
sentinels, such as their password; by default the socket options of the master's) and
``min_other_sentinels``, the rest going to the master's connections as for a plain URL.  The
client is redis-py's :meth:`redis.sentinel.Sentinel.master_for`: each new connection asks the
sentinels for the master, and a connection to a server that is no longer the master breaks
(``READONLY`` or a closed socket), so the gate client's retries reconnect to the new one.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional
from urllib.parse import unquote, urlsplit

import redis
from redis.sentinel import Sentinel

from ..errors import ConfigurationError

SCHEME = "sentinel://"
DEFAULT_PORT = 26379
#: Options for the sentinels and the choice of master, not for the master's connections.
SENTINEL_KEYS = ("master_name", "sentinel_kwargs", "min_other_sentinels")


def is_sentinel_url(url: str) -> bool:
    return url[: len(SCHEME)].lower() == SCHEME


class SentinelAddress:
    """A ``sentinel://`` URL: the sentinels, and the database and credentials of the master."""

    def __init__(self, url: str) -> None:
        self.sentinels: list[tuple[str, int]] = []
        self.db = 0
        self.username: Optional[str] = None
        self.password: Optional[str] = None
        for part in filter(None, (p.strip() for p in url.split(";"))):
            if not is_sentinel_url(part):
                raise ConfigurationError(
                    f"threads_redis_url: {part!r} is not a sentinel:// address; write every "
                    "sentinel as sentinel://host:port, separated by ';'."
                )
            try:
                parsed = urlsplit(part)
                port = parsed.port or DEFAULT_PORT
            except ValueError as exc:
                raise ConfigurationError(f"threads_redis_url: {part!r}: {exc}") from None
            self.sentinels.append((parsed.hostname or "localhost", port))
            if parsed.password and self.password is None:
                self.username = unquote(parsed.username) if parsed.username else None
                self.password = unquote(parsed.password)
            path = parsed.path.strip("/")
            if path:
                if not path.isdigit():
                    raise ConfigurationError(f"threads_redis_url: {part!r}: the database must be a number.")
                self.db = int(path)
        if not self.sentinels:
            raise ConfigurationError("threads_redis_url names no sentinel.")


def master_client(url: str, kwargs: Mapping[str, Any], options: Optional[Mapping[str, Any]]) -> redis.Redis:
    """A client of the master that ``options["master_name"]`` names, found through the sentinels
    of ``url``.  ``kwargs``: the gate client's connection options (retries, timeouts) and the
    user's, for the master's connections."""
    options = dict(options or {})
    master_name = options.get("master_name")
    if not master_name:
        raise ConfigurationError(
            "threads_redis_url is a sentinel:// URL: set threads_redis_options={'master_name': "
            "...} (or broker_transport_options, when the gate is the broker's Sentinel) to the "
            "name the sentinels monitor."
        )
    address = SentinelAddress(url)
    connection = dict(kwargs)
    for key in SENTINEL_KEYS:
        connection.pop(key, None)
    connection.setdefault("db", address.db)
    if address.password is not None:
        connection.setdefault("password", address.password)
        if address.username:
            connection.setdefault("username", address.username)
    sentinel = Sentinel(
        address.sentinels,
        min_other_sentinels=int(options.get("min_other_sentinels") or 0),
        sentinel_kwargs=options.get("sentinel_kwargs"),
        **connection,
    )
    client: redis.Redis = sentinel.master_for(str(master_name), redis_class=redis.Redis)
    return client
