"""gatecpu: the gate's own cost per task, on one Redis and on a 3-master Redis Cluster, against plain
Celery's broker cost, in one run.

Every server is the run's own: the broker on one redis-server, the gate on another (one Redis) or on
a Redis Cluster of 3 masters (``threads_shards=6``), and a third redis-server for the benchmark's
probes (each task counts its completion there), so that a gate server's ``INFO cpu`` holds the
gate's work alone.  Each side starts a prefork ``celery worker -c 2`` (worker dispatch on, no beat),
warms it up, then the driver publishes ``--tasks`` no-op tasks (threaded ones spread over
``--threads`` threads; plain ones for the broker's own cost) while the worker runs them, and waits
for the last one.  Over that window:

* Redis CPU of the gate's servers (``used_cpu_sys`` + ``used_cpu_user`` of ``INFO cpu``), in
  total and per master, and of the broker's server;
* the worker's CPU (its main process and pool processes, /proc) and the producer's (the driver's
  own CPU while it publishes);
* ``INFO commandstats`` of the gate's servers: script calls (``FCALL``/``EVALSHA``) per task and
  Redis time per call, and every command's calls per task (those run inside scripts included).

Each side runs ``--repeats`` times (3), the sides' order alternating, and each figure is the
median over them.  The gate's CPU per task is split into its scripts' Redis time (commandstats) and
the rest: reading requests, writing replies and the kernel's part of each round trip.

The floor side (``round trips alone``) runs the same worker and producer with a plain task that
makes a threaded task's gate round trips to a function that does nothing
(:func:`bench.tasks.floor_call`): the gate's CPU per round trip that no script can save, and so the
floor of any transitions that make one Redis's script calls per task.

Round trips are counted in a second, shorter pass (a tenth of the tasks and threads) with every command logged
(``SLOWLOG`` at 0 µs, which costs the server time of its own: no CPU is measured in that pass); a
command a script ran is logged without a client address and is not a round trip.
Targets (issue 31): one Redis's gate CPU per task <= 120 µs; a 3-master cluster's busiest master
<= 1/2.5 of one Redis's; worker CPU per task on the cluster <= 1.2x one Redis's.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
import uuid
from collections import Counter
from typing import Any

import redis

from bench import harness as h
from bench.cluster import _start_cluster

SIDES = ("single", "cluster", "plain", "floor")
LABELS = {
    "single": "one Redis gate",
    "cluster": "3-master cluster gate (6 shards)",
    "plain": "plain Celery",
    "floor": "round trips alone",
}
OWN = ("CONFIG", "SLOWLOG", "INFO", "PING", "CLUSTER", "COMMAND", "CLIENT", "HELLO", "SELECT", "SCAN")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tasks", type=int, default=None, help="tasks per side (default 4,000)")
    p.add_argument("--threads", type=int, default=None, help="threads (default 400)")
    p.add_argument("--concurrency", type=int, default=2)
    p.add_argument(
        "--against",
        metavar="REV",
        default=None,
        help="also run the one-Redis side with the gate's Lua of git revision REV (the 'before' "
        "of a change; its producer and worker otherwise this tree's), alternating in the same run",
    )


def _label(side: str, args: argparse.Namespace) -> str:
    return f"one Redis gate, Lua of {args.against}" if side == "before" else LABELS[side]


def _redis_cpu(node: redis.Redis) -> float:
    info = node.info("cpu")
    return float(info["used_cpu_sys"]) + float(info["used_cpu_user"])


def _worker_cpu(worker: h.Proc) -> tuple[float, float]:
    """CPU seconds of the worker's main process and of its pool processes."""
    return h.cpu_seconds(worker.pid), sum(h.cpu_seconds(c) for c in h.children_of(worker.pid))


def _script_names() -> dict[str, str]:
    """A script's SHA1 or a library function's name -> the transition's name."""
    import hashlib

    from celery_threads.gate import SCRIPT_NAMES, function_library, script_sources

    sources = script_sources()
    names = {hashlib.sha1(sources[n].encode()).hexdigest(): n for n in SCRIPT_NAMES}
    names.update({f: n for n, f in function_library().functions.items()})
    return names


