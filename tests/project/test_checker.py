"""The chaos checker catches each kind of violation in synthetic histories, and passes a clean one."""

from __future__ import annotations

import dataclasses
from typing import Optional

import pytest

from tests.support.checker import (
    INF,
    DeadLetter,
    Deletion,
    Enqueue,
    Event,
    GateState,
    Limits,
    Operations,
    Redrive,
    Report,
    check,
)

LIMITS = Limits(keepalive=8.0, dispatch_interval=0.5, retry_delay=0.3)
MS = 1000  # the checker works in µs; the histories below are written in ms


class History:
    """A synthetic run: enqueues, attempts (recv, start, end, fin), kills and deletions."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self.enqueues: list[Enqueue] = []
        self.deletions: list[Deletion] = []
        self.dead: dict[str, DeadLetter] = {}
        self.token = 0
        self.pid = 100

    def enqueue(
        self,
        task: str,
        thread: str,
        at: int,
        countdown: int = 0,
        attempt: int = 0,
        landed: Optional[int] = None,
        eta: Optional[int] = None,
    ) -> None:
        """``landed``: for a retry (attempt >= 1), when the task saw the gate take the re-entry
        (``None``: it never did).  ``eta``: the exact scheduled_at the producer gave."""
        self.enqueues.append(
            Enqueue(
                task,
                thread,
                attempt,
                at * MS,
                (at + 1) * MS,
                countdown * MS,
                in_gate_by=None if landed is None else landed * MS,
                exact=None if eta is None else eta * MS,
            )
        )

    def attempt(
        self,
        task: str,
        thread: str,
        start: int,
        end: Optional[int],
        outcome: str = "success",
        attempt: int = 0,
        recv: Optional[int] = None,
        fin: bool = True,
        pid: Optional[int] = None,
        main_pid: int = 1,
    ) -> int:
        """One release of ``task``; returns the pool child's pid."""
        self.token += 1
        token = str(self.token)
        if pid is None:
            self.pid += 1
            pid = self.pid
        if recv is not None:
            self.events.append(Event("recv", recv * MS, task, thread, attempt, token, main_pid))
        self.events.append(Event("start", start * MS, task, thread, attempt, token, pid))
        if end is not None:
            self.events.append(Event("end", end * MS, task, thread, attempt, token, pid, outcome))
            if outcome == "success" and fin:
                self.events.append(Event("fin", end * MS + 500, task, thread, attempt, token, pid))
        return pid

    def kill(self, at: int, *pids: int, what: str = "worker") -> None:
        self.events.append(Event("kill", at * MS, pids=pids, what=what))

    def delete(self, task: str, at: int) -> None:
        self.deletions.append(Deletion(task, at * MS, (at + 1) * MS))

    def die(
        self, task: str, thread: str, at: int, reason: str = "ValueError: dies", retries: int = -1
    ) -> None:
        self.dead[task] = DeadLetter(thread, reason, at, retries)

    def check(self, gate: Optional[GateState] = None, results: Optional[dict[str, str]] = None) -> Report:
        gate = gate or GateState(dead=self.dead)
        return check(self.events, gate, self.deletions, self.enqueues, LIMITS, results)


def serial_thread(h: History, thread: str, start: int = 0) -> None:
    """Three members, FIFO, one retry re-entering behind its sibling, each ending once."""
    h.enqueue(f"{thread}-a", thread, start)
    h.enqueue(f"{thread}-b", thread, start + 2)
    h.enqueue(f"{thread}-c", thread, start + 4, countdown=5000)
    h.attempt(f"{thread}-a", thread, start + 10, start + 100, "retry", recv=start + 9)
    h.enqueue(f"{thread}-a", thread, start + 101, countdown=300, attempt=1, landed=start + 102)
    h.attempt(f"{thread}-b", thread, start + 110, start + 200, "die", recv=start + 105)
    h.die(f"{thread}-b", thread, start + 201)
    h.attempt(f"{thread}-a", thread, start + 410, start + 500, attempt=1, recv=start + 405)
    h.attempt(f"{thread}-c", thread, start + 5010, start + 5100, recv=start + 5006)


def test_a_clean_history_passes() -> None:
    h = History()
    serial_thread(h, "t1")
    serial_thread(h, "t2", start=50)
    # A worker killed while its member ran: the gate re-entered it after the keepalive.
    h.enqueue("k", "t3", 0)
    h.enqueue("k2", "t3", 1)
    victim = h.attempt("k", "t3", 10, None, recv=5)
    h.kill(1000, victim, 1)
    h.attempt("k2", "t3", 8_900, 9_000, recv=8_890)
    h.attempt("k", "t3", 9_200, 9_300, attempt=1, recv=9_190)
    # A running member deleted: the next one starts at once, while the deleted one winds down.
    h.enqueue("d", "t4", 0)
    h.enqueue("d2", "t4", 1)
    h.attempt("d", "t4", 10, 2_000, recv=5)
    h.delete("d", 500)
    h.attempt("d2", "t4", 510, 600, recv=505)
    report = h.check()
    assert report.ok, report.format()
    assert (report.members, report.succeeded, report.dead_lettered, report.deleted) == (10, 7, 2, 1)
    assert report.releases_checked > 0 and report.waiting_compared > 0
    assert report.worst_recovery["worker"] == pytest.approx(7.89, abs=0.01)
    assert "RESULT: OK" in report.format()


