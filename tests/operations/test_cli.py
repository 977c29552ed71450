"""``celery -A tests.support.proj threads ...``: through click's CliRunner, and as a real subprocess.

No worker runs: the first member of each thread is released to the broker and stays RELEASED, the
others wait.  Dead letters and stuck threads are written through the Gate.  Everything runs on
private databases (see tests/support/isolated.py).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
from celery.bin.celery import celery as celery_command
from click.testing import CliRunner, Result

from celery_threads import Threads
from tests.support.helpers import tid
from tests.support.isolated import (
    envelope,
    gate_in_the_past,
    isolated_env,
    kill_member,
    pointed_at,
    run_cli,
)

ROOT = Path(__file__).resolve().parents[2]
HOUR = 3600.0


@pytest.fixture
def app(isolated_app):
    return isolated_app


@pytest.fixture
def env(redis_server):
    return {**isolated_env(redis_server), "COLUMNS": "80"}


@pytest.fixture
def cli(app, env):
    """Run ``celery -A tests.support.proj threads ARGS`` in this process."""

    def run(*args: str, input: str | None = None) -> Result:
        result = run_cli(env, *args, input=input)
        assert "Traceback" not in result.output
        return result

    return run


def ok(result: Result) -> str:
    assert result.exit_code == 0, result.output
    return result.stdout


def as_json(result: Result):
    return json.loads(ok(result))


def fits(text: str, width: int = 80) -> None:
    too_wide = [line for line in text.splitlines() if len(line) > width]
    assert not too_wide, "\n".join(too_wide)


def running(app, thread: str, worker: str = "w1@box") -> str:
    """Claim the thread's released member as a worker would; returns its task id."""
    gate = Threads(app).gate
    active = gate.reads.snapshot(thread).active
    assert gate.claim(thread, active["task"], active["token"], worker) == 1
    return active["task"]


# -- ls -------------------------------------------------------------------------------------


def test_ls_lists_threads_with_members_active_member_and_next_head(proj, cli):
    busy, idle = tid("cli-busy"), tid("cli-idle")
    first = proj.record.delay(busy, "m0").id
    proj.record.delay(busy, "m1")
    proj.record.apply_async((idle, "later"), countdown=60)

    out = ok(cli("ls"))
    lines = out.splitlines()
    assert lines[0].split() == [
        "MEMBERS",
        "STATE",
        "ACTIVE",
        "FOR",
        "NEXT",
        "ELIGIBLE",
        "ACTIVE",
        "TASK",
        "THREAD",
    ]
    rows = {line.split()[-1]: line.split() for line in lines[1:-1]}
    assert rows[busy][:2] == ["2", "RELEASED"]
    assert rows[busy][-2] == first  # whole, to be pasted into `show` or `delete`
    assert rows[idle][:3] == ["1", "-", "-"] and rows[idle][3] == "in"
    assert rows[idle][-2] == "-"
    assert lines[-1] == "2 threads"

    data = {row["thread_id"]: row for row in as_json(cli("ls", "--json"))}
    assert (data[busy]["members"], data[busy]["active_task"], data[busy]["active_state"]) == (
        2,
        first,
        "RELEASED",
    )
    assert data[idle]["active_task"] is None and 55 < -data[idle]["head_age"] <= 60
    datetime.fromisoformat(data[idle]["next_eligible_at"])


def test_ls_sorts_and_limits(proj, cli):
    small, big, middle = tid("cli-a"), tid("cli-b"), tid("cli-c")
    for thread, n in ((small, 1), (big, 3), (middle, 2)):
        for i in range(n):
            proj.record.delay(thread, f"m{i}")

    by_members = as_json(cli("ls", "--sort", "members", "--json"))
    assert [row["thread_id"] for row in by_members] == [big, middle, small]
    by_id = as_json(cli("ls", "--sort", "id", "--limit", "2", "--json"))
    assert [row["thread_id"] for row in by_id] == sorted([small, big, middle])[:2]
    out = ok(cli("ls", "--sort", "members", "--limit", "1"))
    assert big in out and small not in out
    assert out.splitlines()[-1] == "3 threads (first 1 shown)"
    assert cli("ls", "--sort", "size").exit_code == 2


