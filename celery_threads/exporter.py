"""Prometheus export of the gate's metrics (``celery threads metrics``; docs/metrics.md).

Needs ``prometheus_client`` (the ``metrics`` extra): :mod:`celery_threads.cli` imports this module
only for that command.  A custom collector reads the gate on each scrape
(:meth:`celery_threads.Threads.metrics`): the counters live in the gate, so the exporter keeps no
state, and any number of them can run.

While the gate cannot be read (its Redis down, or not answering within ``threads_publish_timeout``:
:meth:`~celery_threads.Threads.metrics` is an admin call, bounded as every one is), a scrape gets
``503 Service Unavailable`` and a one-line body, so Prometheus records ``up == 0`` for the target,
and the exporter logs one line when the outage starts and one when the gate answers again, not a
traceback per scrape.  It serves no stale or made-up values in place of those it could not read.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable, Iterable, Iterator
from socketserver import ThreadingMixIn
from threading import Lock, Thread
from typing import Any, Optional
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import redis
from prometheus_client import CollectorRegistry, generate_latest, make_wsgi_app
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from .admin import Threads
from .errors import GateUnavailable
from .logs import get_logger
from .metrics import OUTCOMES, STATES, Metrics

__all__ = ["GateCollector", "listen", "registry", "render"]

log = get_logger(__name__)

#: What a scrape meets when the gate cannot be read: refused, closed, timed out (the admin call's
#: bound, DeadlinePassed, is a redis.TimeoutError), an error reply (LOADING, MASTERDOWN).
GATE_ERRORS = (redis.RedisError, GateUnavailable, OSError)


class GateCollector(Collector):
    """Every metric of the contract's table, read from the gate once per scrape.  ``top``: also
    ``celery_threads_thread_waiting{thread_id}`` for the ``top`` threads with the most waiting
    members (a read of every thread's queue length: opt-in)."""

    def __init__(self, threads: Threads, top: int = 0) -> None:
        self.threads = threads
        self.top = top

    def collect(self) -> Iterator[Metric]:
        yield from families(self.threads.metrics(top=self.top), self.top > 0)


def families(m: Metrics, top: bool = False) -> Iterator[Metric]:
    yield GaugeMetricFamily("celery_threads_threads", "Threads that exist.", value=m.threads)
    members = GaugeMetricFamily("celery_threads_members", "Members by state.", labels=["state"])
    for state in STATES:
        members.add_metric([state], m.members[state])
    yield members
    yield GaugeMetricFamily("celery_threads_paused_threads", "Paused threads.", value=m.paused_threads)
    yield GaugeMetricFamily(
        "celery_threads_stuck_threads",
        "Threads `celery threads stats` reports as stuck.",
        value=m.stuck_threads,
    )
    yield GaugeMetricFamily(
        "celery_threads_oldest_due_seconds",
        "How long the member that has been due longest without release has waited (0 when none).",
        value=m.oldest_due_seconds,
    )
    yield GaugeMetricFamily(
        "celery_threads_dead_letters", "Members in the dead-letter store.", value=m.dead_letters
    )
    c = m.counters
    endings = CounterMetricFamily(
        "celery_threads_endings",
        "Members ended, by outcome (deleted: also purged, superseded, expired).",
        labels=["outcome"],
    )
    for outcome in OUTCOMES:
        endings.add_metric([outcome], c.endings[outcome])
    yield endings
    yield CounterMetricFamily(
        "celery_threads_retries",
        "Attempts that re-entered their thread (retries, lost attempts with retries left).",
        value=c.retries,
    )
    yield CounterMetricFamily(
        "celery_threads_lease_lapses",
        "Leases that lapsed (a worker or pool process lost, or cut off).",
        value=c.lease_lapses,
    )
    yield HistogramMetricFamily(
        "celery_threads_wait_seconds",
        "From a member's due time to the start of its body.",
        buckets=[(_bound(le), n) for le, n in c.cumulative_wait_buckets()],
        sum_value=c.wait_sum_ms / 1000.0,
    )
    if top:
        waiting = GaugeMetricFamily(
            "celery_threads_thread_waiting",
            "Waiting members of the threads with the most.",
            labels=["thread_id"],
        )
        for thread_id, n in m.thread_waiting:
            waiting.add_metric([thread_id], n)
        yield waiting


def _bound(seconds: float) -> str:
    return "+Inf" if seconds == float("inf") else repr(seconds)


def registry(threads: Threads, top: int = 0) -> CollectorRegistry:
    """A registry holding only the gate's metrics (no process or platform collectors)."""
    reg = CollectorRegistry(auto_describe=False)
    reg.register(GateCollector(threads, top))
    return reg


def render(threads: Threads, top: int = 0) -> str:
    """The metrics once, in Prometheus' text format."""
    return generate_latest(registry(threads, top)).decode()


WSGIApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]


