"""The private seams (celery_threads/seams.py): each holds on the installed versions, and where one
is gone or changed the extension falls back to the public path (or a worker refuses to start).

In this process a seam is broken with ``monkeypatch`` on the real library classes; in real
workers through ``celery -A tests.support.seam_faults`` (``CT_BREAK_SEAMS``).  tests/matrix.py runs this
file on the oldest declared versions too.
"""

from __future__ import annotations

import json
import logging
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable

import pytest
import redis

from celery_threads import seams
from celery_threads.gate import Gate, make_client
from celery_threads.keys import Keys
from celery_threads.runtime import get_runtime
from tests.conftest import CeleryProcess
from tests.support.helpers import assert_serial, starts, tid, wait_for
from tests.support.isolated import BROKER_DB


@pytest.fixture(autouse=True)
def fresh_checks(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Each test checks the seams anew (and leaves no broken result behind)."""
    monkeypatch.delenv(seams.OFF_ENV, raising=False)
    seams._results.clear()
    yield
    seams._results.clear()


def test_every_seam_holds_on_the_installed_versions():
    assert seams.report() == {name: None for name in seams.SEAMS}


def test_the_probe_message_is_laid_out_as_the_gate_builds_it(proj, isolated_app, redis_server):
    """The direct-release probe reads a message laid out as lua/_common.lua publish_direct lays
    it out: the same keys in the same order, the same properties, the gate's headers last."""
    runtime = get_runtime(isolated_app)
    assert runtime.gate.direct is not None
    thread = tid("probe")
    proj.record.apply_async((thread, "x"), thread_id=thread)
    [raw] = redis.Redis(port=redis_server.port, db=BROKER_DB).lrange(
        isolated_app.conf.task_default_queue, 0, -1
    )
    built = json.loads(raw)
    probe = json.loads(seams.lua_message("{}", utf8=True))
    assert list(built) == list(probe)
    assert set(built["properties"]) == set(probe["properties"])
    assert built["properties"]["body_encoding"] == "utf-8"
    assert list(built["headers"])[-4:] == list(probe["headers"])[-4:]


def _break_direct_release(mp: pytest.MonkeyPatch) -> None:
    from kombu.transport.virtual.base import Channel

    mp.setattr(Channel, "decode_body", lambda self, body, encoding=None: body)


def _break_settle_fetch(mp: pytest.MonkeyPatch) -> None:
    from kombu.transport.redis import Channel

    mp.delattr(Channel, "_brpop_read")


def _break_handoff(mp: pytest.MonkeyPatch) -> None:
    from celery.worker import request

    mp.setattr(request, "fast_trace_task", lambda *a, **kw: None)


def _break_untracked_releases(mp: pytest.MonkeyPatch) -> None:
    from kombu.transport.redis import QoS

    mp.delattr(QoS, "append")


def _break_revoke_command(mp: pytest.MonkeyPatch) -> None:
    from celery.worker.control import Panel

    mp.delitem(Panel.data, "revoke")


def _break_request_state(mp: pytest.MonkeyPatch) -> None:
    from celery.worker.request import Request

    mp.delattr(Request, "_already_revoked")


def _break_direct_line(mp: pytest.MonkeyPatch) -> None:
    parser = type(redis.Connection()._parser)
    mp.setattr(parser, "parse_error", lambda self, message: redis.ResponseError(message), raising=False)


BREAK: dict[str, Callable[[pytest.MonkeyPatch], None]] = {
    "direct-release": _break_direct_release,
    "handoff": _break_handoff,
    "untracked-releases": _break_untracked_releases,
    "settle-fetch": _break_settle_fetch,
    "revoke-command": _break_revoke_command,
    "request-state": _break_request_state,
    "direct-line": _break_direct_line,
}


def test_seams_turned_off_by_hand_take_their_fallback_but_never_the_utf8_codec(monkeypatch):
    monkeypatch.setenv(seams.OFF_ENV, "all")
    found = seams.report()
    assert found.pop("utf8-bodies") is None
    assert set(found.values()) == {f"turned off ({seams.OFF_ENV})"}


def test_every_seam_with_a_fallback_has_a_fault_here():
    assert set(BREAK) == {n for n, s in seams.SEAMS.items() if s.fallback}


@pytest.mark.parametrize("name", sorted(BREAK))
def test_a_broken_seam_falls_back_with_one_warning(name, monkeypatch, caplog):
    BREAK[name](monkeypatch)
    with caplog.at_level(logging.WARNING, logger="celery_threads.seams"):
        assert not seams.active(name)
        assert not seams.active(name)
    [warning] = [r.getMessage() for r in caplog.records]
    assert name in warning and seams.versions() in warning
    assert seams.SEAMS[name].fallback in warning


def test_kombu_that_cannot_read_utf8_bodies_refuses(monkeypatch):
    import types

    import kombu
    from kombu.transport.virtual.base import Channel

    def decode_body(self: Any, body: Any, encoding: Any = None) -> Any:  # kombu 5.3's
        return self.codecs.get(encoding).decode(body) if encoding else body

    monkeypatch.setattr(Channel, "decode_body", decode_body)
    monkeypatch.setattr(Channel, "codecs", types.MappingProxyType(dict(Channel.codecs)))
    monkeypatch.setattr(kombu, "VERSION", kombu.version_info_t(5, 3, 7, "", ""))
    with pytest.raises(seams.SeamRefused, match="utf8-bodies.*Supported: .*kombu 5.3.7"):
        seams.check_worker(_RedisBrokerApp())


class _RedisBrokerApp:
    @staticmethod
    def connection_for_write() -> Any:
        from kombu import Connection

        return Connection("redis://127.0.0.1:1/0")


def test_the_gate_goes_through_the_client_when_the_direct_line_does_not_hold(proj, redis_server, monkeypatch):
    """A connection whose socket is not a plain socket (what a changed redis-py would give):
    every transition takes the client's way, and works."""
    from tests.support.seam_faults import _Socket  # after proj (the fixture): it imports tests.support.proj

    original = redis.Connection._connect
    monkeypatch.setattr(redis.Connection, "_connect", lambda self: _Socket(original(self)))
    client = make_client(redis_server.url(11))
    gate = Gate(client, Keys(f"seam-{uuid.uuid4().hex[:6]}"), release_timeout_ms=60_000)
    thread, task = tid("line"), str(uuid.uuid4())
    outcome = gate.enqueue(thread, task, b'{"headers":{}}\n{}')
    assert outcome.release is not None
    assert gate.claim(thread, task, outcome.release.token, "w") == 1
    assert gate.finish(thread, task, outcome.release.token).done
    assert gate._line._usable is False
    client.close()


def _faulted_worker(d: Any, faults: str, wait: bool = True) -> CeleryProcess:
    """A worker of deployment ``d`` on libraries with the seams ``faults`` broken."""
    nodename = f"faults-{uuid.uuid4().hex[:6]}@localhost"
    proc = CeleryProcess(
        "worker",
        {**d.env, "CT_BREAK_SEAMS": faults},
        [
            "--loglevel",
            "INFO",
            "-P",
            "prefork",
            "-c",
            "2",
            "-n",
            nodename,
            "--without-gossip",
            "--without-mingle",
        ],
        "faults",
    )
    proc.cmd[proc.cmd.index("tests.support.proj")] = "tests.support.seam_faults"
    proc.nodename = nodename
    d.processes.append(proc.start())
    return proc.wait_ready() if wait else proc


FALLBACKS = ("handoff", "untracked-releases", "revoke-command", "request-state", "direct-line")


def test_a_worker_on_changed_libraries_falls_back_and_keeps_threads_serial(
    proj, make_deployment, redis_server
):
    from tests.support.seam_faults import FAULTS  # after proj: it imports tests.support.proj

    assert set(FALLBACKS) | {"utf8-bodies"} == set(FAULTS)
    d = make_deployment(broker=redis_server.url(3), CT_KEEPALIVE="3", CT_DISPATCH_INTERVAL="0.2")
    worker = _faulted_worker(d, ",".join(FALLBACKS))
    line = next(x for x in worker.output().splitlines() if "private seams on" in x)
    active, fallen = line.split("active: ")[1].split("; fallen back: ")
    assert set(active.split(", ")) == {"direct-release", "utf8-bodies", "settle-fetch"}
    assert {part.split(" (")[0] for part in fallen.split("; ")} == set(FALLBACKS)
    r = proj.history()
    threads = [tid("faults") for _ in range(3)]
    ends = []
    go = f"go:{threads[0]}"  # each m0 held until every call was sent, however slowly
    for t in threads:
        ends.append(proj.record.delay(t, "m0", sleep=0.05, fail_times=1, countdown=0.2, until=go))
        ends.append(proj.record.delay(t, "m1", sleep=0.05))
        ends.append(proj.record.delay(t, "m2", sleep=0.05))
    r.set(go, 1)
    # The revoke command's fallback: a revoked waiting member is dropped when it is released.
    blocked = tid("revoked")
    first = proj.record.delay(blocked, "b0", sleep=2.0)
    doomed = proj.record.delay(blocked, "b1")
    last = proj.record.delay(blocked, "b2")
    wait_for(lambda: starts(r, blocked) == ["b0"], what="the blocker to start")
    proj.app.control.revoke(doomed.id)
    for x in (*ends, first, last):
        x.get(timeout=60)
    for t in threads:
        assert starts(r, t) == ["m0", "m1", "m2", "m0"]
        assert_serial(r, t)
    assert starts(r, blocked) == ["b0", "b2"]
    assert_serial(r, blocked)
    # Read while the server is up: an unread result's subscription, collected after the test's
    # redis-server is gone, makes Celery 5.3's backend retry its reconnection for minutes.
    assert doomed.get(timeout=30, propagate=False) is not None


def test_a_worker_whose_kombu_cannot_read_the_gates_messages_refuses_to_start(make_deployment, redis_server):
    d = make_deployment(broker=redis_server.url(3))
    worker = _faulted_worker(d, "utf8-bodies", wait=False)
    assert worker.proc is not None
    code = worker.proc.wait(60)
    assert code != 0 and code != -signal.SIGKILL
    output = worker.output()
    assert "utf8-bodies" in output and "Supported: celery 5.3.6+, kombu 5.3.7+" in output
    assert "ready." not in output
    d.processes.remove(worker)  # its traceback is the expected outcome


ROOT = Path(__file__).resolve().parents[2]
_POOL_INDEXES = """
import billiard

from celery_threads import seams


def index(_):
    return seams.pool_process_index()


pool = billiard.Pool(2)
try:
    print(sorted(set(pool.map(index, range(40), chunksize=1))))
finally:
    pool.terminate()
    pool.join()
"""


def test_billiard_numbers_its_pool_processes():
    """The lease watchdog's and the handoff's slots are found by the pool process's number
    (``seams.pool_process_index``): a real billiard pool gives each process one, 0 to n - 1.
    The pool is forked from a new interpreter, as a worker's is: forked from this test process,
    whose other tests leave threads behind, a pool process once inherited a lock held by one of
    them and hung."""
    done = subprocess.run(
        [sys.executable, "-c", _POOL_INDEXES], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout)
    assert found and set(found) <= {0, 1}, found
    assert seams.pool_process_index() is None  # not a pool process


def test_forgetting_an_apps_connections_makes_it_build_them_again():
    """``runtime.reset`` (tools and tests) drops Celery's cached pools through
    ``seams.forget_app_connections``: after the broker URL changes, the next use builds them for
    the new broker (nothing connects here)."""
    from celery import Celery

    app = Celery("forget", broker="redis://127.0.0.1:1/0")
    first = app.pool
    app.conf.broker_url = "redis://127.0.0.1:2/0"
    assert app.pool is first  # cached: Celery does not look at the new URL
    seams.forget_app_connections(app)
    assert app.pool is not first
    assert ":2/" in app.pool.connection.as_uri()
    assert ":2/" in app.amqp.producer_pool.connections.connection.as_uri()
