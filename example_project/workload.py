"""The demo's workload: what it posts, and the scripted incidents."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from celery_threads import Threads


@dataclass
class Story:
    accounts: list[str]
    entries: dict[str, str] = field(default_factory=dict)  # task id -> entry
    enqueued: list[dict[str, Any]] = field(default_factory=list)  # in arrival order
    deleted: dict[str, float] = field(default_factory=dict)  # entry -> server time
    restarted: list[str] = field(default_factory=list)
    expected_total: dict[str, int] = field(default_factory=dict)  # account -> final balance


def run(ledger: Any, accounts: int, postings: int, timeout: float = 120) -> Story:
    names = [f"acct-{i + 1}" for i in range(accounts)]
    story = Story(names)
    threads = Threads(ledger.app)
    r = ledger.store()
    r.sadd(ledger.key("frozen"), names[-1])  # the last account is frozen: one dies

    def post(account: str, entry: str, amount: int, **options: Any) -> Any:
        kwargs = {k: options.pop(k) for k in ("fail_times", "seconds") if k in options}
        result = ledger.post.apply_async((account, entry, amount), kwargs, **options)
        r.hset(ledger.key("entries"), result.id, entry)
        story.entries[result.id] = entry
        story.enqueued.append(
            {
                "account": account,
                "entry": entry,
                "task_id": result.id,
                "at": ledger.server_time(),
                "countdown": options.get("countdown", 0),
            }
        )
        return result

    for n in range(postings):
        for i, account in enumerate(names[:-1]):
            fail = 1 if (n == 1 and i % 2 == 0) else 0  # a flaky bank link: one retry
            post(account, f"{account}/p{n}", 10, fail_times=fail)
            story.expected_total[account] = story.expected_total.get(account, 0) + 10
    scheduled = names[0]
    post(scheduled, f"{scheduled}/scheduled", 5, countdown=2.0)  # runs 2 s from now
    story.expected_total[scheduled] += 5
    dying = post(names[-1], f"{names[-1]}/frozen", 7)
    victim_account = names[1]
    victim = post(victim_account, f"{victim_account}/slow", 1000, seconds=30)
    post(victim_account, f"{victim_account}/after-slow", 1)  # promoted when slow is deleted
    story.expected_total[victim_account] += 1

    # Deleted while running: wait for the slow posting to start, then delete it.
    deadline = time.time() + timeout
    while time.time() < deadline:
        info = threads.get(victim_account)
        if info and info.active and info.active.task_id == victim.id and info.active.state == "RUNNING":
            break
        time.sleep(0.05)
    time.sleep(0.3)
    threads.delete(victim.id)
    story.deleted[f"{victim_account}/slow"] = ledger.server_time()

    # The frozen account's posting dies after its retries; unfreeze it and restart it.
    while time.time() < deadline and dying.id not in [d.task_id for d in threads.dead()]:
        time.sleep(0.1)
    r.srem(ledger.key("frozen"), names[-1])
    threads.restart(dying.id)
    story.restarted.append(f"{names[-1]}/frozen")
    story.enqueued.append(
        {
            "account": names[-1],
            "entry": f"{names[-1]}/frozen",
            "task_id": dying.id,
            "at": ledger.server_time(),
            "countdown": 0,
        }
    )
    story.expected_total[names[-1]] = 7

    while time.time() < deadline and any(threads.get(a) for a in names):
        time.sleep(0.1)
    return story
