"""Redrive of dead letters at their original place, purge of waiting members, and the
dead-letter store's retention, on real prefork workers.

Judged by what the bodies wrote (start records stamped with the Redis server's clock,
tests/support/proj.py ``_Span``), by the result backend (``AsyncResult``), and by the gate's keys.
"""

from __future__ import annotations

import json

import pytest
from celery.bin.celery import celery as celery_command
from click.testing import CliRunner, Result

from celery_threads import Threads
from tests.support.helpers import gate_keys, starts, tid, wait_for


@pytest.fixture
def r(proj):
    return proj.history()


def cli(*args: str, input: str | None = None) -> Result:
    """``celery -A tests.support.proj threads ARGS`` in this process (the app points at the test's
    deployment)."""
    result = CliRunner().invoke(celery_command, ["-A", "tests.support.proj", "threads", *args], input=input)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result


def as_json(result: Result):
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def state(proj, result) -> str:
    """The result backend's state of ``result``, read afresh (an ``AsyncResult`` and the backend
    cache a final state)."""
    return proj.app.backend.get_task_meta(result.id, cache=False)["status"]


def dead_of(proj, thread: str) -> list[str]:
    return [d.task_id for d in Threads(proj.app).dead() if d.thread_id == thread]


def die_three(proj, r, thread: str) -> list:
    """Three members of ``thread`` that die on their first attempt (max_retries=0), in order."""
    r.set(f"flaky:{thread}", 1)
    dying = [proj.flaky.delay(thread, f"d{i}") for i in (1, 2, 3)]
    wait_for(lambda: len(dead_of(proj, thread)) == 3, what="three dead letters", timeout=60)
    assert dead_of(proj, thread) == [d.id for d in dying]
    for d in dying:
        wait_for(lambda d=d: state(proj, d) == "FAILURE", what=f"{d.id} FAILURE", timeout=60)
    return dying


def test_redriven_letters_run_first_in_their_original_order(proj, make_deployment, r):
    """Three members die; a long member then runs and two more arrive behind it; the redrive
    puts the three back at their place: once the long one ends they run in their original
    order, before the two later arrivals, and end SUCCESS under their own task ids."""
    d = make_deployment(CT_EVENTS="0")
    d.worker("redrive", concurrency=2)
    thread = tid("redrive")
    dying = die_three(proj, r, thread)
    hold = proj.beater.delay(thread, "hold", seconds=30, until=f"go:{thread}")
    wait_for(lambda: "hold" in starts(r, thread), what="the holding member to start", timeout=60)
    later = [proj.record.delay(thread, f"l{i}") for i in (1, 2)]
    r.delete(f"flaky:{thread}")
    assert Threads(proj.app).redrive(thread) == 3
    assert dead_of(proj, thread) == []
    info = Threads(proj.app).get(thread)
    assert [m.task_id for m in info.waiting] == [x.id for x in dying + later]
    assert all(m.retries == 0 for m in info.waiting)
    assert [state(proj, x) for x in dying] == ["PENDING"] * 3  # waiting in the gate again
    r.set(f"go:{thread}", 1)
    for member in dying + later + [hold]:
        wait_for(lambda m=member: state(proj, m) == "SUCCESS", what=f"{member.id} SUCCESS", timeout=60)
    assert starts(r, thread) == ["d1", "d2", "d3", "hold", "d1", "d2", "d3", "l1", "l2"]
    # The history is shared with other tests: only this thread's overlaps count.
    assert not [x for x in r.lrange("overlaps", 0, -1) if x.decode().startswith(f"{thread}|")]
    wait_for(lambda: not gate_keys(r, thread), what="the thread's keys to vanish", timeout=60)
    assert Threads(proj.app).redrive(thread) == 0


