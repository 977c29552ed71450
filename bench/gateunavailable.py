"""``python -m bench gateunavailable``: how long a producer's ``apply_async`` waits on a dead gate
before it raises ``GateUnavailable``, for each way a gate can be dead.

This process is the producer (the broker, on a redis-server of the run's own, stays up); the gate:
* never reachable: a free port nobody listens on, from a runtime that never reached it;
* down after use: the gate's redis-server stopped after a call went through, then the first call
  after, and a later one (they differ when the client keeps connections);
* TLS mismatch: ``rediss://`` against the plain redis-server (``TransportMismatch``, once the
  handshake has waited out the bound and the port answered a plain ``PING``);
* black hole: a socket that accepts connections and never answers;
* stopped after use: the gate's redis-server sent SIGSTOP after a call went through (the call is
  sent and no reply comes: its error says the member may be stored).
Each path is timed ``--repeats`` times, each on a new runtime (as a new process would); the
table gives median / min / max in seconds, against ``threads_publish_timeout`` (its default
unless ``--timeout``; 1 s with ``--quick``).  No timing is asserted.
"""

from __future__ import annotations

import argparse
import signal
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Callable

from celery import Celery

from bench import harness as h
from celery_threads import ThreadedTask
from celery_threads.config import DEFAULTS
from celery_threads.errors import GateUnavailable, TransportMismatch
from celery_threads.runtime import reset

REPEATS = 5

app = Celery("bench-gateunavailable")


@app.task(base=ThreadedTask, name="bench.gateunavailable.noop")
def noop() -> None:
    """Never runs: no worker consumes."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--timeout",
        type=float,
        default=None,
        help="threads_publish_timeout in seconds (default: the setting's default, "
        f"{DEFAULTS['threads_publish_timeout']:g})",
    )


@contextmanager
def black_hole() -> Iterator[int]:
    """A port whose server accepts connections and never answers; its port."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(server.accept()[0])
            except OSError:
                continue

    acceptor = threading.Thread(target=accept, daemon=True)
    acceptor.start()
    try:
        yield int(server.getsockname()[1])
    finally:
        stop.set()
        acceptor.join()
        for conn in held:
            conn.close()
        server.close()


def _point(broker_url: str, gate_url: str, timeout: float | None, **options: Any) -> None:
    reset(app)
    app.conf.broker_url = broker_url
    app.conf.threads_redis_url = gate_url
    app.conf.threads_redis_options = options or None
    app.conf.threads_publish_timeout = timeout


def _time_call() -> tuple[float, str]:
    """Seconds until ``apply_async`` raised ``GateUnavailable`` (``TransportMismatch`` for TLS on
    one side only), and its message."""
    started = time.monotonic()
    try:
        noop.apply_async(thread_id="bench", task_id=str(uuid.uuid4()))
    except (GateUnavailable, TransportMismatch) as exc:
        return time.monotonic() - started, str(exc)
    raise SystemExit("apply_async did not raise GateUnavailable on a dead gate")


def run(args: argparse.Namespace) -> int:
    timeout = args.timeout if args.timeout is not None or not args.quick else 1.0
    bound = timeout if timeout is not None else float(DEFAULTS["threads_publish_timeout"])
    times: dict[str, list[float]] = {}
    stored: dict[str, bool] = {}

    def measure(
        path: str,
        prepare: Callable[[], Any],
        after: Callable[[], Any] = lambda: None,
    ) -> None:
        for repeat in range(args.repeats):
            h.progress(f"{path}: repeat {repeat + 1}/{args.repeats}")
            prepare()
            try:
                seconds, message = _time_call()
            finally:
                after()
            times.setdefault(path, []).append(seconds)
            stored[path] = stored.get(path, False) or "may be stored" in message

    with h.Stack("gateunavailable") as stack:
        broker, gate = stack.redis("broker"), stack.redis("gate")
        where = h.machine(gate)
        broker_url = broker.url(h.BROKER_DB)

        measure(
            "never reachable", lambda: _point(broker_url, f"redis://127.0.0.1:{h.free_port()}/0", timeout)
        )

        def used_then(action: Callable[[], None]) -> Callable[[], None]:
            def prepare() -> None:
                if not gate.alive():
                    gate.start()
                _point(broker_url, gate.url(), timeout)
                noop.apply_async(thread_id="bench-warm-up")  # the gate answered once
                action()

            return prepare

        def gate_down() -> None:
            h.Proc.stop(gate)  # keeps its directory, to start it again

        measure("down after use: first call", used_then(gate_down))
        # The runtime of the last repeat, its gate still down: the calls after the first.
        for repeat in range(args.repeats):
            h.progress(f"down after use: later call {repeat + 1}/{args.repeats}")
            seconds, _ = _time_call()
            times.setdefault("down after use: a later call", []).append(seconds)
        gate.start()
        measure(
            "TLS mismatch (rediss:// on a plain server)",
            lambda: _point(broker_url, f"rediss://127.0.0.1:{gate.port}/0", timeout, ssl_cert_reqs="none"),
        )
        with black_hole() as port:
            measure(
                "black hole (accepts, never answers)",
                lambda: _point(broker_url, f"redis://127.0.0.1:{port}/0", timeout),
            )
        measure(
            "stopped after use (SIGSTOP)",
            used_then(lambda: gate.proc.send_signal(signal.SIGSTOP)),
            after=lambda: gate.proc.send_signal(signal.SIGCONT),
        )
        reset(app)

    rows = [
        [path, h.median(values), min(values), max(values), "yes" if stored.get(path) else "no"]
        for path, values in times.items()
    ]
    notes = [
        f"seconds from apply_async to GateUnavailable, {args.repeats} repeat(s) per path, "
        f"each on a new runtime (the later calls: on the last one); "
        f"threads_publish_timeout {bound:g} s" + (" (its default)" if timeout is None else "") + ".",
        "'may be stored': the error said a call went out without its reply (the member may "
        "be stored and run; calling again with the same task id is safe).",
        "before threads_publish_timeout (main at 2f03b9f): never reachable 46.5 s, down "
        "after use 15.5 s then 31 s, TLS mismatch 67 s (issue 27, item 4).",
    ]
    h.report(
        "gateunavailable",
        "gateunavailable",
        args.quick,
        where,
        "this process publishes; no worker",
        ["gate", "median (s)", "min (s)", "max (s)", "may be stored"],
        rows,
        notes,
        options=f" --timeout {args.timeout:g}" if args.timeout is not None else "",
    )
    return 0
