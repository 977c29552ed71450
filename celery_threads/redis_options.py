"""``threads_redis_options``: the gate client's redis-py options, as a Celery user writes them.

A Celery user configures the broker with ``broker_use_ssl`` (``ssl_cert_reqs``, ``ssl_ca_certs``,
``ssl_certfile``, ``ssl_keyfile``) and ``broker_transport_options`` (socket timeouts, keepalive,
``client_name``, ``master_name``/``sentinel_kwargs`` for Sentinel).  kombu's Redis transport hands
the ``ssl_*`` keys and its connection options to redis-py as keyword arguments, with TLS
(``redis.SSLConnection``) whenever ``broker_use_ssl`` is given, whatever the URL's scheme; this
module does the same for the gate.  When the gate lives on the broker's server (its URL taken from
``broker_url``, or naming the same scheme, host, port and user), the broker's options apply under
``threads_redis_options``, so a ``rediss://`` broker with a private CA gives a gate that verifies
with the same CA.  kombu-only keys (``visibility_timeout``, ``global_keyprefix``...) never reach
redis-py.

The result keeps the topology keys (``master_name``, ``sentinel_kwargs``, ``cluster``) for the code
that builds a Sentinel or Cluster client; :func:`client_kwargs` leaves them out of what a plain
``redis.Redis`` gets.
"""

from __future__ import annotations

import ssl
from collections.abc import Mapping
from typing import Any, Optional
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import redis
from celery import Celery

from .errors import ConfigurationError

#: Options that choose the kind of client rather than configure a connection.
TOPOLOGY_KEYS = ("master_name", "sentinel_kwargs", "cluster")
#: ``broker_transport_options`` that kombu's Redis transport passes on to redis-py (kombu
#: ``redis.Channel._connparams``), plus the Sentinel ones its Sentinel transport reads.  Not
#: ``max_connections``: it sizes kombu's pool, and a gate client that reached it would fail its
#: calls ("Too many connections") instead of waiting.
BROKER_CONNECTION_KEYS = (
    "socket_timeout",
    "socket_connect_timeout",
    "socket_keepalive",
    "socket_keepalive_options",
    "health_check_interval",
    "retry_on_timeout",
    "client_name",
    "master_name",
    "sentinel_kwargs",
)
#: Options that must stay bounded: every gate call times out (docs/internals.md, the lease).
TIMEOUT_KEYS = ("socket_timeout", "socket_connect_timeout")
_CERT_REQS = {"none": ssl.CERT_NONE, "optional": ssl.CERT_OPTIONAL, "required": ssl.CERT_REQUIRED}


def gate_redis_options(app: Celery, gate_url: str) -> dict[str, Any]:
    """The options of the gate's client: the broker's own (when the gate is on the broker's
    server) under ``threads_redis_options``."""
    own = app.conf.get("threads_redis_options") or {}
    if not isinstance(own, Mapping):
        raise ConfigurationError(f"threads_redis_options must be a dict of redis-py options, not {own!r}.")
    options: dict[str, Any] = {}
    if _same_server(gate_url, str(app.conf.broker_url or "")):
        options.update(broker_redis_options(app))
    options.update(own)
    if "ssl_cert_reqs" in options:
        options["ssl_cert_reqs"] = cert_reqs(options["ssl_cert_reqs"])
    for key in TIMEOUT_KEYS:
        if key in options and not _positive(options[key]):
            raise ConfigurationError(
                f"{key}={options[key]!r} in threads_redis_options (or the broker's "
                "broker_transport_options, which apply on its server): use a positive number "
                "of seconds (a gate call must never wait forever)."
            )
    if any(key.startswith("ssl_") for key in options) and _scheme(gate_url) == "redis":
        options.setdefault("connection_class", redis.SSLConnection)  # as kombu does
    return options


