"""``python -m bench.poolcost [--broker amqp] [--members N]``: where a threaded task's extra CPU
goes, client side, in one process and the same run.

Not one of the five benchmarks: a profiling aid behind the CPU rows of ``throughput``.  With a
private redis-server (and RabbitMQ for ``--broker amqp``), it times with ``time.process_time``:

* a plain task's ``apply_async`` (what plain Celery's producer pays per task);
* a threaded task's ``apply_async`` over threads of 10 members (the gate's enqueue; a thread's
  head is also published), and to idle threads (each enqueued and published: what a producer
  pays when the workers keep up);
* the pool process's part of a threaded member: ``claim`` before the body, ``finish`` after it,
  and the publish of the release ``finish`` returns (nothing with a Redis broker on the gate's
  server: the gate pushes the release itself).

Redis's own CPU is not counted here (see ``throughput``'s redis-server row).
"""

from __future__ import annotations

import argparse
import time
import uuid
from typing import Any, Callable

from bench import harness as h


def _per_call(times: list[float]) -> str:
    return f"{h.median(times) * 1e6:,.0f}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.poolcost",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--broker", choices=("redis", "amqp"), default="redis")
    p.add_argument("--members", type=int, default=3000, help="calls of each kind (default 3,000)")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    if args.broker == "amqp" and not h.rabbitmq_available():
        raise SystemExit("RabbitMQ is not reachable on 127.0.0.1:5672")
    from bench import tasks
    from celery_threads.runtime import get_runtime

    n = args.members
    rows: dict[str, list[float]] = {}
    with h.Stack("poolcost") as stack:
        server = stack.redis()
        env = h.celery_env(server, broker=args.broker)
        app = tasks.configure(env)
        runtime = get_runtime(app)
        gate = runtime.gate
        envelope = h.captured_envelope(tasks.noop_threaded)
        try:
            for repeat in range(args.repeats):
                tag = f"r{repeat}-{uuid.uuid4().hex[:6]}"

                def timed(name: str, calls: Callable[[], Any]) -> None:
                    start = time.process_time()
                    calls()
                    rows.setdefault(name, []).append((time.process_time() - start) / n)

                timed(
                    "plain task: apply_async (producer)",
                    lambda tag=tag: [tasks.noop_plain.apply_async((f"{tag}-p{i}", "k", n)) for i in range(n)],
                )
                timed(
                    "threaded task: apply_async (producer; 10 members per thread)",
                    lambda tag=tag: [
                        tasks.noop_threaded.apply_async((f"{tag}-t{i % (n // 10 or 1)}", "k", n))
                        for i in range(n)
                    ],
                )
                timed(
                    "threaded task: apply_async (producer; each to an idle thread, so "
                    "enqueued and published)",
                    lambda tag=tag: [
                        tasks.noop_threaded.apply_async((f"{tag}-i{i}", "k", n)) for i in range(n)
                    ],
                )
                # The pool's part: two members per thread, the first released at enqueue.
                heads = []
                for i in range(n):
                    thread = f"{tag}-g{i}"
                    head = gate.enqueue(thread, uuid.uuid4().hex, envelope).release
                    assert head is not None, "a new thread's first member is released"
                    heads.append(head)
                    gate.enqueue(thread, uuid.uuid4().hex, envelope)
                runtime.publish(heads[0])  # the kept producer's first publish declares
                claim = finish = publish = 0.0
                for release in heads:
                    t0 = time.process_time()
                    gate.claim_with_time(release.thread_id, release.task_id, release.token, "w")
                    t1 = time.process_time()
                    outcome = gate.finish(release.thread_id, release.task_id, release.token)
                    t2 = time.process_time()
                    runtime.publish(outcome.release)
                    t3 = time.process_time()
                    claim, finish, publish = claim + t1 - t0, finish + t2 - t1, publish + t3 - t2
                for name, total in (
                    ("threaded member: claim (pool)", claim),
                    ("threaded member: finish (pool)", finish),
                    ("threaded member: publish of the next release (pool)", publish),
                ):
                    rows.setdefault(name, []).append(total / n)
        finally:
            if args.broker == "amqp":
                h.delete_amqp_queue(env["BENCH_BROKER_URL"], env["BENCH_QUEUE"])
        where = h.machine(server)
    print(f"### poolcost ({args.broker} broker)\n")
    options = (
        (" --broker amqp" if args.broker == "amqp" else "")
        + (f" --members {n}" if n != p.get_default("members") else "")
        + (f" --repeats {args.repeats}" if args.repeats != p.get_default("repeats") else "")
    )
    print(f"command: `python -m bench.poolcost{options}`  \nmachine: {where}  \n")
    width = max(len(k) for k in rows)
    print(f"| {'client CPU per call'.ljust(width)} | µs |")
    print(f"|{'-' * (width + 2)}|----|")
    for name, times in rows.items():
        print(f"| {name.ljust(width)} | {_per_call(times)} |")
    print(
        f"\n{n:,} calls of each kind per repeat, median over {args.repeats} repeat(s) of the "
        "mean (time.process_time of this one process; Redis's and the broker's CPU not "
        "included)."
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