def test_redrive_dry_run_and_limit_on_the_command_line(proj, make_deployment, r):
    """--dry-run lists the letters and changes nothing; --limit 1 redrives the oldest death
    only; the rest stay in the store."""
    d = make_deployment(CT_EVENTS="0")
    d.worker("redrive-cli", concurrency=2)
    thread = tid("redrive-cli")
    dying = die_three(proj, r, thread)
    r.delete(f"flaky:{thread}")
    listed = as_json(cli("redrive", thread, "--dry-run", "--json"))
    assert listed["dry_run"] is True
    assert [x["task_id"] for x in listed["would_redrive"]] == [x.id for x in dying]
    assert dead_of(proj, thread) == [x.id for x in dying]
    assert as_json(cli("redrive", thread, "--limit", "1", "--json")) == {"redriven": 1}
    wait_for(lambda: state(proj, dying[0]) == "SUCCESS", what="the redriven letter to succeed", timeout=60)
    assert dead_of(proj, thread) == [x.id for x in dying[1:]]
    assert [state(proj, x) for x in dying[1:]] == ["FAILURE", "FAILURE"]
    assert as_json(cli("redrive", "--json")) == {"redriven": 2}  # every thread's
    for x in dying[1:]:
        wait_for(lambda x=x: state(proj, x) == "SUCCESS", what=f"{x.id} SUCCESS", timeout=60)
    assert starts(r, thread) == ["d1", "d2", "d3", "d1", "d2", "d3"]


def test_a_letter_s_stored_failure_goes_before_its_redrive_or_restart_can_release_it(
    proj, make_deployment, r, monkeypatch
):
    """Redrive and restart forget a letter's stored FAILURE while it is still a dead letter, before
    the gate call that can release it, so the result backend ends with its new run's result.
    Forgotten after that call, a worker faster than the operator (seen on a busy machine) stored
    the new SUCCESS first, and the forget dropped it: ``PENDING`` for good.  Restart forgets it
    too: its ``AsyncResult`` no longer shows the old FAILURE until the new run ends."""
    d = make_deployment(CT_EVENTS="0")
    d.worker("redrive-forget", concurrency=2)
    thread = tid("redrive-forget")
    dying = die_three(proj, r, thread)
    r.delete(f"flaky:{thread}")
    threads = Threads(proj.app)
    backend = proj.app.backend
    real_forget = backend.forget
    dead_when_forgotten: dict[str, bool] = {}

    def forget(task_id: str) -> None:
        dead_when_forgotten[task_id] = threads.dead_task(task_id) is not None
        real_forget(task_id)

    monkeypatch.setattr(backend, "forget", forget)
    assert threads.redrive(thread, limit=2) == 2
    assert threads.restart(dying[2].id).id == dying[2].id
    assert dead_when_forgotten == {x.id: True for x in dying}
    for x in dying:
        wait_for(lambda x=x: state(proj, x) == "SUCCESS", what=f"{x.id} SUCCESS", timeout=60)
    assert [backend.get_task_meta(x.id, cache=False)["result"] for x in dying] == ["d1", "d2", "d3"]
    assert starts(r, thread) == ["d1", "d2", "d3", "d1", "d2", "d3"]


@pytest.mark.parametrize("first", ["forget", "restart-and-run"])
def test_a_restart_or_redrive_another_call_beat_says_so_and_keeps_the_result(
    proj, make_deployment, r, monkeypatch, first
):
    """Two operators on one dead letter: between one's read of the letter and its gate call,
    the other forgets it, or restarts it and its run ends.  Restart said it had restarted it,
    and both it and redrive left its stored result forgotten: PENDING for good, the letter
    gone (forgotten) or its new SUCCESS dropped.  The result is put back, and restart raises."""
    from celery_threads.errors import UnknownTask

    d = make_deployment(CT_EVENTS="0")
    d.worker("operators", concurrency=2)
    thread = tid("operators")
    dying = die_three(proj, r, thread)
    r.delete(f"flaky:{thread}")
    threads, other = Threads(proj.app), Threads(proj.app)
    for how, task in (("restart", dying[0]), ("redrive", dying[1])):
        real, real_restart = getattr(threads.gate, how), threads.gate.restart
        inside: list[bool] = []  # the other operator's own calls (one gate per app) go through

        def beaten(*args, real=real, real_restart=real_restart, task=task, inside=inside, **kwargs):
            if inside:
                return real_restart(*args, **kwargs)
            inside.append(True)
            if first == "forget":
                assert other.forget(task.id) is True
            else:
                other.restart(task.id)
                wait_for(lambda: state(proj, task) == "SUCCESS", what="the other's run", timeout=60)
            inside.clear()
            return real(*args, **kwargs)

        monkeypatch.setattr(threads.gate, how, beaten)
        if how == "restart":
            with pytest.raises(UnknownTask, match="was not restarted"):
                threads.restart(task.id)
        else:
            assert threads.redrive(thread, limit=1) == 0
        monkeypatch.undo()
        assert state(proj, task) == ("FAILURE" if first == "forget" else "SUCCESS"), (how, first)
    assert dead_of(proj, thread) == [dying[2].id]


