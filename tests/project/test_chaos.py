"""Short chaos runs (``python -m tests.chaos``) on each broker: the checker must find nothing.

The run is the command a person would type, in a subprocess; it writes its report as JSON.  Its
own clean-up stops everything it started; a run killed from outside is cleaned up here from the
pids it noted.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import IN_CI, ROOT, rabbitmq_url

KEEPALIVE, TICK, OUTAGE = 8.0, 0.5, 1.5
# keepalive + one dispatcher tick, plus 2 s for Celery's own latencies (a pool child's death is
# noticed by its worker after ~1-2 s; the next member is then received and started).  Windows
# that overlap an outage (the gate's Redis down, no healthy worker) are reported apart.
RECOVERY_BOUND = KEEPALIVE + TICK + 2.0


def _run(
    tmp_path: Path, broker: str, minutes: float, timeout: float, extra: tuple[str, ...] = ()
) -> dict[str, Any]:
    if not (shutil.which("redis-server") or Path("/usr/bin/redis-server").exists()):
        if IN_CI:
            pytest.fail("redis-server is required in CI")
        pytest.skip("redis-server is not available")
    report = tmp_path / "report.json"
    cmd = [
        sys.executable,
        "-m",
        "tests.chaos",
        "--minutes",
        str(minutes),
        "--broker",
        broker,
        "--keepalive",
        str(KEEPALIVE),
        "--dispatch-interval",
        str(TICK),
        "--outage",
        str(OUTAGE),
        "--json",
        str(report),
        "--workdir",
        str(tmp_path / "run"),
        *extra,
    ]
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)  # the run stops what it started, then exits
        output, _ = proc.communicate(timeout=60)
        pytest.fail(f"the chaos run did not finish in {timeout}s:\n{output[-5000:]}")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        _kill_leftovers(tmp_path / "run" / "pids")
    print(output)
    assert report.exists(), f"no report:\n{output[-5000:]}"
    data: dict[str, Any] = json.loads(report.read_text())
    data["output"] = output
    return data


def _kill_leftovers(pid_file: Path) -> None:
    """Celery processes run in sessions of their own: kill any the run could not stop (checking
    that a pid still belongs to one of its processes, as pids are reused)."""
    if not pid_file.exists():
        return
    for pid in {int(line) for line in pid_file.read_text().split()}:
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            cwd = os.readlink(f"/proc/{pid}/cwd")
        except OSError:
            continue
        try:
            if b"tests.support.chaos_tasks" in cmdline:
                os.killpg(pid, signal.SIGKILL)
            elif b"redis-server" in cmdline and "ct-redis-" in cwd:
                os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _assert_clean(data: dict[str, Any], min_members: int) -> None:
    output = data["output"][-6000:]
    assert data["counts"] == {
        "overlaps": 0,
        "bad_endings": 0,
        "order_violations": 0,
        "superseded_started": 0,
        "early_starts": 0,
        "rate_violations": 0,
        "hold_violations": 0,
        "stuck": 0,
        "orphans": 0,
        "result_mismatches": 0,
        "operator_violations": 0,
    }, output
    assert data["ok"], output
    assert data["enqueued"] >= min_members, output
    assert data["faults"]["worker"] >= 2 and data["faults"]["child"] >= 2, output
    assert data["faults"]["redis"] >= 1, output
    assert data["releases_checked"] > 0 and data["waiting_compared"] > 0, output
    assert data["ties_compared"] > 0 and data["schedules_checked"] > 0, output
    assert data["rates_checked"] > 0 and data["holds_checked"] > 0, output
    assert data["results_checked"] >= min_members, output  # every member's stored result read
    assert data["succeeded"] > 0 and data["dead_lettered"] > 0 and data["deleted"] > 0, output
    assert data["superseded"] > 0, output  # coalesce and debounce calls superseded some
    # The operator paused threads (each resumed, but the empty one paused at the end) while the
    # faults happened, and the checker held the attempts against those pauses.
    assert data["operator"]["pauses"] >= 2 and data["paused_checked"] > 0, output
    assert data["recoveries"], f"no recovery was measured:\n{output}"
    worst = max(max(v) for v in data["recoveries"].values())
    assert worst <= RECOVERY_BOUND, f"a thread took {worst}s to move on:\n{output}"


def test_chaos_run_on_the_redis_broker(tmp_path: Path) -> None:
    """The broker is database 1 of the gate's Redis: it goes down with the gate at each restart."""
    data = _run(tmp_path, "redis", minutes=0.5, timeout=180)
    _assert_clean(data, min_members=100)


def test_chaos_run_on_rabbitmq(tmp_path: Path) -> None:
    rabbitmq_url()
    data = _run(tmp_path, "amqp", minutes=0.5, timeout=180)
    _assert_clean(data, min_members=100)


def test_chaos_run_with_a_queue_without_acknowledgements(tmp_path: Path) -> None:
    """Killed workers take the deliveries they held with them, and the broker's restarts lose the
    ones in flight: the gate alone brings every member back."""
    data = _run(tmp_path, "redis", minutes=0.5, timeout=180, extra=("--no-ack",))
    _assert_clean(data, min_members=100)
