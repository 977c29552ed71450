"""``python -m bench.callcost [--calls N] [--repeats N]``: what one gate call costs, as scripts
(``EVALSHA``) and as the library's functions (``FCALL``), in one run on a private redis-server.

Not one of the five benchmarks: a profiling aid behind the Redis rows of ``throughput``.  For each
transition on the hot path (enqueue to an idle thread, claim, finish), both ways alternating
between repeats: Redis's time per call, the inner commands included (``INFO commandstats``,
``usec`` / ``calls`` of ``evalsha`` or ``fcall``), and the client's CPU per call
(``time.process_time`` around the calls, through ``Gate`` as workers make them).  For reference,
a trivial script's round trip (``return 1``): the client's CPU and wall time per call.

Policies: the same lives with ``coalesce="latest"`` (the enqueue writes the thread's policy
hash; the finish that ends the thread gives it its expiry), an enqueue that supersedes a
waiting call, and lives with on_death="hold", a thread_rate_limit and max_waiting.
``--against REV`` measures the Lua of git revision REV beside this tree's, in the same run on the
same server, alternating: what a change costs the calls that do not use it.
"""

from __future__ import annotations

import argparse
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Callable, Optional

from bench import harness as h

ENVELOPE = b'{"headers":{"task":"bench.noop"}}\n' + b"x" * 900
STEPS = ("enqueue", "claim", "finish")
# The other policies' rows (this tree): a member's record policy (h: on_death="hold", r<ms>:
# thread_rate_limit's interval; celery_threads.policies.policy_text) and max_waiting.
POLICIES: dict[str, dict[str, Any]] = {
    "on_death=hold": {"policy": "h"},
    "thread_rate_limit": {"policy": "r100"},
    "max_waiting": {"max_waiting": 5},
}


def _one_way(
    gate: Any, client: Any, calls: int, tag: str, coalesce: Optional[str] = None, **policy: Any
) -> dict[str, tuple[float, float]]:
    """``{step: (Redis µs per call, client CPU µs per call)}`` for ``calls`` idle-thread lives
    (``coalesce``: the enqueues as calls of that task with ``coalesce="latest"``; ``policy``:
    the enqueue's other policy options, e.g. ``policy="h"``, ``max_waiting=5``)."""
    lives = [(f"{tag}-{i}", str(uuid.uuid4())) for i in range(calls)]
    tokens: dict[str, str] = {}
    out = {}
    options = {**policy, **({"coalesce": coalesce} if coalesce else {})}
    for step in STEPS:

        def call(thread: str, task: str, step: str = step) -> None:
            if step == "enqueue":
                tokens[task] = gate.enqueue(thread, task, ENVELOPE, **options).release.token
            elif step == "claim":
                gate.claim(thread, task, tokens[task], "callcost")
            else:
                gate.finish(thread, task, tokens[task])

        out[step] = _measured(client, lives, call)
    return out


def _superseding(gate: Any, client: Any, calls: int, tag: str) -> dict[str, tuple[float, float]]:
    """The enqueue that supersedes a waiting call (``coalesce="latest"``), in ``calls`` threads
    each holding an active member and one waiting call of the task."""
    threads = [f"{tag}-{i}" for i in range(calls)]
    for thread in threads:
        gate.enqueue(thread, str(uuid.uuid4()), ENVELOPE)
        gate.enqueue(thread, str(uuid.uuid4()), ENVELOPE, coalesce="bench.noop")
    lives = [(thread, str(uuid.uuid4())) for thread in threads]
    return {
        "superseding enqueue": _measured(
            client, lives, lambda thread, task: gate.enqueue(thread, task, ENVELOPE, coalesce="bench.noop")
        )
    }


def _measured(
    client: Any, lives: list[tuple[str, str]], call: Callable[[str, str], Any]
) -> tuple[float, float]:
    """(Redis µs, client CPU µs) per ``call(thread, task)`` over ``lives``."""
    client.config_resetstat()
    t0 = time.process_time()
    for thread, task in lives:
        call(thread, task)
    cpu = (time.process_time() - t0) / len(lives) * 1e6
    stats = client.info("commandstats")
    top = stats.get("cmdstat_fcall") or stats["cmdstat_evalsha"]
    return top["usec"] / top["calls"], cpu


