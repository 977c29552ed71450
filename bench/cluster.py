"""``python -m bench.cluster [--seconds S] [--processes N] [--shards N]``: gate-only member lives
per second and Redis time per life, on one Redis, on a one-node Redis Cluster and on a 3-master
Redis Cluster, in one run.

A life is one idle thread's member enqueued, claimed and finished (three gate calls), as a
producer and a worker make them, through :class:`celery_threads.gate.Gate`.  ``--processes``
client processes per topology each run lives on threads of their own for ``--seconds`` seconds,
the two topologies one after the other on the same machine.  One Redis: the gate's default
client (its direct line and the library's functions, ``FCALL``).  The cluster: the gate's cluster
client with ``threads_shards`` shards (its line to each master, ``FCALL``; redis-py's cluster
client for anything else).  Redis time is ``INFO commandstats`` (every command's ``usec``) of
each server, reset before the run; per master and in total, divided by the lives run.  The
one-node cluster (one cluster-enabled redis-server holding all 16,384 slots, driven by the same
cluster client) separates what cluster mode itself costs a server and a client from what three
masters sharing the machine's cores cost.
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


def cluster_node_args(binary: str, port: int, directory: str) -> list[str]:
    """The command line of one cluster-enabled redis-server on 127.0.0.1, without persistence."""
    return [
        binary,
        "--port",
        str(port),
        "--bind",
        "127.0.0.1",
        "--cluster-enabled",
        "yes",
        "--cluster-config-file",
        f"{directory}/nodes-{port}.conf",
        "--save",
        "",
        "--appendonly",
        "no",
        "--dir",
        directory,
    ]


def _start_node(stack: h.Stack) -> int:
    """One cluster-enabled redis-server on a free port, answering PING; its port."""
    port = cluster_port()
    argv = cluster_node_args(h.redis_binary() or "redis-server", port, stack.logdir)
    stack.procs.append(h.Proc(f"cluster-{port}", argv, logdir=stack.logdir).start())
    _wait(lambda: _pings(port), f"redis-server on {port}")
    return port


def _start_cluster(stack: h.Stack, masters: int = 3) -> list[int]:
    ports = [_start_node(stack) for _ in range(masters)]
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


def _start_one_node_cluster(stack: h.Stack) -> int:
    """A cluster of one master that holds every slot (``redis-cli --cluster create`` wants 3)."""
    port = _start_node(stack)
    redis.Redis(port=port).execute_command("CLUSTER", "ADDSLOTSRANGE", 0, 16383)
    _wait(lambda: redis.Redis(port=port).cluster("info")["cluster_state"] == "ok", "the one-node cluster")
    return port


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
    cpu0 = [_server_cpu(node) for node in nodes]
    t0 = time.perf_counter()
    start.set()
    done = [out.get(timeout=seconds + 120) for _ in procs]
    wall = time.perf_counter() - t0
    server_cpu = sum(_server_cpu(node) - c for node, c in zip(nodes, cpu0))
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
        "server_cpu": server_cpu / lives * 1e6,
        "cpu": cpu,
    }


def _server_cpu(node: Any) -> float:
    """The server's CPU seconds so far (``INFO cpu``, user + system)."""
    cpu = node.info("cpu")
    return float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"])


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
        one_port = _start_one_node_cluster(stack)
        ports = _start_cluster(stack)
        h.progress(f"one Redis: {args.processes} processes, {args.seconds:g} s")
        single = _run(server.url(), {}, 1, [server.port], args.processes, args.seconds)
        h.progress(f"one-node cluster: {args.processes} processes, {args.seconds:g} s")
        one = _run(
            f"redis://127.0.0.1:{one_port}/0",
            {"cluster": True},
            args.shards,
            [one_port],
            args.processes,
            args.seconds,
        )
        h.progress(f"cluster of 3 masters: {args.processes} processes, {args.seconds:g} s")
        cluster = _run(
            f"redis://127.0.0.1:{ports[0]}/0",
            {"cluster": True},
            args.shards,
            ports,
            args.processes,
            args.seconds,
        )

    sides = (single, one, cluster)

    def row(label: str, values: list[Any]) -> list[Any]:
        return [label, *values, h.ratio(values[1], values[0]), h.ratio(values[2], values[0])]

    rows: list[list[Any]] = [
        row("member lives per second (wall clock)", [x["rate"] for x in sides]),
        row("Redis time per life, all servers (µs, commandstats)", [x["per_life"] for x in sides]),
        row("Redis CPU per life, all servers (µs, INFO cpu)", [x["server_cpu"] for x in sides]),
    ]
    for i, usec in enumerate(cluster["usec"]):
        rows.append(
            [
                f"Redis time per life on master {i + 1} (µs; share)",
                single["per_life"] if i == 0 else "-",
                one["per_life"] if i == 0 else "-",
                f"{usec / cluster['lives']:.1f} ({usec / sum(cluster['usec']):.0%})",
                "-",
                "-",
            ]
        )
    rows.append(
        row(
            "client CPU per life (µs, the client processes' own)",
            [x["cpu"] / x["lives"] * 1e6 for x in sides],
        )
    )
    rows.append(["lives run", *[x["lives"] for x in sides], "-", "-"])
    print(
        h.table(
            "cluster (gate only)",
            [
                f"command: `python -m bench.cluster --seconds {args.seconds:g} --processes "
                f"{args.processes} --shards {args.shards}`",
                f"machine: {where}",
                f"load: {args.processes} client processes per topology, each running idle-thread lives "
                f"(enqueue, claim, finish) for {args.seconds:g} s; one Redis, then the one-node cluster, "
                "then the 3-master cluster",
            ],
            [
                "measure",
                "one Redis (direct line, FCALL)",
                "one-node cluster (cluster client, FCALL)",
                "3-master cluster (line per master, FCALL)",
                "ratio one-node",
                "ratio 3-master",
            ],
            rows,
            [
                "ratio = cluster / one Redis. The one-node cluster is one cluster-enabled redis-server "
                "holding every slot: what cluster mode itself costs, with nothing more sharing the cores. "
                "On a machine with fewer cores than masters plus clients, the 3-master cluster's wall-clock "
                "rate is bounded by the CPU, not by any one master: its Redis time per master is what one "
                "core per master would serve."
            ],
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
