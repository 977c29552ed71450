"""Every snippet of README.md runs as written: its quick start on a real worker and beat, its calls,
its CLI lines and its ``Threads`` block, against a redis-server of the test's own (the snippets'
``localhost:6379`` is pointed there, nothing else changes); and once more in a new virtual
environment holding only what the README's install line brings."""

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


def _start(
    cmd: str, cwd: Path, env: dict[str, str], log: Path, port: int, python: str
) -> subprocess.Popen[bytes]:
    args = _local(cmd, port).split()
    if args[:3] == ["celery", "-A", "shop"]:
        args = [python, "-m", *args]
    if "beat" in args:
        args += ["-s", str(Path(tempfile.mkdtemp()) / "schedule")]
    return subprocess.Popen(
        args, cwd=cwd, env=env, stdout=open(log, "wb"), stderr=subprocess.STDOUT, start_new_session=True
    )


def _wait_for(log: Path, needle: str, proc: subprocess.Popen[bytes], timeout: float = 60) -> None:
    """Until the log of ``proc`` shows ``needle``; a process that exited fails at once."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if needle in log.read_text(errors="replace"):
            return
        if proc.poll() is not None:
            break
        time.sleep(0.1)
    tail = log.read_text(errors="replace")[-3000:]
    raise AssertionError(f"{needle!r} not in {log.name} (exit status {proc.poll()}):\n{tail}")


def _run_python(code: str, cwd: Path, env: dict[str, str], python: str = sys.executable) -> str:
    done = subprocess.run([python, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"snippet failed:\n{code}\n{done.stdout}\n{done.stderr}"
    return done.stdout


@pytest.fixture
def installed(shop) -> tuple[Path, dict[str, str], RedisServer, str]:
    """``shop`` with a Python of its own: a new virtual environment where the README's install
    line, run as written on this checkout, installed the package and nothing else."""
    cwd, env, server = shop
    line = next(
        ln for block in blocks("bash") for ln in block.splitlines() if ln.startswith("pip install /path")
    )
    venv = cwd / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = str(venv / "bin" / "python")
    words = line.split("#")[0].replace("/path/to/celery-threads", str(ROOT)).split()
    done = subprocess.run(
        [python, "-m", *words, "-q", "--disable-pip-version-check"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, f"{line}:\n{done.stdout}\n{done.stderr}"
    own = dict(env, PYTHONPATH=str(cwd))  # shop.py only: the package comes from the venv
    where = _run_python("import celery_threads; print(celery_threads.__file__)", cwd, own, python)
    assert where.startswith(str(venv)), where
    return cwd, own, server, python


def test_the_quick_start_runs_as_written(shop) -> None:
    _quick_start(*shop, sys.executable)


def test_the_quick_start_runs_in_a_new_environment_with_what_the_install_line_brings(installed) -> None:
    """``pip install celery-threads`` is all a user on a Redis broker installs: Celery's Redis
    transport and result backend import what they need (kombu 5.7's needs ``packaging``, which only
    its ``redis`` extra brings; the test environment has it from pytest)."""
    _quick_start(*installed)


def _quick_start(cwd: Path, env: dict[str, str], server: RedisServer, python: str) -> None:
    start = blocks("bash")[1]
    assert "worker" in start and "beat" in start
    logs: dict[str, Path] = {}
    started: dict[str, subprocess.Popen[bytes]] = {}
    try:
        for line in start.strip().splitlines():
            kind = "worker" if " worker" in line else "beat"
            logs[kind] = cwd / f"{kind}.log"
            started[kind] = _start(line.split("#")[0], cwd, env, logs[kind], server.port, python)
        _wait_for(logs["worker"], "ready.", started["worker"])
        _run_python(_local(blocks("python")[1], server.port), cwd, env, python)
        _wait_for(logs["worker"], "settling 10 on acct-1", started["worker"])
        # The CLI lines, each command of them, and the Threads block.
        for line in blocks("bash")[2].strip().splitlines():
            for command in re.sub(r"\[.*?\]", "", line).split("|"):  # options left out
                words = command.split()
                if words[:4] != ["celery", "-A", "shop", "threads"]:
                    words = ["celery", "-A", "shop", "threads", *words]
                if any(w.isupper() for w in words[4:]):
                    continue  # a placeholder (THREAD_ID, TASK_ID)
                done = subprocess.run(
                    [python, "-m", *words],
                    cwd=cwd,
                    env=env,
                    capture_output=True,
                    text=True,
                    timeout=60,
                )
                assert done.returncode in (0, 3), f"{command}:\n{done.stdout}\n{done.stderr}"
        out = _run_python(blocks("python")[2], cwd, env, python)
        assert "ThreadInfo" in out or "None" in out
        worker_log = logs["worker"].read_text(errors="replace")
        assert "Traceback" not in worker_log, worker_log[-3000:]
        assert "Task celery_threads.dispatch" not in worker_log, "the tick logs at DEBUG"
        assert "due task celery_threads" not in logs["beat"].read_text(errors="replace")
    finally:
        for proc in started.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in started.values():
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
