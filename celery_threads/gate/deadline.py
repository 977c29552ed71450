"""One bound over every wait of a caller's gate call (``threads_publish_timeout``).

The gate's client rides out outages (:data:`~celery_threads.gate.client.RETRY_BUDGET` of retries,
each attempt waiting up to :data:`~celery_threads.gate.client.SOCKET_TIMEOUT`), which is what a
worker needs; a producer's ``apply_async`` must instead fail fast, as Celery does with a dead
broker.  Its waits are many and nested: the rights probe at first use, the shard check, the hot
path's own line and its library load, the client's retries around redis-py's own connection
retries, Sentinel's discovery, a TLS handshake with a server that speaks plain Redis, a server that
accepts and never answers.  So the bound is not a setting of each: :func:`within` opens a
:class:`Deadline` for the calling context, and every wait asks it how long it may last (the
connections of :func:`bounded_class`, :class:`~celery_threads.gate.client.BoundedRetry`'s
backoff and budget, the hot path's line, the cluster client's retries).  Outside one, nothing
changes.

A deadline also notes whether a script call was sent and its reply never read: the call may have
run, which the caller's error must say (each transition recognizes its own replay, so sending it
again is safe, lua/_common.lua ``replayed``).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from contextvars import ContextVar
from typing import Any, Callable, Optional

import redis

from ..errors import DeadlinePassed
from . import transport

#: The least a wait is given once its deadline is near: a socket with no time at all would not
#: even connect, and the error would say less than the attempt's own.
MIN_WAIT = 0.05

#: A call that carries a large message (a task's arguments of many MB) takes Redis time in
#: proportion: it parses it, hands it to the script and stores it (an enqueue with a 150 MB
#: message ran 4.9 s inside Redis on a 2-core VM), and a busy Redis reads it slowly.  Such a
#: call may wait that much longer, to send it and for its reply, and the caller's deadline grows
#: with it: one second per ``LARGE_CALL_RATE`` bytes sent beyond ``LARGE_CALL_FROM``.  Without it
#: the call timed out while Redis ran it, its member stored, and apply_async raised although the
#: task was going to run; or its send timed out.
LARGE_CALL_FROM = 1 << 20
LARGE_CALL_RATE = 4 << 20


class Deadline:
    """The time left to a caller's gate call.  ``stall``: the bound counts from the last reply
    instead (an admin call that reads a large gate goes on for as long as Redis answers)."""

    __slots__ = ("seconds", "stall", "at", "unanswered", "error", "bound")

    def __init__(self, seconds: float, stall: bool = False, bound: str = "threads_publish_timeout") -> None:
        self.seconds = seconds
        self.stall = stall
        self.bound = bound  # what sets it, for the error
        self.at = time.monotonic() + seconds
        #: a script call was sent and its reply was not read: it may have run
        self.unanswered = False
        #: the last wait that failed, named when the time runs out (the cause, not the clock)
        self.error: Optional[BaseException] = None

    def remaining(self) -> float:
        return self.at - time.monotonic()

    def answered(self) -> None:
        self.unanswered = False
        if self.stall:
            self.at = time.monotonic() + self.seconds


_current: ContextVar[Optional[Deadline]] = ContextVar("celery_threads_deadline", default=None)


@contextmanager
def within(
    seconds: float, *, stall: bool = False, bound: str = "threads_publish_timeout"
) -> Iterator[Deadline]:
    """Bound every gate wait of this context (thread, greenlet, task) to ``seconds`` in all;
    ``bound`` names what sets that time, in the error when it runs out."""
    deadline = Deadline(seconds, stall, bound)
    token = _current.set(deadline)
    try:
        yield deadline
    finally:
        _current.reset(token)


def at_most(seconds: float, *, bound: str = "threads_publish_timeout") -> AbstractContextManager[Any]:
    """The caller's deadline where it has one, else :func:`within` ``seconds``: a call that
    must not wait longer than that even when nobody bounded it."""
    return nullcontext() if _current.get() is not None else within(seconds, bound=bound)


def current() -> Optional[Deadline]:
    return _current.get()


def clamp(timeout: Optional[float]) -> Optional[float]:
    """``timeout`` (``None``: no limit), cut to the time the caller has left; raises
    :class:`DeadlinePassed` when it has none."""
    deadline = _current.get()
    if deadline is None:
        return timeout
    left = deadline.remaining()
    if left <= 0:
        raise DeadlinePassed(
            f"the call's bound of {deadline.seconds:g}s for the gate ({deadline.bound}) "
            "ran out" + (f"; the last attempt: {deadline.error}" if deadline.error else "")
        )
    left = max(left, MIN_WAIT)
    return left if timeout is None else min(timeout, left)


def allowance(size: int) -> float:
    """The seconds more that a call of ``size`` bytes may wait for its reply (0 for most calls);
    the caller's deadline, where there is one, is extended by as much."""
    if size <= LARGE_CALL_FROM:
        return 0.0
    extra = (size - LARGE_CALL_FROM) / LARGE_CALL_RATE
    deadline = _current.get()
    if deadline is not None:
        deadline.at += extra
        deadline.seconds += extra
    return extra


def sent_size(command: Any) -> int:
    """The bytes of a packed command (redis-py packs one as bytes or as a list of chunks)."""
    if isinstance(command, (bytes, bytearray, memoryview)):
        return len(command)
    return sum(len(chunk) for chunk in command)


