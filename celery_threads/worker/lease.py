"""Leases a worker holds: the local lease clock, renewal by the claimant, and the stop.

A worker never runs a member's code past the lease it last confirmed.  Each member a process claims
gets a :class:`Lease`.  Its ``expires`` is on this machine's monotonic clock: the time *before* the
call that confirmed the lease (the claim, or the last renewal) was sent, plus ``threads_keepalive``.
The gate's deadline is the Redis server's clock when the call ran, plus the same keepalive, so it is
never earlier (clock rates apart, which the margin covers).  A :class:`Keeper` thread in the
process renews every lease it holds every keepalive/3, fenced by the claim's claimant, and learns
there when the gate no longer counts the member as this process's (deleted, lapsed, claimed again
after a lost write).  It is a thread of the operating system also under gevent
(:mod:`celery_threads.worker.native`), with a gate client of its own there: a member's code that holds
the hub does not hold up its renewals.

Stopping a member whose lease is running out, or lost:

* **prefork**: while a member's code runs, its pool process publishes the lease's ``expires`` in
  memory shared with the worker's main process (one entry per pool process, made before the pool
  forks: :mod:`celery_threads.worker.shared`).  The main process watches those entries
  (:class:`Watchdog`, every ``WATCH_INTERVAL``) and SIGKILLs a pool process whose member's lease
  ends within ``margin()``: before the gate can count the lease as lapsed, whatever the member's
  code is doing (a body holding the GIL in C code cannot stop a thread of its own process, but is
  stopped from outside).  A lost lease kills the process at once.  The worker then sees the pool
  process lost (``WorkerLostError``), as for any crash.
* **threads, solo, gevent, eventlet**: the member's code runs in the worker's own process and
  cannot be stopped from outside it.  The keeper logs an error naming the member when its lease
  runs out or is lost while it runs; the next member may then run beside it.  Use prefork
  where a member can outlive a lost connection to the gate.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Optional

from ..gate import Gate, Renewal, claimant_prefix
from ..gate.records import unique_id
from ..logs import get_logger
from ..runtime import Runtime
from . import native, shared

logger = get_logger(__name__)

#: How often the main process's watchdog reads the lease ends (seconds).
WATCH_INTERVAL = 0.05


def margin(keepalive: float) -> float:
    """How long before a lease's local end its member is stopped: 5% of the keepalive, at least
    0.25 s.  It covers the watchdog's reading interval (50 ms) and a late wake-up of its thread on
    a busy host (not measured: the 0.25 s floor leaves five reading intervals for it), the kill
    itself (immediate), and a drift between this host's monotonic clock and the Redis server's
    (NTP slews at most 500 ppm: 15 ms over 30 s).  What it does not cover is a step of the Redis
    server's wall clock."""
    return max(0.25, 0.05 * keepalive)


def new_claimant(hostname: str) -> str:
    """A claim's own id: the worker, the process, and an id of the process's own (two deliveries
    of one release in one process are two claimants; a process that reuses a dead one's pid
    draws another nonce)."""
    return claimant_prefix(hostname, os.getpid()) + unique_id()


class Lease:
    """A member this process holds under its claim."""

    __slots__ = ("thread_id", "task_id", "token", "claimant", "sent", "expires", "lost", "running")

    def __init__(
        self, thread_id: str, task_id: str, token: str, claimant: str, sent: float, expires: float
    ) -> None:
        self.thread_id, self.task_id, self.token = thread_id, task_id, token
        self.claimant = claimant
        self.sent = sent  # monotonic: when the claiming call was first sent
        self.expires = expires  # monotonic: start of the last confirming call + keepalive
        self.lost = False  # the gate said the member is no longer this claim's
        self.running = False  # the member's code is running

    def remaining(self) -> float:
        return self.expires - time.monotonic()


def stoppable() -> bool:
    """Whether a member running in this process can be stopped (a prefork pool process)."""
    return shared.index() is not None