def _threads_per_master(ports: list[int], shards: int, names: list[str]) -> list[int]:
    """How many of ``names`` (thread ids) the master on each of ``ports`` holds."""
    from redis.crc import key_slot

    from celery_threads.keys import Keys

    owner = {}
    for start, end, master, *_ in redis.Redis(port=ports[0]).execute_command("CLUSTER", "SLOTS"):
        for slot in range(int(start), int(end) + 1):
            owner[slot] = int(master[1])
    keys = Keys("bench", shards)
    held = Counter(owner[key_slot(keys.thread(t).active.encode())] for t in names)
    return [held[p] for p in ports]


def _publish(task: Any, tag: str, n: int, threads: int, key: str) -> float:
    """Publish ``n`` tasks; the producer's CPU seconds for it.  A floor task's producer makes its
    enqueue's round trip first (``bench.tasks.floor_enqueue``)."""
    from bench.tasks import floor_enqueue, noop_floor

    cpu = time.process_time()
    for i in range(n):
        thread = f"{tag}-{i % threads}"
        if task is noop_floor:
            task_id = str(uuid.uuid4())
            floor_enqueue(thread, task_id)
            task.apply_async((thread, key, n), task_id=task_id)
        else:
            task.apply_async((thread, key, n))
    return time.process_time() - cpu


def _round_trips(nodes: list[redis.Redis], names: dict[str, str]) -> Counter[str]:
    """Commands clients sent to ``nodes`` since :func:`_log_all` (a script's own are left out),
    by name (a script call by its transition)."""
    found: Counter[str] = Counter()
    for node in nodes:
        node.config_set("slowlog-log-slower-than", 10_000)
        entries = node.slowlog_get(2_000_000)
        node.slowlog_reset()
        node.config_set("slowlog-max-len", 128)
        for e in entries:
            if e["client_address"] == b"?:0":
                continue
            words = e["command"].split()
            name = words[0].decode().upper()
            if name in OWN:
                continue
            if name in ("EVALSHA", "FCALL") and len(words) > 1:
                name = f"{name} {names.get(words[1].decode(), words[1].decode()[:8])}"
            found[name] += 1
    return found


_drains = itertools.count()


def _active_members(node: redis.Redis) -> bool:
    """Whether ``node`` holds a thread's active member (its ``...:a`` hash)."""
    return any(True for _ in node.scan_iter(match="*:a", count=1000, _type="HASH"))


def _log_all(nodes: list[redis.Redis]) -> None:
    for node in nodes:
        node.config_set("slowlog-max-len", 2_000_000)
        node.slowlog_reset()
        node.config_set("slowlog-log-slower-than", 0)