def test_overlapping_user_code_is_caught() -> None:
    h = History()
    h.enqueue("a", "t", 0)
    h.enqueue("b", "t", 1)
    h.attempt("a", "t", 10, 300)
    h.attempt("b", "t", 200, 400)
    report = h.check()
    assert len(report.overlaps) == 1 and not report.ok
    assert "a#0" in report.overlaps[0] and "b#0" in report.overlaps[0]


def test_a_receipt_while_a_sibling_runs_is_an_overlap() -> None:
    h = History()
    h.enqueue("a", "t", 0)
    h.enqueue("b", "t", 1)
    h.attempt("a", "t", 10, 300)
    h.attempt("b", "t", 310, 400, recv=250)  # received (released) before a ended
    assert len(h.check().overlaps) == 1


def test_the_same_member_running_twice_at_once_is_an_overlap() -> None:
    h = History()
    h.enqueue("a", "t", 0)
    h.attempt("a", "t", 10, 300, fin=False)
    h.attempt("a", "t", 100, 400)
    report = h.check()
    assert len(report.overlaps) == 1
    assert report.bad_endings == ["member a of thread t succeeded 2 times"]


def test_an_attempt_that_never_ended_overlaps_what_follows() -> None:
    h = History()
    h.enqueue("a", "t", 0)
    h.enqueue("b", "t", 1)
    h.attempt("a", "t", 10, None)  # no end, no kill: still running
    h.attempt("b", "t", 9_000, 9_100)
    report = h.check()
    assert len(report.overlaps) == 1 and "open" in report.overlaps[0]
    assert any("neither ended nor were killed" in x for x in report.info)


def test_a_killed_attempt_does_not_overlap_what_follows() -> None:
    h = History()
    h.enqueue("a", "t", 0)
    h.enqueue("b", "t", 1)
    pid = h.attempt("a", "t", 10, None)
    h.kill(100, pid, what="child")
    h.attempt("b", "t", 2_000, 2_100)
    h.attempt("a", "t", 2_200, 2_300, attempt=1)
    report = h.check()
    assert report.ok, report.format()
    assert report.worst_recovery["child"] == pytest.approx(1.9, abs=0.01)


def test_a_deleted_member_is_exempt_from_its_own_overlap_only() -> None:
    h = History()
    for task, at in (("a", 0), ("b", 1), ("c", 2)):
        h.enqueue(task, "t", at)
    h.attempt("a", "t", 10, 1_000)
    h.delete("a", 200)
    h.attempt("b", "t", 210, 600)
    h.attempt("c", "t", 500, 700)  # overlaps b, which was not deleted
    report = h.check()
    assert len(report.overlaps) == 1
    assert "b#0" in report.overlaps[0] and "c#0" in report.overlaps[0]


def test_an_attempt_that_ended_before_its_member_was_deleted_is_not_exempt() -> None:
    h = History()
    h.enqueue("a", "t", 0)
    h.enqueue("b", "t", 1)
    h.attempt("a", "t", 10, 300, "retry")
    h.enqueue("a", "t", 301, countdown=5_000, attempt=1)
    h.attempt("b", "t", 200, 400)  # overlaps a's first attempt
    h.delete("a", 1_000)  # a deleted later, while waiting
    assert len(h.check().overlaps) == 1


@pytest.mark.parametrize(
    "case, expected",
    [
        ("lost", "was lost"),
        ("twice", "succeeded 2 times"),
        ("success-and-dead", "succeeded 1 times and is dead-lettered"),
        ("still-member", "still a member"),
        ("deleted-and-dead", "deleted and is also dead-lettered"),
        ("deleted-and-twice", "deleted and also succeeded 2 times"),
    ],
)
def test_a_member_that_did_not_end_exactly_once_is_caught(case: str, expected: str) -> None:
    h = History()
    h.enqueue("a", "t", 0)
    gate = None
    if case == "twice":
        h.attempt("a", "t", 10, 100)
        h.attempt("a", "t", 200, 300, attempt=1)
    elif case == "success-and-dead":
        h.attempt("a", "t", 10, 100)
        h.die("a", "t", 400)
    elif case == "still-member":
        gate = GateState(due={"t": 5}, members={"a": "t"}, thread_keys={"t": ["x:t:t:q"]})
    elif case == "deleted-and-dead":
        h.delete("a", 5)
        h.die("a", "t", 400)
    elif case == "deleted-and-twice":
        h.attempt("a", "t", 10, 100)
        h.attempt("a", "t", 200, 300, attempt=1)
        h.delete("a", 250)
    report = h.check(gate)
    assert any(expected in x for x in report.bad_endings), report.bad_endings
    assert not report.ok


def test_a_rerun_after_a_kill_in_the_ending_window_is_information() -> None:
    h = History()
    h.enqueue("a", "t", 0)
    pid = h.attempt("a", "t", 10, 100, fin=False)
    h.kill(101, pid, what="child")  # after user code returned, before finish
    h.attempt("a", "t", 2_000, 2_100, attempt=1)
    report = h.check()
    assert report.ok, report.format()
    assert report.succeeded == 1
    assert any("at-least-once window" in x for x in report.info)


