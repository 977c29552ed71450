"""A gate's Redis that may evict keys is named at start: by workers and beat in their logs, by a
producer at its first call, by ``celery threads stats`` (text, ``--json``, exit status).

Real redis-servers started with ``--maxmemory-policy allkeys-lru`` (and ``noeviction`` as the
quiet control), a ``volatile-lru`` one (a warning), one that will not say (an ACL user without
``+info``, ``CONFIG`` renamed away), and the masters of a Sentinel and of a Cluster.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from celery_threads import Threads
from celery_threads.gate import eviction as eviction_module
from celery_threads.gate import make_client
from celery_threads.gate.access import acl_rules
from celery_threads.gate.eviction import check_eviction, eviction_risks
from tests.conftest import Deployment, RedisServer, configure_client, deployment_env
from tests.support.helpers import tid
from tests.support.isolated import pointed_at
from tests.support.topologies import MASTER

ROOT = Path(__file__).resolve().parents[2]
LIMIT = ("--maxmemory", "64mb")
FIX = "CONFIG SET maxmemory-policy noeviction"


def _server(*args: str) -> Iterator[RedisServer]:
    server = RedisServer(args=args)
    server.start()
    try:
        yield server
    finally:
        server.stop()
        shutil.rmtree(server.dir, ignore_errors=True)


@pytest.fixture(scope="module")
def evicting() -> Iterator[RedisServer]:
    yield from _server(*LIMIT, "--maxmemory-policy", "allkeys-lru")


@pytest.fixture(scope="module")
def quiet() -> Iterator[RedisServer]:
    yield from _server(*LIMIT, "--maxmemory-policy", "noeviction")


@pytest.fixture
def fresh_check() -> Iterator[None]:
    """Each process checks once per server: this test's process checks again."""
    eviction_module._found.clear()
    yield
    eviction_module._found.clear()


def _deployment(server: RedisServer, redis_server: RedisServer, proj: Any) -> Deployment:
    name = uuid.uuid4().hex[:8]
    d = Deployment(
        deployment_env(
            server, CT_KEY_PREFIX=f"ct-{name}", CT_QUEUE=f"q-{name}", CT_HISTORY_URL=redis_server.url(0)
        )
    )
    configure_client(proj.app, **d.env)
    return d


def _said(output: str, server: RedisServer) -> list[str]:
    return [
        line
        for line in output.splitlines()
        if f"gate's Redis at 127.0.0.1:{server.port} has maxmemory-policy" in line
    ]


@pytest.mark.parametrize("pool", ["prefork", "threads"])
def test_a_worker_and_beat_on_an_evicting_redis_log_an_error_and_keep_running(
    evicting: RedisServer, redis_server: RedisServer, proj: Any, pool: str
) -> None:
    """The worker logs one ERROR (its pool processes inherit the check) naming the server, the
    policy and the fix, and runs members as before; beat logs the same at its start."""
    d = _deployment(evicting, redis_server, proj)
    try:
        worker = d.worker(pool=pool)
        beat = d.beat()
        assert proj.record.delay(tid("evicting"), "runs").get(timeout=30) == "runs"
        for proc in (worker, beat):
            [line] = _said(proc.output(), evicting)
            assert "ERROR/MainProcess] celery-threads: " in line
            assert "'allkeys-lru' with maxmemory 64mb" in line and FIX in line
            assert "waiting members" in line and "PENDING" in line
        assert worker.proc is not None and worker.proc.poll() is None
    finally:
        d.stop()
        configure_client(proj.app, **deployment_env(redis_server))


def test_a_worker_and_beat_on_a_noeviction_redis_say_nothing_of_it(
    quiet: RedisServer, redis_server: RedisServer, proj: Any
) -> None:
    d = _deployment(quiet, redis_server, proj)
    try:
        worker = d.worker()
        beat = d.beat()
        assert proj.record.delay(tid("quiet"), "runs").get(timeout=30) == "runs"
        for proc in (worker, beat):
            assert "maxmemory-policy" not in proc.output()
        # Its ticks are logged at DEBUG: beat says once, at INFO, that its entry is there.
        assert "celery-threads: beat sends celery_threads.dispatch every " in beat.output()
    finally:
        d.stop()
        configure_client(proj.app, **deployment_env(redis_server))