class GateOutage:
    """A WSGI app around prometheus_client's: a scrape that cannot read the gate gets 503 and a
    short body; the outage is logged once when it starts and once when the gate answers again
    (scrapes run in threads of their own: the state is locked)."""

    def __init__(self, app: WSGIApp, gate: str) -> None:
        self.app = app
        self.gate = gate  # the gate's URL, password masked
        self.lock = Lock()
        self.since: Optional[float] = None  # when the outage's first failed scrape began (monotonic)
        self.failed = 0  # scrapes answered 503 in this outage

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if environ.get("PATH_INFO") == "/favicon.ico":
            return self.app(environ, start_response)  # prometheus_client's: it reads no gate
        started = time.monotonic()
        try:
            body = self.app(environ, start_response)
        except GATE_ERRORS as exc:
            self._down(exc, started)
            text = f"celery-threads: the gate ({self.gate}) cannot be read: {type(exc).__name__}\n"
            start_response(
                "503 Service Unavailable",
                [("Content-Type", "text/plain; charset=utf-8"), ("Content-Length", str(len(text)))],
            )
            return [text.encode()]
        self._up()
        return body

    def _down(self, exc: BaseException, started: float) -> None:
        with self.lock:
            self.failed += 1
            if self.since is not None:
                return
            self.since = started
        log.warning(
            "celery-threads metrics: the gate (%s) cannot be read (%s: %s); scrapes get 503 until it answers",
            self.gate,
            type(exc).__name__,
            exc,
        )

    def _up(self) -> None:
        with self.lock:
            if self.since is None:
                return
            down, failed = time.monotonic() - self.since, self.failed
            self.since, self.failed = None, 0
        log.info(
            "celery-threads metrics: the gate (%s) answers again, after %.1fs (%d scrape%s got 503)",
            self.gate,
            down,
            failed,
            "" if failed == 1 else "s",
        )


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True  # a scrape in progress does not keep the process from exiting


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """No line per request (prometheus_client's server logs none either)."""


def _log_to_stderr() -> None:
    """The exporter's two outage lines reach stderr when nothing else handles them (the
    ``celery threads metrics`` process configures no logging)."""
    if not log.hasHandlers():
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[%(asctime)s: %(levelname)s] %(message)s"))
        log.addHandler(handler)
    if log.level == logging.NOTSET:
        log.setLevel(logging.INFO)  # the line saying the gate answers again is INFO


def listen(threads: Threads, address: str, port: int, top: int = 0) -> Thread:
    """Serve the metrics at ``http://address:port/metrics`` from a daemon thread, returned (join
    it to serve until the process is stopped).  Raises OSError when the address is taken."""
    _log_to_stderr()
    app = GateOutage(make_wsgi_app(registry(threads, top)), threads.runtime.config.shown_url)
    family, host = _family(address, port)

    class Server(_Server):
        address_family = family

    server = make_server(host, port, app, Server, handler_class=_Quiet)
    thread = Thread(target=server.serve_forever, name="celery-threads-metrics", daemon=True)
    thread.start()
    return thread


def _family(address: str, port: int) -> tuple[socket.AddressFamily, str]:
    """The address family of ``address`` (an IPv6 address or name listens on IPv6), and the
    address to bind, as prometheus_client's own server picks them."""
    infos = socket.getaddrinfo(address, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, _, _, _, sockaddr = next(iter(infos))
    return family, str(sockaddr[0])
