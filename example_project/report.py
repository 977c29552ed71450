"""The demo's report: a timeline per account, and the checks that matter."""

from __future__ import annotations

import json
from typing import Any

from celery_threads import Threads

from .workload import Story


def timeline(ledger: Any, account: str) -> list[dict[str, Any]]:
    rows = [json.loads(x) for x in ledger.store().lrange(ledger.key("timeline", account), 0, -1)]
    return sorted(rows, key=lambda e: e["at"])


def checks(ledger: Any, story: Story) -> list[tuple[str, list[str]]]:
    """(name, problems) for each check; a check passes when its list is empty."""
    results = [
        ("at most one posting of an account active at once", []),
        ("each posting released in order (earliest scheduled, then arrival)", []),
        ("every posting ended exactly once (succeeded, died, or deleted)", []),
        ("balances exact (no lost update)", []),
        ("no gate keys left", []),
    ]
    overlap, order, ended, balances, keys = (problems for _, problems in results)
    for account in story.accounts:
        events = timeline(ledger, account)
        _check_overlap_and_order(account, events, story, overlap, order)
        _check_endings(account, events, story, ended)
        balance = int(ledger.store().get(ledger.key("balance", account)) or 0)
        if balance != story.expected_total.get(account, 0):
            balances.append(f"{account}: {balance} != {story.expected_total.get(account, 0)}")
    threads = Threads(ledger.app)
    keys.extend(f"thread {t} still exists" for t in threads.ids())
    prefix = ledger.app.conf.threads_key_prefix
    keys.extend(k.decode() for k in ledger.store().scan_iter(match=f"{prefix}:*:t:*"))
    return results


def _check_overlap_and_order(
    account: str, events: list[dict[str, Any]], story: Story, overlap: list[str], order: list[str]
) -> None:
    arrivals = [e for e in story.enqueued if e["account"] == account]
    arrival = {}
    sched = {}
    finished: dict[str, float] = {}
    running = None
    for e in events:
        t, entry, kind = e["at"], e["entry"], e["event"]
        if kind == "start":
            if running is not None and running not in story.deleted:
                overlap.append(f"{entry} started while {running} was running")
            # Who was waiting and due when this one started? None may precede it.
            for a in arrivals:
                other = a["entry"]
                if a["at"] > t or other == entry or other == running:
                    continue
                arrival.setdefault(other, arrivals.index(a))
                sched.setdefault(other, a["at"] + a["countdown"])
            arrival.setdefault(entry, next(i for i, a in enumerate(arrivals) if a["entry"] == entry))
            mine = (sched.get(entry, 0), arrival[entry])
            for other, when in sched.items():
                if other in (entry, running) or other in finished or other in story.deleted:
                    continue
                if when <= t and (when, arrival[other]) < mine and _waiting(other, t, events):
                    order.append(f"{entry} started at {t:.3f} while earlier {other} waited")
            running = entry
        elif kind in ("end", "retry", "failed"):
            if kind == "retry":
                sched[entry] = t + e.get("next_in", 0)
            if kind == "end":
                finished[entry] = t
            if running == entry:
                running = None


def _waiting(entry: str, t: float, events: list[dict[str, Any]]) -> bool:
    """The entry had arrived (or re-entered) and was not done or dead by time t."""
    done = [e for e in events if e["entry"] == entry and e["event"] in ("end", "died") and e["at"] <= t]
    return not done


def _check_endings(account: str, events: list[dict[str, Any]], story: Story, ended: list[str]) -> None:
    for entry in {e["entry"] for e in story.enqueued if e["account"] == account}:
        kinds = [e["event"] for e in events if e["entry"] == entry]
        ends, deaths = kinds.count("end"), kinds.count("died")
        if entry in story.deleted:
            ok = ends == 0 and deaths == 0
        elif entry in story.restarted:
            ok = deaths == 1 and ends == 1
        else:
            ok = ends == 1 and deaths == 0
        if not ok:
            ended.append(f"{entry}: {kinds}")


def render(ledger: Any, story: Story) -> str:
    lines = []
    everything = [e["at"] for a in story.accounts for e in timeline(ledger, a)]
    t0 = min(everything, default=0.0)
    for account in story.accounts:
        events = timeline(ledger, account)
        deleted = [
            {"entry": entry, "event": "deleted", "at": at}
            for entry, at in story.deleted.items()
            if entry.startswith(account + "/")
        ]
        events = sorted(events + deleted, key=lambda e: e["at"])
        if not events:
            continue
        lines.append(f"\n{account}")
        for e in events:
            detail = {k: v for k, v in e.items() if k not in ("entry", "event", "at")}
            extra = " ".join(f"{k}={v}" for k, v in detail.items())
            lines.append(f"  +{e['at'] - t0:7.3f}s  {e['entry']:<22} {e['event']:<8} {extra}")
    lines.append("\nChecks")
    for name, problems in checks(ledger, story):
        lines.append(f"  [{'ok' if not problems else 'FAIL'}] {name}")
        lines.extend(f"        {p}" for p in problems[:10])
    return "\n".join(lines)


def ok(ledger: Any, story: Story) -> bool:
    return all(not problems for _, problems in checks(ledger, story))
