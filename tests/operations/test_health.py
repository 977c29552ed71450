"""Thread health through ``Threads(app)``: status, summaries, stuck threads, stats.

No worker runs: the first member of each thread is released to the broker and stays RELEASED, the
others wait.  Stale states are written with a Gate whose clock runs in the past, or straight into
Redis.  Everything runs on private databases (see tests/support/isolated.py).
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest
import redis

from celery_threads import Threads
from celery_threads.gate import Gate
from tests.support.helpers import tid
from tests.support.isolated import envelope, gate_in_the_past, kill_member, server_ms

HOUR = 3600.0


@pytest.fixture
def app(isolated_app):
    return isolated_app


@pytest.fixture
def threads(app):
    return Threads(app)


def test_status_of_a_released_member_and_its_waiting_siblings(proj, app, threads):
    thread = tid("hs")
    before = server_ms(app)
    ids = [proj.record.delay(thread, f"m{i}").id for i in range(3)]
    status = threads.status(thread)
    after = server_ms(app)

    assert status.members == 3
    a = status.active
    assert (a.task_id, a.name, a.state, a.worker, a.claimed_at) == (
        ids[0],
        "tests.support.proj.record",
        "RELEASED",
        None,
        None,
    )
    assert before <= a.since.timestamp() * 1000 <= after
    release_timeout = app.conf.threads_release_timeout
    assert a.deadline - a.since == timedelta(seconds=release_timeout)
    assert 0 <= a.active_for <= (after - before) / 1000 + 0.01
    assert release_timeout - 2 < a.expires_in <= release_timeout
    assert [(m.task_id, m.arrival, m.retries, m.name) for m in status.waiting] == [
        (ids[1], 2, 0, "tests.support.proj.record"),
        (ids[2], 3, 0, "tests.support.proj.record"),
    ]
    assert status.next_eligible_at == status.waiting[0].scheduled_at
    assert status.head_age >= 0
    assert threads.status(tid("hs-none")) is None


def test_status_of_a_running_member_names_its_worker_and_lease(proj, app, threads):
    thread = tid("hs")
    task = proj.record.delay(thread, "a").id
    token = threads.gate.reads.snapshot(thread).active["token"]
    assert threads.gate.claim(thread, task, token, "w7@box") == 1

    a = threads.status(thread).active
    assert (a.state, a.worker) == ("RUNNING", "w7@box")
    assert a.deadline - a.claimed_at == timedelta(seconds=30)
    assert 28 < a.expires_in <= 30


def test_waiting_members_are_listed_in_release_order_with_arrival_order(proj, app, threads):
    thread = tid("hs")
    now = datetime.now(timezone.utc)
    first = proj.record.delay(thread, "first").id
    late = proj.record.apply_async((thread, "late"), eta=now + timedelta(seconds=60)).id
    early = proj.record.apply_async((thread, "early"), eta=now + timedelta(seconds=30)).id

    status = threads.status(thread)
    assert status.active.task_id == first
    assert [(m.task_id, m.arrival) for m in status.waiting] == [(early, 3), (late, 2)]
    assert 25 < -status.head_age <= 30


def test_summaries_give_one_line_per_thread(proj, app, threads):
    busy, idle = tid("hs-busy"), tid("hs-idle")
    for i in range(3):
        proj.record.delay(busy, f"m{i}")
    proj.record.apply_async((idle, "later"), countdown=60)

    rows = {s.thread_id: s for s in threads.summaries(batch=1)}
    assert set(rows) == {busy, idle}
    assert (rows[busy].members, rows[busy].active_state) == (3, "RELEASED")
    assert rows[busy].active_for >= 0 and rows[busy].head_age >= 0
    assert (rows[idle].members, rows[idle].active_task, rows[idle].active_for) == (1, None, None)
    assert 55 < -rows[idle].head_age <= 60


def test_lapsed_lease_of_a_running_member_is_stuck(app, threads):
    thread, task = tid("hs-lease"), "lease-task"
    past = gate_in_the_past(app, HOUR)
    token = past.enqueue(thread, task, envelope(task, thread)).release.token
    assert past.claim(thread, task, token, "lost@box") == 1

    [stuck] = threads.stuck()
    assert (stuck.thread_id, stuck.kind, stuck.task_id, stuck.state, stuck.worker) == (
        thread,
        "lease",
        task,
        "RUNNING",
        "lost@box",
    )
    assert HOUR - 30 - 5 < stuck.overdue_for < HOUR - 30 + 5
    assert "dispatcher" in stuck.reason and "lost@box" in stuck.reason


def test_lapsed_release_written_into_redis_is_stuck(proj, app, threads):
    thread = tid("hs-release")
    task = proj.record.delay(thread, "a").id
    # Stale state, straight into Redis: the release deadline passed ten minutes ago.
    keys = threads.gate.keys.thread(thread)
    lapsed = server_ms(app) - 600_000
    client = threads.gate.client
    client.hset(keys.active, "deadline", lapsed)
    client.zadd(keys.shard.leases, {thread: lapsed})

    [stuck] = threads.stuck()
    assert (stuck.thread_id, stuck.kind, stuck.task_id, stuck.state, stuck.worker) == (
        thread,
        "release",
        task,
        "RELEASED",
        None,
    )
    assert 600 <= stuck.overdue_for < 605
    assert stuck.overdue_since == datetime.fromtimestamp(lapsed / 1000, tz=timezone.utc)


def test_due_head_not_released_is_stuck(app, threads):
    thread, task = tid("hs-head"), "head-task"
    past = gate_in_the_past(app, HOUR)
    # Scheduled ten seconds after the past gate's "now": it waits, and nobody releases it.
    outcome = past.enqueue(thread, task, envelope(task, thread), delay_ms=10_000)
    assert outcome.release is None

    [stuck] = threads.stuck()
    assert (stuck.thread_id, stuck.kind, stuck.task_id, stuck.state) == (thread, "head", task, "WAITING")
    assert HOUR - 15 < stuck.overdue_for < HOUR - 5
    assert "not released" in stuck.reason


def test_healthy_threads_are_not_stuck(proj, app, threads):
    for _ in range(3):
        proj.record.delay(tid("hs-ok"), "now")
        proj.record.apply_async((tid("hs-ok"), "later"), countdown=30)
    # Due half a second ago: the dispatcher has a few ticks left to release it.
    recent = gate_in_the_past(app, 1.0)
    recent.enqueue(tid("hs-ok"), "recent-head", envelope("recent-head", "t"), delay_ms=500)
    assert threads.stuck() == []


def test_stuck_waits_a_few_dispatcher_ticks(app, threads):
    thread, task = tid("hs-grace"), "grace-task"
    # Due one second ago and not released: within a few ticks of 0.5 s ... then not.
    gate_in_the_past(app, 2.0).enqueue(thread, task, envelope(task, thread), delay_ms=1_000)
    assert threads.stuck_after == 3 * app.conf.threads_dispatch_interval
    assert threads.stuck(grace=5.0) == []
    assert [s.task_id for s in threads.stuck(grace=0.5)] == [task]


def test_stuck_lists_the_most_overdue_first(app, threads):
    for hours, name in ((1, "one"), (3, "three"), (2, "two")):
        thread = tid(f"hs-{name}")
        gate_in_the_past(app, hours * HOUR).enqueue(thread, name, envelope(name, thread), delay_ms=1_000)
    assert [s.task_id for s in threads.stuck()] == ["three", "two", "one"]


def test_stuck_reads_the_indexes_by_score_never_every_thread(proj, app, threads, monkeypatch):
    for _ in range(60):
        proj.record.delay(tid("hs-many"), "a")
        proj.record.apply_async((tid("hs-many"), "b"), countdown=60)
    thread = tid("hs-one")
    gate_in_the_past(app, HOUR).enqueue(thread, "only", envelope("only", thread), delay_ms=1)

    sent: list[str] = []

    def recording(original):
        def record(self, *args, **kwargs):
            sent.append(str(args[0]).upper())
            return original(self, *args, **kwargs)

        return record

    for cls, name in (
        (redis.Redis, "execute_command"),
        (redis.client.Pipeline, "pipeline_execute_command"),
        (redis.client.Pipeline, "immediate_execute_command"),
    ):
        monkeypatch.setattr(cls, name, recording(getattr(cls, name)))
    assert [s.task_id for s in threads.stuck()] == ["only"]
    monkeypatch.undo()

    assert not {"SCAN", "ZSCAN", "KEYS", "HSCAN"} & set(sent), sent
    assert sent.count("ZRANGEBYSCORE") == 2
    assert len(sent) < 15, sent


def test_stats_count_threads_members_by_state_and_dead_letters(proj, app, threads):
    a, b, c = tid("hs-a"), tid("hs-b"), tid("hs-c")
    for i in range(3):
        proj.record.delay(a, f"a{i}")
    proj.record.delay(b, "b0")
    proj.record.apply_async((c, "c0"), countdown=60)
    task_b = threads.get(b).active.task_id
    token = threads.gate.reads.snapshot(b).active["token"]
    threads.gate.claim(b, task_b, token, "w@box")
    kill_member(threads.gate, tid("hs-dead"), "dead-1")

    stats = threads.stats()
    assert stats.threads == 3
    assert stats.members == {"WAITING": 3, "RELEASED": 1, "RUNNING": 1}
    assert (stats.dead, stats.stuck, stats.oldest_waiting_head) == (1, 0, None)
    assert abs((datetime.now(timezone.utc) - stats.now).total_seconds()) < 5


def test_stats_name_the_oldest_waiting_head_and_count_the_stuck(app, threads):
    old, older = tid("hs-old"), tid("hs-older")
    gate_in_the_past(app, 60).enqueue(old, "old", envelope("old", old), delay_ms=1)
    gate_in_the_past(app, 120).enqueue(older, "older", envelope("older", older), delay_ms=1)
    lease = tid("hs-lease")
    past = gate_in_the_past(app, HOUR)
    token = past.enqueue(lease, "run", envelope("run", lease)).release.token
    past.claim(lease, "run", token, "gone@box")

    stats = threads.stats()
    head = stats.oldest_waiting_head
    assert (head.thread_id, head.task_id) == (older, "older")
    assert 115 < head.age < 125
    assert (stats.threads, stats.stuck) == (3, 3)
    assert stats.members == {"WAITING": 2, "RELEASED": 0, "RUNNING": 1}
    assert threads.stats(grace=2 * HOUR).stuck == 0


def test_gate_health_reads_are_read_only(proj, app, threads):
    thread = tid("hs-ro")
    proj.record.delay(thread, "a")
    proj.record.delay(thread, "b")
    client = threads.gate.client
    before = {k: client.dump(k) for k in client.keys("*")}
    threads.stats()
    threads.stuck(grace=0)
    list(threads.summaries())
    threads.status(thread)
    assert {k: client.dump(k) for k in client.keys("*")} == before
    assert isinstance(threads.gate, Gate)