def test_ls_sorts_by_how_long_the_active_member_has_been_active(app, cli):
    young, old = tid("cli-young"), tid("cli-old")
    for thread, seconds in ((young, 60), (old, 600)):
        gate_in_the_past(app, seconds).enqueue(thread, f"t-{thread}", envelope("x", thread))
    rows = as_json(cli("ls", "--sort", "age", "--json"))
    assert [row["thread_id"] for row in rows] == [old, young]
    assert rows[0]["active_for"] >= 600


def test_ls_without_threads(cli):
    assert ok(cli("ls")) == "No threads.\n"
    assert as_json(cli("ls", "--json")) == []


# -- show -----------------------------------------------------------------------------------


def test_show_lists_the_active_member_then_waiting_ones_in_release_order(proj, cli):
    thread = tid("cli-show")
    now = datetime.now(timezone.utc)
    first = proj.record.delay(thread, "first").id
    late = proj.record.apply_async((thread, "late"), eta=now + timedelta(seconds=60)).id
    early = proj.record.apply_async((thread, "early"), eta=now + timedelta(seconds=30)).id

    out = ok(cli("show", thread))
    assert out.startswith(f"Thread {thread}: 3 members")
    assert f"task id           {first}" in out
    assert "tests.support.proj.record" in out and "RELEASED" in out and "release deadline" in out
    table = out[out.index("Waiting members") :].splitlines()
    assert table[1].split() == ["#", "SCHEDULED", "AT", "ARRIVAL", "RETRIES", "TASK", "ID"]
    rows = [line.split() for line in table[2::2]]
    assert [(row[0], row[-1]) for row in rows] == [("1", early), ("2", late)]
    assert [row[2:4] for row in rows] == [["3", "0"], ["2", "0"]]
    # Under each member, its task and what it was called with.
    calls = table[3::2]
    assert calls[0].startswith("    tests.support.proj.record (") and "'early'" in calls[0]
    assert "'late'" in calls[1]
    assert "'first'" in out[: out.index("Waiting members")]

    data = as_json(cli("show", thread, "--json"))
    assert (data["thread_id"], data["members"]) == (thread, 3)
    assert data["active"]["task_id"] == first and data["active"]["state"] == "RELEASED"
    assert [(m["task_id"], m["arrival"], m["retries"]) for m in data["waiting"]] == [
        (early, 3, 0),
        (late, 2, 0),
    ]
    assert datetime.fromisoformat(data["waiting"][0]["scheduled_at"]) < datetime.fromisoformat(
        data["waiting"][1]["scheduled_at"]
    )


def test_show_reads_the_first_waiting_members_only(proj, app, cli):
    """A thread of many waiting members: show lists the first ``--limit`` (100 by default) in
    release order, says how many more wait, and counts them all; Redis reads only the records
    shown (a thread of 20,000 held the gate's Redis for 0.2 s, and filled the terminal)."""
    thread = tid("cli-show-many")
    first = proj.record.delay(thread, "first").id
    waiting = [proj.record.delay(thread, f"w{i}").id for i in range(5)]

    out = ok(cli("show", thread, "--limit", "2"))
    assert out.startswith(f"Thread {thread}: 6 members")
    assert "Waiting members: the first 2 of 5, in release order" in out
    shown = [line.split()[-1] for line in out[out.index("Waiting members") :].splitlines()[2:6:2]]
    assert shown == waiting[:2]
    assert not any(task_id in out for task_id in waiting[2:])
    assert out.splitlines()[-1] == "... and 3 more waiting; --limit 0 lists them all"

    result = cli("show", thread, "--limit", "2", "--json")
    data = json.loads(result.stdout)
    assert data["members"] == 6 and data["waiting_total"] == 5
    assert [m["task_id"] for m in data["waiting"]] == waiting[:2]
    assert result.stderr == "the first 2 of 5 waiting members listed; --limit 0 lists them all\n"

    everything = as_json(cli("show", thread, "--limit", "0", "--json"))
    assert [m["task_id"] for m in everything["waiting"]] == waiting and everything["members"] == 6
    assert as_json(cli("show", thread, "--json"))["waiting_total"] == 5  # under the default 100

    status = Threads(app).status(thread, limit=1)
    assert status is not None and status.active is not None and status.active.task_id == first
    assert [m.task_id for m in status.waiting] == waiting[:1] and status.members == 6
    snapshot = Threads(app).reads.snapshot(thread, 1)
    assert snapshot is not None and set(snapshot.records) == {first, waiting[0]}


