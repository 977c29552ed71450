"""``python -m bench.cluster [--seconds S] [--processes N] [--shards N]``: gate-only member lives
per second and Redis time per life, on one Redis and on a 3-master Redis Cluster, in one run.

A life is one idle thread's member enqueued, claimed and finished (three gate calls), as a
producer and a worker make them, through :class:`celery_threads.gate.Gate`.  ``--processes``
client processes per topology each run lives on threads of their own for ``--seconds`` seconds,
the two topologies one after the other on the same machine.  One Redis: the gate's default
client (its direct line and the library's functions, ``FCALL``).  The cluster: the gate's cluster
client with ``threads_shards`` shards (its line to each master, ``FCALL``; redis-py's cluster
client for anything else).  Redis time is ``INFO commandstats`` (every command's ``usec``) of
each server, reset before the run; per master and in total, divided by the lives run.
"""

from __future__ import annotations

import argparse
import multiprocessing
import random
import shutil
import socket
import subprocess
import time
import uuid
from typing import Any

import redis

from bench import harness as h

REDIS_CLI = shutil.which("redis-cli", path="/usr/bin:/usr/local/bin") or "redis-cli"
ENVELOPE = b'{"headers":{"task":"bench.noop"}}\n' + b"x" * 900


def cluster_port() -> int:
    """A free port whose cluster bus port (+10000) is free too (the suite's clusters use it)."""
    while True:
        port = random.randrange(20000, 30000)
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 10000))
            return port
        except OSError:
            continue


