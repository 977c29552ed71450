"""``python -m bench.durability [--calls N] [--repeats N]``: what durability costs a gate transition.

Not one of the five benchmarks: the figures behind docs/durability.md.  Private redis-servers on
this machine, one per setting: no persistence; ``appendonly yes`` with ``appendfsync everysec``;
with ``appendfsync always``; a master (``everysec``) with one replica, without and with
``threads_wait_replicas=1`` (``WAIT 1`` after each transition, on the same connection).  For each,
``--calls`` idle-thread lives (enqueue, claim, finish) through ``Gate`` as workers make them, one
caller: the wall time per transition (what the caller waits) and Redis's time per call
(``INFO commandstats`` of ``fcall``; WAIT's own entry apart).  The settings take turns in each
repeat, in a rotating order; medians over the repeats.
"""

from __future__ import annotations

import argparse
import time
import uuid
from typing import Any

import redis

from bench import harness as h

ENVELOPE = b'{"headers":{"task":"bench.noop"}}\n' + b"x" * 900
SETTINGS = (
    "no persistence",
    "appendfsync everysec",
    "appendfsync always",
    "replica, threads_wait_replicas=0",
    "replica, threads_wait_replicas=1",
)


def _server(stack: Any, name: str, *args: str) -> h.RedisServer:
    server = h.RedisServer(name, logdir=stack.logdir)
    server.cmd += ["--repl-diskless-sync-delay", "0", *args]
    stack.procs.append(server)
    return server.start()


def _lives(gate: Any, client: redis.Redis, calls: int, tag: str) -> tuple[float, float, float]:
    """Wall µs per transition, Redis µs per script call, Redis µs per WAIT."""
    client.config_resetstat()
    started = time.perf_counter()
    for i in range(calls):
        thread, task = f"{tag}-{i}", str(uuid.uuid4())
        release = gate.enqueue(thread, task, ENVELOPE).release
        gate.claim(thread, task, release.token, "bench", task)
        gate.finish(thread, task, release.token, caller=task)  # the claim's own ending
    wall = (time.perf_counter() - started) / (3 * calls) * 1e6
    stats = client.info("commandstats")
    top = stats.get("cmdstat_fcall") or stats["cmdstat_evalsha"]
    wait = stats.get("cmdstat_wait")
    return wall, top["usec"] / top["calls"], wait["usec"] / wait["calls"] if wait else 0.0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.durability",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--calls", type=int, default=2000, help="lives per setting and repeat (2,000)")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    from celery_threads.gate import Gate, make_client
    from celery_threads.keys import Keys

    with h.Stack("durability") as stack:
        plain = _server(stack, "plain")
        everysec = _server(stack, "everysec", "--appendonly", "yes", "--appendfsync", "everysec")
        always = _server(stack, "always", "--appendonly", "yes", "--appendfsync", "always")
        master = _server(stack, "master", "--appendonly", "yes", "--appendfsync", "everysec")
        replica = _server(stack, "replica", "--replicaof", "127.0.0.1", str(master.port))
        for _ in range(500):
            if master.client().info("replication").get("connected_slaves") == 1:
                break
            time.sleep(0.02)
        else:
            raise SystemExit(f"the replica did not connect:\n{replica.output()}")
        servers = dict(zip(SETTINGS, (plain, everysec, always, master, master)))
        gates = {
            name: Gate(
                make_client(server.url()),
                Keys(f"dur-{i}"),
                release_timeout_ms=60_000,
                wait_replicas=1 if i == 4 else 0,
            )
            for i, (name, server) in enumerate(servers.items())
        }
        for name, gate in gates.items():  # lines open, library loaded
            _lives(gate, servers[name].client(), 100, f"warm-{name}")
        results: dict[str, list[tuple[float, float, float]]] = {name: [] for name in SETTINGS}
        for rep in range(args.repeats):
            order = SETTINGS[rep % len(SETTINGS) :] + SETTINGS[: rep % len(SETTINGS)]
            for name in order:
                h.progress(f"repeat {rep + 1}/{args.repeats}: {name}")
                results[name].append(_lives(gates[name], servers[name].client(), args.calls, f"{rep}-{name}"))
        where = h.machine(plain)

    base = h.median(r[0] for r in results[SETTINGS[0]])
    rows = []
    for name in SETTINGS:
        wall = h.median(r[0] for r in results[name])
        rows.append(
            [
                name,
                wall,
                wall - base,
                h.median(r[1] for r in results[name]),
                h.median(r[2] for r in results[name]) or "-",
            ]
        )
    print(
        h.table(
            "durability (gate only, one caller)",
            [
                f"command: `python -m bench.durability --calls {args.calls} --repeats {args.repeats}`",
                f"machine: {where}",
                f"load: {args.calls:,} idle-thread lives (enqueue, claim, finish) per setting and repeat; "
                f"{args.repeats} repeat(s), the settings in rotating order",
            ],
            [
                "setting",
                "wall per transition (µs)",
                "added (µs)",
                "Redis per call (µs)",
                "Redis per WAIT (µs)",
            ],
            rows,
            [f"medians over {args.repeats} repeat(s); added = against no persistence, same run."],
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
