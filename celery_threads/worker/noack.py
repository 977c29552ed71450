"""Deliveries the broker does not track: the fast path for threaded tasks.

The gate keeps every member until it ends, so a threaded task's message is only the notice of a
release: when a worker dies holding it, the release deadline lapses (the worker no longer renews
it), the dispatcher publishes it again under the same token, and the claim lets one delivery run.
The broker's own tracking of such a delivery protects nothing more, and with kombu's Redis
transport it costs the worker a round trip to the transport's unacked index when the message
arrives and another when it is acked.  A threaded delivery goes untracked in two ways:

* on any queue of the Redis transport, unless ``threads_track_releases`` is set
  (:func:`untrack_releases`: kombu's QoS does not record a message carrying a release token);
* on a queue declared ``Queue(name, no_ack=True)``, on any broker.

What the worker needs for such deliveries, installed by :class:`NoAckQueues`:

* a prefetch bound: kombu counts only tracked deliveries against ``worker_prefetch_multiplier``,
  so without one a worker would take every release on the queue.  With kombu's virtual
  transports (Redis) the channel stops fetching while the worker holds as many unstarted tasks as
  its prefetch count.  RabbitMQ applies no prefetch to a no-ack consumer; the worker says so.
* no broker calls for these deliveries: their ack, reject and requeue are no-ops
  (:func:`mark_delivery`).
* a hand-back at shutdown (:func:`hand_back_on_pool_close`, installed by the worker step):
  releases it holds unstarted are published again at once, instead of waiting for their release
  deadline to lapse.
* a warning for plain tasks on a no-ack queue: their message is lost if the worker dies before
  the task ends, as with any Celery task consumed without acknowledgements.
* the same no-op ack and reject for a message Celery refuses before any strategy sees it (an
  unknown task name, an invalid or undecodable message).
"""

from __future__ import annotations

from types import MethodType
from typing import Any, Callable

from celery import bootsteps
from celery.worker import state as worker_state

from .. import seams
from ..logs import get_logger
from ..protocol import DISPATCH_TASK, TOKEN_HEADER, is_threaded
from ..publish import request_member
from ..runtime import get_runtime

logger = get_logger(__name__)

#: Set on Celery's consumer while it may receive deliveries the broker does not track.
CONSUMER_FLAG = "_celery_threads_no_ack"
#: Set on a message that came from such a queue.
_DELIVERY_FLAG = "_celery_threads_untracked"


def mark_delivery(message: Any) -> bool:
    """Whether the broker does not track ``message`` (from a no-ack consumer, or a release kept
    out of the Redis transport's unacked index); if so, its ``ack``, ``reject`` and ``requeue``
    become no-ops.  Call it when the message is received.

    py-amqp names the consumer in ``delivery_info`` and keeps its channel's no-ack consumers;
    kombu's virtual transports (Redis, SQS, ...) do neither, but keep every delivery that needs an
    ack in the channel's QoS from before the message is handed over, so one missing there is
    untracked.  Acknowledging such a delivery wastes a round trip (kombu's Redis transport still
    runs its unacked-index pipeline), and RabbitMQ answers a reject of it by closing the channel.
    A threaded member's retry or death is the gate's; a plain task's message has nowhere to go
    back to.
    """
    channel = message.channel
    tag = message.delivery_info.get("consumer_tag")
    if tag is not None:
        no_ack = tag in (getattr(channel, "no_ack_consumers", None) or ())
    else:
        delivered = seams.qos_delivered(getattr(channel, "qos", None))
        no_ack = delivered is not None and message.delivery_tag not in delivered
    if no_ack:
        message.ack = message.reject = message.requeue = _untracked
        setattr(message, _DELIVERY_FLAG, True)
    return no_ack


def is_no_ack_delivery(message: Any) -> bool:
    """For a message already received (and marked by :func:`mark_delivery`)."""
    return bool(getattr(message, _DELIVERY_FLAG, False))


