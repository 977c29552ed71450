"""handoff: how long a thread stands still between two members.

Threaded: one thread, 2,000 no-op members queued behind a blocker member; when the blocker lets go,
the members run back to back.  Handoff = a member's end (its last stamp) -> the next member's start
(its first stamp), both on the Redis server's clock; that interval holds the gate's ``finish``
(releasing the next member), its publish from the pool child, the worker receiving it, ``claim``
and the pool handing it to a process.

Plain: on the same, idle worker, plain Celery's publish-to-start latency: the driver stamps the
server clock, publishes one no-op task, waits for its end, idles 10 ms, and so on.

One prefork worker with 2 processes and beat, Redis broker.
Targets: handoff p50 at most 1.2x and p99 at most 1.5x those of plain Celery.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from bench import harness as h


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--members", type=int, default=None, help="members / samples (default 2,000)")
    p.add_argument("--concurrency", type=int, default=2)
    p.add_argument("--broker", choices=("redis", "amqp"), default="redis")


def _threaded(tasks: Any, client: Any, stack: h.Stack, rep: int, m: int) -> list[float]:
    thread = f"handoff-{rep}"
    key = f"bench:{stack.run_id}:{rep}:threaded"
    go = f"{key}:go"
    tasks.block_threaded.apply_async((thread, go, 300, key))
    for i in range(m):
        tasks.mark_threaded.apply_async((thread, key, str(i)))
    client.rpush(go, "go")
    h.wait_until(
        lambda: client.llen(key) >= 2 * m + 1, 120 + m * 0.05, f"{m} members of one thread", stack=stack
    )
    rows = h.read_stamps(client, key)
    ends = {label: int(us) for kind, label, us in rows if kind == "e"}
    starts = {label: int(us) for kind, label, us in rows if kind == "s"}
    gaps, previous = [], "block"
    for i in range(m):
        gaps.append((starts[str(i)] - ends[previous]) / 1000.0)
        previous = str(i)
    return gaps


def _plain(tasks: Any, client: Any, stack: h.Stack, rep: int, m: int) -> list[float]:
    rec = tasks.recorder()
    key = f"bench:{stack.run_id}:{rep}:plain"
    thread = f"plain-{rep}"
    latencies = []
    for i in range(m):
        published = rec.stamp(f"{key}:published", str(i))
        tasks.mark_plain.apply_async((thread, key, str(i)))
        got: dict[str, int] = {}
        while len(got) < 2:
            popped = client.blpop([key], timeout=60)
            if popped is None:
                raise RuntimeError(f"plain task {i} did not run within 60 s")
            kind, label, us = popped[1].decode().split("|")
            assert label == str(i), (label, i)
            got[kind] = int(us)
        latencies.append((got["s"] - published) / 1000.0)
        time.sleep(0.01)  # let the worker finish its bookkeeping: the next one meets an idle worker
    return latencies


def run(args: argparse.Namespace) -> int:
    m = args.members or (50 if args.quick else 2_000)
    from bench import tasks

    samples: dict[str, list[list[float]]] = {"threaded": [], "plain": []}
    with h.Stack("handoff") as stack:
        server = stack.redis()
        client = server.client()
        env = h.celery_env(server, broker=args.broker)
        tasks.configure(env)
        where = h.machine(server)
        stack.worker(env, concurrency=args.concurrency, ready_client=client)
        stack.beat(env, ready_client=client)
        for rep in range(args.repeats):
            order = ["threaded", "plain"] if rep % 2 == 0 else ["plain", "threaded"]
            for side in order:
                h.progress(f"repeat {rep + 1}/{args.repeats} {side}: {m:,} members")
                fn = _threaded if side == "threaded" else _plain
                samples[side].append(fn(tasks, client, stack, rep, m))
        problems = stack.celery_problems()

    def stat(side: str, p: float) -> float:
        return h.median(h.pct(s, p) for s in samples[side])

    def mean(side: str) -> float:
        return h.median(sum(s) / len(s) for s in samples[side])

    rows = []
    targets = {50: 1.2, 99: 1.5}
    for p in (50, 90, 99):
        t, pl = stat("threaded", p), stat("plain", p)
        r = h.ratio(t, pl)
        limit = targets.get(p)
        rows.append(
            [
                f"p{p} (ms)",
                t,
                pl,
                r,
                f"<= {limit}x" if limit else "-",
                h.verdict(r <= limit) if limit else "-",
            ]
        )
    rows.append(
        ["mean (ms)", mean("threaded"), mean("plain"), h.ratio(mean("threaded"), mean("plain")), "-", "-"]
    )
    rows.append(
        [
            "max (ms)",
            stat("threaded", 100),
            stat("plain", 100),
            h.ratio(stat("threaded", 100), stat("plain", 100)),
            "-",
            "-",
        ]
    )
    per_rep = "; ".join(
        f"p50 {h.pct(t, 50) / h.pct(p, 50):.2f} p99 {h.pct(t, 99) / h.pct(p, 99):.2f}"
        for t, p in zip(samples["threaded"], samples["plain"])
    )
    notes = [
        f"each figure: the percentile over {m:,} samples, median over {args.repeats} "
        "repeat(s); ratio = threaded / plain.",
        f"per-repeat ratios: {per_rep}.",
    ]
    h.report(
        f"handoff ({args.broker} broker)",
        "handoff",
        args.quick,
        where,
        f"one thread of {m:,} no-op members (threaded: member end -> next member start) vs "
        f"{m:,} plain no-op tasks one at a time on an idle worker (publish -> start); one "
        f"prefork worker -c {args.concurrency}, beat; {args.repeats} repeat(s); Redis server "
        "clock",
        ["measure", "threaded handoff", "plain publish->start", "ratio", "target", "verdict"],
        rows,
        notes,
        problems,
    )
    return 0