def test_a_rerun_after_an_ending_the_worker_could_not_record_is_information() -> None:
    """The worker logged that the ending could not reach the gate while the lease held (a
    partition longer than the keepalive): the gate ran the member again, as it must."""
    h = History()
    h.enqueue("a", "t", 0)
    h.attempt("a", "t", 10, 100)
    h.events.append(Event("unrecorded", 900 * MS, task="a"))
    h.attempt("a", "t", 2_000, 2_100, attempt=1)
    report = h.check()
    assert report.ok, report.format()
    assert report.succeeded == 1
    assert any("could not reach the gate" in x for x in report.info)
    without = History()  # the same runs, nothing logged: a violation
    without.enqueue("a", "t", 0)
    without.attempt("a", "t", 10, 100)
    without.attempt("a", "t", 2_000, 2_100, attempt=1)
    assert not without.check().ok


def test_a_success_killed_before_fin_counts_when_nothing_else_ended_it() -> None:
    h = History()
    h.enqueue("a", "t", 0)
    pid = h.attempt("a", "t", 10, 100, fin=False)
    h.kill(101, pid, what="child")
    report = h.check()
    assert report.ok and report.succeeded == 1


def test_a_release_that_skips_an_earlier_due_sibling_is_an_order_violation() -> None:
    h = History()
    h.enqueue("blocker", "t", 0)
    h.enqueue("early", "t", 10)  # scheduled at 10
    h.enqueue("late", "t", 20)  # scheduled at 20
    h.attempt("blocker", "t", 5, 100)
    h.attempt("late", "t", 110, 200, recv=105)  # released first although "early" waited
    h.attempt("early", "t", 210, 300, recv=205)
    report = h.check()
    assert len(report.order_violations) == 1, report.format()
    assert "late#0" in report.order_violations[0] and "early#0" in report.order_violations[0]


def test_a_countdown_lets_a_later_arrival_go_first() -> None:
    h = History()
    h.enqueue("blocker", "t", 0)
    h.enqueue("later", "t", 10, countdown=1_000)  # scheduled at 1010
    h.enqueue("now", "t", 20)  # scheduled at 20
    h.attempt("blocker", "t", 5, 100)
    h.attempt("now", "t", 110, 200, recv=105)
    h.attempt("later", "t", 1_020, 1_100, recv=1_015)
    report = h.check()
    assert report.ok, report.format()
    assert report.waiting_compared == 1


def test_a_retry_that_overtakes_an_earlier_scheduled_sibling_is_an_order_violation() -> None:
    h = History()
    h.enqueue("a", "t", 0)
    h.enqueue("b", "t", 10, countdown=100)  # scheduled at 110
    h.attempt("a", "t", 5, 200, "retry")
    h.enqueue("a", "t", 201, countdown=500, attempt=1, landed=202)  # re-enters at 701
    h.attempt("a", "t", 710, 800, attempt=1)  # released before b, which was due at 110
    h.attempt("b", "t", 810, 900)
    assert len(h.check().order_violations) == 1


def test_a_retry_whose_reentry_never_reached_the_gate_is_no_witness() -> None:
    """self.retry(countdown=27 ms) with the gate down, then the worker killed before the body's
    re-entry reached it (seen in a CI chaos run): the gate re-entered the member when its lease
    lapsed, scheduled at the lapse plus the retry delay, so later-scheduled siblings rightly went
    first.  Had the re-entry landed, they would have overtaken it."""

    def run(landed: Optional[int]) -> Report:
        h = History()
        h.enqueue("a", "t", 0)
        pid = h.attempt("a", "t", 5, 100, "retry", recv=4)
        h.enqueue("a", "t", 100, countdown=27, attempt=1, landed=landed)  # due by 128
        h.enqueue("b", "t", 150)
        h.enqueue("c", "t", 200)
        h.kill(1_700, pid, 1)  # the worker dies before the re-entry lands
        h.attempt("b", "t", 10_000, 10_100, recv=9_990)  # after the lease lapsed (~9,700)
        h.attempt("c", "t", 10_200, 10_300, recv=10_190)
        h.attempt("a", "t", 10_400, 10_500, attempt=1, recv=10_390)
        return h.check()

    report = run(landed=None)
    assert report.ok, report.format()
    report = run(landed=101)
    assert len(report.order_violations) == 2, report.format()


def test_an_unlanded_retry_is_bounded_by_its_own_schedule_or_the_lapse() -> None:
    """A retry whose landing went unrecorded (its process killed right after the gate took it)
    may have re-entered on its own schedule: the earlier of that and the lapse bounds it."""
    h = History()
    h.enqueue("a", "t", 0)
    h.enqueue("b", "t", 10, countdown=340)  # scheduled at 350
    pid = h.attempt("a", "t", 5, 100, "retry")
    h.enqueue("a", "t", 100, countdown=200, attempt=1)  # due by 301 if it landed
    h.kill(102, pid, what="child")  # a lapse would re-enter it at >= 400
    h.attempt("a", "t", 310, 400, attempt=1)  # ran on its own schedule: before b
    h.attempt("b", "t", 410, 500)
    report = h.check()
    assert report.ok and report.waiting_compared == 1, report.format()


