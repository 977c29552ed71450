"""The gate's metrics: what ``celery threads metrics`` exports (docs/metrics.md).

Counters live in each shard's stats hash (:attr:`celery_threads.keys.ShardKeys.stats`), kept by
the transitions themselves (lua/_common.lua ``count``), so any number of exporters can run,
restart, or none at all, and a scrape reads a few O(1) or O(log n) values per shard.  This module
only names and parses them; :meth:`celery_threads.Threads.metrics` reads them, and
:mod:`celery_threads.exporter` serves them through ``prometheus_client``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

WAIT_BUCKETS_MS = (
    5,
    10,
    25,
    50,
    100,
    250,
    500,
    1000,
    2500,
    5000,
    10_000,
    30_000,
    60_000,
    300_000,
    900_000,
    3_600_000,
)
"""The wait histogram's upper bounds in ms (WAIT_BUCKETS in lua/_common.lua), and +Inf."""

OUTCOMES = ("succeeded", "dead", "deleted")
"""How a member ends: ``deleted`` also covers purged, expired and superseded members."""

STATES = ("waiting", "released", "running")


@dataclass(frozen=True)
class Counters:
    """The counters of one shard's stats hash, or their sum over the shards."""

    endings: dict[str, int] = field(default_factory=lambda: dict.fromkeys(OUTCOMES, 0))
    retries: int = 0
    lease_lapses: int = 0
    running: int = 0
    # One count per bucket of WAIT_BUCKETS_MS and a last one for +Inf (not cumulative).
    wait_buckets: tuple[int, ...] = (0,) * (len(WAIT_BUCKETS_MS) + 1)
    wait_sum_ms: int = 0

    @classmethod
    def parse(cls, raw: Mapping[Any, Any]) -> Counters:
        """From the hash as HGETALL returns it (bytes or text)."""
        values = {_text(k): int(v) for k, v in raw.items()}
        return cls(
            endings={o: values.get(f"ended:{o}", 0) for o in OUTCOMES},
            retries=values.get("retries", 0),
            lease_lapses=values.get("lapses", 0),
            running=values.get("running", 0),
            wait_buckets=tuple(values.get(f"w:{b}", 0) for b in (*WAIT_BUCKETS_MS, "inf")),
            wait_sum_ms=values.get("w:sum", 0),
        )

    def __add__(self, other: Counters) -> Counters:
        return Counters(
            endings={o: self.endings[o] + other.endings[o] for o in OUTCOMES},
            retries=self.retries + other.retries,
            lease_lapses=self.lease_lapses + other.lease_lapses,
            running=self.running + other.running,
            wait_buckets=tuple(a + b for a, b in zip(self.wait_buckets, other.wait_buckets)),
            wait_sum_ms=self.wait_sum_ms + other.wait_sum_ms,
        )

    @property
    def wait_count(self) -> int:
        return sum(self.wait_buckets)

    def cumulative_wait_buckets(self) -> list[tuple[float, int]]:
        """``(upper bound in seconds, members that waited at most that long)``, the last bound
        ``inf``: Prometheus' cumulative buckets."""
        out, total = [], 0
        for bound, n in zip((*WAIT_BUCKETS_MS, float("inf")), self.wait_buckets):
            total += n
            out.append((bound / 1000.0, total))
        return out


@dataclass(frozen=True)
class Metrics:
    """One reading of every metric (:meth:`celery_threads.Threads.metrics`), summed over shards."""

    threads: int  # threads that exist
    members: dict[str, int]  # by state: waiting, released, running
    paused_threads: int
    stuck_threads: int  # as ``celery threads stats`` counts them
    oldest_due_seconds: float  # the idle head due the longest (0 when none is due)
    dead_letters: int
    counters: Counters
    # ``--top N``: (thread id, waiting members) of the N threads with the most, most first.
    thread_waiting: list[tuple[str, int]] = field(default_factory=list)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
