"""Threaded tasks on a queue consumed without broker acknowledgements (``Queue(..., no_ack=True)``).

The broker forgets such a delivery once it hands it over, so these tests check what makes that safe
for threaded tasks: the worker's prefetch stays bounded, a worker killed while holding prefetched
members loses none of them, a warm shutdown hands back what the worker had not started, plain
tasks routed there are warned about, and the same workload as tests/tasks/test_brokers.py runs on both
brokers.
"""

from __future__ import annotations

import json
import os
import signal
import time
import uuid

import pytest
import redis

from celery_threads import Threads
from tests.conftest import rabbitmq_url
from tests.support.helpers import events, starts, tid, wait_for
from tests.tasks.test_brokers import BrokerContract


def noack_env(**overrides: str) -> dict[str, str]:
    return {"CT_NOACK_QUEUE": f"noack-{uuid.uuid4().hex[:8]}", **overrides}


#: The two ways a threaded delivery reaches a Redis-transport worker untracked by the broker: its
#: own queue declared without acknowledgements, or Celery's default queue (with acknowledgements),
#: whose threaded deliveries the worker keeps out of kombu's unacked index.
LAYOUTS = pytest.mark.parametrize("layout", ["no-ack queue", "default queue"])


def layout_env(layout: str, **overrides: str) -> dict[str, str]:
    return noack_env(**overrides) if layout == "no-ack queue" else overrides


def queue_length(redis_server, d) -> int:
    """Messages waiting in the threaded tasks' queue (kombu's Redis transport: one list per
    queue)."""
    broker = redis.Redis.from_url(d.env["CT_BROKER_URL"])
    return int(broker.llen(d.env.get("CT_NOACK_QUEUE") or d.env["CT_QUEUE"]))


@LAYOUTS
def test_prefetch_is_bounded(proj, make_deployment, redis_server, layout):
    """kombu does not count untracked deliveries against the prefetch limit; the worker's step
    does, so the releases it cannot start yet stay in the broker for other workers."""
    r = proj.history()
    d = make_deployment(**layout_env(layout, CT_PREFETCH="1"))
    w = d.worker("bounded", concurrency=1)
    assert "hands back the threaded ones it holds" in w.output()
    threads = [tid("bound") for _ in range(8)]
    results = [proj.record.delay(t, "only", sleep=0.6) for t in threads]
    wait_for(lambda: any(starts(r, t) for t in threads), what="a member to start")
    time.sleep(0.5)  # time for the worker to take more than it may
    # One running and at most one waiting in the worker (prefetch 1 x concurrency 1), besides
    # those that ended (a busy machine may have taken more than the sleep to look): counted
    # after the queue is read, they can only be more.
    waiting = queue_length(redis_server, d)
    ended = sum(1 for t in threads for e in events(r, t) if e.kind == "end")
    assert waiting >= len(threads) - 2 - ended, (waiting, ended)
    for x in results:
        assert x.get(timeout=60) == "only"


@LAYOUTS
def test_sigkilled_worker_holding_prefetched_members_loses_none(proj, make_deployment, redis_server, layout):
    """The broker forgot the deliveries the victim held; the gate republishes each once its release
    deadline lapses, and every member still runs, one at a time, in arrival order."""
    r = proj.history()
    d = make_deployment(
        **layout_env(layout, CT_PREFETCH="4"),
        CT_KEEPALIVE="2",
        CT_RELEASE_TIMEOUT="1",
        CT_DISPATCH_INTERVAL="0.2",
    )
    victim = d.worker("victim", concurrency=1)
    threads = [tid("held") for _ in range(5)]
    labels = [f"m{i}" for i in range(3)]
    results = [proj.record.delay(t, label, sleep=0.4) for label in labels for t in threads]
    # The victim runs one member and holds four more unstarted: the queue is empty.
    wait_for(
        lambda: any(starts(r, t) for t in threads) and queue_length(redis_server, d) == 0,
        what="the victim to hold the released members",
    )
    running = {t for t in threads if len(starts(r, t)) > len([e for e in events(r, t) if e.kind == "end"])}
    victim.kill(signal.SIGKILL)
    d.worker("survivor", concurrency=2)
    for x in results:
        assert x.get(timeout=90) in labels
    for t in threads:
        evs = events(r, t)
        if t in running:
            # Its attempt died with the victim (a start without an end); the member re-entered
            # behind the members already waiting, and nothing started before the crash ended.
            assert evs[0].kind == evs[1].kind == "start", evs
            evs = evs[1:]
            assert sorted(e.label for e in evs if e.kind == "start") == labels, evs
        else:
            assert [e.label for e in evs if e.kind == "start"] == labels, f"{t}: {evs}"
        for i, e in enumerate(evs):  # then serial: starts and ends alternate
            assert e.kind == ("start" if i % 2 == 0 else "end"), f"overlap in {t}: {evs}"
            assert e.kind == "start" or e.label == evs[i - 1].label, f"overlap in {t}: {evs}"
        wait_for(lambda t=t: Threads(proj.app).get(t) is None, what="thread to vanish")


