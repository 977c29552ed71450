"""Every error celery-threads raises derives from :class:`ThreadsError` (and keeps the standard
base a caller may already catch: ``ValueError``, ``KeyError``, ``redis.TimeoutError``)."""

from __future__ import annotations

from typing import Any

import redis


class ThreadsError(Exception):
    """Base class of every celery-threads error."""


class InvalidThreadId(ThreadsError, ValueError):
    """The thread id is missing, of the wrong type (a ``bool`` included), empty, not encodable
    as UTF-8 (a lone surrogate), or longer than 1,024 bytes (an ``int``: its decimal string).

    Pass ``thread_id=`` to ``apply_async`` (a non-empty ``str``, an ``int`` or a ``uuid.UUID``), or
    declare the task with ``thread_key=`` naming the argument that holds it.  Nothing was stored
    or sent.
    """


class InvalidArgument(ThreadsError, ValueError):
    """An argument of a celery-threads call is of the wrong type or out of range: a task id that
    is not a ``str`` (or a ``uuid.UUID``), one longer than the broker carries (AMQP: 255 bytes), a
    pause's reason that is not a string, a negative limit.  The message names it; nothing was
    stored, sent or changed."""


class ConfigurationError(ThreadsError):
    """A ``threads_*`` setting, or an option of a threaded task (``max_retries``,
    ``default_retry_delay``), is missing or wrong; the message names what to fix."""


class TransportMismatch(ConfigurationError, redis.ConnectionError):
    """The gate's URL and its server disagree about TLS: ``rediss://`` to a port that speaks plain
    Redis, or ``redis://`` to a port that expects TLS.  Found when a connection fails and a probe
    of the same port answers the other way; raised at once, never retried as an outage (no retry
    makes it right).  A ``redis.ConnectionError`` too, so every caller that handles a gate it
    cannot reach handles it, with this message."""


class MissingRights(ConfigurationError):
    """The gate's Redis user lacks rights (ACL) the gate needs: which ones, and the grant."""


class ReadOnlyGate(ConfigurationError):
    """The gate's Redis is a read-only replica: point the URL at its master."""


class GateUnavailable(ThreadsError):
    """The gate's Redis could not be reached; the message says which URL was tried.

    A publish that raises this sent nothing to the broker.  Unless the connection broke after
    Redis had received the call, it stored nothing either; calling again with the same task id is
    safe in every case, since a member is never stored twice, nor stored again within 30 s of
    its end.
    """


class NotReplicated(ThreadsError, redis.TimeoutError):
    """Fewer replicas than ``threads_wait_replicas`` confirmed a gate transition in time: it counts
    as not done, as when its reply is lost (a ``redis.TimeoutError``, so every caller that rides
    out a silent gate rides this out too).  The master may hold it and a failover may lose it;
    sending the same call again is safe, since each transition recognizes its own replay.
    ``reply``: what the master answered (not yet durable)."""

    def __init__(self, message: str, reply: Any = None) -> None:
        super().__init__(message)
        self.reply = reply


class ThreadFull(ThreadsError):
    """The call's thread already holds ``max_waiting`` waiting members (the task option or the
    ``apply_async`` option): the call was refused, and nothing was stored in the gate or sent to
    the broker.  Call again later, or raise ``max_waiting``.  ``thread_id`` names the thread,
    ``task_id`` the call's task id."""

    def __init__(self, message: str, thread_id: str = "", task_id: str = "") -> None:
        super().__init__(message)
        self.thread_id = thread_id
        self.task_id = task_id


class SeamRefused(ConfigurationError):
    """A seam without a safe fallback does not hold on the installed versions
    (:mod:`celery_threads.seams`)."""


class UnknownTask(ThreadsError, KeyError):
    """No thread member (or dead task) has this task id."""


class LeaseExpired(ThreadsError):
    """A running member's lease lapsed: its worker stopped renewing it (SIGKILL, lost machine).
    The dispatcher that ends such a member stores it as the member's failure, so its
    ``AsyncResult`` shows it (``celery_threads.dispatcher.LeaseExpired`` names it too, as results
    stored by earlier releases do)."""


class UndecodableEnvelope(ThreadsError, ValueError):
    """A stored envelope is not ``header_json \\n body``: it can never be published."""


class ReleaseExpired(ThreadsError):
    """A released member's ``expires`` has passed: published, it could never run (a worker
    revokes it on receipt, RabbitMQ drops it for its TTL), so it is not published."""


class DeadlinePassed(ThreadsError, redis.TimeoutError):
    """The caller's bound ran out before a wait could start (retried as a timeout would be, and
    reported as the attempt before it failed: see ``BoundedRetry``)."""


def error_text(exc: BaseException) -> str:
    """An error's text inside a sentence: without its own closing period (its class's name when
    it has none)."""
    return str(exc).rstrip(".") or type(exc).__name__