def test_purge_drops_waiting_members_and_lets_the_running_one_finish(proj, make_deployment, r):
    """Purge of one thread, then of every thread: the waiting members never start and show
    REVOKED; the running member of each thread finishes SUCCESS; the keys vanish; another
    thread is untouched by the first purge.  Without -f the command asks first."""
    d = make_deployment(CT_EVENTS="0")
    d.worker("purge", concurrency=2)
    one, two = tid("purge-one"), tid("purge-two")
    holds = {t: proj.beater.delay(t, "hold", seconds=30, until=f"go:{t}") for t in (one, two)}
    for t in (one, two):
        wait_for(lambda t=t: "hold" in starts(r, t), what="the holding member to start", timeout=60)
    waiting = {t: [proj.record.delay(t, f"w{i}") for i in range(3)] for t in (one, two)}

    refused = cli("purge", one, input="n\n")
    assert refused.exit_code != 0 and len(Threads(proj.app).get(one).waiting) == 3
    assert as_json(cli("purge", one, "-f", "--json")) == {"purged": 3}
    for w in waiting[one]:
        assert state(proj, w) == "REVOKED"
    assert len(Threads(proj.app).get(two).waiting) == 3
    r.set(f"go:{one}", 1)
    wait_for(lambda: state(proj, holds[one]) == "SUCCESS", what="the running member to finish", timeout=60)
    wait_for(lambda: not gate_keys(r, one), what="the purged thread's keys to vanish", timeout=60)

    assert Threads(proj.app).purge() == 3
    for w in waiting[two]:
        assert state(proj, w) == "REVOKED"
    r.set(f"go:{two}", 1)
    wait_for(lambda: state(proj, holds[two]) == "SUCCESS", what="the running member to finish", timeout=60)
    wait_for(lambda: not gate_keys(r, two), what="the purged thread's keys to vanish", timeout=60)
    assert starts(r, one) == starts(r, two) == ["hold"]
    assert Threads(proj.app).get(one) is None and Threads(proj.app).get(two) is None


def test_retention_drops_letters_past_the_bound_and_the_ttl(proj, make_deployment, r):
    """threads_dead_letter_max=2: of four dead letters the two oldest are dropped by the
    dispatcher; threads_dead_letter_ttl=4: the other two once four seconds old.  The counter
    shows in `celery threads stats`."""
    d = make_deployment(CT_EVENTS="0", CT_DEAD_LETTER_MAX="2", CT_DEAD_LETTER_TTL="4")
    d.worker("retain", concurrency=2)
    thread = tid("retain")
    dying = [proj.boom.delay(thread, f"b{i}") for i in range(4)]
    for x in dying:
        wait_for(lambda x=x: state(proj, x) == "FAILURE", what=f"{x.id} to die", timeout=60)
    threads = Threads(proj.app)
    wait_for(lambda: threads.stats().dead_dropped == 2, what="two letters dropped by the max", timeout=60)
    assert [t.task_id for t in threads.dead()] == [x.id for x in dying[2:]]
    assert as_json(cli("stats", "--json"))["dead_dropped"] == 2
    wait_for(lambda: threads.stats().dead_dropped == 4, timeout=30, what="the other two dropped by the TTL")
    assert threads.dead() == []
    [line] = [x for x in cli("stats").stdout.splitlines() if "retention drops" in x]
    assert line.split()[-1] == "4", line
