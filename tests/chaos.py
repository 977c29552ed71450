"""Chaos run: a realistic deployment on this machine under faults, then the history checker.

    python -m tests.chaos --minutes 5                  # Redis broker
    python -m tests.chaos --minutes 2 --broker amqp    # RabbitMQ on 127.0.0.1:5672 (guest/guest)
    python -m tests.chaos --minutes 2 --no-ack         # the queue without broker acknowledgements

What runs: a redis-server with append-only persistence holding the gate (and, with the Redis broker,
the broker in database 1), restarted during the run; a second redis-server, never restarted, holding
the history (same host, so the same clock for both) and, in database 2, Celery's results
(``--no-results``: none); ``--workers`` prefork ``celery worker`` processes and ``celery beat`` of
:mod:`tests.support.chaos_tasks`; a producer enqueuing members into ``--threads`` threads (a few hot ones)
with random countdowns, sleeps, retries with random countdowns, deaths and a few members longer than
the keepalive, one call in 8 with ``coalesce="latest"`` and one in 16 debounced (a call the gate
superseded is recorded when its producer learns it; a failed such call is sent again under its task
id); a deleter deleting random waiting or active members; an operator pausing and resuming
threads (``--operate-every`` seconds), purging some while they are paused (so that members wait to
be dropped), redriving dead letters, and at the end pausing a thread left with no member (it must
still exist).  Faults: a worker SIGKILLed (whole process group) and replaced every ``--kill-every``
seconds, a pool child SIGKILLed in the middle of a task every ``--child-kill-every`` seconds, broker
redeliveries (``acks_late`` with a short visibility timeout on Redis; requeue of a dead consumer's
messages on RabbitMQ), ``--redis-restarts`` restarts of the gate's Redis (SIGTERM, down for
``--outage`` seconds, started again on the same port with its append-only file; an outage longer
than the gate client's retries, 15 s, with a keepalive longer than the outage, is the long outage),
and ``--partitions`` silent partitions between one worker and the gate (each worker reaches the gate
through a relay of its own, tests/support/netfault.py, that drops everything for ``--partition`` seconds;
the broker stays reachable).  The pool processes a worker kills when a lease ends unconfirmed
("killed pool process" in its log) count as kills of their own kind.

The run is also the deployment's supervisor: a worker that exits, or whose consumer crashes (kombu's
Redis transport does so when the broker restarts), is replaced at once, and how many healthy
workers there are is written to the history, so that the checker can tell an outage from a slow
gate.  After the load phase the faults stop, the workers are brought back to full strength, and the
run waits until the gate is empty; then :func:`tests.support.checker.check` reads the history, the gate and
the stored results, and the report is printed (and written as JSON with ``--json``).  Exit status 0
when the checker found no violation.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

import redis

from celery_threads.policies import rate_interval_ms
from tests.conftest import CeleryProcess, RedisServer
from tests.support import checker
from tests.support.checker import DeadLetter, Deletion, Enqueue, Event, GateState, Limits, Report, check
from tests.support.netfault import Relay

AMQP_URL = "amqp://guest:guest@127.0.0.1:5672//"
RESULTS_DB = 2  # the history server's database holding Celery's results (1: redis-apart's broker)


@dataclass
class Options:
    minutes: float = 1.0
    broker: str = "redis"  # "redis" (on the gate's server), "redis-apart", "amqp"
    workers: int = 3
    concurrency: int = 2
    threads: int = 16
    rate: float = 8.0  # members enqueued per second
    seed: int = 0
    keepalive: float = 8.0
    dispatch_interval: float = 0.5
    release_timeout: float = 5.0
    visibility: float = 3.0
    retry_delay: float = 0.3
    kill_every: float = 8.0
    child_kill_every: float = 5.0
    delete_every: float = 2.5
    operate_every: float = 2.0  # 0: no operator (pause, resume, purge, redrive)
    redis_restarts: int = 2
    outage: float = 1.5
    partitions: int = 0
    partition: float = 0.0  # seconds; 0: 1.5 x the keepalive
    quiesce_timeout: float = 90.0
    json_path: Optional[str] = None
    workdir: Optional[str] = None
    keep: bool = False
    quiet: bool = False
    beat: bool = True
    backend: bool = True  # a Redis result backend (on the history server), checked
    publish_timeout: Optional[float] = None  # threads_publish_timeout (None: its default)
    no_ack: bool = False  # the queue consumed without broker acknowledgements
    rate_threads: int = 2  # threads (of the cold ones) whose calls set ...
    thread_rate: str = "5/s"  # ... this thread_rate_limit
    hold_threads: int = 1  # threads (of the hot ones) whose calls set on_death="hold"
    operator_every: float = 1.0  # seconds between the operator's looks at held threads


class ChaosProcess(CeleryProcess):
    """A ``celery -A tests.support.chaos_tasks worker|beat`` subprocess, logging into the run's directory."""

    def __init__(self, kind: str, env: dict[str, str], args: list[str], name: str, logdir: Path) -> None:
        super().__init__(kind, env, args, name)
        shutil.rmtree(self.log.parent, ignore_errors=True)
        self.log = logdir / f"{name}.log"
        self.cmd = [sys.executable, "-m", "celery", "-A", "tests.support.chaos_tasks", kind, *args]

    _read = 0
    is_ready = False
    crashed = False  # its consumer hit an unrecoverable error (it winds down)
    relay: Optional[Relay] = None  # its own way to the gate, with --partitions

    def poll_log(self) -> None:
        """Read what the log gained since the last call: ready yet?  crashed?"""
        if not self.log.exists():
            return
        with open(self.log, "rb") as f:
            f.seek(max(0, self._read - 64))
            data = f.read()
        self._read += max(0, len(data) - min(64, self._read))
        needle = b"ready." if self.kind == "worker" else b"beat: Starting"
        self.is_ready = self.is_ready or needle in data
        self.crashed = self.crashed or b"Unrecoverable error" in data

    def ready(self) -> bool:
        self.poll_log()
        return self.is_ready

    def healthy(self) -> bool:
        self.poll_log()
        return self.alive() and self.is_ready and not self.crashed

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def group(self) -> list[int]:
        """Every process of the worker's process group (main process and pool children)."""
        if self.proc is None:
            return []
        out = subprocess.run(["pgrep", "-g", str(self.proc.pid)], capture_output=True, text=True)
        return [int(p) for p in out.stdout.split()]


