"""Self-installation: ``base=ThreadedTask`` sets up the beat entry, the worker step and handlers."""
from __future__ import annotations

import logging
from typing import Any

from celery import shared_task, signals

from .protocol import BEAT_ENTRY, DISPATCH_TASK

logger = logging.getLogger(__name__)



def install(app: Any) -> None:
    """Idempotent; called when a ThreadedTask is bound to ``app``."""
    if getattr(app, "_celery_threads_installed", False):
        return
    app._celery_threads_installed = True
    _add_steps(app)
    interval = float(app.conf.get("threads_dispatch_interval") or 1.0)
    schedule = dict(app.conf.beat_schedule or {})
    schedule.setdefault(BEAT_ENTRY, {
        "task": DISPATCH_TASK,
        "schedule": interval,
        # A tick that waited longer than a few intervals is useless: a newer one is coming.
        "options": {"expires": max(interval * 5, 5.0)},
    })
    app.conf.beat_schedule = schedule


@shared_task(name=DISPATCH_TASK, bind=True, ignore_result=True)
def _dispatch(self: Any) -> dict[str, int]:
    """One dispatcher pass (beat's safety net beside each worker's own loop); a shared task, so
    every app has it."""
    from .dispatcher import Dispatcher
    from .runtime import get_runtime

    report = Dispatcher(get_runtime(self.app)).run_until_idle()
    return {"released": report.released, "republished": report.republished,
            "retried": report.retried, "died": report.died}


@signals.worker_init.connect
def _add_worker_step(sender: Any = None, **kwargs: Any) -> None:
    # Task modules imported after the app was bound still get the step: worker_init comes before
    # the worker builds its blueprint.
    app = getattr(sender, "app", None)
    if app is not None and getattr(app, "_celery_threads_installed", False):
        _add_steps(app)


def _add_steps(app: Any) -> None:
    from .worker.noack import NoAckQueues
    from .worker.step import ThreadsWorkerStep

    app.steps["worker"].add(ThreadsWorkerStep)
    app.steps["consumer"].add(NoAckQueues)


@signals.worker_process_init.connect
def _on_pool_process_start(**kwargs: Any) -> None:
    from .worker import lease
    from .worker.handoff import on_pool_process_start

    lease.on_pool_process_start()
    on_pool_process_start()


@signals.worker_shutting_down.connect
def _on_worker_shutting_down(**kwargs: Any) -> None:
    from .worker.handoff import shutting_down

    shutting_down()


@signals.task_revoked.connect
def _on_task_revoked(sender: Any = None, **kwargs: Any) -> None:
    from .worker.step import on_task_revoked

    on_task_revoked(sender=sender, **kwargs)


@signals.task_unknown.connect
def _on_task_unknown(sender: Any = None, **kwargs: Any) -> None:
    from .worker.step import on_unrunnable_message

    on_unrunnable_message(sender=sender, **kwargs)


@signals.task_rejected.connect
def _on_task_rejected(sender: Any = None, **kwargs: Any) -> None:
    from .worker.step import on_unrunnable_message

    on_unrunnable_message(sender=sender, **kwargs)
