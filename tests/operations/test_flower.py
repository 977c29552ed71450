"""What Flower shows, through its HTTP API, of members waiting in, released from and deleted from the gate."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys

import pytest
import requests

from celery_threads import Threads
from tests.conftest import ROOT, free_port
from tests.support.helpers import starts, terminate, tid, wait_for, within


@pytest.fixture
def flower(make_deployment, proj):
    """Flower on the deployment's broker, once it shows a task from its events (before then, a
    busy machine may not have attached its event consumer yet)."""
    d = make_deployment()
    d.worker("w", concurrency=1)
    port = free_port()
    env = {**os.environ, **d.env, "PYTHONPATH": str(ROOT), "FLOWER_UNAUTHENTICATED_API": "true"}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "tests.support.proj",
            "flower",
            f"--port={port}",
            "--address=127.0.0.1",
        ],
        env=env,
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: _up(base), timeout=30, what="flower to listen")

        def shows_a_probe() -> bool:
            probe = proj.plain.delay(tid("flower-probe"), "probe")
            probe.get(timeout=30)
            return within(lambda: _task(base, probe.id).get("state") == "SUCCESS", timeout=5)

        wait_for(shows_a_probe, timeout=90, interval=0.1, what="flower to receive events")
        yield base, d
    finally:
        terminate(proc, group=True)


def _up(base: str) -> bool:
    try:
        return requests.get(f"{base}/healthcheck", timeout=1).status_code == 200
    except requests.RequestException:
        return False


def _task(base: str, task_id: str) -> dict:
    tasks = requests.get(f"{base}/api/tasks", timeout=5).json()
    return tasks.get(task_id) or {}


def test_flower_shows_waiting_running_and_deleted_members(flower, proj):
    base, d = flower
    r = proj.history()
    thread = tid("flower")
    first = proj.record.delay(thread, "first", sleep=3)
    waiting = proj.record.delay(thread, "waiting")
    doomed = proj.record.delay(thread, "doomed")
    # Members still in the gate are known to Flower from the task-sent event at gate entry.
    wait_for(lambda: _task(base, waiting.id).get("state") == "PENDING", what="waiting in flower")
    assert f"thread='{thread}'" in _task(base, waiting.id)["kwargs"]
    wait_for(lambda: _task(base, first.id).get("state") == "STARTED", what="first started")
    # A member deleted from the gate shows as REVOKED.
    assert Threads(proj.app).delete(doomed.id)
    wait_for(lambda: _task(base, doomed.id).get("state") == "REVOKED", what="doomed revoked")
    assert doomed.state == "REVOKED"
    # So does a member purged from the gate.
    other = tid("flower")
    blocker = proj.record.delay(other, "blocker", sleep=2)
    purged = proj.record.delay(other, "purged")
    wait_for(lambda: _task(base, purged.id).get("state") == "PENDING", what="purged waiting in flower")
    assert Threads(proj.app).purge(other) == 1
    wait_for(lambda: _task(base, purged.id).get("state") == "REVOKED", what="purged revoked")
    assert purged.state == "REVOKED" and blocker.get(timeout=30) == "blocker"
    assert waiting.get(timeout=30) == "waiting"
    wait_for(lambda: _task(base, waiting.id).get("state") == "SUCCESS", what="waiting succeeded")
    assert starts(r, thread) == ["first", "waiting"]
    # No phantom worker: the client's events (its node name is gen<pid>@host) never made one.
    workers = requests.get(f"{base}/api/workers", timeout=10).json()
    known = set(workers) | {
        t.get("worker") for t in requests.get(f"{base}/api/tasks", timeout=5).json().values()
    }
    known.discard(None)
    assert any(name.startswith("w-") for name in known), known
    assert not any(name.startswith("gen") for name in known), known
    assert _task(base, doomed.id)["worker"].startswith(("w-", "shared-"))


def test_flower_shows_a_restarted_member_retried_then_its_new_run(flower, proj):
    """A dead member restarted while its thread is busy: Flower shows it retried (RETRY) while it
    waits, then its new run.  It showed the first run's FAILURE until the new run ended (a
    ready state outranks task-received and task-started in Flower's state)."""
    base, d = flower
    r = proj.history()
    thread = tid("flower-restart")
    go = f"go:{thread}"
    r.set(f"flaky:{thread}", 1)
    dying = proj.flaky.delay(thread, "dies")
    wait_for(lambda: _task(base, dying.id).get("state") == "FAILURE", what="its death in flower")
    wait_for(lambda: dying.id in {x.task_id for x in Threads(proj.app).dead()}, what="its dead letter")
    blocker = proj.record.delay(thread, "blocker", until=go)
    wait_for(lambda: _task(base, blocker.id).get("state") == "STARTED", what="the blocker started")
    r.delete(f"flaky:{thread}")
    Threads(proj.app).restart(dying.id)
    # This process still forks: the announcement waits for no reply (a broadcast with replies
    # can leave its reply consumer's BRPOP on a pooled broker connection, which a forked child's
    # kombu cleanup then waits on: a ping-based announcement hung forked children in CI).
    child = multiprocessing.get_context("fork").Process(target=sys.exit, args=(0,), daemon=True)
    child.start()
    child.join(20)
    assert child.exitcode == 0
    wait_for(lambda: _task(base, dying.id).get("state") == "RETRY", what="the restarted member retried")
    assert Threads(proj.app).get(thread).waiting[0].task_id == dying.id  # it waits still
    r.set(go, 1)
    wait_for(
        lambda: _task(base, dying.id).get("state") == "SUCCESS", what="its new run's success", timeout=30
    )
    assert proj.app.backend.get_task_meta(dying.id, cache=False)["status"] == "SUCCESS"
    assert _task(base, dying.id)["worker"].startswith("w-")
