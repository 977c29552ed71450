"""A producer's ``apply_async`` on a dead gate raises ``GateUnavailable`` within
``threads_publish_timeout``, whatever way the gate is dead, and sends nothing.

The gate is a redis-server of the test's own (or a port nobody listens on, or a socket that never
answers); the broker is the test Redis (its private database, tests/support/isolated.py), which stays up.
The bound is set to 1 s to keep the tests short; each call must end within twice that (a loaded
machine), the only timing asserted.  Workers riding out a longer outage: test_bad_input.py
(``test_gate_down_while_workers_finish_members_loses_nothing``, with this bound at 1 s).
"""

from __future__ import annotations

import signal
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from bench.gateunavailable import black_hole as silent_server
from celery_threads import Threads
from celery_threads.errors import ConfigurationError, GateUnavailable, TransportMismatch
from tests.conftest import RedisServer
from tests.support.isolated import BROKER_DB, pointed_at

BOUND = 1.0


@pytest.fixture
def gate_server() -> Iterator[RedisServer]:
    server = RedisServer()
    server.start()
    try:
        yield server
    finally:
        if server.proc is not None:
            server.proc.send_signal(signal.SIGCONT)
        server.stop(kill=True)


@pytest.fixture
def black_hole() -> Iterator[int]:
    """A port whose server accepts connections and never answers."""
    with silent_server() as port:
        yield port


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _unavailable(proj: Any, thread: str, task_id: str) -> tuple[float, str]:
    """Seconds until apply_async raised GateUnavailable, and its message."""
    started = time.monotonic()
    with pytest.raises(GateUnavailable) as info:
        proj.record.apply_async((thread, "x"), task_id=task_id)
    return time.monotonic() - started, str(info.value)


def _broker_holds(redis_server: Any, task_id: str) -> bool:
    broker = redis.Redis(port=redis_server.port, db=BROKER_DB)
    for key in broker.scan_iter(count=1000):
        if broker.type(key) == b"list" and any(task_id.encode() in v for v in broker.lrange(key, 0, -1)):
            return True
    return False


def _stores(server: RedisServer, text: str) -> bool:
    """Whether any key or value of ``server`` mentions ``text``."""
    client = redis.Redis(port=server.port)
    for key in client.scan_iter(count=1000):
        if text.encode() in key or text.encode() in client.dump(key):
            return True
    return False


def _fails_fast(proj: Any, redis_server: Any, url: str, *, calls: int = 1, **settings: Any) -> list[str]:
    """Each of ``calls`` calls raises GateUnavailable naming the URL, within twice the bound, and
    nothing reaches the broker; their messages."""
    messages = []
    with pointed_at(proj.app, threads_redis_url=url, threads_publish_timeout=BOUND, **settings):
        for _ in range(calls):
            task_id = str(uuid.uuid4())
            elapsed, message = _unavailable(proj, f"dead-gate-{uuid.uuid4().hex[:8]}", task_id)
            assert elapsed < 2 * BOUND, f"{elapsed:.1f}s: {message}"
            assert url.split("/")[2] in message and "threads_publish_timeout" in message, message
            assert "Nothing was sent to the broker" in message, message
            assert not _broker_holds(redis_server, task_id)
            messages.append(message)
    return messages


def test_a_gate_never_reachable(proj: Any, isolated_app: Any, redis_server: Any) -> None:
    [message] = _fails_fast(proj, redis_server, f"redis://127.0.0.1:{_free_port()}/0")
    assert "Nothing was stored in the gate either" in message, message
    assert "Connection refused" in message, message


def test_the_error_masks_the_urls_password(proj: Any, isolated_app: Any) -> None:
    """As Celery's own messages do: an exception's text ends up in logs and error trackers."""
    port = _free_port()
    url = f"redis://user:TopSecret@127.0.0.1:{port}/0"
    with pointed_at(proj.app, threads_redis_url=url, threads_publish_timeout=BOUND):
        _, message = _unavailable(proj, f"dead-gate-{uuid.uuid4().hex[:8]}", str(uuid.uuid4()))
    assert "TopSecret" not in message and f"redis://user:**@127.0.0.1:{port}/0" in message, message


