"""The ``threads_*`` settings, read once from ``app.conf`` and cached on the app."""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass, field
from typing import Any, Optional
from urllib.parse import parse_qs, urlparse

from celery import Celery
from celery.utils.serialization import strtobool
from kombu.utils.url import maybe_sanitize_url

from .errors import ConfigurationError
from .logs import get_logger
from .redis_options import gate_redis_options

logger = get_logger(__name__)

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
    def shown_url(self) -> str:
        """The gate's URL as messages and logs show it: its password masked."""
        return sanitized_url(self.redis_url)

    @property
    def keepalive_ms(self) -> int:
        return int(self.keepalive * 1000)

    @property
    def release_timeout_ms(self) -> int:
        return int(self.release_timeout * 1000)


def _setting(app: Celery, name: str) -> Any:
    value = app.conf.get(name)
    return DEFAULTS[name] if value is None else value


# Every number and flag is read by one of the three helpers below, so that a value given as a
# string (``app.conf.update(os.environ)``, ``config_from_envvar``) reads as it would from Python,
# and a value that is not one raises a ConfigurationError naming the setting.

#: what a duration that becomes milliseconds (a lease, a timeout...) takes
_SECONDS = "a number of seconds, 0.001 (1 ms) or more"


def _flag(app: Celery, name: str) -> bool:
    """A boolean setting: ``True``/``False``, ``1``/``0``, or a string Celery itself reads as a
    boolean (``celery.utils.serialization.strtobool``: true/false, yes/no, on/off, 1/0, any case)."""
    value = _setting(app, name)
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str):
        try:
            return bool(strtobool(value.strip()))
        except TypeError:
            pass
    raise ConfigurationError(
        f"{name}={value!r} is not a boolean: write True or False (or, as a string, "
        "true/false, yes/no, on/off or 1/0)."
    )


def _finite(name: str, value: Any, expected: str, why: str = "") -> float:
    """``value`` (a number, or a string holding one) as a finite float, else a
    :class:`ConfigurationError` that names ``name``, ``value`` and what is ``expected``."""
    if not isinstance(value, bool):  # True is no number of seconds or count
        try:
            number = float(value)
        except (TypeError, ValueError, OverflowError):
            pass
        else:
            if math.isfinite(number):
                return number
    raise _not(name, value, expected, why)


def _not(name: str, value: Any, expected: str, why: str = "") -> ConfigurationError:
    return ConfigurationError(f"{name}={value!r} is not {expected}{': ' + why if why else ''}.")


def _seconds(
    app: Celery, name: str, *, minimum: float = 0.001, expected: str = _SECONDS, optional: bool = False
) -> Any:
    """A duration setting, in seconds, at least ``minimum`` (``None`` too when ``optional``)."""
    value = app.conf.get(name) if optional else _setting(app, name)
    if value is None:
        return None
    seconds = _finite(name, value, expected)
    if seconds < minimum:
        raise _not(name, value, expected)
    return seconds


def _count(
    app: Celery, name: str, *, minimum: int, expected: str, why: str = "", optional: bool = False
) -> Any:
    """A whole-number setting, at least ``minimum`` (``None`` too when ``optional``); ``2.0`` and
    ``"2"`` are read as 2, ``2.5`` is not a count."""
    value = app.conf.get(name) if optional else _setting(app, name)
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        count = value
    else:
        number = _finite(name, value, expected, why)
        if not number.is_integer():
            raise _not(name, value, expected, why)
        count = int(number)
    if count < minimum:
        raise _not(name, value, expected, why)
    return count


def dispatch_interval(app: Celery) -> float:
    """``threads_dispatch_interval``, as :func:`read_config` reads it (beat's entry needs it before
    the rest of the configuration)."""
    return float(_seconds(app, "threads_dispatch_interval"))


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
            # redis-py reads a database that is not a number as 0: another app's gate, maybe.
            db = parsed.path.strip("/") if parsed.scheme != "unix" else ""
            db = ",".join(parse_qs(parsed.query).get("db", [])) or db
            if db and not db.isdigit():
                raise ValueError(f"the database must be a number, as in /0, not {db!r}")
    except ValueError as exc:
        # A password with '/', '#' or '?' in it is misread (its '@' is not in the URL's network
        # location): the parser's own words would quote part of it.
        misread = any(
            "@" in part.partition("://")[2] and "@" not in urlparse(part.strip()).netloc
            for part in url.split(";")
        )
        why = (
            "a password holding '/', '#', '?' or '@' must be percent-encoded, e.g. '/' as %2F"
            if misread
            else exc
        )
        raise ConfigurationError(
            f"{setting}={sanitized_url(url)!r} is not a Redis URL the gate can use ({why}): "
            "write redis://[user:password@]host:6379/0, rediss://... for TLS, "
            "unix:///path/to/redis.sock or sentinel://host:26379[;sentinel://host2:26379]/0"
        ) from None
    return url


