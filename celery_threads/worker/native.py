"""Threads of the operating system, also in a process that gevent has monkey-patched.

Under ``celery worker -P gevent`` a ``threading.Thread`` is a greenlet: it runs only when the
running greenlet yields, so a member whose code holds the hub (a CPU-bound loop, a C call that
does not yield) for longer than the keepalive would starve the renewal of its own lease, and the
gate would release the thread's next member beside it.  What must go on whatever a member's code
does (the lease keeper, the worker's renewer) runs in a thread of the operating system instead,
started with the originals gevent keeps of what it patched.  gevent's patched sockets work in
such a thread on a hub of its own, as long as the thread owns its connections: it makes its own
gate client (:meth:`celery_threads.runtime.Runtime.own_gate`), never shares one with greenlets.

Eventlet's monkey-patching is not covered: there these threads are green ones.
"""

from __future__ import annotations

import sys
import threading
from typing import Any, Callable, Optional


def _original(module: str, name: str) -> Any:
    """``module.name`` as it was before gevent patched it (as it is, where gevent did not)."""
    monkey = sys.modules.get("gevent.monkey")
    if monkey is not None and monkey.is_module_patched(module):
        return monkey.get_original(module, name)
    return getattr(__import__(module), name)


def green() -> bool:
    """Whether gevent has patched ``threading`` in this process (``-P gevent``)."""
    monkey = sys.modules.get("gevent.monkey")
    return monkey is not None and bool(monkey.is_module_patched("threading"))


def allocate_lock() -> Any:
    """A lock of the operating system: it excludes a native thread and greenlets alike.  Hold it
    only for moments: a greenlet waiting for it holds the hub."""
    return _original("_thread", "allocate_lock")()


def sleep(seconds: float) -> None:
    """Sleep in a native thread (``time.sleep`` itself, where gevent patched it)."""
    _original("time", "sleep")(seconds)


class Flag:
    """Set once, waited for by a native thread (``threading.Event`` is gevent's under gevent)."""

    def __init__(self) -> None:
        self._lock = allocate_lock()
        self._lock.acquire()  # held until set
        self._set = False
        self._guard = allocate_lock()

    def set(self) -> None:
        with self._guard:
            if not self._set:
                self._set = True
                self._lock.release()

    def is_set(self) -> bool:
        return self._set

    def wait(self, timeout: float) -> bool:
        """Whether the flag is set, waiting up to ``timeout`` seconds for it."""
        if self._set:
            return True
        if self._lock.acquire(True, max(timeout, 0.0)):
            self._lock.release()
            return True
        return False


class NativeThread:
    """A daemon thread of the operating system running ``target``."""

    def __init__(self, target: Callable[[], Any], name: str) -> None:
        self.target, self.name = target, name
        self._started = False
        self._done = Flag()

    def start(self) -> None:
        self._started = True
        if green():
            _original("_thread", "start_new_thread")(self._run, ())
        else:
            threading.Thread(target=self._run, name=self.name, daemon=True).start()

    def _run(self) -> None:
        try:
            self.target()
        finally:
            self._done.set()

    def is_alive(self) -> bool:
        return self._started and not self._done.is_set()

    def join(self, timeout: Optional[float] = None) -> None:
        """Wait for it to end (under gevent this holds the hub meanwhile: for shutdowns)."""
        if self._started:
            self._done.wait(3600.0 if timeout is None else timeout)