def test_a_wrong_password_is_said_at_once_not_retried_as_an_outage(proj: Any, isolated_app: Any) -> None:
    """Credentials the server refused are no outage to ride out: the call is not tried again (the
    server counts each refused AUTH), and the error says what is wrong."""
    server = RedisServer(args=("--requirepass", "right"))
    server.start()
    try:
        url = f"redis://:wrong@127.0.0.1:{server.port}/0"
        # A bound long enough for a dozen retries, were the call retried.
        with pointed_at(proj.app, threads_redis_url=url, threads_publish_timeout=5.0):
            with pytest.raises(ConfigurationError) as info:
                proj.record.apply_async((f"dead-gate-{uuid.uuid4().hex[:8]}", "x"))
        message = str(info.value)
        assert "refused the URL's credentials" in message and "wrong" not in message, message
        log = redis.Redis(port=server.port, password="right").acl_log()
        refused = sum(int(e["count"]) for e in log if e["reason"] == "auth")
        assert 1 <= refused <= 4, log  # once per client of the first use's checks and the call
    finally:
        server.stop()


def test_a_gate_killed_after_use(
    proj: Any, isolated_app: Any, redis_server: Any, gate_server: RedisServer
) -> None:
    """The first call after (its connections were good) and the later ones (they reconnect)."""
    with pointed_at(proj.app, threads_redis_url=gate_server.url(), threads_publish_timeout=BOUND):
        proj.record.apply_async((f"dead-gate-{uuid.uuid4().hex[:8]}", "warm-up"))
        gate_server.stop(kill=True)
        _fails_fast(proj, redis_server, gate_server.url(), calls=3)


def test_rediss_against_a_plain_server(
    proj: Any, isolated_app: Any, redis_server: Any, gate_server: RedisServer
) -> None:
    """The handshake waits out the bound (the server waits for a command line); then the port,
    asked in plain Redis, answers: the error names the mismatch (tests/gate/test_tls_acl.py)."""
    url = f"rediss://127.0.0.1:{gate_server.port}/0"
    settings = {"threads_redis_options": {"ssl_cert_reqs": "none"}, "threads_publish_timeout": BOUND}
    with pointed_at(proj.app, threads_redis_url=url, **settings):
        for _ in range(2):
            task_id = str(uuid.uuid4())
            started = time.monotonic()
            with pytest.raises(TransportMismatch, match="speaks plain Redis, not TLS"):
                proj.record.apply_async((f"dead-gate-{uuid.uuid4().hex[:8]}", "x"), task_id=task_id)
            assert time.monotonic() - started < 2 * BOUND
            assert not _broker_holds(redis_server, task_id)
    assert not _stores(gate_server, "dead-gate")


def test_a_server_that_never_answers(
    proj: Any, isolated_app: Any, redis_server: Any, black_hole: int
) -> None:
    """Also each step of an admin call (Threads: its set-up, then each call) gives up within the
    bound, raising the client's error."""
    url = f"redis://127.0.0.1:{black_hole}/0"
    _fails_fast(proj, redis_server, url, calls=2)
    with pointed_at(proj.app, threads_redis_url=url, threads_publish_timeout=BOUND):
        started = time.monotonic()
        threads = Threads(proj.app)
        assert time.monotonic() - started < 2 * BOUND
        started = time.monotonic()
        with pytest.raises(redis.RedisError):
            threads.get("dead-gate")
        assert time.monotonic() - started < 2 * BOUND


def test_a_stopped_server_may_hold_the_call_and_says_so(
    proj: Any, isolated_app: Any, redis_server: Any, gate_server: RedisServer
) -> None:
    """A server that stops answering after the call was sent (SIGSTOP) runs it once it goes on:
    the error says the member may be stored, and calling again with the same task id stores
    nothing twice."""
    thread, task_id = f"dead-gate-{uuid.uuid4().hex[:8]}", str(uuid.uuid4())
    with pointed_at(proj.app, threads_redis_url=gate_server.url(), threads_publish_timeout=BOUND):
        proj.record.apply_async((f"dead-gate-{uuid.uuid4().hex[:8]}", "warm-up"))
        assert gate_server.proc is not None
        gate_server.proc.send_signal(signal.SIGSTOP)
        try:
            elapsed, message = _unavailable(proj, thread, task_id)
        finally:
            gate_server.proc.send_signal(signal.SIGCONT)
        assert elapsed < 2 * BOUND, f"{elapsed:.1f}s: {message}"
        assert "may be stored" in message and "same task_id is safe" in message, message
        assert not _broker_holds(redis_server, task_id)
        threads = Threads(proj.app)
        info = threads.get(thread)
        assert info is not None and info.active is not None, info  # the call ran, whole
        assert info.active.task_id == task_id and info.waiting == []
        proj.record.apply_async((thread, "x"), task_id=task_id)  # the caller calls again
        info = threads.get(thread)
        assert info is not None and info.active is not None
        assert info.active.task_id == task_id and info.waiting == []


