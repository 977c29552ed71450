"""Paged reads: the ``Threads.ids()`` cursor, ``celery threads ls --limit N`` in O(N) reads, and
``forget --all`` in batches.

Each test runs on a redis-server of this module's own, so that ``INFO commandstats`` counts only
the commands the read under test issued (no worker, beat or other test uses that server).
"""

from __future__ import annotations

import json
import os
import pty
import random
import select
import shutil
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from bench.harness import enqueue_many
from celery_threads import Threads
from celery_threads.gate import Gate, make_client
from celery_threads.keys import Keys
from tests.conftest import RedisServer
from tests.operations.test_cli import ROOT, as_json, celery_process, ok
from tests.support.isolated import (
    GATE_DB,
    envelope,
    isolated,
    isolated_env,
    kill_member,
    own_server,
    run_cli,
)

DAY_MS = 86_400_000


@pytest.fixture(scope="module")
def server() -> Iterator[RedisServer]:
    yield from own_server()


@pytest.fixture
def app(proj, server):
    with isolated(proj.app, server) as app:
        yield app


@pytest.fixture
def cli(app, server):
    def run(*args: str) -> Any:
        return run_cli({**isolated_env(server), "COLUMNS": "100"}, *args)

    return run


def gate_on(server: RedisServer, shards: int) -> Gate:
    client = make_client(server.url(GATE_DB))
    client.flushdb()
    return Gate(client, Keys("ct-paging", shards=shards), release_timeout_ms=DAY_MS, keepalive_ms=DAY_MS)


def fill(gate: Gate, threads: list[str]) -> None:
    """Each thread gets a member a day ahead (the due index); every other one also gets a member
    due now, released at once (the leases index)."""
    rows = [(t, f"{t}-later", DAY_MS) for t in threads]
    rows += [(t, f"{t}-now", 0) for t in threads[::2]]
    enqueue_many(gate, rows, envelope("x", "t"))


def commands(server: RedisServer) -> int:
    """Commands the server ran so far (those inside scripts included), this INFO left out (the
    new connection's CLIENT SETINFO are counted: a test allows for them)."""
    stats = redis.Redis(port=server.port).info("commandstats")
    return sum(int(v["calls"]) for k, v in stats.items() if k != "cmdstat_info")


def calls_of(server: RedisServer, command: str) -> int:
    stats = redis.Redis(port=server.port).info("commandstats")
    return int(stats.get(f"cmdstat_{command}", {}).get("calls", 0))


# -- the cursor -------------------------------------------------------------------------------


@pytest.mark.parametrize("threads", [40, 1500])  # small indexes are listpacks, large hash tables
def test_ids_lists_every_thread_once_across_shards_and_pages(server, threads):
    gate = gate_on(server, shards=3)
    names = [f"th-{i}" for i in range(threads)]
    fill(gate, names)
    indexes = [(gate.client.zcard(s.due), gate.client.zcard(s.leases)) for s in gate.keys.all_shards()]
    assert all(due and leases for due, leases in indexes), indexes
    for page in (1, 7, 500):
        listed = list(gate.reads.thread_ids(page))
        assert sorted(listed) == sorted(names), page


def test_ids_while_threads_move_between_the_indexes(server):
    """Threads released (due -> leases) and ended with a member left (leases -> due) between the
    cursor's pages: each is listed exactly once."""
    gate = gate_on(server, shards=1)
    names = [f"mv-{i}" for i in range(800)]
    fill(gate, names)
    active = {t: f"{t}-now" for t in names[::2]}
    rng, moved, n = random.Random(7), 0, 0

    def move(thread: str) -> None:
        nonlocal n
        if thread in active:
            assert gate.delete(active.pop(thread), thread_id=thread).status
        else:
            n += 1
            task = f"{thread}-again-{n}"
            assert gate.enqueue(thread, task, envelope(task, thread)).release is not None
            active[thread] = task

    listed = Counter()
    for thread_id in gate.reads.thread_ids(page=10):
        listed[thread_id] += 1
        for thread in rng.sample(names, 3):
            move(thread)
            moved += 1
    assert moved > 1000
    assert set(listed) == set(names)
    assert [t for t, c in listed.items() if c > 1] == []


def test_threads_ids_and_summaries_stop_reading_once_the_caller_stops(app, server):
    fill(Threads(app).gate, [f"ids-{i}" for i in range(3000)])
    t = Threads(app)
    before = commands(server)
    first = [next(iter(t.ids(page=5))) for _ in range(3)]
    assert len(first) == 3 and commands(server) - before <= 3 * 4 + 3  # MULTI, 2 ZSCAN, EXEC
    summaries = t.summaries(limit=5)
    before = commands(server)
    taken = [next(summaries) for _ in range(5)]
    assert len({s.thread_id for s in taken}) == 5
    assert commands(server) - before < 60