def test_show_of_a_task_id_names_its_thread(proj, cli):
    """A task id given where a thread id goes: "no thread" said nothing of the member it is."""
    thread = tid("cli-show-task")
    member = proj.record.apply_async((thread, "x"), countdown=60).id
    result = cli("show", member)
    assert result.exit_code == 1
    assert f"is the task id of a member of thread '{thread}'" in result.stderr
    assert f"threads show {thread}" in result.stderr
    # An empty thread id: the usage error of a call, without "nothing was stored or sent".
    empty = cli("show", "")
    assert empty.exit_code == 2 and "thread id is empty" in empty.stderr
    assert "stored or sent" not in empty.stderr


def test_show_a_running_member_names_its_worker_and_lease_expiry(proj, app, cli):
    thread = tid("cli-run")
    proj.record.delay(thread, "a")
    task = running(app, thread, "w42@box")

    out = ok(cli("show", thread))
    assert "RUNNING" in out and "w42@box" in out and "lease expires" in out
    active = as_json(cli("show", thread, "--json"))["active"]
    assert (active["task_id"], active["state"], active["worker"]) == (task, "RUNNING", "w42@box")
    assert 25 < active["expires_in"] <= 30
    lease_end = datetime.fromisoformat(active["deadline"])
    assert lease_end - datetime.fromisoformat(active["claimed_at"]) == timedelta(seconds=30)


def test_show_a_lapsed_lease(app, cli):
    thread = tid("cli-lapsed")
    past = gate_in_the_past(app, HOUR)
    token = past.enqueue(thread, "lapsed", envelope("lapsed", thread)).release.token
    past.claim(thread, "lapsed", token, "gone@box")
    assert "LAPSED" in ok(cli("show", thread))


def test_show_an_unknown_thread_says_what_to_do(cli):
    result = cli("show", "no-such-thread")
    assert result.exit_code == 1
    assert "no thread 'no-such-thread'" in result.stderr and "threads ls" in result.stderr
    assert result.stdout == ""


# -- delete ---------------------------------------------------------------------------------


def test_delete_a_waiting_member(proj, app, cli):
    thread = tid("cli-del")
    proj.record.delay(thread, "a")
    waiting = proj.record.delay(thread, "b").id
    assert ok(cli("delete", waiting)) == f"Deleted member {waiting} of thread {thread}.\n"
    assert Threads(app).get(thread).waiting == []
    result = cli("delete", waiting)
    assert result.exit_code == 1 and "no thread has a member" in result.stderr


def test_delete_the_active_member_promotes_the_next(proj, app, cli):
    thread = tid("cli-del")
    first = proj.record.delay(thread, "a").id
    second = proj.record.delay(thread, "b").id
    assert as_json(cli("delete", first, "--json")) == {"task_id": first, "thread_id": thread, "deleted": True}
    info = Threads(app).get(thread)
    assert (info.active.task_id, info.active.state) == (second, "RELEASED")


def test_delete_an_unknown_task_says_what_to_do(cli, app):
    result = cli("delete", "no-such-task")
    assert result.exit_code == 1
    assert "no-such-task" in result.stderr and "threads show" in result.stderr
    kill_member(Threads(app).gate, tid("cli-dead"), "dead-one")
    result = cli("delete", "dead-one")
    assert result.exit_code == 1 and "dead-letter store" in result.stderr


# -- dead, restart, forget ------------------------------------------------------------------