def test_the_bound_is_the_gates_alone(proj: Any, isolated_app: Any, gate_server: RedisServer) -> None:
    """Celery's own part of apply_async (here a before_task_publish handler slower than the bound;
    a result backend's subscription is another) does not spend the gate's time: the call stores its
    member, and is not reported as a gate that did not answer."""
    from celery import signals

    thread = f"slow-celery-{uuid.uuid4().hex[:8]}"

    def slow(sender: Any = None, headers: Any = None, **kwargs: Any) -> None:
        if (headers or {}).get("id") == task_id:
            time.sleep(BOUND * 1.5)

    task_id = str(uuid.uuid4())
    signals.before_task_publish.connect(slow, weak=False)
    try:
        with pointed_at(proj.app, threads_redis_url=gate_server.url(), threads_publish_timeout=BOUND):
            proj.record.apply_async((thread, "slow"), task_id=task_id)
            assert Threads(proj.app).thread_of(task_id) == thread
    finally:
        signals.before_task_publish.disconnect(slow)


def test_a_gate_down_at_first_use_is_checked_once_it_answers(
    proj: Any, isolated_app: Any, redis_server: Any, gate_server: RedisServer
) -> None:
    """A process whose gate did not answer its start-up checks runs them before its first
    transition once it answers, and the dispatcher's tick too: a producer with the wrong
    ``threads_shards`` is refused instead of storing a member under a shard its thread is not in
    (a second active member of the thread); a gate on a client of its own too."""
    from celery_threads.dispatcher import Dispatcher
    from celery_threads.errors import ConfigurationError
    from celery_threads.runtime import get_runtime

    thread = f"late-check-{uuid.uuid4().hex[:8]}"
    with pointed_at(proj.app, threads_redis_url=gate_server.url(), threads_publish_timeout=BOUND):
        proj.record.apply_async((thread, "first"))  # stored under threads_shards=1
    assert gate_server.proc is not None
    settings = {"threads_redis_url": gate_server.url(), "threads_publish_timeout": BOUND}
    with pointed_at(proj.app, **settings, threads_shards=4):
        gate_server.proc.send_signal(signal.SIGSTOP)
        try:
            _unavailable(proj, thread, str(uuid.uuid4()))  # the runtime is made, unchecked
        finally:
            gate_server.proc.send_signal(signal.SIGCONT)
        for _ in range(2):  # each call checks again: none goes through
            with pytest.raises(ConfigurationError, match="threads_shards=1"):
                proj.record.apply_async((thread, "second"))
        with pytest.raises(ConfigurationError, match="threads_shards=1"):
            Dispatcher(get_runtime(proj.app)).tick()
        # A gevent worker's native thread has a gate on a client of its own: checked the same.
        with pytest.raises(ConfigurationError, match="threads_shards=1"):
            get_runtime(proj.app).own_gate().renew(thread, str(uuid.uuid4()), "token")
    with pointed_at(proj.app, threads_redis_url=gate_server.url()):
        info = Threads(proj.app).get(thread)
    assert info is not None and info.active is not None and info.waiting == []
    assert not _stores(gate_server, "second")


