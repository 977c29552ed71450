"""Receipt: what the worker's main process does with a threaded member's delivery (the task's
strategy), before any pool process runs it.

* :func:`threaded_strategy` checks the fencing token of a delivery that may be a duplicate
  (redelivered, or republished by the gate) before Celery even logs it as received, so a stale
  delivery, or a redelivery of a member already started, is acked and dropped without a
  ``task-received`` event or a result-backend write for the live task.  The claim itself
  happens when the task starts (``ThreadedTask.__call__``): a member prefetched by a worker that
  shuts down before starting it stays RELEASED, so its redelivery runs elsewhere.
* A threaded task's message that did not come through the gate enters its thread here.
* A released member whose message no worker can run dies at once (:func:`kill_unrunnable`),
  also when Celery refuses it before any strategy runs (:func:`on_unrunnable_message`).
* Deliveries the broker does not track are handled in :mod:`celery_threads.worker.noack`.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import redis
from celery.exceptions import NotRegistered
from celery.worker.strategy import default as default_strategy

from .. import policies
from ..errors import ConfigurationError, ThreadFull
from ..gate import NO_HOLDER, Enqueue
from ..logs import get_logger
from ..protocol import (
    REPUBLISHED_HEADER,
    THREAD_HEADER,
    THREADED_REQUEST,
    TOKEN_HEADER,
    eta_ms,
    foreign_gate,
    retry_settings,
)
from ..publish import encode_envelope
from ..runtime import Runtime, get_runtime
from .noack import CONSUMER_FLAG, mark_delivery

logger = get_logger(__name__)


def _keep_threaded_request(task: Any) -> None:
    """A threaded task whose class names a ``Request`` of its own (``Request = MyRequest``):
    the worker makes its requests of that class mixed with the package's
    (:class:`~celery_threads.worker.request.ThreadedRequest`, after it in the MRO), so that its
    hard time limits, lost pool processes and late failures still end the member in the gate.
    Alone, it did not: such a member read ``FAILURE`` and ran again once its lease lapsed."""
    from celery.utils.imports import symbol_by_name

    ThreadedRequest = symbol_by_name(THREADED_REQUEST)  # noqa: N806 (request.py imports this module)
    request = symbol_by_name(task.Request)
    if issubclass(request, ThreadedRequest):
        return
    task.Request = type(
        request.__name__,
        (request, ThreadedRequest),
        {"__module__": request.__module__, "__doc__": request.__doc__},
    )


def threaded_strategy(task: Any, app: Any, consumer: Any, **kwargs: Any) -> Any:
    _keep_threaded_request(task)
    handle = default_strategy(task, app, consumer, **kwargs)
    runtime = get_runtime(app)
    connection_errors = consumer.connection_errors

    def drop(ack: Any) -> None:
        ack(logger, connection_errors)

    def task_message_handler(
        message: Any, body: Any, ack: Any, reject: Any, callbacks: Any, **kw: Any
    ) -> Any:
        if getattr(consumer, CONSUMER_FLAG, False):
            mark_delivery(message)  # untracked by the broker: no ack, no reject
        headers = message.headers or {}
        token = headers.get(TOKEN_HEADER)
        if not token:
            try:
                return _enter_gate_from_worker(
                    task,
                    runtime,
                    message,
                    lambda: drop(ack),
                    lambda: reject(logger, connection_errors, False),
                )
            except redis.RedisError as exc:
                # The gate is unreachable: the message goes back to the broker, for a worker
                # that reaches it (or this one, later).
                logger.warning(
                    "celery-threads: %s[%s] could not enter its thread: the gate at "
                    "%s did not answer (%s); requeued",
                    task.name,
                    headers.get("id"),
                    runtime.config.shown_url,
                    exc,
                )
                reject(logger, connection_errors, True)
                return None
        thread_id, task_id = str(headers.get(THREAD_HEADER)), str(headers.get("id"))
        try:
            state = (
                runtime.gate.reads.peek(thread_id, task_id, token)
                if may_be_duplicate(message)
                else "RELEASED"
            )
        except redis.RedisError as exc:
            # Unchecked, it goes on: its claim, when it starts, lets one delivery run.
            logger.warning(
                "celery-threads: could not check %s[%s] of thread %s against the "
                "gate (%s); its claim decides",
                task.name,
                task_id,
                thread_id,
                exc,
            )
            state = "RELEASED"
        if state != "RELEASED":
            # RUNNING under this token: a redelivery of a member another attempt has started;
            # anything else: a stale release.  Either way the live task is not touched.
            foreign = foreign_gate(headers, runtime.config.key_prefix)
            why = foreign or ("a duplicate delivery" if state == "RUNNING" else "a stale release")
            logger.log(
                logging.WARNING if foreign is not None else logging.INFO,
                "celery-threads: dropped %s[%s] of thread %s: %s (token %s)",
                task.name,
                task_id,
                thread_id,
                why,
                token,
            )
            drop(ack)
            return None
        try:
            return handle(message, body, ack, reject, callbacks, **kw)
        except Exception as exc:  # undecodable body, refused content type, invalid message
            kill_unrunnable(runtime, headers, exc)
            raise  # Celery rejects and logs the message as usual

    return task_message_handler


def may_be_duplicate(message: Any) -> bool:
    """Whether a delivery may repeat one that was already received: the broker redelivered it
    (RabbitMQ's flag; kombu's Redis transport marks restored messages), or the gate published
    its release again (the dispatcher's republish of a lost release, a retried publish).

    Only those are checked against the gate on receipt; a first delivery of a first publish is
    the live release (or a stale one whose member was deleted, which the revoke that came with
    the deletion drops).  Whatever slips through is still stopped by the claim when the task
    starts: it ends as an ignored task instead of being dropped before Celery logs it.
    """
    headers = message.headers or {}
    if headers.get(REPUBLISHED_HEADER) or headers.get("redelivered"):
        return True
    return bool((message.delivery_info or {}).get("redelivered"))


def kill_unrunnable(
    runtime: Runtime,
    headers: dict[str, Any],
    exc: BaseException,
    holder: Optional[str] = NO_HOLDER,
    report: bool = True,
) -> None:
    """A released member whose message no worker can run dies now, instead of being republished
    forever: it goes to the dead letters with the reason, its result is ``FAILURE`` (a member
    that died), and its thread moves on.  ``holder``: the claimant prefix of the pool process
    that had the message (see :meth:`Gate.kill`); by default none did, and a member another
    delivery's claim runs is left alone.  ``report``: false where Celery's request stores the
    failure itself."""
    token = headers.get(TOKEN_HEADER)
    if not token:
        return
    task_id = str(headers.get("id"))
    try:
        runtime.kill(
            str(headers.get(THREAD_HEADER)),
            task_id,
            str(token),
            exc=exc,
            retries=int(headers.get("retries") or 0),
            holder=holder,
            reason=f"{type(exc).__name__}: the worker cannot run this message: {exc}",
            report=report,
        )
    except Exception as failed:
        logger.error(
            "celery-threads: could not dead-letter unrunnable member %s: %r", task_id, failed, exc_info=True
        )


def on_unrunnable_message(sender: Any = None, message: Any = None, exc: Any = None, **kwargs: Any) -> None:
    """``task_unknown`` / ``task_rejected``: a released member Celery refused before any strategy
    ran (a task name this worker does not know, an invalid message)."""
    headers = getattr(message, "headers", None) or {}
    if not headers.get(TOKEN_HEADER):
        return
    app = getattr(sender, "app", None)
    if app is None or not getattr(app, "_celery_threads_installed", False):
        return
    if kwargs.get("name"):
        exc = NotRegistered(kwargs["name"])
    runtime = get_runtime(app)
    foreign = foreign_gate(headers, runtime.config.key_prefix)
    if foreign is not None:  # not this gate's member: its own gate republishes it
        name = kwargs.get("name") or "a member"
        logger.warning("celery-threads: %s[%s]: %s", name, headers.get("id"), foreign)
        return
    kill_unrunnable(runtime, headers, exc or RuntimeError("message refused"))


def _enter_gate_from_worker(task: Any, runtime: Runtime, message: Any, ack: Any, reject: Any) -> None:
    """A threaded task's message that did not come through the gate (``send_task`` by name from
    another program, a dead letter sent back): the worker enqueues it into its thread.  Its
    thread id is the ``thread_id`` header, else the message property that ``send_task(...,
    thread_id=X)`` makes of it (kombu's for an option it does not know), else its arguments'.
    A message that cannot enter (no thread id, a task's invalid option, a full thread) is
    rejected, and its result says why, as Celery's is for an unregistered task."""
    headers = dict(message.headers or {})
    delivery = message.delivery_info or {}
    props = message.properties or {}
    envelope = encode_envelope(
        message.body,
        {
            "exchange": delivery.get("exchange") or "",
            "routing_key": delivery.get("routing_key"),
            "content_type": message.content_type,
            "content_encoding": message.content_encoding,
            "headers": {**headers, "eta": None},
            **{k: props.get(k) for k in ("correlation_id", "reply_to", "priority")},
        },
    )

    def refuse(exc: BaseException, why: str) -> None:
        logger.error("celery-threads: rejected %s[%s]: %s", task.name, headers.get("id"), why)
        runtime.mark_failed(str(headers.get("id")), exc, envelope, int(headers.get("retries") or 0))
        reject()

    try:
        max_retries, retry_delay_ms = retry_settings(task)
        policy = policies.resolve(task, {})  # the task's own: a call's options are not known
    except ConfigurationError as exc:
        return refuse(exc, str(exc))
    try:
        args, kwargs, _ = message.decode()
        given = headers.get(THREAD_HEADER)
        thread_id = task.resolve_thread_id(args, kwargs, props.get(THREAD_HEADER) if given is None else given)
    except Exception as exc:
        return refuse(
            exc,
            f"it came without a thread id ({exc}). Publish it with apply_async(thread_id=...) "
            "or give the task a thread_key.",
        )
    eta = headers.get("eta")
    outcome = runtime.gate.enqueue(
        thread_id,
        headers["id"],
        envelope,
        at_ms=eta_ms(eta) if eta else None,
        max_retries=max_retries,
        retry_delay_ms=retry_delay_ms,
        policy=policy.text,
        max_waiting=policy.max_waiting,
    )
    if outcome.status == Enqueue.FULL:
        why = f"thread {thread_id!r} already has {policy.max_waiting} or more waiting members (max_waiting)"
        return refuse(ThreadFull(f"{why}: {headers['id']} was not stored", thread_id, headers["id"]), why)
    runtime.publish(outcome.release)
    ack()
