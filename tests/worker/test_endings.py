"""Every way a member ends releases its thread exactly once."""

from __future__ import annotations

import time

import pytest
from billiard.exceptions import WorkerLostError
from celery.exceptions import TimeLimitExceeded

from celery_threads import Threads
from tests.support.helpers import assert_serial, events, starts, tid, wait_for


@pytest.fixture
def r(proj):
    return proj.history()


def _next_runs(proj, r, thread, label="next"):
    """A sibling enqueued behind the member under test must run, and the thread must vanish."""
    result = proj.record.delay(thread, label)
    assert result.get(timeout=30) == label
    wait_for(lambda: Threads(proj.app).get(thread) is None, what="the thread to vanish")


def _dead(proj, task_id):
    return [d for d in Threads(proj.app).dead() if d.task_id == task_id]


def test_success(proj, worker, r):
    thread = tid()
    assert proj.record.delay(thread, "ok").get(timeout=30) == "ok"
    _next_runs(proj, r, thread)
    assert starts(r, thread) == ["ok", "next"]


def test_self_retry_keeps_arrival_order_and_counts_retries(proj, worker, r):
    thread = tid()
    result = proj.record.delay(thread, "flaky", fail_times=2, countdown=0.1)
    assert result.get(timeout=30) == "flaky"
    assert starts(r, thread) == ["flaky"] * 3
    _next_runs(proj, r, thread)


def test_a_retry_without_an_exception_is_no_error_in_the_worker(proj, worker, r):
    """Retry's own ``exc`` (None here) is not the failure: the worker neither mistakes the retry
    for an unreported failure nor logs an error."""
    thread = tid()
    result = proj.record.delay(thread, "bare", fail_times=2, countdown=0.05, bare=True)
    assert result.get(timeout=30) == "bare"
    assert starts(r, thread) == ["bare"] * 3
    assert "could not dead-letter unrunnable member " + result.id not in worker.output()


def test_autoretry_with_backoff(proj, worker, r):
    thread = tid()
    result = proj.autoretry.delay(thread, "auto", fail_times=2)
    nxt = proj.record.apply_async((thread, "later"), countdown=5)
    assert result.get(timeout=30) == "auto"
    assert nxt.get(timeout=30) == "later"
    assert starts(r, thread) == ["auto"] * 3 + ["later"]


def test_retries_exhausted_dies(proj, worker, r):
    thread = tid()
    result = proj.record.delay(thread, "hopeless", fail_times=10, countdown=0.05)
    with pytest.raises(RuntimeError):
        result.get(timeout=30)
    assert starts(r, thread) == ["hopeless"] * 4  # max_retries=3
    [dead] = _dead(proj, result.id)
    assert dead.retries == 3 and "RuntimeError" in dead.exception
    _next_runs(proj, r, thread)


def test_retry_raised_by_hand_waits_its_when(proj, worker, r):
    """``raise Retry(when=1)`` without self.retry(): the next attempt starts no earlier than a
    second after the first ended (it re-entered at once before, whatever `when` said)."""
    thread = tid()
    result = proj.retried_by_hand.delay(thread, "later", fail_times=1, when=1.0)
    assert result.get(timeout=30) == "later"
    first_end, second_start = [e.at_us for e in events(r, thread)][1:3]
    assert second_start - first_end >= 1_000_000
    _next_runs(proj, r, thread)


def test_a_retry_raised_by_hand_for_ever_waits_where_the_cli_can_show_it(proj, worker, r):
    """``raise Retry(when=1e16)`` (317 million years): the member waits 100 years, a schedule
    the gate keeps as an integer of ms and a datetime can hold (the gate kept 1e19 ms before, as
    a float, and ``Threads.get`` failed on it: "invalid literal for int()"), and can be
    deleted."""
    from datetime import datetime, timedelta, timezone

    from celery.bin.celery import celery as celery_command
    from click.testing import CliRunner

    thread = tid("far-retry")
    result = proj.retried_by_hand.delay(thread, "far", fail_times=1, when=1e16)
    threads = Threads(proj.app)
    wait_for(lambda: starts(r, thread) == ["far"] and threads.get(thread) is not None, what="the re-entry")
    info = wait_for(lambda: threads.get(thread), what="the waiting member")
    [member] = info.waiting
    assert member.task_id == result.id and member.retries == 1
    assert member.scheduled_at > datetime.now(timezone.utc) + timedelta(days=365 * 99)
    runner = CliRunner()
    for args in (["ls", "--json"], ["show", thread, "--json"], ["show", thread]):
        out = runner.invoke(celery_command, ["-A", "tests.support.proj", "threads", *args])
        assert out.exit_code == 0, out.output
    threads.delete(result.id)
    _next_runs(proj, r, thread)
    assert starts(r, thread) == ["far", "next"]