def _untracked(*args: Any, **kwargs: Any) -> None:
    """The ack, reject or requeue of a delivery the broker does not track."""


class NoAckQueues(bootsteps.StartStopStep):
    """Installed in the consumer of every worker of an app with threaded tasks; acts when the
    worker may receive untracked threaded deliveries (the Redis transport, or a queue declared
    with ``no_ack=True``)."""

    label = "celery-threads no-ack queues"
    requires = ("celery.worker.consumer.tasks:Tasks",)

    def start(self, c: Any) -> None:
        channel = c.task_consumer.channel
        queues = sorted(q.name for q in c.task_consumer.queues if q.no_ack)
        untracked = not get_runtime(c.app).config.track_releases and untrack_releases(channel)
        setattr(c, CONSUMER_FLAG, bool(queues) or untracked)
        if not (queues or untracked):
            return
        bounded = bound_prefetch(channel)
        mark_before_refusing(c)
        if untracked:
            logger.info(
                "celery-threads: threaded tasks' deliveries stay out of the Redis "
                "transport's unacked index (the gate recovers them); this worker holds "
                "at most its prefetch count of unstarted tasks (%s) and hands back the "
                "threaded ones it holds when it shuts down",
                c.qos.value if c.qos else "unbounded",
            )
        if not queues:
            return
        names = ", ".join(queues)
        if bounded:
            logger.info(
                "celery-threads: consuming %s without broker acknowledgements; this "
                "worker holds at most its prefetch count of unstarted tasks (%s) and "
                "hands back the threaded ones it holds when it shuts down",
                names,
                c.qos.value if c.qos else "unbounded",
            )
        else:
            logger.warning(
                "celery-threads: consuming %s without broker acknowledgements over %s, which "
                "applies no prefetch limit to such a consumer: this worker may take every "
                "release on the queue while other workers wait. Prefer the Redis transport for "
                "a no_ack queue, or declare it with acknowledgements.",
                names,
                c.connection.transport.driver_type,
            )
        guard_plain_tasks(c, set(queues))


def untrack_releases(channel: Any) -> bool:
    """With kombu's Redis transport, keep threaded tasks' deliveries out of the channel's ack
    bookkeeping, whatever their queue: kombu records every delivery of an acknowledged queue in
    its unacked index (a pipeline when it arrives, another when it is acked) so that it can put
    the message back if the worker dies, and the gate already does that for a release (its
    deadline lapses, the dispatcher republishes it under the same token).  Such a delivery then
    looks like one from a queue without acknowledgements, and is handled the same way.
    ``False`` for another transport (RabbitMQ tracks deliveries itself; SQS needs its ack to
    delete the message)."""
    from kombu.transport.redis import QoS as RedisQoS

    qos: Any = getattr(channel, "qos", None)
    if not isinstance(qos, RedisQoS) or not seams.active("untracked-releases"):
        return False
    append: Any = getattr(qos, "append")
    if getattr(append, "_celery_threads", False):
        return True
    transport = channel.connection
    requeue_inbound(transport)

    def untracked_append(message: Any, delivery_tag: Any) -> Any:
        headers = message.headers
        if headers and headers.get(TOKEN_HEADER) and not transport.__dict__.get(_REQUEUING):
            return None
        return append(message, delivery_tag)

    untracked_append._celery_threads = True  # type: ignore[attr-defined]
    setattr(qos, "append", untracked_append)
    return True


#: Set on kombu's virtual transport while it puts back a message that arrived for a queue no
#: longer consumed.
_REQUEUING = "_celery_threads_requeuing"


