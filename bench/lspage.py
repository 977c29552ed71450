"""lspage: ``celery threads ls --limit 20`` on a gate of 20,000 and of 1,000,000 threads.

The gate is filled directly (``Gate.enqueue`` in pipelines, as ``bench scale`` does) on a private
redis-server per size: every thread has one member; half of them were released (leases index),
the other half wait with a head scheduled a day ahead (due index).  Then, alternating, each
``--repeats`` times:

* now: the command's own code (click's runner invoking ``threads ls --limit 20`` in this process,
  on an app whose gate is that server: the PING, ``Threads`` and the listing), which reads about
  20 threads through the ``Threads.ids()`` cursor;
* before: the read path ``ls --limit 20`` had before the cursor, every thread's summary read
  (``Threads.summaries()`` to the end) and sorted by id, the first 20 kept.

Reported: wall time (median of the repeats, with min and max) and the Redis commands each read
issued (``INFO commandstats``, those run inside scripts included).  Target: the limited listing
at 1,000,000 threads within 1.5x of it at 20,000 (O(N) reads whatever the gate's size).
"""

from __future__ import annotations

import argparse
import time
import types
from typing import Any, Callable

from celery import Celery

from bench import harness as h

DAY_MS = 86_400_000
LIMIT = 20


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--sizes",
        type=str,
        default=None,
        help="thread counts, comma-separated (default 20000,1000000; --quick: 2000,20000)",
    )


def _envelope(thread: str) -> bytes:
    from celery_threads.publish import encode_envelope

    body = [
        [thread, "bench:key", 20_000],
        {},
        {"callbacks": None, "errbacks": None, "chain": None, "chord": None},
    ]
    return encode_envelope(
        body,
        {
            "headers": {"task": "bench.tasks.noop_threaded", "id": "x", "lang": "py"},
            "serializer": "json",
            "exchange": "",
            "routing_key": "celery",
        },
    )


def _fill(app: Celery, threads: int, label: str) -> None:
    from celery_threads import Threads

    gate = Threads(app).gate
    h.progress(f"{label}: {threads:,} threads")
    rows = [(f"t-{i:07d}", f"m-{i:07d}", 0 if i % 2 == 0 else DAY_MS) for i in range(threads)]
    h.enqueue_many(gate, rows, _envelope("t"))
    shard = gate.keys.shard(0)
    counts = (gate.client.zcard(shard.due), gate.client.zcard(shard.leases))
    assert sum(counts) == threads, counts


def _now(app: Celery) -> Callable[[], Any]:
    from click.testing import CliRunner

    from celery_threads.cli import threads

    def run() -> Any:
        result = CliRunner().invoke(
            threads, ["ls", "--limit", str(LIMIT)], obj=types.SimpleNamespace(app=app)
        )
        assert result.exit_code == 0, result.output
        assert "more exist" in result.output, result.output
        return result.output

    return run


def _before(app: Celery) -> Callable[[], Any]:
    from celery_threads import Threads

    def run() -> Any:
        shown = sorted(Threads(app).summaries(), key=lambda s: s.thread_id)[:LIMIT]
        assert len(shown) == LIMIT
        return shown

    return run


def _commands(client: Any) -> int:
    stats = client.info("commandstats")
    return sum(int(v["calls"]) for k, v in stats.items() if k != "cmdstat_info")


def _measure(server: h.RedisServer, read: Callable[[], Any]) -> tuple[float, int]:
    client = server.client()
    before = _commands(client)
    t0 = time.perf_counter()
    read()
    elapsed = time.perf_counter() - t0
    return elapsed, _commands(client) - before - 1  # the first INFO counts itself


def run(args: argparse.Namespace) -> int:
    sizes = h.sizes(args, "2000,20000", "20000,1000000")
    with h.Stack("lspage") as stack:
        servers, apps = h.gate_servers(stack, "lspage", sizes)
        for app, n in zip(apps, sizes):
            _fill(app, n, f"{n:,}")
        for app in apps:  # connect and load scripts once
            _now(app)()
        times: dict[tuple[str, int], list[float]] = {}
        commands: dict[tuple[str, int], int] = {}
        for repeat in range(args.repeats):
            h.progress(f"repeat {repeat + 1}/{args.repeats}")
            for app, server, n in zip(apps, servers, sizes):
                for side, read in (("now", _now(app)), ("before", _before(app))):
                    elapsed, count = _measure(server, read)
                    times.setdefault((side, n), []).append(elapsed)
                    commands[(side, n)] = count
        where = h.machine(servers[0])
    rows = []
    small, large = sizes[0], sizes[-1]
    for side, label in (
        ("now", f"ls --limit {LIMIT} (Threads.ids() cursor)"),
        ("before", "before: every summary read, sorted, first 20 kept"),
    ):
        for n in sizes:
            t = times[(side, n)]
            rows.append(
                [label, f"{n:,}", h.median(t) * 1000, min(t) * 1000, max(t) * 1000, commands[(side, n)]]
            )
    ratio = h.ratio(h.median(times[("now", large)]), h.median(times[("now", small)]))
    rows.append(
        [
            f"ls --limit {LIMIT}: {large:,} over {small:,} threads",
            "-",
            ratio,
            "-",
            "-",
            h.verdict(ratio <= 1.5),
        ]
    )
    h.report(
        "lspage: ls --limit 20",
        "lspage",
        args.quick,
        where,
        f"one process reading, {len(sizes)} redis-servers; the machine's own load: see its load average",
        ["read", "threads", "wall ms (median)", "min", "max", "Redis commands"],
        rows,
        [
            f"{args.repeats} repeats, alternating sides and sizes; Redis commands include "
            "those run inside scripts (INFO commandstats)"
        ],
        options=f" --sizes {args.sizes}" if args.sizes else "",
    )
    return 0
