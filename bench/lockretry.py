"""lockretry: today's lock-and-retry pattern against threaded tasks.

200 keys x 20 members of 20 ms of work each; each key's 20 members are published back to back (a
burst), key after key.  One prefork worker with 4 processes (prefetch 4) and beat, Redis broker.

* lock + retry: the pattern of the Celery cookbook's "one task at a time" recipe and of the common
  answers: a plain task takes a Redis lock (redis-py ``Lock``, ``SET NX PX``, expiring after 60 s)
  with ``acquire(blocking=False)`` at its start, runs and releases it, or, when the lock is held,
  ``raise self.retry(countdown=0.5)`` (``max_retries=None``).
* threaded: ``base=ThreadedTask, thread_key="key"``, the bare work.
* (reference) no exclusion: plain tasks running the bare work with no serialization at all; what
  this worker can do with this load when nothing is serialized.

Measured on the Redis server's clock: makespan (first publish -> last member's end) against the
ideal (total task time / processes); executions that did no work (every execution is counted; the
work of each member once); keys whose members started their work out of arrival order; members that
ran twice at once (started their work while another member of the same key was running, or ran
their work more than once).
Targets (threaded): makespan within 1.15x of the ideal, zero wasted executions, zero order
violations, zero double runs.
"""

from __future__ import annotations

import argparse
from typing import Any

from bench import harness as h

SIDES = ("lock + retry", "threaded", "no exclusion (reference)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--keys", type=int, default=None, help="keys (default 200)")
    p.add_argument("--members", type=int, default=None, help="members per key (default 20)")
    p.add_argument("--work-ms", type=float, default=20.0, help="work per member (ms)")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--no-reference", action="store_true", help="skip the no-exclusion reference run")


def _one(
    tasks: Any,
    client: Any,
    stack: Any,
    side: str,
    run: str,
    keys: int,
    members: int,
    seconds: float,
    processes: int,
) -> dict[str, float]:
    task = {
        "lock + retry": tasks.lock_work,
        "threaded": tasks.threaded_work,
        "no exclusion (reference)": tasks.free_work,
    }[side]
    total = keys * members
    published = tasks.recorder().now_us()
    for k in range(keys):
        key = f"k{k}"
        for i in range(members):
            task.apply_async((run, key, i, seconds))
    h.wait_until(
        lambda: int(client.get(f"{run}:done") or 0) >= total,
        300 + total * seconds * 10,
        f"{side}: {total} members",
        stack=stack,
    )
    last = int(client.get(f"{run}:last"))
    executions = int(client.get(f"{run}:executions") or 0)
    runs = [int(v) for v in client.hvals(f"{run}:runs")]
    overlaps = int(client.get(f"{run}:overlaps") or 0)
    out_of_order = 0
    for k in range(keys):
        order = [int(x) for x in client.lrange(f"{run}:order:k{k}", 0, -1)]
        if order != sorted(order):
            out_of_order += 1
    busy = int(client.get(f"{run}:busy") or 0) / 1e6
    makespan = (last - published) / 1e6
    return {
        "makespan": makespan,
        "outside": (makespan * processes - busy) / total * 1000,
        "work": busy / total * 1000,
        "executions": executions,
        "wasted": executions - sum(runs),
        "order": out_of_order,
        "double": overlaps + sum(1 for r in runs if r > 1),
        "twice": sum(1 for r in runs if r > 1),
        "members": len(runs),
    }


def run(args: argparse.Namespace) -> int:
    keys = args.keys or (8 if args.quick else 200)
    members = args.members or (5 if args.quick else 20)
    seconds = args.work_ms / 1000.0
    ideal = keys * members * seconds / args.concurrency
    sides = [s for s in SIDES if not (args.no_reference and s.startswith("no exclusion"))]
    from bench import tasks

    results: dict[str, list[dict[str, float]]] = {s: [] for s in sides}
    with h.Stack("lockretry") as stack:
        server = stack.redis()
        client = server.client()
        env = h.celery_env(server)
        tasks.configure(env)
        where = h.machine(server)
        stack.worker(env, concurrency=args.concurrency, ready_client=client)
        stack.beat(env, ready_client=client)
        for rep in range(args.repeats):
            order = sides if rep % 2 == 0 else list(reversed(sides))
            for side in order:
                h.progress(f"repeat {rep + 1}/{args.repeats} {side}: {keys} keys x {members}")
                run_key = f"bench:{stack.run_id}:{rep}:{side.split()[0]}"
                results[side].append(
                    _one(tasks, client, stack, side, run_key, keys, members, seconds, args.concurrency)
                )
        problems = stack.celery_problems()

    def med(side: str, what: str) -> float:
        return h.median(r[what] for r in results[side])

    rows = []
    for side in sides:
        makespan = med(side, "makespan")
        factor = makespan / ideal
        target = side == "threaded"
        ok = (
            (
                factor <= 1.15
                and med(side, "wasted") == 0
                and med(side, "order") == 0
                and med(side, "double") == 0
            )
            if target
            else None
        )
        rows.append(
            [
                side,
                makespan,
                factor,
                med(side, "work"),
                med(side, "outside"),
                int(med(side, "executions")),
                int(med(side, "wasted")),
                int(med(side, "order")),
                int(med(side, "double")),
                h.verdict(ok),
            ]
        )
    lock, threaded = med("lock + retry", "makespan"), med("threaded", "makespan")
    notes = [
        f"ideal = {keys} x {members} x {args.work_ms:g} ms / {args.concurrency} processes = "
        f"{ideal:.2f} s; figures are medians over {args.repeats} repeat(s); "
        f"threaded makespan = {h.ratio(threaded, lock):.2f}x that of lock + retry.",
        "wasted = executions that did no work (a retry burnt on a held lock); out of order = keys "
        "whose members started their work in another order than they were published; double runs "
        "= members that started their work while another member of their key was running, or "
        "ran it twice.",
        "work per member = its measured work span (the 20 ms sleep and the probe around it); "
        "process time outside the work = (makespan x processes - all work spans) / members: what "
        "each member costs a pool process besides its work, idle time included.",
        "target (threaded): makespan <= 1.15x ideal, 0 wasted, 0 out of order, 0 double runs.",
        "per repeat (makespan s): "
        + "; ".join(f"{s} " + ", ".join(f"{r['makespan']:.2f}" for r in results[s]) for s in sides)
        + ".",
    ]
    h.report(
        "lockretry (redis broker)",
        "lockretry",
        args.quick,
        where,
        f"{keys} keys x {members} members of {args.work_ms:g} ms, each key's members in a "
        f"burst; one prefork worker -c {args.concurrency} (prefetch 4), beat; "
        f"{args.repeats} repeat(s)",
        [
            "side",
            "makespan (s)",
            "x ideal",
            "work per member (ms)",
            "process time per member outside its work (ms)",
            "executions",
            "wasted",
            "out of order (keys)",
            "double runs",
            "verdict",
        ],
        rows,
        notes,
        problems,
    )
    return 0
