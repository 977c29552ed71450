"""The policies ``on_death="hold"``, ``max_waiting`` and ``thread_rate_limit`` on real prefork
workers, judged by what the bodies wrote (start records stamped with the Redis server's clock,
tests/support/proj.py ``_Span``), by the result backend and by the gate's keys.
"""

from __future__ import annotations

import json
import uuid
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
import redis
from celery.bin.celery import celery as celery_command
from click.testing import CliRunner

from celery_threads import ThreadFull, Threads, ThreadsError
from celery_threads.errors import ConfigurationError
from celery_threads.gate import Claim, Gate, make_client
from celery_threads.keys import Keys
from celery_threads.policies import rate_interval_ms
from tests.support.helpers import assert_serial, events, gate_keys, starts, tid, wait_for


@pytest.fixture
def r(proj):
    return proj.history()


def state(proj, result) -> str:
    """The result backend's state of ``result``, read afresh."""
    return proj.app.backend.get_task_meta(result.id, cache=False)["status"]


def stored(proj, task_id: str) -> bool:
    """Whether the result backend holds anything for ``task_id``."""
    backend = proj.app.backend
    return backend.get(backend.get_key_for_task(task_id)) is not None


def cli_json(*args: str):
    result = CliRunner().invoke(celery_command, ["-A", "tests.support.proj", "threads", *args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def ended(r, thread: str) -> list[str]:
    return [e.label for e in events(r, thread) if e.kind == "end"]


def held_thread(proj, make_deployment, r, name: str, per_call: bool):
    """A thread whose first member dies with on_death="hold" (the task's option, or with
    ``per_call`` the ``apply_async`` option of a task without it) while two more wait behind
    it; returns (thread, dead member, the two waiting).  Checks that the hold holds: the death
    is FAILURE, the thread is paused with a reason naming the dead task and its exception, and
    nothing more of it starts while another thread's members run on the same worker."""
    d = make_deployment(CT_EVENTS="0")
    d.worker(name, concurrency=2)
    thread, other = tid(name), tid(f"{name}-other")
    r.set(f"flaky:{thread}", 1)
    if per_call:
        dead = proj.flaky.apply_async((thread, "d"), on_death="hold")
    else:
        dead = proj.ledger.delay(thread, "d")
    later = [proj.record.delay(thread, f"l{i}") for i in (1, 2)]
    wait_for(lambda: state(proj, dead) == "FAILURE", what="the member to die", timeout=60)
    threads = Threads(proj.app)
    wait_for(lambda: threads.get(thread).paused is not None, what="the hold", timeout=60)
    reason = threads.get(thread).paused
    assert dead.id in reason and "ValueError: d failed" in reason and "on_death=hold" in reason
    # Other threads run on the same worker meanwhile; the held thread starts nothing.
    for i in range(3):
        proj.record.delay(other, f"o{i}")
    wait_for(lambda: ended(r, other) == ["o0", "o1", "o2"], what="another thread to run", timeout=60)
    info = threads.get(thread)
    assert info.active is None and [m.task_id for m in info.waiting] == [x.id for x in later]
    assert starts(r, thread) == ["d"]
    assert [state(proj, x) for x in later] == ["PENDING", "PENDING"]
    assert [x.task_id for x in threads.dead() if x.thread_id == thread] == [dead.id]
    # The command line shows the hold's reason, without its mark.
    assert {"thread_id": thread, "paused": reason}.items() <= next(
        row for row in cli_json("ls", "--paused") if row["thread_id"] == thread
    ).items()
    shown = cli_json("show", thread)
    assert shown["paused"] == reason, shown
    # A hold's way out is its dead member's, not resume alone (which goes on without it).
    text = CliRunner().invoke(celery_command, ["-A", "tests.support.proj", "threads", "show", thread]).output
    assert "its dead member is redriven (`celery -A tests.support.proj threads redrive" in text, text
    r.delete(f"flaky:{thread}")
    return thread, dead, later


def test_hold_then_redrive_runs_the_dead_member_first(proj, make_deployment, r):
    """on_death="hold" as the task's option: the death holds the thread; redrive puts the dead
    member back at its place and lifts the hold: it runs first, then the two that waited."""
    thread, dead, later = held_thread(proj, make_deployment, r, "hold-redrive", per_call=False)
    threads = Threads(proj.app)
    assert threads.redrive(thread) == 1
    for x in [dead, *later]:
        wait_for(lambda x=x: state(proj, x) == "SUCCESS", what=f"{x.id} SUCCESS", timeout=60)
    assert starts(r, thread) == ["d", "d", "l1", "l2"]
    assert_serial(r, thread)
    wait_for(lambda: threads.get(thread) is None, what="the thread to end", timeout=60)
    wait_for(lambda: not gate_keys(r, thread), what="the thread's keys to vanish", timeout=60)


@pytest.mark.parametrize("how", ["restart", "forget", "resume"])
def test_hold_lifted_by_restart_forget_or_resume(proj, make_deployment, r, how):
    """on_death="hold" as an apply_async option: restart re-enters the dead member as a new
    arrival (it runs after the two that waited); forget drops it; resume goes on without it
    (it stays in the dead-letter store).  Each lifts the hold."""
    thread, dead, later = held_thread(proj, make_deployment, r, f"hold-{how}", per_call=True)
    threads = Threads(proj.app)
    if how == "restart":
        threads.restart(dead.id)
    elif how == "forget":
        assert threads.forget(dead.id) is True
    else:
        assert threads.resume(thread) is True
    for x in later:
        wait_for(lambda x=x: state(proj, x) == "SUCCESS", what=f"{x.id} SUCCESS", timeout=60)
    if how == "restart":
        wait_for(lambda: state(proj, dead) == "SUCCESS", what="the restarted member", timeout=60)
        assert starts(r, thread) == ["d", "l1", "l2", "d"]
    else:
        assert starts(r, thread) == ["d", "l1", "l2"]
        assert state(proj, dead) == "FAILURE"
    dead_ids = [x.task_id for x in threads.dead() if x.thread_id == thread]
    assert dead_ids == ([dead.id] if how == "resume" else [])
    assert_serial(r, thread)
    wait_for(lambda: threads.get(thread) is None, what="the thread to end", timeout=60)


def test_an_operator_pause_over_a_hold_stays_until_resume(proj, make_deployment, r):
    """An operator's pause made over a hold is the operator's: a redrive puts the dead member
    back but does not lift it; resume does, and the redriven member runs first."""
    thread, dead, later = held_thread(proj, make_deployment, r, "hold-operator", per_call=False)
    threads = Threads(proj.app)
    assert threads.pause(thread, "auditing the ledger") is False  # replaces the hold
    assert threads.redrive(thread) == 1
    info = threads.get(thread)
    assert info.paused == "auditing the ledger"
    assert [m.task_id for m in info.waiting] == [x.id for x in [dead, *later]]
    with pytest.raises(ValueError):
        threads.pause(thread, "\0forged")
    assert threads.resume(thread) is True
    for x in [dead, *later]:
        wait_for(lambda x=x: state(proj, x) == "SUCCESS", what=f"{x.id} SUCCESS", timeout=60)
    assert starts(r, thread) == ["d", "d", "l1", "l2"]


def test_a_death_under_an_operators_pause_leaves_it_the_operators(proj, make_deployment, r):
    """A member with on_death="hold" dies while an operator's pause is in place: the pause stays
    the operator's, telling of the death.  The death made it a hold, which the dead member's
    forget then lifted: the member behind it ran in the operator's pause (a migration window)."""
    make_deployment(CT_EVENTS="0").worker("hold-under-pause", concurrency=2)
    thread, go = tid("hold-under-pause"), f"go:{tid()}"
    r.set(f"flaky:{thread}", 1)
    dead = proj.ledger.apply_async((thread, "d"), {"until": go})
    later = proj.record.delay(thread, "l1")
    wait_for(lambda: starts(r, thread) == ["d"], what="the member to start")
    threads = Threads(proj.app)
    assert threads.pause(thread, "migration window") is True
    r.set(go, 1)
    wait_for(lambda: state(proj, dead) == "FAILURE", what="the member to die", timeout=60)
    said = "migration window (then on_death=hold: "
    wait_for(lambda: (threads.get(thread).paused or "").startswith(said), what="the death told", timeout=60)
    assert dead.id in threads.get(thread).paused
    assert threads.forget(dead.id) is True
    info = threads.get(thread)
    assert info.paused.startswith(said) and [m.task_id for m in info.waiting] == [later.id]
    assert threads.resume(thread) is True
    assert later.get(timeout=30) == "l1"
    assert starts(r, thread) == ["d", "l1"]
    r.delete(f"flaky:{thread}")


def test_max_waiting_admits_exactly_n_of_concurrent_calls(proj, make_deployment, r):
    """Twelve producers call at once into a thread whose member is running: exactly
    max_waiting=3 are admitted, the others raise ThreadFull and leave nothing in the result
    backend, and never run; a call replayed with an admitted task id is not refused; once the
    running member ends, the three run in order."""
    d = make_deployment(CT_EVENTS="0")
    d.worker("cap", concurrency=2)
    thread = tid("cap")
    running = proj.beater.delay(thread, "hold", seconds=30, until=f"go:{thread}")
    wait_for(lambda: "hold" in starts(r, thread), what="the running member", timeout=60)

    def call(i: int):
        try:
            return proj.record.apply_async((thread, f"c{i}"), max_waiting=3)
        except ThreadFull as exc:
            return exc

    with ThreadPoolExecutor(12) as pool:
        outcomes = list(pool.map(call, range(12)))
    admitted = [o for o in outcomes if not isinstance(o, Exception)]
    refused = [o for o in outcomes if isinstance(o, Exception)]
    assert len(admitted) == 3 and len(refused) == 9, outcomes
    assert all(isinstance(e, ThreadsError) and e.thread_id == thread for e in refused)
    info = Threads(proj.app).get(thread)
    assert sorted(m.task_id for m in info.waiting) == sorted(a.id for a in admitted)
    # Nothing of the refused calls reached the broker: its queue holds no message naming them.
    broker = redis.Redis.from_url(proj.app.conf.broker_url)
    queued = b"".join(broker.lrange(proj.app.conf.task_default_queue, 0, -1))
    broker.close()
    assert not [e.task_id for e in refused if e.task_id.encode() in queued]
    # A replay of an admitted call (its reply lost) is a duplicate, not refused.
    proj.record.apply_async((thread, "replay"), task_id=admitted[0].id, max_waiting=3)
    with pytest.raises(ThreadFull):
        proj.record.apply_async((thread, "late"), max_waiting=3)
    # The running member is not counted: a cap of 4 admits one more.
    extra = proj.record.apply_async((thread, "c-extra"), max_waiting=4)
    r.set(f"go:{thread}", 1)
    for x in [running, *admitted, extra]:
        wait_for(lambda x=x: state(proj, x) == "SUCCESS", what=f"{x.id} SUCCESS", timeout=60)
    labels = {a.id: a.get(timeout=10) for a in admitted}
    assert starts(r, thread) == ["hold", *[labels[m.task_id] for m in info.waiting], "c-extra"]
    ran = {e.task_id for e in events(r, thread)}
    # Nothing stored or sent of the refused calls: no result, no start, no member.
    refused_ids = [e.task_id for e in refused]
    assert not any(stored(proj, t) for t in refused_ids) and not ran & set(refused_ids)
    wait_for(lambda: not gate_keys(r, thread), what="the thread's keys to vanish", timeout=60)


def test_rate_limit_spaces_the_starts_of_a_thread_not_of_others(proj, make_deployment, r):
    """Two threads of a task with thread_rate_limit="4/s", five members each sent at once: in
    each thread, each member is claimed at least 250 ms after the previous one (the gate's
    clock), so each body starts at least 250 ms after the previous member's claim (the start
    records, the Redis clock); the second thread is not slowed by the first (their first starts
    are close together).  The threads' policy hashes vanish after the last interval."""
    d = make_deployment(CT_EVENTS="0")
    d.worker("rate", concurrency=2)
    one, two = tid("rate-one"), tid("rate-two")
    calls = [proj.rated.delay(t, f"m{i}") for i in range(5) for t in (one, two)]
    for x in calls:
        wait_for(lambda x=x: state(proj, x) == "SUCCESS", what=f"{x.id} SUCCESS", timeout=60)
    first = {}
    for t in (one, two):
        started = [e for e in events(r, t) if e.kind == "start"]
        assert [e.label for e in started] == [f"m{i}" for i in range(5)]
        claims = [int(x.decode().split("|")[1]) * 1000 for x in r.lrange(f"claims:{t}", 0, -1)]
        assert all(b - a >= 250_000 for a, b in zip(claims, claims[1:])), (
            f"claims of {t} closer than 1/rate: {claims}"
        )
        assert all(s.at_us - c >= 250_000 for c, s in zip(claims, started[1:])), (
            f"a start of {t} came before the previous claim + 1/rate: {claims}, {started}"
        )
        first[t] = started[0].at_us
    assert abs(first[one] - first[two]) < 250_000, first
    for t in (one, two):
        wait_for(lambda t=t: not gate_keys(r, t), what="the thread's keys to vanish", timeout=60)


def test_a_coalescing_call_does_not_cut_a_rates_memory_short(redis_server):
    """A thread_rate_limit remembers a release for its whole interval, in the thread's policy
    hash, also when a coalescing call (coalesce/debounce) passes through the thread meanwhile:
    that call's wait keeps the hash without an expiry, and its release gave it the coalescing
    calls' 30 s, so a rate of 1/m was forgotten 30 s after such a call and its next member ran
    early.  Checked on the key's expiry (30 s more of the test would show the early release)."""
    gate = Gate(
        make_client(redis_server.url()), Keys(f"rm-{uuid.uuid4().hex[:6]}"), release_timeout_ms=60_000
    )
    thread = tid("rate-memory")
    policy_key = gate.keys.thread(thread).policy
    client = redis.Redis.from_url(redis_server.url())
    first = str(uuid.uuid4())
    release = gate.enqueue(thread, first, b"rated", policy="r60000").release
    assert release is not None
    assert gate.claim(thread, first, release.token, "test") == Claim.CLAIMED
    assert gate.finish(thread, first, release.token).done
    call = str(uuid.uuid4())
    release = gate.enqueue(thread, call, b"sync", coalesce="sync").release
    assert release is not None and release.task_id == call
    assert client.pttl(policy_key) > 55_000, client.pttl(policy_key)
    assert gate.claim(thread, call, release.token, "test") == Claim.CLAIMED
    assert gate.finish(thread, call, release.token).done
    # The next rated member waits for the rest of the minute.
    later = str(uuid.uuid4())
    assert gate.enqueue(thread, later, b"rated", policy="r60000").release is None
    assert client.pttl(policy_key) > 55_000, client.pttl(policy_key)


def test_policy_values_are_checked(proj, r):
    """A value a policy does not take is refused at the call, naming the option, and nothing of
    the call is stored.  A rate slower than one release per 100 years is refused: ``"1e-15/h"``
    made an interval the gate's enqueue could not add to its clock, and it failed halfway with a
    Redis error, its member left in the thread's queue and never released."""
    thread = tid("refused")
    for options in (
        {"on_death": "stop"},
        {"max_waiting": 0},
        {"max_waiting": True},
        {"thread_rate_limit": "fast"},
        {"thread_rate_limit": "0/s"},
        {"thread_rate_limit": True},
        {"thread_rate_limit": "1e-15/h"},
        {"thread_rate_limit": "5e-324/s"},
        {"thread_rate_limit": 0.99 / (100 * 365 * 86400)},  # just slower than the slowest
    ):
        with pytest.raises(ConfigurationError, match=next(iter(options))):
            proj.record.apply_async((thread, "x"), **options)
    assert gate_keys(r, thread) == []


def test_a_rate_of_one_release_per_decades_is_kept(redis_server):
    """The slowest rates the gate keeps work as any: ``"1e-9/s"`` (one release per 31.7 years)
    releases the first member and holds the next for the interval."""
    interval = rate_interval_ms("1e-9/s", "test")
    assert interval == 10**12
    gate = Gate(
        make_client(redis_server.url()), Keys(f"rs-{uuid.uuid4().hex[:6]}"), release_timeout_ms=60_000
    )
    thread, first, second = tid("rate-slow"), str(uuid.uuid4()), str(uuid.uuid4())
    release = gate.enqueue(thread, first, b"rated", policy=f"r{interval}").release
    assert release is not None
    assert gate.claim(thread, first, release.token, "test") == Claim.CLAIMED
    assert gate.finish(thread, first, release.token).done
    assert gate.enqueue(thread, second, b"rated", policy=f"r{interval}").release is None
    client = redis.Redis.from_url(redis_server.url())
    assert client.pttl(gate.keys.thread(thread).policy) > interval - 60_000
    (head,) = client.zrange(gate.keys.shard(0).due, 0, -1, withscores=True)
    assert head[1] > client.time()[0] * 1000 + interval - 60_000


def test_a_head_held_by_its_rate_shows_when_it_is_released(isolated_app):
    """``show`` and ``ls`` give an idle thread's head as eligible when its thread_rate_limit lets
    it go, not at its scheduled_at: a head a rate of 1/m held showed as eligible since its
    arrival, a due member that did not move."""
    from celery_threads.runtime import get_runtime
    from tests.support.isolated import envelope

    gate = get_runtime(isolated_app).gate
    threads = Threads(isolated_app)
    thread, first, second = tid("rate-shown"), str(uuid.uuid4()), str(uuid.uuid4())
    release = gate.enqueue(thread, first, envelope(first, thread), policy="r60000").release
    assert release is not None and gate.claim(thread, first, release.token, "test") == Claim.CLAIMED
    assert gate.finish(thread, first, release.token).done
    assert gate.enqueue(thread, second, envelope(second, thread), policy="r60000").release is None
    status = threads.status(thread)
    assert status is not None and status.active is None
    assert 55 < -status.head_age <= 60, status.head_age
    assert status.next_eligible_at > status.waiting[0].scheduled_at + timedelta(seconds=55)
    [summary] = [s for s in threads.summaries() if s.thread_id == thread]
    assert 55 < -summary.head_age <= 60 and summary.next_eligible_at == status.next_eligible_at