def test_a_member_reentered_by_the_gate_is_bounded_by_the_retry_delay() -> None:
    h = History()
    h.enqueue("a", "t", 0)
    h.enqueue("b", "t", 10, countdown=2_000)  # scheduled at 2010
    pid = h.attempt("a", "t", 5, None)
    h.kill(50, pid, what="child")
    # a re-entered at (failure) + 300 ms > 55 + 300: it rightly went before b.
    h.attempt("a", "t", 1_000, 1_100, attempt=1)
    h.attempt("b", "t", 2_020, 2_100)
    assert h.check().ok
    # ... but b going first, while a (re-entered by 400 at the latest) waited, is fine too:
    # the gate's own re-entries are never used as witnesses (their schedule is not known).
    h2 = History()
    h2.enqueue("a", "t", 0)
    h2.enqueue("b", "t", 10)
    pid = h2.attempt("a", "t", 5, None)
    h2.kill(50, pid, what="child")
    h2.attempt("b", "t", 400, 500)
    h2.attempt("a", "t", 600, 700, attempt=1)
    assert h2.check().ok


def test_a_copy_that_lost_the_claim_does_not_bound_the_reentry() -> None:
    """A copy of a release received by one worker (w4) while another copy of the same release
    runs elsewhere loses the claim; a later kill of w4 says nothing about when the member's
    attempt ended, so it does not push back the bound of the member's re-entry."""
    h = History()
    h.enqueue("a", "t", 0)
    h.events.append(Event("recv", 1 * MS, "a", "t", 0, "1", 4))  # w4's copy, never run
    h.events.append(Event("recv", 3_000 * MS, "a", "t", 0, "1", 3))  # redelivered to w3
    h.events.append(Event("start", 3_001 * MS, "a", "t", 0, "1", 31))
    h.token = 1
    h.kill(3_100, 3, 31)  # w3 dies mid-attempt
    h.enqueue("b", "t", 10_000, countdown=1_500)  # scheduled at 11,500
    h.attempt("a", "t", 11_200, 11_300, attempt=1, recv=11_190)  # lapsed at ~11,100
    h.attempt("b", "t", 11_600, 11_700, recv=11_590)
    h.kill(20_000, 4)  # w4 dies much later
    report = h.check()
    assert report.order_violations == [], report.order_violations


def test_stuck_threads_and_orphan_keys_are_caught() -> None:
    h = History()
    h.enqueue("a", "t1", 0)
    h.attempt("a", "t1", 10, 100)
    gate = GateState(
        due={"t2": 1_000},
        leases={"t3": 2_000},
        members={"x": "t2", "y": "t3", "z": "t9"},
        thread_keys={"t2": ["p:{0}:t:t2:q"], "t3": ["p:{0}:t:t3:a"], "t8": ["p:{0}:t:t8:m"]},
        active={"t3": {"task": "y", "state": "RUNNING", "worker": "w1", "deadline": "2000"}},
    )
    report = h.check(gate)
    assert len(report.stuck) == 2
    assert any("t3" in x and "RUNNING" in x for x in report.stuck)
    assert any("t8" in x for x in report.orphans)
    assert any("z -> t9" in x for x in report.orphans)
    assert not report.ok


def test_a_thread_in_both_indexes_is_an_orphan() -> None:
    gate = GateState(due={"t": 1}, leases={"t": 2}, thread_keys={"t": ["k"]})
    report = check([], gate, [], [], LIMITS)
    assert any("both" in x for x in report.orphans)


def test_recovery_after_a_worker_kill_is_measured_from_the_kill() -> None:
    h = History()
    h.enqueue("a", "t", 0)
    h.enqueue("b", "t", 1)
    h.enqueue("p", "u", 0)
    running = h.attempt("a", "t", 10, None, recv=5, main_pid=7)
    h.events.append(Event("recv", 20 * MS, "p", "u", 0, "99", 7))  # prefetched, not started
    h.kill(1_000, running, 7)
    h.attempt("b", "t", 10_400, 10_500)  # 9.4 s after the kill
    h.die("p", "u", 9_000)  # the prefetched one died 8 s after
    report = h.check()
    assert sorted(report.recoveries["worker"]) == [8.0, 9.4]
    assert report.worst_recovery["worker"] == 9.4


def test_a_prefetched_release_redelivered_after_a_worker_kill_counts_as_recovery() -> None:
    h = History()
    h.enqueue("a", "t", 0)
    h.events.append(Event("recv", 20 * MS, "a", "t", 0, "7", 3))  # prefetched by worker 3
    h.kill(1_000, 3)
    h.events.append(Event("recv", 4_000 * MS, "a", "t", 0, "7", 4))  # the broker hands it back
    h.events.append(Event("start", 4_001 * MS, "a", "t", 0, "7", 40))
    h.events.append(Event("end", 4_100 * MS, "a", "t", 0, "7", 40, "success"))
    h.events.append(Event("fin", 4_101 * MS, "a", "t", 0, "7", 40))
    report = h.check()
    assert report.ok, report.format()
    assert report.recoveries["worker"] == [3.0]


