"""What a user who got the gate's settings wrong is told: a worker whose gate URL nobody answers
says which URL and setting, and what to check; a malformed URL names its setting."""

from __future__ import annotations

import pytest
from celery import Celery

from celery_threads.config import read_config
from celery_threads.errors import ConfigurationError
from tests.conftest import Deployment, free_port
from tests.support.helpers import wait_for


def test_a_worker_whose_gate_nobody_answers_says_where_and_what_to_check(redis_server):
    dead = f"redis://:secret@127.0.0.1:{free_port()}/0"
    d = Deployment(
        {
            "CT_REDIS_URL": dead,
            "CT_BROKER_URL": redis_server.url(1),
            "CT_BACKEND_URL": redis_server.url(2),
            "CT_HISTORY_URL": redis_server.url(3),
            "CT_DISPATCH_INTERVAL": "0.5",
            "CT_KEY_PREFIX": "misconfigured",
        }
    )
    try:
        worker = d.worker(wait=False)
        wait_for(
            lambda: "cannot reach the gate's Redis" in worker.output(),
            timeout=60,
            what="the worker to say it cannot reach the gate",
        )
        line = next(x for x in worker.output().splitlines() if "cannot reach the gate's" in x)
        assert "ERROR" in line
        assert f"127.0.0.1:{dead.rsplit(':', 1)[1]}" in line and "secret" not in line
        assert "threads_redis_url" in line and "Check that the server runs" in line
        assert "the worker starts and keeps trying" in line  # said at start, at once
        # Then the dispatch loop's failures, rate-limited: its ticks go on, the log does not.
        wait_for(
            lambda: "failure(s) in" in worker.output(),
            timeout=60,
            what="the dispatch loop to report its failures",
        )
        assert worker.output().count("cannot reach the gate's Redis") <= 3
    finally:
        for proc in d.processes:
            proc.stop()


@pytest.mark.parametrize(
    "url, why",
    [
        ("http://localhost:6379/0", "scheme must be one of"),
        ("redis://:pw@localhost:99999/0", "Port out of range"),
        ("sentinel://a:26379;sentinel://b:x/0", "could not be cast"),
    ],
)
def test_a_malformed_gate_url_names_its_setting(url, why):
    app = Celery("bad-url", set_as_current=False)
    app.conf.threads_redis_url = url
    with pytest.raises(ConfigurationError, match="threads_redis_url=") as info:
        read_config(app)
    assert why in str(info.value) and "redis://[user:password@]host:6379/0" in str(info.value)
    assert "pw@" not in str(info.value)
