"""``celery threads metrics``: the counters the gate's transitions keep, on real workers, and the
Prometheus endpoint served by a real ``celery threads metrics`` process.

Counters are judged against what the members did (AsyncResult states, the bodies' start records);
each deployment has its own key prefix, so its counters start at zero.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import requests
from celery.bin.celery import celery as celery_command
from click.testing import CliRunner, Result
from prometheus_client.parser import text_string_to_metric_families

from celery_threads import Threads
from celery_threads.runtime import get_runtime
from tests.conftest import ROOT, CeleryProcess, free_port
from tests.support.helpers import starts, tid, wait_for
from tests.support.isolated import pointed_at


def cli(*args: str) -> Result:
    result = CliRunner().invoke(celery_command, ["-A", "tests.support.proj", "threads", *args])
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a Prometheus text page, by (name, sorted labels)."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(page: dict, name: str, **labels: str) -> float:
    return page[(name, tuple(sorted(labels.items())))]


def state(proj, result) -> str:
    return proj.app.backend.get_task_meta(result.id, cache=False)["status"]


def scrape() -> dict:
    result = cli("metrics", "--once")
    assert result.exit_code == 0, result.output
    return samples(result.stdout)


def test_counters_after_real_runs(proj, make_deployment):
    """Successes, a retry, a death, a delete, a purge and a lease that lapsed when its worker
    was SIGKILLed: each counted once, in the gate, as the members ended."""
    d = make_deployment(CT_EVENTS="0", CT_KEEPALIVE="2", CT_DISPATCH_INTERVAL="0.2")
    d.worker("mA", concurrency=1)
    r = proj.history()
    plain = tid("m-plain")
    done = [proj.record.delay(plain, f"s{i}") for i in range(3)]
    done.append(proj.record.delay(plain, "retried", fail_times=1, countdown=0.1))
    died = proj.boom.delay(plain, "boom")
    for x in done:
        wait_for(lambda x=x: state(proj, x) == "SUCCESS", what=f"{x.id} SUCCESS", timeout=60)
    wait_for(lambda: state(proj, died) == "FAILURE", what="boom FAILURE", timeout=60)

    held = tid("m-held")
    blocker = proj.beater.delay(held, "hold", seconds=120)
    wait_for(lambda: starts(r, held) == ["hold"], what="the blocker to start", timeout=60)
    behind = [proj.record.delay(held, f"w{i}") for i in range(3)]
    wait_for(lambda: len(Threads(proj.app).get(held).waiting) == 3, what="three waiting")
    assert Threads(proj.app).delete(behind[0].id)
    assert Threads(proj.app).purge(held) == 2
    # A second worker takes over the dispatching; the first, running the blocker, is killed.
    d.worker("mB", concurrency=1)
    holder = get_runtime(proj.app).gate.reads.snapshot(held).active["worker"].split("-")[0]
    victim = next(p for p in d.processes if p.kind == "worker" and p.name == holder)
    victim.kill(signal.SIGKILL)
    wait_for(lambda: state(proj, blocker) == "FAILURE", what="the blocker's lapsed lease", timeout=60)

    page = scrape()
    assert value(page, "celery_threads_endings_total", outcome="succeeded") == 4
    assert value(page, "celery_threads_endings_total", outcome="dead") == 2
    assert value(page, "celery_threads_endings_total", outcome="deleted") == 3
    assert value(page, "celery_threads_retries_total") == 1
    assert value(page, "celery_threads_lease_lapses_total") == 1
    # Every attempt's body started once: 3 + 2 (the retried one) + boom + the blocker.
    assert value(page, "celery_threads_wait_seconds_count") == 7
    assert value(page, "celery_threads_dead_letters") == 2
    assert value(page, "celery_threads_threads") == 0
    for s in ("waiting", "released", "running"):
        assert value(page, "celery_threads_members", state=s) == 0


def test_wait_is_measured_from_the_due_time_and_oldest_due_ignores_future_members(proj, make_deployment):
    """A member with a 3 s countdown is not late: its wait (due -> start) stays far below 3 s,
    and while it is not due the oldest-due gauge stays 0 (pgbus#390's false alarm)."""
    d = make_deployment(CT_EVENTS="0", CT_DISPATCH_INTERVAL="0.2")
    d.worker("wait", concurrency=1)
    thread = tid("m-countdown")
    later = proj.record.apply_async((thread, "later"), countdown=3)
    page = scrape()
    assert value(page, "celery_threads_members", state="waiting") == 1
    assert value(page, "celery_threads_oldest_due_seconds") == 0
    wait_for(lambda: state(proj, later) == "SUCCESS", what="the countdown member", timeout=60)
    page = scrape()
    assert value(page, "celery_threads_wait_seconds_count") == 1
    assert value(page, "celery_threads_wait_seconds_sum") < 2.0, page
    assert value(page, "celery_threads_wait_seconds_bucket", le="+Inf") == 1


def test_oldest_due_counts_a_due_head_no_dispatcher_released(proj, isolated_app):
    """With no dispatcher running, a head whose time has come stays unreleased: the gauge is 0
    until it is due, then grows with the Redis server's clock; the stuck count follows stats."""
    threads = Threads(isolated_app)
    gate = get_runtime(isolated_app).gate
    gate.enqueue("m-due", "m-due-1", b"x", delay_ms=1000)
    assert threads.metrics().oldest_due_seconds == 0
    wait_for(lambda: threads.metrics().oldest_due_seconds > 0.2, what="the head to be due", timeout=60)
    m = threads.metrics(grace=0)
    assert m.members == {"waiting": 1, "released": 0, "running": 0}
    assert m.threads == 1
    assert m.stuck_threads == threads.stats(grace=0).stuck == 1


def test_top_threads_by_waiting_members(proj, isolated_app):
    """--top N: the N threads with the most waiting members, as labelled gauges; none without."""
    gate = get_runtime(isolated_app).gate
    for thread, n in (("top-a", 3), ("top-b\x1b[31m", 5), ("top-c", 1)):
        for i in range(n + 1):  # the first is released (active), the rest wait
            gate.enqueue(thread, f"{thread}-{i}", b"x")
    page = scrape()
    assert not [k for k in page if k[0] == "celery_threads_thread_waiting"]
    result = cli("metrics", "--once", "--top", "2")
    assert result.exit_code == 0, result.output
    page = samples(result.stdout)
    top = {dict(k[1])["thread_id"]: v for k, v in page.items() if k[0] == "celery_threads_thread_waiting"}
    # An escape sequence in an id stays (printed through click, a pipe got "top-b": another id).
    assert top == {"top-b\x1b[31m": 5, "top-a": 3}
    assert value(page, "celery_threads_members", state="waiting") == 9
    assert value(page, "celery_threads_members", state="released") == 3


def test_the_endpoint_serves_prometheus_text_over_http(proj, make_deployment):
    """A real `celery threads metrics --port P` process, scraped with an HTTP GET."""
    d = make_deployment(CT_EVENTS="0")
    port = free_port()
    exporter = CeleryProcess("threads", d.env, ["metrics", "--port", str(port)], "metrics")
    d.processes.append(exporter.start())
    url = f"http://127.0.0.1:{port}/metrics"

    def get() -> requests.Response | None:
        try:
            return requests.get(url, timeout=10)
        except requests.ConnectionError:
            return None

    response = wait_for(get, what="the exporter to listen", timeout=60)
    assert response.status_code == 200
    assert response.headers["Content-Type"].startswith("text/plain")
    names = {f.name for f in text_string_to_metric_families(response.text)}
    assert names >= {
        "celery_threads_threads",
        "celery_threads_members",
        "celery_threads_paused_threads",
        "celery_threads_stuck_threads",
        "celery_threads_oldest_due_seconds",
        "celery_threads_dead_letters",
        "celery_threads_endings",
        "celery_threads_retries",
        "celery_threads_lease_lapses",
        "celery_threads_wait_seconds",
    }, names
    assert "python_gc" not in response.text  # the gate's metrics only
    assert requests.get(f"http://127.0.0.1:{port}/metrics", timeout=10).status_code == 200


def test_missing_prometheus_client_says_what_to_install(proj, tmp_path: Path):
    """Without prometheus_client the command exits 1 with the pip command to run."""
    (tmp_path / "sitecustomize.py").write_text(
        textwrap.dedent("""
        import sys

        class _Block:
            def find_spec(self, name, path=None, target=None):
                if name == "prometheus_client" or name.startswith("prometheus_client."):
                    raise ImportError(f"No module named {name!r}")
                return None

        sys.meta_path.insert(0, _Block())
    """)
    )
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}"}
    done = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "tests.support.proj", "threads", "metrics", "--once"],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1, done
    assert "pip install prometheus_client" in done.stderr, done.stderr


