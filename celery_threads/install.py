"""Self-installation: ``base=ThreadedTask`` sets up the beat entry, the worker step and handlers."""

from __future__ import annotations

import logging
from typing import Any

from celery import shared_task, signals

from .config import dispatch_interval
from .logs import get_logger
from .protocol import BEAT_ENTRY, DISPATCH_TASK, THREAD_HEADER, warn_unthreaded

logger = get_logger(__name__)

#: Where Celery logs a task's sending (beat), receipt and success (worker) at INFO.
# celery.worker.request: "Discarding revoked task" of each tick that expired while no worker ran.
_TICK_LOGGERS = ("celery.beat", "celery.worker.strategy", "celery.app.trace", "celery.worker.request")


class _TickAtDebug(logging.Filter):
    """The dispatcher's tick, sent every ``threads_dispatch_interval``, would write three INFO
    lines a second across beat and worker: its lines are logged at DEBUG instead (dropped where
    the logger does not log DEBUG)."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, dict):
            tick = args.get("name") == DISPATCH_TASK
        else:  # only its str arguments: another object's __eq__ may raise (redbeat's entries)
            tick = isinstance(args, tuple) and any(isinstance(a, str) and a == DISPATCH_TASK for a in args)
        if not tick or record.levelno <= logging.DEBUG:
            return True
        if not logging.getLogger(record.name).isEnabledFor(logging.DEBUG):
            return False
        record.levelno, record.levelname = logging.DEBUG, logging.getLevelName(logging.DEBUG)
        return True


def _quiet_tick_logs() -> None:
    for name in _TICK_LOGGERS:
        target = logging.getLogger(name)
        if not any(isinstance(f, _TickAtDebug) for f in target.filters):
            target.addFilter(_TickAtDebug())


def install(app: Any) -> None:
    """Idempotent; called when a ThreadedTask is bound to ``app``."""
    if getattr(app, "_celery_threads_installed", False):
        return
    app._celery_threads_installed = True
    _add_steps(app)
    _quiet_tick_logs()
    schedule = dict(app.conf.beat_schedule or {})
    schedule.setdefault(BEAT_ENTRY, _beat_entry(app))
    app.conf.beat_schedule = schedule


def _beat_entry(app: Any) -> dict[str, Any]:
    interval = dispatch_interval(app)
    return {
        "task": DISPATCH_TASK,
        "schedule": interval,
        # A tick that waited longer than a few intervals is useless: a newer one is coming.
        "options": {"expires": max(interval * 5, 5.0)},
    }


@shared_task(name=DISPATCH_TASK, bind=True, ignore_result=True, send_events=False)
def _dispatch(self: Any) -> dict[str, int]:
    """One dispatcher pass (beat's safety net beside each worker's own loop); a shared task, so
    every app has it.  It sends no task events: Flower's task list shows the user's tasks."""
    from .dispatcher import Dispatcher
    from .runtime import get_runtime

    report = Dispatcher(get_runtime(self.app)).run_until_idle()
    return {
        "released": report.released,
        "republished": report.republished,
        "retried": report.retried,
        "died": report.died,
    }


@signals.before_task_publish.connect
def _on_publish(sender: Any = None, headers: Any = None, properties: Any = None, **kwargs: Any) -> None:
    """``send_task(name, ..., thread_id=X)``: Celery passes the unknown option to kombu as a
    message property, which AMQP does not carry; it goes in the headers, where a worker reads a
    message's thread id.  Then: a plain task given one is warned of."""
    from celery import current_app

    if isinstance(properties, dict) and isinstance(headers, dict) and THREAD_HEADER in properties:
        headers.setdefault(THREAD_HEADER, properties.pop(THREAD_HEADER))
    thread_id = (headers or {}).get(THREAD_HEADER)
    try:
        warn_unthreaded(current_app.tasks.get(sender) if isinstance(sender, str) else None, thread_id)
    except Exception:  # a warning must never stop a publish
        logger.debug("celery-threads: could not check %s for a thread_key", sender, exc_info=True)


@signals.worker_init.connect
def _add_worker_step(sender: Any = None, **kwargs: Any) -> None:
    # Task modules imported after the app was bound still get the step: worker_init comes before
    # the worker builds its blueprint.
    app = getattr(sender, "app", None)
    if app is not None and getattr(app, "_celery_threads_installed", False):
        _add_steps(app)


