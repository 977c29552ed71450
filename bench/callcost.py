"""``python -m bench.callcost [--calls N] [--repeats N] [--policy P] [--max-waiting N]``: what one
gate call costs, as scripts
(``EVALSHA``) and as the library's functions (``FCALL``), in one run on a private redis-server.

Not one of the five benchmarks: a profiling aid behind the Redis rows of ``throughput``.  For each
transition on the hot path (enqueue to an idle thread, claim, finish), both ways alternating
between repeats: Redis's time per call, the inner commands included (``INFO commandstats``,
``usec`` / ``calls`` of ``evalsha`` or ``fcall``), and the client's CPU per call
(``time.process_time`` around the calls, through ``Gate`` as workers make them).  For reference,
a trivial script's round trip (``return 1``): the client's CPU and wall time per call.
``--policy`` (a member's policies as its record keeps them: ``h`` on_death="hold", ``r<ms>``
thread_rate_limit's interval; see ``celery_threads.policies.policy_text``) and ``--max-waiting``
give every enqueued member those policies, to measure what they cost.
"""
from __future__ import annotations

import argparse
import time
import uuid
from typing import Any

from bench import harness as h

ENVELOPE = b'{"headers":{"task":"bench.noop"}}\n' + b"x" * 900
STEPS = ("enqueue", "claim", "finish")


def _one_way(gate: Any, client: Any, calls: int, tag: str,
             **policy: Any) -> dict[str, tuple[float, float]]:
    """``{step: (Redis µs per call, client CPU µs per call)}`` for ``calls`` idle-thread lives;
    ``policy``: the enqueue's policy options."""
    lives = [(f"{tag}-{i}", str(uuid.uuid4())) for i in range(calls)]
    tokens: dict[str, str] = {}
    out = {}
    for step in STEPS:
        client.config_resetstat()
        t0 = time.process_time()
        for thread, task in lives:
            if step == "enqueue":
                tokens[task] = gate.enqueue(thread, task, ENVELOPE, **policy).release.token
            elif step == "claim":
                gate.claim(thread, task, tokens[task], 30_000, "callcost")
            else:
                gate.finish(thread, task, tokens[task])
        cpu = (time.process_time() - t0) / calls * 1e6
        stats = client.info("commandstats")
        top = stats.get("cmdstat_fcall") or stats["cmdstat_evalsha"]
        out[step] = (top["usec"] / top["calls"], cpu)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.callcost", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=5000, help="lives per way and repeat (5,000)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--policy", default="", help="each member's policies (e.g. h, r100, hr100)")
    p.add_argument("--max-waiting", type=int, default=None, help="each enqueue's max_waiting")
    args = p.parse_args(argv)
    policy: dict[str, Any] = {}
    if args.policy:
        policy["policy"] = args.policy
    if args.max_waiting is not None:
        policy["max_waiting"] = args.max_waiting
    from celery_threads.gate import Gate, make_client
    from celery_threads.keys import Keys

    with h.Stack("callcost") as stack:
        server = stack.redis()
        client = server.client()
        where = h.machine(server)
        gates = {way: Gate(make_client(server.url()), Keys(f"cc-{way}"), release_timeout_ms=60_000,
                           functions=way == "fcall") for way in ("evalsha", "fcall")}
        for way, gate in gates.items():      # warm up: lines open, scripts and library loaded
            _one_way(gate, client, 200, f"warm-{way}")
        results: dict[tuple[str, str], list[tuple[float, float]]] = {}
        for rep in range(args.repeats):
            ways = list(gates) if rep % 2 == 0 else list(reversed(gates))
            for way in ways:
                h.progress(f"repeat {rep + 1}/{args.repeats}: {way}")
                for step, value in _one_way(gates[way], client, args.calls,
                                            f"{way}-{rep}", **policy).items():
                    results.setdefault((way, step), []).append(value)
        sha = client.script_load("return 1")
        trivial = []
        for _ in range(args.repeats):
            t0, w0 = time.process_time(), time.perf_counter()
            for _ in range(args.calls):
                client.evalsha(sha, 0)
            trivial.append(((time.process_time() - t0) / args.calls * 1e6,
                            (time.perf_counter() - w0) / args.calls * 1e6))

    rows = []
    for step in STEPS:
        for i, what in ((0, "Redis time per call, inner commands included (µs)"),
                        (1, "client CPU per call (µs)")):
            e, f = (h.median([v[i] for v in results[(way, step)]]) for way in ("evalsha", "fcall"))
            rows.append([f"{step}: {what}", e, f, h.ratio(f, e)])
    rows.append(["trivial script round trip (redis-py client): client CPU / wall (µs)",
                 f"{h.median([t[0] for t in trivial]):.1f} / {h.median([t[1] for t in trivial]):.1f}",
                 "-", "-"])
    print(h.table("callcost (gate only)", [
        f"command: `python -m bench.callcost --calls {args.calls} --repeats {args.repeats}"
        + (f" --policy {args.policy}" if args.policy else "")
        + (f" --max-waiting {args.max_waiting}" if args.max_waiting is not None else "") + "`",
        f"machine: {where}",
        f"load: {args.calls:,} idle-thread lives (enqueue, claim, finish) per way and repeat; "
        f"{args.repeats} repeat(s), the two ways alternating"],
        ["measure", "EVALSHA (scripts)", "FCALL (functions)", "ratio"], rows,
        [f"medians over {args.repeats} repeat(s); ratio = FCALL / EVALSHA."]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
