"""Per-app runtime: the gate's client, the settings, and the few actions every side shares."""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
import traceback as tb
from typing import Any, Callable, Optional

import redis
import redis.backoff
import redis.retry
from celery import Celery
from celery.utils.saferepr import saferepr

from . import seams
from .config import ThreadsConfig, forget_config, read_config
from .errors import ReleaseExpired, TransportMismatch, UndecodableEnvelope
from .gate import (
    DELETED,
    ENDED,
    NO_HOLDER,
    STOPPING,
    DeadRecord,
    Gate,
    Outcome,
    Record,
    Release,
    ReleasePush,
    deadline,
    make_client,
    transport,
)
from .gate.access import check_access
from .gate.cluster import check_shards, is_cluster
from .gate.deadline import unbounded_class
from .gate.eviction import check_eviction
from .gate.transitions import CALL_BOUND, CALL_BOUND_NAME
from .keys import Keys
from .logs import get_logger
from .protocol import THREAD_HEADER
from .publish import ReleasePublisher, member_request, publish_release, task_name
from .signals import member_dead

logger = get_logger(__name__)

_ATTR = "_celery_threads_runtime"
#: How long after its TTL ends a release published with one is given up on (see _deadline_at_ttl):
#: the time a worker that received it just in time needs to start it.
EXPIRY_GRACE_MS = 1000
#: How long ``Threads.delete`` waits for a deleted member that its worker stops (a prefork pool
#: process, terminated) to leave its thread, so that it returns after the next member's release.
STOP_WAIT = 5.0
_lock = threading.Lock()


