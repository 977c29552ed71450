"""The ledger's threaded tasks, tested as a Celery user tests their own: a real Redis for the gate
and an in-process worker (fixtures in conftest.py, recipe in docs/testing.md).

No beat runs: the worker's celery-threads step runs a dispatch loop of its own, which releases
retries and scheduled postings when they are due.  Each posting appends its events to the
account's timeline, stamped with the Redis server's clock.
"""

from __future__ import annotations

import time
from typing import Any

from celery_threads import Threads
from example_project.report import timeline


def post(ledger: Any, account: str, entry: str, amount: int = 10, **options: Any) -> Any:
    kwargs = {k: options.pop(k) for k in ("fail_times", "seconds") if k in options}
    return ledger.post.apply_async((account, entry, amount), kwargs, **options)


def settled(ledger: Any, account: str, endings: int, timeout: float = 20.0) -> list[dict[str, Any]]:
    """The account's timeline once `endings` postings have ended (succeeded or died) and its
    thread is gone from the gate."""
    threads = Threads(ledger.app)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        events = timeline(ledger, account)
        done = sum(e["event"] in ("end", "died") for e in events)
        if done >= endings and threads.get(account) is None:
            return events
        time.sleep(0.05)
    raise AssertionError(f"{account} did not settle within {timeout}s: {timeline(ledger, account)}")


def attempts(events: list[dict[str, Any]]) -> list[tuple[str, float, float]]:
    """(entry, started, stopped) of each attempt, by start: from its "start" to its "end",
    "retry" or "failed"."""
    open_: dict[str, float] = {}
    spans = []
    for e in events:
        if e["event"] == "start":
            open_[e["entry"]] = e["at"]
        elif e["event"] in ("end", "retry", "failed"):
            spans.append((e["entry"], open_.pop(e["entry"]), e["at"]))
    return sorted(spans, key=lambda span: span[1])


def assert_one_at_a_time(spans: list[tuple[str, float, float]]) -> None:
    for (first, _, stopped), (then, started, _) in zip(spans, spans[1:]):
        assert stopped <= started, f"{then} started while {first} was running: {spans}"


def balance(ledger: Any, account: str) -> int:
    return int(ledger.store().get(ledger.key("balance", account)) or 0)


def test_postings_of_one_account_never_overlap_and_run_in_order(ledger, worker, account):
    for n in range(4):
        post(ledger, account, f"p{n}", seconds=0.2)
    spans = attempts(settled(ledger, account, endings=4))
    assert_one_at_a_time(spans)
    assert [entry for entry, _, _ in spans] == ["p0", "p1", "p2", "p3"]
    assert balance(ledger, account) == 40  # no lost update


def test_a_retry_re_enters_behind_postings_scheduled_before_it(ledger, worker, account):
    post(ledger, account, "p0", fail_times=1, seconds=0.1)  # retries 0.5 s after failing
    post(ledger, account, "p1", seconds=0.1)
    post(ledger, account, "p2", seconds=0.1)
    events = settled(ledger, account, endings=3)
    spans = attempts(events)
    assert_one_at_a_time(spans)
    assert [entry for entry, _, _ in spans] == ["p0", "p1", "p2", "p0"]
    assert [e["event"] for e in events if e["entry"] == "p0"] == ["start", "retry", "start", "end"]
    assert balance(ledger, account) == 30


def test_a_scheduled_posting_is_released_when_due(ledger, worker, account):
    posted = ledger.server_time()
    post(ledger, account, "later", countdown=1.0)
    (start,) = [e["at"] for e in settled(ledger, account, endings=1) if e["event"] == "start"]
    assert start >= posted + 1.0 - 0.05  # the Redis server's clock, at millisecond precision


def test_a_posting_longer_than_the_keepalive_runs_once(ledger, worker, account):
    # The worker renews the running posting's lease: it is not taken for lost and run again.
    seconds = ledger.app.conf.threads_keepalive + 0.5
    post(ledger, account, "long", seconds=seconds)
    post(ledger, account, "after")
    events = settled(ledger, account, endings=2, timeout=seconds + 20)
    assert_one_at_a_time(attempts(events))
    assert [(e["entry"], e["event"]) for e in events] == [
        ("long", "start"),
        ("long", "end"),
        ("after", "start"),
        ("after", "end"),
    ]


def test_a_dead_posting_is_kept_and_can_be_restarted(ledger, worker, account):
    ledger.store().sadd(ledger.key("frozen"), account)
    dying = post(ledger, account, "frozen")
    settled(ledger, account, endings=1)
    dead = [d for d in Threads(ledger.app).dead() if d.task_id == dying.id]
    assert [(d.thread_id, d.retries) for d in dead] == [(account, 0)]
    assert "frozen" in dead[0].exception

    ledger.store().srem(ledger.key("frozen"), account)
    post(ledger, account, "next")  # the thread did not stop at the death
    Threads(ledger.app).restart(dying.id)  # a new arrival: behind "next"
    spans = attempts(settled(ledger, account, endings=3))
    assert [entry for entry, _, _ in spans] == ["frozen", "next", "frozen"]
    assert dying.id not in [d.task_id for d in Threads(ledger.app).dead()]
    assert balance(ledger, account) == 20


def test_postings_of_two_accounts_run_at_the_same_time(ledger, worker, account):
    other = f"{account}-b"
    try:
        post(ledger, account, "a", seconds=0.5)
        post(ledger, other, "b", seconds=0.5)
        ((_, a_start, a_stop),) = attempts(settled(ledger, account, endings=1))
        ((_, b_start, b_stop),) = attempts(settled(ledger, other, endings=1))
        assert a_start < b_stop and b_start < a_stop, "the two accounts ran one after the other"
    finally:
        ledger.store().delete(ledger.key("timeline", other), ledger.key("balance", other))
