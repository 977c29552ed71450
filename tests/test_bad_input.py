"""Bad input and outages: messages workers cannot decode, task names no worker knows, the gate's
Redis unreachable when publishing and while workers finish members.

(Invalid thread ids and arguments the serializer refuses are in test_publishing.py.)

The workers run :mod:`tests.chaos_tasks`, whose history lives on a redis-server of its own, so
that stopping the gate's Redis does not stop the tasks from recording; the broker lives there too
(``redis-apart``), so that an outage of the gate is only that.
"""
from __future__ import annotations

import json
import pickle
import re
import shutil
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import redis.retry
from celery import Task

from celery_threads import ThreadedTask, Threads
from celery_threads.errors import GateUnavailable
from celery_threads.publish import CapturingProducer, decode_envelope
from celery_threads.runtime import get_runtime
from tests.chaos import Cluster, Options, parse_history
from tests.checker import Limits, check
from tests.conftest import IN_CI
from tests.helpers import wait_for
from tests.isolated import pointed_at
from tests.netfault import Relay


def _cluster(tmp: Path, **options: Any) -> Iterator[Cluster]:
    if not (shutil.which("redis-server") or Path("/usr/bin/redis-server").exists()):
        if IN_CI:
            pytest.fail("redis-server is required in CI")
        pytest.skip("redis-server is not available")
    settings = {"broker": "redis-apart", "workers": 1, "concurrency": 2, "beat": False,
                "backend": True, "quiet": True, **options}
    opts = Options(**settings)
    cluster = Cluster(opts, tmp)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.close()
        for d in (cluster.gate_server.dir, cluster.history_server.dir):
            shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """Short keepalive and release timeout: a thread that does not move on shows quickly."""
    yield from _cluster(tmp_path_factory.mktemp("bad-input"), keepalive=3.0,
                        release_timeout=2.0, dispatch_interval=0.2)


@pytest.fixture
def tasks(cluster: Cluster) -> Any:
    from tests import chaos_tasks

    chaos_tasks.configure(cluster.env)
    return chaos_tasks


def _history(cluster: Cluster, thread: str) -> list[dict[str, Any]]:
    from tests.chaos_tasks import HISTORY_KEY, read_history

    client = redis.Redis.from_url(cluster.env["CHAOS_HISTORY_URL"])
    return [r for r in read_history(client, HISTORY_KEY) if r.get("thread") == thread]


def _starts(cluster: Cluster, thread: str) -> list[str]:
    return [r["task"] for r in _history(cluster, thread) if r["k"] == "start"]