class Runtime:
    """What a process needs to drive the gate for one app."""

    def __init__(self, app: Celery, parent: Optional[Runtime] = None) -> None:
        """``parent``: the runtime of the process this one was forked from (a pool process's)."""
        self.app = app
        self.config: ThreadsConfig = read_config(app)
        self.client = make_client(self.config.redis_url, self.config.redis_options)
        self.keys = Keys(self.config.key_prefix, self.config.shards)
        self._checked = False
        # On a Redis Cluster, releases go through kombu (the broker is not the cluster).
        self.gate = self._gate(
            self.client,
            direct_release(app, self.client)
            if (self.config.direct_release and not is_cluster(self.client) and seams.active("direct-release"))
            else None,
        )
        self._check_at_start(said=parent is not None and not parent.checked)
        self.publisher = ReleasePublisher(app)
        self.pid = os.getpid()
        #: ``(type, **fields)`` -> sends a task event where this process is a worker's main
        #: process that sends them (set by its bootstep), else ``None``
        self.send_task_event: Optional[Callable[..., None]] = None

    def _gate(self, client: redis.Redis, direct: Optional[ReleasePush]) -> Gate:
        gate = Gate(
            client,
            self.keys,
            release_timeout_ms=self.config.release_timeout_ms,
            keepalive_ms=self.config.keepalive_ms,
            direct=direct,
            wait_replicas=self.config.wait_replicas,
        )
        if not self._checked:  # on this gate's own client (a gevent worker's native thread)
            gate.before_call = functools.partial(self.check_gate, client)
        return gate

    def _check_at_start(self, said: bool) -> None:
        """The gate's checks when the process first uses it, within ``threads_publish_timeout``
        (or the caller's own bound): a process whose gate does not answer starts without waiting
        out the client's retries, and its gate checks them before its first transition.
        ``said``: the parent process has said that its gate did not answer (a debug line here)."""
        try:
            with deadline.at_most(self.config.publish_timeout):
                self.check_gate()
        except TransportMismatch:
            raise  # a setting to fix, as a right the gate's user lacks
        except redis.RedisError as exc:
            refused = transport.refused(self.config.shown_url, exc)  # credentials, or no such database
            if refused is not None:
                raise refused from exc
            if not isinstance(exc, (redis.ConnectionError, redis.TimeoutError)):
                raise
            self._unanswered_at_start(exc, said)
        except OSError as exc:
            self._unanswered_at_start(exc, said)

    def _unanswered_at_start(self, exc: BaseException, said: bool) -> None:
        logger.log(
            logging.DEBUG if said else logging.WARNING,
            "celery-threads: the gate's Redis at %s (threads_redis_url) did not answer its "
            "start-up checks (%s); its rights and threads_shards=%s are checked before this "
            "process's first transition, once it answers",
            self.config.shown_url,
            exc,
            self.config.shards,
        )

    @property
    def checked(self) -> bool:
        """Whether the gate's checks have passed in this process (:meth:`check_gate`)."""
        return self._checked

    def check_gate(self, client: Any = None) -> None:
        """Check the gate once: the rights of its Redis user and its eviction policy (where it
        answers), and ``threads_shards`` against the count it records.  Until this has passed, every
        transition of this process's gates runs it first (``Gate.before_call``), and so does the
        dispatcher's tick: nothing is stored under a shard count the gate does not hold.  Raises
        :class:`ConfigurationError`, or the client's error when the gate does not answer.
        ``client``: the caller's gate client (default: the runtime's)."""
        if self._checked:
            return
        with deadline.at_most(CALL_BOUND, bound=CALL_BOUND_NAME):  # a dispatcher tick's, unbounded
            self._check_gate(client)

    def _check_gate(self, client: Any) -> None:
        # No lock: two threads that check at once make the same idempotent reads (and at most
        # one SET NX of the count), where a lock held through the client's retries would stall
        # a gevent worker's hub.
        client = client or self.client
        if check_access(client, self.keys, self.config.redis_url):
            check_eviction(client, self.config.redis_url)
        else:
            client.ping()  # no answer: the client's own error
        check_shards(client, self.keys)
        self._checked = True
        self.gate.before_call = None

    def own_gate(self) -> Gate:
        """The gate on a client of its own, for a native thread of a gevent worker
        (:mod:`celery_threads.worker.native`): a connection gevent made on one thread's hub cannot be
        used from another thread."""
        return self._gate(make_client(self.config.redis_url, self.config.redis_options), self.gate.direct)

    def publish(
        self,
        release: Optional[Release],
        producer: Any = None,
        republish: bool = False,
        parts: Optional[tuple[dict[str, Any], bytes]] = None,
    ) -> None:
        """Publish a release.  A failure is logged, not raised: the member is safely RELEASED in
        the gate, and the dispatcher republishes it after ``threads_release_timeout``.
        ``republish`` marks a release that was published before (the receiving worker then checks
        that it is not a duplicate).  ``parts``: the message as captured, when the release is of
        the member the caller has just enqueued (see ``publish.release_message``).

        A member whose ``expires`` has passed is not published: it ends (:meth:`end_expired`)
        and the member promoted in its place is published instead."""
        while release is not None and not release.published:
            try:
                ttl = self.publisher.publish(release, producer, republish=republish, parts=parts)
            except ReleaseExpired:
                release, republish, parts = self.end_expired(release), False, None
                continue
            except UndecodableEnvelope as exc:
                # Republishing could never help: the member dies and its thread moves on.
                self.kill(
                    release.thread_id,
                    release.task_id,
                    release.token,
                    exc=exc,
                    retries=0,
                    reason=f"UndecodableEnvelope: {exc}",
                    holder=NO_HOLDER,
                    report=True,
                )
            except Exception:
                logger.exception(
                    "celery-threads: could not publish member %s of thread %s; the dispatcher "
                    "republishes it after threads_release_timeout (%ss)",
                    release.task_id,
                    release.thread_id,
                    self.config.release_timeout,
                )
            else:
                if ttl is not None:
                    self._deadline_at_ttl(release, ttl)
            return

    def end_expired(self, release: Release) -> Optional[Release]:
        """A released member whose ``expires`` has passed leaves its thread, as Celery's worker
        ends an expired task: REVOKED (reason ``expired``) in the result backend, not retried,
        not a dead letter.  ``delete`` rather than ``kill``: it detaches and promotes the next
        member like a death, but records nothing in the dead-letter store and tells no
        ``member_dead`` listener, since the task did not fail; fenced by its token, and only
        while it is still RELEASED (a worker that claimed it in time runs it).  Returns the
        release of the member promoted in its place, if any."""
        # Its stored record, read before it leaves: its message for its chord (a release may carry
        # none), its retries for its result (its message's headers may say fewer).
        record = self._stored_record(release)
        envelope = release.envelope or (record.envelope if record else None)
        retries = record.retries if record else None
        try:
            outcome = self.gate.delete(
                release.task_id, token=release.token, only_released=True, thread_id=release.thread_id
            )
        except Exception:
            logger.exception(
                "celery-threads: could not end expired member %s of thread %s; "
                "the dispatcher tries again after threads_release_timeout (%ss)",
                release.task_id,
                release.thread_id,
                self.config.release_timeout,
            )
            return None
        if outcome.done and outcome.info == "RELEASED":
            logger.info(
                "celery-threads: member %s of thread %s: its expires passed, by this host's clock, "
                "before its release was published (or published again); revoked",
                release.task_id,
                release.thread_id,
            )
            self.revoke_unstarted(
                release.thread_id, release.task_id, "expired", envelope=envelope, retries=retries
            )
        return outcome.release

    def _deadline_at_ttl(self, release: Release, ttl: float) -> None:
        """A release published with a TTL that ends before its release deadline: a broker that
        drops it then (RabbitMQ) leaves no delivery to claim it, so its deadline is brought
        forward to the TTL's end plus ``EXPIRY_GRACE_MS``.  The dispatcher then ends it
        (:meth:`end_expired`, from its republish) instead of waiting the release timeout.  A
        worker holding it unstarted renews the deadline as usual."""
        ms = int(ttl * 1000) + EXPIRY_GRACE_MS
        if ms >= self.config.release_timeout_ms:
            return
        try:
            self.gate.renew(release.thread_id, release.task_id, release.token, for_ms=ms)
        except Exception:
            logger.debug(
                "celery-threads: could not bring the release deadline of %s forward",
                release.task_id,
                exc_info=True,
            )

    def publish_outcome(self, outcome: Outcome, producer: Any = None) -> Outcome:
        """Publish the release a gate transition's ``outcome`` carries (if any); returns the
        outcome, so that a transition and its publish read as one call."""
        self.publish(outcome.release, producer)
        return outcome

    def delete_member(self, task_id: str, wait: float = STOP_WAIT) -> Optional[str]:
        """Detach a member whatever its state and promote the next; returns its previous state
        (``None`` if it was not a member), or ``STOPPING``.

        A member running in a prefork pool process (its claim says it can be stopped) is only
        marked deleted in the gate (``STOPPING``) and revoked with terminate: its worker's main
        process signals the process and, once it has exited, ends the member, which releases the
        next one.  This call waits up to ``wait`` seconds for that, so that it returns after the
        promotion; a member still running then leaves when its worker stops it, its own body
        returns, or its lease lapses (logged).  A member running where it cannot be stopped (the
        threads, solo or gevent pool) is detached at once and the next one promoted, while its
        body runs on.

        A running member is revoked with terminate, and its worker announces it.  For a waiting or
        released one, the result backend is marked REVOKED here, and one worker (elected by a note
        in the gate) sends the ``task-revoked`` event, so Flower shows it without a phantom worker.
        """
        record = self.gate.reads.record(task_id)  # its thread, and its message for its chord
        if record is None:
            return None
        thread_id = record.thread_id
        outcome = self.publish_outcome(self.gate.delete(task_id, stop=True, thread_id=thread_id))
        if not outcome.done:
            return None
        if outcome.info == STOPPING:
            self.app.control.revoke(task_id, terminate=True)
        elif outcome.info == "RUNNING":
            # Detached at once: its pool (threads, solo, gevent) cannot stop it (a terminate
            # would only fail in its worker); its body runs on, and ends as revoked there.
            self.mark_revoked(task_id, envelope=record.envelope, retries=record.retries)
            self.app.control.revoke(task_id)
        else:
            # ENDED: the call was replayed after its reply was lost, and the member may have
            # been running: revoke with terminate (a no-op where it does not run).
            self.revoke_unstarted(
                thread_id,
                task_id,
                terminate=outcome.info == ENDED,
                envelope=record.envelope,
                retries=record.retries,
            )
        if outcome.info == STOPPING:
            self._wait_stopped(thread_id, task_id, wait)
        return outcome.info

    def revoke_unstarted(
        self,
        thread_id: str,
        task_id: str,
        reason: str = "deleted from its thread",
        terminate: bool = False,
        envelope: Optional[bytes] = None,
        retries: Optional[int] = None,
    ) -> None:
        """A member that left its thread before it ran: ``REVOKED`` in the result backend (and
        in its chord: see :meth:`mark_revoked`), and one worker (elected by a note in the gate)
        sends the ``task-revoked`` event, so Flower shows it without a phantom worker."""
        self.mark_revoked(task_id, reason, envelope, retries)
        self.gate.note_deleted(thread_id, task_id, expired=reason == "expired")
        self.app.control.revoke(task_id, terminate=terminate)

    def revoke_superseded(self, thread_id: str, task_ids: list[str], envelope: bytes = b"") -> None:
        """An enqueue superseded ``task_ids[0]`` (``coalesce``, ``debounce``): revoked as a
        deleted waiting member is, and counted revoked in its chord when it is a chord's part
        (``envelope``: its stored message, which the enqueue returns).  Any other is one that
        member had superseded, told again in case that call's reply was lost: marked
        ``REVOKED`` again (the same state)."""
        self.revoke_unstarted(thread_id, task_ids[0], "superseded", envelope=envelope or None)
        for task_id in task_ids[1:]:
            self.mark_revoked(task_id, "superseded")

    def _wait_stopped(self, thread_id: str, task_id: str, wait: float) -> None:
        """Wait, at most ``wait`` seconds, until a member marked deleted has left its thread."""
        deadline = time.monotonic() + wait
        pause = 0.01
        while self.gate.reads.holds(thread_id, task_id):
            if time.monotonic() >= deadline:
                logger.info(
                    "celery-threads: deleted member %s of thread %s still runs %ss "
                    "after its revoke; the next member starts once its worker has "
                    "stopped it (or its body returns, or its lease lapses)",
                    task_id,
                    thread_id,
                    wait,
                )
                return
            time.sleep(pause)
            pause = min(pause * 2, 0.1)

    def _stored_record(self, release: Release) -> Optional[Record]:
        """The gate's record of a released member, read before it leaves; ``None`` if it cannot
        be read."""
        try:
            return self.gate.reads.record(release.task_id, release.thread_id)
        except redis.RedisError:
            return None

    def _stores_errors(self, request: Optional[dict[str, Any]]) -> bool:
        """Whether an ending of the request's task is stored, as Celery's worker decides it
        (``Request.store_errors``): not for a task that ignores its results, unless it stores
        errors even so.  Its chord and errbacks are told either way.  Unknown task: stored."""
        task = self.app.tasks.get((request or {}).get("task") or "")
        return task is None or not task.ignore_result or bool(task.store_errors_even_if_ignored)

    def mark_revoked(
        self,
        task_id: str,
        reason: str = "deleted from its thread",
        envelope: Optional[bytes] = None,
        retries: Optional[int] = None,
        count_in_chord: bool = True,
        request: Optional[dict[str, Any]] = None,
    ) -> None:
        """``REVOKED`` in the result backend (where its task stores it).  ``envelope``: the
        member's stored message, read before it left the gate, is the request Celery ends a
        revoked task with: an extended result (``result_extended``) names its task, arguments
        and queue, and when a chord counts the member (its request has the chord and its group)
        the chord counts it revoked, as a worker's revoke of a chord's part does (the chord ends
        with a ChordError, and its body never runs with a part missing).  ``retries``: the
        member's record's, which its next run's request would carry (a lost attempt re-enters
        with its stored message unchanged, whose headers still say the retries before it).
        ``count_in_chord``: false for a member marked again, which its chord counted already.
        ``request``: the request to end it with when there is no ``envelope`` (a worker's)."""
        if envelope:
            request = member_request(self.app, task_id, envelope)
        if request is not None and retries is not None:
            request["retries"] = retries
        if request is not None and not (count_in_chord and request.get("group") and request.get("chord")):
            request["chord"] = None  # Celery counts a part of any request with a chord
        try:
            from celery.app.task import Context

            self.app.backend.mark_as_revoked(
                task_id,
                reason,
                request=Context(request) if request is not None else None,
                store_result=self._stores_errors(request),
            )
        except Exception:
            logger.debug("celery-threads: no result backend to mark %s revoked", task_id, exc_info=True)

    def mark_failed(
        self,
        task_id: str,
        exc: BaseException,
        envelope: Optional[bytes] = None,
        retries: int = 0,
    ) -> None:
        """``FAILURE`` in the result backend for a member that died where no worker's request
        ends it (its lease lapsed, its pool process was lost while it ran by handoff), as Celery
        ends a failed task: with its stored message (``envelope``) as the request, its
        ``retries`` (the attempts before the last) in it, so that its errbacks are called, its
        chord fails, its chain fails with it and the result names it; the ``task_failure``
        signal; and ``task-failed`` for Flower where this is a worker's main process that sends
        task events."""
        from celery import signals
        from celery.app.task import Context

        request = None if not envelope else member_request(self.app, task_id, envelope)
        if request is not None:
            request["retries"] = retries
        try:
            self.app.backend.mark_as_failure(
                task_id,
                exc,
                request=Context(request) if request is not None else None,
                store_result=self._stores_errors(request),
            )
        except Exception:  # no result backend, or it is down: the dead-letter store has it
            logger.debug(
                "celery-threads: could not mark %s failed in the result backend", task_id, exc_info=True
            )
        called = request or {}
        signals.task_failure.send(
            sender=self.app.tasks.get(called.get("task"), called.get("task")),
            task_id=task_id,
            exception=exc,
            args=called.get("args", ()),
            kwargs=called.get("kwargs", {}),
            traceback=None,
            einfo=None,
        )
        if self.send_task_event is not None:
            self.send_task_event("task-failed", uuid=task_id, exception=saferepr(exc), traceback="")

    def kill(
        self,
        thread_id: str,
        task_id: str,
        token: str,
        *,
        exc: BaseException,
        retries: int,
        keep: bool = True,
        einfo: Any = None,
        reason: Optional[str] = None,
        caller: Optional[str] = None,
        fenced: bool = False,
        holder: Optional[str] = None,
        report: bool = False,
    ) -> Outcome:
        """The member died: record it (unless ``keep`` is false), tell listeners, promote the next.
        ``fenced``, ``holder``: whose run it ends (see :meth:`Gate.kill`).  ``report``: no Celery
        request ends it (its message cannot run anywhere), so it is ``FAILURE`` in the result
        backend from here, as any member that died."""
        exception = reason or f"{type(exc).__name__}: {exc}"
        trace = getattr(einfo, "traceback", None) or "".join(
            tb.format_exception(type(exc), exc, exc.__traceback__)
        )
        meta = {"retries": retries, "exception": exception, "traceback": trace}
        outcome = self.publish_outcome(
            self.gate.kill(
                thread_id, task_id, token, meta, keep=keep, caller=caller, fenced=fenced, holder=holder
            )
        )
        if outcome.done and outcome.info != DELETED:  # DELETED: deleted while it ran, not dead
            record = self.announce_death(thread_id, task_id, exception, retries)
            if report:
                self.mark_failed(task_id, exc, record.envelope if record is not None else None, retries)
        return outcome

    def announce_death(
        self, thread_id: str, task_id: str, exception: str, retries: int, record: Optional[DeadRecord] = None
    ) -> Optional[DeadRecord]:
        """Log a death, send it to the dead-letter queue and tell ``member_dead``; the member's
        dead record (``None`` when it is not kept)."""
        record = record or self.gate.reads.dead_record(task_id)
        name = task_name(record.envelope) if record else ""
        logger.warning(
            "celery-threads: member %s (%s) of thread %s died: %s", task_id, name, thread_id, exception
        )
        if record is not None and name and self.config.dead_letter_queue:
            self._send_dead_letter(thread_id, task_id, exception, record.envelope)
        member_dead.send(
            sender=self.app.tasks.get(name, name),
            task_id=task_id,
            thread_id=thread_id,
            name=name,
            exception=exception,
            retries=retries,
        )
        return record

    def end_death(
        self,
        thread_id: str,
        task_id: str,
        exc: BaseException,
        exception: str,
        retries: int = 0,
        record: Optional[DeadRecord] = None,
    ) -> Optional[DeadRecord]:
        """A member the gate killed where no worker's request ends it (a lapsed lease, a pool
        process lost, a cancelled attempt): its death announced (:meth:`announce_death`, with
        ``exception``, its text), and ``exc`` stored as its failure (:meth:`mark_failed`), both
        with its dead record's message and retries (``retries`` when it is not kept; ``record``:
        read already)."""
        record = record or self.gate.reads.dead_record(task_id)
        retries = record.retries if record else retries
        self.announce_death(thread_id, task_id, exception, retries, record)
        self.mark_failed(task_id, exc, record.envelope if record else None, retries)
        return record

    def _send_dead_letter(self, thread_id: str, task_id: str, exception: str, envelope: bytes) -> None:
        try:
            publish_release(
                self.app,
                Release(thread_id, task_id, "", 0, envelope),
                extra_headers={
                    THREAD_HEADER: thread_id,
                    "thread_dead_letter": True,
                    "thread_exception": exception,
                },
                queue=self.config.dead_letter_queue,
            )
        except Exception:
            logger.exception(
                "celery-threads: could not route dead member %s to queue %s; it "
                "stays in the dead-letter store",
                task_id,
                self.config.dead_letter_queue,
            )