def requeue_inbound(transport: Any) -> None:
    """A fetch still pending when the queue's consumer is cancelled (``cancel_consumer``, a
    shutdown) delivers a message nobody consumes; kombu puts it back through the unacked index
    (track, then reject with requeue), so a release must be tracked there too, or it would wait
    for its release deadline."""
    original, install = seams.reject_inbound_hook(transport)
    if getattr(original, "_celery_threads", False):
        return

    def reject_inbound(raw_message: Any) -> Any:
        transport.__dict__[_REQUEUING] = True
        try:
            return original(raw_message)
        finally:
            transport.__dict__[_REQUEUING] = False

    reject_inbound._celery_threads = True  # type: ignore[attr-defined]
    install(reject_inbound)


def hand_back_on_pool_close(worker: Any) -> None:
    """Hand back the releases the worker holds unstarted just before its pool closes: a warm or
    cold shutdown drops the tasks the pool has not started (the broker redelivers those it
    tracks), and the requests with them."""
    pool = getattr(worker, "pool", None)
    if pool is None:
        return
    done: set[tuple[str, str]] = set()
    for name in ("on_close", "on_terminate"):
        original = getattr(pool, name, None)
        if original is None or getattr(original, "_celery_threads", False):
            continue

        def hook(*args: Any, _original: Any = original, **kwargs: Any) -> Any:
            try:
                hand_back(worker, done)
            except Exception:
                logger.exception("celery-threads: hand-back at shutdown failed")
            return _original(*args, **kwargs)

        hook._celery_threads = True  # type: ignore[attr-defined]
        setattr(pool, name, hook)


def hand_back(worker: Any, done: set[tuple[str, str]]) -> None:
    """Publish again, under the same token, each release this worker holds unstarted from a queue
    without acknowledgements (``done``: those handed back already)."""
    consumer = getattr(worker, "consumer", None)
    if not getattr(consumer, CONSUMER_FLAG, False):
        return
    held = []
    for request in list(worker_state.reserved_requests):
        thread_id, token = request_member(request)
        key = (request.id, token)
        if (
            not token
            or request in worker_state.active_requests
            or key in done
            or not is_no_ack_delivery(request.message)
        ):
            continue
        done.add(key)
        held.append((thread_id, request.id, token))
    if not held:
        return
    stop_fetching(consumer)
    runtime = get_runtime(worker.app)
    try:
        outcomes = runtime.gate.hand_back(held)
    except Exception:
        logger.exception(
            "celery-threads: could not hand back %d released members; the "
            "dispatcher republishes them when their release deadline lapses",
            len(held),
        )
        return
    returned = [o.release for o in outcomes if o.release is not None]
    for release in returned:
        runtime.publish(release, republish=True)
    logger.info(
        "celery-threads: handed back %d released member(s) this worker held "
        "unstarted; they were published again",
        len(returned),
    )


def stop_fetching(consumer: Any) -> None:
    """Cancel the task consumer (Celery does it a moment later in its shutdown) and settle a fetch
    still pending on the channel, so that the releases handed back go to other workers: kombu's
    Redis transport keeps a BRPOP outstanding between loop iterations, and a message it pops now
    finds no consumer and is put back on its queue."""
    task_consumer = getattr(consumer, "task_consumer", None)
    if task_consumer is None:
        return
    try:
        task_consumer.cancel()
        seams.settle_fetch(task_consumer.channel)
    except Exception:  # Empty (the fetch timed out), or a connection already gone
        logger.debug("celery-threads: settling the pending fetch at shutdown", exc_info=True)


def bound_prefetch(channel: Any) -> bool:
    """Make a virtual channel stop fetching while the worker holds as many unstarted tasks as its
    prefetch count, whatever their queue (as Celery's ``worker_disable_prefetch`` does with the
    pool size).  ``False`` when the transport has no such hook (py-amqp)."""
    qos: Any = getattr(channel, "qos", None)
    if not seams.active("untracked-releases"):
        return False
    original = getattr(qos, "can_consume", None)
    if original is None or getattr(original, "_celery_threads", False):
        return original is not None
    reserved, active = worker_state.reserved_requests, worker_state.active_requests

    def can_consume(self: Any) -> bool:
        limit = self.prefetch_count
        if limit and len(reserved) - len(active) >= limit:
            return False
        return bool(original())

    can_consume._celery_threads = True  # type: ignore[attr-defined]
    qos.can_consume = MethodType(can_consume, qos)
    return True