def test_every_value_is_summed_over_the_shards(proj, isolated_app):
    """With three shards, each shard keeps its own counters and indexes: the metrics are their
    sums (the top threads ranked across shards)."""
    with pointed_at(isolated_app, threads_shards=3):
        gate = get_runtime(isolated_app).gate
        ids = [f"sh-{i}" for i in range(6)]
        assert len({gate.keys.shard_of(t) for t in ids}) > 1
        released = {}
        for n, thread in enumerate(ids):
            for i in range(n + 2):  # the first is released, the rest wait
                outcome = gate.enqueue(thread, f"{thread}-{i}", b"x")
                if outcome.release is not None:
                    released[thread] = outcome.release
        for thread, release in released.items():
            gate.claim(thread, release.task_id, release.token, "w")
            gate.finish(thread, release.task_id, release.token)
        m = Threads(isolated_app).metrics(top=2)
        assert m.threads == 6
        assert m.members == {"waiting": sum(range(6)), "released": 6, "running": 0}
        assert m.counters.endings == {"succeeded": 6, "dead": 0, "deleted": 0}
        assert m.counters.wait_count == 6
        assert m.thread_waiting == [("sh-5", 5), ("sh-4", 4)]


def test_a_taken_port_is_a_clear_error(proj):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = cli("metrics", "--port", str(port))
    assert result.exit_code == 1, result.output
    assert f"cannot listen on 127.0.0.1:{port}" in result.output, result.output