def broker_redis_options(app: Celery) -> dict[str, Any]:
    """What kombu's Redis transport gives redis-py from ``broker_transport_options`` and
    ``broker_use_ssl`` (unset or ``None`` values left out: kombu's defaults are not options)."""
    transport = app.conf.broker_transport_options or {}
    options = {key: transport[key] for key in BROKER_CONNECTION_KEYS if transport.get(key) is not None}
    use_ssl = app.conf.broker_use_ssl
    if isinstance(use_ssl, Mapping):  # True alone means something only to amqp transports
        options.update(use_ssl)
    return options


def client_kwargs(options: Optional[Mapping[str, Any]]) -> dict[str, Any]:
    """``options`` without the topology keys: keyword arguments for ``redis.Redis``."""
    return {key: value for key, value in (options or {}).items() if key not in TOPOLOGY_KEYS}


def checked(client: redis.Redis) -> redis.Redis:
    """``client``, once its connection class takes the options (it connects only when used, and
    an option redis-py does not know would fail there, on first use)."""
    pool = getattr(client, "connection_pool", None)
    if type(pool) is redis.ConnectionPool:  # Sentinel and Cluster pools build their own
        try:
            pool.connection_class(**pool.connection_kwargs)
        except TypeError as exc:
            raise ConfigurationError(
                f"threads_redis_options (or the broker's options, on its server): "
                f"{pool.connection_class.__name__} does not take them ({exc}); fix or remove "
                "that option."
            ) from None
    return client


def cert_reqs(value: Any) -> Any:
    """``ssl_cert_reqs`` as redis-py takes it: kombu and Celery accept ``ssl.CERT_REQUIRED`` and
    the strings ``"CERT_REQUIRED"`` or ``"required"`` (any case); redis-py only the constant or the
    lower-case word."""
    if value is None or isinstance(value, int):
        return value
    if isinstance(value, str):
        word = value.strip().lower()
        word = word[len("cert_") :] if word.startswith("cert_") else word
        if word in _CERT_REQS:
            return _CERT_REQS[word]
    raise ConfigurationError(
        f"ssl_cert_reqs={value!r}: use ssl.CERT_REQUIRED, ssl.CERT_OPTIONAL, ssl.CERT_NONE, or "
        "one of the strings 'required', 'optional', 'none'."
    )


def url_cert_reqs(url: str) -> str:
    """``url`` with its ``ssl_cert_reqs`` query value as redis-py reads it (``CERT_REQUIRED``, the
    form Celery's docs show for a broker URL, as ``required``): redis-py refused it at the first
    connection, as an outage ("could not reach").  A value no form matches is refused here."""
    if "ssl_cert_reqs=" not in url or ";" in url:
        return url
    parts = urlsplit(url)
    query = parse_qsl(parts.query, keep_blank_values=True)
    words = {value: name for name, value in _CERT_REQS.items()}
    fixed = [(k, words[cert_reqs(v)] if k == "ssl_cert_reqs" else v) for k, v in query]
    return urlunsplit(parts._replace(query=urlencode(fixed)))


def _positive(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


def _scheme(url: str) -> str:
    return url.split("://", 1)[0].lower() if "://" in url else ""


def _same_server(gate_url: str, broker_url: str) -> bool:
    """Whether the two URLs name one Redis server as written: scheme, host, port and user (the
    database may differ).  Only Redis URLs can: another broker has no Redis options to lend."""
    if gate_url == broker_url:
        return True
    schemes = ("redis", "rediss", "unix", "sentinel")
    if _scheme(gate_url) not in schemes or _scheme(broker_url) not in schemes:
        return False
    try:
        gate, broker = urlsplit(gate_url), urlsplit(broker_url)
        return (gate.scheme.lower(), (gate.hostname or "").lower(), gate.port, gate.username) == (
            broker.scheme.lower(),
            (broker.hostname or "").lower(),
            broker.port,
            broker.username,
        ) and (gate.scheme != "unix" or gate.path == broker.path)
    except ValueError:  # a port that is not a number: not the same as written
        return False
