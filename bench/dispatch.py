"""dispatch: the dispatcher's tick, and how late members with a countdown start.

Part 1, the tick (``celery_threads.dispatcher.Dispatcher`` on this process's runtime, no worker
consuming, its own key prefix and queue):

* 100,000 existing threads, nothing due: half with an active member (released, deadline days
  ahead), half idle with a head scheduled a day ahead.  Each tick is timed (client wall time) and
  its Redis commands and execution time taken from ``SLOWLOG`` / ``INFO commandstats``.
* 1,000 due heads on top of them (fresh threads whose member's countdown just passed): the ticks
  that release and publish them all, with the default ``threads_dispatch_batch`` (500 per tick).

Part 2, lateness: members with a countdown, each in a thread of its own (so that only the due time
holds it back), countdowns spread 10 ms apart starting 1 s ahead; lateness = start of the task body
(Redis server clock) - its ``scheduled_at`` (the gate's, in ms, read from the active member's hash
in the same Lua call).  Beside it, plain Celery's countdown lateness in the same run: start - the
message's ``eta``.  One prefork worker with 2 processes (its dispatch loop on) and beat, Redis broker.

Targets: a tick with nothing due under 5 ms; threaded p99 lateness at most 20 ms.
"""

from __future__ import annotations

import argparse
import datetime as dt
import time
import uuid
from typing import Any

from bench import harness as h

DAY_MS = 86_400_000


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", type=int, default=None, help="existing threads (100,000)")
    p.add_argument("--due", type=int, default=None, help="due heads (1,000)")
    p.add_argument("--ticks", type=int, default=None, help="timed idle ticks per repeat (200)")
    p.add_argument("--members", type=int, default=None, help="countdown members per side and repeat (500)")
    p.add_argument("--spacing-ms", type=float, default=10.0)


def _tick_part(
    stack: h.Stack, server: h.RedisServer, args: argparse.Namespace, threads: int, due: int, ticks: int
) -> dict[str, list[float]]:
    from bench import tasks
    from celery_threads.dispatcher import Dispatcher
    from celery_threads.runtime import Runtime

    env = h.celery_env(server, BENCH_RELEASE_TIMEOUT=10 * 86400, BENCH_KEEPALIVE=10 * 86400)
    app = tasks.configure(env)
    runtime = Runtime(app)
    dispatcher, gate, client = Dispatcher(runtime), runtime.gate, server.client()
    envelope = h.captured_envelope(tasks.noop_threaded)
    h.progress(f"tick: {threads:,} threads")
    rows = [(f"bg-{i}", str(uuid.uuid4()), 0 if i % 2 == 0 else DAY_MS) for i in range(threads)]
    h.enqueue_many(gate, rows, envelope)
    dispatcher.tick()  # warm up
    out: dict[str, list[float]] = {}
    for rep in range(args.repeats):
        h.progress(f"repeat {rep + 1}/{args.repeats}: {ticks} idle ticks")
        times = []
        with h.Probe(client) as probe:
            for _ in range(ticks):
                t0 = time.perf_counter()
                report = dispatcher.tick()
                times.append((time.perf_counter() - t0) * 1000)
                assert report.released == 0 and report.republished == 0
        out.setdefault("idle_p50", []).append(h.pct(times, 50))
        out.setdefault("idle_p99", []).append(h.pct(times, 99))
        out.setdefault("idle_server_us", []).append(probe.server_us / ticks)
        out.setdefault("idle_cmds", []).append(sum(probe.top.values()) / ticks)
        out.setdefault("idle_all", []).append(probe.all_calls / ticks)

        h.progress(f"repeat {rep + 1}/{args.repeats}: {due:,} due heads")
        heads = [(f"due-{rep}-{i}", str(uuid.uuid4()), 50) for i in range(due)]
        h.enqueue_many(gate, heads, envelope)
        time.sleep(0.1)
        released, tick_times = 0, []
        t0 = time.perf_counter()
        while released < due:
            t1 = time.perf_counter()
            report = dispatcher.tick()
            tick_times.append((time.perf_counter() - t1) * 1000)
            released += report.released
            if not report.released and not report.more:
                raise RuntimeError(f"only {released} of {due} due heads were released")
        total = (time.perf_counter() - t0) * 1000
        out.setdefault("due_total", []).append(total)
        out.setdefault("due_per_head", []).append(total * 1000 / due)
        out.setdefault("due_max_tick", []).append(max(tick_times))
        out.setdefault("due_ticks", []).append(len(tick_times))
        # Back to 100,000 threads: detach the released members, drop their messages.
        pipe = client.pipeline(transaction=False)
        for thread, task, _ in heads:
            gate._run("delete", thread, task, "", "0", client=pipe)
        pipe.execute()
        h.redis_broker_client(env).delete(env["BENCH_QUEUE"])
    out["batch"] = [runtime.config.dispatch_batch]
    return out