def test_dead_lists_the_store_newest_last_with_exceptions(app, cli):
    gate = Threads(app).gate
    first, second = tid("cli-dead"), tid("cli-dead")
    kill_member(gate, first, "dead-older", "ValueError: older exploded", retries=2)
    time.sleep(0.01)  # died_at has millisecond resolution; ties are ordered by task id
    kill_member(gate, second, "dead-newer", "KeyError: 'newer'\nmore text")

    out = ok(cli("dead"))
    lines = out.splitlines()
    assert lines[0].split() == ["DIED", "AT", "TASK", "ID", "THREAD"]
    assert lines[1].split()[1:] == ["dead-older", first]
    assert lines[2] == "    tests.support.proj.record, 2 retries: ValueError: older exploded"
    assert lines[3].split()[1:] == ["dead-newer", second]
    assert lines[4] == "    tests.support.proj.record, 0 retries: KeyError: 'newer'"
    assert lines[5].startswith("2 dead tasks")

    data = as_json(cli("dead", "--json"))
    assert [d["task_id"] for d in data] == ["dead-older", "dead-newer"]
    assert data[0] | {"died_at": None} == {
        "task_id": "dead-older",
        "thread_id": first,
        "name": "tests.support.proj.record",
        "args": [first, "x"],
        "kwargs": {},
        "retries": 2,
        "exception": "ValueError: older exploded",
        "died_at": None,
    }


def test_dead_lists_the_latest_deaths_up_to_a_limit(app, cli):
    threads = Threads(app)
    thread = tid("cli-dead-limit")
    for i in range(5):
        kill_member(threads.gate, thread, f"dead-{i}", f"ValueError: {i}")
        time.sleep(0.002)  # distinct died_at milliseconds
    everything = [f"dead-{i}" for i in range(5)]
    assert [d.task_id for d in threads.dead()] == everything
    assert [d.task_id for d in threads.dead(limit=2)] == ["dead-3", "dead-4"]  # oldest first
    assert [d.task_id for d in threads.dead(limit=9)] == everything
    assert threads.dead(limit=0) == [] and threads.gate.reads.dead_count() == 5
    with pytest.raises(ValueError):
        threads.dead(limit=-1)

    lines = ok(cli("dead", "--limit", "2")).splitlines()
    assert [line.split()[1] for line in lines[1:5:2]] == ["dead-3", "dead-4"]
    assert lines[-1].startswith("the 2 latest of 5 dead tasks") and "--limit 0" in lines[-1]
    assert ok(cli("dead", "--limit", "0")).splitlines()[-1].startswith("5 dead tasks")
    cut = cli("dead", "--limit", "3", "--json")
    assert [d["task_id"] for d in as_json(cut)] == everything[2:]
    # The list a script reads says nothing of the two left out: stderr does.
    assert cut.stderr == "the 3 latest of 5 dead tasks listed; --limit 0 lists them all\n"
    assert cli("dead", "--limit", "5", "--json").stderr == ""


def test_dead_when_empty(cli):
    assert ok(cli("dead")) == "The dead-letter store is empty.\n"
    assert as_json(cli("dead", "--json")) == []


def _leave_marker(url: str, key: str) -> str:
    """What unpickling a :class:`_Unpickled` runs: it leaves ``key`` in Redis."""
    import redis

    redis.Redis.from_url(url).set(key, 1)
    return "unpickled"


class _Unpickled:
    def __init__(self, url: str, key: str) -> None:
        self.url, self.key = url, key

    def __reduce__(self):
        return _leave_marker, (self.url, self.key)


def test_dead_never_decodes_a_content_type_the_app_does_not_accept(app, cli):
    """A dead task stored as pickle, in an app that accepts only JSON (Celery's default): its
    arguments are not unpickled, neither by Threads.dead() nor by `celery threads dead`, and come
    back empty.  Once the app accepts pickle, they are decoded (the marker proves it runs)."""
    import redis

    from celery_threads.publish import encode_envelope

    url, marker = app.conf.threads_redis_url, f"unpickled-{tid()}"
    r = redis.Redis.from_url(url)
    assert list(app.conf.accept_content) == ["json"]
    gate, thread = Threads(app).gate, tid("cli-pickle")
    body = [
        [thread, _Unpickled(url, marker)],
        {},
        {"callbacks": None, "errbacks": None, "chain": None, "chord": None},
    ]
    stored = encode_envelope(
        body,
        {
            "headers": {"task": "tests.support.proj.record", "id": "pickled", "lang": "py"},
            "serializer": "pickle",
            "exchange": "",
            "routing_key": "celery",
        },
    )
    released = gate.enqueue(thread, "pickled", stored).release
    assert released is not None and gate.claim(thread, "pickled", released.token, "w")
    assert gate.kill(thread, "pickled", released.token, {"exception": "E: x"}).done

    [dead] = Threads(app).dead()
    assert (dead.task_id, dead.name, dead.args, dead.kwargs) == (
        "pickled",
        "tests.support.proj.record",
        [],
        {},
    )
    [listed] = as_json(cli("dead", "--json"))
    assert (listed["args"], listed["kwargs"]) == ([], {})
    assert r.exists(marker) == 0, "a content type the app does not accept was deserialized"

    with pointed_at(app, accept_content=["json", "pickle"]):
        [dead] = Threads(app).dead()
    assert dead.args == [thread, "unpickled"] and r.exists(marker) == 1


