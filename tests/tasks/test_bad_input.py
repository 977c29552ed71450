"""Bad input and outages: thread ids Python cannot turn into the gate's text, messages workers
cannot decode, task names no worker knows, the gate's Redis unreachable when publishing and while
workers finish members.

(The plainer invalid thread ids and arguments the serializer refuses are in test_publishing.py.)

The workers run :mod:`tests.support.chaos_tasks`, whose history lives on a redis-server of its own, so
that stopping the gate's Redis does not stop the tasks from recording; the broker lives there too
(``redis-apart``), so that an outage of the gate is only that.
"""

from __future__ import annotations

import enum
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

from celery_threads import InvalidArgument, InvalidThreadId, ThreadedTask, Threads, ThreadsError
from celery_threads.errors import GateUnavailable
from celery_threads.publish import CapturingProducer, decode_envelope
from celery_threads.runtime import get_runtime
from tests.chaos import Cluster, Options, parse_history
from tests.conftest import IN_CI
from tests.support.checker import Limits, check
from tests.support.helpers import assert_serial, starts, tid, wait_for
from tests.support.isolated import BROKER_DB, GATE_DB, pointed_at
from tests.support.netfault import Relay


def _cluster(tmp: Path, **options: Any) -> Iterator[Cluster]:
    if not (shutil.which("redis-server") or Path("/usr/bin/redis-server").exists()):
        if IN_CI:
            pytest.fail("redis-server is required in CI")
        pytest.skip("redis-server is not available")
    settings = {
        "broker": "redis-apart",
        "workers": 1,
        "concurrency": 2,
        "beat": False,
        "backend": True,
        "quiet": True,
        **options,
    }
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
    yield from _cluster(
        tmp_path_factory.mktemp("bad-input"), keepalive=3.0, release_timeout=2.0, dispatch_interval=0.2
    )


@pytest.fixture
def tasks(cluster: Cluster) -> Any:
    from tests.support import chaos_tasks

    chaos_tasks.configure(cluster.env)
    return chaos_tasks


def _history(cluster: Cluster, thread: str) -> list[dict[str, Any]]:
    from tests.support.chaos_tasks import HISTORY_KEY, read_history

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
    return (
        f"active: {active and (active.task_id, active.state, active.republished, active.retries)}; "
        f"waiting: {status and [w.task_id for w in status.waiting]}; dead: {dead}; "
        f"history: {[(r['k'], r['task'][:8], r.get('n')) for r in _history(cluster, thread)]}"
    )


# -- thread ids that were refused with the wrong exception, or not accepted ---------------------

BAD_THREAD_IDS = {
    # Python refuses to turn an int of more than 4,300 digits into text (a bare ValueError).
    "int-5001-digits": (10**5000, r"more than 1024 decimal digits.*use a shorter id"),
    "negative-int-5001-digits": (-(10**5000), r"more than 1024 decimal digits.*use a shorter id"),
    "int-1025-digits": (10**1024, r"1025 bytes long.*limit is 1024 bytes.*use a shorter id"),
    # UTF-8 cannot encode a lone surrogate (a UnicodeEncodeError): what surrogateescape leaves.
    "lone-surrogate": ("\ud800", r"lone surrogate.*decode it into valid text"),
    "surrogate-escaped-byte": (
        b"acct-\xff".decode("utf-8", "surrogateescape"),
        r"'\\udcff' at position 5, a lone surrogate.*decode it",
    ),
    # bool is an int, but True as thread "1" (or "True") is a bug, not an id.
    "true": (True, r"is a bool: use a non-empty str, an int or a uuid\.UUID"),
    "false": (False, r"is a bool: use a non-empty str, an int or a uuid\.UUID"),
}


def _nothing_stored_or_sent(app: Any) -> None:
    """The isolated app's gate holds nothing but its shard count, and its broker nothing."""
    port = int(app.conf.threads_redis_url.rsplit(":", 1)[1].split("/")[0])
    meta = get_runtime(app).keys.meta.encode()
    assert set(redis.Redis(port=port, db=GATE_DB).keys()) <= {meta}
    assert redis.Redis(port=port, db=BROKER_DB).dbsize() == 0


