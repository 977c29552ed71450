"""The gate's Redis losing its process or its last writes: what holds (docs/durability.md).

Real workers run members of a few threads whose bodies write their start and end, stamped with the
Redis server's clock, to a history server of their own (tests/support/proj.py ``record``: the body counts
how many members of its thread run at once).  The gate's redis-server is SIGKILLed mid-run and
started again from its append-only file; no member may run while another of its thread runs, and
each ends exactly once.  Lost writes (a crash with ``appendfsync everysec`` of the machine, not
just the process, or a failover without WAIT) are written straight into Redis: a snapshot of the
gate's keys taken before some transitions is restored after them.
"""

from __future__ import annotations

import collections
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any, Callable

import pytest
import redis

from celery_threads.errors import NotReplicated
from celery_threads.gate import NO_HOLDER, Done, Gate, Lapse, Renewal, claimant_prefix
from celery_threads.keys import Keys
from tests.conftest import Deployment, RedisServer, configure_client, deployment_env
from tests.support.helpers import events, tid, wait_for
from tests.support.isolated import point_app

THREADS, MEMBERS, SLEEP = 5, 10, 0.1


def load_env(gate_url: str, history: RedisServer, **overrides: str) -> dict[str, str]:
    """A deployment's environment: the gate at ``gate_url``; broker, results and the history on
    the session's Redis, which no fault touches."""
    name = uuid.uuid4().hex[:8]
    return {
        "CT_REDIS_URL": gate_url,
        "CT_BROKER_URL": history.url(1),
        "CT_BACKEND_URL": history.url(2),
        "CT_HISTORY_URL": history.url(0),
        "CT_KEEPALIVE": "10",
        "CT_DISPATCH_INTERVAL": "0.2",
        "CT_RELEASE_TIMEOUT": "3",
        "CT_KEY_PREFIX": f"ct-{name}",
        "CT_QUEUE": f"q-{name}",
        **overrides,
    }