def test_a_member_just_received_has_its_release_deadline_renewed_within_seconds(
    proj, make_deployment, redis_server
):
    """A member received since the renewer's last round (every keepalive/3) kept its release's
    first deadline, the release timeout (60 s): a worker killed then left it waiting that long
    (seen in an exploratory run), not the keepalive.  The renewer renews it about a second after
    it arrived.  With a keepalive of 90 s, its round every 30 s rarely comes in between."""
    from celery_threads.keys import Keys

    r = proj.history()
    d = make_deployment(CT_PREFETCH="4", CT_KEEPALIVE="90", CT_DISPATCH_INTERVAL="0.2")
    d.worker("holder", concurrency=1)
    go, blocker = f"go:{tid()}", tid("blocker")
    first = proj.record.delay(blocker, "block", until=go)  # holds the worker's one process
    wait_for(lambda: starts(r, blocker) == ["block"], what="the blocker to run")
    threads = [tid("fresh") for _ in range(3)]
    results = [proj.record.delay(t, "m") for t in threads]
    wait_for(lambda: queue_length(redis_server, d) == 0, what="the worker to hold the releases")
    gate = redis.Redis.from_url(d.env["CT_REDIS_URL"])
    keys = Keys(d.env["CT_KEY_PREFIX"])

    def renewed() -> bool:
        seconds, micros = gate.time()
        now_ms = seconds * 1000 + micros // 1000
        deadlines = [gate.hget(keys.thread(t).active, "deadline") for t in threads]
        # Renewed: the keepalive (90 s) from now, not the release timeout (60 s) from the release.
        return all(x is not None and int(x) > now_ms + 61_000 for x in deadlines)

    wait_for(renewed, timeout=15, what="the held members' release deadlines to be renewed")
    r.set(go, 1)
    assert [first.get(timeout=30), *(x.get(timeout=30) for x in results)] == ["block", "m", "m", "m"]


@LAYOUTS
def test_warm_shutdown_hands_back_unstarted_members(proj, make_deployment, redis_server, layout):
    """With a keepalive of a minute, the members a stopping worker held would wait a minute for
    their release deadline; handed back, they run on the other worker while the first one is
    still finishing its running member."""
    r = proj.history()
    d = make_deployment(**layout_env(layout, CT_PREFETCH="4"), CT_KEEPALIVE="60", CT_RELEASE_TIMEOUT="60")
    leaving = d.worker("leaving", concurrency=1)
    slow, *quick = [tid("back") for _ in range(4)]
    long_one = proj.record.delay(slow, "long", sleep=4)
    wait_for(lambda: starts(r, slow) == ["long"], what="the long member to start")
    results = [proj.record.delay(t, "quick") for t in quick]
    wait_for(
        lambda: (
            queue_length(redis_server, d) == 0
            and all(Threads(proj.app).get(t).active.state == "RELEASED" for t in quick)
        ),
        what="the leaving worker to hold the quick members",
    )
    staying = d.worker("staying", concurrency=1)
    os.kill(leaving.proc.pid, signal.SIGTERM)  # warm shutdown of the main process only
    try:
        for x in results:
            assert x.get(timeout=20) == "quick"
    except Exception:
        print(leaving.output()[-6000:])
        raise
    long_end = [e for e in events(r, slow) if e.kind == "end"]
    quick_starts = [e.at_us for t in quick for e in events(r, t) if e.kind == "start"]
    assert not long_end or max(quick_starts) < long_end[0].at_us, (
        "the handed-back members ran only after the leaving worker finished: "
        f"{leaving.output()} {staying.output()}"
    )
    assert long_one.get(timeout=20) == "long"
    leaving.proc.wait(30)
    assert "handed back 3 released member(s)" in leaving.output()
    for t in quick:
        assert starts(r, t) == ["quick"]