def unreachable(config: ThreadsConfig) -> Optional[BaseException]:
    """Why the gate's Redis does not answer a PING at once (``None`` when it does): one attempt,
    a few seconds at most, where the gate's own client retries for ~15 s (right for a worker's
    transitions, not for telling a person at start)."""
    quick = {
        "socket_connect_timeout": 3,
        "socket_timeout": 5,
        "retry": redis.retry.Retry(redis.backoff.NoBackoff(), 0),
    }
    try:
        probe = make_client(config.redis_url, {**config.redis_options, **quick})
    except ValueError as exc:
        return exc
    try:
        probe.ping()
    except redis.RedisError as exc:
        return exc
    finally:
        probe.close()
    return None


def direct_release(app: Celery, client: Any) -> Optional[ReleasePush]:
    """Where the gate's scripts may publish releases themselves: when the broker is kombu's Redis
    transport on the gate's own server (same host and port, compared as written, and the same
    credentials), else ``None`` and releases are published by Python through kombu."""
    try:
        conn = app.connection_for_write()
    except Exception:  # an unusable broker_url: Celery says why where it is used
        return None
    conn.release()  # only its parsed URL is read: it never connects
    options = client.connection_pool.connection_kwargs
    if (
        conn.transport_cls not in ("redis", "rediss")
        or unbounded_class(client.connection_pool.connection_class)
        not in (redis.Connection, redis.SSLConnection)
        or (conn.hostname or "localhost").lower() != str(options.get("host", "")).lower()
        or int(conn.port or 6379) != int(options.get("port") or 6379)
        or (conn.password or None) != (options.get("password") or None)
        or (conn.userid or None) != (options.get("username") or None)
    ):
        return None
    vhost = conn.virtual_host
    if isinstance(vhost, int):
        broker_db = vhost
    else:
        vhost = str(vhost or "").strip("/")
        broker_db = int(vhost) if vhost else 0
    prefix = (app.conf.broker_transport_options or {}).get("global_keyprefix") or ""
    return ReleasePush(gate_db=int(options.get("db") or 0), broker_db=broker_db, key_prefix=str(prefix))