# -- ls --limit -------------------------------------------------------------------------------


def test_ls_limit_reads_n_threads_whatever_the_gates_size(app, server, cli):
    gate = Threads(app).gate
    fill(gate, [f"ls-{i:05d}" for i in range(200)])
    ok(cli("ls", "--limit", "5"))  # connects, loads the scripts

    def cost(*args: str) -> tuple[int, str]:
        before = commands(server)
        out = ok(cli(*args))
        return commands(server) - before, out

    small_text, _ = cost("ls", "--limit", "5")
    small_json, _ = cost("ls", "--limit", "5", "--json")
    fill(gate, [f"ls-{i:05d}" for i in range(200, 5000)])
    large_text, out = cost("ls", "--limit", "5")
    large_json, data = cost("ls", "--limit", "5", "--json")
    everything, _ = cost("ls", "--json")

    assert everything > 5000  # the count sees a full read
    assert large_text <= small_text + 10 and large_json <= small_json + 10
    assert large_text < 100

    lines = out.splitlines()
    assert len(lines) == 1 + 5 + 1
    hint = "`celery -A tests.support.proj threads stats` counts them"
    assert lines[-1] == f"first 5 threads shown; more exist ({hint})"
    rows = json.loads(data)
    assert len(rows) == 5 and len({r["thread_id"] for r in rows}) == 5
    assert all(r["thread_id"].startswith("ls-") and r["members"] >= 1 for r in rows)


def test_ls_limit_footer_counts_when_all_were_shown(app, cli):
    fill(Threads(app).gate, ["few-a", "few-b", "few-c"])
    assert ok(cli("ls", "--limit", "3")).splitlines()[-1] == "3 threads"
    assert ok(cli("ls", "--limit", "10")).splitlines()[-1] == "3 threads"
    assert len(as_json(cli("ls", "--limit", "2", "--json"))) == 2
    assert ok(cli("ls", "--limit", "2", "--sort", "id")).splitlines()[-1] == ("3 threads (first 2 shown)")


def test_ls_help_says_sorting_reads_every_thread(cli):
    assert "Sorting reads every thread" in " ".join(ok(cli("ls", "--help")).split())


# -- forget --all -----------------------------------------------------------------------------


def kill_many(gate: Gate, n: int, prefix: str = "dead") -> list[str]:
    ids = [f"{prefix}-{i}" for i in range(n)]
    for task_id in ids:
        kill_member(gate, f"th-{task_id}", task_id)
    return ids


def test_forget_all_works_in_batches(app, server, cli):
    gate = Threads(app).gate
    ids = kill_many(gate, 1100)
    zrem = calls_of(server, "zrem")
    data = as_json(cli("forget", "--all", "--yes", "--json"))
    assert sorted(data["forgotten"]) == sorted(ids)
    assert calls_of(server, "zrem") - zrem == 3  # 500 + 500 + 100
    assert gate.reads.dead_count() == 0 and gate.client.hlen(gate.keys.shard(0).dead_records) == 0


def test_forget_all_forgets_the_deaths_before_it_started(app):
    t = Threads(app)
    kill_many(t.gate, 7)
    batches = t.forget_all(batch=3)
    assert len(next(batches)) == 3
    kill_member(t.gate, "th-late", "died-meanwhile")
    assert [len(b) for b in batches] == [3, 1]
    assert [d.task_id for d in t.dead()] == ["died-meanwhile"]
    with pytest.raises(ValueError):
        next(t.forget_all(batch=0))


def test_forget_all_shows_a_progress_bar_on_a_terminal_only(app, server):
    gate = Threads(app).gate
    kill_many(gate, 3)
    env = {**isolated_env(server), "COLUMNS": "100"}
    main, child = pty.openpty()
    script = shutil.which("celery") or ""
    command = [script] if script else [sys.executable, "-m", "celery"]
    proc = subprocess.Popen(
        [*command, "-A", "tests.support.proj", "threads", "forget", "--all", "-y"],
        env={**os.environ, **env, "PYTHONPATH": str(ROOT)},
        cwd=ROOT,
        stdin=subprocess.DEVNULL,
        stdout=child,
        stderr=child,
    )
    os.close(child)
    out = b""
    while True:
        ready, _, _ = select.select([main], [], [], 60)
        if not ready:
            break
        try:
            chunk = os.read(main, 4096)
        except OSError:  # the child closed its end
            break
        if not chunk:
            break
        out += chunk
    os.close(main)
    assert proc.wait(60) == 0, out
    assert b"Forgetting dead tasks" in out and b"Forgot 3 dead tasks." in out

    kill_many(gate, 2, "piped")
    done = celery_process(env, "forget", "--all", "-y")
    assert done.returncode == 0, done.stderr
    assert done.stdout == "Forgot 2 dead tasks.\n" and "Forgetting" not in done.stderr