def mark_before_refusing(c: Any) -> None:
    """Celery acks or rejects a message it cannot hand to any strategy (an unknown task name, an
    invalid or undecodable message) itself: mark a no-ack delivery first, so that its reject
    does not reach RabbitMQ (which would close the channel over the unknown delivery tag)."""
    for name, at in (
        ("on_unknown_task", 1),
        ("on_unknown_message", 1),
        ("on_invalid_task", 1),
        ("on_decode_error", 0),
    ):
        refuse = getattr(c, name, None)
        if refuse is None or getattr(refuse, "_celery_threads", False):
            continue

        def marked(*args: Any, _refuse: Any = refuse, _at: int = at) -> Any:
            if getattr(c, CONSUMER_FLAG, False) and len(args) > _at:
                mark_delivery(args[_at])
            return _refuse(*args)

        marked._celery_threads = True  # type: ignore[attr-defined]
        setattr(c, name, marked)


def guard_plain_tasks(c: Any, queues: set[str]) -> None:
    """Warn about plain tasks on a queue consumed without acknowledgements: at start for those
    routed there, and at the first delivery of each task name that arrives there.  The delivery
    check wraps the plain tasks' strategies, again whenever Celery rebuilds them (a consumer
    restart, ``pool_restart`` with reload)."""
    app = c.app
    if not c.__dict__.get("_celery_threads_routes_checked"):
        c._celery_threads_routes_checked = True
        for name, task in sorted(app.tasks.items()):
            if is_threaded(task) or name.startswith("celery.") or name == DISPATCH_TASK:
                continue
            try:
                queue = app.amqp.router.route({}, name).get("queue")
            except Exception:
                continue
            if getattr(queue, "name", queue) in queues:
                logger.warning(_PLAIN_WARNING, name, getattr(queue, "name", queue))
    warned: set[str] = c.__dict__.setdefault("_celery_threads_warned", set())

    def wrap() -> None:
        for name, strategy in list(c.strategies.items()):
            task = app.tasks.get(name)
            if task is not None and not is_threaded(task) and not getattr(strategy, "_celery_threads", False):
                c.strategies[name] = _guarded(name, strategy, warned)

    wrap()
    rebuild = c.update_strategies
    if not getattr(rebuild, "_celery_threads", False):

        def update_strategies(*args: Any, **kwargs: Any) -> Any:
            result = rebuild(*args, **kwargs)
            if getattr(c, CONSUMER_FLAG, False):
                wrap()
            return result

        update_strategies._celery_threads = True  # type: ignore[attr-defined]
        c.update_strategies = update_strategies


_PLAIN_WARNING = (
    "celery-threads: plain task %s is routed to %s, a queue consumed without broker "
    "acknowledgements: its message is lost if the worker dies before the task "
    "ends. Only threaded tasks are safe there (the gate keeps them); route plain "
    "tasks to a queue with acknowledgements."
)


def _guarded(name: str, strategy: Callable[..., Any], warned: set[str]) -> Callable[..., Any]:
    def task_message_handler(
        message: Any, body: Any, ack: Any, reject: Any, callbacks: Any, **kw: Any
    ) -> Any:
        if mark_delivery(message) and name not in warned and name != DISPATCH_TASK:
            warned.add(name)
            logger.warning(
                _PLAIN_WARNING,
                name,
                "a queue"
                if not message.delivery_info.get("routing_key")
                else f"{message.delivery_info['routing_key']!r}",
            )
        return strategy(message, body, ack, reject, callbacks, **kw)

    task_message_handler._celery_threads = True  # type: ignore[attr-defined]
    return task_message_handler