def test_restart_a_dead_task_as_a_new_arrival(proj, app, cli):
    thread = tid("cli-restart")
    kill_member(Threads(app).gate, thread, "to-restart")
    assert ok(cli("restart", "to-restart")) == (
        f"Restarted to-restart in thread {thread} as a new arrival.\n"
    )
    info = Threads(app).get(thread)
    assert (info.active.task_id, info.active.state, info.active.retries) == ("to-restart", "RELEASED", 0)
    assert as_json(cli("dead", "--json")) == []
    result = cli("restart", "to-restart")  # live again, not dead: nothing to restart
    assert result.exit_code == 1
    assert f"is a live member of thread '{thread}' (not dead)" in result.stderr
    assert "nothing to restart" in result.stderr


def test_restart_json(app, cli):
    thread = tid("cli-restart")
    kill_member(Threads(app).gate, thread, "to-restart-json")
    assert as_json(cli("restart", "to-restart-json", "--json")) == {
        "task_id": "to-restart-json",
        "thread_id": thread,
        "restarted": True,
    }


def test_forget_one_dead_task(app, cli):
    gate = Threads(app).gate
    kill_member(gate, tid("cli-forget"), "forget-me")
    kill_member(gate, tid("cli-forget"), "keep-me")
    assert ok(cli("forget", "forget-me")) == "Forgot dead task forget-me.\n"
    assert [d.task_id for d in Threads(app).dead()] == ["keep-me"]
    assert as_json(cli("forget", "keep-me", "--json")) == {"forgotten": ["keep-me"]}
    result = cli("forget", "forget-me")
    assert result.exit_code == 1 and "not in the dead-letter store" in result.stderr


def test_forget_all_asks_first(app, cli):
    gate = Threads(app).gate
    for i in range(3):
        kill_member(gate, tid("cli-forget"), f"dead-{i}")

    declined = cli("forget", "--all", input="n\n")
    assert declined.exit_code == 1 and "Forget all 3 dead tasks?" in declined.stderr
    assert len(Threads(app).dead()) == 3

    accepted = cli("forget", "--all", input="y\n")
    assert ok(accepted) == "Forgot 3 dead tasks.\n"
    assert Threads(app).dead() == []


def test_forget_all_yes_skips_the_question(app, cli):
    gate = Threads(app).gate
    kill_member(gate, tid("cli-forget"), "dead-a")
    kill_member(gate, tid("cli-forget"), "dead-b")
    result = cli("forget", "--all", "--yes", "--json")
    assert result.stderr == ""
    assert sorted(as_json(result)["forgotten"]) == ["dead-a", "dead-b"]
    assert Threads(app).dead() == []


def test_forget_needs_a_task_id_or_all(cli):
    for args in ((), ("some-id", "--all")):
        result = cli("forget", *args)
        assert result.exit_code == 2 and "TASK_ID or --all" in result.stderr


# -- stats ----------------------------------------------------------------------------------


