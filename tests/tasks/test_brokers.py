"""The same workload on each broker: Redis and RabbitMQ (one shared body, subclassed per broker)."""

from __future__ import annotations

import signal

import pytest

from celery_threads import Threads
from celery_threads.runtime import get_runtime
from tests.conftest import rabbitmq_url
from tests.support.helpers import assert_serial, starts, tid, wait_for


class BrokerContract:
    broker: str = ""

    def broker_url(self, redis_server) -> str:
        raise NotImplementedError

    def extra_env(self) -> dict[str, str]:
        return {}

    @pytest.fixture
    def deployment(self, make_deployment, redis_server):
        d = make_deployment(
            broker=self.broker_url(redis_server),
            CT_KEEPALIVE="2",
            CT_DISPATCH_INTERVAL="0.2",
            **self.extra_env(),
        )
        d.worker("a", concurrency=2)
        d.worker("b", concurrency=2)
        d.beat()
        return d

    def test_threads_are_serial_ordered_and_retry(self, proj, deployment):
        r = proj.history()
        threads = [tid(self.broker) for _ in range(6)]
        results = []
        go = f"go:{threads[0]}"  # each m0 held until every call was sent, however slowly
        for t in threads:
            results.append(proj.record.delay(t, "m0", sleep=0.05, fail_times=1, countdown=0.3, until=go))
            results += [proj.record.delay(t, f"m{i}", sleep=0.05) for i in range(1, 4)]
        r.set(go, 1)
        for x in results:
            x.get(timeout=60)
        for t in threads:
            # m0's retry re-enters at now + 0.3 s, after its siblings' arrival times.
            assert starts(r, t) == ["m0", "m1", "m2", "m3", "m0"]
            assert_serial(r, t)
            wait_for(lambda t=t: Threads(proj.app).get(t) is None, what="thread to vanish")

    def test_sigkilled_worker_is_recovered(self, proj, deployment):
        r = proj.history()
        thread = tid(self.broker)
        doomed = proj.record.delay(thread, "doomed", sleep=30)
        nxt = proj.record.delay(thread, "next")
        wait_for(lambda: starts(r, thread) == ["doomed"], what="doomed to start")
        holder = _holder(proj, thread)
        victim = next(p for p in deployment.processes if p.kind == "worker" and p.name == holder)
        victim.kill(signal.SIGKILL)
        assert nxt.get(timeout=60) == "next"
        Threads(proj.app).delete(doomed.id)


def _holder(proj, thread: str) -> str:
    """The name of the worker holding the thread's active member (names are "<name>-<hex>@host")."""
    snapshot = get_runtime(proj.app).gate.reads.snapshot(thread)
    return snapshot.active["worker"].split("-")[0]


class TestRedisBroker(BrokerContract):
    broker = "redis"

    def broker_url(self, redis_server) -> str:
        return redis_server.url(3)


class TestRabbitMQBroker(BrokerContract):
    broker = "amqp"

    def broker_url(self, redis_server) -> str:
        return rabbitmq_url()


def test_a_countdown_to_a_quorum_queue_behind_a_topic_exchange_keeps_its_route(redis_server):
    """Celery 5.5+ routes a call with a countdown or eta to RabbitMQ's native delayed delivery
    (the ``celery_delayed_27`` exchange) where the app has a quorum queue and the route's exchange
    is not direct.  The gate holds the countdown itself: the stored message kept that route, and
    its release went to an exchange no worker had declared (stuck RELEASED), or would have been
    delayed twice; a countdown under a second raised kombu's ValueError.  Nothing is published
    here: the member waits in the gate."""
    import uuid

    from celery import Celery
    from kombu import Exchange, Queue

    from celery_threads import ThreadedTask
    from celery_threads.publish import decode_envelope

    app = Celery("quorum", broker=rabbitmq_url(), backend=redis_server.url(1), set_as_current=False)
    exchange = Exchange("ct_quorum_topic", type="topic")
    app.conf.update(
        threads_redis_url=redis_server.url(2),
        threads_key_prefix=f"ct-quorum-{uuid.uuid4().hex[:6]}",
        task_queues=[Queue("ct_quorum", exchange, "ct.#", queue_arguments={"x-queue-type": "quorum"})],
        task_default_queue="ct_quorum",
        task_default_exchange="ct_quorum_topic",
        task_default_exchange_type="topic",
        task_default_routing_key="ct.call",
    )

    @app.task(base=ThreadedTask, thread_key="thread", shared=False)
    def quorum_call(thread):
        return thread

    threads = Threads(app)
    for options in ({"countdown": 30}, {"countdown": 0.5}):
        call = quorum_call.apply_async((tid("quorum"),), **options)
        try:
            header, _ = decode_envelope(threads.gate.reads.record(call.id).envelope)
            assert (header["exchange"], header["routing_key"]) == ("ct_quorum_topic", "ct.#"), header
        finally:
            threads.delete(call.id)


def test_send_task_with_a_thread_id_carries_it_in_the_headers_on_rabbitmq():
    """``send_task(name, ..., thread_id=X)``: Celery passes the option to kombu as a message
    property, and AMQP carries no such property: the worker saw no thread id, and the call joined
    its arguments' thread.  It travels in the headers, read here from the queue itself."""
    import uuid

    from celery import Celery
    from kombu import Connection, Queue

    queue = f"ct_by_name_{uuid.uuid4().hex[:8]}"
    app = Celery("by-name", broker=rabbitmq_url(), set_as_current=False)
    app.conf.task_default_queue = queue
    with Connection(rabbitmq_url()) as conn:
        declared = Queue(queue, auto_delete=False)(conn.default_channel)
        declared.declare()
        try:
            app.send_task("elsewhere.threaded", ("arg-thread",), thread_id="the-thread")
            got: list = []

            def fetched() -> bool:
                message = declared.get(no_ack=True)
                if message is not None:
                    got.append(message)
                return bool(got)

            wait_for(fetched, what="the message in its queue")
            assert got[0].headers.get("thread_id") == "the-thread", got[0].headers
        finally:
            declared.delete()