def test_retry_raised_by_hand_stops_at_max_retries(proj, worker, r):
    """Raised by hand on every attempt, it runs 1 + max_retries times (2) and dies as
    self.retry() would: with the Retry's exception, else MaxRetriesExceededError (it ran on
    with no limit before)."""
    thread = tid()
    spent = proj.retried_by_hand.delay(thread, "spent", fail_times=10)
    with pytest.raises(proj.retried_by_hand.MaxRetriesExceededError):
        spent.get(timeout=30)
    own = proj.retried_by_hand.delay(thread, "own", fail_times=10, when="exc")
    with pytest.raises(ValueError):
        own.get(timeout=30)
    _next_runs(proj, r, thread)
    assert starts(r, thread) == ["spent"] * 3 + ["own"] * 3 + ["next"]
    [dead] = _dead(proj, spent.id)
    assert dead.retries == 2 and "MaxRetriesExceededError" in dead.exception
    assert "ValueError" in _dead(proj, own.id)[0].exception
    assert_serial(r, thread)


def test_a_retry_from_on_failure_is_told_the_member_died_already(proj, worker, r):
    """on_failure runs once the exception has ended the member: its self.retry() is refused,
    and the worker says why (it blamed a delete or a lapsed lease) and what to do instead."""
    thread = tid()
    result = proj.retried_on_failure.delay(thread, "late")
    _next_runs(proj, r, thread)
    assert starts(r, thread) == ["late", "next"]
    assert _dead(proj, result.id)
    wait_for(
        lambda: (
            f"retry of tests.support.proj.retried_on_failure[{result.id}] ignored: it died already"
            in worker.output()
        ),
        what="the warning",
    )


def test_exception_without_retry_dies(proj, worker, r):
    thread = tid()
    result = proj.boom.delay(thread, "boom")
    _next_runs(proj, r, thread)
    assert "ValueError" in _dead(proj, result.id)[0].exception


def test_dead_letter_false_drops_the_member(proj, worker, r):
    thread = tid()
    result = proj.boom_quietly.delay(thread, "quiet")
    _next_runs(proj, r, thread)
    assert _dead(proj, result.id) == []
    assert r.llen(f"dead_signal:{thread}") == 1  # the signal still fires


def test_reject_without_requeue_dies(proj, worker, r):
    thread = tid()
    result = proj.rejecter.delay(thread, "rej")
    _next_runs(proj, r, thread)
    assert "Rejected" in _dead(proj, result.id)[0].exception


def test_reject_with_requeue_runs_again(proj, worker, r):
    thread = tid()
    proj.rejecter.delay(thread, "again", requeue=True)
    _next_runs(proj, r, thread)
    wait_for(
        lambda: (
            starts(r, thread) == ["again", "again", "next"] or starts(r, thread) == ["again", "next", "again"]
        ),
        what="the requeued run",
    )
    assert_serial(r, thread)


def test_ignore_ends_the_member(proj, worker, r):
    thread = tid()
    proj.ignorer.delay(thread, "ignored")
    _next_runs(proj, r, thread)
    assert starts(r, thread) == ["ignored", "next"]


def test_soft_time_limit_dies(proj, worker, r):
    thread = tid()
    result = proj.soft_limited.delay(thread, "soft")
    _next_runs(proj, r, thread)
    assert "SoftTimeLimitExceeded" in _dead(proj, result.id)[0].exception
    assert_serial(r, thread)


def test_hard_time_limit_dies(proj, worker, r):
    thread = tid()
    result = proj.hard_limited.delay(thread, "hard")
    _next_runs(proj, r, thread)
    assert "TimeLimitExceeded" in _dead(proj, result.id)[0].exception
    with pytest.raises(TimeLimitExceeded):
        result.get(timeout=5)


def test_a_task_with_a_request_class_of_its_own_still_ends_in_its_thread(proj, worker, r):
    """``Request = OwnRequest`` replaced the package's request class: a member's hard time
    limit read FAILURE, but the gate kept it running until its lease lapsed (30 s), then ran it
    again.  The worker mixes the task's class with the package's: the member dies of its limit
    at once, and the task's own class still makes its requests."""
    thread = tid()
    result = proj.own_request_limited.delay(thread, "own")  # time_limit=1, a retry left
    nxt = proj.record.delay(thread, "next")
    assert nxt.get(timeout=20) == "next"  # well within the 30 s keepalive
    assert "TimeLimitExceeded" in _dead(proj, result.id)[0].exception
    assert starts(r, thread) == ["own", "next"]
    assert r.lrange(f"own_request:{result.id}", 0, -1) == [b"accepted"]