def sanitized_url(url: str) -> str:
    """``url`` with its password masked, whatever its shape: everything between the user's name
    and the last ``@`` of each URL (a password written with an unencoded ``/``, ``#`` or ``?``
    is not where a URL parser looks for it)."""
    return ";".join(_masked(part) for part in url.split(";"))


def _masked(url: str) -> str:
    scheme, sep, rest = url.partition("://")
    if not sep or "@" not in rest:
        try:
            return str(maybe_sanitize_url(url))
        except ValueError:
            return url
    userinfo, _, host = rest.rpartition("@")
    user, colon, _ = userinfo.partition(":")
    return f"{scheme}://{user}{':**' if colon else ''}@{host}"


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
        f"broker is Redis, and the broker here is {sanitized_url(str(broker))!r}."
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
        keepalive=_seconds(app, "threads_keepalive"),
        dispatch_interval=dispatch_interval(app),
        dead_letter_queue=app.conf.get("threads_dead_letter_queue"),
        release_timeout=_seconds(app, "threads_release_timeout"),
        dispatch_batch=_count(app, "threads_dispatch_batch", minimum=1, expected="a whole number, 1 or more"),
        worker_dispatch=_flag(app, "threads_worker_dispatch"),
        shards=_count(
            app,
            "threads_shards",
            minimum=1,
            expected="a whole number, 1 or more",
            why="the gate needs at least 1 shard (one per hash tag; on a Redis Cluster, a few per "
            "master spread the threads over them)",
        ),
        direct_release=_flag(app, "threads_direct_release"),
        track_releases=_flag(app, "threads_track_releases"),
        local_handoff=_seconds(
            app,
            "threads_local_handoff",
            minimum=0,
            expected="a number of seconds, 0 or more (0 turns the in-process handoff off)",
        ),
        redis_options=gate_redis_options(app, redis_url),
        wait_replicas=_count(
            app, "threads_wait_replicas", minimum=0, expected="0 (no WAIT) or a whole number of replicas"
        ),
        publish_timeout=_seconds(app, "threads_publish_timeout"),
        dead_letter_max=_count(
            app,
            "threads_dead_letter_max",
            minimum=0,
            expected="None (no bound) or a whole number of letters, 0 or more",
            optional=True,
        ),
        dead_letter_ttl=_seconds(
            app, "threads_dead_letter_ttl", expected=f"None (kept) or {_SECONDS}", optional=True
        ),
    )
    _warn_unknown(app)
    setattr(app, _ATTR, config)
    return config


def _warn_unknown(app: Celery) -> None:
    """Warn of each ``threads_*`` setting in ``app.conf`` that is none of this package's (a typo
    would be ignored without a word, the setting's default used), naming the likely one; and of
    a ``thread_*`` one that is a setting's name but for its ``s`` (``thread_redis_url``)."""
    for key in list(app.conf.keys()):
        name = str(key).lower()
        name = name[len("celery_") :] if name.startswith(("celery_threads_", "celery_thread_")) else name
        namespace = str(key)[: len(str(key)) - len(name)]  # "CELERY_" in Django's settings
        if name.startswith("thread_") and "threads_" + name[len("thread_") :] in DEFAULTS:
            name = "threads_" + name[len("thread_") :]
            close = [name]
        elif not name.startswith("threads_") or name in DEFAULTS:
            continue
        else:
            close = difflib.get_close_matches(name, DEFAULTS, n=1, cutoff=0.75)
        if close and str(key).isupper():  # CELERY_THREADS_*, as Django settings name them
            close = [namespace + close[0].upper()]
        logger.warning(
            "celery-threads: app.conf has %s, which is no celery-threads setting; it is ignored%s "
            "(the settings: docs/settings.md)",
            key,
            f": did you mean {close[0]}?" if close else "",
        )


def forget_config(app: Celery) -> None:
    """Drop the cached settings, so that changed ``app.conf`` values are read again."""
    if hasattr(app, _ATTR):
        delattr(app, _ATTR)