def two_threads_killed_at_1s() -> History:
    """Threads t (a, b) and u (c, d): a and c run on the worker killed at 1 s, and t moves on
    3 s later."""
    h = History()
    for task, thread, at in (("a", "t", 0), ("b", "t", 1), ("c", "u", 0), ("d", "u", 1)):
        h.enqueue(task, thread, at)
    one = h.attempt("a", "t", 10, None)
    two = h.attempt("c", "u", 10, None)
    h.kill(1_000, one, two)
    h.attempt("b", "t", 4_000, 4_100)
    return h


def test_a_recovery_across_an_outage_is_kept_apart() -> None:
    h = two_threads_killed_at_1s()
    h.events.append(Event("redis_down", 5_000 * MS))
    h.events.append(Event("redis_up", 6_500 * MS))
    h.events.append(Event("healthy", 7_000 * MS, count=0))
    h.events.append(Event("healthy", 12_000 * MS, count=2))
    h.attempt("d", "u", 13_000, 13_100)  # waited for a worker: kept apart
    report = h.check()
    assert report.recoveries["worker"] == [3.0]
    assert report.confounded["worker"] == [12.0]
    assert "overlapped an outage" in report.format()


def test_a_recovery_across_another_workers_kill_is_kept_apart() -> None:
    """The next member may have been lost with the second worker (a delivery it prefetched from a
    queue without acknowledgements): that window measures two faults, not one."""
    h = two_threads_killed_at_1s()
    h.kill(8_000, 77)  # another worker
    h.attempt("d", "u", 13_000, 13_100)  # after it: kept apart
    report = h.check()
    assert report.recoveries["worker"] == [3.0]
    assert report.confounded["worker"] == [12.0]
    assert "another worker's kill" in report.format()


def test_a_child_kill_followed_by_its_workers_kill_counts_from_the_worker() -> None:
    h = History()
    h.enqueue("a", "t", 0)
    h.enqueue("b", "t", 1)
    child = h.attempt("a", "t", 10, None, recv=5, main_pid=7)
    h.kill(100, child, what="child")
    h.kill(2_000, 7, 8)  # before the worker noticed its child's death
    h.attempt("b", "t", 10_000, 10_100)
    report = h.check()
    assert report.recoveries == {"worker": [8.0]}


# -- the stricter rules -----------------------------------------------------------------------


def test_a_deleted_member_overlapping_a_sibling_before_its_delete_is_caught() -> None:
    """Only what runs after the delete began is exempt: a sibling released while the member
    still held the thread is an overlap, however the member ended."""
    h = History()
    h.enqueue("a", "t", 0)
    h.enqueue("b", "t", 1)
    h.attempt("a", "t", 10, 1_000)
    h.attempt("b", "t", 100, 300)  # before the delete: a still held the thread
    h.delete("a", 500)
    report = h.check()
    assert len(report.overlaps) == 1 and "before its delete" in report.overlaps[0]
    assert not report.ok


def test_a_start_before_scheduled_at_is_caught() -> None:
    h = History()
    h.enqueue("a", "t", 0, countdown=1_000)  # scheduled at 1,000 ms or later
    h.attempt("a", "t", 990, 1_100, recv=985)
    report = h.check()
    assert len(report.early_starts) == 1 and "a#0" in report.early_starts[0], report.format()
    assert not report.ok
    ok = History()
    ok.enqueue("a", "t", 0, countdown=1_000)
    ok.attempt("a", "t", 1_002, 1_100, recv=1_001)
    report = ok.check()
    assert report.ok and report.schedules_checked == 1, report.format()


def test_a_retry_started_before_its_countdown_is_caught() -> None:
    """A retry's re-entry is scheduled from its claim, after the retrying attempt's receipt."""
    h = History()
    h.enqueue("a", "t", 0)
    h.attempt("a", "t", 10, 100, "retry", recv=5)
    h.enqueue("a", "t", 100, countdown=500, attempt=1, landed=101)  # due at 505 or later
    h.attempt("a", "t", 300, 400, attempt=1, recv=290)
    report = h.check()
    assert len(report.early_starts) == 1 and "a#1" in report.early_starts[0], report.format()


def tied_pair(order: tuple[str, str], eta: Optional[int] = 2_000) -> Report:
    """``first`` and ``second`` (arriving in that order) both scheduled at exactly ``eta`` (None:
    a countdown, known within bounds only), released in ``order`` once a blocker ends."""
    h = History()
    h.enqueue("blocker", "t", 0)
    h.enqueue("first", "t", 10, eta=eta, countdown=0 if eta else 1_990)
    h.enqueue("second", "t", 20, eta=eta, countdown=0 if eta else 1_980)
    h.attempt("blocker", "t", 5, 2_500)
    h.attempt(order[0], "t", 2_510, 2_600, recv=2_505)
    h.attempt(order[1], "t", 2_610, 2_700, recv=2_605)
    return h.check()


def test_tied_members_released_out_of_arrival_order_are_caught() -> None:
    report = tied_pair(("second", "first"))
    assert len(report.order_violations) == 1, report.format()
    assert "exactly" in report.order_violations[0] and "second#0" in report.order_violations[0]
    assert report.ties_compared == 1
    # In arrival order, or tied only within bounds (countdowns, not exact): no violation.
    assert tied_pair(("first", "second")).ok
    assert tied_pair(("second", "first"), eta=None).ok