def _start_cluster(stack: h.Stack, masters: int = 3) -> list[int]:
    binary = h.redis_binary() or "redis-server"
    ports = [cluster_port() for _ in range(masters)]
    for port in ports:
        stack.procs.append(
            h.Proc(
                f"cluster-{port}",
                [
                    binary,
                    "--port",
                    str(port),
                    "--bind",
                    "127.0.0.1",
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    f"{stack.logdir}/nodes-{port}.conf",
                    "--save",
                    "",
                    "--appendonly",
                    "no",
                    "--dir",
                    stack.logdir,
                ],
                logdir=stack.logdir,
            ).start()
        )
    for port in ports:
        _wait(lambda port=port: _pings(port), f"redis-server on {port}")
    subprocess.run(
        [
            REDIS_CLI,
            "--cluster",
            "create",
            *[f"127.0.0.1:{p}" for p in ports],
            "--cluster-replicas",
            "0",
            "--cluster-yes",
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    _wait(
        lambda: all(redis.Redis(port=p).cluster("info")["cluster_state"] == "ok" for p in ports),
        "the cluster",
    )
    return ports


def _pings(port: int) -> bool:
    try:
        return bool(redis.Redis(port=port).ping())
    except redis.ConnectionError:
        return False


def _wait(condition: Any, what: str, timeout: float = 60.0) -> None:
    end = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > end:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.05)


def _lives(
    url: str, options: dict[str, Any], shards: int, seconds: float, ready: Any, start: Any, out: Any
) -> None:
    """One client process: lives on its own threads until ``seconds`` after ``start`` is set."""
    from celery_threads.gate import Gate, make_client
    from celery_threads.keys import Keys

    gate = Gate(make_client(url, options), Keys("bench-cluster", shards), release_timeout_ms=60_000)
    me = uuid.uuid4().hex[:8]
    gate.enqueue(f"{me}-warm", str(uuid.uuid4()), ENVELOPE)  # connections open, scripts loaded
    ready.put(me)
    start.wait()
    end, n, cpu = time.monotonic() + seconds, 0, time.process_time()
    while time.monotonic() < end:
        thread, task = f"{me}-{n}", str(uuid.uuid4())
        release = gate.enqueue(thread, task, ENVELOPE).release
        assert release is not None
        gate.claim(thread, task, release.token, "bench", "c")
        gate.finish(thread, task, release.token)
        n += 1
    out.put((n, time.process_time() - cpu))


def _run(
    url: str, options: dict[str, Any], shards: int, ports: list[int], processes: int, seconds: float
) -> dict[str, Any]:
    ctx = multiprocessing.get_context("fork")
    ready, start, out = ctx.Queue(), ctx.Event(), ctx.Queue()
    procs = [
        ctx.Process(target=_lives, args=(url, options, shards, seconds, ready, start, out))
        for _ in range(processes)
    ]
    for proc in procs:
        proc.start()
    for _ in procs:  # every process connected and warmed up before the clock starts
        ready.get(timeout=120)
    nodes = [redis.Redis(port=p) for p in ports]
    for node in nodes:
        node.config_resetstat()
    t0 = time.perf_counter()
    start.set()
    done = [out.get(timeout=seconds + 120) for _ in procs]
    wall = time.perf_counter() - t0
    lives, cpu = sum(n for n, _ in done), sum(c for _, c in done)
    for proc in procs:
        proc.join(30)
    usec = [
        sum(v["usec"] for k, v in node.info("commandstats").items() if k.startswith("cmdstat_"))
        for node in nodes
    ]
    return {
        "lives": lives,
        "wall": wall,
        "rate": lives / wall,
        "usec": usec,
        "per_life": sum(usec) / lives,
        "cpu": cpu,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.cluster",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--seconds", type=float, default=10.0, help="run time per topology (10)")
    p.add_argument("--processes", type=int, default=6, help="client processes per topology (6)")
    p.add_argument("--shards", type=int, default=3, help="threads_shards on the cluster (3)")
    args = p.parse_args(argv)

    with h.Stack("cluster") as stack:
        server = stack.redis()
        where = h.machine(server)
        ports = _start_cluster(stack)
        h.progress(f"one Redis: {args.processes} processes, {args.seconds:g} s")
        single = _run(server.url(), {}, 1, [server.port], args.processes, args.seconds)
        h.progress(f"cluster of 3 masters: {args.processes} processes, {args.seconds:g} s")
        cluster = _run(
            f"redis://127.0.0.1:{ports[0]}/0",
            {"cluster": True},
            args.shards,
            ports,
            args.processes,
            args.seconds,
        )

    rows: list[list[Any]] = [
        [
            "member lives per second (wall clock)",
            single["rate"],
            cluster["rate"],
            h.ratio(cluster["rate"], single["rate"]),
        ],
        [
            "Redis time per life, all servers (µs)",
            single["per_life"],
            cluster["per_life"],
            h.ratio(cluster["per_life"], single["per_life"]),
        ],
    ]
    for i, usec in enumerate(cluster["usec"]):
        rows.append(
            [
                f"Redis time per life on master {i + 1} (µs; share)",
                single["per_life"] if i == 0 else "-",
                f"{usec / cluster['lives']:.1f} ({usec / sum(cluster['usec']):.0%})",
                "-",
            ]
        )
    cpu = [x["cpu"] / x["lives"] * 1e6 for x in (single, cluster)]
    rows.append(
        ["client CPU per life (µs, the client processes' own)", cpu[0], cpu[1], h.ratio(cpu[1], cpu[0])]
    )
    rows.append(["lives run", single["lives"], cluster["lives"], "-"])
    print(
        h.table(
            "cluster (gate only)",
            [
                f"command: `python -m bench.cluster --seconds {args.seconds:g} --processes "
                f"{args.processes} --shards {args.shards}`",
                f"machine: {where}",
                f"load: {args.processes} client processes per topology, each running idle-thread lives "
                f"(enqueue, claim, finish) for {args.seconds:g} s; one Redis first, then the cluster",
            ],
            [
                "measure",
                "one Redis (direct line, FCALL)",
                "3-master cluster (line per master, FCALL)",
                "ratio",
            ],
            rows,
            [
                "ratio = cluster / one Redis. On a machine with fewer cores than masters plus clients, "
                "the cluster's wall-clock rate is bounded by the CPU, not by any one master: its "
                "Redis time per master is what one core per master would serve."
            ],
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