def _lateness_part(
    stack: h.Stack, server: h.RedisServer, args: argparse.Namespace, members: int
) -> dict[str, list[list[float]]]:
    from bench import tasks

    env = h.celery_env(server)
    tasks.configure(env)
    client = server.client()
    stack.worker(env, concurrency=2, ready_client=client)
    stack.beat(env, ready_client=client)
    spacing = args.spacing_ms / 1000.0
    samples: dict[str, list[list[float]]] = {"threaded": [], "plain": []}
    for rep in range(args.repeats):
        order = ["threaded", "plain"] if rep % 2 == 0 else ["plain", "threaded"]
        for side in order:
            h.progress(f"repeat {rep + 1}/{args.repeats} {side}: {members} countdown members")
            key = f"bench:{stack.run_id}:{rep}:{side}:due"
            task = tasks.due_threaded if side == "threaded" else tasks.due_plain
            for i in range(members):
                task.apply_async((f"due-{side}-{rep}-{i}", key, str(i)), countdown=1.0 + i * spacing)
            h.wait_until(
                lambda key=key: client.llen(key) >= members,
                60 + members * spacing,
                f"{members} {side} countdown members",
                stack=stack,
            )
            late: list[float] = []
            parts: dict[str, list[float]] = {"released": [], "claimed": [], "started": []}
            for row in h.read_stamps(client, key):
                if side == "threaded":  # label | start us | scheduled_at | released | claimed (ms)
                    start_ms = int(row[1]) / 1000.0
                    sched, since, claimed = (int(x) for x in row[2:5])
                    late.append(start_ms - sched)
                    parts["released"].append(since - sched)
                    parts["claimed"].append(claimed - since)
                    parts["started"].append(start_ms - claimed)
                else:  # label | eta | start us
                    eta = dt.datetime.fromisoformat(row[1])
                    late.append((int(row[2]) - eta.timestamp() * 1e6) / 1000.0)
            samples[side].append(late)
            if side == "threaded":
                for name, values in parts.items():
                    samples.setdefault(name, []).append(values)
            time.sleep(0.5)
    return samples


def run(args: argparse.Namespace) -> int:
    threads = args.threads or (2_000 if args.quick else 100_000)
    due = args.due or (100 if args.quick else 1_000)
    ticks = args.ticks or (20 if args.quick else 200)
    members = args.members or (30 if args.quick else 500)
    with h.Stack("dispatch") as stack:
        server = stack.redis()
        where = h.machine(server)
        ticked = _tick_part(stack, server, args, threads, due, ticks)
        late = _lateness_part(stack, server, args, members)
        problems = stack.celery_problems()

    def med(what: str) -> float:
        return h.median(ticked[what])

    def lat(side: str, p: float) -> float:
        return h.median(h.pct(s, p) for s in late[side])

    rows: list[list[Any]] = [
        [
            f"tick, {threads:,} threads, nothing due: p50 (ms)",
            med("idle_p50"),
            "-",
            "-",
            "< 5 ms",
            h.verdict(med("idle_p50") < 5),
        ],
        [f"tick, {threads:,} threads, nothing due: p99 (ms)", med("idle_p99"), "-", "-", "-", "-"],
        [
            "  its Redis execution time (µs) / top-level, all commands",
            f"{med('idle_server_us'):.0f} / {med('idle_cmds'):.0f}, {med('idle_all'):.0f}",
            "-",
            "-",
            "-",
            "-",
        ],
        [f"{due:,} due heads: release and publish them all (ms)", med("due_total"), "-", "-", "-", "-"],
        [
            "  per head (µs); ticks; longest tick (ms)",
            f"{med('due_per_head'):.0f}; {med('due_ticks'):.0f}; {med('due_max_tick'):.0f}",
            "-",
            "-",
            "-",
            "-",
        ],
    ]
    for p in (50, 90, 99):
        t, pl = lat("threaded", p), lat("plain", p)
        rows.append(
            [
                f"countdown lateness p{p} (ms)",
                t,
                pl,
                h.ratio(t, pl),
                "<= 20 ms" if p == 99 else "-",
                h.verdict(t <= 20) if p == 99 else "-",
            ]
        )
    t, pl = lat("threaded", 100), lat("plain", 100)
    rows.append(["countdown lateness max (ms)", t, pl, h.ratio(t, pl), "-", "-"])
    for name, label in (
        ("released", "due -> released by a dispatcher"),
        ("claimed", "released -> claimed by the worker"),
        ("started", "claimed -> task body starts"),
    ):
        rows.append(
            [
                f"  threaded, of which {label}: p50 / p99 (ms)",
                f"{lat(name, 50):.1f} / {lat(name, 99):.1f}",
                "-",
                "-",
                "-",
                "-",
            ]
        )
    notes = [
        f"tick figures: medians over {args.repeats} repeat(s) of {ticks} ticks (client wall time, "
        f"this process as the dispatcher); due heads released {ticked['batch'][0]} per tick "
        "(threads_dispatch_batch), published to a Redis broker queue nobody consumes.",
        f"lateness: {members} members per side and repeat, countdowns 1 s + i x "
        f"{args.spacing_ms:g} ms, each in its own thread; percentiles over the members, median "
        f"over {args.repeats} repeat(s); the gate's scheduled_at is whole ms, so threaded "
        "lateness may read up to 1 ms high; ratio = threaded / plain.",
    ]
    h.report(
        "dispatch (redis broker)",
        "dispatch",
        args.quick,
        where,
        f"tick: {threads:,} existing threads (half active, half idle with a head a day "
        f"ahead), then {due:,} due heads; lateness: one prefork worker -c 2 with its "
        "dispatch loop, beat (threads_dispatch_interval 1 s)",
        ["measure", "threaded", "plain", "ratio", "target", "verdict"],
        rows,
        notes,
        problems,
    )
    return 0
