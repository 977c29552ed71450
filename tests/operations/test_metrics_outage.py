"""`celery threads metrics` while the gate's Redis is down or silent: a real exporter process on a
redis-server of the test's own.  A scrape gets 503 (Prometheus records ``up == 0``), never 500;
the exporter logs one line when the outage starts and one when the gate answers again, never a
traceback per scrape; a silent gate cannot hold a scrape past ``threads_publish_timeout``.
"""

from __future__ import annotations

import os
import shutil
import signal
import time
from collections.abc import Iterator

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import CeleryProcess, RedisServer, deployment_env, free_port, redis_binaries
from tests.support.helpers import wait_for

DOWN = "cannot be read"  # the outage's one line
UP = "answers again"  # and the line that ends it
PUBLISH_TIMEOUT = 5.0  # threads_publish_timeout's default, which tests.support.proj keeps


class Exporter:
    def __init__(self, server: RedisServer) -> None:
        self.server = server
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/metrics"
        self.process = CeleryProcess(
            "threads", deployment_env(server), ["metrics", "--port", str(self.port)], "metrics"
        )

    def get(self) -> requests.Response | None:
        try:
            return requests.get(self.url, timeout=60)
        except requests.ConnectionError:
            return None

    def scrape(self) -> requests.Response:
        response = self.get()
        assert response is not None, self.process.output()
        return response

    def lines(self, needle: str) -> list[str]:
        return [line for line in self.process.output().splitlines() if needle in line]

    def assert_no_traceback(self) -> None:
        assert "Traceback" not in self.process.output(), self.process.output()

    def assert_serves_metrics(self, response: requests.Response) -> None:
        assert response.status_code == 200, response.text
        names = {f.name for f in text_string_to_metric_families(response.text)}
        assert {"celery_threads_threads", "celery_threads_endings"} <= names, names


@pytest.fixture
def exporter(proj) -> Iterator[Exporter]:
    if not redis_binaries():
        pytest.skip("redis-server is not available")
    server = RedisServer()
    server.start()
    exp = Exporter(server)
    try:
        exp.process.start()
        response = wait_for(exp.get, what="the exporter to listen", timeout=60)
        exp.assert_serves_metrics(response)
        yield exp
    finally:
        if server.proc is not None and server.proc.poll() is None:
            os.kill(server.proc.pid, signal.SIGCONT)  # a test that failed with it stopped
        exp.process.stop()
        server.stop(kill=True)
        shutil.rmtree(server.dir, ignore_errors=True)


def test_a_dead_gate_gets_503_and_one_log_line_until_it_answers_again(exporter: Exporter):
    server = exporter.server
    server.stop(kill=True)
    for _ in range(3):
        response = exporter.scrape()
        assert response.status_code == 503, (response.status_code, response.text)
        assert "the gate" in response.text and len(response.text) < 300, response.text
    assert len(exporter.lines(DOWN)) == 1, exporter.process.output()
    assert f"127.0.0.1:{server.port}" in exporter.lines(DOWN)[0]
    assert not exporter.lines(UP)
    exporter.assert_no_traceback()

    server.start()  # the same port
    response = wait_for(
        lambda: (r := exporter.scrape()).status_code == 200 and r,
        what="a scrape to succeed once the gate is back",
        timeout=60,
    )
    exporter.assert_serves_metrics(response)
    assert len(exporter.lines(UP)) == 1, exporter.process.output()
    assert "3 scrapes got 503" in exporter.lines(UP)[0], exporter.lines(UP)
    assert len(exporter.lines(DOWN)) == 1, exporter.process.output()
    exporter.assert_serves_metrics(exporter.scrape())
    assert len(exporter.lines(UP)) == 1
    exporter.assert_no_traceback()


def test_a_silent_gate_cannot_hold_a_scrape_past_the_publish_timeout(exporter: Exporter):
    """A redis-server that accepts and never answers (SIGSTOP): the scrape ends with 503 within
    threads_publish_timeout (the admin call's bound), and 200 once it answers (SIGCONT)."""
    pid = exporter.server.proc.pid
    os.kill(pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        response = exporter.scrape()
        took = time.monotonic() - started
        assert response.status_code == 503, (response.status_code, response.text)
        assert took < PUBLISH_TIMEOUT + 5, took
        assert len(exporter.lines(DOWN)) == 1, exporter.process.output()
    finally:
        os.kill(pid, signal.SIGCONT)
    response = wait_for(
        lambda: (r := exporter.scrape()).status_code == 200 and r,
        what="a scrape to succeed once the gate answers",
        timeout=60,
    )
    exporter.assert_serves_metrics(response)
    assert len(exporter.lines(UP)) == 1, exporter.process.output()
    exporter.assert_no_traceback()