def test_plain_task_on_a_noack_queue_is_warned_about(proj, make_deployment):
    d = make_deployment(**noack_env(CT_NOACK_PLAIN="1"))
    w = d.worker("plain", concurrency=1)
    assert "plain task tests.support.proj.plain is routed to" in w.output()
    thread = tid("plain")
    assert proj.plain.delay(thread, "p").get(timeout=30) == "p"
    wait_for(
        lambda: w.output().count("plain task tests.support.proj.plain") >= 2,
        what="the warning at its first delivery",
    )
    assert w.output().count("plain task tests.support.proj.plain") == 2  # once per name


class TestRedisNoAckQueue(BrokerContract):
    broker = "redis-noack"

    def broker_url(self, redis_server) -> str:
        return redis_server.url(3)

    def extra_env(self) -> dict[str, str]:
        return noack_env()

    def test_unacked_index_stays_empty(self, proj, deployment, redis_server):
        """The threaded tasks went through the no-ack queue: kombu tracked none of their
        deliveries in its unacked index (that their acks make no call is checked below)."""
        thread = tid("idx")
        results = [proj.record.delay(thread, f"m{i}") for i in range(5)]
        for x in results:
            x.get(timeout=30)
        broker = redis.Redis.from_url(self.broker_url(redis_server))
        assert broker.hlen("unacked") == 0 and broker.zcard("unacked_index") == 0


class TestRabbitMQNoAckQueue(BrokerContract):
    broker = "amqp-noack"

    def broker_url(self, redis_server) -> str:
        return rabbitmq_url()

    def extra_env(self) -> dict[str, str]:
        return noack_env()

    def test_rejected_member_dies_without_closing_the_channel(self, proj, make_deployment, redis_server):
        """RabbitMQ closes a channel that rejects a delivery it does not track: the worker must
        not send the reject of a no-ack delivery (the gate ends the member).  With late acks,
        Celery rejects the message of a task that raised Reject.  (The worker also warns that
        RabbitMQ does not bound its prefetch.)"""
        r = proj.history()
        deployment = make_deployment(
            broker=self.broker_url(redis_server), CT_ACKS_LATE="1", **self.extra_env()
        )
        late = deployment.worker("late", concurrency=1)
        assert "applies no prefetch limit to such a consumer" in late.output()
        thread = tid("rej")
        proj.rejecter.delay(thread, "no")
        after = proj.record.delay(thread, "after")
        assert after.get(timeout=30) == "after"
        assert starts(r, thread) == ["no", "after"]
        for p in deployment.processes:
            assert "PRECONDITION_FAILED" not in p.output()
            assert "unknown delivery tag" not in p.output()

    def test_unknown_task_name_does_not_close_the_channel(self, proj, deployment):
        """Celery rejects a message naming a task it does not know before any strategy sees it."""
        r = proj.history()
        proj.app.send_task(
            "tests.support.proj.no_such_task", args=(1,), queue=deployment.env["CT_NOACK_QUEUE"]
        )
        thread = tid("unknown")
        assert proj.record.delay(thread, "after").get(timeout=30) == "after"
        workers = [p for p in deployment.processes if p.kind == "worker"]
        wait_for(
            lambda: any("no_such_task" in p.output() for p in workers),
            what="a worker to refuse the unknown task",
        )
        for p in workers:
            assert "PRECONDITION_FAILED" not in p.output()
        assert starts(r, thread) == ["after"]


def test_a_noack_delivery_makes_no_broker_call_when_acked_or_rejected(redis_server):
    """kombu's Redis transport still runs its unacked-index pipeline (MULTI, ZREM, HDEL, EXEC) for
    the ack of a delivery it never tracked; once marked, acking, rejecting and requeueing it reach
    no Redis server."""
    from kombu import Connection, Queue

    from celery_threads.worker.noack import is_no_ack_delivery, mark_delivery

    url = redis_server.url(5)
    name = f"marked-{uuid.uuid4().hex[:8]}"
    watcher = redis.Redis.from_url(url)
    with Connection(url) as conn:
        received = []
        tracked, untracked = Queue(f"{name}-acked"), Queue(name, no_ack=True)
        with conn.Consumer([tracked, untracked], callbacks=[lambda body, m: received.append(m)]):
            for queue in (tracked, untracked):
                conn.Producer().publish({"n": 1}, routing_key=queue.name, declare=[queue])
            while len(received) < 2:
                conn.drain_events(timeout=5)
            by_queue = {m.delivery_info["routing_key"]: m for m in received}
            assert not mark_delivery(by_queue[tracked.name])  # needs its ack: left alone
            message = by_queue[name]
            assert mark_delivery(message) and is_no_ack_delivery(message)
            before = watcher.info("commandstats")
            for _ in range(50):
                message.ack()
                message.reject()
                message.requeue()
            after = watcher.info("commandstats")
            by_queue[tracked.name].ack()
    changed = {
        k: after[k]["calls"] - before.get(k, {"calls": 0})["calls"]
        for k in after
        if after[k]["calls"] != before.get(k, {"calls": 0})["calls"]
    }
    # Unmarked, the 50 acks alone made 50 MULTI/ZREM/HDEL/EXEC each (checked by hand).
    assert changed.get("cmdstat_zrem", 0) < 50 and changed.get("cmdstat_hdel", 0) < 50, changed


