"""``python -m bench.callcost [--calls N] [--repeats N]``: what one gate call costs, as scripts
(``EVALSHA``) and as the library's functions (``FCALL``), in one run on a private redis-server.

Not one of the five benchmarks: a profiling aid behind the Redis rows of ``throughput``.  For each
transition on the hot path (enqueue to an idle thread, claim, finish), both ways alternating
between repeats: Redis's time per call, the inner commands included (``INFO commandstats``,
``usec`` / ``calls`` of ``evalsha`` or ``fcall``), and the client's CPU per call
(``time.process_time`` around the calls, through ``Gate`` as workers make them).  For reference,
a trivial script's round trip (``return 1``): the client's CPU and wall time per call.

``--against REV``: the cost of a change instead.  The same lives through this checkout's gate and
through the gate of commit ``REV`` (checked out into a temporary worktree), each in a process of
its own importing its own tree, the two alternating between repeats on one private redis-server
(their function libraries coexist: each is named by a digest of its source).  FCALL only, the way
workers call on Redis 7.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from bench import harness as h

ENVELOPE = b'{"headers":{"task":"bench.noop"}}\n' + b"x" * 900
STEPS = ("enqueue", "claim", "finish")


def _one_way(gate: Any, client: Any, calls: int, tag: str) -> dict[str, tuple[float, float]]:
    """``{step: (Redis µs per call, client CPU µs per call)}`` for ``calls`` idle-thread lives."""
    lives = [(f"{tag}-{i}", str(uuid.uuid4())) for i in range(calls)]
    tokens: dict[str, str] = {}
    out = {}
    for step in STEPS:
        client.config_resetstat()
        t0 = time.process_time()
        for thread, task in lives:
            if step == "enqueue":
                tokens[task] = gate.enqueue(thread, task, ENVELOPE).release.token
            elif step == "claim":
                gate.claim(thread, task, tokens[task], 30_000, "callcost")
            else:
                gate.finish(thread, task, tokens[task])
        cpu = (time.process_time() - t0) / calls * 1e6
        stats = client.info("commandstats")
        top = stats.get("cmdstat_fcall") or stats["cmdstat_evalsha"]
        out[step] = (top["usec"] / top["calls"], cpu)
    return out


def _probe(url: str, calls: int, tag: str) -> int:
    """One side of ``--against``: the gate of the tree on ``PYTHONPATH`` (FCALL), ``calls`` lives,
    as JSON.  This file runs as a script there, so that an older tree needs no probe of its own."""
    import redis

    from celery_threads.gate import Gate, make_client
    from celery_threads.keys import Keys
    client = redis.Redis.from_url(url)
    gate = Gate(make_client(url), Keys(f"cc-{tag}"), release_timeout_ms=60_000, functions=True)
    _one_way(gate, client, 200, f"warm-{tag}")
    print(json.dumps(_one_way(gate, client, calls, tag)))
    return 0


def _against(rev: str, calls: int, repeats: int) -> int:
    """This checkout against commit ``rev``, alternating, on one redis-server."""
    here = h.ROOT
    with tempfile.TemporaryDirectory(prefix="callcost-") as tmp, h.Stack("callcost") as stack:
        tree = Path(tmp) / "before"
        subprocess.run(["git", "-C", str(here), "worktree", "add", "-q", "--detach", str(tree), rev],
                       check=True)
        try:
            server = stack.redis()
            where = h.machine(server)
            sides = {"before": tree, "after": here}
            results: dict[tuple[str, str], list[tuple[float, float]]] = {}
            for rep in range(repeats):
                order = list(sides) if rep % 2 == 0 else list(reversed(sides))
                for side in order:
                    h.progress(f"repeat {rep + 1}/{repeats}: {side}")
                    out = subprocess.run(
                        [sys.executable, __file__, "--probe", server.url(),
                         "--calls", str(calls), "--tag", f"{side}-{rep}"],
                        cwd=sides[side], env={**os.environ, "PYTHONPATH": str(sides[side])},
                        check=True, capture_output=True, text=True).stdout
                    for step, value in json.loads(out.strip().splitlines()[-1]).items():
                        results.setdefault((side, step), []).append(tuple(value))
        finally:
            subprocess.run(["git", "-C", str(here), "worktree", "remove", "--force", str(tree)],
                           check=False)
    head = subprocess.run(["git", "-C", str(here), "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True).stdout.strip()
    rows = []
    for step in STEPS:
        for i, what in ((0, "Redis time per call, inner commands included (µs)"),
                        (1, "client CPU per call (µs)")):
            b, a = (h.median([v[i] for v in results[(side, step)]]) for side in ("before", "after"))
            rows.append([f"{step}: {what}", b, a, h.ratio(a, b)])
    print(h.table("callcost: a change's cost per gate call (FCALL)", [
        f"command: `python -m bench.callcost --against {rev} --calls {calls} --repeats {repeats}`",
        f"machine: {where}",
        f"before: {rev}; after: this checkout ({head}, with its uncommitted changes)",
        f"load: {calls:,} idle-thread lives (enqueue, claim, finish) per side and repeat; "
        f"{repeats} repeat(s), the sides alternating"],
        ["measure", "before", "after", "ratio"], rows,
        [f"medians over {repeats} repeat(s); ratio = after / before."]))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.callcost", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=5000, help="lives per way and repeat (5,000)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--against", metavar="REV",
                   help="compare this checkout with commit REV (FCALL) instead of the two ways")
    p.add_argument("--probe", help=argparse.SUPPRESS)
    p.add_argument("--tag", default="probe", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.probe:
        return _probe(args.probe, args.calls, args.tag)
    if args.against:
        return _against(args.against, args.calls, args.repeats)
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
                                            f"{way}-{rep}").items():
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
        f"command: `python -m bench.callcost --calls {args.calls} --repeats {args.repeats}`",
        f"machine: {where}",
        f"load: {args.calls:,} idle-thread lives (enqueue, claim, finish) per way and repeat; "
        f"{args.repeats} repeat(s), the two ways alternating"],
        ["measure", "EVALSHA (scripts)", "FCALL (functions)", "ratio"], rows,
        [f"medians over {args.repeats} repeat(s); ratio = FCALL / EVALSHA."]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
