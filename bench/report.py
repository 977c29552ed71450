"""``python -m bench.report FILE [--write DOC]``: render a results file as Markdown.

A results file (``bench/results/<date>-<commit>.json``) holds the last table each ``python -m bench
<name>`` command recorded in it.  This prints the run's machine and a summary of every row that has
a target, then each benchmark's full table; ``--write docs/benchmarks.md`` replaces the part of
that document between its ``<!-- results:begin -->`` and ``<!-- results:end -->`` lines instead.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

from bench.harness import ROOT, fmt, table

BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"
# The order the document presents the benchmarks in; others follow in the file's order.
ORDER = ("throughput", "handoff", "lockretry", "scale", "dispatch")
# The columns of a per-side table (lockretry) the summary quotes.
SIDE_COLUMNS = ("makespan", "x ideal", "wasted", "out of order", "double runs")


def _key(result: dict[str, Any]) -> tuple[int, str]:
    name = result["command"].split()[3] if len(result["command"].split()) > 3 else ""
    return (ORDER.index(name) if name in ORDER else len(ORDER), result["command"])


def _machine(results: list[dict[str, Any]]) -> str:
    """The part of the machine line every table shares (its load average and time differ), with
    every commit the tables name, and whether their ``celery_threads/`` is the same."""
    first = re.sub(r"; load average at start [^;]*; [0-9-]+ [0-9:]+ UTC$", "", results[0]["machine"])
    revisions = list(
        dict.fromkeys(
            m.group(1) for r in results if (m := re.search(r"celery-threads ([^;]*)", r["machine"]))
        )
    )
    if len(revisions) > 1:
        same = _same_package(revisions)
        first = re.sub(
            r"celery-threads [^;]*",
            "celery-threads "
            + ", ".join(revisions)
            + (" (the same celery_threads/)" if same else " (celery_threads/ differs between them)"),
            first,
        )
    return first


def _same_package(revisions: list[str]) -> bool:
    """Whether every one of these commits has the same ``celery_threads/`` (git diff)."""
    import subprocess

    commits = [r.split(" ")[0] for r in revisions]
    if any(" " in r for r in revisions):
        return False  # "+ uncommitted changes"
    for other in commits[1:]:
        done = subprocess.run(
            ["git", "diff", "--quiet", commits[0], other, "--", "celery_threads"],
            cwd=ROOT,
            capture_output=True,
        )
        if done.returncode != 0:
            return False
    return True


def _started(result: dict[str, Any]) -> str:
    match = re.search(r"; ([0-9-]+ [0-9:]+ UTC)$", result["machine"])
    return match.group(1) if match else result["finished"]


def _summary(results: list[dict[str, Any]]) -> str:
    """Every row with a target, one line each, in the tables' order: what was measured against
    what (a per-side table, lockretry's, gives the side's row whose verdict is set)."""
    rows, pairs = [], []
    for result in results:
        header = result["header"]
        v = header.index("verdict") if "verdict" in header else None
        if v is None:
            continue
        if "target" in header:
            t = header.index("target")
            ratio = header.index("ratio") if "ratio" in header else None
            pair = " vs ".join(header[1 : ratio if ratio is not None else t])
            parent = ""
            for row in result["rows"]:
                label = str(row[0])
                if not label.startswith(" "):
                    parent = label
                elif parent:  # a sub-row: "parent: of which ..."
                    label = f"{parent}: {label.strip()}"
                if row[t] in (None, "-"):
                    continue
                values = [c for c in row[1 : ratio if ratio is not None else t] if c not in (None, "-")]
                rows.append(
                    [
                        result["title"],
                        label,
                        " vs ".join(fmt(c) for c in values),
                        fmt(row[ratio]) if ratio is not None else "-",
                        row[t],
                        row[v],
                    ]
                )
                if pair not in pairs:
                    pairs.append(pair)
            continue
        for row in result["rows"]:
            if row[v] in (None, "-"):
                continue
            cells = ", ".join(
                f"{h} {fmt(c)}" for h, c in zip(header[1:v], row[1:v]) if h.startswith(SIDE_COLUMNS)
            )
            target = next(
                (
                    n.split(": ", 1)[1].rstrip(".")
                    for n in result["notes"]
                    if n.startswith(f"target ({row[0]})")
                ),
                "-",
            )
            rows.append([result["title"], row[0], cells, "-", target, row[v]])
    text = table(
        "Targets",
        [],
        ["benchmark", "measure", "measured", "ratio", "target", "verdict"],
        rows,
        ["measured: " + "; ".join(pairs) + "."] if pairs else (),
    )
    return text.replace("\n\n\n", "\n\n")


def render(path: Path) -> str:
    data = json.loads(path.read_text())
    results = sorted(data["results"], key=_key)
    if not results:
        raise SystemExit(f"{path}: no results")
    started = min(_started(r) for r in results)
    finished = max(r["finished"] for r in results)
    try:
        shown = path.resolve().relative_to(ROOT)
    except ValueError:
        shown = path
    out = [
        f"Results file: `{shown}` (rendered by `python -m bench.report {shown}`).  ",
        f"Machine: {_machine(results)}.  ",
        f"Run: {started} to {finished}, one command at a time.",
        "",
    ]
    out += [_summary(results), ""]
    for result in results:
        out += [
            table(
                result["title"],
                [
                    f"command: `{result['command']}`",
                    f"load: {result['load']}; load average at start " + _load(result["machine"]),
                ],
                result["header"],
                result["rows"],
                result["notes"],
            ),
            "",
        ]
    return "\n".join(out).rstrip() + "\n"


def _load(machine: str) -> str:
    match = re.search(r"load average at start ([^;]*); (.*)$", machine)
    return f"{match.group(1)} at {match.group(2)}" if match else "-"


def write(doc: Path, text: str) -> None:
    content = doc.read_text()
    start, end = content.find(BEGIN), content.find(END)
    if start < 0 or end < start:
        raise SystemExit(f"{doc} has no {BEGIN} ... {END} section")
    doc.write_text(
        content[: start + len(BEGIN)] + "\n\n" + text.replace("### ", "#### ") + "\n" + content[end:]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.report",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("file", type=Path, help="a results file (bench/results/*.json)")
    parser.add_argument(
        "--write",
        type=Path,
        metavar="DOC",
        default=None,
        help="replace DOC's results section (e.g. docs/benchmarks.md)",
    )
    args = parser.parse_args(argv)
    text = render(args.file)
    if args.write is not None:
        write(args.write, text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