@pytest.mark.parametrize("bad,message", list(BAD_THREAD_IDS.values()), ids=list(BAD_THREAD_IDS))
def test_a_thread_id_python_cannot_make_text_of_raises_invalid_thread_id(
    proj: Any, isolated_app: Any, bad: Any, message: str
) -> None:
    """Given as ``thread_id=``, through ``thread_key``, or to the ``Threads`` API: each raises
    InvalidThreadId (a ValueError and a ThreadsError) saying what to do, and nothing is stored
    or sent."""
    calls = {
        "thread_id=": lambda: proj.free.apply_async(("x",), thread_id=bad),
        "thread_key": lambda: proj.record.delay(bad, "x"),
        "Threads.get": lambda: Threads(isolated_app).get(bad),
        "Threads.status": lambda: Threads(isolated_app).status(bad),
    }
    for how, call in calls.items():
        with pytest.raises(InvalidThreadId, match=message) as info:
            call()
        assert isinstance(info.value, ValueError) and isinstance(info.value, ThreadsError), how
        text = str(info.value)
        text.encode("utf-8")  # loggable: the surrogate itself is not in it
        if how != "Threads.get" and how != "Threads.status":
            assert "nothing was stored or sent" in text, text
            # Which task, and where its thread id came from (it said only "thread id None is...").
            named = "its thread_id=" if how == "thread_id=" else "its argument 'thread' (thread_key)"
            assert text.startswith("task tests.support.proj.") and named in text, text
    _nothing_stored_or_sent(isolated_app)


def test_the_longest_int_thread_id_is_accepted(proj: Any, isolated_app: Any) -> None:
    """1,024 digits (and a minus sign with 1,023) are 1,024 bytes: accepted, as their text."""
    for n in (10**1023, -(10**1022)):
        result = proj.free.apply_async(("x",), thread_id=n)
        info = Threads(isolated_app).get(str(n))
        assert info is not None and info.active is not None
        assert info.active.task_id == result.id and info.thread_id == str(n)


def test_a_message_of_many_megabytes_is_stored_and_published_within_a_short_bound(
    proj: Any, isolated_app: Any
) -> None:
    """A call carrying 64 MB of arguments takes Redis time to run (it parses, stores and hands on
    the message): its wait, and the producer's bound, grow with its size (gate.deadline
    ``allowance``).  Before, such a call timed out while Redis ran it: apply_async raised
    GateUnavailable ("the member may be stored whole and will run"), and the member ran.  Here
    the bound is 0.2 s, which the call alone outlasts (a 150 MB message outlasted the default 5 s)."""
    thread = tid("big-message")
    big = "x" * (64 << 20)
    with pointed_at(isolated_app, threads_publish_timeout=0.2):
        result = proj.record.apply_async((thread, big))
    info = Threads(isolated_app).get(thread)
    assert info is not None and info.active is not None and info.active.task_id == result.id
    broker = redis.Redis.from_url(isolated_app.conf.broker_url)
    [queue] = [k for k in broker.keys() if broker.type(k) == b"list"]
    [message] = broker.lrange(queue, 0, -1)
    assert len(message) > len(big) and result.id.encode() in message