@pytest.mark.parametrize("case", ["retries-left", "nothing-failed"])
def test_a_dead_letter_the_history_does_not_explain_is_caught(case: str) -> None:
    """A dead letter is a valid ending only for a member whose user code failed for good (an
    ``end`` with ``die``) or whose last allowed attempt failed without an ending."""
    h = History()
    h.enqueue("a", "t", 0)
    if case == "retries-left":
        # killed on its first attempt, with 3 retries left: the gate must re-enter it
        pid = h.attempt("a", "t", 10, None, recv=5)
        h.kill(100, pid, what="child")
        h.die("a", "t", 200, "WorkerLostError: gone", retries=0)
    else:
        h.attempt("a", "t", 10, 100, "retry", recv=5)  # retried, then nothing failed
        h.die("a", "t", 200, "LeaseExpired: no keepalive", retries=3)
    report = h.check()
    assert any("dead-lettered but" in x for x in report.bad_endings), report.format()
    assert not report.ok


def test_dead_letters_of_exhausted_or_failed_members_pass() -> None:
    h = History()
    h.enqueue("a", "t", 0)  # failed for good in user code
    h.attempt("a", "t", 10, 100, "die", recv=5)
    h.die("a", "t", 101, "ValueError: dies", retries=0)
    h.enqueue("b", "u", 0)  # its last retry's process killed
    for n in range(3):
        h.attempt("b", "u", 10 + 1_000 * n, 100 + 1_000 * n, "retry", attempt=n)
    pid = h.attempt("b", "u", 3_010, None, attempt=3)
    h.kill(3_050, pid, what="child")
    h.die("b", "u", 3_100, "WorkerLostError: gone", retries=3)
    h.enqueue("c", "v", 0)  # its last retry killed before "start"
    for n in range(3):
        h.attempt("c", "v", 10 + 1_000 * n, 100 + 1_000 * n, "retry", attempt=n)
    h.kill(2_500, 999)
    h.die("c", "v", 12_000, "LeaseExpired: no keepalive", retries=3)
    report = h.check()
    assert report.ok, report.format()
    assert report.dead_lettered == 3


def test_leftover_shard_keys_are_caught() -> None:
    h = History()
    h.enqueue("a", "t", 0)
    h.attempt("a", "t", 10, 100)
    h.enqueue("b", "t", 1)
    h.attempt("b", "t", 110, 200)
    h.delete("c", 50)
    h.delete("d", 60)
    gate = GateState(
        dead_index=["x"],
        dead_records=["y"],
        ended={"a": 100.0, "b": 200_000.0, "z": 150_000.0, "u": INF},
        notes={"c": 590, "a": 300, "d": -1},
        other_keys=["p:{0}:stray"],
    )
    report = h.check(gate)
    text = "\n".join(report.orphans)
    for expected in (
        "dead index entry x",
        "dead record y",
        "ended index entry u at +inf",
        "entry z: not a member",
        "entry a at 100 ms, more than 30000 ms",
        "deleted note of a, which was not deleted",
        "deleted note of d without",
        "p:{0}:stray",
    ):
        assert expected in text, report.format()
    assert not report.ok
    assert any("1 deleted note(s) not taken" in x for x in report.info)
    clean = GateState(dead_index=[], dead_records=[], ended={"a": 100.0, "b": 200.0}, notes={}, other_keys=[])
    assert h.check(clean).ok


def test_stored_results_that_disagree_with_the_endings_are_caught() -> None:
    """SUCCESS for a member that succeeded, FAILURE for one that died, REVOKED for one deleted
    (or SUCCESS, when the delete raced its finish); an attempt killed between its ending and
    Celery's store may leave no final state (information), never a wrong one."""
    h = History()
    serial_thread(h, "t1")  # t1-a and t1-c succeed (t1-a after a retry), t1-b dies
    h.enqueue("d", "t2", 0)
    h.enqueue("raced", "t2", 1)
    h.delete("d", 5)  # deleted while waiting
    h.attempt("raced", "t2", 10, 100)
    h.delete("raced", 99)  # deleted as it finished
    h.enqueue("cut", "t3", 0)
    pid = h.attempt("cut", "t3", 10, 100, fin=False)
    h.kill(101, pid, what="child")  # after the gate's finish, before Celery's store
    right = {
        "t1-a": "SUCCESS",
        "t1-b": "FAILURE",
        "t1-c": "SUCCESS",
        "d": "REVOKED",
        "raced": "SUCCESS",
        "cut": "SUCCESS",
    }
    report = h.check(results=right)
    assert report.ok, report.format()
    assert report.results_checked == 6
    assert report.counts()["result_mismatches"] == 0
    report = h.check(results={**right, "cut": "STARTED"})
    assert report.ok, report.format()
    assert any("hold no final state" in x and "cut" in x for x in report.info), report.info
    wrong = {**right, "t1-a": "FAILURE", "t1-b": "RETRY", "d": "PENDING", "cut": "FAILURE"}
    wrong.pop("t1-c")  # never stored: PENDING
    report = h.check(results=wrong)
    assert not report.ok
    assert report.counts()["result_mismatches"] == 5, report.result_mismatches
    assert (
        "member t1-a of thread t1 succeeded but its stored result reads FAILURE" in report.result_mismatches
    )
    assert any(
        "t1-b of thread t1 died but its stored result reads RETRY" in x for x in report.result_mismatches
    )
    assert any("t1-c" in x and "reads PENDING" in x for x in report.result_mismatches)
    assert any(
        "d of thread t2 was deleted but its stored result reads PENDING" in x
        for x in report.result_mismatches
    )
    assert "stored results that disagree with how their member ended: 5" in report.format()
    assert h.check().results_checked == 0  # a run that kept no results: not checked