def test_threaded_deliveries_stay_out_of_the_unacked_index(proj, make_deployment, redis_server):
    """On Celery's default queue over Redis (acknowledgements, late acks here): kombu tracks a
    running plain task in its unacked index, and none of the threaded ones."""
    r = proj.history()
    d = make_deployment(CT_ACKS_LATE="1")
    d.worker("idx", concurrency=2)
    broker = redis.Redis.from_url(d.env["CT_BROKER_URL"])
    plain_thread, thread = tid("idx-plain"), tid("idx")
    plain = proj.plain.delay(plain_thread, "p", sleep=1.5)
    threaded = [proj.record.delay(thread, f"m{i}", sleep=0.3) for i in range(4)]
    seen: set[str] = set()

    def tracked() -> bool:
        for raw in broker.hvals("unacked"):
            seen.add(json.loads(raw)[0]["headers"]["id"])
        return all(x.ready() for x in [plain, *threaded])

    wait_for(tracked, what="the tasks to end", interval=0.05)
    assert plain.id in seen  # the control: a plain task is tracked
    assert not seen & {x.id for x in threaded}, seen
    assert starts(r, thread) == [f"m{i}" for i in range(4)]


def test_untrack_releases_keeps_only_threaded_deliveries_out(redis_server):
    """At the transport level: on one acknowledged queue, a delivery carrying a release token is
    not written to the unacked index, and is then marked like a no-ack delivery; another is
    tracked and acked as kombu does."""
    from kombu import Connection, Queue

    from celery_threads.protocol import TOKEN_HEADER
    from celery_threads.worker.noack import mark_delivery, untrack_releases

    url = redis_server.url(5)
    queue = Queue(f"untracked-{uuid.uuid4().hex[:8]}")
    watcher = redis.Redis.from_url(url)
    with Connection(url) as conn:
        received = []
        with conn.Consumer([queue], callbacks=[lambda body, m: received.append(m)]) as consumer:
            assert untrack_releases(consumer.channel)
            producer = conn.Producer()
            producer.publish({"n": 1}, routing_key=queue.name, declare=[queue], headers={TOKEN_HEADER: "t1"})
            producer.publish({"n": 2}, routing_key=queue.name, declare=[queue])
            while len(received) < 2:
                conn.drain_events(timeout=5)
            release, plain = sorted(received, key=lambda m: m.payload["n"])
            assert watcher.hlen("unacked") == 1
            assert plain.delivery_tag.encode() in watcher.hkeys("unacked")
            assert mark_delivery(release) and not mark_delivery(plain)
            release.ack()
            plain.ack()
            assert watcher.hlen("unacked") == 0
    with Connection("memory://") as conn:
        assert not untrack_releases(conn.default_channel)  # only kombu's Redis transport


@LAYOUTS
def test_release_fetched_after_cancel_consumer_goes_back_to_the_queue(
    proj, make_deployment, redis_server, layout
):
    """An idle worker keeps a BRPOP pending; after ``cancel_consumer`` the release it pops has no
    consumer, and kombu puts it back through its unacked index.  An untracked release must go
    back too (not wait a minute for its release deadline)."""
    r = proj.history()
    d = make_deployment(**layout_env(layout))
    w = d.worker("cancel", concurrency=1)
    queue = d.env.get("CT_NOACK_QUEUE") or d.env["CT_QUEUE"]
    destination = [
        name for reply in proj.app.control.ping(timeout=2) for name in reply if name.startswith("cancel-")
    ]
    assert destination, w.output()
    assert proj.app.control.cancel_consumer(queue, destination=destination, reply=True, timeout=10)
    thread = tid("cancelled")
    result = proj.record.delay(thread, "back")
    wait_for(
        lambda: "no consumers" in w.output().lower() or queue_length(redis_server, d) == 1,
        what="the release to be popped or queued",
    )
    assert proj.app.control.add_consumer(queue, destination=destination, reply=True, timeout=10)
    assert result.get(timeout=20) == "back", w.output()[-3000:]
    assert starts(r, thread) == ["back"]