def test_a_gate_without_an_append_only_file_is_warned_of_once(
    quiet: RedisServer, proj: Any, fresh_check: None, caplog: pytest.LogCaptureFixture
) -> None:
    """A gate restarted without persistence lost every member without an error anywhere (their
    results PENDING for good), and one restored from an older RDB snapshot ran members again,
    two of a thread at once: nothing said at start that the gate's Redis keeps no append-only
    file."""
    caplog.set_level(logging.INFO, logger="celery_threads")
    with _point(proj.app, quiet):  # appendonly no
        for n in range(2):
            proj.record.delay(tid("aof"), f"m{n}")
    said = [r for r in caplog.records if "append-only file" in r.getMessage()]
    assert [r.levelno for r in said] == [logging.WARNING], said
    assert f"127.0.0.1:{quiet.port}" in said[0].getMessage() and "appendonly yes" in said[0].getMessage()
    caplog.clear()
    eviction_module._found.clear()
    client = redis.Redis(port=quiet.port)
    client.config_set("appendonly", "yes")
    try:
        with _point(proj.app, quiet):
            proj.record.delay(tid("aof"), "m")
        assert not [r for r in caplog.records if "append-only file" in r.getMessage()]
    finally:
        client.config_set("appendonly", "no")


def _point(app: Any, server: RedisServer) -> Any:
    return pointed_at(
        app, threads_redis_url=server.url(0), broker_url=server.url(1), result_backend=server.url(2)
    )


def test_a_producer_logs_it_once_at_its_first_call(
    evicting: RedisServer, quiet: RedisServer, proj: Any, fresh_check: None, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="celery_threads")
    thread = tid("producer")
    with _point(proj.app, evicting):
        results = [proj.record.delay(thread, f"m{n}") for n in range(3)]
        info = Threads(proj.app).get(thread)
    assert info is not None and [info.active.task_id, *(m.task_id for m in info.waiting)] == [
        r.id for r in results
    ]  # stored as before: the check only says
    said = [r for r in caplog.records if "maxmemory-policy" in r.getMessage()]
    assert [r.levelno for r in said] == [logging.ERROR], said
    assert f"127.0.0.1:{evicting.port}" in said[0].getMessage()
    assert "'allkeys-lru'" in said[0].getMessage() and FIX in said[0].getMessage()

    caplog.clear()
    with _point(proj.app, quiet):
        proj.record.delay(tid("producer"), "m0")
    assert not [r for r in caplog.records if "maxmemory" in r.getMessage()]


