"""throughput: 20,000 no-op threaded tasks spread over 2,000 threads against 20,000 no-op plain tasks.

One prefork worker with 2 processes and beat, Redis broker (``--broker amqp``: RabbitMQ on
127.0.0.1:5672, a queue of the run's own, deleted afterwards).  Each repeat runs both sides (their
order alternating) in three ways:

* drain: the worker's consumer is cancelled, the tasks are published, the consumer is added back;
  throughput = tasks / (first task's completion -> last task's completion).  For threaded tasks
  the queue then holds each thread's first member only; every other member is released by its
  predecessor's ending, inside the measured window.  CPU time of the worker's main process, its
  pool processes and redis-server during the drain, per task, from /proc.
* end-to-end: the worker consumes while the tasks are published (one producer, one at a time);
  throughput = tasks / (first publish -> last task's end).
* publish: the producer alone (the publishing of the drain run): tasks / publishing time.

Every task body is one Lua call counting its completion; times are the Redis server's clock.
Target: threaded throughput at least 0.9x plain Celery.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from bench import harness as h


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--broker", choices=("redis", "amqp"), default="redis")
    p.add_argument("--tasks", type=int, default=None, help="tasks per side (default 20,000)")
    p.add_argument("--threads", type=int, default=None, help="threads (default 2,000)")
    p.add_argument("--concurrency", type=int, default=2)
    p.add_argument(
        "--threaded-no-ack",
        action="store_true",
        help="route the threaded tasks to a queue of their own consumed without broker "
        "acknowledgements (Queue(name, no_ack=True)); plain tasks keep theirs",
    )
    p.add_argument(
        "--track-releases",
        action="store_true",
        help="threads_track_releases=True: threaded deliveries on the Redis transport "
        "go through kombu's unacked index like plain ones (the default before "
        "e0558c4)",
    )
    p.add_argument(
        "--events",
        action="store_true",
        help="the worker sends task events (worker_send_task_events, as for Flower), "
        "both sides (the pool process sends a handed-off member's own)",
    )


def _publish(task: Any, tag: str, n: int, threads: int, key: str) -> None:
    for i in range(n):
        task.apply_async((f"{tag}-{i % threads}", key, n))


def _calls(client: Any) -> dict[str, int]:
    """Commands the Redis server has run so far (INFO commandstats, scripts' inner ones included)."""
    stats = client.info("commandstats")
    return {
        "evalsha": sum(int(stats.get(f"cmdstat_{c}", {}).get("calls", 0)) for c in ("evalsha", "fcall")),
        "all": sum(int(v["calls"]) for v in stats.values()),
    }


def _control(app: Any, worker: Any, queue: str, consume: bool) -> None:
    call = app.control.add_consumer if consume else app.control.cancel_consumer
    replies = call(queue, destination=[worker.hostname], reply=True, timeout=10)
    if not replies:
        raise RuntimeError(f"worker did not answer {'add' if consume else 'cancel'}_consumer")


def run(args: argparse.Namespace) -> int:
    n = args.tasks or (400 if args.quick else 20_000)
    threads = args.threads or (40 if args.quick else 2_000)
    if args.broker == "amqp" and not h.rabbitmq_available():
        raise SystemExit("RabbitMQ is not reachable on 127.0.0.1:5672")
    from bench import tasks

    sides = {"threaded": tasks.noop_threaded, "plain": tasks.noop_plain}
    results: dict[tuple[str, str], list[float]] = {}
    with h.Stack("throughput") as stack:
        server = stack.redis()
        client = server.client()
        env = h.celery_env(server, broker=args.broker)
        if args.track_releases:
            env["BENCH_TRACK_RELEASES"] = "1"
        if args.events:
            env["BENCH_EVENTS"] = "1"
        queue = env["BENCH_QUEUE"]
        queues = [queue]
        if args.threaded_no_ack:
            env["BENCH_NOACK_QUEUE"] = f"{queue}-noack"
            queues.append(env["BENCH_NOACK_QUEUE"])
        app = tasks.configure(env)
        where = h.machine(server)
        worker = stack.worker(env, concurrency=args.concurrency, queues=",".join(queues), ready_client=client)
        stack.beat(env, ready_client=client)
        rec = tasks.recorder()
        broker_pid = h.rabbitmq_pid() if args.broker == "amqp" else None
        timeout = 120 + n / 20
        for rep in range(args.repeats):
            order = list(sides) if rep % 2 == 0 else list(reversed(sides))
            for side in order:
                task, tag = sides[side], f"{side[0]}{rep}"
                # drain (and the publish rate of its producer)
                for q in queues:
                    _control(app, worker, q, consume=False)
                key = f"bench:{stack.run_id}:{tag}:drain"
                h.progress(f"repeat {rep + 1}/{args.repeats} {side}: publishing {n:,}")
                before = _calls(client)
                p0 = rec.now_us()
                _publish(task, f"{tag}d", n, threads, key)
                p1 = rec.now_us()
                cpu0 = h.cpu_snapshot(worker, server, broker_pid)
                for q in queues:
                    _control(app, worker, q, consume=True)
                h.progress(f"repeat {rep + 1}/{args.repeats} {side}: draining")
                h.wait_until(
                    lambda key=key: int(client.get(key) or 0) >= n,
                    timeout,
                    f"{side} drain of {n} tasks",
                    stack=stack,
                )
                after = _calls(client)
                cpu1 = h.cpu_snapshot(worker, server, broker_pid)
                for proc in cpu0:
                    results.setdefault((side, f"cpu_{proc}"), []).append((cpu1[proc] - cpu0[proc]) * 1000 / n)
                # the benchmark's own probe is one EVALSHA (INCR, TIME, SET inside) per task
                results.setdefault((side, "scripts"), []).append(
                    (after["evalsha"] - before["evalsha"]) / n - 1
                )
                results.setdefault((side, "commands"), []).append((after["all"] - before["all"]) / n)
                first, last = (int(client.get(f"{key}:{x}") or 0) for x in ("first", "last"))
                results.setdefault((side, "publish"), []).append(n / ((p1 - p0) / 1e6))
                results.setdefault((side, "drain"), []).append(n / ((last - first) / 1e6))
                # end-to-end
                key = f"bench:{stack.run_id}:{tag}:e2e"
                h.progress(f"repeat {rep + 1}/{args.repeats} {side}: end-to-end")
                cpu0 = {**h.cpu_snapshot(worker, server, broker_pid), "producer": time.process_time()}
                p0 = rec.now_us()
                _publish(task, f"{tag}e", n, threads, key)
                p1 = rec.now_us()
                h.wait_until(
                    lambda key=key: int(client.get(key) or 0) >= n,
                    timeout,
                    f"{side} end-to-end run of {n} tasks",
                    stack=stack,
                )
                cpu1 = {**h.cpu_snapshot(worker, server, broker_pid), "producer": time.process_time()}
                last = int(client.get(f"{key}:last") or 0)
                results.setdefault((side, "e2e"), []).append(n / ((last - p0) / 1e6))
                results.setdefault((side, "e2e_publishing"), []).append((p1 - p0) / (last - p0))
                for proc in cpu0:
                    results.setdefault((side, f"e2e_cpu_{proc}"), []).append(
                        (cpu1[proc] - cpu0[proc]) * 1000 / n
                    )
        leftover = sum(client.zcard(f"{env['BENCH_KEY_PREFIX']}:{{0}}:{x}") for x in ("due", "leases"))
        problems = stack.celery_problems()

    rows = []
    verdicts = []
    labels = {
        "drain": "drain (worker alone, full queue)",
        "e2e": "end-to-end (publishing while the worker runs)",
        "publish": "publish (producer alone)",
    }
    for what in ("drain", "e2e", "publish"):
        t, p = h.median(results[("threaded", what)]), h.median(results[("plain", what)])
        r = h.ratio(t, p)
        target = what in ("drain", "e2e")
        verdicts.append(r >= 0.9 if target else None)
        rows.append(
            [labels[what], t, p, r, ">= 0.90" if target else "-", h.verdict(r >= 0.9) if target else "-"]
        )
    if args.broker == "redis":
        t, p = h.median(results[("threaded", "commands")]), h.median(results[("plain", "commands")])
        rows.append(
            ["Redis commands per task (broker + gate, during the drain)", t, p, h.ratio(t, p), "-", "-"]
        )
    procs = [("main", "worker main process"), ("pool", "pool processes"), ("redis", "redis-server")]
    if broker_pid is not None:
        procs.append(("rabbitmq", "RabbitMQ server"))
    for proc, label in [*procs, ("machine", "whole machine")]:
        t, p = (h.median(results[(side, f"cpu_{proc}")]) for side in ("threaded", "plain"))
        rows.append([f"CPU ms per task during the drain: {label}", t, p, h.ratio(t, p), "-", "-"])
    e2e_cpu = {
        side: {
            proc: h.median(results[(side, f"e2e_cpu_{proc}")])
            for proc in ("producer", *(proc for proc, _ in procs))
        }
        for side in sides
    }
    t, p = (sum(e2e_cpu[side].values()) for side in ("threaded", "plain"))
    rows.append(
        [
            f"CPU ms per task end-to-end (producer, worker, redis-server"
            f"{', RabbitMQ' if broker_pid is not None else ''})",
            t,
            p,
            h.ratio(t, p),
            "-",
            "-",
        ]
    )
    t, p = (h.median(results[(side, "e2e_cpu_machine")]) for side in ("threaded", "plain"))
    rows.append(["CPU ms per task end-to-end: whole machine", t, p, h.ratio(t, p), "-", "-"])
    rows.append(
        [
            "gate script calls per task (during the drain)",
            h.median(results[("threaded", "scripts")]),
            h.median(results[("plain", "scripts")]),
            "-",
            "-",
            "-",
        ]
    )
    per_rep = {
        what: ", ".join(f"{t / p:.2f}" for t, p in zip(results[("threaded", what)], results[("plain", what)]))
        for what in ("drain", "e2e", "publish")
    }
    notes = [
        f"throughput in tasks/s, median of {args.repeats} repeat(s); ratio = threaded / plain "
        "of the medians.",
        "commands per task: INFO commandstats deltas over the publish and drain of a side, "
        "including those run inside scripts and the benchmark's own probe (one script per "
        "task, not counted among the gate's script calls); beat's dispatch entry and the "
        "workers' dispatch loops included.",
        "end-to-end CPU ms per task, threaded / plain: "
        + ", ".join(
            f"{proc} {e2e_cpu['threaded'][proc]:.2f} / {e2e_cpu['plain'][proc]:.2f}"
            for proc in e2e_cpu["threaded"]
        )
        + "; the producer published for "
        + " / ".join(f"{h.median(results[(side, 'e2e_publishing')]):.0%}" for side in ("threaded", "plain"))
        + " of the end-to-end window.",
        "per-repeat ratios: " + "; ".join(f"{k} {v}" for k, v in per_rep.items()) + ".",
        "whole machine: busy CPU of all processors (/proc/stat, steal excluded), including "
        "beat, the broker and anything else running; both cores saturated means "
        "throughput follows CPU per task.",
        f"gate left with {leftover} thread(s) after the run (expected 0).",
    ]
    options = (
        (" --broker amqp" if args.broker == "amqp" else "")
        + (" --threaded-no-ack" if args.threaded_no_ack else "")
        + (" --track-releases" if args.track_releases else "")
        + (" --events" if args.events else "")
    )
    if args.events:
        notes.append(
            "--events: the worker sent task events (worker_send_task_events=True), to "
            "no consumer; a pool process sent the events of the members it ran by handoff."
        )
    if args.track_releases:
        notes.append(
            "--track-releases: threads_track_releases=True, threaded deliveries tracked "
            "in the broker's unacked index and acknowledged like plain ones."
        )
    if args.threaded_no_ack:
        bound = (
            "prefetch bounded by the worker's step"
            if args.broker == "redis"
            else "RabbitMQ applies no prefetch to such a consumer"
        )
        notes.append(
            "--threaded-no-ack: the threaded tasks' queue was consumed without broker "
            f"acknowledgements (no unacked bookkeeping and no acks; {bound}); the plain "
            "tasks' queue as usual."
        )
    h.report(
        f"throughput ({args.broker} broker)",
        "throughput",
        args.quick,
        where,
        f"{n:,} no-op tasks per side, threaded ones over {threads:,} threads; one prefork "
        f"worker -c {args.concurrency} (prefetch 4), beat; {args.repeats} repeat(s)",
        ["measure", "threaded", "plain", "ratio", "target", "verdict"],
        rows,
        notes,
        problems,
        options=options,
    )
    return 0
