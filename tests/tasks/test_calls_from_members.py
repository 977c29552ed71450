"""Calls a running member makes that Celery would run: ``self.replace(sig)`` (which gives ``sig``
the member's own task id) and calls passing the member's request headers on."""

from __future__ import annotations

import pytest

from tests.support.helpers import assert_serial, events, starts, tid, wait_for


@pytest.fixture
def r(proj):
    return proj.history()


def _span(r, thread: str, label: str) -> tuple[int, int]:
    """(start, end) of `label`'s run in `thread`, on the Redis server's clock."""
    evs = [e for e in events(r, thread) if e.label == label]
    assert [e.kind for e in evs] == ["start", "end"], evs
    return evs[0].at_us, evs[1].at_us


def test_a_replacement_in_the_members_thread_takes_its_place(proj, worker, r):
    thread, key = tid(), tid("go")
    replaced = proj.replacer.delay(thread, "x", "same", until=key)
    wait_for(lambda: starts(r, thread) == ["x"], what="x to start")
    sibling = proj.record.delay(thread, "s")  # arrives while x runs, before it is replaced
    r.set(key, 1)
    assert replaced.get(timeout=20) == "x-r"
    assert sibling.get(timeout=20) == "s"
    # The replacement keeps x's place (ahead of the later arrival), once x's body has ended.
    assert starts(r, thread) == ["x", "x-r", "s"]
    assert_serial(r, thread)
    assert all(e.task_id == replaced.id for e in events(r, thread) if e.label in ("x", "x-r"))


def test_a_replacement_in_another_thread_joins_it_once_the_member_ended(proj, worker, r):
    thread, other = tid(), tid()
    replaced = proj.replacer.delay(thread, "x", "other", target=other)
    after = proj.record.delay(thread, "s")
    assert replaced.get(timeout=20) == "x-o"
    assert after.get(timeout=20) == "s"
    assert starts(r, thread) == ["x", "s"] and starts(r, other) == ["x-o"]
    assert _span(r, other, "x-o")[0] >= _span(r, thread, "x")[1]
    assert_serial(r, thread)


def test_a_replacement_chain_runs_each_step_and_returns_the_last(proj, worker, r):
    thread = tid()
    replaced = proj.replacer.delay(thread, "x", "chain")
    assert replaced.get(timeout=20) == "x-c2"
    assert starts(r, thread) == ["x", "x-c1", "x-c2"]
    assert_serial(r, thread)


def test_headers_copied_from_a_member_make_new_calls(proj, worker, r):
    """``headers=self.request.headers`` carries the member's thread token: the call is no retry of
    the caller.  A task without a thread_key joins the caller's thread, after it."""
    thread = tid()
    called = proj.caller.delay(thread, "c")
    assert called.get(timeout=20) == "c"
    wait_for(lambda: len(starts(r, thread)) == 3, what="both calls to run")
    assert starts(r, thread) == ["c", "c-called", "c-free"]
    assert_serial(r, thread)


def test_copied_headers_leave_a_keyed_task_in_its_own_thread(proj, worker, r):
    thread, other = tid(), tid()
    proj.caller.delay(thread, "c", callee_thread=other, linger=1.0)
    wait_for(lambda: starts(r, other) == ["c-called"], what="c-called to run in its thread")
    wait_for(lambda: starts(r, thread) == ["c", "c-free"], what="c-free to run after c")
    assert_serial(r, thread)


def test_a_replacement_of_an_ended_id_is_admitted_once(proj, isolated_app):
    """The gate admits a replacement (``replaced_task_nesting``) under the id of a member that
    ended less than a minute ago, once per nesting level: a replayed call stays a no-op, also after
    the replacement itself has ended."""
    from celery_threads.gate import Claim
    from celery_threads.runtime import get_runtime

    gate = get_runtime(isolated_app).gate
    thread, other, task_id = tid(), tid(), "replaced-id"

    def run_to_end(thread_id: str) -> None:
        token = gate.reads.snapshot(thread_id).active["token"]
        assert gate.claim(thread_id, task_id, token, "w") == Claim.CLAIMED
        assert gate.finish(thread_id, task_id, token).done

    assert gate.enqueue(thread, task_id, b"x").done
    run_to_end(thread)
    assert not gate.enqueue(other, task_id, b"x").done  # a replay: refused
    assert gate.enqueue(other, task_id, b"x", replaced=1).done  # its replacement
    assert not gate.enqueue(other, task_id, b"x", replaced=1).done  # while a member
    run_to_end(other)
    assert not gate.enqueue(other, task_id, b"x", replaced=1).done  # replayed after its end
    assert gate.enqueue(thread, task_id, b"x", replaced=2).done  # the next replacement