def backoff(seconds: float) -> float:
    """A retry's pause, ended with the caller's deadline (the next attempt then reports it)."""
    deadline = _current.get()
    return seconds if deadline is None else max(0.0, min(seconds, deadline.remaining()))


_SCRIPT_CALLS = (b"EVALSHA", b"FCALL")


def note_sent(command: Any) -> None:
    """A command went out: when it is a script call, it may run although no reply comes."""
    deadline = _current.get()
    if deadline is not None and not deadline.unanswered:
        first = (
            command
            if isinstance(command, (bytes, bytearray, memoryview))
            else (command[0] if command else b"")
        )
        head = bytes(first[:32])
        deadline.unanswered = any(name in head for name in _SCRIPT_CALLS)


def note_failed(error: BaseException) -> None:
    """A wait failed (refused, timed out, closed): the cause the caller's error names."""
    deadline = _current.get()
    if deadline is not None and not isinstance(error, DeadlinePassed):
        deadline.error = error


def note_answered() -> None:
    deadline = _current.get()
    if deadline is not None:
        deadline.answered()


class _Bounded:
    """A redis-py connection whose every wait (connect, TLS handshake, send, read) ends with the
    caller's deadline, when there is one; mixed into the pool's own connection class (plain, TLS,
    Unix socket, Sentinel-managed), so nothing else about the connection changes."""

    socket_timeout: Optional[float]
    socket_connect_timeout: Optional[float]
    _sock: Any

    def _connect(self) -> Any:
        if _current.get() is None:
            return self._probing(super()._connect)  # type: ignore[misc]
        own = self.socket_timeout, self.socket_connect_timeout
        try:
            self.socket_timeout, self.socket_connect_timeout = clamp(own[0]), clamp(own[1])
            sock = super()._connect()  # type: ignore[misc]
            self._clamped = True  # its timeout is the caller's: set back on the next use
            return sock
        except _FAILURES as exc:
            note_failed(exc)
            transport.check(self, exc, _probe_wait())
            raise
        finally:
            self.socket_timeout, self.socket_connect_timeout = own

    # The connection's first exchange (redis-py 5: on_connect; 6+: on_connect_check_health, which
    # on_connect calls): a TLS server closes a plain connection there.
    def on_connect(self, *args: Any, **kwargs: Any) -> Any:
        return self._probing(super().on_connect, *args, **kwargs)  # type: ignore[misc]

    def on_connect_check_health(self, *args: Any, **kwargs: Any) -> Any:
        return self._probing(super().on_connect_check_health, *args, **kwargs)  # type: ignore[misc]

    def _probing(self, step: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``step(...)``, a failure of which is named a TLS mismatch when the port answers the
        other way (:func:`transport.check`)."""
        try:
            return step(*args, **kwargs)
        except _FAILURES as exc:
            transport.check(self, exc, _probe_wait())
            raise

    def _bound_socket(self, extra: float = 0.0) -> None:
        """The socket's timeout: its own, plus ``extra`` (a large call's :func:`allowance`), cut
        to the caller's deadline."""
        sock = self._sock
        if sock is None:
            return
        own = self.socket_timeout
        timeout = own + extra if own is not None and extra else own
        if _current.get() is not None:
            sock.settimeout(clamp(timeout))
            self._clamped = True
        elif extra or getattr(self, "_clamped", False):
            sock.settimeout(timeout)
            self._clamped = bool(extra)

    def send_packed_command(self, command: Any, *args: Any, **kwargs: Any) -> Any:
        # A large call's allowance holds from its first byte: Redis reads its message at its own
        # pace (Python's sendall times out on the whole send), then runs it.
        self._extra = allowance(sent_size(command))
        self._bound_socket(self._extra)
        try:
            super().send_packed_command(command, *args, **kwargs)  # type: ignore[misc]
        except _FAILURES as exc:
            note_failed(exc)
            raise
        note_sent(command)

    def read_response(self, *args: Any, **kwargs: Any) -> Any:
        extra, self._extra = getattr(self, "_extra", 0.0), 0.0
        self._bound_socket(extra)
        try:
            response = super().read_response(*args, **kwargs)  # type: ignore[misc]
        except redis.ResponseError:
            note_answered()
            raise
        except _FAILURES as exc:
            note_failed(exc)
            raise
        note_answered()
        return response


_FAILURES = (redis.ConnectionError, redis.TimeoutError, OSError)


def _probe_wait() -> float:
    """How long :func:`transport.check` may wait: within the caller's bound, but never below
    ``transport.PROBE_FLOOR`` (a TLS handshake with a plain server waits out the whole bound, and
    the probe is what turns that into a clear error)."""
    deadline = _current.get()
    if deadline is None:
        return transport.PROBE_WAIT
    return max(min(transport.PROBE_WAIT, deadline.remaining()), transport.PROBE_FLOOR)


_classes: dict[type, type] = {}


def bounded_class(connection_class: type) -> type:
    """``connection_class`` with its waits bounded by the caller's deadline (one class per base)."""
    if issubclass(connection_class, _Bounded):
        return connection_class
    found = _classes.get(connection_class)
    if found is None:
        found = _classes[connection_class] = type(
            connection_class.__name__,
            (_Bounded, connection_class),
            {"__module__": __name__, "__doc__": connection_class.__doc__},
        )
    return found


def unbounded_class(connection_class: type) -> type:
    """The class :func:`bounded_class` made ``connection_class`` from (itself if none)."""
    if issubclass(connection_class, _Bounded):
        return connection_class.__mro__[2]
    return connection_class
