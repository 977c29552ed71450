"""Reading the history the test tasks write, and waiting for things."""

from __future__ import annotations

import os
import signal
import subprocess
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

T = TypeVar("T")


def tid(prefix: str = "t") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


def wait_for(
    condition: Callable[[], T],
    timeout: float = 20.0,
    interval: float = 0.05,
    what: str | Callable[[], str] = "condition",
) -> T:
    """``condition()`` once it is true; ``what`` (or what it returns, then) names it in the
    error when it stays false for ``timeout`` seconds."""
    end = time.time() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.time() > end:
            raise AssertionError(
                f"timed out after {timeout}s waiting for {what() if callable(what) else what}"
            )
        time.sleep(interval)


def within(condition: Callable[[], object], timeout: float) -> bool:
    """Whether ``condition()`` comes true within ``timeout`` seconds: for a probe sent again
    until one gets through (``wait_for(probe, ...)``)."""
    try:
        wait_for(condition, timeout=timeout)
    except AssertionError:
        return False
    return True


@dataclass(frozen=True)
class Event:
    kind: str  # "start" or "end"
    label: str
    task_id: str
    at_us: int  # Redis server clock


def events(r, thread: str) -> list[Event]:
    rows = [x.decode().split("|") for x in r.lrange(f"hist:{thread}", 0, -1)]
    return [Event(k, label, task_id, int(at)) for k, label, task_id, at in rows]


def starts(r, thread: str) -> list[str]:
    return [e.label for e in events(r, thread) if e.kind == "start"]


def assert_serial(r, thread: str) -> None:
    """No two members of `thread` ran at once: starts and ends alternate."""
    evs = events(r, thread)
    for i, e in enumerate(evs):
        assert e.kind == ("start" if i % 2 == 0 else "end"), f"overlap in {thread}: {evs}"
        if e.kind == "end":
            assert e.label == evs[i - 1].label, f"overlap in {thread}: {evs}"


def gate_keys(r, thread: str) -> list[bytes]:
    return [k for k in r.scan_iter(match=f"*:t:{thread}:*")]


def now_us(r) -> int:
    seconds, micros = r.time()
    return seconds * 1_000_000 + micros


def beats(r, thread: str, label: str) -> list[int]:
    rows = [x.decode().split("|") for x in r.lrange(f"beats:{thread}", 0, -1)]
    return [int(at) for who, at in rows if who == label]


def last_beat(r, thread: str, label: str, quiet: float = 0.5, timeout: float = 5.0) -> int:
    """``label``'s last heartbeat, once it has not beaten for ``quiet`` seconds (or after
    ``timeout`` seconds, when it goes on beating)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end and now_us(r) - beats(r, thread, label)[-1] < quiet * 1e6:
        time.sleep(0.05)
    return beats(r, thread, label)[-1]


def started_at(r, thread: str, label: str) -> int:
    [at] = [e.at_us for e in events(r, thread) if e.kind == "start" and e.label == label]
    return at


def terminate(proc: subprocess.Popen[Any], group: bool = False, grace: float = 30.0) -> None:
    """SIGTERM ``proc`` (its process group with ``group``) and wait for it; SIGKILL after
    ``grace`` seconds: how long a server or Flower takes to stop on a loaded machine is no test's."""
    if proc.poll() is not None:
        return

    def send(signum: int) -> None:
        try:
            os.killpg(proc.pid, signum) if group else proc.send_signal(signum)
        except ProcessLookupError:
            pass

    send(signal.SIGTERM)
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        send(signal.SIGKILL)
        proc.wait(grace)


def collect_events(app):
    """Start a receiver of every event on the broker; returns (events list, stop) once it
    received an event sent after it started."""
    import threading
    import uuid

    got: list[dict] = []
    conn = app.connection_for_read()
    recv = app.events.Receiver(conn, handlers={"*": got.append})

    def run() -> None:
        try:
            recv.capture(limit=None, timeout=None, wakeup=False)
        except Exception:
            pass

    threading.Thread(target=run, daemon=True).start()
    probe = uuid.uuid4().hex
    with app.events.default_dispatcher() as dispatcher:  # until its queue is bound
        wait_for(
            lambda: (
                dispatcher.send("probe-receiver", probe=probe) or any(e.get("probe") == probe for e in got)
            ),
            timeout=60,
            interval=0.2,
            what="the event receiver to be bound",
        )

    def stop() -> None:
        recv.should_stop = True
        conn.release()

    return got, stop


def the_event(got: list, kind: str, task_id: str, timeout: float = 30) -> dict:
    """The one event of ``kind`` about ``task_id`` among those :func:`collect_events` gathers,
    once it has come."""

    def found() -> list:
        return [e for e in got if e.get("type") == kind and e.get("uuid") == task_id]

    wait_for(found, timeout=timeout, what=f"{kind} of {task_id}")
    [event] = found()
    return event
