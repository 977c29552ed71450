"""Model-based test of the gate: random operations on the real Lua scripts and on tests/support/model.py.

A hypothesis state machine drives the gate (``celery_threads.gate.Gate`` on the tests' private
redis-server, with an injected clock) and the reference model (:mod:`tests.support.model`) with the same
operations: enqueues (delay or absolute time, duplicate task ids), the dispatcher's tick (scan,
release of due heads, lease sweep), stale dispatcher calls, claims, renewals, hand-backs at
shutdown, the endings (finish, requeue, kill, fail), deletes, restarts and forgets of dead tasks,
fenced calls with stale or bogus tokens, clock advances, and jumps of the shard counter.  The
counter (arrival numbers and tokens) starts unset or just below a byte boundary up to 3 * 2^48, and
jumps forward to just below the next one during a run, with members arriving at once: members tied
on scheduled_at then sit on both sides of it, and their order rests on the queue member's whole
encoding (length byte, big-endian seq).  After every step both must agree on
every thread (active member, waiting order, member records), on the due / leases / tasks indexes,
on the dead letters, and no key of a thread that no longer exists may remain.

Fencing tokens are compared through a one-to-one mapping (model token <-> gate token), so the test
does not depend on how the gate makes its tokens.

Default: 100 examples of up to 80 steps (about 6,000 steps) as functions, a quarter of them as
scripts.  A longer run, without the 300 s pytest timeout (CT_MODEL_STEPS defaults to 200 then;
CT_MODEL_VERBOSE=1 prints what the operations returned, to see what was exercised):

    CT_MODEL_EXAMPLES=2000 python -m pytest tests/gate/test_gate_model.py -q -s
"""

from __future__ import annotations

import base64
import json
import os
import uuid
from collections import Counter
from typing import Any, Optional

import pytest
import redis
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from celery_threads import gate as gate_module
from celery_threads.gate import (
    Gate,
    ReleasePush,
    member_field,
    parse_record,
    pause_reason,
    record_task,
    task_field,
)
from celery_threads.keys import Keys
from celery_threads.publish import encode_envelope
from tests.support import model as M

DB = 5
PREFIX = "ctmodel"
# The broker the gate publishes releases on itself (lua/_common.lua publish_direct): kombu's Redis
# transport in another database of the same server (the script switches to it and back).
BROKER_DB = 6
BROKER_PREFIX = "ctbroker:"
ROUTING_KEY = "ctq"
RELEASE_TIMEOUT = 100  # ms
KEEPALIVE = 1500  # ms; the gate's own keepalive only names itself in death reasons
# The fake clock's first reading, ms.  The shard counter never falls below the clock in
# microseconds (lua/_common.lua next_seq): at 10^9 ms that floor (10^12, just below 2^40) sits
# among the counter's starts below, so some starts are overtaken by it (arrival numbers jump to
# the clock, as when a gate of an older version is upgraded) and others lie above it.
START = 1_000_000_000
THREAD_IDS = ["a", "b", "c:q", "é"]
#: A member's policies (celery_threads.policies.policy_text): none (most), on_death="hold",
#: thread_rate_limit (an interval in ms of the test's clock), or both.
#: A member's own policy (its record's: on_death="hold", thread_rate_limit's interval).
OWN_POLICIES = st.sampled_from(["", "", "", "h", f"r{10 * RELEASE_TIMEOUT}", f"hr{RELEASE_TIMEOUT + 50}"])
UNKNOWN = "never-enqueued"
#: A claim's claimant: none (an older worker's claim, or a holder of an unclaimed release) or one
#: of two deliveries'.
CLAIMANTS = st.sampled_from(["", "c1", "c2"])
#: A main process's fence on its endings (a pool process's claimant prefix): none, one no
#: claimant has, one both claimants begin with, each claimant's, another.
HOLDERS = [None, "\0", "c", "c1", "c2", "w"]

EXAMPLES = int(os.environ.get("CT_MODEL_EXAMPLES", "100"))
#: The suite's run draws the same examples every time (a red CI is then the code's, not the
#: draw's); the long run (CT_MODEL_EXAMPLES) draws new ones each time, to find what they miss.
DERANDOMIZE = "CT_MODEL_EXAMPLES" not in os.environ
STEPS = int(os.environ.get("CT_MODEL_STEPS", "200" if "CT_MODEL_EXAMPLES" in os.environ else "80"))

Target = tuple[str, str, str, str]  # (thread id, task id, model token, gate token)

# Where the shard counter (arrival numbers and tokens) starts: 0 (not set), or a little below
# a byte boundary of the queue member's big-endian seq, m * 2^bits (bits 8 ... 48), so that
# members tied on scheduled_at get arrival numbers on both sides of it and their order rests on
# the encoding (lua/_member.lua, queue_member) at every length from one byte to seven: m = 1
# changes the length byte (2^16 - 1 -> 2^16), m = 2 or 3 a byte above the last one at the same
# length (0x1ff -> 0x200).  At most 3 * 2^48: Lua's numbers are exact below 2^53.
BOUNDARY_BITS = [8, 16, 24, 32, 40, 48]


def byte_boundary(bits: int, times: int, below: int) -> int:
    return times * 2**bits - below if bits else 0


MAX_COUNTER = 3 * 2**48
COUNTER_STARTS = st.builds(
    byte_boundary, st.sampled_from([0, *BOUNDARY_BITS]), st.sampled_from([1, 2, 3]), st.integers(1, 8)
)

# An enqueue's coalesce/debounce (lua/enqueue.lua ARGV[13]): none, or (task name, debounce ms,
# debounce_max ms) of one of two task names, so that calls of one supersede each other and not
# the other's.  Half of the enqueues have one.
POLICIES = st.one_of(
    st.just((None, 0, 0)),
    st.tuples(
        st.sampled_from(["sync", "other"]),
        st.sampled_from([0, 0, 50, 3 * RELEASE_TIMEOUT]),
        st.sampled_from([0, 0, 2 * RELEASE_TIMEOUT]),
    ),
)

# What every run must have exercised (a count in STATS), and what it means when it did not.
EXERCISED = {
    "long UUID fields": "no state had two members sharing a UUID's first bytes",
    "ties across a length": "no queue held tied members of seqs of two lengths",
    "ties across a byte": "no queue held tied members across a byte boundary",
    "coalescing enqueues": "no enqueue with coalesce or debounce",
    "superseding enqueues": "no enqueue superseded a waiting call",
    "replays told what they superseded": "no replay of a superseding enqueue",
    "lingering policy hashes": "no thread ended with policy state",
}

# What a run exercised: printed with -s; the outcome breakdown with CT_MODEL_VERBOSE=1.
STATS: Counter[str] = Counter()
# The stats hash's fields every run must move (lua/_common.lua count).
COUNTERS = ("ended:succeeded", "ended:dead", "ended:deleted", "retries", "lapses", "running", "w:sum")
OUTCOMES: Counter[str] = Counter()


def note(what: str) -> None:
    OUTCOMES[what] += 1


def without_seq(meta: dict[str, Any]) -> dict[str, Any]:
    """A dead record's meta without the arrival number the gate keeps in it (the model's seqs
    are its own; the order they give is checked through the redriven members' places)."""
    assert isinstance(meta.get("seq"), int), f"dead record without its seq: {meta}"
    return {k: v for k, v in meta.items() if k != "seq"}


def has_active(self: GateMachine) -> bool:
    return any(t.active is not None for t in self.model.threads.values())


def has_dead(self: GateMachine) -> bool:
    return bool(self.model.dead)


