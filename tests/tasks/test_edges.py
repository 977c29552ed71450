"""Exclusion at the edges: a worker cut off from the gate, a gate that refuses connections while a
member ends, calls whose reply is lost, a handed-off member behind a slow trace tail.

"At most one at a time" is judged by what the task bodies wrote (heartbeats and start/end records
stamped with the Redis server's clock), never by the gate's state.  The gate's Redis is reached
through a relay (tests/support/netfault.py) that the test breaks; the tasks write their history to the
same server directly.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from celery_threads import Threads
from tests.support.helpers import beats, events, last_beat, now_us, started_at, starts, tid, wait_for
from tests.support.isolated import pointed_at
from tests.support.netfault import Relay, script_call


@pytest.fixture
def r(proj):
    return proj.history()


@pytest.fixture
def relay(redis_server) -> Iterator[Relay]:
    """A link to the gate that a test can silence, refuse or make lose replies.  Tests ask for it
    before ``make_deployment``: their workers stop while it is still open (healed), instead of
    retrying a closed link for their whole budget."""
    link = Relay(redis_server.port)
    yield link
    link.close()


def test_a_worker_cut_off_from_the_gate_stops_its_member_before_the_lease_ends(
    proj, redis_server, relay, make_deployment, r
):
    """The link between a worker and the gate goes silent (the broker is still reachable).  The
    worker kills the pool process running the member before its lease can lapse; the gate lapses
    the lease and the next member runs on another worker, never beside the cut-off body."""
    d = make_deployment(CT_KEEPALIVE="3", CT_DISPATCH_INTERVAL="0.2", CT_HISTORY_URL=redis_server.url(0))
    cut = d.worker("cut", concurrency=1, env={"CT_REDIS_URL": relay.url(0)})
    thread = tid("cut")
    first = proj.beater.delay(thread, "first", seconds=30)
    wait_for(lambda: beats(r, thread, "first"), what="first to beat on the worker to be cut off")
    # Only the other worker takes what comes next (the broker is not what is cut off here).
    proj.app.control.cancel_consumer(d.env["CT_QUEUE"], destination=[cut.nodename], reply=True)
    second = proj.record.delay(thread, "second")
    d.worker("ok", concurrency=1)
    cut_at = now_us(r)
    relay.silence()
    assert second.get(timeout=30) == "second"
    first_end, second_start = last_beat(r, thread, "first"), started_at(r, thread, "second")
    assert first_end < second_start, (
        f"first beat {(first_end - second_start) / 1e6:.3f}s after second started"
    )
    moved_on = (second_start - cut_at) / 1e6
    print(f"from the cut to the next member's start: {moved_on:.2f}s (keepalive 3s)")
    assert moved_on < 3 + 0.2 + 5, f"the thread moved on only {moved_on:.2f}s after the cut"
    assert "killed pool process" in cut.output()
    [dead] = [x for x in Threads(proj.app).dead() if x.task_id == first.id]
    assert "LeaseExpired" in dead.exception
    relay.heal()


def test_an_ending_is_kept_while_the_gate_is_away_and_delivered_when_it_is_back(
    proj, redis_server, relay, make_deployment, r
):
    """The gate refuses connections while a member ends, for longer than the client's retries
    (until the worker says it keeps the ending: its first call rode them out and gave up) but
    well within the lease.  The ending is kept and delivered when the gate is back: the member
    does not run again, and the next one starts at once."""
    d = make_deployment(CT_KEEPALIVE="45", CT_DISPATCH_INTERVAL="0.2", CT_HISTORY_URL=redis_server.url(0))
    worker = d.worker("w", concurrency=1, env={"CT_REDIS_URL": relay.url(0)})
    thread = tid("kept")
    go = f"go:{thread}"
    first = proj.beater.delay(thread, "first", seconds=120, until=go)
    second = proj.record.delay(thread, "second")
    wait_for(lambda: beats(r, thread, "first"), what="first to run")
    relay.refuse()
    r.set(go, 1)  # first ends while the gate is away
    wait_for(
        lambda: "is kept and sent again" in worker.output(), timeout=40, what="the worker to keep the ending"
    )
    back_at = now_us(r)
    relay.heal()
    assert second.get(timeout=30) == "second"
    assert first.get(timeout=5) == "first"
    assert starts(r, thread) == ["first", "second"]
    waited = (started_at(r, thread, "second") - back_at) / 1e6
    assert waited < 5, f"the next member started {waited:.2f}s after the gate came back"
    assert not Threads(proj.app).dead()


def test_a_claim_whose_reply_is_lost_runs_the_member_at_once(proj, redis_server, relay, make_deployment, r):
    """The claim runs in the gate and its reply is lost; the client sends it again, and the gate
    recognizes the same claimant: the member runs now, on its first attempt, not after its lease
    lapses as a retry."""
    d = make_deployment(CT_KEEPALIVE="30", CT_HISTORY_URL=redis_server.url(0))
    d.worker("w", concurrency=1, env={"CT_REDIS_URL": relay.url(0)})
    thread = tid("claim")
    relay.lose_reply(*script_call("claim"))
    result = proj.record.delay(thread, "only")
    assert result.get(timeout=15) == "only"
    assert relay.lost == 1
    assert starts(r, thread) == ["only"]
    wait_for(lambda: Threads(proj.app).get(thread) is None, what="the thread to end")


def test_a_finish_whose_reply_is_lost_hands_on_at_once(proj, redis_server, relay, make_deployment, r):
    """The finish that releases (and, handing off, claims) the next member runs in the gate and
    its reply is lost; sent again, it gets the same release back: the next member runs now, on
    its first attempt."""
    d = make_deployment(CT_KEEPALIVE="30", CT_HISTORY_URL=redis_server.url(0))
    d.worker("w", concurrency=1, env={"CT_REDIS_URL": relay.url(0)})
    thread = tid("finish")
    relay.lose_reply(*script_call("finish"))
    first = proj.record.delay(thread, "first", sleep=0.2)
    second = proj.record.delay(thread, "second")
    assert second.get(timeout=15) == "second"
    assert first.get(timeout=5) == "first"
    assert relay.lost == 1
    assert starts(r, thread) == ["first", "second"]
    wait_for(lambda: Threads(proj.app).get(thread) is None, what="the thread to end")


@pytest.mark.parametrize("outage", ["after the claim ran", "before the claim ran"])
def test_a_handed_off_member_claimed_across_an_outage_keeps_its_retry_countdown(
    proj, redis_server, relay, make_deployment, r, outage
):
    """The finish that claims the next member (the handoff) meets an outage of the gate: after it
    ran (its reply is lost, then connections are refused), or before (connections are refused,
    and the client sends it again until they are accepted).  Sent again, it gets its claim
    back, and the member runs.  It retries with a 3 s countdown, fixed on the Redis server's
    clock when self.retry() is called: the next attempt starts 3 s later, not earlier (the claim's
    time paired with the body's start: the outage's length early) nor later (paired with the
    finish's first send: the outage's length late)."""
    # A pool job may hand off for 30 s: the first member's second of sleep leaves it the handoff.
    d = make_deployment(CT_KEEPALIVE="30", CT_LOCAL_HANDOFF="30", CT_HISTORY_URL=redis_server.url(0))
    d.worker("w", concurrency=1, env={"CT_REDIS_URL": relay.url(0)})
    thread = tid("claimed-across")
    if outage == "after the claim ran":
        relay.lose_reply(*script_call("finish"), then="refuse")
    first = proj.record.delay(thread, "first", sleep=1.0)
    second = proj.record.delay(thread, "second", fail_times=1, countdown=3)
    if outage == "after the claim ran":
        wait_for(lambda: relay.lost == 1, what="the finish's reply to be lost")
    else:
        wait_for(lambda: starts(r, thread) == ["first"], what="the first member to start")
        relay.refuse()  # the first member's finish is refused, and sent again after it
    time.sleep(4.0)  # the outage
    relay.heal()
    assert second.get(timeout=40) == "second"
    assert first.get(timeout=5) == "first"
    attempts = [e for e in events(r, thread) if e.label == "second"]
    assert [e.kind for e in attempts] == ["start", "end", "start", "end"], attempts
    waited = (attempts[2].at_us - attempts[1].at_us) / 1e6
    assert 2.95 <= waited < 4.0, f"the retry ran {waited:.3f}s after it was asked for 3s"


def test_a_delete_whose_reply_is_lost_still_stops_the_running_member(
    proj, redis_server, relay, make_deployment, r
):
    """``Threads.delete`` of a running member: the delete runs in the gate and its reply is lost.
    Sent again, it still says the member may be running, so it is revoked with terminate, and the
    next member runs."""
    d = make_deployment(CT_KEEPALIVE="30")
    d.worker("w", concurrency=2)
    thread = tid("delete")
    first = proj.beater.delay(thread, "first", seconds=30)
    second = proj.record.delay(thread, "second")
    wait_for(lambda: beats(r, thread, "first"), what="first to run")
    with pointed_at(proj.app, threads_redis_url=relay.url(0)):
        relay.lose_reply(*script_call("delete"))
        assert Threads(proj.app).delete(first.id)
    deleted_at = now_us(r)
    assert relay.lost == 1
    assert second.get(timeout=20) == "second"
    stopped = (last_beat(r, thread, "first", quiet=1.0, timeout=15) - deleted_at) / 1e6
    assert stopped < 5, f"the deleted member ran on {stopped:.2f}s after its delete"


def test_a_handed_off_member_keeps_its_lease_through_a_slow_trace_tail(proj, make_deployment, r):
    """The in-process handoff claims the next member when the previous one finishes; the rest of
    that one's trace (here its after_return) takes longer than the keepalive.  The next member's
    lease is renewed from its claim on: it runs once, after the tail."""
    d = make_deployment(CT_KEEPALIVE="2", CT_DISPATCH_INTERVAL="0.2")
    d.worker("w", concurrency=2)
    thread = tid("tail")
    first = proj.slow_tail.delay(thread, "first", tail=4.0)
    second = proj.slow_tail.delay(thread, "second")
    assert second.get(timeout=30) == "second"
    assert first.get(timeout=5) == "first"
    wait_for(lambda: Threads(proj.app).get(thread) is None, what="the thread to end")
    assert starts(r, thread) == ["first", "second"]
    assert not [x for x in r.lrange("overlaps", 0, -1) if x.decode().startswith(f"{thread}|")]


def attempts(r, thread: str) -> list[tuple[int, str]]:
    """``(retries, how it ended)`` of each attempt of ``proj.outlast``: ``succeeded``, or
    ``killed`` (it started and never returned)."""
    rows = [x.decode() for x in r.lrange(f"attempts:{thread}", 0, -1)]
    return [(int(row), "succeeded" if f"{row}|ok" in rows else "killed") for row in rows if "|" not in row]


@pytest.mark.parametrize("fault,outage", [("silence", 6.0), ("refuse", 20.0)])
def test_an_attempt_lost_while_cut_off_is_not_reported_as_the_final_failure(
    proj, redis_server, relay, make_deployment, r, fault, outage
):
    """The worker is cut off from the gate while its pool process runs a member with a retry
    left: the watchdog kills the process, another worker's dispatcher retries the member when
    its lease lapses, and it runs again once the link is back, and succeeds.  The worker's
    report of the lost attempt comes after the gate moved on (``silence``: a silent link for
    less than the client's retries), or never gets through (``refuse``: longer).  Either way the
    result backend never shows the lost attempt's WorkerLostError as FAILURE; it shows the
    success, and ``get()`` returns it."""
    d = make_deployment(CT_KEEPALIVE="3", CT_DISPATCH_INTERVAL="0.2", CT_HISTORY_URL=redis_server.url(0))
    cut = d.worker("cut", concurrency=1, env={"CT_REDIS_URL": relay.url(0)})
    d.worker("dispatcher", concurrency=1, extra=["-Q", "elsewhere"])  # dispatches, runs nothing
    thread = tid("lost")
    result = proj.outlast.delay(thread, "a", seconds=60)
    wait_for(lambda: beats(r, thread, "a"), what="a to beat on the worker to be cut off")
    getattr(relay, fault)()
    wait_for(
        lambda: "killed pool process" in cut.output(),
        timeout=30,
        what="the watchdog to kill the pool process",
    )
    states = set()
    end = time.monotonic() + outage
    while time.monotonic() < end:
        states.add(stored_state(proj, result.id))
        time.sleep(0.1)
    relay.heal()
    assert result.get(timeout=60) == "a"
    assert attempts(r, thread) == [(0, "killed"), (1, "succeeded")]
    assert "FAILURE" not in states, states
    assert stored_state(proj, result.id) == "SUCCESS"


def stored_state(proj, task_id: str) -> str:
    """The state the result backend holds now (``AsyncResult.state`` keeps the first final state
    it read)."""
    return proj.app.backend.get_task_meta(task_id, cache=False)["status"]
