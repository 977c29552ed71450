"""The dispatcher: releases due heads, reclaims lapsed leases, republishes lost releases.

A tick reads only the earliest entries of two index ZSETs, so it costs O(due work), never a scan of
all threads.  Each piece of work is one fenced script, so any number of dispatchers (beat's entry
on any worker, every worker's own loop) can run at once.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any, Optional

import redis

from .errors import LeaseExpired  # imported here too: results stored before it moved name this module
from .gate import Lapse, Outcome, transport
from .keys import ShardKeys
from .logs import get_logger
from .publish import route_of
from .runtime import Runtime

logger = get_logger(__name__)


@dataclass
class TickReport:
    released: int = 0
    republished: int = 0
    retried: int = 0
    died: int = 0
    dead_dropped: int = 0  # dead letters dropped by retention
    next_ms: Optional[int] = None  # earliest known future work (server clock, ms)
    now_ms: int = 0
    more: bool = False  # a batch was full: run again at once


class Dispatcher:
    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime

    def tick(self) -> TickReport:
        """One pass over every shard, at most ``threads_dispatch_batch`` items of each kind."""
        self.runtime.check_gate()  # its scan reads the shards of the count it checks
        report = TickReport()
        for shard in self.runtime.keys.all_shards():
            self._tick_shard(shard, report)
        return report

    def run_until_idle(self, max_passes: int = 20) -> TickReport:
        report = self.tick()
        passes = 1
        while report.more and passes < max_passes:
            report = self.tick()
            passes += 1
        return report

    def _tick_shard(self, shard: ShardKeys, report: TickReport) -> None:
        gate, batch = self.runtime.gate, self.runtime.config.dispatch_batch
        scan = gate.reads.scan_due(shard, batch)
        report.now_ms = scan.now_ms
        if scan.next_ms is not None:
            report.next_ms = min(scan.next_ms, report.next_ms or scan.next_ms)
        report.more = report.more or len(scan.due) >= batch or len(scan.lapsed) >= batch
        for outcome in gate.release_many(scan.due):
            if outcome.release is not None:
                report.released += 1
                self.runtime.publish(outcome.release)
        for thread_id, outcome in zip(scan.lapsed, gate.expire_many(scan.lapsed)):
            self._after_expire(thread_id, outcome, report)
        self._retain_dead(shard, report)

    def _retain_dead(self, shard: ShardKeys, report: TickReport) -> None:
        """Dead-letter retention (``threads_dead_letter_max``, ``threads_dead_letter_ttl``): the
        shard's oldest letters past its share of the bound, or older than the TTL, are dropped,
        at most ``threads_dispatch_batch`` per tick (one O(log n + dropped) script)."""
        config = self.runtime.config
        if config.dead_letter_max is None and config.dead_letter_ttl is None:
            return
        keep = (
            None if config.dead_letter_max is None else -(-config.dead_letter_max // config.shards)
        )  # ceil: a share per shard
        ttl_ms = None if config.dead_letter_ttl is None else int(config.dead_letter_ttl * 1000)
        dropped, more = self.runtime.gate.trim_dead(shard, keep, ttl_ms, config.dispatch_batch)
        if dropped:
            report.dead_dropped += dropped
            logger.info(
                "celery-threads: dropped %s dead letter(s) past threads_dead_letter_max "
                "or threads_dead_letter_ttl",
                dropped,
            )
        report.more = report.more or more

    def _after_expire(self, thread_id: str, outcome: Outcome, report: TickReport) -> None:
        if outcome.status == Lapse.REPUBLISH:
            report.republished += 1
            release = outcome.release
            logger.warning(
                "celery-threads: member %s of thread %s was released but no worker "
                "claimed it within its release deadline; republishing it (or ending "
                "it, if it has expired), with routing key %s: does a worker consume its queue?",
                release and release.task_id,
                thread_id,
                (release and release.envelope and route_of(release.envelope)) or "?",
            )
        elif outcome.status == Lapse.RETRIED:
            report.retried += 1
            logger.warning(
                "celery-threads: lease of member %s of thread %s lapsed (its worker lost, or cut off "
                "from the gate?); it will run again",
                outcome.info,
                thread_id,
            )
        elif outcome.status == Lapse.DELETED:
            # Deleted while it ran, and no worker was left to stop it and end it.
            logger.info(
                "celery-threads: lease of deleted member %s of thread %s lapsed; it has left its thread",
                outcome.info,
                thread_id,
            )
            self.runtime.mark_revoked(
                outcome.info, envelope=outcome.gone_envelope or None, retries=outcome.gone_retries
            )
        elif outcome.status == Lapse.DIED:
            report.died += 1
            record = self.runtime.gate.reads.dead_record(outcome.info)
            exception = record.meta.get("exception", "") if record else "LeaseExpired"
            # The dead letter's text names its class (lua/expire.lua): the result's, once.
            lapsed = LeaseExpired(exception.removeprefix("LeaseExpired: ") or "its lease lapsed")
            self.runtime.end_death(thread_id, outcome.info, lapsed, exception, record=record)
        self.runtime.publish(outcome.release, republish=outcome.status == Lapse.REPUBLISH)


class DispatchLoop:
    """Every worker's own dispatcher: sleeps until the next due head or deadline, woken early by
    the gate's pub/sub message when a sooner head appears; beat's entry remains the safety net."""

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        self.dispatcher = Dispatcher(runtime)
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._failing_since: Optional[float] = None  # monotonic time of the first failure
        self._reported = 0.0
        self._failures = 0

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="celery-threads-dispatch", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def _run(self) -> None:
        interval = self.runtime.config.dispatch_interval
        pubsub = None
        while not self._stop.is_set():
            attempt = time.monotonic()  # a failed tick's client retried for a while before it gave up
            try:
                if pubsub is None:
                    client: Any = self.runtime.client  # redis-py's pubsub() is typed in some
                    pubsub = client.pubsub(ignore_subscribe_messages=True)  # versions only
                    pubsub.subscribe(*[s.wake_channel for s in self.runtime.keys.all_shards()])
                started = time.monotonic()
                report = self.dispatcher.tick()
                self._answered()
                wait = 0.0 if report.more else interval
                if report.next_ms is not None and not report.more:
                    # next_ms is on the server's clock as of the tick's scan: take off the time
                    # the tick itself took, so the loop wakes when the head is due, not after.
                    until_next = (report.next_ms - report.now_ms) / 1000.0
                    wait = min(wait, max(0.0, until_next - (time.monotonic() - started)))
                self._sleep(pubsub, wait)
            except Exception as exc:
                self._failed(exc, interval, attempt)
                if pubsub is not None:
                    try:
                        pubsub.close()
                    except Exception:
                        pass
                pubsub = None
                self._stop.wait(interval)
        if pubsub is not None:
            pubsub.close()

    #: After the first failure in a row, how often one more is logged (the others are counted).
    REPORT_EVERY = 30.0

    def _failed(self, exc: BaseException, interval: float, attempt: float) -> None:
        """Say what failed, where, and what to check: at once for the first failure in a row,
        then at most every :attr:`REPORT_EVERY` seconds; and when the gate answers again.  The
        failures are counted from ``attempt``, when the first failed tick began (its client rode
        out the outage for up to its retry budget before that tick failed)."""
        now = time.monotonic()
        self._failures += 1
        if self._failing_since is None:
            self._failing_since, self._reported = attempt, now
            log = logger.error
        elif now - self._reported >= self.REPORT_EVERY:
            self._reported = now
            log = logger.warning
        else:
            logger.debug("celery-threads: dispatcher tick failure", exc_info=True)
            return
        if transport.missing_right(exc):  # a right revoked since the process checked them
            what = (
                "the gate's Redis at %s refused the dispatcher's tick for its user's rights: %s; "
                "%d failure(s) in %.0fs. Grant the user the rules docs/redis-tls-acl.md lists."
            )
        elif isinstance(exc, redis.ResponseError):  # it answered: out of memory, a script's error
            what = (
                "the gate's Redis at %s refused the dispatcher's tick: %s; %d failure(s) in %.0fs. "
                "Free memory or raise maxmemory if it is full; `celery threads stats` says whether "
                "it evicts keys, which breaks the gate's records."
            )
        else:
            what = (
                "cannot reach the gate's Redis at %s (threads_redis_url): %s; %d failure(s) in "
                "%.0fs. Check that the server runs and accepts connections from here, and the "
                "URL's host, port, password and TLS options (threads_redis_options)."
            )
        log(
            f"celery-threads: {what} Trying again every %ss",
            self.runtime.config.shown_url,
            f"{type(exc).__name__}: {exc}",
            self._failures,
            now - self._failing_since,
            interval,
        )
        logger.debug("celery-threads: dispatcher tick failure", exc_info=True)

    def _answered(self) -> None:
        if self._failing_since is not None:
            logger.warning(
                "celery-threads: the gate's Redis at %s answers again, after %d failed tick(s) in %.0fs",
                self.runtime.config.shown_url,
                self._failures,
                time.monotonic() - self._failing_since,
            )
        self._failing_since, self._failures = None, 0

    def _sleep(self, pubsub: Any, wait: float) -> None:
        """Sleep up to ``wait`` seconds; a wake message on the gate's channel cuts it short."""
        end = time.monotonic() + wait
        while not self._stop.is_set():
            remaining = end - time.monotonic()
            if remaining <= 0:
                return
            if pubsub.get_message(timeout=min(remaining, 0.5)) is not None:
                return
