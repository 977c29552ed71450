"""Every snippet of README.md runs as written: its quick start on a real worker and beat, its calls,
its CLI lines and its ``Threads`` block, against a redis-server of the test's own (the snippets'
``localhost:6379`` is pointed there, nothing else changes)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import RedisServer, redis_binaries

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README, flags=re.S)


def _local(text: str, port: int) -> str:
    return text.replace("localhost:6379", f"127.0.0.1:{port}")


@pytest.fixture
def shop(tmp_path: Path) -> Iterator[tuple[Path, dict[str, str], RedisServer]]:
    if not redis_binaries():
        pytest.skip("no redis-server")
    server = RedisServer()
    server.start()
    quick = blocks("python")[0]
    assert quick.startswith("# shop.py\n"), "the README's first Python block is shop.py"
    (tmp_path / "shop.py").write_text(_local(quick, server.port))
    env = {k: v for k, v in os.environ.items() if not k.startswith("CT_")}
    env["PYTHONPATH"] = os.pathsep.join((str(tmp_path), str(ROOT)))
    try:
        yield tmp_path, env, server
    finally:
        server.stop(kill=True)
        shutil.rmtree(server.dir, ignore_errors=True)


def _start(cmd: str, cwd: Path, env: dict[str, str], log: Path, port: int) -> subprocess.Popen[bytes]:
    args = _local(cmd, port).split()
    if args[:3] == ["celery", "-A", "shop"]:
        args = [sys.executable, "-m", *args]
    if "beat" in args:
        args += ["-s", str(Path(tempfile.mkdtemp()) / "schedule")]
    return subprocess.Popen(
        args, cwd=cwd, env=env, stdout=open(log, "wb"), stderr=subprocess.STDOUT, start_new_session=True
    )


def _wait_for(log: Path, needle: str, timeout: float = 60) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if needle in log.read_text(errors="replace"):
            return
        time.sleep(0.1)
    raise AssertionError(f"{needle!r} not in {log.name}:\n{log.read_text(errors='replace')[-3000:]}")


def _run_python(code: str, cwd: Path, env: dict[str, str]) -> str:
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, f"snippet failed:\n{code}\n{done.stdout}\n{done.stderr}"
    return done.stdout


def test_the_quick_start_runs_as_written(shop) -> None:
    cwd, env, server = shop
    start = blocks("bash")[1]
    assert "worker" in start and "beat" in start
    procs = []
    try:
        logs = {}
        for line in start.strip().splitlines():
            kind = "worker" if " worker" in line else "beat"
            logs[kind] = cwd / f"{kind}.log"
            procs.append(_start(line.split("#")[0], cwd, env, logs[kind], server.port))
        _wait_for(logs["worker"], "ready.")
        _run_python(_local(blocks("python")[1], server.port), cwd, env)
        _wait_for(logs["worker"], "settling 10 on acct-1")
        # The CLI lines, each command of them, and the Threads block.
        for line in blocks("bash")[2].strip().splitlines():
            for command in re.sub(r"\[.*?\]", "", line).split("|"):  # options left out
                words = command.split()
                if words[:4] != ["celery", "-A", "shop", "threads"]:
                    words = ["celery", "-A", "shop", "threads", *words]
                if any(w.isupper() for w in words[4:]):
                    continue  # a placeholder (THREAD_ID, TASK_ID)
                done = subprocess.run(
                    [sys.executable, "-m", *words],
                    cwd=cwd,
                    env=env,
                    capture_output=True,
                    text=True,
                    timeout=60,
                )
                assert done.returncode in (0, 3), f"{command}:\n{done.stdout}\n{done.stderr}"
        out = _run_python(blocks("python")[2], cwd, env)
        assert "ThreadInfo" in out or "None" in out
        worker_log = logs["worker"].read_text(errors="replace")
        assert "Traceback" not in worker_log, worker_log[-3000:]
        assert "Task celery_threads.dispatch" not in worker_log, "the tick logs at DEBUG"
        assert "due task celery_threads" not in logs["beat"].read_text(errors="replace")
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)


def test_the_policy_snippet_declares_and_supersedes_as_written(shop) -> None:
    """The Policies block, next to shop.py: its tasks declare as written, and a burst of
    ``sync_crm`` calls leaves one waiting member, the others superseded (REVOKED)."""
    cwd, env, _ = shop
    block = blocks("python")[3]
    assert "debounce=" in block and "on_death=" in block
    (cwd / "policies.py").write_text("from shop import ThreadedTask, app\n\n" + block)
    out = _run_python(
        "from celery_threads import Threads\n"
        "from policies import app, post_entry, sync_crm\n"
        "calls = [sync_crm.delay('cust-42') for _ in range(3)]\n"
        "post_entry.delay('acct-9', {'amount': 1})\n"
        "info = Threads(app).get('cust-42')\n"
        "members = ([info.active] if info.active else []) + list(info.waiting)\n"
        "print([m.task_id for m in members] == [calls[-1].id],\n"
        "      [c.state for c in calls[:-1]], Threads(app).get('acct-9') is not None)\n",
        cwd,
        env,
    )
    assert out.split() == ["True", "['REVOKED',", "'REVOKED']", "True"], out