def _gone(pid: int) -> bool:
    """The process has exited (reaped, or a zombie its parent has not reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def test_hard_time_limit_releases_the_next_member_once_the_body_is_gone(proj, make_deployment, r):
    """billiard runs the request's on_timeout (where the member leaves its thread) before it
    signals the timed-out pool process: SIGTERM, then SIGKILL 0.1 s later.  The next member,
    sent to another worker, must not start before the timed-out body's last heartbeat (a body
    that ignores SIGTERM writes them until SIGKILL)."""
    d = make_deployment(CT_EVENTS="0")
    first_q, next_q = f"{d.env['CT_QUEUE']}-limited", f"{d.env['CT_QUEUE']}-next"
    d.worker("limited", concurrency=1, extra=["-Q", first_q])
    d.worker("next", concurrency=1, extra=["-Q", next_q])
    thread = tid("hard")
    first = proj.stubborn.apply_async((thread, "first"), queue=first_q)
    wait_for(lambda: starts(r, thread) == ["first"], what="the stubborn member")
    nxt = proj.record.apply_async((thread, "next"), queue=next_q)
    assert nxt.get(timeout=30) == "next"
    with pytest.raises(TimeLimitExceeded):
        first.get(timeout=10)
    pid = int(r.lindex(f"pid:{thread}", 0))
    wait_for(lambda: _gone(pid), what="the timed-out pool process to exit")
    last_beat = int(r.get(f"heartbeat:{thread}"))
    [next_start] = [e.at_us for e in events(r, thread) if e.label == "next" and e.kind == "start"]
    assert next_start > last_beat, (
        f"the next member started {(last_beat - next_start) / 1000:.1f} ms before the "
        "timed-out body's last heartbeat"
    )
    assert "TimeLimitExceeded" in _dead(proj, first.id)[0].exception


def test_pool_child_killed_counts_as_a_failed_attempt(proj, worker, r):
    thread = tid()
    result = proj.suicide.delay(thread, f"suicide-{thread}")
    nxt = proj.record.delay(thread, "next")
    assert result.get(timeout=30) == f"suicide-{thread}"
    assert nxt.get(timeout=30) == "next"
    assert starts(r, thread)[0] == f"suicide-{thread}"
    assert sorted(starts(r, thread)) == sorted([f"suicide-{thread}"] * 2 + ["next"])
    # Told as Celery tells a retry (it was silent): a log line, the task_retry signal.
    assert f"suicide[{result.id}] of thread {thread} lost its pool process" in worker.output()
    assert r.lrange(f"retry_signal:{result.id}", 0, -1) == [b"WorkerLostError"]


def test_a_member_lost_while_run_by_handoff_dies_with_its_retries_and_task_failure(proj, worker, r):
    """Its second attempt runs by handoff (its thread's next member's finish releases it to the
    same pool process) and loses that process too: it dies, counted with its one retry (0
    before) in the dead record, member_dead and the result, and with the task_failure signal
    (none before)."""
    thread = tid()
    go = f"go:{thread}"
    lost = proj.doomed.delay(thread, "doomed", until=go)
    wait_for(lambda: starts(r, thread) == ["doomed"], what="the first attempt to start")
    proj.record.delay(thread, "between", sleep=0.5)
    r.set(go, 1)
    with pytest.raises(WorkerLostError):
        lost.get(timeout=30)
    _next_runs(proj, r, thread)
    assert starts(r, thread) == ["doomed", "between", "doomed", "next"]
    assert _dead(proj, lost.id)[0].retries == 1
    assert r.lrange(f"dead_retries:{lost.id}", 0, -1) == [b"1"]
    wait_for(
        lambda: r.lrange(f"failure_signal:{lost.id}", 0, -1) == [b"WorkerLostError"], what="task_failure"
    )


def test_revoke_terminate_of_running_member_promotes_the_next(proj, worker, r):
    thread = tid()
    running = proj.record.delay(thread, "long", sleep=20)
    wait_for(lambda: starts(r, thread) == ["long"], what="long to start")
    nxt = proj.record.delay(thread, "next")
    t0 = time.time()
    proj.app.control.revoke(running.id, terminate=True)
    assert nxt.get(timeout=20) == "next"
    assert time.time() - t0 < 15
    wait_for(lambda: Threads(proj.app).get(thread) is None, what="the thread to vanish")


def test_plain_revoke_of_a_waiting_member_ends_it(proj, worker, r):
    thread = tid()
    proj.record.delay(thread, "first", sleep=1.0)
    doomed = proj.record.delay(thread, "doomed")
    proj.app.control.revoke(doomed.id)

    def waiting():
        info = Threads(proj.app).get(thread)
        return [] if info is None else [m.task_id for m in info.waiting]

    wait_for(lambda: doomed.id not in waiting(), what="the revoked member to leave the gate")
    _next_runs(proj, r, thread)
    assert starts(r, thread) == ["first", "next"]


def test_plain_revoke_of_a_running_member_lets_it_finish(proj, worker, r):
    thread = tid()
    running = proj.record.delay(thread, "running", sleep=1.5)
    wait_for(lambda: starts(r, thread) == ["running"], what="running to start")
    proj.app.control.revoke(running.id)
    nxt = proj.record.delay(thread, "next")
    assert nxt.get(timeout=20) == "next"
    assert_serial(r, thread)
    assert starts(r, thread) == ["running", "next"]
