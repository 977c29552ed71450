"""``python -m bench.seams [--repeats N] [--only seam,...]``: what each private seam's fast path buys,
against its public fallback, in one run (celery_threads/seams.py).

Not one of the five benchmarks: the measure behind docs/compatibility.md.  One private
redis-server (gate, broker on another database of it, so direct releases apply).  For the run with
every seam on, and for each speed seam turned off (``CELERY_THREADS_SEAMS_OFF=<seam>`` in the
worker and in this producer process), in an order rotated between repeats:

* publish: this process publishes the threaded side of ``throughput``'s drain (``--tasks`` no-op
  members over ``--threads`` threads, no worker running): tasks/s;
* drain: a prefork worker (``-c 2``) starts and drains them: tasks / (first completion -> last),
  the Redis server's clock; CPU ms per task of the worker (main + pool processes) and of
  redis-server during it;
* handoff: on that worker, ``handoff``'s threaded side (one thread of ``--members`` no-op members
  behind a blocker): member end -> next member start, p50 and p90 (ms).

Medians over the repeats; ratio = seam on / seam off (for handoff and CPU lower is better).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any, Optional

from bench import handoff as handoff_bench
from bench import harness as h

SPEED_SEAMS = ("handoff", "direct-release", "untracked-releases", "direct-line")
MEASURES = ("cpu_producer", "cpu_worker", "cpu_redis", "handoff_p50", "handoff_p90", "publish", "drain")
LABELS = {
    "publish": "publish (tasks/s)",
    "drain": "drain (tasks/s)",
    "cpu_producer": "producer CPU ms/task (publish)",
    "cpu_worker": "worker CPU ms/task (drain)",
    "cpu_redis": "redis CPU ms/task (drain)",
    "handoff_p50": "handoff p50 (ms)",
    "handoff_p90": "handoff p90 (ms)",
}


def _configure(tasks: Any, env: dict[str, str], off: Optional[str]) -> None:
    """This process as the producer of configuration ``off`` (``None``: every seam on)."""
    from celery_threads import seams

    if off is None:
        os.environ.pop(seams.OFF_ENV, None)
    else:
        os.environ[seams.OFF_ENV] = off
    seams._results.clear()
    tasks.configure(env)


def _one(
    tasks: Any,
    stack: h.Stack,
    server: Any,
    client: Any,
    env: dict[str, str],
    off: Optional[str],
    tag: str,
    n: int,
    threads: int,
    members: int,
) -> dict[str, float]:
    worker_env = dict(env)
    if off is not None:
        off = off.replace("+", ",")
        worker_env["CELERY_THREADS_SEAMS_OFF"] = off
    _configure(tasks, env, off)
    rec = tasks.recorder()
    key = f"bench:{stack.run_id}:{tag}:drain"
    p0 = rec.now_us()
    c0 = time.process_time()
    for i in range(n):
        tasks.noop_threaded.apply_async((f"{tag}-{i % threads}", key, n))
    cpu_producer = (time.process_time() - c0) * 1000 / n
    p1 = rec.now_us()
    worker = stack.worker(worker_env, name=f"w{tag}", ready_client=None)
    cpu0: Optional[dict[str, float]] = None
    while cpu0 is None:  # from the first completion on
        if client.exists(f"{key}:first"):
            cpu0 = h.cpu_snapshot(worker, server)
        elif not worker.alive():
            raise RuntimeError(f"worker {worker.name} died:\n{worker.output()}")
        else:
            time.sleep(0.005)
    h.wait_until(lambda: int(client.get(key) or 0) >= n, 120 + n / 20, f"drain of {n}", stack=stack)
    cpu1 = h.cpu_snapshot(worker, server)
    first, last = (int(client.get(f"{key}:{x}") or 0) for x in ("first", "last"))
    gaps = sorted(handoff_bench._threaded(tasks, client, stack, tag, members))  # type: ignore[arg-type]
    worker.stop()
    stack.procs.remove(worker)
    return {
        "publish": n / ((p1 - p0) / 1e6),
        "cpu_producer": cpu_producer,
        "drain": n / ((last - first) / 1e6),
        "cpu_worker": ((cpu1["main"] - cpu0["main"]) + (cpu1["pool"] - cpu0["pool"])) * 1000 / n,
        "cpu_redis": (cpu1["redis"] - cpu0["redis"]) * 1000 / n,
        "handoff_p50": h.pct(gaps, 50),
        "handoff_p90": h.pct(gaps, 90),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.seams",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--tasks", type=int, default=4_000)
    p.add_argument("--threads", type=int, default=400)
    p.add_argument("--members", type=int, default=300)
    p.add_argument(
        "--only",
        default=",".join(SPEED_SEAMS),
        help="seams to turn off, one by one; 'a+b': b off on top of a",
    )
    p.add_argument("--quick", action="store_true", help="seconds: 1 repeat, 200 tasks")
    args = p.parse_args(argv)
    if args.quick:
        args.repeats, args.tasks, args.threads, args.members = 1, 200, 20, 30
    configs: list[Optional[str]] = [None, *args.only.split(",")]
    from bench import tasks

    results: dict[tuple[Optional[str], str], list[float]] = {}
    with h.Stack("seams") as stack:
        server = stack.redis()
        client = server.client()
        env = h.celery_env(server)
        where = h.machine(server)
        for rep in range(args.repeats):
            order = configs[rep % len(configs) :] + configs[: rep % len(configs)]
            for i, off in enumerate(order):
                h.progress(f"repeat {rep + 1}/{args.repeats}: {off or 'every seam on'}")
                got = _one(
                    tasks,
                    stack,
                    server,
                    client,
                    env,
                    off,
                    f"r{rep}c{i}",
                    args.tasks,
                    args.threads,
                    args.members,
                )
                for k, v in got.items():
                    results.setdefault((off, k), []).append(v)
        problems = stack.celery_problems()
    _configure(tasks, env, None)
    rows = []
    for off in configs[1:]:
        # "a+b": b off on top of a (b's own gain where a's fallback is the path taken)
        base = off.rsplit("+", 1)[0] if off and "+" in off else None
        base = base if base in configs else None
        for what in MEASURES:
            on_value, off_value = (h.median(results[(c, what)]) for c in (base, off))
            rows.append([off, LABELS[what], on_value, off_value, h.ratio(on_value, off_value)])
    notes = [
        "medians over the repeats; a worker started per configuration and repeat; the "
        "producer (this process) runs the same configuration.  'a+b': b turned off on top "
        "of a, against a alone (seam on: every other seam on)."
    ]
    for what in ("drain", "publish", "handoff_p50"):
        notes.append(
            f"{LABELS[what]} per repeat: "
            + "; ".join(
                f"{off or 'all on'} " + "/".join(f"{v:,.4g}" for v in results[(off, what)]) for off in configs
            )
            + "."
        )
    if problems:
        notes.append("worker log problems: " + " / ".join(problems[:5]))
    print(
        h.table(
            "private seams: fast path vs public fallback",
            [
                f"command: `python -m bench.seams{' --quick' if args.quick else ''}`",
                f"machine: {where}",
                f"load: {args.tasks:,} no-op threaded tasks over {args.threads:,} threads, then one thread "
                f"of {args.members:,} members; prefork -c 2; {args.repeats} repeat(s)",
            ],
            ["seam turned off", "measure", "seam on", "seam off", "ratio on/off"],
            rows,
            notes,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