def _eventually(condition: Any, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > end:
            return False
        time.sleep(0.1)
    return True


def _thread(tag: str) -> str:
    return f"{tag}-{uuid.uuid4().hex[:8]}"


def _state(tasks: Any, cluster: Cluster, thread: str) -> str:
    """What the gate and the history say about a thread, for a failure message."""
    threads = Threads(tasks.app)
    dead = [(d.task_id, d.exception) for d in threads.dead() if d.thread_id == thread]
    status = threads.status(thread)
    active = status.active if status else None
    return (f"active: {active and (active.task_id, active.state, active.republished, active.retries)}; "
            f"waiting: {status and [w.task_id for w in status.waiting]}; dead: {dead}; "
            f"history: {[(r['k'], r['task'][:8], r.get('n')) for r in _history(cluster, thread)]}")


# -- a stored message that cannot be decoded -----------------------------------------------------

def _stored_message(tasks: Any, thread: str, task_id: str) -> bytes:
    """The envelope apply_async would store for ``work(thread, "bad")``."""
    with tasks.app.producer_or_acquire() as real:
        capture = CapturingProducer(real)
        Task.apply_async(tasks.work, (thread, "bad"), task_id=task_id, producer=capture)
    assert capture.envelope is not None
    return capture.envelope


def _corrupt(envelope: bytes, how: str) -> bytes:
    header, body = decode_envelope(envelope)
    if how == "body":                   # the serializer cannot decode it
        return json.dumps(header).encode() + b"\n" + body[: len(body) // 2]
    if how == "content-type":           # a content type the workers do not accept
        header["content_type"] = "application/x-python-serialize"
        header["content_encoding"] = "binary"
        return json.dumps(header).encode() + b"\n" + pickle.dumps(json.loads(body))
    assert how == "envelope"            # the stored envelope itself is garbage
    return b"\x00not an envelope\n" + body


@pytest.mark.parametrize("how", ["body", "content-type", "envelope"])
def test_undecodable_stored_message_is_dead_lettered_and_its_thread_moves_on(
        tasks: Any, cluster: Cluster, how: str) -> None:
    runtime = get_runtime(tasks.app)
    thread, bad_id = _thread(f"undecodable-{how}"), f"bad-{uuid.uuid4().hex[:8]}"
    envelope = _corrupt(_stored_message(tasks, thread, bad_id), how)
    outcome = runtime.gate.enqueue(thread, bad_id, envelope, max_retries=tasks.work.max_retries,
                                   retry_delay_ms=300)
    assert outcome.release is not None
    runtime.publish(outcome.release)
    sibling = tasks.work.delay(thread, "sibling")

    bound = cluster.opts.keepalive + cluster.opts.release_timeout + 2
    threads = Threads(tasks.app)
    if not _eventually(lambda: sibling.id in _starts(cluster, thread)
                       and any(d.task_id == bad_id for d in threads.dead()), bound):
        pytest.fail(f"the undecodable member ({how}) was not dead-lettered, or its sibling did "
                    f"not run, within {bound:g}s: {_state(tasks, cluster, thread)}")
    [dead] = [d for d in threads.dead() if d.task_id == bad_id]
    assert re.search(r"decod|content|serializ|disallow|envelope|json", dead.exception, re.I), \
        f"the dead letter should say why the message could not be decoded: {dead.exception!r}"
    assert bad_id not in _starts(cluster, thread)
    wait_for(lambda: threads.get(thread) is None, what="the thread to vanish")


# -- a task name no worker knows -----------------------------------------------------------------

def test_task_name_no_worker_knows_is_dead_lettered_and_its_thread_moves_on(
        tasks: Any, cluster: Cluster) -> None:
    name = "tests.chaos_tasks.only_the_producer_knows_me"
    unknown = tasks.app.tasks.get(name)
    if unknown is None:
        @tasks.app.task(base=ThreadedTask, name=name, thread_key="thread", max_retries=3,
                        shared=False)
        def only_the_producer_knows_me(thread: str) -> None:
            """Registered in this test process only; the workers run an older release."""

        unknown = only_the_producer_knows_me
    thread = _thread("unknown-name")
    orphan = unknown.delay(thread)
    sibling = tasks.work.delay(thread, "sibling")

    bound = cluster.opts.keepalive + cluster.opts.release_timeout + 2
    threads = Threads(tasks.app)
    if not _eventually(lambda: sibling.id in _starts(cluster, thread), bound):
        pytest.fail(f"the sibling of a member no worker knows did not run within {bound:g}s: "
                    f"{_state(tasks, cluster, thread)}")
    [dead] = [d for d in threads.dead() if d.task_id == orphan.id]
    assert re.search(r"NotRegistered|unregistered|unknown", dead.exception, re.I), dead.exception
    assert dead.name == name


# -- the gate's Redis unreachable when publishing ---------------------------------------------

def _broker_keys_naming(cluster: Cluster, task_id: str) -> list[bytes]:
    broker = redis.Redis.from_url(cluster.env["CHAOS_BROKER_URL"])
    found = []
    for key in broker.scan_iter(count=1000):
        kind = broker.type(key)
        if kind == b"list":
            values = broker.lrange(key, 0, -1)
        elif kind == b"hash":
            values = broker.hvals(key)
        elif kind == b"zset":
            values = broker.zrange(key, 0, -1)
        else:
            values = []
        if any(task_id.encode() in v for v in values):
            found.append(key)
    return found


def test_gate_unreachable_when_publishing_raises_and_stores_nothing(
        tasks: Any, cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    """The gate's client retries for ~17 s before giving up; its backoff sleeps are recorded
    instead of slept, so the whole retry policy runs in a moment."""
    slept: list[float] = []
    monkeypatch.setattr(redis.retry, "sleep", slept.append)
    thread, task_id = _thread("gate-down"), str(uuid.uuid4())
    cluster.gate_server.stop()
    try:
        started = time.monotonic()
        with pytest.raises(GateUnavailable) as info:
            tasks.work.apply_async((thread, "while-down"), task_id=task_id)
        elapsed = time.monotonic() - started
    finally:
        cluster.gate_server.start()
    message = str(info.value)
    assert f"127.0.0.1:{cluster.gate_server.port}" in message and "threads_redis_url" in message
    assert "Nothing was sent" in message
    assert sum(slept) > 10, f"the client gave up after {sum(slept):.1f}s of backoff: {slept}"
    assert elapsed < 5
    assert _broker_keys_naming(cluster, task_id) == []      # nothing reached the broker
    threads = Threads(tasks.app)
    assert threads.get(thread) is None                     # and nothing is in the gate
    monkeypatch.undo()
    # Calling again with the same task id is safe: it runs once.
    tasks.work.apply_async((thread, "again"), task_id=task_id)
    wait_for(lambda: any(r["k"] == "fin" for r in _history(cluster, thread)),
             what="the member to run once the gate is back")
    assert _starts(cluster, thread) == [task_id]


# A script call, by its command name (the library's source, sent by FUNCTION LOAD, names both).
SCRIPT_CALLS = (b"\r\nEVALSHA\r\n", b"\r\nFCALL\r\n")


def test_reply_lost_when_publishing_is_safe_to_call_again(
        tasks: Any, cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    """The gate runs the enqueue script, its reply is lost, and Redis stays unreachable for the
    client's whole retry budget.  apply_async raises GateUnavailable, saying the member may be
    stored (it is, whole: the script is atomic) and that calling again with the same task id is
    safe.  Calling again once Redis is back runs the member exactly once."""
    link = Relay(cluster.gate_server.port)
    thread, task_id = _thread("reply-lost"), str(uuid.uuid4())
    try:
        with pointed_at(tasks.app, threads_redis_url=link.url()):
            tasks.work.delay(_thread("warm-up"), "warm-up")   # the enqueue script is loaded
            slept: list[float] = []
            monkeypatch.setattr(redis.retry, "sleep", slept.append)
            link.lose_reply(*SCRIPT_CALLS, then="refuse")   # a Redis that died with it
            with pytest.raises(GateUnavailable) as info:
                tasks.work.apply_async((thread, "reply-lost"), task_id=task_id)
            monkeypatch.undo()
        assert link.lost == 1
    finally:
        link.close()
        tasks.configure(cluster.env)
    message = str(info.value)
    assert "may be stored" in message and "same task_id is safe" in message, message
    tasks.work.apply_async((thread, "reply-lost"), task_id=task_id)     # the caller retries
    wait_for(lambda: task_id in _starts(cluster, thread),
             timeout=cluster.opts.release_timeout + cluster.opts.keepalive + 5,
             what="the member to run")
    wait_for(lambda: Threads(tasks.app).get(thread) is None, what="the thread to vanish")
    assert _starts(cluster, thread) == [task_id]


# -- the gate's Redis down for a few seconds while workers finish members ---------------------

@pytest.fixture
def outage_cluster(tmp_path: Path) -> Iterator[Cluster]:
    """A keepalive well above the outage (the documented requirement), two workers."""
    yield from _cluster(tmp_path, keepalive=10.0, release_timeout=5.0, dispatch_interval=0.2,
                        workers=2)


def test_gate_down_while_workers_finish_members_loses_nothing(outage_cluster: Cluster) -> None:
    from tests import chaos_tasks

    cluster = outage_cluster
    chaos_tasks.configure(cluster.env)
    threads = [_thread("outage") for _ in range(4)]
    members: dict[str, list[str]] = {t: [] for t in threads}
    for i in range(3):
        for t in threads:
            lo = chaos_tasks.now_us()
            result = chaos_tasks.work.delay(t, f"m{i}", sleep=1.0)
            chaos_tasks.record("enq", task=result.id, thread=t, n=0, cd=0, lo=lo)
            members[t].append(result.id)
    everything = [m for ms in members.values() for m in ms]

    def history() -> list[dict[str, Any]]:
        return chaos_tasks.read_history(redis.Redis.from_url(cluster.env["CHAOS_HISTORY_URL"]),
                                        chaos_tasks.HISTORY_KEY)

    wait_for(lambda: sum(r["k"] == "start" for r in history()) >= 3, timeout=30,
             what="members to be running")
    down = chaos_tasks.record("redis_down")
    cluster.gate_server.stop()
    # Running members finish while the gate is away (their 1 s bodies, or longer on a busy
    # machine).
    wait_for(lambda: any(r["k"] == "end" and r["t"] > down for r in history()), timeout=30,
             what="a member to end while the gate is away")
    cluster.gate_server.start()
    up = chaos_tasks.record("redis_up")

    wait_for(lambda: {r["task"] for r in history() if r["k"] == "fin"} >= set(everything),
             timeout=60, what="every member to succeed")
    wait_for(lambda: cluster.gate_busy() == 0, timeout=30, what="the gate to empty")
    rows = history()
    events, enqueues, deletions = parse_history(rows)
    report = check(events, cluster.gate_state(), deletions, enqueues,
                   Limits(cluster.opts.keepalive, cluster.opts.dispatch_interval,
                          cluster.opts.retry_delay))
    assert report.ok, report.format()
    assert report.succeeded == len(everything) and report.members == len(everything)
    # Members that ended during the outage had their ending applied once the gate came back.
    ended_while_down = [r for r in rows if r["k"] == "end" and down < r["t"] < up]
    assert ended_while_down, "no member ended during the outage; the test proved nothing"
    for r in ended_while_down:
        [fin] = [f for f in rows if f["k"] == "fin" and f["task"] == r["task"]]
        assert fin["t"] > up
    # Each thread ran its members once, in arrival order.
    for t in threads:
        assert [r["task"] for r in rows if r["k"] == "start" and r["thread"] == t] == members[t]


# -- the broker connection breaks under a worker's kept producer ----------------------------------

def test_releases_still_go_out_after_the_broker_connection_breaks(proj: Any, isolated_app: Any,
                                                                  redis_server: Any) -> None:
    """Releases are published through a producer the process keeps.  When its connection breaks,
    the next release still reaches the broker, exactly once or marked as a possible duplicate
    (``thread_republished``), which the receiving worker checks on receipt.  When the broker is
    unreachable for a moment, the direct publish fails and Celery's way (with its retries) sends
    the release, marked."""
    from celery_threads.gate import Release
    from tests.isolated import BROKER_DB

    link = Relay(redis_server.port)
    broker = redis.Redis(port=redis_server.port, db=BROKER_DB)
    try:
        with pointed_at(isolated_app, broker_url=f"redis://127.0.0.1:{link.port}/{BROKER_DB}"):
            with isolated_app.producer_or_acquire() as real:
                capture = CapturingProducer(real)
                Task.apply_async(proj.record, (_thread("kept"), "x"), producer=capture)
            assert capture.envelope is not None
            runtime = get_runtime(isolated_app)
            queue = isolated_app.conf.task_default_queue
            runtime.publish(Release("T", "first", "1", 0, capture.envelope))
            link.cut()                        # every connection through the link is closed
            runtime.publish(Release("T", "second", "2", 0, capture.envelope))
            runtime.publish(Release("T", "third", "3", 0, capture.envelope))
            link.refuse()                     # the broker refuses connections for 0.3 s
            threading.Timer(0.3, link.heal).start()
            runtime.publish(Release("T", "fourth", "4", 0, capture.envelope))
    finally:
        link.close()
    messages = [json.loads(raw) for raw in reversed(broker.lrange(queue, 0, -1))]
    broker.delete(queue)
    tokens = [m["headers"]["thread_token"] for m in messages]
    unmarked = [m["headers"]["thread_token"] for m in messages
                if not m["headers"].get("thread_republished")]
    assert sorted(set(tokens)) == ["1", "2", "3", "4"], tokens
    assert sorted(unmarked) == sorted(set(unmarked)), f"an unmarked duplicate: {tokens}"
    # The direct publish failed during the outage; Celery's way (with its retries) sent it, marked.
    assert "4" not in unmarked, tokens
