"""``python -m bench <name> [--quick] [--repeats N] [--results FILE] [...]``: run one benchmark, print
its table and record it in a results file (``python -m bench.report FILE`` renders one)."""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

from bench import harness

BENCHMARKS = {
    "throughput": "no-op threaded vs plain tasks through a prefork worker (2 processes)",
    "handoff": "end of one member -> start of the next, vs plain publish-to-start latency",
    "lockretry": "Redis lock + self.retry(countdown=0.5) vs threaded tasks, 4 processes",
    "scale": "gate cost of a member's life with 1,000 vs 1,000,000 waiting members",
    "dispatch": "dispatcher tick cost, and countdown lateness vs plain Celery",
    "lspage": "celery threads ls --limit 20 at 20,000 and 1,000,000 threads, before/after the cursor",
    "metrics": "a celery threads metrics scrape on a gate of 1,000 and of 1,000,000 waiting members",
    "gatecpu": "the gate's Redis and worker CPU per task: one Redis vs a 3-master cluster, and "
    "plain Celery's broker",
    "gateunavailable": "time for a producer's apply_async to raise GateUnavailable on a dead gate",
}


def _repeats(module: object) -> int:
    """A benchmark's default repeats: its ``REPEATS``, else 3."""
    return int(getattr(module, "REPEATS", 3))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    sub = parser.add_subparsers(dest="name", required=True, metavar="name")
    for name, summary in BENCHMARKS.items():
        module = importlib.import_module(f"bench.{name}")
        p = sub.add_parser(
            name,
            help=summary,
            description=module.__doc__,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        p.add_argument(
            "--quick",
            action="store_true",
            help="shrink the run to seconds (CI: checks that it runs and prints)",
        )
        p.add_argument(
            "--results",
            default=None,
            metavar="FILE",
            help="record the table in this JSON file (default: "
            "bench/results/<date>-<commit>.json; none with --quick); "
            "'-' records nothing; render with python -m bench.report FILE",
        )
        p.add_argument(
            "--repeats",
            type=int,
            default=None,
            help=f"repeats of each side (default: {_repeats(module)}, or 1 with --quick)",
        )
        module.add_arguments(p)
    args = parser.parse_args(argv)
    module = importlib.import_module(f"bench.{args.name}")
    if args.repeats is None:
        args.repeats = 1 if args.quick else _repeats(module)
    if args.results != "-" and (args.results or not args.quick):
        harness.RESULTS_FILE = Path(args.results) if args.results else harness.default_results_file()
    return int(module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
