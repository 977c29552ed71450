"""Members with ``expires``: one that expires while it waits in its thread, or before a lost
release is published again, ends as Celery reports an expired task (REVOKED), and its thread moves
on at once.  One shared body per broker."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest
from celery import Task
from celery.exceptions import TaskRevokedError

from celery_threads import Threads
from celery_threads.errors import ReleaseExpired
from celery_threads.gate import Gate, Release
from celery_threads.publish import CapturingProducer, release_message
from celery_threads.runtime import get_runtime
from tests.conftest import rabbitmq_url
from tests.support.helpers import assert_serial, collect_events, starts, the_event, tid, wait_for


@pytest.fixture
def r(proj):
    return proj.history()


def assert_expired(result) -> None:
    """What Celery's worker stores for a task that expired before it ran."""
    wait_for(lambda: result.state == "REVOKED", timeout=20, what=f"{result.id} to be REVOKED")
    assert isinstance(result.result, TaskRevokedError) and "expired" in str(result.result)


def _release_of(proj, expires) -> Release:
    """A release of a ``record`` call captured with ``expires``."""
    with proj.app.producer_or_acquire() as real:
        capture = CapturingProducer(real)
        result = Task.apply_async(proj.record, ("t", "x"), expires=expires, producer=capture)
    assert capture.envelope is not None
    return Release("t", result.id, "7", 0, capture.envelope)


def test_the_ttl_is_counted_from_each_publish_not_from_the_capture(proj):
    """The captured message's ``expiration`` (its TTL when it was captured) is never replayed:
    every publish sends what is left until ``expires``."""
    expires = datetime.now(timezone.utc) + timedelta(seconds=30)
    release = _release_of(proj, 3600)  # captured with a TTL of an hour ...
    stored = release.envelope.decode()
    later = stored.replace(stored.split('"expires":"')[1].split('"')[0], expires.isoformat())
    _, options = release_message(proj.app, Release("t", release.task_id, "7", 0, later.encode()))
    assert options["expiration"] == pytest.approx(30, abs=5)  # ... sent with what is left


def test_an_expired_release_is_not_published(proj):
    release = _release_of(proj, datetime.now(timezone.utc) - timedelta(seconds=1))
    with pytest.raises(ReleaseExpired):
        release_message(proj.app, release)
    # A dead letter goes out all the same (whatever consumes them decides).
    _, options = release_message(proj.app, release, expired_ok=True)
    assert options["expiration"] == 0.001


