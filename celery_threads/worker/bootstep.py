"""The worker's bootstep: what celery-threads starts and stops with every worker of an app with
threaded tasks.

:class:`ThreadsWorkerStep` makes the memory shared with the pool processes before the pool forks,
wraps the revoke command, and runs the renewer of unstarted members' release deadlines (in a
thread of the operating system, so it works under every pool, gevent's included), the lease
watchdog and the worker's dispatch loop.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Callable, Optional

from celery import bootsteps

from .. import seams
from ..config import read_config
from ..errors import ConfigurationError
from ..gate import transport
from ..logs import get_logger
from ..protocol import warn_unthreaded
from ..runtime import get_runtime, unreachable
from . import handoff, lease, member, processes, shared
from .noack import hand_back_on_pool_close
from .renewer import LeaseRenewer
from .revoke import wrap_revoke_command

logger = get_logger(__name__)


@contextmanager
def _stops_on_a_setting_to_fix() -> Iterator[None]:
    """A :class:`ConfigurationError` stops the worker with one CRITICAL line, as beat stops
    (install._on_beat_start), not a traceback; exit status 78 (EX_CONFIG), as `celery threads`."""
    try:
        yield
    except ConfigurationError as exc:
        logger.critical("celery-threads: the worker cannot start: %s", exc)
        raise SystemExit(78) from None


class ThreadsWorkerStep(bootsteps.StartStopStep):
    """Installed in every worker of an app with threaded tasks: renewer, lease watchdog and
    dispatch loop."""

    label = "celery-threads"

    def __init__(self, worker: Any, **kwargs: Any) -> None:
        self.renewer: Optional[LeaseRenewer] = None
        self.watchdog: Optional[lease.Watchdog] = None
        self.loop: Any = None
        with _stops_on_a_setting_to_fix():
            config = read_config(worker.app)
            problem = unreachable(config)
            if isinstance(problem, ConfigurationError):
                raise problem  # TLS on one side only: a setting to fix
            refused = None if problem is None else transport.refused(config.shown_url, problem)
            if refused is not None:  # it answered: wrong credentials, or no such database
                raise refused
        if problem is not None:
            # As Celery's own "Cannot connect to ...": at once, then the dispatch loop goes on
            # saying so while the gate does not answer.
            logger.error(
                "celery-threads: cannot reach the gate's Redis at %s (threads_redis_url): "
                "%s. Check that the server runs and accepts connections from here, and "
                "the URL's host, port, password and TLS options (threads_redis_options); "
                "the worker starts and keeps trying",
                config.shown_url,
                f"{type(problem).__name__}: {problem}",
            )
        with _stops_on_a_setting_to_fix():
            # A gate that answers is checked now (its rights, its shard count); one that does
            # not, at its first use.
            runtime = get_runtime(worker.app)
        # Before the consumer fetches a release; raises when a seam that cannot fall back does
        # not hold (the worker does not start), else logs which seams are in use.
        self.fallen = seams.check_worker(worker.app, runtime.client if runtime.checked else None)
        processes.GREEN = bool(getattr(worker.pool_cls, "is_green", False))
        shared.prepare(shared.pool_size(worker))  # before the pool forks
        handoff.prepare(worker)

    def start(self, worker: Any) -> None:
        from ..dispatcher import DispatchLoop

        runtime = get_runtime(worker.app)
        for task in list(worker.app.tasks.values()):
            warn_unthreaded(task)
        runtime.send_task_event = _task_event_sender(worker)
        wrap_revoke_command()
        hand_back_on_pool_close(worker)
        self.renewer = LeaseRenewer(
            runtime,
            tick=lambda: handoff.sync(worker),
            buckets=lambda: getattr(getattr(worker, "consumer", None), "task_buckets", None),
        )
        self.renewer.start()
        self.watchdog = lease.Watchdog(runtime.config.keepalive)
        self.watchdog.start()
        if runtime.config.worker_dispatch:
            self.loop = DispatchLoop(runtime)
            self.loop.start()
        pool = type(getattr(worker, "pool", None)).__module__
        if pool == "celery.concurrency.solo":
            member.cut_off_on_cold_shutdown(worker.pool)
        if "eventlet" in pool:
            logger.warning(
                "celery-threads: the eventlet pool is not covered: a member that holds "
                "its hub past threads_keepalive (%ss) loses its lease and may run beside "
                "the next one. Use prefork, threads, solo or gevent",
                runtime.config.keepalive,
            )
        logger.info(
            "celery-threads: ready: gate %s, keepalive %ss, %s; %s",
            runtime.config.shown_url,
            runtime.config.keepalive,
            f"dispatch every {runtime.config.dispatch_interval}s"
            if runtime.config.worker_dispatch
            else "no dispatch here (threads_worker_dispatch is off: celery beat releases retries "
            "and countdown/eta members)",
            f"{self.fallen} fast path(s) fell back to Celery's public API (see the warning above)"
            if self.fallen
            else "every fast path available"
            if runtime.checked
            else "the gate's own fast path judged once the gate answers",
        )

    def stop(self, worker: Any) -> None:
        handoff.sync(worker, stopping=True)
        if self.renewer is not None:
            self.renewer.tick = None
        if self.loop is not None:
            self.loop.stop()
        if self.renewer is not None:
            self.renewer.stop()  # keeps renewing what is still held, then ends
        if self.watchdog is not None:
            self.watchdog.stop()

    def shutdown(self, worker: Any) -> None:
        self.stop(worker)


def _task_event_sender(worker: Any) -> Callable[..., None]:
    """Sends a task event for a member this worker's main process ends outside any request (a
    lapsed lease, a pool process lost while it ran a member by handoff), when the worker sends
    task events (``-E``, or ``enable_events`` at runtime), on a connection of its own: the
    dispatch loop calls it from its thread, where the consumer's connection is not to be used."""
    main = os.getpid()

    def send(kind: str, **fields: Any) -> None:
        events = getattr(getattr(worker, "consumer", None), "event_dispatcher", None)
        if os.getpid() != main or events is None or not events.enabled:
            return
        try:
            with worker.app.events.default_dispatcher(hostname=worker.hostname) as dispatcher:
                dispatcher.send(kind, **fields)
        except Exception:
            logger.warning(
                "celery-threads: could not send %s for %s", kind, fields.get("uuid"), exc_info=True
            )

    return send