def run_through_fault(
    proj: Any, env: dict[str, str], history: RedisServer, fault: Callable[[], None], settings: dict[str, Any]
) -> dict[str, Any]:
    """Two prefork workers run ``THREADS`` x ``MEMBERS`` members; ``fault()`` strikes once a
    quarter of them ended.  Every member must end exactly once, none while another member of its
    thread runs (by the bodies' own count, and by their start/end stamps)."""
    d = Deployment(env)
    configure_client(proj.app, **env)
    point_app(proj.app, settings)
    r = proj.history()
    try:
        d.worker("w1", concurrency=2)
        d.worker("w2", concurrency=2)
        threads = [tid("fault") for _ in range(THREADS)]
        for i in range(MEMBERS):
            for thread in threads:
                proj.record.delay(thread, f"m{i}", sleep=SLEEP)
        total = THREADS * MEMBERS

        def ended() -> int:
            return sum(e.kind == "end" for t in threads for e in events(r, t))

        wait_for(lambda: ended() >= total // 4, timeout=60, what="a quarter of the members")
        at_fault = ended()
        fault()
        try:
            wait_for(lambda: ended() >= total, timeout=90, interval=0.2, what="every member to end")
        except AssertionError:
            logs = "\n".join(f"--- {p.name}\n{p.output()[-6000:]}" for p in d.processes)
            raise AssertionError(f"{ended()} of {total} members ended:\n{logs}") from None
        overlaps = [x for x in r.lrange("overlaps", 0, -1) if x.decode().split("|")[0] in threads]
        assert not overlaps, f"members ran at once: {overlaps}"
        for thread in threads:
            evs = events(r, thread)
            ends = collections.Counter(e.label for e in evs if e.kind == "end")
            assert sorted(ends) == sorted(f"m{i}" for i in range(MEMBERS)), (thread, evs)
            assert set(ends.values()) == {1}, f"a member of {thread} ran twice: {evs}"
            for before, after in zip(evs, evs[1:]):  # start, end, start, end... in order
                assert before.kind != after.kind and before.at_us <= after.at_us, evs
        return {"ended_before_fault": at_fault, "total": total, "logs": [p.output() for p in d.processes]}
    finally:
        d.stop()
        configure_client(proj.app, **deployment_env(history))
        point_app(proj.app, {"threads_redis_options": None, "threads_wait_replicas": 0})


def test_a_gate_sigkilled_under_load_restarts_from_its_append_only_file(proj, redis_server):
    """``appendonly yes`` with ``appendfsync everysec`` (Redis's default): the server writes each
    transition to the file before it replies, so a killed process loses no write a caller saw.
    The outage (2 s, within the client's retries) is said in the workers' logs when it ends: no
    line said it."""
    gate = RedisServer(appendonly=True)
    gate.start()
    try:
        client = redis.Redis(port=gate.port)
        assert client.config_get("appendfsync")["appendfsync"] == "everysec"

        def kill_and_restart() -> None:
            gate.stop(kill=True)
            time.sleep(2)  # the outage: its length is the test's own
            gate.start()
            assert client.dbsize() > 0, "the restarted gate read nothing from its file"

        run = run_through_fault(proj, load_env(gate.url(0), redis_server), redis_server, kill_and_restart, {})
        said = [
            line
            for log in run["logs"]
            for line in log.splitlines()
            if "did not answer for" in line and "it answers again" in line
        ]
        assert said and f"127.0.0.1:{gate.port}" in said[0], run["logs"]
        assert (
            "WARNING" in said[0] and max(len(log.split("did not answer for")) - 1 for log in run["logs"]) <= 3
        )
    finally:
        gate.stop(kill=True)


# -- lost writes, written straight into Redis --------------------------------------------------


@pytest.fixture
def gate(redis_server) -> Iterator[Gate]:
    client = redis.Redis(port=redis_server.port, db=12)
    client.flushdb()
    yield Gate(client, Keys(f"ctdur-{uuid.uuid4().hex[:6]}"), release_timeout_ms=5000, keepalive_ms=10_000)
    client.flushdb()


def snapshot(client: redis.Redis) -> dict[bytes, bytes]:
    return {key: client.dump(key) for key in client.keys("*")}  # type: ignore[misc]


def lose_writes_since(client: redis.Redis, before: dict[bytes, bytes]) -> None:
    """The database as it was at ``before``: what a crash forgets of its last writes."""
    for key in client.keys("*"):
        if key not in before:
            client.delete(key)
    for key, value in before.items():
        client.restore(key, 0, value, replace=True)


def test_tokens_never_repeat_across_lost_writes_and_the_first_holder_loses_its_member(gate):
    """A claim and an ending are lost: the member is RELEASED again under its token and another
    delivery claims it.  The first holder's renewal gets NOT_YOURS (its worker stops the member),
    its endings (finish, requeue, its own kill) are refused (they would end the second holder's
    run), and the next member's token is larger than the one the lost ending handed out, so a
    store fenced by tokens never takes a write under a token it has seen for another activation."""
    client = gate.client
    a = gate.enqueue("t", "a", b"A").release
    gate.enqueue("t", "b", b"B")
    assert a is not None and int(a.token) >= int(time.time() * 1_000_000) - 60_000_000
    before = snapshot(client)
    assert gate.claim("t", "a", a.token, "w1", "c1") == 1
    lost = gate.finish("t", "a", a.token, caller="c1").release  # a worker's ending: its claim's
    assert lost is not None and lost.task_id == "b"

    lose_writes_since(client, before)
    active = gate.reads.snapshot("t").active
    assert (active["task"], active["state"], active["token"]) == ("a", "RELEASED", a.token)
    assert gate.claim("t", "a", a.token, "w2", "c2") == 1
    assert gate.renew("t", "a", a.token, "c1") == Renewal.NOT_YOURS
    assert gate.renew("t", "a", a.token, "c2") == Renewal.RENEWED
    # The first worker's ending, sent again: refused, it would end the second worker's run.
    assert gate.finish("t", "a", a.token, caller="c1").status == Done.NOOP
    assert gate.requeue("t", "a", a.token, retries=1, caller="c1").status == Done.NOOP
    assert gate.kill("t", "a", a.token, {"exception": "x"}, caller="c1", fenced=True).status == Done.NOOP
    assert gate.reads.snapshot("t").active["by"] == "c2"
    again = gate.finish("t", "a", a.token, caller="c2").release
    assert again is not None and again.task_id == "b"
    assert int(again.token) > int(lost.token) > int(a.token)


def test_after_a_lost_claim_the_first_workers_main_process_ends_nothing_of_the_second(gate):
    """A worker's main process ends what its pool process ran without knowing the claim (a lost
    pool process, a hard time limit, a message the process could not run): fenced by that
    process's claimant prefix, it cannot end the run another worker claimed under the same token
    after the first claim was lost; the second worker's own main process can."""
    first, second = claimant_prefix("w1@h", 4242), claimant_prefix("w2@h", 4243)
    a = gate.enqueue("t", "a", b"A").release
    gate.enqueue("t", "b", b"B")
    assert a is not None
    before = snapshot(gate.client)
    assert gate.claim("t", "a", a.token, "w1@h", first + "c0ffee") == 1
    lose_writes_since(gate.client, before)
    assert gate.claim("t", "a", a.token, "w2@h", second + "beef00") == 1
    lost = "WorkerLostError: gone; no retries were left"
    assert gate.fail("t", "a", a.token, lost, holder=first).status == Lapse.NOOP
    assert gate.kill("t", "a", a.token, {"exception": "TimeLimitExceeded"}, holder=first).status == Done.NOOP
    assert gate.kill("t", "a", a.token, {"exception": "NotRegistered"}, holder=NO_HOLDER).status == Done.NOOP
    assert gate.reads.snapshot("t").active["by"] == second + "beef00"
    assert gate.fail("t", "a", a.token, lost, holder=second).status == Lapse.RETRIED
    assert gate.reads.snapshot("t").active["task"] == "b"


def test_tokens_stay_increasing_when_the_counter_is_lost(gate):
    """Even with the shard counter gone (a gate restored from an old file), a thread's next
    token is larger than any it had: the counter never falls below the server's clock."""
    tokens = []
    for i in range(3):
        release = gate.enqueue("t", f"m{i}", b"x").release
        assert release is not None
        tokens.append(int(release.token))
        gate.client.delete(gate.keys.shard(0).seq)
        assert gate.claim("t", f"m{i}", release.token, "w", "c") == 1
        assert gate.finish("t", f"m{i}", release.token, caller="c").done
    assert tokens == sorted(set(tokens)), tokens


# -- threads_wait_replicas ------------------------------------------------------------------------


def test_a_transition_no_replica_confirmed_counts_as_not_done(redis_server):
    """Without a replica, ``threads_wait_replicas=1`` makes every transition raise NotReplicated
    (a redis TimeoutError: the callers' paths for a gate that did not answer), on the client's
    way, on the hot path's own connection, and in a pipeline; the call replayed answers as the
    first, once confirmed."""
    client = redis.Redis(port=redis_server.port, db=12)
    client.flushdb()
    gate = Gate(client, Keys("ctwait"), release_timeout_ms=5000, keepalive_ms=1000, wait_replicas=1)
    gate.replicated_budget = 0  # an enqueue is not sent again (see the next test)
    try:
        assert gate.wait == (1, 100)
        started = time.monotonic()
        for _ in range(2):  # the first goes the client's way, the second the direct line's
            with pytest.raises(NotReplicated):
                gate.enqueue("t", "a", b"A")
        with pytest.raises(NotReplicated):
            gate.release_many(["t"])
        assert time.monotonic() - started >= 0.3  # each waited its 100 ms
        plain = Gate(client, Keys("ctwait"), release_timeout_ms=5000)
        assert plain.reads.snapshot("t").active["task"] == "a"  # the master holds it all the same
    finally:
        client.flushdb()


def test_an_enqueue_is_sent_again_until_a_replica_confirms_it(redis_server):
    """A producer's enqueue that no replica confirmed is sent again, backing off, until one
    does (here: a replica attaches meanwhile) or the budget runs out; the gate knows it sent
    again, so the member is stored once."""
    client = redis.Redis(port=redis_server.port, db=12)
    client.flushdb()
    gate = Gate(client, Keys("ctwait"), release_timeout_ms=5000, keepalive_ms=1000, wait_replicas=1)
    gate.replicated_budget = 1.5
    replica = RedisServer()
    delay = client.config_get("repl-diskless-sync-delay")["repl-diskless-sync-delay"]
    try:
        started = time.monotonic()
        with pytest.raises(NotReplicated):
            gate.enqueue("t", "a", b"A")
        # It gives up once its next pause (at most 1 s) would pass the budget, not before: more
        # than 0.5 s, where one send waits 0.1 s (its WAIT's timeout) for the missing replica.
        assert time.monotonic() - started > gate.replicated_budget - 1.0
        gate.replicated_budget = 30
        client.config_set("repl-diskless-sync-delay", 0)
        replica.start()
        attach = threading.Timer(
            0.3, lambda: redis.Redis(port=replica.port).replicaof("127.0.0.1", redis_server.port)
        )
        attach.start()
        assert gate.enqueue("t", "b", b"B").done  # confirmed once the replica is in sync
        attach.join()
        again = gate.enqueue("t", "a", b"A")  # the first one's member, stored then
        assert not again.done and again.release is not None and again.release.task_id == "a"
        plain = Gate(client, Keys("ctwait"), release_timeout_ms=5000)
        assert [task for task, _ in plain.reads.snapshot("t").waiting] == ["b"]
    finally:
        replica.stop()
        client.config_set("repl-diskless-sync-delay", delay)
        client.flushdb()


def test_a_connection_closed_while_wait_blocks_is_left_not_spun_on(redis_server):
    """The master dies (here: its connection is killed) after a transition's reply and before
    WAIT's: the hot path's line gives up on that connection and the call goes the client's way,
    instead of reading a closed socket forever."""
    client = redis.Redis(port=redis_server.port, db=12)
    client.flushdb()
    gate = Gate(client, Keys("ctwait"), release_timeout_ms=5000, keepalive_ms=10_000, wait_replicas=1)
    gate.replicated_budget = 0  # each enqueue is sent once
    outcome: list[Any] = []
    line_open = threading.Event()
    try:

        def call() -> None:
            for task in ("opens-the-line", "a"):  # the client's way; then the thread's line
                try:
                    gate.enqueue("t", task, b"x")
                except NotReplicated as exc:
                    outcome.append(exc)
                line_open.set()

        caller = threading.Thread(target=call, daemon=True)
        caller.start()
        assert line_open.wait(10)
        blocked = wait_for(
            lambda: [c for c in client.client_list() if c["cmd"] == "wait" and "b" in c["flags"]],
            timeout=10,
            interval=0.01,
            what="the line's WAIT",
        )
        client.client_kill_filter(_id=blocked[0]["id"])
        caller.join(15)
        assert not caller.is_alive(), "the call spun on a closed connection"
        assert len(outcome) == 2, outcome
    finally:
        client.flushdb()