def test_superseded_members_never_start_and_coalesced_calls_keep_no_known_schedule() -> None:
    """coalesce/debounce: a superseded member ends as a deletion, and a start of it is a
    violation; the call that superseded it took its place (an earlier scheduled_at than its own
    enqueue says), which is no order violation; an ended thread's policy hash may linger within
    the ended window, not longer."""
    h = History()
    h.enqueue("busy", "t", 0)
    h.enqueue("old", "t", 5)
    h.enqueue("between", "t", 6)
    h.enqueues.append(Enqueue("new", "t", 0, 50 * MS, 51 * MS, coalesced=True))
    h.deletions.append(Deletion("old", 51 * MS, 51 * MS, superseded=True))
    h.attempt("busy", "t", 10, 100, recv=9)
    h.attempt("new", "t", 110, 200, recv=105)  # in old's place, before between
    h.attempt("between", "t", 210, 300, recv=205)
    report = h.check(GateState(lingering={"t": 29_000}))
    assert report.ok, report.format()
    assert report.superseded == 1 and report.deleted == 1
    # The same call taken for a plain one: it went before a sibling certainly scheduled earlier.
    coalesced = h.enqueues
    h.enqueues = [dataclasses.replace(e, coalesced=False) for e in coalesced]
    assert h.check().order_violations
    h.enqueues = coalesced

    h.attempt("old", "t", 310, 400, recv=305)
    report = h.check(GateState(lingering={"t": -1}))
    assert any("old" in x and "superseded" in x for x in report.superseded_started)
    assert any("policy hash" in x for x in report.orphans)
    assert not report.ok


# -- operator actions (pause, purge, redrive) ---------------------------------------------------


def _released_at(
    h: History, task: str, thread: str, at: int, end: int, attempt: int = 0, outcome: str = "success"
) -> None:
    """An attempt released at ``at`` ms: its token is the gate's clock then, in µs (a token is
    a value of the shard counter, which follows the clock in µs)."""
    h.token = at * MS - 1
    h.attempt(task, thread, at + 2, end, outcome, attempt=attempt, recv=at + 1)


def _check_ops(h: History, ops: Operations, gate: Optional[GateState] = None) -> Report:
    return check(h.events, gate or GateState(dead=h.dead), h.deletions, h.enqueues, LIMITS, None, ops)


@pytest.mark.parametrize("released, bad", [(100, True), (39, False), (203, False)])
def test_a_release_while_its_thread_was_paused(released: int, bad: bool) -> None:
    """Paused from 40 ms (the call returned) to 200 ms (the resume began): a member released in
    between broke the pause; one released before it (in flight) or by the resume did not."""
    h = History()
    h.enqueue("p-a", "p", 0)
    h.enqueue("p-b", "p", 1)
    _released_at(h, "p-a", "p", 10, 30)
    _released_at(h, "p-b", "p", released, released + 20)
    report = _check_ops(h, Operations(pauses=[("p", 40 * MS, 200 * MS)]))
    assert len(report.operator_violations) == bad, report.operator_violations
    assert report.paused_checked == 2


@pytest.mark.parametrize("start, bad", [(None, False), (30, True)])
def test_a_purged_member_never_starts_after_its_purge(start: Optional[int], bad: bool) -> None:
    """A purged member ends as deleted (REVOKED); an attempt of it after the purge is a
    violation."""
    h = History()
    h.enqueue("q-a", "q", 0, countdown=5)
    if start is not None:
        _released_at(h, "q-a", "q", start, start + 10)
    ops = Operations(purged=[Deletion("q-a", 20 * MS, 21 * MS)])
    report = check(h.events, GateState(), h.deletions, h.enqueues, LIMITS, {"q-a": "REVOKED"}, ops)
    assert len(report.operator_violations) == bad, report.operator_violations
    assert report.deleted == 1 and not report.bad_endings and not report.result_mismatches


@pytest.mark.parametrize("first, bad", [("r-a", False), ("r-b", True)])
def test_redriven_letters_run_again_in_their_places_order(first: str, bad: bool) -> None:
    """r-a died before r-b in place order; redriven together, r-a's next attempt 0 must be
    released first."""
    h = History()
    for task, at in (("r-a", 0), ("r-b", 1)):
        h.enqueue(task, "r", at)
    _released_at(h, "r-a", "r", 10, 20)
    _released_at(h, "r-b", "r", 30, 40)
    second = "r-b" if first == "r-a" else "r-a"
    _released_at(h, first, "r", 110, 120)
    _released_at(h, second, "r", 130, 140)
    report = _check_ops(h, Operations(redrives=[Redrive("r", 100 * MS, ("r-a", "r-b"))]))
    assert len(report.operator_violations) == bad, report.operator_violations
    assert report.redriven_checked == 2


