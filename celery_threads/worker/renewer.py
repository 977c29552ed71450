"""The release deadlines of the members a worker holds unstarted (prefetched, or waiting in
Celery's rate-limit bucket of their task; not yet claimed), renewed by the worker's main process;
a claimed member's lease is its pool process's to renew (:mod:`celery_threads.worker.lease`).  The
renewer's thread also runs the worker's tick every second: the bootstep's, which keeps the
handoff's flag in step with the worker.
"""

from __future__ import annotations

import time
from typing import Any, Optional

from celery.worker import state as worker_state

from ..gate import Renewal
from ..logs import get_logger
from ..publish import request_member
from ..runtime import Runtime
from . import native

logger = get_logger(__name__)


class LeaseRenewer:
    """Every keepalive/3, renews the release deadline of each threaded member this worker holds
    unclaimed in its prefetch buffer, and one it has just received about a second after.  A
    claimed member's lease is renewed by the process that claimed it, with its claimant
    (:class:`celery_threads.worker.lease.Keeper`); the gate refuses this renewal for it.  A native
    thread (:mod:`celery_threads.worker.native`): under gevent, a member's code holding the hub
    does not hold up these renewals either."""

    def __init__(self, runtime: Runtime, tick: Any = None, buckets: Any = None) -> None:
        """``buckets``: returns the worker consumer's rate-limit buckets (``task_buckets``)."""
        self.runtime = runtime
        self.tick = tick
        self.buckets = buckets
        self._stop = native.Flag()
        self._thread: Optional[native.NativeThread] = None

    def start(self) -> None:
        self._thread = native.NativeThread(self._run, "celery-threads-renew")
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def held(self) -> list[tuple[str, str, str]]:
        members = []
        for request in [*worker_state.reserved_requests, *self._bucketed()]:
            thread_id, token = request_member(request)
            if token:
                members.append((thread_id, request.id, token))
        return members

    def _bucketed(self) -> list[Any]:
        """The requests a task's rate limit holds in its bucket (kombu's ``TokenBucket``, whose
        ``contents`` are ``(request, tokens)``): received, not reserved until the bucket lets
        them go.  Read from this thread while the consumer's changes them: a read that meets a
        change is made again."""
        buckets = self.buckets() if self.buckets is not None else None
        for _ in range(3):
            try:
                return [
                    item[0]
                    for bucket in list((buckets or {}).values())
                    if bucket is not None
                    for item in list(getattr(bucket, "contents", ()))
                ]
            except RuntimeError:  # changed during the read
                continue
        return []

    def _renew(self, gate: Any, members: list[tuple[str, str, str]]) -> None:
        try:
            renewed = gate.renew_many(members)
            for (thread_id, task_id, _), status in zip(members, renewed):
                if status == Renewal.STALE:
                    logger.debug("celery-threads: %s no longer holds thread %s", task_id, thread_id)
        except Exception:
            logger.exception("celery-threads: could not renew leases; retrying")

    def _run(self) -> None:
        period = self.runtime.config.keepalive / 3.0
        gate = self.runtime.own_gate() if native.green() else self.runtime.gate
        while True:
            members = self.held()
            if self._stop.is_set() and not members:
                return
            if members:
                self._renew(gate, members)
            if self._stop.is_set():
                self._stop.wait(0.2)
                continue
            # The tick (the handoff's flag) runs every second; renewals every keepalive/3.  A
            # member received since then keeps its release's first deadline,
            # threads_release_timeout (60 s), were this worker to die: one still held a second
            # later is renewed at once, so that it lapses within the keepalive too.
            renewed = set(members)
            seen: set[tuple[str, str, str]] = set()
            deadline = time.monotonic() + period
            while not self._stop.is_set() and time.monotonic() < deadline:
                tick = self.tick
                if tick is not None:
                    try:
                        tick()
                    except Exception:
                        logger.exception("celery-threads: worker tick failed")
                self._stop.wait(min(1.0, max(deadline - time.monotonic(), 0.0)))
                fresh = [m for m in self.held() if m not in renewed]
                late = [m for m in fresh if m in seen]
                if late:
                    self._renew(gate, late)
                    renewed.update(late)
                seen = set(fresh)
