"""Model-based test of the gate: random operations on the real Lua scripts and on tests/model.py.

A hypothesis state machine drives the gate (``celery_threads.gate.Gate`` on a private
redis-server, its clock injected) and the reference model with the same operations: enqueue,
the dispatcher's scan + release + lease sweep, claims with right and stale tokens, renewals,
endings (finish, requeue, kill, fail), deletes, restarts and forgets of dead tasks, and clock
advances.  After every step both must agree on every thread, on the indexes and dead letters, and
no key of a thread that no longer exists may remain.

Fencing tokens are compared through a one-to-one mapping (the model's token <-> the gate's token),
so the test does not depend on how the gate makes its tokens.

Default run: a few thousand steps in well under a minute.  More: CT_MODEL_EXAMPLES=2000 (and
optionally CT_MODEL_STEPS=200) python -m pytest tests/test_gate_model.py -q
"""
from __future__ import annotations

import json
import os
from collections import Counter
from typing import Any, Optional

import pytest
import redis
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, rule,
                                 run_state_machine_as_test)

from celery_threads import gate as gate_module
from celery_threads.gate import Gate, parse_record
from celery_threads.keys import Keys
from tests import model as M

DB = 5
PREFIX = "ctmodel"
RELEASE_TIMEOUT = 100          # ms
KEEPALIVE = 1500               # ms; the gate's own keepalive only names itself in death reasons
START = 1_700_000_000_000      # the fake clock's first reading, ms (a realistic epoch time)
THREAD_IDS = ["a", "b", "c:q", "é"]

EXAMPLES = int(os.environ.get("CT_MODEL_EXAMPLES", "60"))
STEPS = int(os.environ.get("CT_MODEL_STEPS", "60" if "CT_MODEL_EXAMPLES" not in os.environ
                           else "120"))

# Counters for reporting how much a run exercised (printed with -s).
STATS: dict[str, int] = {"examples": 0, "steps": 0}
OUTCOMES: Counter[str] = Counter()


def note(what: str) -> None:
    OUTCOMES[what] += 1