class Cluster:
    """The run's servers and processes; :meth:`close` stops every one of them."""

    def __init__(self, opts: Options, workdir: Path) -> None:
        self.opts = opts
        self.workdir = workdir
        self.logdir = workdir / "logs"
        self.logdir.mkdir(parents=True, exist_ok=True)
        self.run_id = uuid.uuid4().hex[:8]
        self.history_server = RedisServer()
        self.gate_server = RedisServer(appendonly=True)
        self.workers: list[ChaosProcess] = []
        self.retired: list[ChaosProcess] = []
        self.beat: Optional[ChaosProcess] = None
        self.env: dict[str, str] = {}
        self._count = 0
        self._healthy = -1

    # -- set-up ---------------------------------------------------------------------------
    def start(self) -> None:
        self.history_server.start()
        self._note(self.history_server.proc)
        self.gate_server.start()
        self._note(self.gate_server.proc)
        broker = {
            "redis": self.gate_server.url(1),
            "redis-apart": self.history_server.url(1),
            "amqp": AMQP_URL,
        }[self.opts.broker]
        self.env = {
            "CHAOS_RUN": self.run_id,
            "CHAOS_GATE_URL": self.gate_server.url(0),
            "CHAOS_BROKER_URL": broker,
            "CHAOS_HISTORY_URL": self.history_server.url(0),
            "CHAOS_KEY_PREFIX": f"chaos-{self.run_id}",
            "CHAOS_QUEUE": f"chaos-{self.run_id}",
            "CHAOS_CONTROL_EXCHANGE": f"chaos-{self.run_id}-control",
            "CHAOS_KEEPALIVE": str(self.opts.keepalive),
            "CHAOS_DISPATCH_INTERVAL": str(self.opts.dispatch_interval),
            "CHAOS_RELEASE_TIMEOUT": str(self.opts.release_timeout),
            "CHAOS_RETRY_DELAY": str(self.opts.retry_delay),
            "CHAOS_ACKS_LATE": "1",
            "CHAOS_VISIBILITY": str(self.opts.visibility),
            "CHAOS_PREFETCH": "2",
        }
        if self.opts.no_ack:
            self.env["CHAOS_NOACK"] = "1"
        # Always set: os.environ keeps what an earlier run of this process set.
        self.env["CHAOS_PUBLISH_TIMEOUT"] = str(self.opts.publish_timeout or "")
        if self.opts.backend:
            # On the history server, which no fault touches: what Celery stored for each member
            # is read after the run and checked against how the member ended.
            self.env["CHAOS_BACKEND_URL"] = self.history_server.url(RESULTS_DB)
        os.environ.update(self.env)
        from tests.support import chaos_tasks

        chaos_tasks.configure(self.env)
        for _ in range(self.opts.workers):
            self.add_worker()
        if self.opts.beat:
            self.beat = ChaosProcess(
                "beat",
                self.env,
                ["--loglevel", "INFO", "-s", str(self.workdir / "beat-schedule")],
                "beat",
                self.logdir,
            )
            self.beat.start()
            self._note(self.beat.proc)
        for w in self.workers:
            w.wait_ready(60)
        if self.beat is not None:
            self.beat.wait_ready(60)

    def _note(self, proc: Any) -> None:
        """Remember every pid, so that an outside cleanup can find what a killed run left."""
        with open(self.workdir / "pids", "a") as f:
            f.write(f"{proc.pid}\n")

    def add_worker(self) -> ChaosProcess:
        self._count += 1
        name = f"w{self._count}"
        args = [
            "--loglevel",
            "INFO",
            "-P",
            "prefork",
            "-c",
            str(self.opts.concurrency),
            "-n",
            f"chaos-{name}-{self.run_id}@%h",
            "--without-gossip",
            "--without-mingle",
            "--without-heartbeat",
        ]
        env = self.env
        relay = None
        if self.opts.partitions:
            relay = Relay(self.gate_server.port)
            env = {**env, "CHAOS_GATE_URL": relay.url(0)}
        proc = ChaosProcess("worker", env, args, name, self.logdir)
        proc.relay = relay
        proc.start()
        self._note(proc.proc)
        self.workers.append(proc)
        return proc

    # -- faults ---------------------------------------------------------------------------
    def kill_worker(self, rng: random.Random, busy_pids: set[int]) -> Optional[dict[str, Any]]:
        """SIGKILL a worker's process group, preferring one that is running a member."""
        candidates = [w for w in self.workers if w.healthy()]
        if len(candidates) < 2:
            return None  # keep one worker standing
        busy = [w for w in candidates if set(w.children()) & busy_pids]
        victim = rng.choice(busy or candidates)
        pids = victim.group()
        from tests.support.chaos_tasks import now_us, record

        lo = now_us()
        victim.kill(signal.SIGKILL)
        record("kill", what="worker", pids=pids, lo=lo, name=victim.name)
        self.workers.remove(victim)
        self.retired.append(victim)
        self.add_worker()
        return {"name": victim.name, "pids": pids}

    def supervise(self) -> list[str]:
        """A supervisor's job: replace each worker that exited, or whose consumer crashed (it
        finishes what it runs, then exits); note how many healthy workers there are."""
        from tests.support.chaos_tasks import record

        gone = []
        for w in list(self.workers):
            w.poll_log()
            if not w.alive() or w.crashed:
                code = w.proc.returncode if w.proc is not None else None
                what = "crashed" if w.crashed else f"exit {code}"
                record("worker_exit", name=w.name, what=what)
                self.workers.remove(w)
                self.retired.append(w)
                self.add_worker()
                gone.append(f"{w.name} ({what})")
        healthy = sum(1 for w in self.workers if w.healthy())
        if healthy != self._healthy:
            self._healthy = healthy
            record("healthy", n=healthy)
        return gone

    def children(self) -> set[int]:
        pids: set[int] = set()
        for w in self.workers:
            if w.alive():
                pids.update(w.children())
        return pids

    def kill_child(
        self, rng: random.Random, history: redis.Redis, key: str, deadline: float
    ) -> Optional[int]:
        """SIGKILL a pool child in the middle of user code (at least 150 ms of sleep left)."""
        from tests.support.chaos_tasks import now_us, record

        while time.time() < deadline:
            now = now_us()
            children = self.children()
            ready = [
                r
                for r in open_spans(history, key)
                if r["pid"] in children and r["t"] + r.get("sleep", 0) * 1e6 - now > 150_000
            ]
            if ready:
                pid = int(rng.choice(ready)["pid"])
                lo = now_us()
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    continue
                record("kill", what="child", pids=[pid], lo=lo)
                return pid
            time.sleep(0.2)
        return None

    def partition_worker(self, rng: random.Random, busy_pids: set[int]) -> Optional[ChaosProcess]:
        """Silence the link between a worker (preferably one running a member) and the gate."""
        from tests.support.chaos_tasks import now_us, record

        candidates = [
            w for w in self.workers if w.healthy() and w.relay is not None and w.relay.mode == "pass"
        ]
        if len(candidates) < 2:
            return None  # keep one worker connected
        busy = [w for w in candidates if set(w.children()) & busy_pids]
        victim = rng.choice(busy or candidates)
        assert victim.relay is not None
        lo = now_us()
        victim.relay.silence()
        record("partition", name=victim.name, pids=victim.group(), lo=lo)
        return victim

    def heal(self, worker: ChaosProcess) -> None:
        from tests.support.chaos_tasks import record

        if worker.relay is not None:
            worker.relay.heal()
        record("healed", name=worker.name)

    def lease_kills(self) -> list[Event]:
        """The pool processes the workers killed when a member's lease ended unconfirmed (their
        logs say so right after the signal: "killed pool process <pid>"), and the endings a pool
        process could not record in the gate while the member's lease held ("could not record
        the end of <task>"), in local time."""
        found = []
        for proc in [*self.workers, *self.retired]:
            if not proc.log.exists():
                continue
            for line in proc.log.read_text(errors="replace").splitlines():
                match = _LEASE_KILL.search(line)
                if match:
                    found.append(
                        Event(
                            "kill",
                            _log_time(match) + 1000,  # the next ms, at most
                            pids=(int(match["pid"]),),
                            what="lease",
                        )
                    )
                match = _UNRECORDED.search(line)
                if match:
                    found.append(Event("unrecorded", _log_time(match), task=match["task"]))
        return found

    def restart_redis(self, outage: float) -> None:
        from tests.support.chaos_tasks import record

        record("redis_down")
        self.gate_server.stop()  # SIGTERM: Redis flushes its append-only file
        time.sleep(outage)
        self.gate_server.start()
        self._note(self.gate_server.proc)
        record("redis_up")

    # -- reading --------------------------------------------------------------------------
    def gate_client(self) -> redis.Redis:
        return redis.Redis.from_url(self.env["CHAOS_GATE_URL"])

    def gate_busy(self) -> int:
        from celery_threads.keys import Keys

        shard = Keys(self.env["CHAOS_KEY_PREFIX"]).shard(0)
        client = self.gate_client()
        try:
            # A paused thread (held by a death: the operator resumes it) is in neither index.  One
            # transaction: read one by one, a thread moving from the leases index to the due
            # index (a retry) between the reads was in neither, and the run was taken for quiet
            # with a member still to end (its last death's hold then outlived the operator).
            pipe = client.pipeline(transaction=True)
            pipe.zcard(shard.due)
            pipe.zcard(shard.leases)
            pipe.hlen(shard.paused)
            return sum(int(n) for n in pipe.execute())
        finally:
            client.close()

    def gate_state(self) -> GateState:
        from celery_threads.gate import Gate, parse_record, record_task
        from celery_threads.keys import Keys

        keys = Keys(self.env["CHAOS_KEY_PREFIX"])
        shard = keys.shard(0)
        client = self.gate_client()
        try:
            due = {k.decode(): int(v) for k, v in client.zrange(shard.due, 0, -1, withscores=True)}
            leases = {k.decode(): int(v) for k, v in client.zrange(shard.leases, 0, -1, withscores=True)}
            members = {
                record_task(k, v): parse_record(v).thread_id for k, v in client.hgetall(shard.tasks).items()
            }
            gate = Gate(client, keys, release_timeout_ms=1000)
            dead = {
                r.task_id: DeadLetter(
                    str(r.meta.get("thread_id", "")),
                    str(r.meta.get("exception", "")),
                    r.died_at_ms,
                    int(r.meta.get("retries", -1)),
                )
                for r in gate.reads.dead_records()
            }
            thread_keys: dict[str, list[str]] = {}
            lingering: dict[str, int] = {}
            head = f"{shard.tag}:t:"
            indexed = set(due) | set(leases)
            for raw in client.scan_iter(match=f"{head}*", count=1000):
                key = raw.decode()
                thread = key[len(head) : -2]
                if key.endswith(":p") and thread not in indexed:
                    lingering[thread] = int(client.pttl(raw))  # the policy hash of an ended one
                else:
                    thread_keys.setdefault(thread, []).append(key)
            active = {
                t: {k.decode(): v.decode() for k, v in client.hgetall(keys.thread(t).active).items()}
                for t in set(due) | set(leases)
            }
            notes: dict[str, int] = {}
            note_head = shard.deleted_note("")
            for raw in client.scan_iter(match=f"{note_head}*", count=1000):
                notes[raw.decode()[len(note_head) :]] = int(client.ttl(raw))
            known = {
                shard.seq,
                shard.due,
                shard.leases,
                shard.tasks,
                shard.dead,
                shard.dead_records,
                shard.ended,
                shard.paused,
                shard.stats,
                shard.dead_dropped,
                keys.meta,
            }
            other = [
                k
                for k in (raw.decode() for raw in client.scan_iter(match=f"{keys.prefix}:*", count=1000))
                if k not in known and not k.startswith((head, note_head))
            ]
            return GateState(
                due,
                leases,
                members,
                dead,
                thread_keys,
                active,
                lingering,
                dead_index=[k.decode() for k in client.zrange(shard.dead, 0, -1)],
                dead_records=[k.decode() for k in client.hkeys(shard.dead_records)],
                ended={k.decode(): v for k, v in client.zrange(shard.ended, 0, -1, withscores=True)},
                notes=notes,
                other_keys=other,
                paused=gate.reads.paused(shard),
                listed=list(gate.reads.thread_ids()),
                stats={k.decode(): int(v) for k, v in client.hgetall(shard.stats).items()},
            )
        finally:
            client.close()

    def results(self, tasks: Iterable[str]) -> Optional[dict[str, str]]:
        """The state Celery's result backend holds for each of ``tasks`` (those with none left
        out), or ``None`` when the run keeps no results.  Read as stored, not through Celery."""
        if not self.opts.backend:
            return None
        tasks = sorted(set(tasks))
        client = redis.Redis.from_url(self.env["CHAOS_BACKEND_URL"])
        try:
            states: dict[str, str] = {}
            for i in range(0, len(tasks), 500):
                chunk = tasks[i : i + 500]
                for task, raw in zip(chunk, client.mget([f"celery-task-meta-{t}" for t in chunk])):
                    if raw is not None:
                        states[task] = json.loads(raw)["status"]
            return states
        finally:
            client.close()

    def logs_summary(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for proc in [*self.workers, *self.retired, *([self.beat] if self.beat else [])]:
            if not proc.log.exists():
                continue
            for line in proc.log.read_text(errors="replace").splitlines():
                for needle in ("Unrecoverable error", "CRITICAL/", "ERROR/"):
                    if needle in line:
                        counts[needle] = counts.get(needle, 0) + 1
        return counts

    # -- tear-down ------------------------------------------------------------------------
    def close(self) -> None:
        # The driver's calls subscribed its result backend to their results, and a result still
        # in a reference cycle unsubscribes when it is collected: now, while the history server
        # answers, not at exit, where Celery's backend would retry its reconnection for ~20 s.
        gc.collect()
        for proc in [*self.workers, *self.retired]:
            if proc.relay is not None:
                proc.relay.close()
        for proc in [*self.workers, *self.retired, *([self.beat] if self.beat else [])]:
            try:
                proc.stop()
            except Exception:
                if proc.proc is not None and proc.proc.poll() is None:
                    os.killpg(proc.proc.pid, signal.SIGKILL)
        for server in (self.gate_server, self.history_server):
            try:
                server.stop()
            except Exception:
                server.stop(kill=True)
        if self.opts.broker == "amqp" and self.env:
            _drop_amqp(self.env["CHAOS_QUEUE"], self.env["CHAOS_CONTROL_EXCHANGE"])


_LOG_TIME = r"^\[(?P<at>\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(?P<ms>\d{3}): ERROR/"
_LEASE_KILL = re.compile(_LOG_TIME + r".*killed pool process (?P<pid>\d+)")
_UNRECORDED = re.compile(_LOG_TIME + r".*could not record the end of (?P<task>\S+) of thread")


def _log_time(match: re.Match[str]) -> int:
    """A Celery log line's time (local time, ms) in µs since the epoch."""
    at = time.mktime(time.strptime(match["at"], "%Y-%m-%d %H:%M:%S"))
    return int(at * 1e6) + int(match["ms"]) * 1000


def partition_recoveries(rows: list[dict[str, Any]]) -> list[float]:
    """For each partition: the time from its start to the next start, on another worker, of each
    thread whose member was running on the partitioned worker (seconds)."""
    found = []
    starts = [r for r in rows if r["k"] == "start"]
    for p in (r for r in rows if r["k"] == "partition"):
        pids, at = set(p["pids"]), int(p["lo"])
        open_at: dict[str, str] = {}
        for r in rows:
            if r["t"] > at:
                break
            if r["k"] == "start" and r["pid"] in pids:
                open_at[r["thread"]] = r["task"]
            elif r["k"] in ("end", "fin") and r["pid"] in pids:
                open_at.pop(r["thread"], None)
        for thread in open_at:
            later = [r["t"] for r in starts if r["thread"] == thread and r["t"] > at and r["pid"] not in pids]
            if later:
                found.append((min(later) - at) / 1e6)
    return found


def _drop_amqp(queue: str, exchange: str) -> None:
    from kombu import Connection

    try:
        with Connection(AMQP_URL, connect_timeout=5) as conn:
            channel = conn.channel()
            channel.queue_delete(queue)
            for name in (queue, f"{exchange}.pidbox", f"reply.{exchange}.pidbox"):
                channel.exchange_delete(name)
    except Exception as exc:  # the queue is the run's own; a leftover is harmless
        print(f"could not delete RabbitMQ queue {queue}: {exc}", file=sys.stderr)


def open_spans(client: redis.Redis, key: str, n: int = 400) -> list[dict[str, Any]]:
    """The ``start`` rows among the last ``n`` history rows that have no ``end`` yet."""
    spans: dict[tuple[str, str, int], dict[str, Any]] = {}
    for raw in client.lrange(key, -n, -1):
        stamp, _, body = raw.decode().partition(" ")
        row = {"t": int(stamp), **json.loads(body)}
        span = (row.get("task", ""), row.get("tok", ""), row.get("pid", 0))
        if row["k"] == "start":
            spans[span] = row
        elif row["k"] == "end":
            spans.pop(span, None)
    return list(spans.values())


# -- the workload -----------------------------------------------------------------------------


class Workload:
    """The producer and the deleter, each in its own thread, until :attr:`stop` is set."""

    def __init__(self, opts: Options, cluster: Cluster) -> None:
        self.opts = opts
        self.cluster = cluster
        self.stop = threading.Event()
        self.threads = [f"th{i:02d}-{cluster.run_id}" for i in range(opts.threads)]
        hot = max(1, opts.threads // 5)
        self.weights = [4.0 if i < hot else 1.0 for i in range(opts.threads)]
        # The last threads (cold ones) are rate-limited: every call into them sets
        # thread_rate_limit, and the checker holds their releases to its interval.
        self.rated = set(self.threads[hot:][-opts.rate_threads :]) if opts.rate_threads else set()
        # The first threads (hot ones) hold on death: the operator resumes them (operator()).
        self.holding = set(self.threads[: min(hot, opts.hold_threads)])
        self.halt = threading.Event()  # the operator's own stop: after the gate has emptied
        self.enqueued = 0
        self.failed_enqueues: list[str] = []
        self.deleted = 0
        self.errors: list[str] = []
        self.long_until = 0.0
        self.quiet_around: list[float] = []  # when the gate's Redis restarts (time.time())
        self.ops = {"pauses": 0, "purges": 0, "purged": 0, "redrives": 0, "redriven": 0}
        self.paused: set[str] = set()

    def producer(self, until: float, long_until: float) -> None:
        """Members at ``--rate``; one time in 16, a burst of three into one thread with the same
        ``eta`` (a multiple of 250 ms, so exact on the gate's millisecond clock), whose order
        must be their arrival order."""
        from tests.support.chaos_tasks import now_us

        rng = random.Random(self.opts.seed)
        period = 1.0 / self.opts.rate
        _record_superseded()
        n = 0
        while not self.stop.is_set() and time.time() < until:
            thread = rng.choices(self.threads, self.weights)[0]
            if rng.random() < 1 / 16:
                eta_ms = (now_us() // 1000 + 600) // 250 * 250 + 250
                for _ in range(3):
                    n += 1
                    self._enqueue(thread, f"m{n}", self._kwargs(rng, long_until), eta_ms=eta_ms)
            else:
                n += 1
                countdown_ms = 0 if rng.random() < 0.6 else rng.randint(100, 3000)
                self._enqueue(
                    thread,
                    f"m{n}",
                    self._kwargs(rng, long_until),
                    countdown_ms=countdown_ms,
                    policy=self._policy(rng),
                )
            self.stop.wait(period * rng.uniform(0.5, 1.5))

    @staticmethod
    def _policy(rng: random.Random) -> dict[str, Any]:
        """One call in 8 supersedes its task's waiting call in its thread (coalesce), one in 16
        is debounced (0.3 s, at most 1 s after its burst's first call); the others neither."""
        roll = rng.random()
        if roll < 1 / 8:
            return {"coalesce": "latest"}
        if roll < 3 / 16:
            return {"debounce": 0.3, "debounce_max": 1.0}
        return {}

    def _kwargs(self, rng: random.Random, long_until: float) -> dict[str, Any]:
        roll = rng.random()
        if roll < 0.02 and time.time() < long_until:
            sleep = round(self.opts.keepalive * 1.5, 2)  # outlives several renewals
        else:
            sleep = round(rng.uniform(0.02, 0.3), 3)
        fails = rng.choices([0, 1, 2, 5], [65, 20, 10, 5])[0]  # 5: exhausts max_retries=3
        die = rng.random() < 0.05
        return {"sleep": sleep, "fails": fails, "die": die, "retry_ms": rng.randint(0, 1000)}

    def _enqueue(
        self,
        thread: str,
        label: str,
        kwargs: dict[str, Any],
        countdown_ms: int = 0,
        eta_ms: Optional[int] = None,
        policy: Optional[dict[str, Any]] = None,
    ) -> None:
        """``policy``: coalesce or debounce options.  Such a call that fails (the gate away) is
        sent again under its task id, as a producer should: it may have superseded a call
        before its reply was lost, and only its replay is told which."""
        from datetime import datetime, timezone

        from celery.utils import uuid

        from tests.support.chaos_tasks import now_us, record, work

        lo = now_us()
        # Rate-limited and holding threads (each call there), besides coalesce or debounce.
        own: dict[str, Any] = (
            {"thread_rate_limit": self.opts.thread_rate}
            if thread in self.rated
            else {"on_death": "hold"}
            if thread in self.holding
            else {}
        )
        options: dict[str, Any] = {"task_id": uuid(), **own, **(policy or {})}
        for _ in range(1 + 5 * bool(policy)):
            try:
                if eta_ms is not None:
                    result = work.apply_async(
                        (thread, label),
                        kwargs,
                        eta=datetime.fromtimestamp(eta_ms / 1000, timezone.utc),
                        **options,
                    )
                else:
                    result = work.apply_async(
                        (thread, label),
                        kwargs,
                        countdown=countdown_ms / 1000.0 if countdown_ms else None,
                        **options,
                    )
            except Exception as exc:
                self.failed_enqueues.append(f"{type(exc).__name__}: {exc}")
                record("enq_failed", thread=thread, error=repr(exc)[:300], lo=lo)
            else:
                exact = {} if eta_ms is None else {"at": eta_ms * 1000}
                record(
                    "enq",
                    task=result.id,
                    thread=thread,
                    n=0,
                    cd=countdown_ms * 1000,
                    lo=lo,
                    **exact,
                    **({"co": 1} if policy else {}),
                )
                self.enqueued += 1
                return

    def hold_operator(self) -> None:
        """An operator who looks at the held threads every ``--operator-every`` seconds, and
        resumes each that a death holds (``act``: the time read before the resume), until the
        run has drained the gate; then once more."""
        halted = False
        while not halted:
            halted = self.halt.wait(self.opts.operator_every)
            self._resume_held()

    def _resume_held(self) -> None:
        from celery_threads import Threads
        from tests.support.chaos_tasks import app, now_us, record

        threads = Threads(app)
        for thread in sorted(self.holding):
            try:
                info = threads.get(thread)
                if info is None or not (info.paused or "").startswith("on_death=hold"):
                    continue
                lo = now_us()
                if threads.resume(thread):
                    record("act", thread=thread, lo=lo, what="resume")
            except Exception as exc:
                self.errors.append(f"operator: {type(exc).__name__}: {exc}")

    def deleter(self, until: float) -> None:
        from celery_threads import Threads
        from tests.support.chaos_tasks import app, now_us, record

        rng = random.Random(self.opts.seed + 1)
        threads = Threads(app)
        while not self.stop.wait(self.opts.delete_every * rng.uniform(0.5, 1.5)):
            if time.time() >= until:
                return
            try:
                info = threads.get(rng.choice(self.threads))
                if info is None:
                    continue
                pool = ([info.active] if info.active else []) + list(info.waiting)
                if not pool:  # a paused thread with no member left
                    continue
                if info.active and rng.random() < 0.5:
                    victim = info.active
                else:
                    victim = rng.choice(pool)
                lo = now_us()
                if threads.delete(victim.task_id):
                    record("del", task=victim.task_id, state=victim.state, lo=lo)
                    self.deleted += 1
            except Exception as exc:
                self.errors.append(f"delete: {type(exc).__name__}: {exc}")

    def operator(self, until: float) -> None:
        """Every ``--operate-every`` seconds or so: pause a thread (mostly a hot one), let it
        fill for a while, purge it half of the time, resume it; and, half of the time, redrive
        the dead letters of a thread that has some.  A purge is kept away from the gate's
        restarts: the members a purge dropped are known from its replies (Threads.purge marks
        each REVOKED), and a reply lost to a restart would hide some."""
        from celery_threads import Threads
        from tests.support.chaos_tasks import app

        rng = random.Random(self.opts.seed + 3)
        threads = Threads(app)
        purged: list[str] = []
        mark = threads.runtime.mark_revoked

        def marked(task_id: str, reason: str = "deleted from its thread", *args: Any, **kwargs: Any) -> None:
            if reason.startswith("purged"):  # this thread is the only one that purges
                purged.append(task_id)
            mark(task_id, reason, *args, **kwargs)

        setattr(threads.runtime, "mark_revoked", marked)
        try:
            while not self.stop.wait(self.opts.operate_every * rng.uniform(0.5, 1.5)):
                if time.time() >= until:
                    return
                # Not a holding thread: there only the hold operator acts (a resume lifts a hold).
                thread = rng.choices(self.threads, self.weights)[0]
                if thread in self.holding:
                    continue
                self._until_done("pause", thread, threads.pause, "chaos")
                self.stop.wait(rng.uniform(1.0, 3.0))
                near = any(abs(time.time() - t) < 4.0 for t in self.quiet_around)
                if rng.random() < 0.5 and not near:
                    self._purge(threads, thread, purged)
                self._until_done("resume", thread, threads.resume)
                if rng.random() < 0.5:
                    self._redrive(threads, rng)
        finally:
            for thread in sorted(self.paused):
                self._until_done("resume", thread, threads.resume)
            setattr(threads.runtime, "mark_revoked", mark)

    def _until_done(self, what: str, thread: str, call: Any, *args: Any, timeout: float = 60.0) -> None:
        """A pause or a resume (each idempotent), sent until it went through: a thread left
        paused would keep its members for good.  Recorded with the time read before the first
        try (``lo``) and the stamp after the last (``t``)."""
        from tests.support.chaos_tasks import now_us, record

        lo, end = now_us(), time.monotonic() + timeout
        while True:
            try:
                call(thread, *args)
                break
            except Exception as exc:
                if time.monotonic() > end:
                    self.errors.append(f"{what}: {type(exc).__name__}: {exc}")
                    return
                time.sleep(0.5)
        record(what, thread=thread, lo=lo)
        if what == "pause":
            self.ops["pauses"] += 1
            self.paused.add(thread)
        else:
            self.paused.discard(thread)

    def pause_an_empty_thread(self) -> None:
        """After the run: pause a thread with no member left, which exists for its pause alone
        (the checker finds it listed and in the paused hash)."""
        from celery_threads import Threads
        from tests.support.chaos_tasks import app

        threads = Threads(app)
        for thread in self.threads:
            if thread in self.holding:
                continue
            if threads.get(thread) is None:
                self._until_done("pause", thread, threads.pause, "chaos: empty")
                info = threads.get(thread)
                if info is None or info.paused is None or info.active or info.waiting:
                    self.errors.append(f"paused empty thread {thread} reads {info}")
                return

    def _purge(self, threads: Any, thread: str, purged: list[str]) -> None:
        from tests.support.chaos_tasks import now_us, record

        lo = now_us()
        try:
            threads.purge(thread)
        except Exception as exc:
            self.errors.append(f"purge: {type(exc).__name__}: {exc}")
        if purged:
            record("purge", thread=thread, tasks=list(purged), lo=lo)
            self.ops["purges"] += 1
            self.ops["purged"] += len(purged)
            purged.clear()

    def _redrive(self, threads: Any, rng: random.Random) -> None:
        """The dead letters of one thread back at their places: which went back is read from
        the dead store before and after (a letter leaves it only so here), their places from
        their records."""
        from tests.support.chaos_tasks import now_us, record

        try:
            letters = threads.gate.reads.dead_records()
            by_thread: dict[str, list[Any]] = {}
            for r in letters:
                if str(r.meta.get("thread_id")) not in self.holding:  # a redrive lifts a hold
                    by_thread.setdefault(str(r.meta.get("thread_id")), []).append(r)
            if not by_thread:
                return
            # Mostly a thread with several, whose order the redrive must keep.
            thread = max(by_thread, key=lambda t: (len(by_thread[t]) + rng.random() * 2, t))
            lo = now_us()
            threads.redrive(thread)
            left = {r.task_id for r in threads.gate.reads.dead_records()}
        except Exception as exc:
            self.errors.append(f"redrive: {type(exc).__name__}: {exc}")
            return
        back = sorted(
            (r for r in by_thread[thread] if r.task_id not in left),
            key=lambda r: (r.meta.get("sched", 0), r.meta.get("seq", 0)),
        )
        if back:
            record("redrive", thread=thread, tasks=[r.task_id for r in back], lo=lo)
            self.ops["redrives"] += 1
            self.ops["redriven"] += len(back)


def _record_superseded() -> None:
    """Each call's superseded members go to the history (``sup``) as the producer learns them,
    before it revokes them as usual: the checker's record of what coalesce and debounce
    ended."""
    from celery_threads.runtime import get_runtime
    from tests.support.chaos_tasks import app, record

    runtime = get_runtime(app)
    revoke = runtime.revoke_superseded

    def recorded(thread_id: str, task_ids: list[str], envelope: bytes = b"") -> None:
        for task_id in task_ids:
            record("sup", task=task_id, thread=thread_id)
        revoke(thread_id, task_ids, envelope)

    runtime.revoke_superseded = recorded  # type: ignore[method-assign]


# -- the run ----------------------------------------------------------------------------------


def _await_quiet(client: redis.Redis, key: str, quiet: float = 1.0, timeout: float = 30.0) -> None:
    """Until the list ``key`` has not grown for ``quiet`` seconds (at most ``timeout``): the rows
    a process writes after its member's finish, however late a busy machine lets it write them."""
    end = time.monotonic() + timeout
    length = client.llen(key)
    while time.monotonic() < end:
        time.sleep(quiet)
        now = client.llen(key)
        if now == length:
            return
        length = now


def parse_history(
    rows: list[dict[str, Any]],
) -> tuple[list[Event], list[Enqueue], list[Deletion], checker.Operations]:
    events: list[Event] = []
    enqueues: list[Enqueue] = []
    deletions: list[Deletion] = []
    landed: dict[tuple[str, int], int] = {}
    ops = checker.Operations()
    paused: dict[str, int] = {}  # thread -> when its pause call returned
    for row in rows:
        k = row["k"]
        if k == "pause":
            paused.setdefault(row["thread"], row["t"])
        elif k == "resume" and row["thread"] in paused:
            ops.pauses.append((row["thread"], paused.pop(row["thread"]), int(row["lo"])))
        elif k == "purge":
            ops.purged += [Deletion(task, int(row["lo"]), row["t"]) for task in row["tasks"]]
        elif k == "redrive":
            ops.redrives.append(checker.Redrive(row["thread"], int(row["lo"]), tuple(row["tasks"])))
        if k in ("recv", "start", "end", "fin"):
            events.append(
                Event(
                    k,
                    row["t"],
                    row["task"],
                    row["thread"],
                    int(row["n"]),
                    str(row["tok"]),
                    int(row["pid"]),
                    row.get("outcome", ""),
                )
            )
        elif k == "kill":
            events.append(Event("kill", int(row["lo"]), pids=tuple(row["pids"]), what=row["what"]))
        elif k == "enq":
            enqueues.append(
                Enqueue(
                    row["task"],
                    row["thread"],
                    int(row["n"]),
                    int(row["lo"]),
                    row["t"],
                    int(row["cd"]),
                    exact=row.get("at"),
                    coalesced=bool(row.get("co")),
                )
            )
        elif k == "landed":
            landed[(row["task"], int(row["n"]))] = row["t"]
        elif k == "del":
            deletions.append(Deletion(row["task"], int(row["lo"]), row["t"]))
        elif k == "sup":
            deletions.append(Deletion(row["task"], row["t"], row["t"], superseded=True))
        elif k in ("redis_down", "redis_up"):
            events.append(Event(k, row["t"]))
        elif k == "act":
            events.append(Event(k, int(row["lo"]), thread=row["thread"], what=row["what"]))
        elif k == "healthy":
            events.append(Event(k, row["t"], count=int(row["n"])))
    # A retry's re-entry (attempt >= 1) counts as in the gate only once the task saw it land.
    enqueues = [dataclasses.replace(e, in_gate_by=landed.get((e.task, e.attempt))) for e in enqueues]
    ops.pauses += [(thread, at, checker.INF) for thread, at in paused.items()]
    return events, enqueues, deletions, ops


def run(opts: Options) -> Report:
    own_workdir = opts.workdir is None
    workdir = Path(opts.workdir or tempfile.mkdtemp(prefix="ct-chaos-"))
    workdir.mkdir(parents=True, exist_ok=True)
    say = (lambda *a: None) if opts.quiet else (lambda *a: print(*a, flush=True))
    cluster = Cluster(opts, workdir)
    workload: Optional[Workload] = None
    pool: list[threading.Thread] = []
    ok = False
    try:
        t_setup = time.time()
        cluster.start()
        say(
            f"chaos run {cluster.run_id}: {opts.broker} broker, {opts.workers} workers x "
            f"{opts.concurrency}, {opts.threads} threads, {opts.minutes:g} min, seed {opts.seed}, "
            f"keepalive {opts.keepalive:g}s, logs in {cluster.logdir} "
            f"(set-up {time.time() - t_setup:.1f}s)"
        )
        from tests.support.chaos_tasks import HISTORY_KEY, read_history

        history = redis.Redis.from_url(cluster.env["CHAOS_HISTORY_URL"])
        rng = random.Random(opts.seed + 2)
        load = opts.minutes * 60.0
        t0 = time.time()
        workload = Workload(opts, cluster)
        restarts = [t0 + load * (i + 1) / (opts.redis_restarts + 1.5) for i in range(opts.redis_restarts)]
        workload.quiet_around = list(restarts)
        pool = [
            threading.Thread(target=workload.producer, args=(t0 + 0.85 * load, t0 + 0.6 * load), daemon=True),
            threading.Thread(target=workload.deleter, args=(t0 + 0.9 * load,), daemon=True),
        ]
        if opts.operate_every > 0:
            pool.append(threading.Thread(target=workload.operator, args=(t0 + 0.7 * load,), daemon=True))
        holder = threading.Thread(target=workload.hold_operator, daemon=True)
        holder.start()
        for th in pool:
            th.start()

        faults = {"worker": 0, "child": 0, "redis": 0, "partition": 0}
        partition = opts.partition or 1.5 * opts.keepalive
        partitions = [t0 + load * (i + 0.5) / (opts.partitions + 1) for i in range(opts.partitions)]
        healing: list[tuple[float, ChaosProcess]] = []
        exits: list[str] = []
        next_kill = t0 + min(6.0, opts.kill_every)
        next_child = t0 + min(3.0, opts.child_kill_every)
        next_report = t0 + 10
        while time.time() < t0 + load:
            now = time.time()
            if opts.kill_every > 0 and now >= next_kill:
                killed = cluster.kill_worker(rng, {int(r["pid"]) for r in open_spans(history, HISTORY_KEY)})
                next_kill = now + opts.kill_every * rng.uniform(0.7, 1.3)
                if killed:
                    faults["worker"] += 1
                    say(
                        f"  {now - t0:5.1f}s SIGKILL worker {killed['name']} "
                        f"(pids {killed['pids']}); replacement started"
                    )
            if opts.child_kill_every > 0 and now >= next_child:
                pid = cluster.kill_child(rng, history, HISTORY_KEY, now + 2.0)
                next_child = time.time() + opts.child_kill_every * rng.uniform(0.7, 1.3)
                if pid:
                    faults["child"] += 1
                    say(f"  {now - t0:5.1f}s SIGKILL pool child {pid} in the middle of a task")
            if restarts and now >= restarts[0]:
                restarts.pop(0)
                say(f"  {now - t0:5.1f}s gate Redis down for {opts.outage:g}s (SIGTERM, AOF)")
                cluster.restart_redis(opts.outage)
                faults["redis"] += 1
            if partitions and now >= partitions[0]:
                partitions.pop(0)
                cut = cluster.partition_worker(rng, {int(r["pid"]) for r in open_spans(history, HISTORY_KEY)})
                if cut is not None:
                    faults["partition"] += 1
                    healing.append((now + partition, cut))
                    say(f"  {now - t0:5.1f}s worker {cut.name} cut off from the gate for {partition:g}s")
            for at, cut in [h for h in healing if now >= h[0]]:
                healing.remove((at, cut))
                cluster.heal(cut)
                say(f"  {now - t0:5.1f}s worker {cut.name} reaches the gate again")
            for name in cluster.supervise():
                exits.append(name)
                say(f"  {now - t0:5.1f}s worker {name}; replacement started")
            if now >= next_report:
                next_report = now + 10
                say(
                    f"  {now - t0:5.1f}s enqueued {workload.enqueued}, deleted "
                    f"{workload.deleted}, history {history.llen(HISTORY_KEY)} rows, "
                    f"threads in the gate {cluster.gate_busy()}"
                )
            time.sleep(0.1)

        workload.stop.set()
        for _, cut in healing:
            cluster.heal(cut)
        for th in pool:
            th.join(30)
        say(
            f"  {time.time() - t0:5.1f}s load over: {workload.enqueued} members enqueued, "
            f"{workload.deleted} deleted; faults {faults}; waiting for the gate to empty"
        )
        exits += cluster.supervise()
        for w in cluster.workers:
            w.wait_ready(60)
        t_quiet = time.time()
        while time.time() < t_quiet + opts.quiesce_timeout and cluster.gate_busy():
            exits += cluster.supervise()
            time.sleep(0.5)
        workload.halt.set()
        holder.join(30)
        busy = cluster.gate_busy()
        say(f"  quiesced in {time.time() - t_quiet:.1f}s ({busy} threads left in the gate)")
        _await_quiet(history, HISTORY_KEY)  # the last fin rows follow the last finishes
        if opts.operate_every > 0:
            workload.pause_an_empty_thread()
        gate = cluster.gate_state()
        logs = cluster.logs_summary()
        rows = read_history(history, HISTORY_KEY)
        (workdir / "history.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (workdir / "gate.json").write_text(json.dumps(asdict(gate), indent=1))
        events, enqueues, deletions, operations = parse_history(rows)
        events += cluster.lease_kills()
        results = cluster.results([e.task for e in enqueues] + [d.task for d in deletions] + list(gate.dead))
        interval_us = 1000 * (rate_interval_ms(opts.thread_rate, "chaos") or 0)
        report = check(
            events,
            gate,
            deletions,
            enqueues,
            Limits(
                opts.keepalive,
                opts.dispatch_interval,
                opts.retry_delay,
                rates={t: interval_us for t in workload.rated},
                holding=frozenset(workload.holding),
            ),
            results,
            operations,
        )
        report.info.append(
            f"faults: {faults['worker']} worker SIGKILLs, {faults['child']} "
            f"pool-child SIGKILLs, {faults['redis']} gate Redis restarts "
            f"({opts.outage:g}s each), acks_late"
            + (f", visibility timeout {opts.visibility:g}s" if opts.broker == "redis" else "")
        )
        if faults["partition"]:
            moved = partition_recoveries(rows)
            report.info.append(
                f"{faults['partition']} partition(s) of {partition:g}s between a worker and the "
                f"gate; from a partition to its threads' next start elsewhere: "
                + (
                    f"worst {max(moved):.2f}s, median {sorted(moved)[len(moved) // 2]:.2f}s "
                    f"({len(moved)} threads)"
                    if moved
                    else "no thread was running there"
                )
            )
            report.info.append(
                f"pool processes killed at a lease's end: {sum(1 for e in events if e.what == 'lease')}"
            )
        if opts.operate_every > 0:
            report.info.append(f"operator: {workload.ops}")
        report.info.append(f"worker and beat logs: {logs or 'no errors'}")
        if exits:
            report.info.append(
                f"{len(exits)} worker(s) crashed or exited on their own and were replaced: {exits}"
            )
        if workload.failed_enqueues:
            report.info.append(
                f"{len(workload.failed_enqueues)} apply_async call(s) raised: {workload.failed_enqueues[:3]}"
            )
        if workload.errors:
            report.info.append(f"deleter and operator errors: {workload.errors[:3]}")
        say(report.format())
        if opts.json_path:
            data = report.as_dict()
            data.update(
                {
                    "faults": faults,
                    "logs": logs,
                    "exits": exits,
                    "options": vars(opts),
                    "run_id": cluster.run_id,
                    "enqueued": workload.enqueued,
                    "operator": workload.ops,
                }
            )
            Path(opts.json_path).write_text(json.dumps(data, indent=2))
        ok = report.ok
        return report
    finally:
        if workload is not None:
            workload.stop.set()
            workload.halt.set()
        cluster.close()
        if own_workdir and ok and not opts.keep:
            shutil.rmtree(workdir, ignore_errors=True)
        elif not ok:
            say(f"logs kept in {workdir}")
        for d in (cluster.gate_server.dir, cluster.history_server.dir):
            shutil.rmtree(d, ignore_errors=True)


def main(argv: Optional[list[str]] = None) -> int:
    defaults = Options()
    parser = argparse.ArgumentParser(prog="python -m tests.chaos", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--minutes",
        type=float,
        default=defaults.minutes,
        help="length of the load phase (the quiesce and the check come after)",
    )
    parser.add_argument(
        "--broker",
        choices=["redis", "redis-apart", "amqp"],
        default=defaults.broker,
        help="redis: the broker is database 1 of the gate's Redis, restarted with "
        "it; redis-apart: on the history server, never restarted",
    )
    parser.add_argument(
        "--thread-rate",
        default=defaults.thread_rate,
        help="thread_rate_limit of the calls into the rate-limited threads",
    )
    for name in (
        "workers",
        "concurrency",
        "threads",
        "seed",
        "redis_restarts",
        "partitions",
        "rate_threads",
        "hold_threads",
    ):
        parser.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(defaults, name))
    for name in (
        "rate",
        "keepalive",
        "dispatch_interval",
        "release_timeout",
        "visibility",
        "retry_delay",
        "kill_every",
        "child_kill_every",
        "delete_every",
        "operate_every",
        "outage",
        "operator_every",
        "partition",
        "quiesce_timeout",
    ):
        parser.add_argument("--" + name.replace("_", "-"), type=float, default=getattr(defaults, name))
    parser.add_argument(
        "--no-ack",
        action="store_true",
        help="declare the queue Queue(name, no_ack=True): deliveries the workers "
        "hold are forgotten by the broker, and only the gate recovers them",
    )
    parser.add_argument(
        "--no-results",
        dest="backend",
        action="store_false",
        help="run without a result backend (the stored results are not checked)",
    )
    parser.add_argument("--json", dest="json_path")
    parser.add_argument("--workdir")
    parser.add_argument("--keep", action="store_true", help="keep the logs of a clean run too")
    parser.add_argument("--quiet", action="store_true")
    opts = Options(**vars(parser.parse_args(argv)))

    def terminate(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)  # unwinds through run()'s clean-up

    signal.signal(signal.SIGTERM, terminate)
    report = run(opts)
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