def test_stats_of_a_healthy_gate(proj, app, cli):
    busy, other = tid("cli-stats"), tid("cli-stats")
    for i in range(3):
        proj.record.delay(busy, f"m{i}")
    proj.record.delay(other, "x")
    running(app, other)
    kill_member(Threads(app).gate, tid("cli-stats"), "stats-dead")

    out = ok(cli("stats"))
    lines = out.splitlines()
    lines = lines[: lines.index("")] if "" in lines else lines  # the table, before any warning
    oldest = next(line for line in lines if line.startswith("oldest due idle head"))
    # Both waiting members wait behind their thread's active member: none is due and idle.
    assert "none (the 2 waiting wait behind an active member" in oldest
    pairs = dict(line.rsplit(None, 1) for line in lines if line.strip() and line != oldest)
    assert {k.strip(): v for k, v in pairs.items()} == {
        "threads": "2",
        "members": "4",
        "waiting": "2",
        "released": "1",
        "running": "1",
        "paused threads": "0",
        "dead letters": "1",
        "retention drops": "0",
        "stuck": "0",
    }

    data = as_json(cli("stats", "--json"))
    assert (data["threads"], data["members"], data["dead"], data["stuck"]) == (
        2,
        {"WAITING": 2, "RELEASED": 1, "RUNNING": 1},
        1,
        0,
    )
    assert (data["healthy"], data["stuck_threads"], data["oldest_waiting_head"]) == (True, [], None)


def test_stats_exits_3_and_lists_what_is_stuck(app, cli):
    lease, head = tid("cli-stuck"), tid("cli-stuck")
    past = gate_in_the_past(app, HOUR)
    token = past.enqueue(lease, "lost-lease", envelope("lost-lease", lease)).release.token
    past.claim(lease, "lost-lease", token, "gone@box")
    # 121 s: "due 2m.." even when the stats below read the server's millisecond clock within
    # the enqueue's millisecond (119.999 s would print 1m59s).
    gate_in_the_past(app, 121).enqueue(head, "late-head", envelope("late-head", head), delay_ms=1)

    result = cli("stats")
    assert result.exit_code == 3
    out = result.stdout
    assert "oldest due idle head  due 2m" in out and "late-head of thread" in out
    stuck_rows = out[out.index("Stuck threads") :].splitlines()[2:4]
    assert [row.split()[-1] for row in stuck_rows] == [lease, head]
    assert "lease lapsed" in stuck_rows[0] and "gone@box" in stuck_rows[0]
    assert "head not released" in stuck_rows[1]
    assert "dispatcher" in out

    result = cli("stats", "--json")
    assert result.exit_code == 3
    data = json.loads(result.stdout)
    assert (data["healthy"], data["stuck"]) == (False, 2)
    assert [(s["thread_id"], s["kind"], s["task_id"]) for s in data["stuck_threads"]] == [
        (lease, "lease", "lost-lease"),
        (head, "head", "late-head"),
    ]
    assert data["oldest_waiting_head"]["task_id"] == "late-head"

    assert cli("stats", "--stuck-after", str(2 * HOUR)).exit_code == 0


# -- presentation and errors ----------------------------------------------------------------

# -- pause and resume ---------------------------------------------------------------------------


def test_pause_shows_in_show_ls_and_stats_until_resume(proj, app, cli):
    held, other, empty = tid("cli-held"), tid("cli-other"), tid("cli-empty")
    first = proj.record.delay(held, "m0").id
    second = proj.record.delay(held, "m1").id
    proj.record.delay(other, "x")

    out = ok(cli("pause", held, "--reason", "fixing bug 12"))
    assert f"Paused thread {held}: fixing bug 12." in out and f"resume {held}" in out
    assert as_json(cli("pause", empty, "--json")) == {
        "thread_id": empty,
        "paused": True,
        "reason": "paused",
        "was_paused": False,
    }
    assert as_json(cli("pause", held, "--reason", "fixing bug 13", "--json"))["was_paused"]

    out = ok(cli("show", held))
    assert "PAUSED: fixing bug 13." in out and f"`celery -A tests.support.proj threads resume {held}`" in out
    assert first in out and second in out  # the released member goes on; m1 waits
    data = as_json(cli("show", held, "--json"))
    assert (data["paused"], data["active"]["task_id"]) == ("fixing bug 13", first)
    shown = ok(cli("show", empty))  # a pause with no member is operator state
    assert "0 members" in shown and "PAUSED: paused." in shown
    assert as_json(cli("show", empty, "--json"))["paused"] == "paused"

    lines = ok(cli("ls")).splitlines()
    assert lines[0].split()[-2:] == ["PAUSED", "THREAD"]
    rows = {line.split()[-1]: line for line in lines[1:-1]}
    assert set(rows) == {held, other, empty} and lines[-1] == "3 threads"
    assert "fixing" in rows[held] and "paused" in rows[empty]  # cut to fit 80 columns
    lines = ok(cli("ls", "--paused")).splitlines()
    assert sorted(line.split()[-1] for line in lines[1:-1]) == sorted([held, empty])
    assert lines[-1] == "2 paused threads"
    paused = {row["thread_id"]: row for row in as_json(cli("ls", "--paused", "--json"))}
    assert {t: row["paused"] for t, row in paused.items()} == {held: "fixing bug 13", empty: "paused"}
    assert (paused[held]["members"], paused[empty]["members"]) == (2, 0)

    stats = as_json(cli("stats", "--json"))
    assert (stats["threads"], stats["paused"], stats["stuck"]) == (3, 2, 0)
    assert [
        line.split()[-1] for line in ok(cli("stats")).splitlines() if line.startswith("paused threads")
    ] == ["2"]

    assert ok(cli("resume", held)) == f"Resumed thread {held}.\n"
    assert as_json(cli("resume", empty, "--json")) == {"thread_id": empty, "resumed": True}
    result = cli("resume", empty)  # not paused: nothing to do, which is no error
    assert result.exit_code == 0 and "is not paused: nothing to resume" in result.stdout
    assert "ls --paused" in result.stdout
    assert ok(cli("ls", "--paused")) == "No paused threads.\n"
    assert as_json(cli("show", held, "--json"))["paused"] is None
    assert cli("show", empty).exit_code == 1  # no member and no pause: gone
    assert as_json(cli("stats", "--json"))["paused"] == 0