def _side(
    stack: h.Stack,
    side: str,
    args: argparse.Namespace,
    n: int,
    threads: int,
    broker: h.RedisServer,
    probe: h.RedisServer,
    gate_url: str,
    gate_nodes: list[redis.Redis],
) -> dict[str, Any]:
    from bench import tasks

    extra: dict[str, Any] = {"BENCH_PROBE_URL": probe.url()}
    if side == "before":
        extra["BENCH_LUA_REV"] = args.against
    if side == "cluster":
        extra.update(BENCH_SHARDS=6, BENCH_REDIS_OPTIONS=json.dumps({"cluster": True}))
    env = h.celery_env(broker, **extra)
    env["BENCH_REDIS_URL"] = gate_url
    tasks.configure(env)
    task = {"plain": tasks.noop_plain, "floor": tasks.noop_floor}.get(side, tasks.noop_threaded)
    rec = tasks.recorder()
    worker = stack.worker(
        env, name=f"worker-{side}", concurrency=args.concurrency, ready_client=probe.client()
    )
    timeout = 120 + n / 10
    try:

        def drain(tag: str, count: int, over: int = threads) -> float:
            # The count's key is this drain's own: a later repeat of the side starts from zero.
            key = f"bench:{stack.run_id}:{side}:{tag}:{next(_drains)}"
            cpu = _publish(task, f"{side}{tag}", count, over, key)
            h.wait_until(
                lambda: int(rec.client.get(key) or 0) >= count,
                timeout,
                f"{side}: {count} tasks ({tag})",
                stack=stack,
            )
            return cpu

        h.progress(f"{side}: warming up")
        drain("warm", min(n, threads))
        broker_node = broker.client()
        nodes = [*gate_nodes, broker_node]
        for node in nodes:
            node.config_resetstat()
        gate0 = [_redis_cpu(g) for g in gate_nodes]
        broker0, worker0 = _redis_cpu(broker_node), _worker_cpu(worker)
        h.progress(f"{side}: {n:,} tasks over {threads:,} threads")
        producer = drain("run", n)
        gate1 = [_redis_cpu(g) for g in gate_nodes]
        broker1, worker1 = _redis_cpu(broker_node), _worker_cpu(worker)
        stats = Counter[str]()
        usec = Counter[str]()
        for g in gate_nodes:
            for k, v in g.info("commandstats").items():
                name = k[len("cmdstat_") :]
                if name.split("|")[0] in ("config", "info", "slowlog"):
                    continue
                stats[name] += int(v["calls"])
                usec[name] += int(v["usec"])
        # as many members per thread as in the measured pass
        rt_threads = max(1, threads // 10)
        rt_n = max(rt_threads, n * rt_threads // threads)
        h.progress(f"{side}: counting round trips over {rt_n:,} tasks")
        _log_all(nodes)
        drain("trips", rt_n, rt_threads)
        # A task's body counts it done before its worker's finish reaches the gate: wait for the
        # last finishes (no active member left), or the count would miss them.
        h.wait_until(
            lambda: not any(_active_members(g) for g in gate_nodes),
            60,
            f"{side}: the gate's last finishes",
            stack=stack,
        )
        names = _script_names()
        gate_trips = _round_trips(gate_nodes, names)
        broker_trips = _round_trips([broker_node], names)
    finally:
        worker.stop()
        stack.procs.remove(worker)
    per_master = [(b - a) * 1e6 / n for a, b in zip(gate0, gate1)]
    scripts = stats["fcall"] + stats["evalsha"]
    return {
        "gate_us": sum(per_master),
        "masters_us": per_master,
        "broker_us": (broker1 - broker0) * 1e6 / n,
        "worker_us": (sum(worker1) - sum(worker0)) * 1e6 / n,
        "main_us": (worker1[0] - worker0[0]) * 1e6 / n,
        "pool_us": (worker1[1] - worker0[1]) * 1e6 / n,
        "producer_us": producer * 1e6 / n,
        "scripts": scripts / n,
        "script_us": (usec["fcall"] + usec["evalsha"]) / scripts if scripts else float("nan"),
        "commands": {k: (c / n, usec[k] / c) for k, c in stats.most_common() if c},
        "trips": sum(gate_trips.values()) / rt_n,
        "trips_by": {k: c / rt_n for k, c in gate_trips.most_common()},
        "broker_trips": sum(broker_trips.values()) / rt_n,
    }


def _median_side(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One side's figures over its repeats: the median of each number (of each master's, one by
    one); the breakdowns (commands, round trips by command) of the repeat whose gate CPU is the
    median's."""
    middle = sorted(runs, key=lambda r: r["gate_us"])[len(runs) // 2]
    out = dict(middle)
    for key, value in middle.items():
        if isinstance(value, (int, float)):
            out[key] = h.median([r[key] for r in runs])
        elif key == "masters_us":
            out[key] = [h.median([r[key][i] for r in runs]) for i in range(len(value))]
    return out


def run(args: argparse.Namespace) -> int:
    n = args.tasks or (200 if args.quick else 4_000)
    threads = args.threads or (20 if args.quick else 400)
    from bench import tasks

    sides = SIDES + (("before",) if args.against else ())
    runs: dict[str, list[dict[str, Any]]] = {side: [] for side in sides}
    with h.Stack("gatecpu") as stack:
        broker = stack.redis("broker")
        probe = stack.redis("probe")
        single = stack.redis("gate")
        where = h.machine(single)
        ports = _start_cluster(stack)
        gates = {
            "single": (single.url(), [single.client()]),
            "cluster": (f"redis://127.0.0.1:{ports[0]}/0", [redis.Redis(port=p) for p in ports]),
            "plain": (probe.url(), []),
            "floor": (single.url(), [single.client()]),
            "before": (single.url(), [single.client()]),
        }
        single.client().function_load(tasks.FLOOR_LIBRARY, replace=True)
        for rep in range(args.repeats):
            for side in sides if rep % 2 == 0 else sides[::-1]:
                if args.repeats > 1:
                    h.progress(f"repeat {rep + 1}/{args.repeats}")
                url, nodes = gates[side]
                runs[side].append(_side(stack, side, args, n, threads, broker, probe, url, nodes))
        problems = stack.celery_problems()
        spread = _threads_per_master(ports, 6, [f"clusterrun-{i}" for i in range(threads)])

    out = {side: _median_side(runs[side]) for side in sides}
    s, c, p, f = out["single"], out["cluster"], out["plain"], out["floor"]
    busiest = max(c["masters_us"])
    # The floor: what one Redis's script calls per task cost when each is a round trip alone.
    floor_call_us = f["gate_us"] / f["scripts"]
    floor_us = floor_call_us * s["scripts"]
    rows: list[list[Any]] = [
        [
            "gate Redis CPU per task, all servers (µs)",
            s["gate_us"],
            c["gate_us"],
            h.ratio(c["gate_us"], s["gate_us"]),
            "-",
            "one Redis <= 120",
            h.verdict(s["gate_us"] <= 120),
        ],
        [
            "busiest master's Redis CPU per task (µs; masters "
            + " / ".join(f"{m:.0f}" for m in c["masters_us"])
            + ")",
            s["gate_us"],
            busiest,
            h.ratio(busiest, s["gate_us"]),
            "-",
            "<= 0.40 (2.5x capacity)",
            h.verdict(busiest <= s["gate_us"] / 2.5),
        ],
        [
            "a master's Redis CPU per task were the threads spread evenly (all servers / 3, µs)",
            s["gate_us"],
            c["gate_us"] / 3,
            h.ratio(c["gate_us"] / 3, s["gate_us"]),
            "-",
            "-",
            "-",
        ],
        [
            "worker CPU per task (µs: main + pool processes)",
            s["worker_us"],
            c["worker_us"],
            h.ratio(c["worker_us"], s["worker_us"]),
            p["worker_us"],
            "cluster <= 1.2x",
            h.verdict(c["worker_us"] <= 1.2 * s["worker_us"]),
        ],
        [
            "producer CPU per task (µs: apply_async)",
            s["producer_us"],
            c["producer_us"],
            h.ratio(c["producer_us"], s["producer_us"]),
            p["producer_us"],
            "-",
            "-",
        ],
        [
            "broker Redis CPU per task (µs)",
            s["broker_us"],
            c["broker_us"],
            h.ratio(c["broker_us"], s["broker_us"]),
            p["broker_us"],
            "-",
            "-",
        ],
        [
            "gate script calls per task (FCALL/EVALSHA)",
            s["scripts"],
            c["scripts"],
            h.ratio(c["scripts"], s["scripts"]),
            "-",
            "-",
            "-",
        ],
        [
            "Redis time per script call (µs, commandstats)",
            s["script_us"],
            c["script_us"],
            h.ratio(c["script_us"], s["script_us"]),
            "-",
            "-",
            "-",
        ],
        [
            "gate round trips per task (commands sent)",
            s["trips"],
            c["trips"],
            h.ratio(c["trips"], s["trips"]),
            "-",
            "-",
            "-",
        ],
        [
            "gate Redis CPU per task inside its scripts (script calls x time per call, µs)",
            s["scripts"] * s["script_us"],
            c["scripts"] * c["script_us"],
            h.ratio(c["scripts"] * c["script_us"], s["scripts"] * s["script_us"]),
            "-",
            "-",
            "-",
        ],
        [
            "gate Redis CPU per task outside its scripts (reading, replying, the kernel; µs)",
            s["gate_us"] - s["scripts"] * s["script_us"],
            c["gate_us"] - c["scripts"] * c["script_us"],
            h.ratio(
                c["gate_us"] - c["scripts"] * c["script_us"], s["gate_us"] - s["scripts"] * s["script_us"]
            ),
            "-",
            "-",
            "-",
        ],
        [
            "floor: Redis CPU per round trip alone (a call of a function that does nothing, with "
            "a transition's keys and arguments; µs)",
            floor_call_us,
            "-",
            "-",
            "-",
            "-",
            "-",
        ],
        [
            "floor: one Redis's script calls per task as round trips alone (µs)",
            floor_us,
            "-",
            "-",
            "-",
            "-",
            "-",
        ],
        [
            "one Redis's gate CPU per task above the floor: the transitions' own work (µs)",
            s["gate_us"] - floor_us,
            "-",
            "-",
            "-",
            "-",
            "-",
        ],
        [
            "broker round trips per task",
            s["broker_trips"],
            c["broker_trips"],
            h.ratio(c["broker_trips"], s["broker_trips"]),
            p["broker_trips"],
            "-",
            "-",
        ],
    ]

    def breakdown(side: dict[str, Any]) -> str:
        return ", ".join(
            f"{k} {calls:.2f} x {us:.1f} µs" for k, (calls, us) in list(side["commands"].items())[:14]
        )

    notes = [
        "worker CPU per task, main process / pool processes (µs): "
        + "; ".join(f"{_label(k, args)} {out[k]['main_us']:.0f} / {out[k]['pool_us']:.0f}" for k in sides)
        + ".",
        f"medians over {args.repeats} repeat(s), the sides' order alternating; the breakdowns "
        "below are of the repeat with the median gate CPU.  Inside the scripts: their Redis time "
        "(commandstats, wall time, so an upper bound of their CPU on a busy machine); outside: "
        "the rest of the servers' CPU, what their round trips cost.",
        "ratio = cluster / one Redis.  CPU per task: the servers' INFO cpu (user + system) and "
        "the processes' /proc times over the publish-and-run window of each side, divided by the "
        "tasks run; plain Celery's column is the same worker and producer without the gate.",
        "gate round trips per task by command, one Redis: "
        + ", ".join(f"{k} {v:.2f}" for k, v in s["trips_by"].items())
        + "; cluster: "
        + ", ".join(f"{k} {v:.2f}" for k, v in c["trips_by"].items())
        + ".",
        "gate commandstats per task (calls x µs per call, a script's inner commands included), "
        "one Redis: " + breakdown(s) + ".",
        "cluster: " + breakdown(c) + ".",
        "the cluster's shards: 2 per master; the run's threads per master (their ids' crc32 "
        "modulo 6 shards): " + " / ".join(str(x) for x in spread) + ".",
        "the gate's servers are not the broker's: releases are published through kombu (no "
        "direct release), on both gates; worker dispatch loops included.",
        "round trips alone (the floor): the same producer and worker run a plain task that makes a "
        "threaded task's gate round trips (its enqueue's from the producer, its claim's and "
        "finish's from its body), each an FCALL of a function that does nothing, with a "
        "transition's 12 keys and arguments (the enqueue's with a message of 950 bytes), on the "
        f"one-Redis gate's server: {f['scripts']:.2f} calls per task cost it {f['gate_us']:.0f} µs. "
        "Its broker work is plain Celery's.  Any transitions making the same round trips cost at "
        "least the floor, whatever their scripts do.",
    ]
    if args.against:
        b = out["before"]
        notes.append(
            f"the before of a change: the one-Redis side with the gate's Lua of {args.against} "
            "(its producer and worker this tree's), in the same run: gate Redis CPU per task "
            f"{b['gate_us']:.0f} µs against this tree's {s['gate_us']:.0f} "
            f"({h.ratio(s['gate_us'], b['gate_us']):.2f}x); inside its scripts "
            f"{b['scripts'] * b['script_us']:.0f} µs against {s['scripts'] * s['script_us']:.0f} "
            f"({b['scripts']:.2f} and {s['scripts']:.2f} script calls per task, "
            f"{b['script_us']:.1f} and {s['script_us']:.1f} µs per call); worker CPU per task "
            f"{b['worker_us']:.0f} against {s['worker_us']:.0f} µs.  Its commandstats per task: "
            + breakdown(b)
            + "."
        )
    h.report(
        "gatecpu (gate cost per task)",
        "gatecpu",
        args.quick,
        where,
        f"{n:,} no-op tasks per side, threaded ones over {threads:,} threads; one prefork "
        f"worker -c {args.concurrency} per side (prefetch 4), broker on its own Redis; "
        f"{args.repeats} repeat(s)",
        ["measure", LABELS["single"], LABELS["cluster"], "ratio", LABELS["plain"], "target", "verdict"],
        rows,
        notes,
        problems,
        options=f" --against {args.against}" if args.against else "",
    )
    return 0