def _add_steps(app: Any) -> None:
    from .worker.bootstep import ThreadsWorkerStep
    from .worker.noack import NoAckQueues

    app.steps["worker"].add(ThreadsWorkerStep)
    app.steps["consumer"].add(NoAckQueues)


@signals.beat_init.connect
def _on_beat_start(sender: Any = None, **kwargs: Any) -> None:
    """Beat never uses the gate itself (its entry runs on a worker), but it is where an operator
    looks at start: it says there too when the gate's Redis may evict members."""
    app = getattr(sender, "app", None)
    if app is None or not getattr(app, "_celery_threads_installed", False):
        return
    from .config import read_config
    from .errors import ConfigurationError
    from .gate import make_client
    from .gate.eviction import check_eviction

    try:
        config = read_config(app)
    except ConfigurationError as exc:
        # As a worker does: beat's dispatch entry would fail on every worker.  A signal handler's
        # Exception is only logged by Celery; SystemExit stops beat.
        logger.critical("%s", exc)
        raise SystemExit(78) from None  # EX_CONFIG, as `celery threads` exits on it
    _keep_beat_entry(app, sender)
    client = make_client(config.redis_url, config.redis_options)
    try:
        check_eviction(client, config.redis_url)
    finally:
        client.close()


def _keep_beat_entry(app: Any, service: Any) -> None:
    """Beat's scheduler holds the dispatcher's entry, put back when a ``beat_schedule`` assigned
    after the app was finalized (``on_after_finalize``) replaced it; and it says so once (its
    ticks log at DEBUG: _TickAtDebug)."""
    scheduler: Any = getattr(service, "scheduler", None)
    held: Any = getattr(scheduler, "schedule", None)
    if isinstance(held, dict) and BEAT_ENTRY not in held:
        added = _beat_entry(app)
        app.conf.beat_schedule = {**(app.conf.beat_schedule or {}), BEAT_ENTRY: added}
        try:
            scheduler.update_from_dict({BEAT_ENTRY: added})
        except Exception:
            logger.error(
                "celery-threads: beat's schedule lacks the entry %s (%s every %ss), and it could not "
                "be added: without a worker's own dispatch loop, countdowns and lapsed members wait. "
                "Keep it when you set beat_schedule.",
                BEAT_ENTRY,
                DISPATCH_TASK,
                added["schedule"],
                exc_info=True,
            )
            return
        logger.warning(
            "celery-threads: beat_schedule was replaced after the app was finalized, without the entry "
            "%s: it is added back",
            BEAT_ENTRY,
        )
    held = getattr(scheduler, "schedule", None)
    entry = held.get(BEAT_ENTRY) if isinstance(held, dict) else None
    every: Any = getattr(getattr(entry, "schedule", None), "run_every", None)  # a ScheduleEntry's
    if every is None:
        every = ((app.conf.beat_schedule or {}).get(BEAT_ENTRY) or {}).get("schedule")
    seconds = every.total_seconds() if hasattr(every, "total_seconds") else every
    logger.info(
        "celery-threads: beat sends %s every %ss, the dispatcher's safety net", DISPATCH_TASK, seconds
    )


@signals.worker_process_init.connect
def _on_pool_process_start(**kwargs: Any) -> None:
    from .worker import handoff, shared

    shared.on_pool_process_start()
    handoff.on_pool_process_start()


@signals.worker_shutting_down.connect
def _on_worker_shutting_down(**kwargs: Any) -> None:
    from .worker.handoff import shutting_down

    shutting_down()


@signals.task_revoked.connect
def _on_task_revoked(sender: Any = None, **kwargs: Any) -> None:
    from .worker.revoke import on_task_revoked

    on_task_revoked(sender=sender, **kwargs)


@signals.task_retry.connect
def _on_task_retry(sender: Any = None, **kwargs: Any) -> None:
    from .worker.revoke import on_task_retry

    on_task_retry(sender=sender, **kwargs)


@signals.task_unknown.connect
def _on_task_unknown(sender: Any = None, **kwargs: Any) -> None:
    from .worker.strategy import on_unrunnable_message

    on_unrunnable_message(sender=sender, **kwargs)


@signals.task_rejected.connect
def _on_task_rejected(sender: Any = None, **kwargs: Any) -> None:
    from .worker.strategy import on_unrunnable_message

    on_unrunnable_message(sender=sender, **kwargs)