class GateMachine(RuleBasedStateMachine):
    url: str = ""
    # Expire of a thread with nothing active (a sweep acting on a stale scan) releases a due head
    # but does not report the release: see test_expire_of_an_idle_thread_reports_its_release.
    EXPIRE_IDLE = False

    def __init__(self) -> None:
        super().__init__()
        self.r = redis.Redis.from_url(self.url)
        self.r.flushdb()
        self.keys = Keys(PREFIX)
        self.shard = self.keys.shard(0)
        self.model = M.Model(release_timeout_ms=RELEASE_TIMEOUT, keepalive_ms=KEEPALIVE,
                             max_republish_backoff=gate_module.MAX_REPUBLISH_BACKOFF, now=START)
        self.gate = Gate(self.r, self.keys, release_timeout_ms=RELEASE_TIMEOUT,
                         keepalive_ms=KEEPALIVE, clock=lambda: self.model.now)
        self.m2r: dict[str, str] = {}            # model token -> gate token
        self.r2m: dict[str, str] = {}
        self.issued: list[tuple[str, str, str, str]] = []   # (thread, task, model tok, gate tok)
        self.task_ids: list[str] = []            # every task id used so far
        self.serial = 0
        STATS["examples"] += 1

    # -- comparing --------------------------------------------------------------------------
    def bind(self, thread_id: str, task_id: str, mtok: str, rtok: str) -> None:
        """The model's token ``mtok`` is the gate's ``rtok``: one to one, for good."""
        if mtok in self.m2r:
            assert self.m2r[mtok] == rtok, f"token of {task_id}: model {mtok}, gate {rtok}"
            return
        assert rtok not in self.r2m, f"gate reused token {rtok} for a new release of {task_id}"
        self.m2r[mtok], self.r2m[rtok] = rtok, mtok
        self.issued.append((thread_id, task_id, mtok, rtok))

    def same_outcome(self, real: gate_module.Outcome, expected: M.Outcome, what: str) -> None:
        note(f"{what.split()[0]} -> {expected.status} {expected.info}"
             f"{' +release' if expected.release else ''}")
        assert (real.status, real.info) == (expected.status, expected.info), (
            f"{what}: gate {real.status, real.info}, model {expected.status, expected.info}")
        if expected.release is None or real.release is None:
            assert real.release is None and expected.release is None, (
                f"{what}: gate released {real.release}, model released {expected.release}")
            return
        g, m = real.release, expected.release
        assert (g.thread_id, g.task_id, g.retries, g.envelope) == (
            m.thread_id, m.task_id, m.retries, m.envelope), f"{what}: gate {g}, model {m}"
        self.bind(m.thread_id, m.task_id, m.token, g.token)

    def next_task_id(self) -> str:
        self.serial += 1
        task_id = f"task-{self.serial}"
        self.task_ids.append(task_id)
        return task_id

    def envelope(self, task_id: str) -> bytes:
        self.serial += 1
        return f"body of {task_id} #{self.serial}\nsecond line".encode()

    def target(self, pick: int, kind: int) -> Optional[tuple[str, str, str, str]]:
        """A (thread, task, model token, gate token) a worker might hold: mostly the active
        member with its right token, else any earlier release (stale or not), else a bogus one."""
        actives = [t for t in sorted(self.model.threads.values(), key=lambda t: t.thread_id)
                   if t.active is not None]
        if kind < 6 and actives:
            t = actives[pick % len(actives)]
            return t.thread_id, t.active.task_id, t.active.token, self.m2r[t.active.token]
        if kind < 9 and self.issued:
            return self.issued[pick % len(self.issued)]
        if self.task_ids:
            task_id = self.task_ids[pick % len(self.task_ids)]
            thread_id = self.model.tasks.get(task_id, THREAD_IDS[pick % len(THREAD_IDS)])
            return thread_id, task_id, "bogus", "bogus"
        return None

    def known_task(self, pick: int) -> str:
        pool = self.task_ids + ["never-enqueued"]
        return pool[pick % len(pool)]

    # -- rules ------------------------------------------------------------------------------
    @rule(step=st.one_of(st.integers(0, 20), st.integers(0, 3 * RELEASE_TIMEOUT),
                         st.sampled_from([RELEASE_TIMEOUT, KEEPALIVE, 64 * RELEASE_TIMEOUT,
                                          500 * RELEASE_TIMEOUT])))
    def advance_clock(self, step: int) -> None:
        self.model.now += step
        STATS["steps"] += 1

    @rule(thread_id=st.sampled_from(THREAD_IDS), dup=st.integers(0, 7), pick=st.integers(0, 999),
          at=st.booleans(), delay=st.one_of(st.just(0), st.integers(0, 3 * RELEASE_TIMEOUT)),
          offset=st.integers(-3 * RELEASE_TIMEOUT, 3 * RELEASE_TIMEOUT),
          max_retries=st.sampled_from([None, 0, 1, 2]),
          retry_delay=st.sampled_from([0, 10, RELEASE_TIMEOUT, 5 * RELEASE_TIMEOUT]))
    def enqueue(self, thread_id: str, dup: int, pick: int, at: bool, delay: int, offset: int,
                max_retries: Optional[int], retry_delay: int) -> None:
        if dup == 0 and self.task_ids:
            task_id = self.task_ids[pick % len(self.task_ids)]
        else:
            task_id = self.next_task_id()
        body = self.envelope(task_id)
        at_ms = self.model.now + offset if at else None
        kw: dict[str, Any] = dict(delay_ms=delay, at_ms=at_ms, max_retries=max_retries,
                                  retry_delay_ms=retry_delay)
        self.same_outcome(self.gate.enqueue(thread_id, task_id, body, **kw),
                          self.model.enqueue(thread_id, task_id, body, **kw), "enqueue")
        STATS["steps"] += 1

    @rule(limit=st.sampled_from([1, 2, 500]))
    def dispatch(self, limit: int) -> None:
        """One dispatcher tick, as Dispatcher._tick_shard does it."""
        scan = self.gate.scan_due(self.shard, limit)
        expected = self.model.scan_due(limit)
        assert (scan.due, scan.lapsed, scan.next_ms) == (
            expected.due, expected.lapsed, expected.next_ms), f"scan: {scan} vs {expected}"
        assert scan.now_ms == self.model.now
        for thread_id, outcome in zip(scan.due, self.gate.release_many(scan.due)):
            self.same_outcome(outcome, self.model.release(thread_id), f"release {thread_id}")
        for thread_id, outcome in zip(scan.lapsed, self.gate.expire_many(scan.lapsed)):
            self.same_outcome(outcome, self.model.expire(thread_id), f"expire {thread_id}")
        STATS["steps"] += 1

    @rule(thread_id=st.sampled_from(THREAD_IDS))
    def stale_release(self, thread_id: str) -> None:
        """A dispatcher acting on an old scan: release of a thread that may not be due."""
        self.same_outcome(self.gate.release(thread_id), self.model.release(thread_id),
                          f"release {thread_id}")
        STATS["steps"] += 1

    @rule(thread_id=st.sampled_from(THREAD_IDS))
    def stale_expire(self, thread_id: str) -> None:
        """A dispatcher acting on an old scan: expire of a thread that may not have lapsed."""
        if not self.EXPIRE_IDLE:
            thread = self.model.threads.get(thread_id)
            if thread is None or thread.active is None:
                return
        self.same_outcome(self.gate.expire(thread_id), self.model.expire(thread_id),
                          f"expire {thread_id}")
        STATS["steps"] += 1

    @rule(pick=st.integers(0, 999), kind=st.integers(0, 9),
          keepalive=st.sampled_from([50, RELEASE_TIMEOUT, 1000]),
          worker=st.sampled_from(["w1", "w2"]))
    def claim(self, pick: int, kind: int, keepalive: int, worker: str) -> None:
        target = self.target(pick, kind)
        if target is None:
            return
        thread_id, task_id, mtok, rtok = target
        got = self.gate.claim(thread_id, task_id, rtok, keepalive, worker)
        expected = self.model.claim(thread_id, task_id, mtok, keepalive, worker)
        assert got == expected, f"claim: gate {got}, model {expected}"
        note(f"claim -> {expected}")
        STATS["steps"] += 1

    @rule(pick=st.integers(0, 999), kind=st.integers(0, 9),
          keepalive=st.sampled_from([50, RELEASE_TIMEOUT, 1000]))
    def renew(self, pick: int, kind: int, keepalive: int) -> None:
        target = self.target(pick, kind)
        if target is None:
            return
        thread_id, task_id, mtok, rtok = target
        assert self.gate.renew(thread_id, task_id, rtok, keepalive) == self.model.renew(
            thread_id, task_id, mtok, keepalive), "renew"
        STATS["steps"] += 1

    @rule(pick=st.integers(0, 999), kind=st.integers(0, 9))
    def renew_many(self, pick: int, kind: int) -> None:
        """The worker's batched renewal: every active member plus one possibly stale target."""
        targets = [(t.thread_id, t.active.task_id, t.active.token, self.m2r[t.active.token])
                   for t in self.model.threads.values() if t.active is not None]
        extra = self.target(pick, kind)
        if extra is not None:
            targets.append(extra)
        if not targets:
            return
        got = self.gate.renew_many([(t, k, r) for t, k, _, r in targets], 1000)
        assert got == [self.model.renew(t, k, m, 1000) for t, k, m, _ in targets], "renew_many"
        STATS["steps"] += 1

    @rule(pick=st.integers(0, 999), kind=st.integers(0, 9))
    def finish(self, pick: int, kind: int) -> None:
        target = self.target(pick, kind)
        if target is None:
            return
        thread_id, task_id, mtok, rtok = target
        self.same_outcome(self.gate.finish(thread_id, task_id, rtok),
                          self.model.finish(thread_id, task_id, mtok), "finish")
        STATS["steps"] += 1

    @rule(pick=st.integers(0, 999), kind=st.integers(0, 9), retries=st.integers(0, 3),
          at=st.booleans(), delay=st.one_of(st.just(0), st.integers(0, 3 * RELEASE_TIMEOUT)),
          offset=st.integers(-2 * RELEASE_TIMEOUT, 2 * RELEASE_TIMEOUT),
          new_body=st.booleans())
    def requeue(self, pick: int, kind: int, retries: int, at: bool, delay: int, offset: int,
                new_body: bool) -> None:
        target = self.target(pick, kind)
        if target is None:
            return
        thread_id, task_id, mtok, rtok = target
        kw: dict[str, Any] = dict(retries=retries, delay_ms=delay,
                                  at_ms=self.model.now + offset if at else None,
                                  envelope=self.envelope(task_id) if new_body else b"")
        self.same_outcome(self.gate.requeue(thread_id, task_id, rtok, **kw),
                          self.model.requeue(thread_id, task_id, mtok, **kw), "requeue")
        STATS["steps"] += 1

    @rule(pick=st.integers(0, 999), kind=st.integers(0, 9), keep=st.booleans(),
          retries=st.integers(0, 3))
    def kill(self, pick: int, kind: int, keep: bool, retries: int) -> None:
        target = self.target(pick, kind)
        if target is None:
            return
        thread_id, task_id, mtok, rtok = target
        meta = {"retries": retries, "exception": "ValueError: boom", "traceback": "tb\nline"}
        self.same_outcome(self.gate.kill(thread_id, task_id, rtok, meta, keep=keep),
                          self.model.kill(thread_id, task_id, mtok, meta, keep=keep), "kill")
        STATS["steps"] += 1

    @rule(pick=st.integers(0, 999), kind=st.integers(0, 9))
    def fail(self, pick: int, kind: int) -> None:
        target = self.target(pick, kind)
        if target is None:
            return
        thread_id, task_id, mtok, rtok = target
        reason = "WorkerLostError: gone; no retries were left"
        self.same_outcome(self.gate.fail(thread_id, task_id, rtok, reason),
                          self.model.fail(thread_id, task_id, mtok, reason), "fail")
        STATS["steps"] += 1

    @rule(pick=st.integers(0, 999), how=st.sampled_from(["any", "active", "issued", "bogus"]),
          only_waiting=st.booleans())
    def delete(self, pick: int, how: str, only_waiting: bool) -> None:
        task_id, mtok, rtok = self.known_task(pick), "", ""
        if how == "active":
            target = self.target(pick, 0)
            if target is not None:
                _, task_id, mtok, rtok = target
        elif how == "issued" and self.issued:
            _, task_id, mtok, rtok = self.issued[pick % len(self.issued)]
        elif how == "bogus":
            mtok = rtok = "bogus"
        self.same_outcome(self.gate.delete(task_id, token=rtok, only_waiting=only_waiting),
                          self.model.delete(task_id, token=mtok, only_waiting=only_waiting),
                          f"delete {task_id}")
        STATS["steps"] += 1

    @rule(pick=st.integers(0, 999), from_dead=st.integers(0, 4),
          max_retries=st.sampled_from([None, 0, 1]),
          retry_delay=st.sampled_from([0, RELEASE_TIMEOUT]))
    def restart(self, pick: int, from_dead: int, max_retries: Optional[int],
                retry_delay: int) -> None:
        dead = sorted(self.model.dead)
        task_id = dead[pick % len(dead)] if dead and from_dead else self.known_task(pick)
        kw: dict[str, Any] = dict(max_retries=max_retries, retry_delay_ms=retry_delay)
        self.same_outcome(self.gate.restart(task_id, **kw), self.model.restart(task_id, **kw),
                          f"restart {task_id}")
        STATS["steps"] += 1

    @rule(pick=st.integers(0, 999), from_dead=st.booleans())
    def forget(self, pick: int, from_dead: bool) -> None:
        dead = sorted(self.model.dead)
        task_id = dead[pick % len(dead)] if dead and from_dead else self.known_task(pick)
        assert self.gate.forget(task_id) == self.model.forget(task_id), f"forget {task_id}"
        STATS["steps"] += 1

    # -- the agreement, after every step ------------------------------------------------------
    @invariant()
    def gate_agrees_with_model(self) -> None:
        model = self.model
        for thread_id in sorted(set(THREAD_IDS) | set(model.threads)):
            self.check_thread(thread_id, model.threads.get(thread_id))

        # Indexes: exactly the idle threads in due (scored by head), the active ones in leases.
        due = {k.decode(): int(s) for k, s in self.r.zrange(self.shard.due, 0, -1,
                                                             withscores=True)}
        leases = {k.decode(): int(s) for k, s in self.r.zrange(self.shard.leases, 0, -1,
                                                                withscores=True)}
        assert due == model.due_index(), f"due index {due} vs model {model.due_index()}"
        assert leases == model.lease_index(), f"leases {leases} vs model {model.lease_index()}"
        assert not set(due) & set(leases), "a thread in both indexes"
        listed = list(self.gate.thread_ids())
        assert sorted(listed) == sorted(model.threads), f"thread_ids {listed}"

        tasks = {k.decode(): v.decode() for k, v in self.r.hgetall(self.shard.tasks).items()}
        assert tasks == model.tasks, f"tasks index {tasks} vs {model.tasks}"
        for task_id in self.task_ids[-5:] + ["never-enqueued"]:
            assert self.gate.thread_of(task_id) == model.thread_of(task_id)

        dead = {d.task_id: (d.meta, d.envelope, d.died_at_ms) for d in self.gate.dead_records()}
        expected = {d.task_id: (d.meta, d.envelope, d.died_at_ms) for d in model.dead.values()}
        assert dead == expected, f"dead letters {dead} vs {expected}"
        assert self.r.zcard(self.shard.dead) == self.r.hlen(self.shard.dead_records)

        self.check_keys()

    def check_thread(self, thread_id: str, thread: Optional[M.Thread]) -> None:
        snap = self.gate.snapshot(thread_id)
        if thread is None:
            assert snap is None, f"thread {thread_id} exists in the gate only: {snap}"
            return
        assert snap is not None, f"thread {thread_id} missing from the gate"
        what = f"thread {thread_id}"
        if thread.active is None:
            assert snap.active == {}, f"{what}: gate active {snap.active}, model idle"
            assert snap.due_at == thread.waiting()[0].sched, f"{what}: due_at {snap.due_at}"
        else:
            a, ga = thread.active, snap.active
            assert (ga["task"], ga["state"]) == (a.task_id, a.state), f"{what}: {ga} vs {a}"
            assert int(ga["deadline"]) == a.deadline, f"{what}: deadline {ga} vs {a}"
            assert int(ga["n"]) == a.n, f"{what}: republications {ga} vs {a}"
            if a.state == M.RUNNING:
                assert ga["worker"] == a.worker, f"{what}: worker {ga} vs {a}"
            self.bind(thread_id, a.task_id, a.token, ga["token"])
            assert snap.due_at is None, f"{what}: active and due at {snap.due_at}"
        waiting = [(m.task_id, m.sched) for m in thread.waiting()]
        assert snap.waiting == waiting, f"{what}: waiting {snap.waiting} vs model {waiting}"
        records = {}
        for task_id, raw in snap.records.items():
            _, retries, max_retries, delay, body = parse_record(raw)
            records[task_id] = (retries, max_retries, delay, body)
        expected = {m.task_id: (m.retries, m.max_retries, m.retry_delay_ms, m.envelope)
                    for m in thread.members.values()}
        assert records == expected, f"{what}: records {records} vs model {expected}"

    def check_keys(self) -> None:
        """Exactly the keys the model's state needs: none of a gone thread, no empty leftovers."""
        s = self.shard
        expected: set[str] = set()      # the shard's seq counter lives on; it is not checked
        for key, present in ((s.due, self.model.due_index()), (s.leases, self.model.lease_index()),
                             (s.tasks, self.model.tasks), (s.dead, self.model.dead),
                             (s.dead_records, self.model.dead)):
            if present:
                expected.add(key)
        for thread in self.model.threads.values():
            k = s.thread(thread.thread_id)
            expected.add(k.members)
            if thread.waiting():
                expected.add(k.queue)
            if thread.active is not None:
                expected.add(k.active)
        actual = {k.decode() for k in self.r.scan_iter(match="*", count=1000)}
        actual.discard(s.seq)
        assert actual == expected, (f"keys: unexpected {sorted(actual - expected)}, "
                                    f"missing {sorted(expected - actual)}")


@pytest.fixture
def gate_url(redis_server) -> str:
    url = redis_server.url(DB)
    assert f":{redis_server.port}/" in url and redis_server.port != 6379
    return url


def test_gate_matches_model(gate_url: str) -> None:
    GateMachine.url = gate_url
    STATS.update(examples=0, steps=0)
    OUTCOMES.clear()
    run_state_machine_as_test(GateMachine, settings=settings(
        max_examples=EXAMPLES, stateful_step_count=STEPS, deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much]))
    print(f"\ngate model: {STATS['examples']} examples, {STATS['steps']} steps")
    if os.environ.get("CT_MODEL_VERBOSE"):
        for what, n in sorted(OUTCOMES.items()):
            print(f"  {n:6d}  {what}")