@pytest.fixture
def slammer() -> Iterator[int]:
    """A port whose server accepts connections and closes them at once."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)

    def serve() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            conn.close()

    threading.Thread(target=serve, daemon=True).start()
    try:
        yield server.getsockname()[1]
    finally:
        server.close()


def test_a_call_without_a_bound_of_its_own_gives_up_within_the_gates_bound(
    slammer: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker's call (no caller bound) retries at several levels (the hot path's line, the
    connection's connect, the command), each with a retry budget of its own; one bound over the
    call keeps them from adding up, so that its last replay stays within the gate's ENDED_WINDOW.
    The budget is cut to 1 s here (the levels added up to about 6 s before)."""
    from celery_threads.gate import Gate, make_client, transitions
    from celery_threads.gate import client as client_module
    from celery_threads.keys import Keys

    monkeypatch.setattr(client_module, "RETRY_BUDGET", 1.0)
    monkeypatch.setattr(transitions, "CALL_BOUND", 1.5)
    gate = Gate(make_client(f"redis://127.0.0.1:{slammer}/0"), Keys("slammed"), release_timeout_ms=1000)
    started = time.monotonic()
    with pytest.raises(redis.RedisError):
        gate.fail("t", "task", "token", "why")
    elapsed = time.monotonic() - started
    assert elapsed < 2 * 1.5, f"{elapsed:.1f}s"


def test_a_gate_that_answers_with_an_error_is_not_called_unreachable(proj: Any, isolated_app: Any) -> None:
    """A script's error (here a key of another type, as where keys were evicted and written
    again) is an answer: the producer said it could not reach the gate, and to call again once
    it was back."""
    from celery_threads.runtime import get_runtime

    keys = get_runtime(isolated_app).keys
    client = redis.Redis.from_url(isolated_app.conf.threads_redis_url)
    client.delete(keys.shard(0).seq)
    client.hset(keys.shard(0).seq, "x", 1)  # WRONGTYPE for the enqueue's INCR
    try:
        with pytest.raises(GateUnavailable) as info:
            proj.record.apply_async((f"answers-{uuid.uuid4().hex[:8]}", "x"))
    finally:
        client.delete(keys.shard(0).seq)
    message = str(info.value)
    assert "answered the call" in message and "WRONGTYPE" in message, message
    assert "could not reach" not in message


def _paused(server: RedisServer, seconds: float) -> threading.Timer:
    """Stop ``server`` (SIGSTOP) and let it go on after ``seconds``: it reads nothing meanwhile."""
    assert server.proc is not None
    server.proc.send_signal(signal.SIGSTOP)
    resume = threading.Timer(seconds, server.proc.send_signal, (signal.SIGCONT,))
    resume.start()
    return resume


BIG = 64 << 20  # its allowance (gate.deadline): 15.75 s


def test_a_large_message_waits_for_a_server_slow_to_read_it(
    proj: Any, isolated_app: Any, gate_server: RedisServer
) -> None:
    """A call of 64 MB takes its allowance from its first byte: sent to a server that reads
    nothing for a second (busy, or here stopped), it goes through within a bound of 0.2 s
    plus that allowance.  Before, only the wait for the reply had it: the send timed out after
    the socket's timeout or the caller's bound ('Timeout writing to socket'), as a 64 MB call
    to a cluster did on a loaded machine."""
    thread = f"big-slow-{uuid.uuid4().hex[:8]}"
    options = {"socket_timeout": 0.2}
    with pointed_at(
        proj.app,
        threads_redis_url=gate_server.url(),
        threads_publish_timeout=0.2,
        threads_redis_options=options,
    ):
        for _ in range(2):  # the first-use checks, then the hot path's own line, open
            proj.record.apply_async((f"warm-{uuid.uuid4().hex[:8]}", "warm-up"))
        resume = _paused(gate_server, 1.0)
        try:
            result = proj.record.apply_async((thread, "x" * BIG))
        finally:
            resume.join()
    with pointed_at(proj.app, threads_redis_url=gate_server.url()):
        info = Threads(proj.app).get(thread)
        assert info is not None and info.active is not None and info.active.task_id == result.id

        # redis-py's connections (the client's way: an admin call, the cluster's nodes) alike.
        from celery_threads.gate import deadline

        pool = redis.ConnectionPool.from_url(
            gate_server.url(), connection_class=deadline.bounded_class(redis.Connection), socket_timeout=0.2
        )
        client = redis.Redis(connection_pool=pool)
        client.ping()
        resume = _paused(gate_server, 1.0)
        try:
            with deadline.within(0.2):
                assert client.set("big", b"y" * BIG)
        finally:
            resume.join()
        assert client.strlen("big") == BIG
        pool.disconnect()
