"""The worker's pool processes as its main process sees them: which one a request went to (its
claimant prefix, which fences the main process's endings of that request), and acting once one
has exited (a pidfd wait, or polling where the system has no pidfds).

Ending a member only once its pool process has exited keeps any of its code, ``finally`` blocks
included, from running beside the next member of its thread: the hard time limit
(:mod:`celery_threads.worker.request`) and a terminating revoke
(:mod:`celery_threads.worker.revoke`) end their members this way.
"""

from __future__ import annotations

import os
import select
import threading
import time
from typing import Any, Callable, Optional

from ..gate import claimant_prefix
from ..logs import get_logger

logger = get_logger(__name__)


#: Whether the worker's pool runs tasks in green threads of its own process (gevent, eventlet:
#: the pool's ``is_green``), set by the worker's bootstep.  Their requests' ``worker_pid`` is
#: then a greenlet's id, not a process: nothing of it can be signalled or waited for.
GREEN = False


def process_of(request: Any) -> Optional[int]:
    """The process running a request (its pool process under prefork; this one for the threads,
    solo, gevent and eventlet pools), or ``None`` before the pool said which."""
    pid = getattr(request, "worker_pid", None)
    if pid and GREEN:
        return os.getpid()
    return int(pid) if pid else None


def pool_holder(request: Any) -> Optional[str]:
    """The claimant prefix of the pool process a request went to (its claims begin with it), or
    ``None`` before the pool said which: the main process's endings are then fenced by token
    only."""
    pid = process_of(request)
    return claimant_prefix(request.hostname or "", pid) if pid else None


def when_gone(
    pid: Optional[int], action: Callable[[], Any], timeout: float, what: str = "", anyway: bool = True
) -> None:
    """Run ``action`` once the process ``pid`` has exited (in a thread of its own), or at once
    when ``pid`` is this process (a pool without processes) or no longer exists.  Past
    ``timeout`` seconds it runs anyway, with a warning: as when a lease lapses; not
    ``anyway``: it does not run then (the member ends otherwise, see
    :func:`celery_threads.worker.revoke._delete_once_stopped`)."""
    if not pid or pid == os.getpid():
        _run_logged(action, what)
        return
    try:
        fd: Optional[int] = os.pidfd_open(pid)
    except ProcessLookupError:
        _run_logged(action, what)
        return
    except (AttributeError, OSError):  # no pidfd (Linux before 5.3, another system): poll
        fd = None

    def wait() -> None:
        if _wait_exit(pid, fd, timeout):
            logger.debug("celery-threads: pool process %s exited; ending %s", pid, what)
        elif anyway:
            logger.warning(
                "celery-threads: pool process %s still runs %ss after %s timed out; "
                "ending it in its thread all the same",
                pid,
                timeout,
                what,
            )
        else:
            logger.warning(
                "celery-threads: pool process %s still runs %ss after deleted member "
                "%s was signalled (its code ignores the signal?); it leaves its thread "
                "when its body returns or its lease lapses",
                pid,
                timeout,
                what,
            )
            return
        _run_logged(action, what)

    threading.Thread(target=wait, name="celery-threads-when-gone", daemon=True).start()


def _wait_exit(pid: int, fd: Optional[int], timeout: float) -> bool:
    """Whether process ``pid`` (``fd`` its pidfd, or ``None``) exited within ``timeout`` s."""
    if fd is not None:
        try:
            poll = select.poll()
            poll.register(fd, select.POLLIN)  # readable once the process has exited
            return bool(poll.poll(timeout * 1000))
        finally:
            os.close(fd)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)  # succeeds until the pool reaps its exited process
        except ProcessLookupError:
            return True
        except OSError:
            pass
        time.sleep(0.01)
    return False


def _run_logged(action: Callable[[], Any], what: str) -> None:
    try:
        action()
    except Exception:
        logger.exception("celery-threads: could not end %s in its thread; its lease will lapse", what)


def open_pidfd(pid: int) -> Optional[int]:
    """A pidfd of ``pid`` (Linux 5.3+), or ``None``."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None