def test_a_paused_thread_with_no_member_exists() -> None:
    """Paused at the end with no member: listed, and its paused entry is no orphan; a paused
    entry of a thread the run never had is one, and a paused thread not listed a violation."""
    h = History()
    h.enqueue("e-a", "e", 0)
    _released_at(h, "e-a", "e", 10, 20)
    pauses = [("e", 30 * MS, INF), ("f", 30 * MS, INF)]
    report = _check_ops(
        h, Operations(pauses=pauses), GateState(paused={"e": "x", "f": "x"}, listed=["e", "f"])
    )
    assert report.ok, report.format()
    report = _check_ops(h, Operations(pauses=pauses), GateState(paused={"e": "x", "g": "x"}, listed=["g"]))
    assert len(report.operator_violations) == 1 and len(report.orphans) == 1, report.format()


def test_a_redriven_member_lives_again_from_attempt_zero() -> None:
    """A member that died at its retry is redriven: its next attempts (0, then a retry 1) are
    another life's, not to be matched with the first life's schedules; its ended-index mark
    ("\\0redriven:<call>:<task id>") is no orphan."""
    h = History()
    h.enqueue("v-a", "v", 0)
    _released_at(h, "v-a", "v", 10, 20, outcome="retry")
    h.enqueue("v-a", "v", 20, countdown=100, attempt=1, landed=21)
    _released_at(h, "v-a", "v", 130, 140, attempt=1, outcome="die")
    h.enqueue("v-b", "v", 150, countdown=5_000)
    _released_at(h, "v-a", "v", 210, 220, outcome="retry")  # redriven at 200
    h.enqueue("v-a", "v", 220, countdown=20_000, attempt=1, landed=221)  # its second life
    _released_at(h, "v-b", "v", 5_200, 5_210)
    _released_at(h, "v-a", "v", 20_300, 20_310, attempt=1)
    gate = GateState(ended={"\0redriven:c1:v-a": 200.0, "v-a": 20_310.0, "v-b": 5_210.0})
    report = _check_ops(h, Operations(redrives=[Redrive("v", 200 * MS, ("v-a",))]), gate)
    assert report.ok, report.format()
    assert report.schedules_checked >= 3 and report.redriven_checked == 1


def test_releases_of_a_rate_limited_thread_closer_than_its_interval_are_caught() -> None:
    """thread_rate_limit: the release tokens (the shard counter, which follows the gate's clock
    in µs) of a rate-limited thread are its interval apart, less the clock's resolution."""

    def run(gap_ms: int) -> Report:
        h = History()
        for i, task in enumerate(("a", "b", "c")):
            h.enqueue(task, "t", 0)
            h.token = i * gap_ms * MS - 1  # the next release's token, in µs
            h.attempt(task, "t", 10 + i * gap_ms, 20 + i * gap_ms, recv=5 + i * gap_ms)
        limits = dataclasses.replace(LIMITS, rates={"t": 250 * MS})
        return check(h.events, GateState(), h.deletions, h.enqueues, limits)

    report = run(240)
    assert len(report.rate_violations) == 2 and "thread t" in report.rate_violations[0], report.format()
    assert not report.ok
    report = run(249)  # within the clock's resolution
    assert report.ok and report.rates_checked == 2, report.format()


def test_a_start_in_a_held_thread_before_the_operator_acted_is_caught() -> None:
    """on_death="hold": after a death nothing of the thread starts before the operator acts."""

    def run(resumed_at: int) -> Report:
        h = History()
        h.enqueue("a", "t", 0)
        h.enqueue("b", "t", 1)
        h.attempt("a", "t", 10, 100, "die", recv=5)
        h.die("a", "t", 101)
        h.events.append(Event("act", resumed_at * MS, thread="t", what="resume"))
        h.attempt("b", "t", 300, 400, recv=295)
        limits = dataclasses.replace(LIMITS, holding=frozenset({"t"}))
        return check(h.events, GateState(dead=h.dead), h.deletions, h.enqueues, limits)

    report = run(350)
    assert len(report.hold_violations) == 1 and "b#0" in report.hold_violations[0], report.format()
    assert not report.ok
    report = run(250)
    assert report.ok and report.holds_checked == 1, report.format()


def test_the_metrics_counters_agree_with_the_lives_that_ended() -> None:
    """After the run nothing is counted as running, and the endings counted are the lives that
    ended (a member that succeeded, one deleted)."""
    h = History()
    h.enqueue("a", "t", 0)
    h.enqueue("b", "t", 1)
    h.attempt("a", "t", 10, 20)
    h.deletions.append(Deletion("b", 30 * MS, 31 * MS))
    good = {"ended:succeeded": 1, "ended:deleted": 1, "running": 0}
    assert h.check(GateState(stats=good)).ok
    for bad in ({**good, "running": 1}, {**good, "ended:succeeded": 2}, {"ended:succeeded": 1}):
        report = h.check(GateState(stats=bad))
        assert any("metrics" in x for x in report.bad_endings), (bad, report.format())