def test_a_paused_thread_is_never_stuck(app, cli):
    lease, head = tid("cli-stuck-paused"), tid("cli-stuck-paused")
    past = gate_in_the_past(app, HOUR)
    token = past.enqueue(lease, "lost-lease", envelope("lost-lease", lease)).release.token
    past.claim(lease, "lost-lease", token, "gone@box")
    gate_in_the_past(app, 121).enqueue(head, "late-head", envelope("late-head", head), delay_ms=1)
    assert cli("stats").exit_code == 3
    for thread in (lease, head):
        ok(cli("pause", thread))
    result = cli("stats", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert (data["stuck"], data["stuck_threads"], data["paused"], data["threads"]) == (0, [], 2, 2)


def test_tables_fit_in_80_columns(proj, app, cli):
    long_id = "account-" + "x" * 120
    for i in range(3):
        proj.record.delay(long_id, f"m{i}")
    gate = Threads(app).gate
    kill_member(
        gate,
        "dead-" + "y" * 120,
        "a-dead-task-with-a-long-id-" + "z" * 20,
        "RuntimeError: " + "a long message " * 20,
    )
    past = gate_in_the_past(app, HOUR)
    stuck = "stuck-" + "s" * 120
    past.enqueue(stuck, "stuck-task", envelope("stuck-task", stuck), delay_ms=1)

    # Ids are printed whole, to be pasted into show, delete or restart: a line holding a long
    # one runs past the width, with the id last; every other line fits.
    ids = (long_id, stuck, "dead-" + "y" * 120, "a-dead-task-with-a-long-id-" + "z" * 20)
    for args in (("ls",), ("show", long_id), ("dead",), ("stats",)):
        result = cli(*args)
        assert result.exit_code in (0, 3), result.output
        lines = result.stdout.splitlines()
        if args[0] in ("show", "stats"):
            fits("\n".join(line for line in lines if not any(i in line for i in ids)))
    assert long_id in ok(cli("ls")) and stuck in ok(cli("ls"))
    assert "a-dead-task-with-a-long-id-" + "z" * 20 in ok(cli("dead"))


def test_every_command_takes_json(proj, app, cli):
    thread = tid("cli-json")
    proj.record.delay(thread, "a")
    waiting = proj.record.delay(thread, "b").id
    kill_member(Threads(app).gate, tid("cli-json"), "json-dead")
    kill_member(Threads(app).gate, tid("cli-json"), "json-dead-2")
    for args in (
        ("ls",),
        ("show", thread),
        ("dead",),
        ("stats",),
        ("delete", waiting),
        ("restart", "json-dead"),
        ("forget", "json-dead-2"),
        ("forget", "--all", "-y"),
        ("pause", thread),
        ("ls", "--paused"),
        ("resume", thread),
    ):
        result = cli(*args, "--json")
        assert result.exit_code == 0, (args, result.output)
        json.loads(result.stdout)


def test_unreachable_redis_names_the_url_and_the_setting(app, env, free_redis_url):
    with pointed_at(app, threads_redis_url=free_redis_url):
        result = CliRunner().invoke(celery_command, ["-A", "tests.support.proj", "threads", "ls"], env=env)
    assert result.exit_code == 69
    assert free_redis_url in result.stderr and "threads_redis_url" in result.stderr
    assert "Traceback" not in result.output


def test_missing_gate_setting_says_which_to_set(app, env):
    with pointed_at(app, threads_redis_url=None, broker_url="amqp://guest@127.0.0.1:1//"):
        result = CliRunner().invoke(celery_command, ["-A", "tests.support.proj", "threads", "stats"], env=env)
    assert result.exit_code == 78
    assert "threads_redis_url" in result.stderr and "Traceback" not in result.output


# -- a real `celery` process ------------------------------------------------------------------


@pytest.fixture
def free_redis_url():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"redis://127.0.0.1:{port}/0"


def celery_process(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    script = Path(sys.executable).with_name("celery")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "celery"]
    return subprocess.run(
        [*command, "-A", "tests.support.proj", "threads", *args],
        env={**os.environ, **env, "PYTHONPATH": str(ROOT)},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_the_celery_command_has_threads_subcommands(env):
    done = celery_process(env, "--help")
    assert done.returncode == 0, done.stderr
    for command in ("ls", "show", "delete", "dead", "restart", "forget", "stats", "pause", "resume"):
        assert f"  {command} " in done.stdout


def test_a_celery_process_lists_and_shows_threads(proj, app, env):
    thread = tid("cli-proc")
    first = proj.record.delay(thread, "a").id
    proj.record.delay(thread, "b")

    done = celery_process(env, "ls", "--json")
    assert done.returncode == 0, done.stderr
    assert [(r["thread_id"], r["members"], r["active_task"]) for r in json.loads(done.stdout)] == [
        (thread, 2, first)
    ]
    done = celery_process(env, "show", thread)
    assert done.returncode == 0, done.stderr
    assert first in done.stdout
    fits(done.stdout)


def test_a_celery_process_stats_is_a_health_check(app, env):
    assert celery_process(env, "stats").returncode == 0
    thread = tid("cli-proc")
    gate_in_the_past(app, HOUR).enqueue(thread, "stuck", envelope("stuck", thread), delay_ms=1)
    done = celery_process(env, "stats")
    assert done.returncode == 3, done.stderr
    assert thread in done.stdout


def test_a_celery_process_reports_errors_without_tracebacks(app, env, free_redis_url):
    done = celery_process(env, "show", "no-such-thread")
    assert done.returncode == 1
    assert "no thread 'no-such-thread'" in done.stderr and "Traceback" not in done.stderr

    done = celery_process({**env, "CT_REDIS_URL": free_redis_url}, "stats")
    assert done.returncode == 69
    assert free_redis_url in done.stderr and "threads_redis_url" in done.stderr
    assert "Traceback" not in done.stderr


def test_without_an_app_it_says_to_name_one(tmp_path):
    # Run where no celery config module is found, as a user who forgot -A.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CELERY_", "CT_"))}
    done = subprocess.run(
        [sys.executable, "-m", "celery", "threads", "ls"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "name your Celery app" in done.stderr and "celery -A proj threads" in done.stderr
    assert "threads_redis_url" not in done.stderr


def test_a_named_app_without_a_redis_url_is_told_so(tmp_path):
    """An app named with -A whose broker URL comes from an environment variable left unset: it
    was told to name its app."""
    (tmp_path / "envapp.py").write_text('from celery import Celery\n\napp = Celery("envapp")\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CELERY_", "CT_"))}
    done = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "envapp", "threads", "ls"],
        cwd=tmp_path,
        env={**env, "PYTHONPATH": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "name your Celery app" not in done.stderr, done.stderr
    assert done.returncode == 78 and "needs a Redis server" in done.stderr, (done.returncode, done.stderr)
