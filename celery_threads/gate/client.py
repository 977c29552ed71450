"""The gate's Redis client: timeouts, bounded retries, and the client for each topology (a single
Redis, Sentinel, a Redis Cluster) with the options of ``threads_redis_options``.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Optional

import redis
from redis.backoff import AbstractBackoff, ExponentialBackoff
from redis.retry import Retry

from ..config import sanitized_url
from ..errors import DeadlinePassed, TransportMismatch
from ..logs import get_logger
from ..redis_options import checked, client_kwargs, url_cert_reqs
from ..seams import health_check_interval
from . import cluster, deadline
from .sentinel import is_sentinel_url, master_client

logger = get_logger(__name__)

#: How long a gate call waits for Redis to accept a connection, or to answer, before it counts as
#: failed (and is retried): no call waits forever on a link that went silent.
SOCKET_TIMEOUT = 5.0
#: redis-py options of TCP connections only: a ``unix://`` gate's connections do not take them.
TCP_ONLY_KEYS = ("socket_keepalive", "socket_keepalive_options")
#: A call's retries give up this long after its first failure: the last replay of a call is sent
#: at most this plus ``SOCKET_TIMEOUT`` after the call, within the gate's ENDED_WINDOW (30 s,
#: lua/_common.lua) of remembering what ended.
RETRY_BUDGET = 15.0


def wait_timeout_ms(keepalive_ms: int) -> int:
    """How long a transition's ``WAIT`` (``threads_wait_replicas``) waits for the replicas: a
    tenth of the keepalive, within 0.1 to 1 s.  A replica on a working link confirms in about a
    millisecond, so the bound only matters when one lags or is gone; then every call waits it out,
    and it must stay well inside the lease that a claim's caller starts counting before it sends
    the claim (celery_threads.lease), and below ``SOCKET_TIMEOUT``."""
    return int(min(1000, max(100, keepalive_ms // 10)))


class BoundedRetry(Retry):
    """redis-py's :class:`~redis.retry.Retry`, which also gives up ``budget`` seconds after a
    call's first failure (attempts on a silent link each wait ``SOCKET_TIMEOUT``), and when the
    caller's deadline passes (:mod:`.deadline`; its pauses end with it too), and at once when the
    server refused the credentials.  The error raised is the last attempt's own, not that the time
    ran out."""

    def __init__(self, backoff: Any, retries: int, budget: float, where: str = "") -> None:
        super().__init__(_DeadlineBackoff(backoff), retries)
        self.budget = budget
        #: the server's URL, for the log line of an outage ridden out (its password masked there)
        self.where = where

    def call_with_retry(  # its signature varies across redis-py 5-8: the rest passes through
        self, do: Callable[[], Any], fail: Callable[..., Any], *args: Any, **kwargs: Any
    ) -> Any:
        started: list[float] = []
        attempted: list[BaseException] = []

        def fail_within_budget(error: Any, *count: Any) -> Any:
            if not started:
                started.append(time.monotonic())
            result = fail(error, *count)
            if isinstance(error, DeadlinePassed):
                raise attempted[-1] if attempted else error
            if isinstance(error, (redis.AuthenticationError, TransportMismatch)):
                raise error  # wrong credentials, or TLS on one side only: no retry makes them right
            attempted[:] = [error]
            if time.monotonic() - started[0] > self.budget:
                raise error
            return result

        result = super().call_with_retry(do, fail_within_budget, *args, **kwargs)
        if started:
            _rode_out(self.where, time.monotonic() - started[0], attempted)
        return result


#: An outage a call rode out is logged when it lasted this long (a connection the server closed
#: while idle fails once and is replaced at once: no outage), and at most once per
#: ``OUTAGE_LOG_EVERY`` seconds per process (each of a worker's processes rides out the same one).
OUTAGE_LOGGED_FROM = 1.0
OUTAGE_LOG_EVERY = 30.0
_last_logged = [-OUTAGE_LOG_EVERY]


def _rode_out(where: str, lasted: float, errors: list[BaseException]) -> None:
    """A call went through after its retries rode out ``lasted`` seconds of failures: say so, as
    Celery says when its broker connection came back.  Longer outages, whose calls gave up, are
    said by their callers (the dispatch loop, the renewer, the producer's error)."""
    now = time.monotonic()
    if lasted < OUTAGE_LOGGED_FROM or now - _last_logged[0] < OUTAGE_LOG_EVERY:
        return
    _last_logged[0] = now
    error = f"{type(errors[-1]).__name__}: {errors[-1]}" if errors else "no answer"
    logger.warning(
        "celery-threads: the gate's Redis at %s (threads_redis_url) did not answer for %.1fs "
        "(%s); it answers again, and the call went through on a retry",
        sanitized_url(where) or "?",
        lasted,
        error,
    )


class _DeadlineBackoff(AbstractBackoff):
    """A backoff whose pauses end with the caller's deadline (:func:`.deadline.backoff`)."""

    def __init__(self, backoff: Any) -> None:
        self.backoff = backoff

    def reset(self) -> None:
        self.backoff.reset()

    def compute(self, failures: int) -> float:
        return deadline.backoff(self.backoff.compute(failures))


def make_client(url: str, options: Optional[dict[str, Any]] = None) -> redis.Redis:
    """A client that rides out short Redis outages: each command is retried with backoff for at
    most ``RETRY_BUDGET`` seconds, and a connection that gives no answer for ``SOCKET_TIMEOUT``
    seconds counts as broken.  ``options``: ``ThreadsConfig.redis_options`` (TLS, timeouts...),
    over these; a URL's query (``?ssl_ca_certs=...``) wins over both, as in redis-py.
    ``cluster: True`` makes it a Redis Cluster client (:mod:`celery_threads.gate.cluster`).

    A script call replayed after its reply was lost gives the reply of the call that ran: each
    transition recognizes its own replay (lua/_common.lua ``replayed``; claim by its claimant).
    """
    kwargs: dict[str, Any] = {
        "retry": BoundedRetry(ExponentialBackoff(cap=1.0, base=0.05), 20, RETRY_BUDGET, url),
        "retry_on_error": [redis.ConnectionError, redis.TimeoutError],
        "health_check_interval": health_check_interval(30),
        "socket_keepalive": True,
        "socket_timeout": SOCKET_TIMEOUT,
        "socket_connect_timeout": SOCKET_TIMEOUT,
    }
    cluster_mode = bool((options or {}).get("cluster"))
    kwargs.update(client_kwargs(options))
    if url.lower().startswith("unix:"):
        # TCP's own options, which a Unix socket's connection refuses (as kombu drops them).
        for key in TCP_ONLY_KEYS:
            kwargs.pop(key, None)
    url = url_cert_reqs(url)
    if cluster_mode:
        return cluster.make_cluster_client(url, kwargs, RETRY_BUDGET)  # type: ignore[return-value]
    if is_sentinel_url(url):
        return _bounded(master_client(url, kwargs, options))
    return _bounded(checked(redis.Redis.from_url(url, **kwargs)))


def _bounded(client: redis.Redis) -> redis.Redis:
    """``client`` with every connection's waits bounded by its caller's deadline (:mod:`.deadline`):
    the pool's, and on Sentinel the sentinels' (the master is asked of them at each connect)."""
    pools = [client.connection_pool]
    manager = getattr(client.connection_pool, "sentinel_manager", None)
    pools += [sentinel.connection_pool for sentinel in getattr(manager, "sentinels", ())]
    for pool in pools:
        pool.connection_class = deadline.bounded_class(pool.connection_class)
    return client