class ExpiryContract:
    broker: str = ""

    def broker_url(self, redis_server) -> str:
        raise NotImplementedError

    def test_a_member_that_expired_while_waiting_ends_and_the_next_runs(
        self, proj, make_deployment, redis_server, r
    ):
        """The second member's expires passes while the first runs: when the first ends, the
        second is not published at all (RabbitMQ would drop it for its TTL before the worker
        could take it, here where the first member's late ack holds the only prefetch slot, and
        the gate would republish it forever); it ends REVOKED, and the third runs right after
        the first."""
        d = make_deployment(
            broker=self.broker_url(redis_server),
            CT_DISPATCH_INTERVAL="0.2",
            CT_ACKS_LATE="1",
            CT_PREFETCH="1",
        )
        w = d.worker("w", concurrency=1)
        thread = tid(f"exp-{self.broker}")
        first = proj.record.delay(thread, "first", sleep=3)
        wait_for(lambda: starts(r, thread) == ["first"], what="the first member to start")
        late = proj.record.apply_async((thread, "late"), expires=1)
        third = proj.record.delay(thread, "third")
        # The release timeout is 60 s: a blocked thread would not get the third member this soon.
        assert third.get(timeout=20) == "third"
        assert first.get(timeout=5) == "first"
        assert_expired(late)
        assert starts(r, thread) == ["first", "third"]
        assert_serial(r, thread)
        assert f"{late.id}] received" not in w.output(), "published after it expired"
        wait_for(lambda: Threads(proj.app).get(thread) is None, what="the thread to vanish")

    def test_a_lost_release_that_expired_is_ended_instead_of_republished(
        self, proj, make_deployment, redis_server, r
    ):
        """A release that never reached the broker, whose expires passes before its release
        deadline: the dispatcher's republish ends it instead (no worker ever receives it), and
        the member behind it runs."""
        d = make_deployment(
            broker=self.broker_url(redis_server), CT_RELEASE_TIMEOUT="1.5", CT_DISPATCH_INTERVAL="0.2"
        )
        w = d.worker("w", concurrency=1)
        thread = tid(f"lost-exp-{self.broker}")
        runtime = get_runtime(proj.app)
        # Released by a gate that publishes nothing itself, and then never published: a producer
        # that died between the gate and the broker.
        gate = Gate(runtime.client, runtime.keys, release_timeout_ms=runtime.config.release_timeout_ms)
        with proj.app.producer_or_acquire() as real:
            capture = CapturingProducer(real)
            lost = Task.apply_async(proj.record, (thread, "lost"), expires=0.3, producer=capture)
        assert gate.enqueue(thread, lost.id, capture.envelope).release is not None
        nxt = proj.record.delay(thread, "next")
        assert nxt.get(timeout=20) == "next"
        assert_expired(lost)
        assert starts(r, thread) == ["next"]
        assert f"{lost.id}] received" not in w.output(), "republished after it expired"
        wait_for(lambda: Threads(proj.app).get(thread) is None, what="the thread to vanish")


class TestRedisBroker(ExpiryContract):
    broker = "redis"

    def broker_url(self, redis_server) -> str:
        return redis_server.url(3)


class TestRabbitMQBroker(ExpiryContract):
    broker = "amqp"

    def broker_url(self, redis_server) -> str:
        return rabbitmq_url()

    def test_a_member_that_expires_in_the_broker_ends_at_its_ttl(
        self, proj, make_deployment, redis_server, r
    ):
        """Published with a TTL of one second behind a busy worker (a plain task's late ack
        holds its only prefetch slot): RabbitMQ drops it when the TTL ends, so no delivery will
        ever claim it.  Its release deadline was brought forward to the TTL's end: it ends
        REVOKED then, not after the 60 s release timeout, and the member behind it runs.  (Only
        here: kombu's Redis transport keeps no TTL, and a worker revokes the member on
        receipt.)"""
        d = make_deployment(
            broker=rabbitmq_url(), CT_DISPATCH_INTERVAL="0.2", CT_ACKS_LATE="1", CT_PREFETCH="1"
        )
        d.worker("w", concurrency=1)
        thread = tid("ttl")
        busy_thread = tid("busy")
        busy = proj.plain.delay(busy_thread, "busy", sleep=4)
        wait_for(lambda: starts(r, busy_thread) == ["busy"], what="the plain task to start")
        doomed = proj.record.apply_async((thread, "doomed"), expires=1)
        nxt = proj.record.delay(thread, "next")
        assert nxt.get(timeout=20) == "next"
        assert_expired(doomed)
        assert starts(r, thread) == ["next"]
        busy.get(timeout=10)


def test_a_member_that_expired_while_waiting_is_announced_expired(proj, make_deployment, r):
    """Its task-revoked event says expired (it said expired=False, as for a delete)."""
    d = make_deployment(CT_DISPATCH_INTERVAL="0.2")
    d.worker("exp-ev", concurrency=1, extra=["-E"])
    got, stop = collect_events(proj.app)
    try:
        thread = tid("exp-ev")
        first = proj.record.delay(thread, "first", sleep=2)
        wait_for(lambda: starts(r, thread) == ["first"], what="the first member to start")
        late = proj.record.apply_async((thread, "late"), expires=0.5)
        assert first.get(timeout=30) == "first"
        revoked = the_event(got, "task-revoked", late.id)
        assert revoked.get("expired") is True, revoked
        assert_expired(late)
    finally:
        stop()