@contextmanager
def _lua_of(rev: Optional[str]) -> Iterator[None]:
    """Gates made inside load the Lua of git revision ``rev`` (None: this tree's)."""
    h.use_lua_of(rev)
    try:
        yield
    finally:
        h.use_lua_of(None)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.callcost",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--calls", type=int, default=5000, help="lives per way and repeat (5,000)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--against",
        metavar="REV",
        default=None,
        help="also measure the Lua of git revision REV (the 'before' of a change), "
        "alternating with this tree's in the same run",
    )
    args = p.parse_args(argv)
    from celery_threads.gate import Gate, make_client
    from celery_threads.keys import Keys

    versions = [None, args.against] if args.against else [None]
    with h.Stack("callcost") as stack:
        server = stack.redis()
        client = server.client()
        where = h.machine(server)
        gates, policy_gates = {}, {}
        for rev in versions:
            with _lua_of(rev):
                for way in ("evalsha", "fcall"):
                    gates[(way, rev)] = Gate(
                        make_client(server.url()),
                        Keys(f"cc-{way}-{rev}"),
                        release_timeout_ms=60_000,
                        functions=way == "fcall",
                    )
        # The policies' lives in keys of their own: the superseding ones leave members behind,
        # which must not make the plain lives' hashes and indexes bigger for one version.
        for way in ("evalsha", "fcall"):
            policy_gates[way] = Gate(
                make_client(server.url()),
                Keys(f"cc-{way}-policies"),
                release_timeout_ms=60_000,
                functions=way == "fcall",
            )
        for (way, rev), gate in gates.items():  # warm up: lines open, scripts and library loaded
            _one_way(gate, client, 200, f"warm-{way}-{rev}")
        results: dict[tuple[str, Optional[str], str], list[tuple[float, float]]] = {}
        for rep in range(args.repeats):
            order = list(gates) if rep % 2 == 0 else list(reversed(gates))
            for way, rev in order:
                h.progress(f"repeat {rep + 1}/{args.repeats}: {way} {rev or 'this tree'}")
                measured = _one_way(gates[(way, rev)], client, args.calls, f"{way}-{rev}-{rep}")
                if rev is None:  # the policies' costs, this tree only
                    measured.update(
                        {
                            f"{step} (coalesce)": v
                            for step, v in _one_way(
                                policy_gates[way], client, args.calls, f"{way}-c-{rep}", coalesce="bench.noop"
                            ).items()
                        }
                    )
                    measured.update(_superseding(policy_gates[way], client, args.calls, f"{way}-s-{rep}"))
                    for label, options in POLICIES.items():
                        measured.update(
                            {
                                f"{step} ({label})": v
                                for step, v in _one_way(
                                    policy_gates[way], client, args.calls, f"{way}-{label}-{rep}", **options
                                ).items()
                            }
                        )
                for step, value in measured.items():
                    results.setdefault((way, rev, step), []).append(value)
        sha = client.script_load("return 1")
        trivial = []
        for _ in range(args.repeats):
            t0, w0 = time.process_time(), time.perf_counter()
            for _ in range(args.calls):
                client.evalsha(sha, 0)
            trivial.append(
                ((time.process_time() - t0) / args.calls * 1e6, (time.perf_counter() - w0) / args.calls * 1e6)
            )

    def median(way: str, rev: Optional[str], step: str, i: int) -> Any:
        values = results.get((way, rev, step))
        return h.median([v[i] for v in values]) if values else "-"

    rows = []
    steps = [
        *STEPS,
        *(f"{step} (coalesce)" for step in STEPS),
        "superseding enqueue",
        *(f"{step} ({label})" for label in POLICIES for step in STEPS),
    ]
    for step in steps:
        for i, what in (
            (0, "Redis time per call, inner commands included (µs)"),
            (1, "client CPU per call (µs)"),
        ):
            e, f = median("evalsha", None, step, i), median("fcall", None, step, i)
            before = (
                [median("evalsha", args.against, step, i), median("fcall", args.against, step, i)]
                if args.against
                else []
            )
            rows.append([f"{step}: {what}", *before, e, f, h.ratio(f, e) if "-" not in (e, f) else "-"])
    rows.append(
        [
            "trivial script round trip (redis-py client): client CPU / wall (µs)",
            *(["-", "-"] if args.against else []),
            f"{h.median([t[0] for t in trivial]):.1f} / {h.median([t[1] for t in trivial]):.1f}",
            "-",
            "-",
        ]
    )
    against = f" --against {args.against}" if args.against else ""
    before_columns = [f"EVALSHA ({args.against})", f"FCALL ({args.against})"] if args.against else []
    print(
        h.table(
            "callcost (gate only)",
            [
                f"command: `python -m bench.callcost --calls {args.calls} --repeats {args.repeats}{against}`",
                f"machine: {where}",
                f"load: {args.calls:,} idle-thread lives (enqueue, claim, finish) per way, version and "
                f"repeat, the same with coalesce='latest', on_death='hold', a rate of 10/s and max_waiting "
                f"5, and {args.calls:,} superseding enqueues (this tree); {args.repeats} repeat(s), the "
                "ways and versions alternating",
            ],
            ["measure", *before_columns, "EVALSHA (scripts)", "FCALL (functions)", "ratio"],
            rows,
            [f"medians over {args.repeats} repeat(s); ratio = FCALL / EVALSHA of this tree."],
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
