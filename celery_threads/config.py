"""The ``threads_*`` settings, read once from ``app.conf`` and cached on the app."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Optional
from urllib.parse import urlparse

from celery import Celery
from kombu.utils.url import maybe_sanitize_url

from .errors import ConfigurationError
from .redis_options import gate_redis_options

_ATTR = "_celery_threads_config"

DEFAULTS: dict[str, Any] = {
    "threads_redis_url": None,
    "threads_key_prefix": "celery_threads",
    "threads_keepalive": 30.0,
    "threads_dispatch_interval": 1.0,
    "threads_dead_letter_queue": None,
    "threads_release_timeout": 60.0,
    "threads_dispatch_batch": 500,
    "threads_worker_dispatch": True,
    "threads_shards": 1,
    "threads_direct_release": True,
    "threads_track_releases": False,
    "threads_local_handoff": 1.0,
    "threads_redis_options": None,
    "threads_wait_replicas": 0,
    "threads_publish_timeout": 5.0,
    "threads_dead_letter_max": None,
    "threads_dead_letter_ttl": None,
}


@dataclass(frozen=True)
class ThreadsConfig:
    redis_url: str
    key_prefix: str
    keepalive: float
    dispatch_interval: float
    dead_letter_queue: Optional[str]
    release_timeout: float
    dispatch_batch: int
    worker_dispatch: bool
    shards: int
    direct_release: bool = True
    track_releases: bool = False
    local_handoff: float = 1.0
    #: the gate client's redis-py options (:mod:`celery_threads.redis_options`)
    redis_options: dict[str, Any] = field(default_factory=dict, hash=False)
    wait_replicas: int = 0  # Redis WAIT after each transition (docs/durability.md)
    #: the most a producer's ``apply_async`` (and each step of an admin call: ``Threads``, the
    #: CLI) waits for the gate, all its connection attempts, retries and handshakes included,
    #: before it raises ``GateUnavailable``; a worker's own gate calls ride out longer outages
    #: (gate/deadline.py)
    publish_timeout: float = 5.0
    #: dead-letter retention: past this many letters the oldest are dropped (None: no bound),
    #: ``ceil(max / shards)`` per shard
    dead_letter_max: Optional[int] = None
    #: dead-letter retention: letters older than this many seconds are dropped (None: kept)
    dead_letter_ttl: Optional[float] = None

    @property
    def keepalive_ms(self) -> int:
        return int(self.keepalive * 1000)

    @property
    def release_timeout_ms(self) -> int:
        return int(self.release_timeout * 1000)


def _setting(app: Celery, name: str) -> Any:
    value = app.conf.get(name)
    return DEFAULTS[name] if value is None else value


def _optional(app: Celery, name: str, kind: Any) -> Any:
    value = app.conf.get(name)
    return None if value is None else kind(value)


_SCHEMES = ("redis", "rediss", "unix", "sentinel")


def _checked_url(url: str, setting: str) -> str:
    """``url`` when it is a URL the gate's client takes, else a :class:`ConfigurationError` that
    names ``setting`` (redis-py's own error would name neither the setting nor the forms)."""
    try:
        for part in url.split(";"):
            parsed = urlparse(part.strip())
            if parsed.scheme not in _SCHEMES:
                raise ValueError(f"the scheme must be one of {', '.join(_SCHEMES)}")
            parsed.port  # noqa: B018 (raises ValueError for a port out of range or not a number)
    except ValueError as exc:
        raise ConfigurationError(
            f"{setting}={sanitized_url(url)!r} is not a Redis URL the gate can use ({exc}): "
            "write redis://[user:password@]host:6379/0, rediss://... for TLS, "
            "unix:///path/to/redis.sock or sentinel://host:26379[;sentinel://host2:26379]/0"
        ) from None
    return url


def sanitized_url(url: str) -> str:
    """``url`` with its password masked, whatever its shape."""
    try:
        return str(maybe_sanitize_url(url))
    except ValueError:
        return re.sub(r"(://[^:/@;]*:)[^@/;]*@", r"\1**@", url)


def _redis_url(app: Celery) -> str:
    url = app.conf.get("threads_redis_url")
    if url:
        return _checked_url(str(url), "threads_redis_url")
    broker = app.conf.broker_url or ""
    if isinstance(broker, str) and broker.startswith(("redis://", "rediss://", "unix://", "sentinel://")):
        return _checked_url(broker, "broker_url (the gate's Redis unless threads_redis_url is set)")
    raise ConfigurationError(
        "celery-threads needs a Redis server for its gate: set app.conf.threads_redis_url "
        "(for example 'redis://localhost:6379/0'); it defaults to broker_url only when the "
        f"broker is Redis, and the broker here is {broker!r}."
    )


def read_config(app: Celery) -> ThreadsConfig:
    """Return the app's :class:`ThreadsConfig`, reading ``app.conf`` the first time only."""
    cached: Optional[ThreadsConfig] = getattr(app, _ATTR, None)
    if cached is not None:
        return cached
    prefix = str(_setting(app, "threads_key_prefix"))
    if not prefix or "{" in prefix or "}" in prefix:
        raise ConfigurationError(
            f"threads_key_prefix={prefix!r}: use a non-empty name without braces; the braces of "
            "each key are the gate's Redis Cluster hash tag."
        )
    redis_url = _redis_url(app)
    config = ThreadsConfig(
        redis_url=redis_url,
        key_prefix=prefix,
        keepalive=float(_setting(app, "threads_keepalive")),
        dispatch_interval=float(_setting(app, "threads_dispatch_interval")),
        dead_letter_queue=app.conf.get("threads_dead_letter_queue"),
        release_timeout=float(_setting(app, "threads_release_timeout")),
        dispatch_batch=int(_setting(app, "threads_dispatch_batch")),
        worker_dispatch=bool(_setting(app, "threads_worker_dispatch")),
        shards=int(_setting(app, "threads_shards")),
        direct_release=bool(_setting(app, "threads_direct_release")),
        track_releases=bool(_setting(app, "threads_track_releases")),
        local_handoff=float(_setting(app, "threads_local_handoff")),
        redis_options=gate_redis_options(app, redis_url),
        wait_replicas=int(_setting(app, "threads_wait_replicas")),
        publish_timeout=float(_setting(app, "threads_publish_timeout")),
        dead_letter_max=_optional(app, "threads_dead_letter_max", int),
        dead_letter_ttl=_optional(app, "threads_dead_letter_ttl", float),
    )
    if (
        config.keepalive <= 0
        or config.dispatch_interval <= 0
        or config.release_timeout <= 0
        or config.publish_timeout <= 0
    ):
        raise ConfigurationError(
            "threads_keepalive, threads_dispatch_interval, threads_release_timeout and "
            "threads_publish_timeout must be positive numbers of seconds."
        )
    if (config.dead_letter_max is not None and config.dead_letter_max < 0) or (
        config.dead_letter_ttl is not None and config.dead_letter_ttl <= 0
    ):
        raise ConfigurationError(
            "threads_dead_letter_max must be None (no bound) or a number of letters, 0 or more; "
            "threads_dead_letter_ttl None (kept) or a positive number of seconds."
        )
    if config.wait_replicas < 0:
        raise ConfigurationError("threads_wait_replicas must be 0 (no WAIT) or a number of replicas.")
    if config.local_handoff < 0:
        raise ConfigurationError(
            "threads_local_handoff must be a number of seconds, 0 or more (0 turns the "
            "in-process handoff off)."
        )
    if config.shards < 1:
        raise ConfigurationError(
            f"threads_shards={config.shards}: the gate needs at least 1 shard (one per hash tag; "
            "on a Redis Cluster, a few per master spread the threads over them)."
        )
    setattr(app, _ATTR, config)
    return config


def forget_config(app: Celery) -> None:
    """Drop the cached settings, so that changed ``app.conf`` values are read again."""
    if hasattr(app, _ATTR):
        delattr(app, _ATTR)