class GateMachine(RuleBasedStateMachine):
    client: redis.Redis  # set by the test, shared by every example
    broker_client: redis.Redis  # the same server's BROKER_DB
    # Expire of a thread with nothing active releases its due head without reporting the
    # release (see test_expire_of_an_idle_thread_reports_its_release): while that stands, the
    # machine sends expire only to threads with an active member, as a live dispatcher does.
    EXPIRE_IDLE = True
    # The hot path calls the library's functions (FCALL, Redis 7+) or the scripts (EVALSHA).
    FUNCTIONS = True

    def __init__(self) -> None:
        super().__init__()
        self.r = self.client
        self.r.flushdb()
        self.keys = Keys(PREFIX)
        self.shard = self.keys.shard(0)
        self.broker = self.broker_client
        self.broker.flushdb()
        self.model = M.Model(
            release_timeout_ms=RELEASE_TIMEOUT,
            keepalive_ms=KEEPALIVE,
            max_republish_backoff=gate_module.MAX_REPUBLISH_BACKOFF,
            now=START,
            direct=True,
        )
        self.gates: dict[int, Gate] = {}
        self.gate = self.leasing(KEEPALIVE)
        self.m2r: dict[str, str] = {}  # model token -> gate token
        self.r2m: dict[str, str] = {}
        self.last_token: dict[str, int] = {}  # thread id -> its latest release's gate token
        self.issued: list[Target] = []  # every release so far
        self.task_ids: list[str] = []  # every task id used so far
        # Coalescing enqueues so far (thread id, task id, body, arguments), to replay them.
        self.coalescing: list[tuple[str, str, bytes, dict[str, Any]]] = []
        self.caller: Optional[str] = None  # the current ending's own id (None: a fresh one)
        self.last_ending: Optional[tuple[str, Any, Any]] = None
        self.serial = 0
        self.checks = 0
        self.counter_start = 0  # where the shard counter started (0: unset)
        self.last_redrive: Optional[tuple[str, list[Any], str]] = None
        self.last_replacement: Optional[tuple[str, str, bytes, int]] = None
        self.pushed: dict[str, Any] = {}  # messages the gate published, by their token
        STATS["examples"] += 1

    # -- helpers ----------------------------------------------------------------------------
    def leasing(self, keepalive: int) -> Gate:
        """The gate as a worker with this keepalive drives it: a ``Gate`` holds one keepalive
        (its claims and renewals give it), where the model takes it per call."""
        gate = self.gates.get(keepalive)
        if gate is None:
            gate = self.gates[keepalive] = Gate(
                self.r,
                self.keys,
                release_timeout_ms=RELEASE_TIMEOUT,
                keepalive_ms=keepalive,
                clock=lambda: self.model.now,
                functions=self.FUNCTIONS,
                direct=ReleasePush(DB, BROKER_DB, BROKER_PREFIX),
            )
        return gate

    def bind(self, thread_id: str, task_id: str, mtok: str, rtok: str) -> None:
        """The model's token ``mtok`` is the gate's ``rtok``, one to one and for good."""
        if mtok in self.m2r:
            assert self.m2r[mtok] == rtok, f"token of {task_id}: model {mtok}, gate {rtok}"
            return
        assert rtok not in self.r2m, f"gate reused token {rtok} for a new release of {task_id}"
        # Users fence their own writes with it: a decimal string, larger for every later release
        # of the thread, and never below the clock in microseconds (lua/_common.lua next_seq).
        assert rtok.isdigit() and int(rtok) >= self.model.now * 1000, f"token {rtok!r}"
        assert int(rtok) > self.last_token.get(thread_id, 0), (
            f"token {rtok} of {thread_id} after {self.last_token[thread_id]}"
        )
        # A paused thread releases nothing: no new token until it is resumed.
        assert thread_id not in self.model.paused, f"paused {thread_id} released {task_id}"
        self.last_token[thread_id] = int(rtok)
        self.m2r[mtok], self.r2m[rtok] = rtok, mtok
        self.issued.append((thread_id, task_id, mtok, rtok))

    def same_outcome(self, real: gate_module.Outcome, expected: M.Outcome, what: str) -> None:
        info = "<task>" if expected.info in self.task_ids else expected.info
        note(f"{what:8} -> {expected.status} {info}{' +release' if expected.release else ''}")
        STATS["calls"] += 1
        assert (real.status, real.info) == (expected.status, expected.info), (
            f"{what}: gate {real.status, real.info}, model {expected.status, expected.info}"
        )
        if expected.release is None or real.release is None:
            assert real.release is None and expected.release is None, (
                f"{what}: gate released {real.release}, model released {expected.release}"
            )
            return
        g, m = real.release, expected.release
        assert g.published == m.published, f"{what}: gate {g}, model {m} (published)"
        if g.published:
            STATS["published by the gate"] += 1
            self.check_published(g, m, what)
        else:
            assert (g.thread_id, g.task_id, g.retries, g.envelope) == (
                m.thread_id,
                m.task_id,
                m.retries,
                m.envelope,
            ), f"{what}: gate {g}, model {m}"
        self.bind(m.thread_id, m.task_id, m.token, g.token)

    def check_published(self, g: gate_module.Release, m: M.Release, what: str) -> None:
        """The message the gate pushed (lua/_common.lua publish_direct) is the one kombu's Redis
        transport would have: the stored headers plus the release's (retries as the model
        counts them, the gate's token), the body as published, the delivery info."""
        assert (g.thread_id, g.task_id, g.retries, g.envelope) == (m.thread_id, m.task_id, 0, b""), (
            f"{what}: gate {g}"
        )
        # A batch (release_many, expire_many) publishes all its releases before they are read.
        for raw in self.broker.lpop(BROKER_PREFIX + ROUTING_KEY, 1000) or []:
            pushed = json.loads(raw)
            self.pushed[pushed["headers"]["thread_token"]] = pushed
        message = self.pushed.pop(g.token, None)
        assert message is not None, f"{what}: {g} published, but no message on the broker"
        header, _, body = m.envelope.partition(b"\n")
        stored = json.loads(header)
        assert message["headers"] == {
            **stored["headers"],
            "retries": m.retries,
            "eta": None,
            "thread_id": m.thread_id,
            "thread_token": g.token,
        }, f"{what}: headers {message['headers']} of {m}"
        props = message["properties"]
        encoding = props.pop("body_encoding")
        sent = base64.b64decode(message["body"]) if encoding == "base64" else message["body"].encode()
        assert (encoding, sent) == ("utf-8" if stored["d"] == 2 else "base64", body), (
            f"{what}: body {message['body']!r} ({encoding}) of {m}"
        )
        assert props.pop("delivery_tag").startswith(f"{self.shard.seq}:{g.token}:"), props
        assert props == {
            **stored["properties"],
            "priority": 0,
            "delivery_info": {"exchange": "", "routing_key": ROUTING_KEY},
        }, props
        assert (message["content-type"], message["content-encoding"]) == (
            stored["content_type"],
            stored["content_encoding"],
        ), message

    def same(self, real: Any, expected: Any, what: str) -> None:
        note(
            f"{what:8} -> {sum(expected)} of {len(expected)} renewed"
            if what == "renew_many"
            else f"{what:8} -> {expected}"
        )
        STATS["calls"] += 1
        assert real == expected, f"{what}: gate {real}, model {expected}"

    def next_task_id(self) -> str:
        self.serial += 1
        # Half of them Celery's kind (a UUID, keyed by its first 14 bytes), and half of those
        # sharing their first 14 bytes with the UUID before them (keyed by their long form while
        # that one is a member).
        mix = 0x9E3779B97F4A7C15
        if self.serial % 2:
            task_id = f"task-{self.serial}"
        elif self.serial % 4 == 0:
            task_id = str(uuid.UUID(int=self.serial * mix))
        else:
            task_id = str(uuid.UUID(int=((self.serial - 2) * mix & ~0xFFFF) | (self.serial * mix & 0xFFFF)))
        self.task_ids.append(task_id)
        return task_id

    def envelope(self, task_id: str) -> bytes:
        """A message as stored; every third one a message the gate publishes itself (Celery's
        to a plain Redis queue), with a UTF-8 body or a binary one (then base64-encoded)."""
        self.serial += 1
        body = f"body of {task_id} #{self.serial}\nsecond line".encode()
        if self.serial % 3:
            return body
        if self.serial % 2:
            body = b"\xff\x00" + body
        return encode_envelope(
            body,
            dict(
                exchange="",
                routing_key=ROUTING_KEY,
                content_type="application/x-test",
                content_encoding="binary",
                delivery_mode=2,
                correlation_id=task_id,
                headers={"id": task_id, "task": "proj.t", "argsrepr": "(1, 'é')"},
            ),
        )

    def active_target(self, pick: int) -> Target:
        """An active member with its right token (what the worker holding it has)."""
        actives = [
            t for t in sorted(self.model.threads.values(), key=lambda t: t.thread_id) if t.active is not None
        ]
        t = actives[pick % len(actives)]
        assert t.active is not None
        return t.thread_id, t.active.task_id, t.active.token, self.m2r[t.active.token]

    def stale_target(self, pick: int, bogus: bool) -> Target:
        """Any earlier release (most are stale by now), or a known task with a bogus token."""
        if self.issued and not bogus:
            return self.issued[pick % len(self.issued)]
        task_id = self.known_task(pick)
        thread_id = self.model.tasks.get(task_id, THREAD_IDS[pick % len(THREAD_IDS)])
        return thread_id, task_id, "bogus", "bogus"

    def known_task(self, pick: int) -> str:
        pool = self.task_ids + [UNKNOWN]
        return pool[pick % len(pool)]

    # -- the outside world --------------------------------------------------------------------
    @initialize(
        members=st.lists(
            st.tuples(
                st.sampled_from(THREAD_IDS),
                st.one_of(st.just(0), st.integers(0, 300)),
                st.sampled_from([None, 0, 1, 2]),
            ),
            min_size=1,
            max_size=10,
        ),
        counter=COUNTER_STARTS,
    )
    def seed(self, members: list[tuple[str, int, Optional[int]]], counter: int) -> None:
        """Some members to begin with (the rule choice may leave enqueue out of an example),
        with the shard counter at ``counter`` first: a gate that has run for a while, whose
        arrival numbers cross a byte boundary of their queue members during the example."""
        if counter:
            self.r.set(self.shard.seq, counter)
            self.counter_start = counter
        for thread_id, delay, max_retries in members:
            task_id = self.next_task_id()
            body = self.envelope(task_id)
            self.same_outcome(
                self.gate.enqueue(
                    thread_id,
                    task_id,
                    body,
                    delay_ms=delay,
                    max_retries=max_retries,
                    retry_delay_ms=RELEASE_TIMEOUT,
                ),
                self.model.enqueue(
                    thread_id,
                    task_id,
                    body,
                    delay_ms=delay,
                    max_retries=max_retries,
                    retry_delay_ms=RELEASE_TIMEOUT,
                ),
                "enqueue",
            )

    @rule(
        step=st.one_of(
            st.integers(0, 20),
            st.integers(0, 3 * RELEASE_TIMEOUT),
            st.sampled_from([RELEASE_TIMEOUT, KEEPALIVE, 64 * RELEASE_TIMEOUT, 500 * RELEASE_TIMEOUT]),
        )
    )
    def advance_clock(self, step: int) -> None:
        self.model.now += step

    @rule(
        step=st.one_of(
            st.integers(0, 3 * RELEASE_TIMEOUT), st.sampled_from([KEEPALIVE, 64 * RELEASE_TIMEOUT])
        )
    )
    def time_passes(self, step: int) -> None:
        """Time passes and the dispatcher ticks."""
        self.advance_clock(step)
        self.dispatch(500)

    @rule(
        place=st.sampled_from([0, 0, 1, 2, 3]),
        below=st.integers(1, 3),
        thread_id=st.sampled_from(THREAD_IDS),
        arrivals=st.integers(0, 3),
        max_retries=st.sampled_from([None, 0, 1]),
    )
    def counter_jumps(
        self, place: int, below: int, thread_id: str, arrivals: int, max_retries: Optional[int]
    ) -> None:
        """Other threads of the shard spend arrival numbers meanwhile: the counter moves on to
        just below the next multiple of 256^place (place 0, or at least the counter's length in
        bytes: where arrival numbers grow a byte longer), and ``arrivals`` members arrive at
        once, tied with each other and with the thread's members already waiting since this
        instant, on both sides of the boundary.  The model keeps arrival order only, which a
        jump forward does not change."""
        current = int(self.r.get(self.shard.seq) or 0)
        length = max(1, (current.bit_length() + 7) // 8)
        unit = 256 ** (min(place, length) if place else length)
        target = (current // unit + 1) * unit - below
        if current < target <= MAX_COUNTER:
            self.r.set(self.shard.seq, target)
        for _ in range(arrivals):
            self.enqueue(
                thread_id,
                dup=7,
                pick=0,
                at=False,
                delay=0,
                offset=0,
                max_retries=max_retries,
                retry_delay=RELEASE_TIMEOUT,
            )

    @rule(
        thread_id=st.sampled_from(THREAD_IDS),
        dup=st.integers(0, 7),
        pick=st.integers(0, 999),
        at=st.booleans(),
        delay=st.one_of(st.just(0), st.integers(0, 3 * RELEASE_TIMEOUT)),
        offset=st.integers(-3 * RELEASE_TIMEOUT, 3 * RELEASE_TIMEOUT),
        max_retries=st.sampled_from([None, 0, 1, 2]),
        retry_delay=st.sampled_from([0, 10, RELEASE_TIMEOUT, 5 * RELEASE_TIMEOUT]),
        policy=POLICIES,
        own=OWN_POLICIES,
        cap=st.sampled_from([None, None, None, 1, 2]),
    )
    def enqueue(
        self,
        thread_id: str,
        dup: int,
        pick: int,
        at: bool,
        delay: int,
        offset: int,
        max_retries: Optional[int],
        retry_delay: int,
        policy: tuple[Optional[str], int, int] = (None, 0, 0),
        own: str = "",
        cap: Optional[int] = None,
    ) -> None:
        """``policy``: coalesce or debounce; ``own``: the member's (on_death="hold",
        thread_rate_limit); ``cap``: max_waiting."""
        dead = sorted(self.model.dead)
        if dup == 0 and self.task_ids:
            task_id = self.task_ids[pick % len(self.task_ids)]  # likely a duplicate
        elif dup == 1 and dead:
            task_id = dead[pick % len(dead)]  # a dead task's id, reused
        else:
            task_id = self.next_task_id()
        body = self.envelope(task_id)
        kw: dict[str, Any] = dict(
            delay_ms=delay,
            at_ms=self.model.now + offset if at else None,
            max_retries=max_retries,
            retry_delay_ms=retry_delay,
            policy=own,
            max_waiting=cap,
        )
        if policy[0] is not None:
            kw.update(coalesce=policy[0], debounce_ms=policy[1], debounce_max_ms=policy[2])
            STATS["coalescing enqueues"] += 1
        self._enqueue(thread_id, task_id, body, kw)
        if policy[0] is not None:
            self.coalescing.append((thread_id, task_id, body, kw))

    def _enqueue(self, thread_id: str, task_id: str, body: bytes, kw: dict[str, Any]) -> None:
        expected = self.model.enqueue(thread_id, task_id, body, **kw)
        self.same_outcome(self.gate.enqueue(thread_id, task_id, body, **kw), expected, "enqueue")
        if expected.status == 2:
            STATS["refused by max_waiting"] += 1
        elif expected.info:
            STATS["superseding enqueues" if expected.status else "replays told what they superseded"] += 1

    @rule(
        thread_id=st.sampled_from(THREAD_IDS),
        calls=st.integers(2, 4),
        delay=st.integers(0, 50),
        policy=POLICIES.filter(lambda p: p[0] is not None),
        replay=st.booleans(),
    )
    def coalescing_burst(
        self, thread_id: str, calls: int, delay: int, policy: tuple[Optional[str], int, int], replay: bool
    ) -> None:
        """New calls of one task in a row, a few ms apart: each supersedes the one before
        while it waits (and takes its place), or finds it released; ``replay``: the last one
        is sent again (its reply lost)."""
        for _ in range(calls):
            task_id = self.next_task_id()
            kw: dict[str, Any] = dict(
                delay_ms=delay, coalesce=policy[0], debounce_ms=policy[1], debounce_max_ms=policy[2]
            )
            self._enqueue(thread_id, task_id, self.envelope(task_id), kw)
            self.coalescing.append((thread_id, task_id, self.envelope(task_id), kw))
            self.model.now += 7
        if replay:
            self._enqueue(*self.coalescing[-1])

    @precondition(lambda self: bool(self.coalescing))
    @rule(back=st.integers(0, 3))
    def replay_coalescing_enqueue(self, back: int) -> None:
        """A coalescing enqueue sent again (its reply lost): it supersedes nothing more, and is
        told what it superseded while it is its task's latest call in the thread."""
        self._enqueue(*self.coalescing[-1 - back % len(self.coalescing)])

    @rule(
        thread_id=st.sampled_from(THREAD_IDS),
        every=st.sampled_from([10 * RELEASE_TIMEOUT, RELEASE_TIMEOUT + 50]),
        hold=st.booleans(),
    )
    def rate_limited_pair(self, thread_id: str, every: int, hold: bool) -> None:
        """Two members of a rate-limited task arrive together, and the active member (the
        first, when the thread was idle) ends at once: the next one's turn comes early, and it
        waits at its place until the dispatcher releases it."""
        for _ in range(2):
            self.enqueue(
                thread_id,
                dup=7,
                pick=0,
                at=False,
                delay=0,
                offset=0,
                max_retries=0,
                retry_delay=0,
                own=("h" if hold else "") + f"r{every}",
            )
        thread = self.model.threads.get(thread_id)
        if thread is not None and thread.active is not None:
            task_id, mtok = thread.active.task_id, thread.active.token
            rtok = self.m2r[mtok]
            self.caller = f"call-{len(self.task_ids)}-{STATS['calls']}"
            self._ending(
                "finish",
                lambda: self.gate.finish(thread_id, task_id, rtok, caller=self.caller),
                lambda: self.model.finish(thread_id, task_id, mtok, caller=self.caller),
            )

    @rule(pick=st.integers(0, 999), keep=st.booleans())
    def held_death(self, pick: int, keep: bool) -> None:
        """A member with on_death="hold" and no retries left arrives in an idle thread, is
        released at once, and dies: its thread is held (the other rules redrive, restart,
        forget or resume it).  Not left to the draws alone: the coverage check below needs it
        reached whatever the examples drawn."""
        idle = [
            t
            for t in THREAD_IDS
            if t not in self.model.paused
            and (t not in self.model.threads or self.model.threads[t].active is None)
        ]
        if not idle:
            return
        thread_id = idle[pick % len(idle)]
        self.enqueue(
            thread_id, dup=7, pick=0, at=False, delay=0, offset=0, max_retries=0, retry_delay=0, own="h"
        )
        thread = self.model.threads.get(thread_id)
        if thread is None or thread.active is None:
            return
        task_id, mtok = thread.active.task_id, thread.active.token
        self.caller = f"call-{len(self.task_ids)}-{STATS['calls']}"
        self._kill(thread_id, task_id, mtok, self.m2r[mtok], keep, 0)

    # -- the dispatcher -----------------------------------------------------------------------
    @rule(limit=st.sampled_from([1, 2, 500]))
    def dispatch(self, limit: int) -> None:
        """One dispatcher tick, as Dispatcher._tick_shard does it."""
        scan = self.gate.reads.scan_due(self.shard, limit)
        expected = self.model.scan_due(limit)
        assert (scan.now_ms, scan.due, scan.lapsed, scan.next_ms) == (
            self.model.now,
            expected.due,
            expected.lapsed,
            expected.next_ms,
        ), f"scan: gate {scan}, model {expected}"
        note(f"scan     -> {len(scan.due)} due, {len(scan.lapsed)} lapsed")
        for thread_id, outcome in zip(scan.due, self.gate.release_many(scan.due)):
            self.same_outcome(outcome, self.model.release(thread_id), "release")
        for thread_id, outcome in zip(scan.lapsed, self.gate.expire_many(scan.lapsed)):
            self.same_outcome(outcome, self.model.expire(thread_id), "expire")

    @rule(thread_id=st.sampled_from(THREAD_IDS), expire=st.booleans())
    def stale_dispatch(self, thread_id: str, expire: bool) -> None:
        """A dispatcher acting on an old scan: release of a thread that may not be due, or expire
        of one that may not have lapsed."""
        if not expire:
            self.same_outcome(self.gate.release(thread_id), self.model.release(thread_id), "release")
            return
        thread = self.model.threads.get(thread_id)
        if not self.EXPIRE_IDLE and (thread is None or thread.active is None):
            return
        self.same_outcome(self.gate.expire(thread_id), self.model.expire(thread_id), "expire")

    # -- the worker holding the active member ---------------------------------------------------
    @precondition(has_active)
    @rule(
        pick=st.integers(0, 999),
        keepalive=st.sampled_from([50, RELEASE_TIMEOUT, 1000]),
        worker=st.sampled_from(["w1", "w2"]),
        claimant=CLAIMANTS,
        stoppable=st.booleans(),
    )
    def claim(self, pick: int, keepalive: int, worker: str, claimant: str, stoppable: bool = False) -> None:
        """A delivery claims the active member; the same claimant again is its claim replayed.
        ``stoppable``: a prefork pool process's claim (a delete waits for it to stop)."""
        thread_id, task_id, mtok, rtok = self.active_target(pick)
        self.same(
            self.gate.reads.peek(thread_id, task_id, rtok), self.model.peek(thread_id, task_id, mtok), "peek"
        )
        self.same(
            self.leasing(keepalive).claim(thread_id, task_id, rtok, worker, claimant, stoppable=stoppable),
            self.model.claim(thread_id, task_id, mtok, keepalive, worker, claimant, stoppable=stoppable),
            "claim",
        )

    @precondition(has_active)
    @rule(
        pick=st.integers(0, 999), keepalive=st.sampled_from([50, RELEASE_TIMEOUT, 1000]), claimant=CLAIMANTS
    )
    def renew(self, pick: int, keepalive: int, claimant: str) -> None:
        """The claimant renews its lease; no claimant: a worker holding the release unclaimed."""
        thread_id, task_id, mtok, rtok = self.active_target(pick)
        self.same(
            self.leasing(keepalive).renew(thread_id, task_id, rtok, claimant),
            self.model.renew(thread_id, task_id, mtok, keepalive, claimant),
            "renew",
        )

    @precondition(has_active)
    @rule(pick=st.integers(0, 999), bogus=st.booleans())
    def hand_back(self, pick: int, bogus: bool) -> None:
        """A worker shutting down returns the release it holds (claimed or not), beside a
        possibly stale one, in one pipeline."""
        targets = [self.active_target(pick), self.stale_target(pick, bogus)]
        real = self.gate.hand_back([(t, k, r) for t, k, _, r in targets])
        for (t, k, m, _), outcome in zip(targets, real):
            self.same_outcome(outcome, self.model.hand_back(t, k, m), "handback")

    @rule(pick=st.integers(0, 999), bogus=st.booleans())
    def renew_many(self, pick: int, bogus: bool) -> None:
        """The worker's batched renewal: every active member plus one possibly stale target."""
        targets = [
            (t.thread_id, t.active.task_id, t.active.token, self.m2r[t.active.token])
            for t in self.model.threads.values()
            if t.active is not None
        ]
        targets.append(self.stale_target(pick, bogus))
        self.same(
            self.leasing(1000).renew_many([(t, k, r) for t, k, _, r in targets]),
            [self.model.renew(t, k, m, 1000) for t, k, m, _ in targets],
            "renew_many",
        )

    @precondition(has_active)
    @rule(
        pick=st.integers(0, 999),
        how=st.sampled_from(["finish", "requeue", "kill", "fail"]),
        retries=st.integers(0, 3),
        at=st.booleans(),
        delay=st.one_of(st.just(0), st.integers(0, 3 * RELEASE_TIMEOUT)),
        offset=st.integers(-2 * RELEASE_TIMEOUT, 2 * RELEASE_TIMEOUT),
        flag=st.booleans(),
        other=st.integers(0, 4),
        holder=st.sampled_from(HOLDERS),
    )
    def end_attempt(
        self,
        pick: int,
        how: str,
        retries: int,
        at: bool,
        delay: int,
        offset: int,
        flag: bool,
        other: int,
        holder: Optional[str],
    ) -> None:
        """The worker holding the active member ends its attempt: success, retry (requeue, with
        a new envelope when ``flag``; with an odd ``retries`` too, a replacement: Task.replace
        in the same thread, which is not counted as a retry), death (kept in the dead letters
        when ``flag``), or a lost pool child (fail).  A worker's ending is its claim's: its
        caller id is the claimant (``other == 0``: another caller's, which a member RUNNING for a
        claimant refuses, as after a lost claim and another delivery's claim).  A kill or a lost
        pool child with a ``holder`` is the worker's main process's, fenced by that pool
        process's claims."""
        thread_id, task_id, mtok, rtok = self.active_target(pick)
        active = self.model.threads[thread_id].active
        claimant = active.by if active is not None and active.state == M.RUNNING else None
        if claimant and other:
            self.caller = claimant
        else:  # this ending's own id
            self.caller = f"call-{len(self.task_ids)}-{STATS['calls']}"
        if how == "finish" and flag:
            self._finish_and_claim(thread_id, task_id, mtok, rtok, retries)
        elif how == "finish":
            self._ending(
                "finish",
                lambda: self.gate.finish(thread_id, task_id, rtok, caller=self.caller),
                lambda: self.model.finish(thread_id, task_id, mtok, caller=self.caller),
            )
        elif how == "requeue" and flag and retries % 2:  # a new body: a replacement's
            self._replace(thread_id, task_id, mtok, rtok, retries, at, offset)
        elif how == "requeue":
            self._requeue(thread_id, task_id, mtok, rtok, retries, at, delay, offset, flag)
        elif how == "kill":
            self._kill(thread_id, task_id, mtok, rtok, flag, retries, holder)
        else:
            self._fail(thread_id, task_id, mtok, rtok, holder)

    def _finish_and_claim(self, thread_id: str, task_id: str, mtok: str, rtok: str, choice: int) -> None:
        """The in-process handoff: finish claims the next member for this worker; ``choice`` 0:
        the pool process cannot run it after all and gives it back (unclaim), or its stale token
        is given back."""
        claim = ("w-handoff", "c-handoff")
        caller = self.caller
        real = self._ending(
            "finish+claim",
            lambda: self.leasing(1000).finish(
                thread_id, task_id, rtok, keep_release=True, claim=claim, caller=caller
            ),
            lambda: self.model.finish(
                thread_id, task_id, mtok, keep_release=True, claim=(1000, *claim), caller=caller
            ),
        )
        if real.release is not None and choice == 0:
            rnext = real.release.token
            mnext = self.r2m[rnext]
            self.same_outcome(
                self.gate.unclaim(thread_id, real.release.task_id, rnext),
                self.model.unclaim(thread_id, real.release.task_id, mnext),
                "unclaim",
            )
        elif choice == 1:
            self.same_outcome(
                self.gate.unclaim(thread_id, task_id, rtok),
                self.model.unclaim(thread_id, task_id, mtok),
                "unclaim",
            )
        elif choice == 2:  # the same call again, as after its reply was lost
            self.replay_ending()

    def _requeue(
        self,
        thread_id: str,
        task_id: str,
        mtok: str,
        rtok: str,
        retries: int,
        at: bool,
        delay: int,
        offset: int,
        new_body: bool,
    ) -> None:
        kw: dict[str, Any] = dict(
            retries=retries,
            delay_ms=delay,
            at_ms=self.model.now + offset if at else None,
            envelope=self.envelope(task_id) if new_body else b"",
        )
        kw["caller"] = self.caller
        self._ending(
            "requeue",
            lambda: self.gate.requeue(thread_id, task_id, rtok, **kw),
            lambda: self.model.requeue(thread_id, task_id, mtok, **kw),
        )

    def _replace(
        self, thread_id: str, task_id: str, mtok: str, rtok: str, retries: int, at: bool, offset: int
    ) -> None:
        """Task.replace in the same thread: the member waits again as its replacement (new
        message and retry settings, ``retries`` as its max_retries), not counted as a retry."""
        kw: dict[str, Any] = dict(
            at_ms=self.model.now + offset if at else None,
            max_retries=retries or None,
            retry_delay_ms=retries * 10,
            caller=self.caller,
        )
        body = self.envelope(task_id)
        self._ending(
            "replace",
            lambda: self.gate.replace(thread_id, task_id, rtok, body, **kw),
            lambda: self.model.replace(thread_id, task_id, mtok, body, **kw),
        )

    def _kill(
        self,
        thread_id: str,
        task_id: str,
        mtok: str,
        rtok: str,
        keep: bool,
        retries: int,
        holder: Optional[str] = None,
    ) -> None:
        meta = {"retries": retries, "exception": "ValueError: boom", "traceback": "tb\nline"}
        caller = self.caller
        # A worker's own kill (its claimant), unless it is the main process's (by its holder)
        fenced = caller is not None and holder is None
        self._ending(
            "kill",
            lambda: self.gate.kill(
                thread_id, task_id, rtok, meta, keep=keep, caller=caller, fenced=fenced, holder=holder
            ),
            lambda: self.model.kill(
                thread_id, task_id, mtok, meta, keep=keep, caller=caller, fenced=fenced, holder=holder
            ),
        )

    def _fail(self, thread_id: str, task_id: str, mtok: str, rtok: str, holder: Optional[str] = None) -> None:
        reason = "WorkerLostError: gone; no retries were left"
        caller = self.caller
        self._ending(
            "fail",
            lambda: self.gate.fail(thread_id, task_id, rtok, reason, caller=caller, holder=holder),
            lambda: self.model.fail(thread_id, task_id, mtok, reason, caller=caller, holder=holder),
        )

    def _ending(self, what: str, real: Any, model: Any) -> Any:
        """Run an ending on both sides, and keep it to send again (:meth:`replay_ending`)."""
        self.last_ending = (what, real, model)
        outcome = real()
        self.same_outcome(outcome, model(), what)
        return outcome

    @precondition(lambda self: self.last_ending is not None)
    @rule()
    def replay_ending(self) -> None:
        """The last ending sent again under its own caller id, as after its reply was lost
        (whatever happened since): the same outcome while what it released is active."""
        what, real, model = self.last_ending
        self.same_outcome(real(), model(), f"{what} replayed")

    @precondition(has_active)
    @rule(pick=st.integers(0, 999), how=st.sampled_from(["kill", "requeue", "finish"]), flag=st.booleans())
    def lost_claim_ending(self, pick: int, how: str, flag: bool) -> None:
        """The gate lost a claim (a crash with appendfsync everysec, a failover without WAIT) and
        another delivery claimed the member again (claimant c1 here, when it is RELEASED): the
        first worker's own ending, under its own claim (another claimant), is refused while
        c1 runs the member, and nothing is released beside it.  A rule of its own: drawn as one
        case of end_attempt, kill and requeue met it too seldom for a mutant without their
        claimant fence to fail the suite (issue 32)."""
        thread_id, task_id, mtok, rtok = self.active_target(pick)
        active = self.model.threads[thread_id].active
        assert active is not None
        if active.state == M.RELEASED:
            self.same(
                self.leasing(1000).claim(thread_id, task_id, rtok, "w1", "c1"),
                self.model.claim(thread_id, task_id, mtok, 1000, "w1", "c1"),
                "claim",
            )
        self.caller = "c2" if active.by != "c2" else "c1"
        if how == "kill":
            self._kill(thread_id, task_id, mtok, rtok, flag, 0)
        elif how == "requeue":
            self._requeue(thread_id, task_id, mtok, rtok, 1, False, 0, 0, flag)
        else:
            self._ending(
                "finish",
                lambda: self.gate.finish(thread_id, task_id, rtok, caller=self.caller),
                lambda: self.model.finish(thread_id, task_id, mtok, caller=self.caller),
            )

    # -- a worker holding an old (or a bogus) token ---------------------------------------------
    @rule(
        op=st.sampled_from(
            [
                "peek",
                "claim",
                "renew",
                "finish",
                "requeue",
                "kill",
                "fail",
                "delete",
                "delete_expired",
                "mark_deleted",
                "handback",
            ]
        ),
        pick=st.integers(0, 999),
        bogus=st.integers(0, 4),
        flag=st.booleans(),
        holder=st.sampled_from(HOLDERS),
    )
    def fenced_call(self, op: str, pick: int, bogus: int, flag: bool, holder: Optional[str]) -> None:
        thread_id, task_id, mtok, rtok = self.stale_target(pick, bogus == 0)
        self.caller = None  # a call of its own, never taken for a replay
        if op == "peek":  # the worker's filter of stale deliveries on receipt
            self.same(
                self.gate.reads.peek(thread_id, task_id, rtok),
                self.model.peek(thread_id, task_id, mtok),
                "peek",
            )
        elif op == "claim":
            self.same(
                self.leasing(1000).claim(thread_id, task_id, rtok, "w3"),
                self.model.claim(thread_id, task_id, mtok, 1000, "w3"),
                "claim",
            )
        elif op == "renew":
            self.same(
                self.leasing(1000).renew(thread_id, task_id, rtok),
                self.model.renew(thread_id, task_id, mtok, 1000),
                "renew",
            )
        elif op == "finish":
            self.same_outcome(
                self.gate.finish(thread_id, task_id, rtok),
                self.model.finish(thread_id, task_id, mtok),
                "finish",
            )
        elif op == "requeue":
            self._requeue(thread_id, task_id, mtok, rtok, 1, False, 10, 0, flag)
        elif op == "kill":
            self._kill(thread_id, task_id, mtok, rtok, flag, 0, holder)
        elif op == "fail":
            self._fail(thread_id, task_id, mtok, rtok, holder)
        elif op == "handback":
            [outcome] = self.gate.hand_back([(thread_id, task_id, rtok)])
            self.same_outcome(outcome, self.model.hand_back(thread_id, task_id, mtok), "handback")
        elif op == "delete_expired":  # an expired release, ended instead of published
            self.same_outcome(
                self.gate.delete(task_id, token=rtok, only_released=True),
                self.model.delete(task_id, token=mtok, only_released=True),
                "delete",
            )
        elif op == "mark_deleted":  # the worker's mark on revoke(terminate=True)
            self.same_outcome(
                self.gate.delete(task_id, token=rtok, stop=True, holder=holder),
                self.model.delete(task_id, token=mtok, stop=True, holder=holder),
                "delete",
            )
        else:  # the worker's delete on revoke, or once a terminated pool process has exited
            self.same_outcome(
                self.gate.delete(task_id, token=rtok, only_waiting=flag, holder=holder),
                self.model.delete(task_id, token=mtok, only_waiting=flag, holder=holder),
                "delete",
            )

    # -- the operator -------------------------------------------------------------------------
    @rule(
        pick=st.integers(0, 999), member=st.integers(0, 3), only_waiting=st.booleans(), stop=st.integers(0, 2)
    )
    def delete(self, pick: int, member: int, only_waiting: bool, stop: int) -> None:
        """Threads.delete (any state; ``stop``: a running member in a stoppable process is
        marked, as Threads.delete does) or a plain revoke (only_waiting) of a member or any id.
        Marks land mostly on the active member, so its endings meet them."""
        members = sorted(self.model.tasks)
        actives = sorted(t.active.task_id for t in self.model.threads.values() if t.active is not None)
        if stop == 2 and actives:
            task_id = actives[pick % len(actives)]
        else:
            task_id = members[pick % len(members)] if members and member else self.known_task(pick)
        kw: dict[str, Any] = dict(only_waiting=True) if only_waiting and not stop else dict(stop=bool(stop))
        self.same_outcome(self.gate.delete(task_id, **kw), self.model.delete(task_id, **kw), "delete")

    @precondition(
        lambda self: any(
            t.active is not None and t.active.stop and not t.active.deleted
            for t in self.model.threads.values()
        )
    )
    @rule(pick=st.integers(0, 999))
    def delete_stoppable(self, pick: int) -> None:
        """Threads.delete of a member RUNNING in a stoppable process: it is marked, and whatever
        ends it next (its worker once the process exited, its own ending, a lapse) meets the
        mark."""
        running = sorted(
            t.active.task_id
            for t in self.model.threads.values()
            if t.active is not None and t.active.stop and not t.active.deleted
        )
        task_id = running[pick % len(running)]
        self.same_outcome(
            self.gate.delete(task_id, stop=True), self.model.delete(task_id, stop=True), "delete"
        )

    @precondition(has_dead)
    @rule(
        pick=st.integers(0, 999),
        from_dead=st.integers(0, 4),
        max_retries=st.sampled_from([None, 0, 1]),
        retry_delay=st.sampled_from([0, RELEASE_TIMEOUT]),
    )
    def restart(self, pick: int, from_dead: int, max_retries: Optional[int], retry_delay: int) -> None:
        dead = sorted(self.model.dead)
        task_id = dead[pick % len(dead)] if from_dead else self.known_task(pick)
        kw: dict[str, Any] = dict(max_retries=max_retries, retry_delay_ms=retry_delay)
        self.same_outcome(self.gate.restart(task_id, **kw), self.model.restart(task_id, **kw), "restart")

    @precondition(has_dead)
    @rule(pick=st.integers(0, 999), from_dead=st.integers(0, 3))
    def forget(self, pick: int, from_dead: int) -> None:
        dead = sorted(self.model.dead)
        task_id = dead[pick % len(dead)] if from_dead else self.known_task(pick)
        self.same_outcome(self.gate.forget(task_id), self.model.forget(task_id), "forget")

    @rule(
        thread_id=st.sampled_from(THREAD_IDS),
        pick=st.integers(0, 999),
        nesting=st.sampled_from([1, 2]),
        replay=st.integers(0, 2),
    )
    def enqueue_replacement(self, thread_id: str, pick: int, nesting: int, replay: int) -> None:
        """Task.replace: the replacement has the replaced task's id (mostly one that ended in the
        last ENDED_WINDOW, as a chain's last step), admitted once per nesting level; or (replay
        0) the last replacement sent again after its reply was lost, whatever happened since."""
        if replay == 0 and self.last_replacement is not None:
            thread_id, task_id, body, nesting = self.last_replacement
        else:
            ended = sorted(t for t in self.model.ended if not t.startswith("\0"))
            task_id = ended[pick % len(ended)] if ended and pick % 4 else self.known_task(pick)
            body = self.envelope(task_id)
            self.last_replacement = (thread_id, task_id, body, nesting)
        self.same_outcome(
            self.gate.enqueue(thread_id, task_id, body, replaced=nesting),
            self.model.enqueue(thread_id, task_id, body, replaced=nesting),
            "replace",
        )

    # -- the operator ---------------------------------------------------------------------------
    @rule(thread_id=st.sampled_from(THREAD_IDS), reason=st.sampled_from(["", "fixing a bug"]))
    def pause(self, thread_id: str, reason: str) -> None:
        self.same_outcome(self.gate.pause(thread_id, reason), self.model.pause(thread_id, reason), "pause")

    @rule(thread_id=st.sampled_from(THREAD_IDS), pick=st.integers(0, 999), paused=st.booleans())
    def resume(self, thread_id: str, pick: int, paused: bool) -> None:
        """A paused thread (``paused``: when there is one), or any."""
        if paused and self.model.paused:
            thread_id = sorted(self.model.paused)[pick % len(self.model.paused)]
        self.same_outcome(self.gate.resume(thread_id), self.model.resume(thread_id), "resume")

    @precondition(has_dead)
    @rule(
        thread_id=st.sampled_from([None, *THREAD_IDS]),
        picks=st.lists(st.integers(0, 999), min_size=1, max_size=3),
        unknown=st.booleans(),
        replay=st.integers(0, 3),
        max_retries=st.sampled_from([None, 0, 1]),
        retry_delay=st.sampled_from([0, RELEASE_TIMEOUT]),
    )
    def redrive(
        self,
        thread_id: Optional[str],
        picks: list[int],
        unknown: bool,
        replay: int,
        max_retries: Optional[int],
        retry_delay: int,
    ) -> None:
        """Dead letters (of this thread, another, or none) back at their place, into the first
        one's thread (None) or another; or (replay 0) the last redrive sent again after its
        reply was lost, under the same caller."""
        if replay == 0 and self.last_redrive is not None:
            thread_id, letters, caller = self.last_redrive
        else:
            dead = list(self.model.dead)
            ids = [dead[p % len(dead)] for p in picks]
            if thread_id is None:
                thread_id = self.model.dead[ids[0]].meta["thread_id"]
            if unknown:
                ids.append(self.known_task(len(picks)))
            letters = [(t, max_retries, retry_delay) for t in ids]
            self.serial += 1
            caller = f"redrive-{self.serial}"
            self.last_redrive = (thread_id, letters, caller)
        places = {}  # the arrival numbers the dead records kept
        for task_id, _, _ in letters:
            record = self.gate.reads.dead_record(task_id)
            if record is not None:
                places[task_id] = record.meta["seq"]
        codes, release = self.gate.redrive(thread_id, letters, caller=caller)
        want_codes, want_release = self.model.redrive(thread_id, letters, caller=caller)
        self.same_outcome(
            gate_module.Outcome(1, "".join(codes), release),
            M.Outcome(1, "".join(want_codes), want_release),
            "redrive",
        )
        # A redriven member is back under the arrival number it died with (its place in its
        # thread's order, which the waiting order checks against the model's).
        seqs = {record_task(k, v): parse_record(v).seq for k, v in self.r.hgetall(self.shard.tasks).items()}
        for (task_id, _, _), code in zip(letters, codes):
            if code == "r" and task_id in places:
                assert seqs.get(task_id) == places[task_id], (
                    f"redriven {task_id}: seq {seqs.get(task_id)}, died with {places[task_id]}"
                )

    @rule(thread_id=st.sampled_from(THREAD_IDS), limit=st.sampled_from([1, 2, 100]))
    def purge(self, thread_id: str, limit: int) -> None:
        self.same(self.gate.purge(thread_id, limit), self.model.purge(thread_id, limit), "purge")

    @precondition(has_dead)
    @rule(keep=st.integers(0, 3), limit=st.sampled_from([1, 100]))
    def trim_dead(self, keep: int, limit: int) -> None:
        self.same(
            self.gate.trim_dead(self.shard, keep, None, limit), self.model.trim_dead(keep, limit), "trim_dead"
        )
        assert int(self.r.get(self.shard.dead_dropped) or 0) == self.model.dead_dropped

    # -- the agreement, after every step ------------------------------------------------------
    @invariant()
    def gate_agrees_with_model(self) -> None:
        """The whole Redis state, read in one round trip, is exactly what the model implies."""
        STATS["checks"] += 1
        model, s = self.model, self.shard
        threads = sorted(set(THREAD_IDS) | set(model.threads))
        pipe = self.r.pipeline(transaction=True)
        pipe.zrange(s.due, 0, -1, withscores=True)
        pipe.zrange(s.leases, 0, -1, withscores=True)
        pipe.hgetall(s.tasks)
        pipe.zrange(s.dead, 0, -1, withscores=True)
        pipe.hgetall(s.dead_records)
        pipe.keys("*")
        pipe.zrange(s.ended, 0, -1, withscores=True)
        pipe.pttl(s.ended)
        pipe.hgetall(s.paused)
        pipe.hgetall(s.stats)
        for thread_id in threads:
            k = s.thread(thread_id)
            pipe.hgetall(k.active)
            pipe.zrange(k.queue, 0, -1, withscores=True)
        for thread_id in threads:
            pipe.hgetall(s.thread(thread_id).policy)
            pipe.pttl(s.thread(thread_id).policy)
        (due, leases, tasks, dead, dead_records, keys, ended, ended_ttl, paused, stats, *per_thread) = (
            pipe.execute()
        )
        # The metrics' counters (lua/_common.lua count): each ending, retry, lapse and wait
        # counted exactly once, replays included; 'running' is the RUNNING members' number.
        stats = {k.decode(): int(v) for k, v in stats.items()}
        assert stats == model.stats, f"stats {stats} vs model {model.stats}"
        running = sum(
            1 for t in model.threads.values() if t.active is not None and t.active.state == M.RUNNING
        )
        assert stats.get("running", 0) == running, f"running {stats} vs {running} RUNNING"
        for name, n in stats.items():
            if n:
                STATS[f"counted {name}"] += 1
        policies = per_thread[2 * len(threads) :]
        for i, thread_id in enumerate(threads):
            fields, ttl = policies[2 * i : 2 * i + 2]
            fields = {k.decode(): v.decode() for k, v in fields.items()}
            want = dict(model.policy.get(thread_id, {}))
            if thread_id in model.rate_stamps:  # thread_rate_limit's last release
                last, until = model.rate_stamps[thread_id]
                want.update(rl=str(last), re=str(until))
            assert fields == want, f"policy hash of {thread_id}: {fields} vs model {want}"
            # No expiry while the thread holds a call to supersede (lua/_common.lua
            # keep_policy); else an expiry: the replay window, a rate's interval.
            waiting = int(want.get("n", "0")) > 0
            assert (ttl == -1) == waiting and (ttl > 0) == (bool(want) and not waiting), (
                f"policy hash of {thread_id}: pttl {ttl}, fields {want}"
            )
            STATS["lingering policy hashes"] += thread_id in model.policy_lingers
        STATS["rate-limited releases held"] += sum(
            1 for t in model.threads.values() if t.rate_due is not None
        )
        STATS["held threads"] += sum(1 for v in model.paused.values() if v.startswith("\0"))
        paused = {k.decode(): v.decode() for k, v in paused.items()}
        assert paused == model.paused, f"paused {paused} vs model {model.paused}"
        # +inf: a UUID member keyed by its long form (its short field was taken when it came):
        # exactly those, and the others as the model's ended index (a dead-lettered id restarted
        # in its window and keyed long has only the +inf one).
        long_uuids = {
            record_task(k, v)
            for k, v in tasks.items()
            if k[:1] == b"\x01" and task_field(k[1:].decode())[1] is not None
        }
        at_inf = {m.decode() for m, score in ended if score == float("inf")}
        assert at_inf == long_uuids, f"ended at +inf {at_inf} vs long-form UUIDs {long_uuids}"
        # The model's clock is not Redis's: an expiry on the index would, in real time, drop a
        # live member's +inf entry, and an enqueue of that UUID replayed then would be admitted
        # a second time.  So the index must not expire while it holds one.
        assert not self.pushed and not self.broker.exists(BROKER_PREFIX + ROUTING_KEY), (
            f"the gate published what it did not report: {self.pushed}"
        )
        assert not at_inf or ended_ttl == -1, f"ended index expires in {ended_ttl} ms: {at_inf}"
        ended = {m.decode(): int(score) for m, score in ended if score != float("inf")}
        expected_ended = {t: at for t, at in model.ended.items() if t not in at_inf}
        assert ended == expected_ended, f"ended {ended} vs model {expected_ended}"

        due = {m.decode(): int(score) for m, score in due}
        leases = {m.decode(): int(score) for m, score in leases}
        assert due == model.due_index(), f"due index {due} vs model {model.due_index()}"
        assert leases == model.lease_index(), f"leases {leases} vs model {model.lease_index()}"
        assert not set(due) & set(leases), "a thread in both indexes"
        # A paused thread with nothing active is in no index: no tick of the dispatcher reads it.
        idle_paused = {t for t, th in model.threads.items() if th.active is None and t in paused}
        assert set(due) | set(leases) == set(model.threads) - idle_paused, "an existing thread in no index"

        records = {record_task(k, v): parse_record(v) for k, v in tasks.items()}
        named = {k: record_task(k, v) for k, v in tasks.items()}  # field -> task id
        STATS["long UUID fields"] += sum(1 for k in tasks if len(k) == 37 and k[:1] == b"\x01")
        index = {task_id: r.thread_id for task_id, r in records.items()}
        assert index == model.tasks, f"tasks index {index} vs {model.tasks}"
        # Arrival order across the shard: the gate's seqs order the members as the model's do
        # (a redriven member back at its own, a restarted one a new arrival).
        arrival = {m.task_id: m.seq for t in model.threads.values() for m in t.members.values()}
        assert sorted(arrival, key=lambda t: int(records[t].seq)) == sorted(
            arrival, key=arrival.__getitem__
        ), "arrival order differs"

        order = [m.decode() for m, _ in dead]
        assert order == list(model.dead), f"dead letters in order {order} vs {list(model.dead)}"
        assert len({score for _, score in dead}) == len(dead), f"dead order has ties: {dead}"
        dead_parsed = {}
        for task_id, raw in dead_records.items():
            died_at, meta, body = raw.split(b"\n", 2)
            at, _, caller = died_at.decode().partition("|")  # the call that killed it
            dead_parsed[task_id.decode()] = (int(at), without_seq(json.loads(meta)), body)
            named_caller = model.dead_callers.get(task_id.decode())
            assert named_caller is None or caller == named_caller, (task_id, caller, named_caller)
        expected_dead = {d.task_id: (d.died_at_ms, d.meta, d.envelope) for d in model.dead.values()}
        assert dead_parsed == expected_dead, f"dead records {dead_parsed} vs {expected_dead}"

        for i, thread_id in enumerate(threads):
            active, queue = per_thread[2 * i : 2 * i + 2]
            members = {t: r for t, r in records.items() if r.thread_id == thread_id}
            self.check_thread(thread_id, model.threads.get(thread_id), active, queue, members, named)
        self.check_keys({k.decode() for k in keys}, long_uuids)
        self.check_readers(threads)

    def check_thread(
        self,
        thread_id: str,
        thread: Optional[M.Thread],
        active: dict,
        queue: list,
        members: dict,
        named: dict,
    ) -> None:
        what = f"thread {thread_id}"
        if thread is None:
            assert not (active or queue or members), f"{what} exists in the gate only"
            return
        field_of_active = active.get(b"f")  # bytes: a UUID's field is binary
        active = {k.decode(): v.decode() for k, v in active.items() if k != b"f"}
        if thread.active is None:
            assert active == {}, f"{what}: gate active {active}, model idle"
        else:
            a = thread.active
            assert (active.get("task"), active.get("state")) == (a.task_id, a.state), (
                f"{what}: gate active {active}, model {a}"
            )
            assert int(active["deadline"]) == a.deadline, f"{what}: deadline {active} vs {a}"
            assert int(active["n"]) == a.n, f"{what}: republications {active} vs {a}"
            if a.state == M.RUNNING:
                assert active["worker"] == a.worker, f"{what}: worker {active} vs {a}"
            assert (active.get("stop", ""), active.get("del")) == (
                "1" if a.stop else "",
                "1" if a.deleted else None,
            ), f"{what}: stop/del {active} vs {a}"
            self.bind(thread_id, a.task_id, a.token, active["token"])
            field = next(f for f, t in named.items() if t == a.task_id)
            assert field_of_active == field, f"{what}: 'f' {field_of_active!r} vs {field!r}"
            assert active.get("rl") == (None if a.rate is None else str(a.rate)), (
                f"{what}: 'rl' {active} vs {a}"
            )
        waiting = [(named.get(member_field(m)), int(score)) for m, score in queue]
        expected = [(m.task_id, m.sched) for m in thread.waiting()]
        assert waiting == expected, f"{what}: waiting {waiting} vs model {expected}"
        # A member is <n><seq, n bytes big-endian><field> (lua/_member.lua): its record's seq,
        # an arrival number drawn from the shard counter after where it started.
        for m, _ in queue:
            record = members.get(named.get(member_field(m)))
            assert record is not None and int.from_bytes(m[1 : 1 + m[0]], "big") == record.seq, (
                f"{what}: queue member {m!r} vs record {record}"
            )
            assert record.seq > self.counter_start, f"{what}: seq {record.seq} reused"
        # Neighbours tied on scheduled_at whose arrival numbers differ in length, or at the same
        # length above their last byte: their order (checked above against the model's) rests
        # on the length byte, and on the byte order.
        for (m1, s1), (m2, s2) in zip(queue, queue[1:]):
            if s1 == s2 and m1[0] != m2[0]:
                STATS["ties across a length"] += 1
            elif s1 == s2 and m1[1 : m1[0]] != m2[1 : m2[0]]:
                STATS["ties across a byte"] += 1
        records = {
            task_id: (r.retries, r.max_retries, r.retry_delay_ms, r.envelope, r.policy)
            for task_id, r in members.items()
        }
        # 'c': a call with coalesce or debounce not released yet (lua/_common.lua make_record).
        expected_records = {
            m.task_id: (
                m.retries,
                m.max_retries,
                m.retry_delay_ms,
                m.envelope,
                m.policy + "c" * m.coalescable,
            )
            for m in thread.members.values()
        }
        assert records == expected_records, f"{what}: records {records} vs {expected_records}"

    def check_keys(self, actual: set[str], long_uuids: set[str]) -> None:
        """Exactly the keys the model's state needs: none of a gone thread, no empty leftovers.
        ``long_uuids``: the members keyed by their long form (in the ended index at +inf)."""
        s, model = self.shard, self.model
        expected = {s.seq}  # the shard's counter lives on
        for key, present in (
            (s.due, model.due_index()),
            (s.leases, model.lease_index()),
            (s.tasks, model.tasks),
            (s.dead, model.dead),
            (s.dead_records, model.dead),
            (s.ended, model.ended or long_uuids),
            (s.paused, model.paused),
            (s.dead_dropped, model.dead_dropped),
            (s.stats, model.stats),
        ):
            if present:
                expected.add(key)
        for thread_id in model.policy:
            expected.add(s.thread(thread_id).policy)
        # A thread's policy hash (thread_rate_limit's last release) outlives its members: under
        # the test's clock for an hour of Redis's time (its value says when it counts as gone).
        expected.update(s.thread(t).policy for t in model.rate_stamps)
        for thread in model.threads.values():
            k = s.thread(thread.thread_id)
            if thread.waiting():
                expected.add(k.queue)
            if thread.active is not None:
                expected.add(k.active)
        if not actual:  # nothing has happened yet
            expected.discard(s.seq)
        assert actual == expected, (
            f"keys: unexpected {sorted(actual - expected)}, missing {sorted(expected - actual)}"
        )

    def check_readers(self, threads: list[str]) -> None:
        """The gate's read API (snapshot, thread_ids, thread_of, dead letters, the health reads)
        on the same state: one reader per step, in turn, to keep the steps cheap."""
        self.checks += 1
        model, turn, now = self.model, self.checks % 8, self.model.now
        if turn == 0:
            thread_id = threads[(self.checks // 8) % len(threads)]
            snap, thread = self.gate.reads.snapshot(thread_id), model.threads.get(thread_id)
            paused = model.paused.get(thread_id)
            assert (snap is None) == (thread is None and paused is None), f"snapshot of {thread_id}: {snap}"
            if snap is not None:  # a hold's reason shown without its mark
                assert snap.paused == (paused and pause_reason(paused)), f"snapshot of {thread_id}: {snap}"
            if snap is not None and thread is None:
                assert (snap.active, snap.waiting) == ({}, []), f"snapshot of {thread_id}: {snap}"
            if snap is not None and thread is not None:
                assert snap.waiting == [(m.task_id, m.sched) for m in thread.waiting()]
                assert snap.due_at == (
                    None
                    if thread.active or paused is not None
                    else thread.rate_due or thread.waiting()[0].sched
                )
                active = thread.active.task_id if thread.active else None
                assert snap.active.get("task") == active
        elif turn == 1:
            listed = list(self.gate.reads.thread_ids())
            assert sorted(listed) == sorted(set(model.threads) | set(model.paused)), f"thread_ids {listed}"
        elif turn == 2:
            task_id = self.known_task(self.checks // 8)
            assert self.gate.reads.thread_of(task_id) == model.thread_of(task_id), task_id
        elif turn == 3:
            dead = [
                (d.task_id, without_seq(d.meta), d.envelope, d.died_at_ms)
                for d in self.gate.reads.dead_records()
            ]
            expected = [(d.task_id, d.meta, d.envelope, d.died_at_ms) for d in model.dead.values()]
            assert dead == expected, f"dead letters {dead} vs {expected}"
            for task_id in list(model.dead)[:1] + [UNKNOWN]:
                record, want = self.gate.reads.dead_record(task_id), model.dead.get(task_id)
                assert (record is None) == (want is None), task_id
                if record is not None and want is not None:
                    assert (without_seq(record.meta), record.envelope, record.died_at_ms) == (
                        want.meta,
                        want.envelope,
                        want.died_at_ms,
                    )
        elif turn == 4:
            rows = self.gate.reads.thread_summaries(threads)
            for thread_id, (active, waiting, head, _due) in zip(threads, rows):
                thread = model.threads.get(thread_id)
                queue = thread.waiting() if thread else []
                want_task = thread.active.task_id if thread and thread.active else None
                assert (active.get("task"), waiting, head) == (
                    want_task,
                    len(queue),
                    (queue[0].task_id, queue[0].sched) if queue else None,
                ), f"summary of {thread_id}: {active, waiting, head}"
        elif turn == 5:
            before, limit = now + (self.checks // 8) % 3 * RELEASE_TIMEOUT, 1 + self.checks % 3
            got = self.gate.reads.overdue(self.shard, before, limit)
            assert got == model.overdue(before, limit), f"overdue({before}, {limit}): {got}"
        elif turn == 6:
            before = now - RELEASE_TIMEOUT
            got = self.gate.reads.index_counts(self.shard, now, before)
            assert got == model.index_counts(now, before), f"index_counts: {got}"
        else:
            got = self.gate.reads.active_states(self.shard, batch=2)
            assert got == model.active_states(), f"active_states: {got}"


def connect(gate_url: str) -> None:
    """The machine's clients: the gate's database, and the broker's on the same server."""
    GateMachine.client = redis.Redis.from_url(gate_url)
    GateMachine.broker_client = redis.Redis.from_url(gate_url.rsplit("/", 1)[0] + f"/{BROKER_DB}")


def disconnect() -> None:
    GateMachine.client.close()
    GateMachine.broker_client.close()


@pytest.fixture
def gate_url(redis_server) -> str:
    assert redis_server.port != 6379, "never the shared Redis"
    return redis_server.url(DB)


@pytest.mark.timeout(0 if "CT_MODEL_EXAMPLES" in os.environ else 300)
@pytest.mark.parametrize("how", ["fcall", "evalsha"])
def test_gate_matches_model(gate_url: str, how: str) -> None:
    """The gate's transitions against the model, called as the library's functions (Redis 7+)
    and as scripts: the same Lua either way."""
    connect(gate_url)
    GateMachine.FUNCTIONS = how == "fcall"
    GateMachine.client.config_resetstat()
    STATS.clear()
    OUTCOMES.clear()
    M.LEFT_WAITING.clear()
    try:
        run_state_machine_as_test(
            GateMachine,
            settings=settings(
                # Scripts run the same Lua bodies as the functions: a quarter of the examples
                # checks that calling them that way changes nothing.
                max_examples=EXAMPLES if how == "fcall" else max(1, EXAMPLES // 4),
                stateful_step_count=STEPS,
                deadline=None,
                report_multiple_bugs=False,
                derandomize=DERANDOMIZE,
                database=None if DERANDOMIZE else settings.default.database,
                # no "explain" phase: it replays a failure many times over and adds minutes
                phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink],
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
            ),
        )
    finally:
        disconnect()
    steps = STATS["checks"] - STATS["examples"]  # the invariant also runs once at the start
    print(
        f"\ngate model: {STATS['examples']} examples, {steps} steps, "
        f"{STATS['calls']} gate calls compared; " + ", ".join(f"{what}: {STATS[what]}" for what in EXERCISED)
    )
    print(f"coalescing calls that left the queue: {dict(M.LEFT_WAITING)}")
    counted = {name: STATS[f"counted {name}"] for name in COUNTERS}
    print(f"states with a counter: {counted}")
    if how == "fcall":
        # What the run must have reached.  Not asked of the script way: it draws a quarter of
        # the examples, and which rules run depends on keys expiring on Redis's own clock, so
        # its rarer states (a tie across a length) come and go with the machine's speed.
        for what, failure in EXERCISED.items():
            assert STATS[what] > 0, failure
        assert M.LEFT_WAITING["released"] > 0, "no coalescing call was released"
        assert all(counted.values()), f"a counter the run never moved: {counted}"
        assert STATS["published by the gate"] > 0, "the gate published no release itself"
        assert STATS["rate-limited releases held"] > 0, "no thread_rate_limit head ever waited"
        assert STATS["held threads"] > 0, "no on_death='hold' death ever held its thread"
        assert STATS["refused by max_waiting"] > 0, "no enqueue was refused by max_waiting"
    assert STATS["calls"] > 0, "no gate call was compared"
    calls = {k: v["calls"] for k, v in redis.Redis.from_url(gate_url).info("commandstats").items()}
    if how == "fcall":
        assert calls.get("cmdstat_fcall", 0) > 1000, calls
    else:
        assert "cmdstat_fcall" not in calls, calls
    if os.environ.get("CT_MODEL_VERBOSE"):
        for what, n in sorted(OUTCOMES.items()):
            print(f"  {n:6d}  {what}")


def test_expire_of_an_idle_thread_reports_its_release(gate_url: str) -> None:
    """A sweep acting on a stale scan (another dispatcher already handled the lapse) finds the
    thread idle with a due head: it releases that head, so it must report the release for the
    dispatcher to publish; otherwise the member stays RELEASED, undelivered, until the release
    timeout lapses and the next sweep republishes it (a bug the state machine found)."""
    client = redis.Redis.from_url(gate_url)
    client.flushdb()
    now = [START]
    gate = Gate(client, Keys(PREFIX), release_timeout_ms=RELEASE_TIMEOUT, clock=lambda: now[0])
    try:
        assert gate.enqueue("a", "t1", b"body", delay_ms=10).release is None  # idle, not due
        now[0] += 10  # due now
        outcome = gate.expire("a")
        snap = gate.reads.snapshot("a")
        assert snap is not None and snap.active["state"] == "RELEASED"  # released ...
        assert outcome.release is not None, f"... but not reported: {outcome}"  # ... silently
    finally:
        client.close()


def test_enqueue_paths_release_the_member_they_admit(gate_url: str) -> None:
    """The enqueue script's short cuts, each against what it skips: a due member of an empty thread
    is released without its queue key ever being written, with its own record (the message as
    given); a duplicate is a no-op; a member behind an active one waits; a due member that sorts
    before an idle thread's future head is released with the record it was given."""
    client = redis.Redis.from_url(gate_url)
    client.flushdb()
    now = [START]
    gate = Gate(
        client, Keys(PREFIX), release_timeout_ms=RELEASE_TIMEOUT, keepalive_ms=1000, clock=lambda: now[0]
    )
    shard = gate.keys.shard(0)

    def calls() -> Counter[str]:  # commands run so far, those inside scripts included
        return Counter({k: v["calls"] for k, v in client.info("commandstats").items()})

    try:
        before = calls()
        first = gate.enqueue("a", "t1", b"first\nbody", max_retries=2)
        ran = calls() - before
        assert first.status == 1 and first.release is not None
        assert (first.release.task_id, first.release.envelope) == ("t1", b"first\nbody")
        assert not client.exists(gate.keys.thread("a").queue)
        # the short cut: no queue written (the one ZADD is the leases index), no record read back
        assert (ran["cmdstat_zadd"], ran["cmdstat_zrem"], ran["cmdstat_hget"]) == (1, 0, 0), ran
        assert client.zscore(shard.leases, "a") is not None and client.zscore(shard.due, "a") is None

        # A duplicate (an enqueue replayed after its reply was lost) of the RELEASED member
        # adds nothing, and hands back its release with the message stored first, to publish.
        dup = gate.enqueue("a", "t1", b"other")
        assert dup.status == 0 and dup.release is not None
        assert (dup.release.token, dup.release.envelope) == (first.release.token, b"first\nbody")
        assert parse_record(client.hget(shard.tasks, task_field("t1")[0])).envelope == b"first\nbody"

        assert gate.enqueue("a", "t2", b"second").release is None  # behind t1
        nxt = gate.finish("a", "t1", first.release.token).release
        assert nxt is not None and (nxt.task_id, nxt.envelope) == ("t2", b"second")
        assert nxt.token != first.release.token
        assert gate.claim("a", "t2", nxt.token, "w") == 1
        assert gate.finish("a", "t2", nxt.token).done
        assert gate.reads.snapshot("a") is None and not client.exists(shard.tasks)

        assert gate.enqueue("b", "t3", b"later", delay_ms=5_000).release is None
        assert client.zscore(shard.due, "b") == START + 5_000
        before = calls()
        early = gate.enqueue("b", "t4", b"now").release  # sorts before t3
        assert (calls() - before)["cmdstat_hget"] == 0  # its record, not re-read
        assert early is not None and (early.task_id, early.envelope) == ("t4", b"now")
        assert client.zscore(shard.due, "b") is None and client.zscore(shard.leases, "b") is not None
        assert [t for t, _ in gate.reads.snapshot("b").waiting] == ["t3"]
    finally:
        client.close()


def test_uuid_prefix_collisions(gate_url: str) -> None:
    """A UUID is keyed by its first 14 bytes, its record holding the last two; one arriving while
    another member holds those 14 bytes is keyed by its long form.  Every lookup by task id finds
    the right member, a duplicate of either is refused, and nothing is left behind."""
    client = redis.Redis.from_url(gate_url)
    client.flushdb()
    now = [START]
    gate = Gate(
        client, Keys(PREFIX), release_timeout_ms=RELEASE_TIMEOUT, keepalive_ms=1000, clock=lambda: now[0]
    )
    tasks = gate.keys.shard(0).tasks
    prefix = "0b6f3c1e-9a2d-4c57-8e1f-2a3b4c5d"
    u1, u2, u3, u4 = (prefix + tail for tail in ("6e7f", "0000", "ffff", "1234"))
    short = task_field(u1)[0]
    assert all(task_field(u)[0] == short for u in (u2, u3, u4))
    try:
        r1 = gate.enqueue("a", u1, b"one").release
        r2 = gate.enqueue("b", u2, b"two").release
        assert r1 is not None and r2 is not None and (r2.task_id, r2.envelope) == (u2, b"two")
        assert set(client.hkeys(tasks)) == {short, b"\x01" + u2.encode()}
        ended = gate.keys.shard(0).ended  # a long-form member is there at +inf, until it ends
        assert client.zrange(ended, 0, -1, withscores=True) == [(u2.encode(), float("inf"))]
        assert client.hget(gate.keys.thread("b").active, "f") == b"\x01" + u2.encode()
        assert gate.enqueue("c", u2, b"again").status == 0  # a duplicate of each
        assert gate.enqueue("c", u1, b"again").status == 0
        assert gate.enqueue("a", u3, b"three").release is None  # behind u1, long form
        assert [gate.reads.thread_of(u) for u in (u1, u2, u3)] == ["a", "b", "a"]
        assert gate.reads.thread_of(u4) is None
        snap = gate.reads.snapshot("a")
        assert snap is not None and snap.active["task"] == u1
        assert snap.waiting == [(u3, START)] and set(snap.records) == {u1, u3}
        assert [row[2] for row in gate.reads.thread_summaries(["a", "b"])] == [(u3, START), None]

        assert gate.claim("a", u1, r1.token, "w") == 1
        r3 = gate.finish("a", u1, r1.token).release  # frees the short field
        assert r3 is not None and (r3.task_id, r3.envelope) == (u3, b"three")
        assert client.hget(tasks, short) is None
        assert gate.enqueue("c", u2, b"again").status == 0  # still a member
        r4 = gate.enqueue("d", u4, b"four").release  # takes the short field
        assert r4 is not None and client.hget(tasks, short) is not None
        assert gate.delete(u2).done and gate.reads.thread_of(u2) is None  # by its long form
        assert client.zscore(ended, u2) == now[0]  # ended, not +inf
        assert gate.reads.thread_of(u4) == "d" and gate.reads.thread_of(u3) == "a"

        assert gate.claim("a", u3, r3.token, "w") == 1
        assert gate.requeue("a", u3, r3.token, retries=1).done  # a retry keeps its key
        r3 = gate.reads.snapshot("a").active
        assert r3["task"] == u3 and gate.reads.thread_of(u3) == "a"
        assert gate.kill("a", u3, r3["token"], keep=True, meta={"thread_id": "a"}).done
        assert gate.claim("d", u4, r4.token, "w") == 1
        assert gate.finish("d", u4, r4.token).done
        assert not client.exists(tasks) and gate.reads.snapshot("a") is None
    finally:
        client.close()


def test_active_members_written_before_their_field_was_kept(gate_url: str) -> None:
    """An active hash written by an earlier version (a gate's processes may run two versions
    against one Redis) has 'l' instead of 'f', or neither: its ending finds its field all the
    same (a UUID's short form, a UUID's long form, another id), and leaves nothing behind."""
    client = redis.Redis.from_url(gate_url)
    client.flushdb()
    gate = Gate(
        client, Keys(PREFIX), release_timeout_ms=RELEASE_TIMEOUT, keepalive_ms=1000, clock=lambda: START
    )
    tasks = gate.keys.shard(0).tasks
    prefix = "0b6f3c1e-9a2d-4c57-8e1f-2a3b4c5d"
    holder, long_one = prefix + "6e7f", prefix + "0000"  # the second takes its long form
    try:
        assert gate.enqueue("h", holder, b"holds the short field").release is not None
        for thread, task, old in (
            ("u", str(uuid.UUID(int=7)), "0"),
            ("x", long_one, "1"),
            ("t", "plain-id", None),
            ("v", str(uuid.UUID(int=9)), None),
        ):
            released = gate.enqueue(thread, task, b"body").release
            assert released is not None and gate.claim(thread, task, released.token, "w") == 1
            active = gate.keys.thread(thread).active
            assert client.hget(active, "f") is not None
            client.hdel(active, "f")
            if old is not None:
                client.hset(active, "l", old)
            assert gate.finish(thread, task, released.token).done
            assert gate.reads.thread_of(task) is None, (task, client.hkeys(tasks))
        assert client.hkeys(tasks) == [task_field(holder)[0]]
    finally:
        client.close()


def test_dead_records_latest_across_shards(gate_url: str) -> None:
    """``dead_records(limit)``: the latest deaths, oldest first, merged across shards, however the
    limit compares with how many there are."""
    client = redis.Redis.from_url(gate_url)
    client.flushdb()
    now = [START]
    gate = Gate(
        client,
        Keys(PREFIX, shards=2),
        release_timeout_ms=RELEASE_TIMEOUT,
        keepalive_ms=1000,
        clock=lambda: now[0],
    )
    threads = [f"dead-{i}" for i in range(8)]
    assert len({gate.keys.shard_of(t) for t in threads}) == 2  # both shards hold deaths
    try:
        for i, thread in enumerate(threads):
            now[0] += 1
            rel = gate.enqueue(thread, f"d{i}", b"body").release
            assert rel is not None and gate.claim(thread, f"d{i}", rel.token, "w") == 1
            assert gate.kill(thread, f"d{i}", rel.token, {"exception": "boom"}).done
        every = [f"d{i}" for i in range(8)]
        assert [r.task_id for r in gate.reads.dead_records()] == every
        assert [r.task_id for r in gate.reads.dead_records(3)] == every[-3:]
        assert [r.task_id for r in gate.reads.dead_records(10)] == every  # more than there are
        assert gate.reads.dead_records(0) == [] and gate.reads.dead_count() == 8
    finally:
        client.close()


def test_a_stale_finish_of_a_restarted_members_old_run(gate_url: str) -> None:
    """A member dies (its lease lapses), is restarted, and a finish of its old run arrives: the
    member is live again, so that finish is refused (NOOP) whichever field keys it; found by the
    state machine (the restarted UUID keyed by its long form, the gate and the model disagreed)."""
    connect(gate_url)
    GateMachine.FUNCTIONS = False
    try:
        state = GateMachine()
        state.seed(members=[("a", 0, None), ("b", 0, None), ("b", 0, None)], counter=0)
        state.enqueue(
            at=False, delay=0, dup=0, max_retries=None, offset=0, pick=0, retry_delay=0, thread_id="a"
        )
        state.fenced_call(bogus=1, flag=False, op="finish", pick=0, holder=None)
        state.counter_jumps(arrivals=1, below=1, max_retries=None, place=0, thread_id="b")
        state.advance_clock(step=0)
        state.advance_clock(step=0)
        state.counter_jumps(arrivals=1, below=1, max_retries=0, place=0, thread_id="a")
        state.advance_clock(step=0)
        state.claim(claimant="", keepalive=50, pick=0, worker="w1")
        state.time_passes(step=1500)
        state.gate_agrees_with_model()
        state.restart(from_dead=1, max_retries=None, pick=0, retry_delay=0)
        state.gate_agrees_with_model()
        state.fenced_call(bogus=1, flag=False, op="finish", pick=2, holder=None)
        state.gate_agrees_with_model()
        state.teardown()
    finally:
        disconnect()


def _machine(gate_url: str) -> GateMachine:
    connect(gate_url)
    GateMachine.FUNCTIONS = False
    return GateMachine()


@pytest.mark.parametrize("how", ["kill", "requeue", "finish"])
def test_an_ending_after_a_lost_claim(gate_url: str, how: str) -> None:
    """claim(task, claimant=c1), then the ending of a caller that is not c1 (the first worker,
    after the gate lost its claim and another delivery claimed the member again): refused, the
    member goes on RUNNING for c1 and nothing is released beside it (issue 32's first two blind
    spots, as a fixed example besides the state machine's lost_claim_ending)."""
    try:
        state = _machine(gate_url)
        state.seed(members=[("a", 0, None), ("a", 0, None)], counter=0)
        state.lost_claim_ending(pick=0, how=how, flag=True)
        state.gate_agrees_with_model()
        active = state.model.threads["a"].active
        assert active is not None and (active.state, active.by) == (M.RUNNING, "c1")
        assert not state.model.dead and len(state.issued) == 1
        state.teardown()
    finally:
        disconnect()


def test_the_ended_index_never_expires_under_a_live_long_form_uuid(gate_url: str) -> None:
    """u2 shares u1's first 14 bytes, so it is keyed by its long form and sits in the ended index
    at +inf while it lives: an ending elsewhere must not give the index a TTL (after 30 s of real
    time the index would vanish, and a replayed enqueue of u2 be admitted a second time).  The
    model runs on a fake clock: the per-step invariant reads the index's PTTL."""
    prefix = "0b6f3c1e-9a2d-4c57-8e1f-2a3b4c5d"
    u1, u2 = prefix + "6e7f", prefix + "0000"
    try:
        state = _machine(gate_url)
        for thread_id, task_id in (("a", u1), ("b", u2), ("c:q", "t3")):
            body = state.envelope(task_id)
            state.task_ids.append(task_id)
            state.same_outcome(
                state.gate.enqueue(thread_id, task_id, body),
                state.model.enqueue(thread_id, task_id, body),
                "enqueue",
            )
        state.gate_agrees_with_model()
        state.end_attempt(
            pick=2, how="finish", retries=0, at=False, delay=0, offset=0, flag=False, other=1, holder=None
        )  # t3 ends
        assert state.r.pttl(state.shard.ended) == -1
        state.gate_agrees_with_model()
        state.end_attempt(
            pick=0, how="finish", retries=0, at=False, delay=0, offset=0, flag=False, other=1, holder=None
        )  # u1 ends
        state.gate_agrees_with_model()
        assert state.gate.enqueue("d", u2, b"again").status == 0  # still refused
        state.end_attempt(
            pick=0, how="finish", retries=0, at=False, delay=0, offset=0, flag=False, other=1, holder=None
        )  # u2 ends
        assert 0 < state.r.pttl(state.shard.ended) <= M.ENDED_WINDOW_MS
        state.gate_agrees_with_model()
        state.teardown()
    finally:
        disconnect()


def test_a_replacement_is_admitted_once_per_nesting(gate_url: str) -> None:
    """Task.replace's enqueue (``replaced=``) admits the replaced task's id although it ended
    lately, once per nesting level: the same call replayed after the replacement ended is
    refused, another nesting is admitted; the model agrees at every step."""
    try:
        state = _machine(gate_url)
        state.seed(members=[("a", 0, None)], counter=0)
        task_id = state.task_ids[0]
        state.end_attempt(
            pick=0, how="finish", retries=0, at=False, delay=0, offset=0, flag=False, other=1, holder=None
        )
        outcomes = []
        for nesting, replay in ((1, 1), (1, 0), (2, 1)):
            state.enqueue_replacement(thread_id="b", pick=1, nesting=nesting, replay=replay)
            state.gate_agrees_with_model()
            outcomes.append(state.model.thread_of(task_id))
            if state.model.threads.get("b") is not None:
                state.end_attempt(
                    pick=0,
                    how="finish",
                    retries=0,
                    at=False,
                    delay=0,
                    offset=0,
                    flag=False,
                    other=1,
                    holder=None,
                )
                state.gate_agrees_with_model()
        assert outcomes == ["b", None, "b"], outcomes
        state.teardown()
    finally:
        disconnect()


def test_releases_the_gate_publishes_itself(gate_url: str) -> None:
    """With ``direct``, a release of a message the publisher marked is pushed onto the broker's
    queue by the script (publish_direct): the model says which releases are, and the message is
    checked against the model's member (its retries after a requeue included)."""
    try:
        state = _machine(gate_url)
        before = STATS["published by the gate"]
        state.seed(members=[("a", 0, None), ("b", 0, None), ("c:q", 0, None)], counter=0)
        assert STATS["published by the gate"] == before + 1  # the third: a marked message
        state.claim(pick=2, keepalive=1000, worker="w1", claimant="")
        state.end_attempt(
            pick=2, how="requeue", retries=1, at=False, delay=0, offset=0, flag=False, other=1, holder=None
        )  # released again, retries 1
        assert STATS["published by the gate"] == before + 2
        state.gate_agrees_with_model()
        state.teardown()
    finally:
        disconnect()


def test_coalescing_calls_leave_the_queue_every_way(gate_url: str) -> None:
    """A waiting call with coalesce is released, deleted, purged or superseded: each way drops it
    from the thread's policy hash as the model says, and the hash, kept while such a call
    waits, expires once none does."""
    client = redis.Redis.from_url(gate_url)
    client.flushdb()
    model = M.Model(release_timeout_ms=RELEASE_TIMEOUT, now=START)
    gate = Gate(client, Keys(PREFIX), release_timeout_ms=RELEASE_TIMEOUT, clock=lambda: model.now)
    policy = Keys(PREFIX).thread("a").policy

    def both(call: str, *args: Any, model_args: Any = None, **kw: Any) -> Any:
        real = getattr(gate, call)(*args, **kw)
        expected = getattr(model, call)(*(model_args or args), **kw)
        fields = {k.decode(): v.decode() for k, v in client.hgetall(policy).items()}
        assert fields == model.policy.get("a", {}), (call, args, fields, model.policy)
        assert (client.pttl(policy) > 0) == ("a" in model.policy_lingers), (call, args)
        return real, expected

    try:
        busy, modelled = both("enqueue", "a", "busy", b"busy")
        assert busy.release is not None and modelled.release is not None
        for way in ("delete", "purge", "supersede", "release"):
            both("enqueue", "a", f"{way}-1", b"call", coalesce="sync")
            assert client.pttl(policy) == -1  # kept while it waits
            if way == "delete":
                both("delete", "delete-1")
            elif way == "purge":
                both("purge", "a")
            elif way == "supersede":
                real, _ = both("enqueue", "a", "supersede-2", b"call", coalesce="sync")
                assert real.superseded == ["supersede-1"] and client.pttl(policy) == -1
                both("purge", "a")
            else:
                real, _ = both(
                    "finish",
                    "a",
                    "busy",
                    busy.release.token,
                    model_args=("a", "busy", modelled.release.token),
                )
                assert real.release is not None and real.release.task_id == "release-1"
            assert client.pttl(policy) > 0, way  # none waits: it expires
        assert M.LEFT_WAITING["deleted"] and M.LEFT_WAITING["purged"]
    finally:
        client.close()