def get_runtime(app: Celery) -> Runtime:
    """The app's runtime in this process (a forked child builds its own)."""
    runtime: Optional[Runtime] = getattr(app, _ATTR, None)
    if runtime is not None and runtime.pid == os.getpid():
        return runtime
    with _lock:
        runtime = getattr(app, _ATTR, None)
        if runtime is None or runtime.pid != os.getpid():
            runtime = Runtime(app, parent=runtime)
            setattr(app, _ATTR, runtime)
        return runtime


def reset(app: Celery) -> None:
    """Forget what was built from ``app.conf``: the threads settings and gate client, and Celery's
    pooled broker connections, queues and routes, and result backend.  For tools and tests that
    point one app at another Redis or broker after it has been used; the next use reads
    ``app.conf`` again."""
    forget_config(app)
    runtime = getattr(app, _ATTR, None)
    if runtime is not None:
        if runtime.pid == os.getpid():
            runtime.publisher.close()
        delattr(app, _ATTR)
    seams.forget_app_connections(app)
    for cached in ("queues", "default_queue", "router"):  # built from task_queues, task_routes
        app.amqp.__dict__.pop(cached, None)
    app.__dict__.pop("backend", None)
    local = getattr(app, "_local", None)
    if local is not None:
        local.__dict__.pop("backend", None)
