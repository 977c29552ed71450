"""The handoff's slots (celery_threads/worker/shared.py) hold every valid identity: a thread id of
any characters up to 1,024 bytes, a task id of any length.  Unit-level in the real shared memory
(a forked writer, the reader in this process), then on real prefork workers: a handed-off member
with an odd identity is stopped by Threads.delete and by revoke(terminate=True), and fails at once
when its pool process is killed.
"""

from __future__ import annotations

import multiprocessing
import os
import uuid
from types import SimpleNamespace

import pytest

from celery_threads.gate import Release
from celery_threads.runtime import get_runtime
from celery_threads.worker import handoff, shared
from tests.support.helpers import events, starts, tid, wait_for
from tests.worker.test_handoff import assert_serial_but_for_the_killed, received

MAX = "é" * 512  # 1,024 UTF-8 bytes: the longest thread id
ODD_THREADS = ["a\x00b", "\x00", "\x00\x00|\n", "名前\x00\U0001f600", MAX, "x" * 1024]
ODD_TASKS = [
    "",
    "\x00",
    "t\x00\x00",
    "\udc80 lone surrogate",
    "k" * 600,
    "ü" * 1400,
    "z" * 3000,
    "long" * 2000,
]


def sized(prefix: str, size: int) -> str:
    """``prefix`` padded to exactly ``size`` UTF-8 bytes (two-byte characters first)."""
    text = prefix + "-" + "é" * ((size - len(prefix.encode()) - 1) // 2)
    return text + "x" * (size - len(text.encode()))


@pytest.fixture
def shared_slots(proj):
    """The handoff's slots of a worker of 2 pool processes, made here as the worker's main
    process makes them (then the module as it was)."""
    saved = (
        handoff._app,
        handoff._allowed,
        handoff._stopping,
        handoff._main_pid,
        shared._lease_ends,
        shared._slots,
        shared._flag,
        shared._index,
    )
    shared.prepare(2)
    handoff.prepare(SimpleNamespace(app=proj.app, task_events=False, concurrency=2))
    try:
        yield shared.handoff_slots()
    finally:
        (
            handoff._app,
            handoff._allowed,
            handoff._stopping,
            handoff._main_pid,
            shared._lease_ends,
            shared._slots,
            shared._flag,
            shared._index,
        ) = saved
        handoff._reported.clear()


def _writer(index: int, members, conn) -> None:
    """A forked pool process stand-in: names each member in its slot (as handoff._note does),
    answering once each is written; with ``members`` of two, alternates them ``conn`` times."""
    shared._index = index
    if isinstance(conn, int):
        for i in range(conn):
            handoff._note(members[i % 2])
        return
    for release in members:
        handoff._note(release)
        conn.send(os.getpid())
        conn.recv()


def test_any_identity_round_trips_in_shared_memory(shared_slots):
    fork = multiprocessing.get_context("fork")
    members = [
        Release(thread, task or str(uuid.uuid4()), str(10**18 + i), 0, b"")
        for i, (thread, task) in enumerate((t, k) for t in ODD_THREADS for k in ODD_TASKS)
    ]
    ours, theirs = fork.Pipe()
    writer = fork.Process(target=_writer, args=(1, members, theirs), daemon=True)
    writer.start()
    try:
        for release in members:
            pid = ours.recv()
            fits = (
                len(shared.encode(release.thread_id))
                + len(release.token)
                + len(shared.encode(release.task_id))
                <= shared.ROOM
            )
            [(index, _, found, member)] = list(shared_slots.members(1.0))
            assert (index, found) == (1, pid)
            assert member.thread_id == release.thread_id and member.token == release.token
            assert member.task_id == (release.task_id if fits else "")
            assert member.matches(release.task_id)
            assert not member.matches(release.task_id + "\x00")
            assert handoff.running(release.task_id) == (
                pid,
                (release.thread_id, release.task_id, release.token),
            )
            assert handoff.running(release.task_id[:-1] or "other") is None
            ours.send("next")
    finally:
        writer.join(10)
    # The longest thread id and token, with a task id of 3,000 bytes, fit whole.
    whole = shared.Member(MAX, "k" * 3000, "9" * 20)
    assert shared.unpack(shared.pack(1, whole)) == (1, whole)


def test_a_slot_rewritten_while_it_is_read_is_never_read_torn(shared_slots):
    """The main process reads a slot while its pool process rewrites it, member after member,
    with identities of different lengths: each read is one member, whole."""
    one = Release("a\x00" * 300, "k" * 1500, "12345", 0, b"")
    two = Release("b", "short\x00", "6", 0, b"")
    expected = {(m.thread_id, m.task_id, m.token) for m in (one, two)}
    writer = multiprocessing.get_context("fork").Process(
        target=_writer, args=(0, [one, two], 200_000), daemon=True
    )
    writer.start()
    reads = 0
    try:
        while writer.is_alive() or not reads:
            for _, _, _, member in shared_slots.members(1.0):
                assert (member.thread_id, member.task_id, member.token) in expected
                reads += 1
    finally:
        writer.join(30)
    assert writer.exitcode == 0 and reads > 100


def test_a_slot_left_in_mid_write_is_skipped_then_rewritten(shared_slots, caplog):
    """A pool process killed in the middle of a write leaves its slot odd: a reader gives up on
    it within its patience (that member's lease lapses instead), and the process that takes the
    slot over writes it again."""
    shared._index = 0
    handoff._note(Release("t", "x", "1", 0, b""))
    shared_slots.memory[0:8] = (int.from_bytes(shared_slots.memory[0:8], "little") + 1).to_bytes(
        8, "little"
    )  # odd: a write under way
    with pytest.raises(shared.Unreadable):
        shared_slots.read(0, 0.05)
    assert handoff.running("x") is None
    assert "is being written" in caplog.text
    handoff._note(Release("t", "y", "2", 0, b""))
    assert handoff.running("y") == (os.getpid(), ("t", "y", "2"))
    handoff._note(None)
    assert handoff.running("y") is None


def test_a_lost_member_too_long_for_its_slot_is_read_from_the_gate(shared_slots, isolated_app):
    """A task id longer than the slot's room is kept as its digest: the main process finds the
    member of a lost process by it, with its task id read from the gate (the thread's active
    member under the slot's token); once that member is no longer active under it, none."""
    from tests.support.isolated import envelope

    gate = get_runtime(isolated_app).gate
    thread, task_id = sized(tid("big"), 1024), "id-" + "\x01k" * 5000
    released = gate.enqueue(thread, task_id, envelope(task_id, thread)).release
    assert released is not None
    assert gate.claim(thread, task_id, released.token, "w") == 1
    fork = multiprocessing.get_context("fork")
    ours, theirs = fork.Pipe()
    writer = fork.Process(target=_writer, args=(1, [released], theirs), daemon=True)
    writer.start()
    pid = ours.recv()
    writer.kill()
    writer.join(10)
    [(_, _, _, member)] = list(shared_slots.members(1.0))
    assert member.task_id == "" and member.digest == shared.digest(task_id)
    assert handoff.running(task_id) == (pid, (thread, task_id, released.token))
    assert handoff.lost_member(pid) == (thread, task_id, released.token)
    assert handoff.lost_member(pid) is None, "reported once"
    assert handoff.running(task_id) is None

    handoff._reported.clear()  # read again, once the member has moved on
    gate.fail(thread, task_id, released.token, "lost")
    assert gate.reads.snapshot(thread).active.get("token") != released.token
    assert handoff.lost_member(pid) is None


# -- on real prefork workers -----------------------------------------------------------------------
def odd_identity(kind: str) -> tuple[str, str | None]:
    """(thread id, custom task id or None): "nul" a thread id with NUL bytes; "long" a 1,000-byte
    thread id with a 600-character task id; "huge" the longest thread id with a task id of
    5,000 characters (kept as its digest in the slot)."""
    if kind == "nul":
        return tid("nul") + "\x00mid\x00", None
    if kind == "long":
        return sized(tid("long"), 1000), (uuid.uuid4().hex + "-" + "k" * 600)[:600]
    return sized(tid("huge"), 1024), uuid.uuid4().hex + "-" + "h" * 4967


IDENTITIES = ["nul", "long", "huge"]


def beats(r, thread: str, label: str) -> list[int]:
    """The heartbeats (Redis server clock, µs) that member `label` of `thread` wrote."""
    rows = [x.decode().split("|") for x in r.lrange(f"beats:{thread}", 0, -1)]
    return [int(at) for who, at in rows if who == label]


def server_us(r) -> int:
    seconds, micros = r.time()
    return seconds * 1_000_000 + micros


@pytest.mark.parametrize("identity", IDENTITIES)
@pytest.mark.parametrize("how", ["delete", "revoke"])
def test_a_handed_off_member_of_any_identity_is_stopped(proj, make_deployment, how, identity):
    """Threads.delete or revoke(terminate=True) of a member run by handoff, whatever its ids:
    its body stops (no heartbeat a couple of seconds after the call; it would beat for 20 s),
    it ends REVOKED, and the next member runs."""
    from celery_threads import Threads

    r = proj.history()
    thread, task_id = odd_identity(identity)
    d = make_deployment(CT_EVENTS="0")
    w = d.worker("odd", concurrency=2)
    first = proj.where.apply_async((thread, "first"), {"sleep": 0.5})
    wait_for(lambda: starts(r, thread) == ["first"], what="the first member")
    long = proj.beater.apply_async((thread, "long"), {"seconds": 20}, task_id=task_id)
    nxt = proj.beater.apply_async((thread, "next"), {"seconds": 0.3})
    wait_for(lambda: beats(r, thread, "long"), what="the handed-off member's heartbeats")
    assert not received(w, long.id), "long was not handed off"
    asked = server_us(r)
    if how == "revoke":
        proj.app.control.revoke(long.id, terminate=True)
    else:
        assert Threads(proj.app).delete(long.id) is True
    assert nxt.get(timeout=20) == "next"
    wait_for(lambda: long.state == "REVOKED", what="long to be marked REVOKED")
    assert first.get(timeout=5) == "first"
    # A body still running would have beaten since: read once the Redis clock is past the bound.
    wait_for(lambda: server_us(r) > asked + 2_500_000, what="the Redis clock")
    assert max(beats(r, thread, "long")) < asked + 2_000_000, "long ran on after its stop"
    assert beats(r, thread, "next")
    assert starts(r, thread) == ["first", "long", "next"]
    wait_for(lambda: Threads(proj.app).get(thread) is None, what="the thread to vanish")


@pytest.mark.parametrize("identity", IDENTITIES)
def test_a_lost_pool_process_fails_a_member_of_any_identity_at_once(proj, make_deployment, identity):
    """A pool process killed while it runs a member by handoff, whatever its ids: the main
    process fails that attempt at once, well before its 30 s lease lapses, and it runs again."""
    r = proj.history()
    thread, task_id = odd_identity(identity)
    d = make_deployment(CT_EVENTS="0", CT_KEEPALIVE="30", CT_DISPATCH_INTERVAL="0.2")
    w = d.worker("lost", concurrency=2)
    first = proj.where.apply_async((thread, "first"), {"sleep": 0.5})
    wait_for(lambda: starts(r, thread) == ["first"], what="the first member")
    label = f"suicide-{uuid.uuid4().hex[:8]}"
    doomed = proj.suicide.apply_async((thread, label), task_id=task_id)  # kills its process
    after = proj.where.delay(thread, "after")
    wait_for(
        lambda: starts(r, thread).count(label) == 2, timeout=25, what="the killed member's second attempt"
    )
    killed, again = [e.at_us for e in events(r, thread) if e.label == label and e.kind == "start"]
    assert again - killed < 5_000_000, f"recovered after {(again - killed) / 1e6:.1f} s"
    assert any(doomed.id in line and "by handoff was lost" in line for line in w.output().splitlines()), (
        "failed from its slot"
    )
    assert doomed.get(timeout=15) == label
    assert after.get(timeout=15) == "after"
    assert first.get(timeout=5) == "first"
    assert_serial_but_for_the_killed(r, thread)