class Keeper:
    """Renews the leases this process holds, every keepalive/3, with their claimants."""

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        self.keepalive = float(runtime.config.keepalive)
        self._leases: dict[int, Lease] = {}
        self._lock = native.allocate_lock()  # shared by greenlets and the native thread
        self._thread: Optional[native.NativeThread] = None
        self._pid = os.getpid()

    def lease(self, thread_id: str, task_id: str, token: str, claimant: str, sent: float) -> Lease:
        """A lease confirmed by a call sent at ``sent`` (monotonic), held from now on."""
        lease = Lease(thread_id, task_id, token, claimant, sent, sent + self.keepalive)
        with self._lock:
            self._leases[id(lease)] = lease
        self._start()
        return lease

    def drop(self, lease: Lease) -> None:
        with self._lock:
            self._leases.pop(id(lease), None)

    @contextmanager
    def running(self, lease: Lease) -> Iterator[bool]:
        """Run the member's code under ``lease``: yields whether it may run (its lease holds, for
        longer than the margin, confirmed with the gate if need be).  While it runs, the lease's
        end is published for the watchdog."""
        if lease.lost or lease.remaining() <= margin(self.keepalive):
            self.renew(lease)
        if lease.lost or lease.remaining() <= margin(self.keepalive):
            yield False
            return
        lease.running = True
        shared.publish_lease_end(lease.expires)
        try:
            yield True
        finally:
            lease.running = False
            shared.publish_lease_end(0.0)

    def renew(self, lease: Lease, gate: Optional[Gate] = None) -> None:
        """One renewal of ``lease`` (through ``gate``, by default the runtime's): on success its
        local end moves on; when the gate says the member is no longer this claim's, it is lost
        (and stopped, if running)."""
        sent = time.monotonic()
        try:
            status = (gate or self.runtime.gate).renew(
                lease.thread_id, lease.task_id, lease.token, lease.claimant
            )
        except Exception as exc:
            logger.warning(
                "celery-threads: could not renew the lease of %s of thread %s (%s); "
                "it ends in %.1fs unless a renewal gets through",
                lease.task_id,
                lease.thread_id,
                exc,
                max(lease.remaining(), 0.0),
            )
            return
        if status == Renewal.RENEWED:
            lease.expires = max(lease.expires, sent + self.keepalive)
            if lease.running:
                shared.publish_lease_end(lease.expires)
            return
        lease.lost = True
        if lease.running:
            self._stop(
                lease,
                "the gate no longer counts it as running here (deleted, its lease lapsed, or the "
                "gate lost its data: a restart without an append-only file)",
            )

    def _stop(self, lease: Lease, why: str) -> None:
        if stoppable():
            logger.error(
                "celery-threads: stopping %s of thread %s: %s; its pool process is killed",
                lease.task_id,
                lease.thread_id,
                why,
            )
            shared.publish_lease_end(0.0)
            os.kill(os.getpid(), signal.SIGKILL)
        logger.error(
            "celery-threads: %s of thread %s keeps running although %s: this pool "
            "cannot stop it, and the thread's next member may run beside it (use the "
            "prefork pool)",
            lease.task_id,
            lease.thread_id,
            why,
        )

    def _start(self) -> None:
        if self._thread is not None and self._pid == os.getpid() and self._thread.is_alive():
            return
        self._pid = os.getpid()
        self._thread = native.NativeThread(self._loop, "celery-threads-lease")
        self._thread.start()

    def _loop(self) -> None:
        period = self.keepalive / 3.0
        warned: set[int] = set()
        gate = self.runtime.own_gate() if native.green() else self.runtime.gate
        while True:
            native.sleep(min(period, 1.0))
            with self._lock:
                leases = list(self._leases.values())
            for lease in leases:
                if lease.lost:
                    continue
                if lease.remaining() <= self.keepalive - period:
                    self.renew(lease, gate)
                if lease.running and not stoppable() and id(lease) not in warned and lease.remaining() <= 0:
                    warned.add(id(lease))
                    self._stop(lease, "its lease ran out unconfirmed (the gate is unreachable)")


_keepers: dict[int, Keeper] = {}
_keepers_lock = threading.Lock()


def keeper(runtime: Runtime) -> Keeper:
    """The process's keeper for ``runtime`` (one per runtime, made again in a forked child)."""
    key = id(runtime)
    found = _keepers.get(key)
    if found is None or found._pid != os.getpid():
        with _keepers_lock:
            found = _keepers.get(key)
            if found is None or found._pid != os.getpid():
                found = _keepers[key] = Keeper(runtime)
    return found


class Watchdog:
    """In a prefork worker's main process: SIGKILLs a pool process whose running member's lease
    ends within the margin (the pool process publishes it; see the module's docstring)."""

    def __init__(self, keepalive: float) -> None:
        self.margin = margin(keepalive)
        self._stop = threading.Event()

    def start(self) -> None:
        if shared.lease_ends() is None:
            return
        threading.Thread(target=self._loop, name="celery-threads-watchdog", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()

    def _loop(self) -> None:
        while not self._stop.wait(WATCH_INTERVAL):
            ends = shared.lease_ends()
            if ends is None:
                continue
            now = time.monotonic()
            for i in range(len(ends)):
                expires = ends.expiries[i]
                if expires <= 0 or now < expires - self.margin:
                    continue
                pid = ends.pids[i]
                if ends.expiries[i] != expires or pid <= 0:
                    continue  # renewed, or ended, meanwhile
                ends.expiries[i] = 0.0
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    continue
                # Logged once the signal is sent (tools read the kill's time off this line).
                logger.error(
                    "celery-threads: killed pool process %s: the lease of the member "
                    "it ran ended %.2fs later and no renewal got through (the gate "
                    "unreachable, or the process's lease keeper starved: a body holding the "
                    "GIL, as C code that does not release it, longer than threads_keepalive); "
                    "the member must not run past it",
                    pid,
                    expires - now,
                )
