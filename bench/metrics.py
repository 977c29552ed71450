"""metrics: what a ``celery threads metrics`` scrape costs on a gate of 1,000 and of 1,000,000
waiting members.

The gate is filled directly, through the real enqueue script in pipelines (``Gate.enqueue``, as
``bench scale`` does), on a private redis-server per size: 10 waiting members per thread; half
the threads hold an active (released, never claimed) member, the other half are idle with their
heads a day ahead, except one idle thread in a hundred whose head fell due without a dispatcher to
release it (so the oldest-due and stuck gauges have something to find).  Then, alternating between
the sizes, each ``--repeats`` times: one scrape as the exporter serves it (the Prometheus text of
every metric, ``exporter.render``, no ``--top``).

Reported: wall time (median of the repeats, with min and max), the Redis server's time of the
scrape's commands (``INFO commandstats``: the ``usec`` added by every command but ``INFO`` itself,
the reads inside its one MULTI/EXEC counted once, in EXEC's; also by command) and how many
commands it sent.  Targets: the same commands at both sizes, and the 1,000,000 scrape within 2x of
the 1,000 one in Redis time: its reads are O(1) and O(log n) (a sorted set's rank or range by
score), never a scan, and log2 of the indexes' sizes (500 and 500,000 threads) doubles.
"""

from __future__ import annotations

import argparse
import time
import uuid
from typing import Any

from celery import Celery

from bench import harness as h

DAY_MS = 86_400_000
PER_THREAD = 10
ENVELOPE = b'{"headers":{"task":"bench.noop"}}\n' + b"x" * 300


# The reads GateReads.index_counts sends in one MULTI/EXEC (a consistent view of the indexes): EXEC's
# time includes theirs, so they are counted once, in EXEC's.  A scrape without --top sends these
# commands nowhere else.
IN_EXEC = {"zcard", "hlen", "zcount", "zrangebyscore"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--sizes",
        type=str,
        default=None,
        help="waiting members, comma-separated (default 1000,1000000; --quick: 1000,20000)",
    )


def _fill(app: Celery, waiting: int, label: str) -> float:
    """The gate of ``app`` with ``waiting`` waiting members; the fill's seconds."""
    from celery_threads import Threads

    gate = Threads(app).gate
    threads = max(2, waiting // PER_THREAD)
    t0 = time.monotonic()
    h.progress(f"{label}: {threads:,} threads, active members for half of them")
    h.enqueue_many(gate, [(f"t-{i}", str(uuid.uuid4()), 0) for i in range(0, threads, 2)], ENVELOPE)
    h.progress(f"{label}: {threads * PER_THREAD:,} waiting members")
    for start in range(0, threads, 10_000):
        rows = []
        for i in range(start, min(threads, start + 10_000)):
            delay = 0 if i % 2 == 0 else (1 if i % 100 == 1 else DAY_MS)
            rows += [(f"t-{i}", str(uuid.uuid4()), delay) for _ in range(PER_THREAD)]
        h.enqueue_many(gate, rows, ENVELOPE)
    return time.monotonic() - t0


def _commandstats(client: Any) -> dict[str, tuple[int, int]]:
    """command -> (usec, calls) so far, every command but INFO."""
    return {
        k.removeprefix("cmdstat_"): (int(v["usec"]), int(v["calls"]))
        for k, v in client.info("commandstats").items()
        if k != "cmdstat_info"
    }


def _scrape(app: Celery, client: Any) -> tuple[float, dict[str, tuple[int, int]], str]:
    """One scrape: (wall s, command -> (Redis usec, calls) it added, its text)."""
    from celery_threads import Threads
    from celery_threads.exporter import render

    threads = Threads(app)
    before = _commandstats(client)
    t0 = time.perf_counter()
    text = render(threads)
    wall = time.perf_counter() - t0
    after = _commandstats(client)
    spent = {}
    for name, (usec, calls) in after.items():
        u0, c0 = before.get(name, (0, 0))
        if calls > c0:
            spent[name] = (usec - u0, calls - c0)
    return wall, spent, text


def _value(text: str, name: str) -> str:
    return next(line.split()[-1] for line in text.splitlines() if line.startswith(name + " "))


def run(args: argparse.Namespace) -> int:
    sizes = h.sizes(args, "1000,20000", "1000,1000000")
    with h.Stack("metrics") as stack:
        servers, apps = h.gate_servers(stack, "metrics", sizes)
        clients = [server.client() for server in servers]
        fills = [_fill(app, n, f"{n:,}") for app, n in zip(apps, sizes)]
        for app, client in zip(apps, clients):  # connect and load scripts once
            _scrape(app, client)
        walls: dict[int, list[float]] = {}
        usecs: dict[int, list[float]] = {}
        commands: dict[int, int] = {}
        per_command: dict[int, dict[str, int]] = {}
        texts: dict[int, str] = {}
        for repeat in range(args.repeats):
            h.progress(f"repeat {repeat + 1}/{args.repeats}")
            for app, client, n in zip(apps, clients, sizes):
                wall, spent, texts[n] = _scrape(app, client)
                walls.setdefault(n, []).append(wall)
                usecs.setdefault(n, []).append(
                    sum(u for name, (u, _) in spent.items() if name not in IN_EXEC)
                )
                commands[n] = sum(c for _, c in spent.values())
                for name, (usec, _) in spent.items():
                    per_command.setdefault(n, {})[name] = per_command.get(n, {}).get(name, 0) + usec
        where = h.machine(servers[0])
    rows = []
    for n, fill in zip(sizes, fills):
        w, u = walls[n], usecs[n]
        rows.append(
            [
                f"{n:,}",
                h.median(w) * 1000,
                min(w) * 1000,
                max(w) * 1000,
                h.median(u),
                commands[n],
                _value(texts[n], 'celery_threads_members{state="waiting"}'),
                round(fill, 1),
            ]
        )
    small, large = sizes[0], sizes[-1]
    redis_ratio = h.ratio(h.median(usecs[large]), h.median(usecs[small]))
    wall_ratio = h.ratio(h.median(walls[large]), h.median(walls[small]))
    rows.append(
        [
            f"{large:,} over {small:,}",
            wall_ratio,
            "-",
            "-",
            redis_ratio,
            h.verdict(commands[large] == commands[small]),
            "-",
            h.verdict(redis_ratio <= 2.0),
        ]
    )
    breakdown = "; ".join(
        f"{n:,}: "
        + ", ".join(f"{name} {usec / args.repeats:.1f}" for name, usec in sorted(per_command[n].items()))
        for n in sizes
    )
    h.report(
        "metrics: a scrape of celery threads metrics",
        "metrics",
        args.quick,
        where,
        f"one process scraping, {len(sizes)} redis-servers; the machine's own load: see its load average",
        [
            "waiting members",
            "wall ms (median)",
            "min",
            "max",
            "Redis µs (median)",
            "Redis commands",
            "waiting (scraped)",
            "fill s",
        ],
        rows,
        [
            f"{args.repeats} repeats, alternating sizes; Redis µs and commands from INFO "
            "commandstats (INFO itself left out; the reads of the scrape's one MULTI/EXEC "
            "counted in EXEC's); filled through the enqueue script in pipelines of 1,000",
            f"Redis µs per scrape by command (mean): {breakdown}",
        ],
        options=f" --sizes {args.sizes}" if args.sizes else "",
    )
    return 0
