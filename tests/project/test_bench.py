"""Every benchmark command still runs: ``python -m bench <name> --quick`` exits 0 and prints its table.

Only that it runs and prints: on a shared machine no timing is asserted.  Each run starts its own
redis-server, workers and beat (RabbitMQ for ``--broker amqp``) and stops them before it exits.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench import report
from bench.harness import ROOT, rabbitmq_available, redis_binary

IN_CI = os.environ.get("CI") == "1"


def _missing(what: str) -> None:
    if IN_CI:
        pytest.fail(f"{what} is required in CI")
    pytest.skip(f"{what} is not available")


def _run(module_argv: list[str], timeout: float) -> str:
    """``python -m <module_argv>`` from the repository; its stdout, once it exited 0."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-m", *module_argv],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout}\n{done.stderr[-4000:]}"
    return done.stdout


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "argv",
    [
        ["throughput"],
        ["throughput", "--broker", "amqp"],
        ["throughput", "--threaded-no-ack"],
        ["throughput", "--track-releases"],
        ["handoff"],
        ["lockretry"],
        ["scale"],
        ["dispatch"],
        ["gateunavailable"],
        ["lspage"],
        ["metrics"],
        ["gatecpu", "--against", "HEAD"],
    ],
    ids=lambda argv: "-".join(argv).replace("--broker-", ""),
)
def test_benchmark_runs_and_prints_its_table(argv: list[str], tmp_path: Path) -> None:
    if redis_binary() is None:
        _missing("redis-server")
    if "amqp" in argv and not rabbitmq_available():
        _missing("RabbitMQ on 127.0.0.1:5672")
    results = tmp_path / "results.json"
    out = _run(["bench", *argv, "--quick", "--results", str(results)], timeout=220)
    assert out.startswith(f"### {argv[0]}"), out
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("| "))
    assert lines[header + 1].startswith("|---"), out
    rows = [line for line in lines[header + 2 :] if line.startswith("| ")]
    assert rows, out
    assert "command: `python -m bench " in out and "machine: " in out
    if argv[0] == "gatecpu":  # --against: the fifth side, the one-Redis gate with HEAD's Lua
        assert "command: `python -m bench gatecpu --quick --against HEAD`" in out, out
        assert "the before of a change: the one-Redis side with the gate's Lua of HEAD" in out, out
    if argv == ["scale"] and "gives no DEBUG HTSTATS-KEY" not in out:
        # --quick fills the large case just past a power of two: the growth's path runs too
        assert "tasks hash growing (transient)" in out and "the growth amortized" in out, out
    # The table is recorded in the results file, and bench.report renders the same table from it.
    recorded = json.loads(results.read_text())["results"]
    assert [r["command"] for r in recorded] == [" ".join(["python -m bench", argv[0], "--quick", *argv[1:]])]
    rendered = report.render(results)
    assert out.splitlines()[0] in rendered and lines[header] in rendered, rendered
    assert all(row in rendered for row in rows), rendered


def test_results_file_keeps_one_table_per_command_and_renders_into_a_document(tmp_path: Path) -> None:
    """A command run again replaces its table in the results file; ``--write`` replaces only the
    document's section between the markers."""
    from bench import harness

    path = tmp_path / "results.json"
    entry = {
        "title": "handoff (redis broker)",
        "command": "python -m bench handoff",
        "machine": "2 cores; load average at start 0.10, 0.20, 0.30; 2026-12-05 10:00 UTC",
        "load": "one thread",
        "finished": "2026-12-05 10:01 UTC",
        "header": ["measure", "threaded", "plain", "ratio", "target", "verdict"],
        "rows": [["p50 (ms)", 0.5, 2.5, 0.2, "<= 1.2x", "met"], ["max (ms)", 3.0, None, None, "-", "-"]],
        "notes": ["a note."],
    }
    harness.record_result(path, entry)
    harness.record_result(
        path, {**entry, "command": "python -m bench throughput", "title": "throughput (redis broker)"}
    )
    harness.record_result(path, {**entry, "rows": [["p50 (ms)", 0.6, 2.5, 0.24, "<= 1.2x", "met"]]})
    commands = [r["command"] for r in json.loads(path.read_text())["results"]]
    assert sorted(commands) == ["python -m bench handoff", "python -m bench throughput"]
    text = report.render(path)
    summary = [
        [c.strip() for c in line.split("|")[1:-1]]
        for line in text.splitlines()
        if line.startswith("| handoff (redis broker)")
    ]
    assert summary == [["handoff (redis broker)", "p50 (ms)", "0.60 vs 2.50", "0.24", "<= 1.2x", "met"]], text
    assert text.index("### throughput") < text.index("### handoff (redis broker)"), text
    doc = tmp_path / "doc.md"
    doc.write_text(f"# Title\n\nkept\n\n{report.BEGIN}\nold\n{report.END}\n\nkept too\n")
    report.write(doc, text)
    written = doc.read_text()
    assert "old" not in written and written.startswith("# Title\n\nkept\n")
    assert written.endswith(f"{report.END}\n\nkept too\n") and "#### handoff" in written


@pytest.mark.timeout(120)
@pytest.mark.parametrize("broker", ["redis", "amqp"])
def test_poolcost_runs_and_prints_its_table(broker: str) -> None:
    """The profiling aid behind docs/benchmarks.md's accounting of a threaded task's CPU."""
    if redis_binary() is None:
        _missing("redis-server")
    if broker == "amqp" and not rabbitmq_available():
        _missing("RabbitMQ on 127.0.0.1:5672")
    out = _run(["bench.poolcost", "--broker", broker, "--members", "100", "--repeats", "1"], timeout=100)
    assert out.startswith(f"### poolcost ({broker} broker)"), out
    for part in (
        "plain task: apply_async",
        "claim (pool)",
        "finish (pool)",
        "publish of the next release (pool)",
    ):
        assert part in out, out


@pytest.mark.timeout(120)
def test_callcost_runs_and_prints_its_table() -> None:
    """The profiling aid behind docs/benchmarks.md's figures for a gate call as EVALSHA and as
    FCALL: both ways are measured (a Redis before 7 would fail it: no FCALL column to fill)."""
    if redis_binary() is None:
        _missing("redis-server")
    out = _run(["bench.callcost", "--calls", "100", "--repeats", "1"], timeout=100)
    assert out.startswith("### callcost (gate only)"), out
    for step in ("enqueue", "claim", "finish", "enqueue (coalesce)", "superseding enqueue"):
        row = next(line for line in out.splitlines() if line.startswith(f"| {step}: Redis time per call"))
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert float(cells[1]) > 0 and float(cells[2]) > 0, row
    # --against: a revision's Lua beside this tree's (here the checkout's own HEAD).
    out = _run(["bench.callcost", "--calls", "100", "--repeats", "1", "--against", "HEAD"], timeout=100)
    row = next(line for line in out.splitlines() if line.startswith("| finish: Redis time"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert all(float(c) > 0 for c in cells[1:5]), row


@pytest.mark.timeout(120)
def test_cluster_bench_runs_and_prints_its_table() -> None:
    """bench.cluster: one Redis, a one-node cluster and a 3-master cluster, measured in one run."""
    if redis_binary() is None:
        _missing("redis-server")
    out = _run(["bench.cluster", "--seconds", "1", "--processes", "2"], timeout=100)
    assert out.startswith("### cluster (gate only)"), out
    row = next(line for line in out.splitlines() if line.startswith("| member lives per second"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert all(float(c.replace(",", "")) > 0 for c in cells[1:4]), row