def _celery(server: RedisServer, *args: str) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "CT_REDIS_URL": server.url(0),
        "CT_BROKER_URL": server.url(1),
        "CT_BACKEND_URL": server.url(2),
        "PYTHONPATH": str(ROOT),
        "COLUMNS": "100",
    }
    return subprocess.run(
        [sys.executable, "-m", "celery", "-A", "tests.support.proj", "threads", *args],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_stats_shows_an_evicting_redis_and_exits_4(evicting: RedisServer, quiet: RedisServer) -> None:
    done = _celery(evicting, "stats")
    assert done.returncode == 4, done.stdout + done.stderr
    shown = " ".join(done.stdout.split())
    assert (
        f"ERROR: the gate's Redis at 127.0.0.1:{evicting.port} has maxmemory-policy "
        "'allkeys-lru' with maxmemory 64mb"
    ) in shown and FIX in shown
    assert "allkeys-lru" in done.stderr  # the log line every command prints too
    assert "allkeys-lru" in _celery(evicting, "ls").stderr

    done = _celery(evicting, "stats", "--json")
    assert done.returncode == 4, done.stderr
    data = json.loads(done.stdout)
    [risk] = data["eviction"]
    assert (risk["server"], risk["policy"], risk["maxmemory"], risk["level"]) == (
        f"127.0.0.1:{evicting.port}",
        "allkeys-lru",
        64 << 20,
        "error",
    )
    assert data["healthy"] is False and data["stuck_threads"] == []

    for args in (("stats",), ("stats", "--json")):
        done = _celery(quiet, *args)
        assert done.returncode == 0, done.stdout + done.stderr
        assert "maxmemory" not in done.stdout + done.stderr
    data = json.loads(done.stdout)
    assert data["eviction"] == [] and data["healthy"] is True


def test_stats_warns_of_a_gate_without_an_append_only_file(quiet: RedisServer) -> None:
    """A warning in stats' report (and its JSON), not an unhealthy status; the other commands do
    not repeat it on stderr."""
    done = _celery(quiet, "stats")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "WARNING: the gate's Redis at" in done.stdout
    assert "keeps no append-only file" in " ".join(done.stdout.split())
    data = json.loads(_celery(quiet, "stats", "--json").stdout)
    assert data["healthy"] is True and "appendonly yes" in data["persistence"][0]
    assert "append-only" not in _celery(quiet, "ls").stderr


def test_stats_says_a_full_noeviction_redis_is_not_healthy() -> None:
    """A noeviction server at its maxmemory evicts nothing but refuses every write: no member can
    be stored or end.  ``stats`` said it was healthy.  Where its reads get through (Redis 6.2 runs
    a script until its first write), the eviction check says it is full and stats exits 4; where
    they do not (Redis 7 refuses a function without the no-writes flag at once), stats exits as
    for a Redis out of memory."""
    for full in _server("--maxmemory", "1", "--maxmemory-policy", "noeviction"):
        done = _celery(full, "stats", "--json")
        data = json.loads(done.stdout)
        if done.returncode == 4:
            [risk] = data["eviction"]
            assert (risk["policy"], risk["level"]) == ("noeviction", "error"), risk
            assert " is full" in risk["message"] and data["healthy"] is False
        else:
            assert (done.returncode, data["kind"]) == (75, "out_of_memory"), done.stdout + done.stderr


def test_volatile_policies_are_a_warning_not_an_error(
    proj: Any, fresh_check: None, caplog: pytest.LogCaptureFixture
) -> None:
    """volatile-* evicts only keys with a TTL: of the gate's, only the ended index has one."""
    for server in _server(*LIMIT, "--maxmemory-policy", "volatile-lru"):
        done = _celery(server, "stats", "--json")
        assert done.returncode == 0, done.stderr
        data = json.loads(done.stdout)
        [risk] = data["eviction"]
        assert (risk["policy"], risk["level"], data["healthy"]) == ("volatile-lru", "warning", True)
        assert "recently ended members" in risk["message"] and FIX in risk["message"]
        caplog.set_level(logging.INFO, logger="celery_threads")
        with _point(proj.app, server):
            proj.record.delay(tid("volatile"), "m0")
        said = [r for r in caplog.records if "maxmemory-policy" in r.getMessage()]
        assert [r.levelno for r in said] == [logging.WARNING]
        # allkeys-* without a maxmemory evicts nothing yet: a warning too.
        admin = redis.Redis(port=server.port)
        admin.config_set("maxmemory-policy", "allkeys-lru")
        admin.config_set("maxmemory", 0)
        [risk] = eviction_risks(make_client(server.url(0), {}))
        assert (risk.level, risk.maxmemory) == ("warning", 0)
        assert "no maxmemory yet" in risk.message


def test_a_server_that_will_not_say_is_a_warning_and_the_gate_works(
    proj: Any, fresh_check: None, caplog: pytest.LogCaptureFixture
) -> None:
    """CONFIG renamed away (as managed services do) and an ACL user without +info: the check
    warns that it could not read the policy, says how to let it, and the gate works; with +info
    back, INFO alone reads it."""
    for server in _server(*LIMIT, "--maxmemory-policy", "allkeys-lru", "--rename-command", "CONFIG", ""):
        prefix, user = f"ct-{uuid.uuid4().hex[:6]}", f"gate-{uuid.uuid4().hex[:6]}"
        admin = redis.Redis(port=server.port)
        admin.execute_command(*acl_rules(prefix, user, "pw").split())
        admin.execute_command("ACL", "SETUSER", user, "-info")
        url = f"redis://{user}:pw@127.0.0.1:{server.port}/0"
        caplog.set_level(logging.INFO, logger="celery_threads")
        with pointed_at(
            proj.app,
            threads_redis_url=url,
            threads_key_prefix=prefix,
            broker_url=server.url(1),
            result_backend=server.url(2),
        ):
            thread = tid("unread")
            result = proj.record.delay(thread, "m0")
            info = Threads(proj.app).get(thread)
        assert info is not None and info.active is not None and info.active.task_id == result.id
        said = [r for r in caplog.records if "maxmemory-policy" in r.getMessage()]
        assert [r.levelno for r in said] == [logging.WARNING], said
        message = said[0].getMessage()
        assert "could not read the maxmemory-policy" in message and "+info" in message
        assert "INFO: " in message and "CONFIG GET: " in message

        admin.execute_command("ACL", "SETUSER", user, "+info")
        [risk] = eviction_risks(make_client(url, {}))
        assert (risk.policy, risk.level) == ("allkeys-lru", "error")


def test_every_master_of_a_cluster_is_checked(redis_cluster: Any, fresh_check: None) -> None:
    """Each master evicts on its own: the one with an evicting policy is named."""
    url = redis_cluster.url()
    client = make_client(url, {"cluster": True})
    assert eviction_risks(client) == []
    port = redis_cluster.ports[1]
    node = redis_cluster.node(port)
    before = node.config_get("maxmemory*")
    node.config_set("maxmemory", 64 << 20)
    node.config_set("maxmemory-policy", "allkeys-lfu")
    try:
        [risk] = check_eviction(client, url)
        assert (risk.server, risk.policy, risk.level) == (f"127.0.0.1:{port}", "allkeys-lfu", "error")
        assert check_eviction(client, url) == [risk]  # once per process
    finally:
        node.config_set("maxmemory-policy", before["maxmemory-policy"])
        node.config_set("maxmemory", before["maxmemory"])


def test_a_sentinel_gate_is_checked_on_its_master(sentinel_setup: Any) -> None:
    master = redis.Redis(port=sentinel_setup.master_port)
    master.config_set("maxmemory", 64 << 20)
    master.config_set("maxmemory-policy", "allkeys-random")
    client = make_client(sentinel_setup.url(0), {"master_name": MASTER})
    [risk] = eviction_risks(client)
    assert (risk.server, risk.policy, risk.level) == (
        f"127.0.0.1:{sentinel_setup.master_port}",
        "allkeys-random",
        "error",
    )


def test_a_full_noeviction_gate_still_ends_and_renews_what_it_holds() -> None:
    """At its maxmemory a noeviction server refuses new members, but the members it holds still
    renew their leases, end and release the next: it refused those too, so a member that had
    run could not end (its lease lapsed and it ran again) and nothing drained the gate."""
    from celery_threads.gate import Gate
    from celery_threads.keys import Keys

    for full in _server("--maxmemory-policy", "noeviction"):
        client = make_client(full.url())
        if int(client.info("server")["redis_version"].split(".")[0]) < 7:
            pytest.skip("function flags need Redis 7")
        gate = Gate(client, Keys("oom"), release_timeout_ms=60_000, keepalive_ms=30_000)
        dying = gate.enqueue("d", "dead", b"m0").release
        assert dying is not None and gate.kill("d", "dead", dying.token, {"exception": "x"}).done
        first = gate.enqueue("t", "first", b"m1").release
        gate.enqueue("t", "second", b"m2")
        assert first is not None and gate.claim("t", "first", first.token, "w") == 1
        client.config_set("maxmemory", max(1, int(client.info("memory")["used_memory"]) - 100_000))
        with pytest.raises(redis.exceptions.OutOfMemoryError):
            gate.enqueue("t", "third", b"m3")
        assert gate.renew("t", "first", first.token) == 1
        second = gate.finish("t", "first", first.token).release
        assert second is not None and second.task_id == "second"
        assert gate.claim("t", "second", second.token, "w") == 1
        assert gate.finish("t", "second", second.token).done
        assert not client.keys("oom:*:t:t:*")  # the thread's keys are gone
        # The health check's counts, and forgetting dead letters (which frees memory), too:
        # whatever a MULTI queues was refused.
        shard = gate.keys.shard(0)
        assert gate.reads.index_counts(shard, 0, 0)["dead"] == 1
        assert gate.forget_batch(shard, gate.reads.last_death(shard), 10) == ["dead"]


def test_a_delete_on_a_full_gate_is_done_and_says_so(isolated_app: Any) -> None:
    """The member left, but the note for Flower's task-revoked event (a plain SET) was refused:
    the delete raised as if nothing was done, and REVOKED was never stored (PENDING for good)."""
    for full in _server("--maxmemory-policy", "noeviction"):
        client = make_client(full.url())
        if int(client.info("server")["redis_version"].split(".")[0]) < 7:
            pytest.skip("function flags need Redis 7")
        with pointed_at(isolated_app, threads_redis_url=full.url()):
            thread = tid("oom")
            holder = Threads(isolated_app)
            from tests.support.proj import record

            first = record.apply_async((thread, "first"))
            doomed = record.apply_async((thread, "doomed"))
            client.config_set("maxmemory", max(1, int(client.info("memory")["used_memory"]) - 100_000))
            assert holder.delete(doomed.id) is True
            assert doomed.state == "REVOKED"
            assert holder.delete(first.id) is True