def test_a_uuid_thread_id_is_the_thread_of_its_canonical_string(proj: Any, worker: Any) -> None:
    """A uuid.UUID (as thread_id=, or in the thread_key argument) joins the thread named by
    ``str(uuid)``: one thread with the members given by the str, run one at a time, in order, on
    a real worker; the task's argument arrives as a UUID."""
    r = proj.history()
    account = uuid.uuid4()
    thread = str(account)
    first = proj.record.delay(account, "uuid-arg", sleep=0.5)
    wait_for(lambda: starts(r, thread) == ["uuid-arg"], what="the first member to start")
    second = proj.record.delay(thread, "str-arg")
    third = proj.free.apply_async(("uuid-option",), thread_id=account)
    by_uuid, by_text = Threads(proj.app).get(account), Threads(proj.app).get(thread)
    assert by_uuid is not None and by_uuid == by_text and by_uuid.thread_id == thread
    assert by_uuid.active is not None and by_uuid.active.task_id == first.id
    assert [m.task_id for m in by_uuid.waiting] == [second.id, third.id]
    assert [res.get(timeout=30) for res in (first, second, third)] == ["uuid-arg", "str-arg", "uuid-option"]
    assert starts(r, thread) == ["uuid-arg", "str-arg", "uuid-option"]
    assert_serial(r, thread)
    wait_for(lambda: Threads(proj.app).get(account) is None, what="the thread to vanish")


def test_a_str_subclass_thread_id_is_the_thread_of_its_text(proj: Any, worker: Any) -> None:
    """A ``class Region(str, Enum)`` member names the thread of its text ("eu-west"): its f-string
    is "Region.EU", so the gate's keys were named one way and its messages the other; the first
    member's release read as stale on the worker and never ran, and its thread was stuck."""
    thread = f"eu-west-{uuid.uuid4().hex[:8]}"
    region = enum.Enum("R", {"X": thread}, type=str).X  # type: ignore[call-overload]
    results = [proj.free.apply_async((f"m{i}",), thread_id=region) for i in range(2)]
    results.append(proj.record.delay(region, "by thread_key"))
    assert [res.get(timeout=30) for res in results] == ["m0", "m1", "by thread_key"]
    assert Threads(proj.app).get(region) is None and Threads(proj.app).get(thread) is None
    assert f"{region}" != thread  # the case: its f-string is not its text


@pytest.mark.parametrize(
    "task_id, message",
    [
        (b"bytes-id", "is a bytes"),
        (7, "is a int"),
        ("", "is a str"),
        ("id-\udcff", "a lone surrogate"),  # it raised UnicodeEncodeError
    ],
)
def test_a_task_id_that_is_no_str_is_refused(
    proj: Any, isolated_app: Any, task_id: Any, message: str
) -> None:
    """A bytes task id was stored as its text and sent as its repr: the worker took the release
    for stale and the thread was stuck for good.  A uuid.UUID is its canonical string (it raised
    GateUnavailable, the gate "unreachable")."""
    with pytest.raises(InvalidArgument, match=message):
        proj.free.apply_async(("x",), thread_id="t", task_id=task_id)
    _nothing_stored_or_sent(isolated_app)
    as_uuid = uuid.uuid4()
    assert proj.free.apply_async(("x",), thread_id="t", task_id=as_uuid).id == str(as_uuid)
    assert Threads(isolated_app).thread_of(as_uuid) == "t"
    assert Threads(isolated_app).delete(as_uuid) is True


def test_admin_arguments_of_the_wrong_kind_raise_threads_errors(isolated_app: Any) -> None:
    """They raised a bare ValueError, TypeError, AttributeError or redis DataError."""
    threads = Threads(isolated_app)
    for call in (
        lambda: threads.pause("t", reason="\0hold"),
        lambda: threads.pause("t", reason=5),
        lambda: threads.dead(limit=-1),
        lambda: threads.delete(b"x"),
        lambda: threads.delete(5),
        lambda: threads.restart(object()),
        lambda: threads.forget(None),
    ):
        with pytest.raises(InvalidArgument):
            call()
    assert threads.forget(uuid.uuid4()) is False


