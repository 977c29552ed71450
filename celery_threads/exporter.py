"""Prometheus export of the gate's metrics (``celery threads metrics``; docs/metrics.md).

Needs ``prometheus_client`` (the ``metrics`` extra): :mod:`celery_threads.cli` imports this module
only for that command.  A custom collector reads the gate on each scrape
(:meth:`celery_threads.Threads.metrics`): the counters live in the gate, so the exporter keeps no
state, and any number of them can run.
"""

from __future__ import annotations

from collections.abc import Iterator
from threading import Thread

from prometheus_client import CollectorRegistry, generate_latest, start_http_server
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from .admin import Threads
from .metrics import OUTCOMES, STATES, Metrics

__all__ = ["GateCollector", "listen", "registry", "render"]


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


def listen(threads: Threads, address: str, port: int, top: int = 0) -> Thread:
    """Serve the metrics at ``http://address:port/metrics`` from a daemon thread, returned (join
    it to serve until the process is stopped).  Raises OSError when the address is taken."""
    _server, thread = start_http_server(port, addr=address, registry=registry(threads, top))
    return thread