def test_a_task_id_longer_than_amqp_carries_is_refused_on_rabbitmq(proj: Any, isolated_app: Any) -> None:
    """Its release could never be published (AMQP's correlation_id is at most 255 bytes): the
    member stayed RELEASED, republished and failing, and its thread was stuck for good."""
    with pointed_at(proj.app, broker_url="amqp://guest:guest@127.0.0.1:5672//"):
        with pytest.raises(InvalidArgument, match="255 bytes"):
            proj.free.apply_async(("x",), thread_id="t", task_id="x" * 256)
    _nothing_stored_or_sent(isolated_app)
    # On a Redis broker it is carried whole.
    long_id = "x" * 256
    assert proj.free.apply_async(("x",), thread_id="t", task_id=long_id).id == long_id


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
    if how == "body":  # the serializer cannot decode it
        return json.dumps(header).encode() + b"\n" + body[: len(body) // 2]
    if how == "content-type":  # a content type the workers do not accept
        header["content_type"] = "application/x-python-serialize"
        header["content_encoding"] = "binary"
        return json.dumps(header).encode() + b"\n" + pickle.dumps(json.loads(body))
    assert how == "envelope"  # the stored envelope itself is garbage
    return b"\x00not an envelope\n" + body


@pytest.mark.parametrize("how", ["body", "content-type", "envelope"])
def test_undecodable_stored_message_is_dead_lettered_and_its_thread_moves_on(
    tasks: Any, cluster: Cluster, how: str
) -> None:
    runtime = get_runtime(tasks.app)
    thread, bad_id = _thread(f"undecodable-{how}"), f"bad-{uuid.uuid4().hex[:8]}"
    envelope = _corrupt(_stored_message(tasks, thread, bad_id), how)
    outcome = runtime.gate.enqueue(
        thread, bad_id, envelope, max_retries=tasks.work.max_retries, retry_delay_ms=300
    )
    assert outcome.release is not None
    runtime.publish(outcome.release)
    sibling = tasks.work.delay(thread, "sibling")

    bound = cluster.opts.keepalive + cluster.opts.release_timeout + 2
    threads = Threads(tasks.app)
    if not _eventually(
        lambda: sibling.id in _starts(cluster, thread) and any(d.task_id == bad_id for d in threads.dead()),
        bound,
    ):
        pytest.fail(
            f"the undecodable member ({how}) was not dead-lettered, or its sibling did "
            f"not run, within {bound:g}s: {_state(tasks, cluster, thread)}"
        )
    [dead] = [d for d in threads.dead() if d.task_id == bad_id]
    assert re.search(r"decod|content|serializ|disallow|envelope|json", dead.exception, re.I), (
        f"the dead letter should say why the message could not be decoded: {dead.exception!r}"
    )
    assert bad_id not in _starts(cluster, thread)
    wait_for(lambda: threads.get(thread) is None, what="the thread to vanish")
    _wait_failed(tasks, bad_id)


def _wait_failed(tasks: Any, task_id: str) -> None:
    """A member that died is FAILURE in the result backend (it stayed PENDING)."""
    wait_for(
        lambda: tasks.app.backend.get_task_meta(task_id, cache=False)["status"] == "FAILURE",
        what=f"{task_id} FAILURE in the result backend",
    )


# -- a task name no worker knows -----------------------------------------------------------------


def test_task_name_no_worker_knows_is_dead_lettered_and_its_thread_moves_on(
    tasks: Any, cluster: Cluster
) -> None:
    name = "tests.support.chaos_tasks.only_the_producer_knows_me"
    unknown = tasks.app.tasks.get(name)
    if unknown is None:

        @tasks.app.task(base=ThreadedTask, name=name, thread_key="thread", max_retries=3, shared=False)
        def only_the_producer_knows_me(thread: str) -> None:
            """Registered in this test process only; the workers run an older release."""

        unknown = only_the_producer_knows_me
    thread = _thread("unknown-name")
    orphan = unknown.delay(thread)
    sibling = tasks.work.delay(thread, "sibling")

    bound = cluster.opts.keepalive + cluster.opts.release_timeout + 2
    threads = Threads(tasks.app)
    if not _eventually(lambda: sibling.id in _starts(cluster, thread), bound):
        pytest.fail(
            f"the sibling of a member no worker knows did not run within {bound:g}s: "
            f"{_state(tasks, cluster, thread)}"
        )
    [dead] = [d for d in threads.dead() if d.task_id == orphan.id]
    assert re.search(r"NotRegistered|unregistered|unknown", dead.exception, re.I), dead.exception
    assert dead.name == name
    _wait_failed(tasks, orphan.id)


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


def test_gate_unreachable_when_publishing_raises_and_stores_nothing(tasks: Any, cluster: Cluster) -> None:
    """The producer's client retries for threads_publish_timeout (1 s here) before giving up
    (each way a gate can be dead: test_dead_gate.py)."""
    thread, task_id = _thread("gate-down"), str(uuid.uuid4())
    cluster.gate_server.stop()
    try:
        with pointed_at(tasks.app, threads_publish_timeout=1.0):
            started = time.monotonic()
            with pytest.raises(GateUnavailable) as info:
                tasks.work.apply_async((thread, "while-down"), task_id=task_id)
            elapsed = time.monotonic() - started
    finally:
        cluster.gate_server.start()
        tasks.configure(cluster.env)
    message = str(info.value)
    assert f"127.0.0.1:{cluster.gate_server.port}" in message and "threads_redis_url" in message
    assert "Nothing was sent" in message
    assert elapsed < 2, f"{elapsed:.1f}s: {message}"
    assert _broker_keys_naming(cluster, task_id) == []  # nothing reached the broker
    threads = Threads(tasks.app)
    assert threads.get(thread) is None  # and nothing is in the gate
    # Calling again with the same task id is safe: it runs once.
    tasks.work.apply_async((thread, "again"), task_id=task_id)
    wait_for(
        lambda: any(r["k"] == "fin" for r in _history(cluster, thread)),
        what="the member to run once the gate is back",
    )
    assert _starts(cluster, thread) == [task_id]


# A script call, by its command name (the library's source, sent by FUNCTION LOAD, names both).
SCRIPT_CALLS = (b"\r\nEVALSHA\r\n", b"\r\nFCALL\r\n")


def test_reply_lost_when_publishing_is_safe_to_call_again(
    tasks: Any, cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The gate runs the enqueue script, its reply is lost, and Redis stays unreachable for the
    client's whole retry budget.  apply_async raises GateUnavailable, saying the member may be
    stored (it is, whole: the script is atomic) and that calling again with the same task id is
    safe.  Calling again once Redis is back runs the member exactly once."""
    link = Relay(cluster.gate_server.port)
    thread, task_id = _thread("reply-lost"), str(uuid.uuid4())
    try:
        with pointed_at(tasks.app, threads_redis_url=link.url()):
            tasks.work.delay(_thread("warm-up"), "warm-up")  # the enqueue script is loaded
            slept: list[float] = []
            monkeypatch.setattr(redis.retry, "sleep", slept.append)
            link.lose_reply(*SCRIPT_CALLS, then="refuse")  # a Redis that died with it
            with pytest.raises(GateUnavailable) as info:
                tasks.work.apply_async((thread, "reply-lost"), task_id=task_id)
            monkeypatch.undo()
        assert link.lost == 1
    finally:
        link.close()
        tasks.configure(cluster.env)
    message = str(info.value)
    assert "may be stored" in message and "same task_id is safe" in message, message
    tasks.work.apply_async((thread, "reply-lost"), task_id=task_id)  # the caller retries
    wait_for(
        lambda: task_id in _starts(cluster, thread),
        timeout=cluster.opts.release_timeout + cluster.opts.keepalive + 5,
        what="the member to run",
    )
    wait_for(lambda: Threads(tasks.app).get(thread) is None, what="the thread to vanish")
    assert _starts(cluster, thread) == [task_id]


# -- the gate's Redis down for a few seconds while workers finish members ---------------------


@pytest.fixture
def outage_cluster(tmp_path: Path) -> Iterator[Cluster]:
    """A keepalive well above the outage (the documented requirement), two workers; a
    producer's bound (threads_publish_timeout) well below it, which the workers' own gate calls
    do not keep to."""
    yield from _cluster(
        tmp_path, keepalive=10.0, release_timeout=5.0, dispatch_interval=0.2, workers=2, publish_timeout=1.0
    )


def test_gate_down_while_workers_finish_members_loses_nothing(outage_cluster: Cluster) -> None:
    from tests.support import chaos_tasks

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
        return chaos_tasks.read_history(
            redis.Redis.from_url(cluster.env["CHAOS_HISTORY_URL"]), chaos_tasks.HISTORY_KEY
        )

    wait_for(lambda: sum(r["k"] == "start" for r in history()) >= 3, timeout=30, what="members to be running")
    down = chaos_tasks.record("redis_down")
    cluster.gate_server.stop()
    # Running members finish while the gate is away (their 1 s bodies, or longer on a busy
    # machine).
    wait_for(
        lambda: any(r["k"] == "end" and r["t"] > down for r in history()),
        timeout=30,
        what="a member to end while the gate is away",
    )
    # Read before the start: an ending kept meanwhile may land as soon as the server listens,
    # before the stamp made after start() (a busy machine took 19 ms between the two).
    back = chaos_tasks.now_us()
    cluster.gate_server.start()
    chaos_tasks.record("redis_up")

    wait_for(
        lambda: {r["task"] for r in history() if r["k"] == "fin"} >= set(everything),
        timeout=60,
        what="every member to succeed",
    )
    wait_for(lambda: cluster.gate_busy() == 0, timeout=30, what="the gate to empty")
    rows = history()
    events, enqueues, deletions, _ = parse_history(rows)
    report = check(
        events,
        cluster.gate_state(),
        deletions,
        enqueues,
        Limits(cluster.opts.keepalive, cluster.opts.dispatch_interval, cluster.opts.retry_delay),
    )
    assert report.ok, report.format()
    assert report.succeeded == len(everything) and report.members == len(everything)
    # Members that ended during the outage had their ending applied once the gate came back.
    ended_while_down = [r for r in rows if r["k"] == "end" and down < r["t"] < back]
    assert ended_while_down, "no member ended during the outage; the test proved nothing"
    for r in ended_while_down:
        [fin] = [f for f in rows if f["k"] == "fin" and f["task"] == r["task"]]
        assert fin["t"] > back
    # Each thread ran its members once, in arrival order.
    for t in threads:
        assert [r["task"] for r in rows if r["k"] == "start" and r["thread"] == t] == members[t]


# -- the broker connection breaks under a worker's kept producer ----------------------------------


def test_releases_still_go_out_after_the_broker_connection_breaks(
    proj: Any, isolated_app: Any, redis_server: Any
) -> None:
    """Releases are published through a producer the process keeps.  When its connection breaks,
    the next release still reaches the broker, exactly once or marked as a possible duplicate
    (``thread_republished``), which the receiving worker checks on receipt.  When the broker is
    unreachable for a moment, the direct publish fails and Celery's way (with its retries) sends
    the release, marked."""
    from celery_threads.gate import Release
    from tests.support.isolated import BROKER_DB

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
            link.cut()  # every connection through the link is closed
            runtime.publish(Release("T", "second", "2", 0, capture.envelope))
            runtime.publish(Release("T", "third", "3", 0, capture.envelope))
            link.refuse()  # the broker refuses connections for 0.3 s
            threading.Timer(0.3, link.heal).start()
            runtime.publish(Release("T", "fourth", "4", 0, capture.envelope))
    finally:
        link.close()
    messages = [json.loads(raw) for raw in reversed(broker.lrange(queue, 0, -1))]
    broker.delete(queue)
    tokens = [m["headers"]["thread_token"] for m in messages]
    unmarked = [m["headers"]["thread_token"] for m in messages if not m["headers"].get("thread_republished")]
    assert sorted(set(tokens)) == ["1", "2", "3", "4"], tokens
    assert sorted(unmarked) == sorted(set(unmarked)), f"an unmarked duplicate: {tokens}"
    # The direct publish failed during the outage; Celery's way (with its retries) sent it, marked.
    assert "4" not in unmarked, tokens
