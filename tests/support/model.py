"""A pure-Python reference model of the gate (one shard), for the model-based test.

It states the semantics of ``celery_threads/gate/lua/*.lua`` without Redis: a thread is a set of members,
at most one of which is *active* (RELEASED to a worker under a fencing token, or RUNNING under a
lease); the others wait.  The head is the waiting member with the earliest scheduled_at, ties broken
by arrival order.  After every transition that detaches or re-queues the active member, or adds a
member, the head is released when it is due and nothing is active ("release_head"), unless an
operator paused the thread.  A thread exists only while it has members; a pause (``paused``) is
kept apart, with or without members, until resumed.

Fencing tokens here are the model's own strings (``"m1"``, ``"m2"``, ...): the test maps them one to
one onto the gate's tokens instead of assuming how the gate makes them.  Every method mirrors the
:class:`celery_threads.gate.Gate` method of the same name and returns what that method returns.
"""

from __future__ import annotations

import functools
import itertools
import json
import re
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any, Optional

from celery_threads.metrics import WAIT_BUCKETS_MS

DONE, NOOP = 1, 0
CLAIMED, ALREADY_CLAIMED, STALE = 1, 2, 0
REPUBLISH, RETRIED, DIED, DELETED_LAPSE = 2, 3, 4, 5
RELEASED, RUNNING, WAITING = "RELEASED", "RUNNING", "WAITING"
STOPPING, DELETED = "STOPPING", "DELETED"  # delete's info when it marks; an ending's of a marked one
ENDED_WINDOW_MS = 30_000  # ENDED_WINDOW in lua/_common.lua
#: How often calls with coalesce or debounce left the queue otherwise than superseded, by how
#: (what the model-based test exercised).
LEFT_WAITING: Counter[str] = Counter()


@dataclass
class Member:
    task_id: str
    sched: int  # scheduled_at, ms
    seq: int  # arrival order, kept across retries, new on restart
    retries: int
    max_retries: int  # -1: unlimited
    retry_delay_ms: int
    envelope: bytes
    policy: str = ""  # "h" on_death="hold", "r<ms>" thread_rate_limit (policies.policy_text)
    # A call with coalesce or debounce, its record marked (lua/_common.lua left_waiting); a
    # retry's record is not.
    coalescable: bool = False

    def rate_ms(self) -> Optional[int]:
        at = self.policy.find("r")
        return int(self.policy[at + 1 :]) if at >= 0 else None


@dataclass
class Active:
    task_id: str
    token: str
    state: str  # RELEASED or RUNNING
    deadline: int  # release timeout (RELEASED) or lease (RUNNING), ms
    n: int = 0  # republications of this release so far
    worker: Optional[str] = None
    by: Optional[str] = None  # the claimant
    claimed: Optional[int] = None  # when it was claimed, ms
    # The call that released it, had it detached the previous active member: (kind, task id,
    # token, caller) and its reply (status, info), for that call replayed (lua/_common.lua
    # replayed; caller None: a call of its own, never replayed).
    prev: Optional[tuple[str, str, str, Optional[str]]] = None
    pst: Optional[tuple[int, str]] = None
    # The claim's process can be stopped from outside (a prefork pool process): a delete of the
    # RUNNING member marks it (``deleted``) instead of detaching it, and every later ending of
    # it ends it as deleted (lua/_common.lua marked_deleted).
    stop: bool = False
    deleted: bool = False
    waited: bool = False  # its wait (due -> claim) was counted (lua/claim.lua, 'w')
    rate: Optional[int] = None  # thread_rate_limit's interval: its claim stamps the thread


@dataclass
class Thread:
    thread_id: str
    members: dict[str, Member] = field(default_factory=dict)  # waiting and active alike
    active: Optional[Active] = None
    # When its head waits for thread_rate_limit: the time it may be released, the thread's score
    # in the due index (set when a release finds the head due but early).
    rate_due: Optional[int] = None

    def waiting(self) -> list[Member]:
        """Waiting members in release order: earliest scheduled_at, then arrival."""
        busy = self.active.task_id if self.active else None
        return sorted((m for m in self.members.values() if m.task_id != busy), key=lambda m: (m.sched, m.seq))


@dataclass(frozen=True)
class Release:
    thread_id: str
    task_id: str
    token: str
    retries: int
    envelope: bytes
    # The gate pushed its message onto the broker's queue itself (a Gate with ``direct``, and an
    # envelope that allows it): lua/_common.lua publish_direct.
    published: bool = False


@dataclass(frozen=True)
class Outcome:
    status: int
    info: str
    release: Optional[Release] = None


@dataclass(frozen=True)
class Dead:
    task_id: str
    meta: dict[str, Any]
    envelope: bytes
    died_at_ms: int


@dataclass(frozen=True)
class Scan:
    due: list[str]
    lapsed: list[str]
    next_ms: Optional[int]


_DIRECT_LEAD = re.compile(rb'^\{"d":[12],"hl":\d+,"headers":')


def publishable(envelope: bytes) -> bool:
    """Whether lua/_common.lua publish_direct pushes a release of this stored message itself:
    the publisher marked it (publish.encode_envelope) and its header names a routing key."""
    header, nl, _ = envelope.partition(b"\n")
    if not nl or not _DIRECT_LEAD.match(header):
        return False
    try:
        rest = json.loads(header)
    except ValueError:
        return False
    return isinstance(rest.get("routing_key"), str) and isinstance(rest.get("properties"), dict)


def _publishes(method: Any) -> Any:
    """A transition whose replies go through lua/_common.lua ``reply``: with ``direct``, the
    release of a publishable message is published by the script (``published``).  A republish
    (expire or hand-back of a RELEASED member: republish_active) never is, nor a release that
    ``finish(keep_release=True)`` keeps for its caller (``_direct_off``)."""

    @functools.wraps(method)
    def call(self: Model, *args: Any, **kwargs: Any) -> Any:
        self._direct_off = False
        try:
            result = method(self, *args, **kwargs)
        finally:
            direct, self._direct_off = self.direct and not self._direct_off, False
        if isinstance(result, tuple):  # redrive: (codes, release)
            codes, release = result
            republish = False
        else:
            release = result.release
            republish = (result.status, result.info) == (REPUBLISH, "republish")
        if not direct or release is None or republish or not publishable(release.envelope):
            return result
        release = replace(release, published=True)
        return (codes, release) if isinstance(result, tuple) else replace(result, release=release)

    return call


class Model:
    def __init__(
        self,
        *,
        release_timeout_ms: int,
        keepalive_ms: int = 30_000,
        max_republish_backoff: int = 6,
        now: int = 0,
        direct: bool = False,
    ) -> None:
        self.release_timeout_ms = release_timeout_ms
        self.keepalive_text = f"{keepalive_ms / 1000:g}s"
        self.max_republish_backoff = max_republish_backoff
        self.now = now
        self.threads: dict[str, Thread] = {}
        self.tasks: dict[str, str] = {}  # task id -> thread id, every member
        self.dead: dict[str, Dead] = {}  # in death order
        self.ended: dict[str, int] = {}  # task id -> ended_at, the last ENDED_WINDOW_MS
        self._arrivals = itertools.count(1)
        self._tokens = itertools.count(1)
        # What the current call detached, for the member it releases (see Active.prev).
        self._detached: Optional[tuple[tuple[str, str, str, Optional[str]], tuple[int, str]]] = None
        self.dead_callers: dict[str, Optional[str]] = {}  # task id -> the call that killed it
        self.paused: dict[str, str] = {}  # thread id -> the pause's reason
        self.dead_places: dict[str, tuple[int, int]] = {}  # task id -> its (sched, seq) at death
        self.dead_dropped = 0  # dead letters dropped by retention
        self.direct = direct  # Gate(direct=...): see _publishes
        self._direct_off = False
        # The shard's stats hash (lua/_common.lua count): every field a transition touched.
        self.stats: dict[str, int] = {}
        # Each thread's policy hash (K_POLICY) as coalesce and debounce keep it (lua/enqueue.lua):
        # 'c:<task name>' -> "<task id>\n<burst start>\n<superseded>", 'w:<task id>' -> "1"
        # while that call waits unreleased, 'n' their count; and the threads whose hash has an
        # expiry (no such call is left, lua/_common.lua left_waiting).
        self.policy: dict[str, dict[str, str]] = {}
        self.policy_lingers: set[str] = set()
        # thread id -> (last release of a member with a rate, until when it counts): the
        # policy hash's 'rl' and 're' (lua/_common.lua rate_stamp); kept as the gate keeps the
        # key under the test's clock (an hour of Redis's time).
        self.rate_stamps: dict[str, tuple[int, int]] = {}

    # -- helpers ---------------------------------------------------------------------------
    def _count(self, name: str, n: int = 1) -> None:
        self.stats[name] = self.stats.get(name, 0) + n

    def _count_ending(self, outcome: str, n: int = 1) -> None:
        self._count(f"ended:{outcome}", n)

    def _claimed(self, thread: Thread) -> None:
        """The active member's body starts: RUNNING counted, and its wait, once per release."""
        active = thread.active
        assert active is not None
        self._count("running")
        if not active.waited:
            active.waited = True
            wait = max(0, self.now - thread.members[active.task_id].sched)
            bound = next((b for b in WAIT_BUCKETS_MS if wait <= b), None)
            self._count(f"w:{'inf' if bound is None else bound}")
            self._count("w:sum", wait)

    def _leave_active(self, thread: Thread) -> None:
        assert thread.active is not None
        if thread.active.state == RUNNING:
            self._count("running", -1)
        thread.active = None

    def _schedule(self, delay_ms: int, at_ms: Optional[int]) -> int:
        return int(at_ms) if at_ms is not None else self.now + max(0, int(delay_ms))

    def _active(self, thread_id: str, task_id: str, token: str) -> Optional[Active]:
        """The active member when it is (task_id, token); token "" matches any token."""
        thread = self.threads.get(thread_id)
        if thread is None or thread.active is None or thread.active.task_id != task_id:
            return None
        if token != "" and thread.active.token != token:
            return None
        return thread.active

    def _release_of(self, thread: Thread) -> Release:
        assert thread.active is not None
        m = thread.members[thread.active.task_id]
        return Release(thread.thread_id, m.task_id, thread.active.token, m.retries, m.envelope)

    def _release_head(self, thread_id: str) -> Optional[Release]:
        thread = self.threads.get(thread_id)
        if thread is None:
            return None
        if thread.active is not None:
            return None
        waiting = thread.waiting()
        if not waiting:
            del self.threads[thread_id]  # the last member left: the thread is gone
            return None
        head = waiting[0]
        thread.rate_due = None
        if head.sched > self.now or thread_id in self.paused:
            return None
        every = head.rate_ms()
        if every is not None:
            last, until = self.rate_stamps.get(thread_id, (0, 0))
            if until > self.now and last + every > self.now:
                thread.rate_due = last + every  # it waits at its place
                return None
            self.rate_stamps[thread_id] = (self.now, self.now + every)
        self._left_waiting(thread_id, head, "released")
        thread.active = Active(
            head.task_id, f"m{next(self._tokens)}", RELEASED, self.now + self.release_timeout_ms, rate=every
        )
        if self._detached is not None:
            thread.active.prev, thread.active.pst = self._detached
        return self._release_of(thread)

    def _release_after(
        self,
        thread_id: str,
        kind: str,
        task_id: str,
        token: str,
        status: int,
        info: str,
        caller: Optional[str],
    ) -> Optional[Release]:
        """``_release_head`` after a call of ``kind`` detached the active (task_id, token)."""
        self._detached = ((kind, task_id, token, caller), (status, info))
        try:
            return self._release_head(thread_id)
        finally:
            self._detached = None

    def _replayed(
        self, thread_id: str, kind: str, task_id: str, token: str, caller: Optional[str], claimant: str = ""
    ) -> Optional[Outcome]:
        """The reply the call ``caller`` of ``kind`` that detached (task_id, token) gave, while
        the member it released is active (RELEASED, or RUNNING for ``claimant``); else
        ``None``."""
        thread = self.threads.get(thread_id)
        active = thread.active if thread is not None else None
        if (
            not caller
            or active is None
            or active.prev != (kind, task_id, token, caller)
            or active.pst is None
        ):
            return None
        status, info = active.pst
        mine = active.state == RUNNING and claimant != "" and active.by == claimant
        if mine or (active.state == RELEASED and (claimant == "" or info == DELETED)):
            if mine:
                info = str(active.claimed)
            return Outcome(status, info, self._release_of(thread))  # type: ignore[arg-type]
        return Outcome(status, info)

    def _ended_lately(self, task_id: str) -> bool:
        return self.ended.get(task_id, -ENDED_WINDOW_MS - 1) >= self.now - ENDED_WINDOW_MS

    def _add_member(
        self,
        thread_id: str,
        task_id: str,
        sched: int,
        max_retries: int,
        retry_delay_ms: int,
        envelope: bytes,
        again: bool = False,
        seq: Optional[int] = None,
        policy: str = "",
        cap: Optional[int] = None,
    ) -> Any:
        """``seq``: the arrival number it keeps (a redrive), else a new one.  ``again`` (a
        restart, a redrive, a replacement's admission): admitted although it ended lately, and no
        longer counted as ended, even when it is refused as a member already (lua/_common.lua
        add_member drops its ended entry first; a member's is one older than the window).
        ``cap`` (max_waiting): ``"full"`` when that many members wait, after the duplicate
        checks."""
        if again:
            self.ended.pop(task_id, None)
        if task_id in self.tasks:
            return False
        if not again and self.ended.get(task_id, -ENDED_WINDOW_MS - 1) >= self.now - ENDED_WINDOW_MS:
            return False
        thread = self.threads.get(thread_id)
        if cap is not None and not again and thread is not None and len(thread.waiting()) >= cap:
            return "full"
        thread = self.threads.setdefault(thread_id, Thread(thread_id))
        thread.members[task_id] = Member(
            task_id,
            sched,
            next(self._arrivals) if seq is None else seq,
            0,
            max_retries,
            retry_delay_ms,
            envelope,
            policy,
        )
        self.tasks[task_id] = thread_id
        return True

    def _left_waiting(self, thread_id: str, m: Member, why: str) -> None:
        """A call with coalesce or debounce left the queue (``why``: released, purged,
        deleted): no later call supersedes it; the policy hash expires once no such call is
        left."""
        if not m.coalescable:
            return
        LEFT_WAITING[why] += 1
        fields = self.policy.setdefault(thread_id, {})
        fields.pop(f"w:{m.task_id}", None)
        fields["n"] = str(int(fields.get("n", "0")) - 1)
        if int(fields["n"]) <= 0:
            self.policy_lingers.add(thread_id)

    def _hold(self, thread_id: str, task_id: str, exception: Any) -> None:
        """on_death="hold": the thread is paused by the death (lua/_common.lua hold_thread)."""
        reason = f"on_death=hold: {task_id} died" + (f": {exception}" if isinstance(exception, str) else "")
        before = self.paused.get(thread_id)
        if before is not None:  # paused already: it stays whose it is
            self.paused[thread_id] = f"{before} (then {reason})"
            return
        self.paused[thread_id] = f"\0{task_id}\0{reason}"

    def _lift_hold(self, thread_id: str, task_id: str) -> bool:
        if self.paused.get(thread_id, "").startswith(f"\0{task_id}\0"):
            del self.paused[thread_id]
            return True
        return False

    def _drop_active(self, thread: Thread) -> str:
        assert thread.active is not None
        task_id = thread.active.task_id
        self._leave_active(thread)
        del thread.members[task_id]
        del self.tasks[task_id]
        self._mark_ended(task_id)
        return task_id

    def _mark_ended(self, task_id: str) -> None:
        self.ended[task_id] = self.now
        self.ended = {t: at for t, at in self.ended.items() if at >= self.now - ENDED_WINDOW_MS}

    def _requeue_active(self, thread: Thread, sched: int, retries: int, envelope: bytes) -> None:
        assert thread.active is not None
        m = thread.members[thread.active.task_id]
        m.sched, m.retries = sched, retries
        m.coalescable = False  # its new record is unmarked
        if envelope:
            m.envelope = envelope
        self._leave_active(thread)

    def _kill_active(
        self, thread: Thread, keep: bool, meta: dict[str, Any], caller: Optional[str] = None
    ) -> None:
        assert thread.active is not None
        m = thread.members[thread.active.task_id]
        if "h" in m.policy:
            self._hold(thread.thread_id, m.task_id, meta.get("exception"))
        if keep:  # a task id that died before goes to the end of the death order
            self.dead.pop(m.task_id, None)
            # Its place, for a redrive: the gate adds its seq and scheduled_at to the meta (the
            # test compares the gate's seq by the order it gives, as for every seq), and its
            # policy.
            kept = {"sched": m.sched, **({"policy": m.policy} if m.policy else {})}
            self.dead[m.task_id] = Dead(m.task_id, {**meta, **kept}, m.envelope, self.now)
            self.dead_places[m.task_id] = (m.sched, m.seq)
            self.dead_callers[m.task_id] = caller
        self._count_ending("dead")
        self._drop_active(thread)

    def _killed_by(self, task_id: str, caller: Optional[str]) -> bool:
        return bool(caller) and task_id in self.dead and self.dead_callers.get(task_id) == caller

    def _ends_deleted(self, thread_id: str) -> bool:
        """When the active member was marked deleted, it leaves now as deleted (an ending other
        than its worker's after its process exited): no retry, no dead letter."""
        thread = self.threads[thread_id]
        assert thread.active is not None
        if not thread.active.deleted:
            return False
        self._count_ending("deleted")
        self._drop_active(thread)
        return True

    def _fail_active(self, thread: Thread, reason: str, caller: Optional[str] = None) -> int:
        """A failed attempt: retry at now + retry delay while retries remain, else die."""
        assert thread.active is not None
        m = thread.members[thread.active.task_id]
        if m.max_retries < 0 or m.retries < m.max_retries:
            self._requeue_active(thread, self.now + m.retry_delay_ms, m.retries + 1, b"")
            self._count("retries")
            return RETRIED
        meta = {"thread_id": thread.thread_id, "retries": m.retries, "exception": reason, "traceback": ""}
        self._kill_active(thread, True, meta, caller)
        return DIED

    # -- transitions (mirroring Gate) --------------------------------------------------------
    @_publishes
    def enqueue(
        self,
        thread_id: str,
        task_id: str,
        envelope: bytes,
        *,
        delay_ms: int = 0,
        at_ms: Optional[int] = None,
        max_retries: Optional[int] = None,
        retry_delay_ms: int = 0,
        replaced: int = 0,
        policy: str = "",
        max_waiting: Optional[int] = None,
        coalesce: Optional[str] = None,
        debounce_ms: int = 0,
        debounce_max_ms: int = 0,
    ) -> Outcome:
        """``replaced``: a replacement's nesting (lua/enqueue.lua ARGV[12]): its task id (the
        replaced task's) is admitted although it ended lately, once per nesting: the admission
        is remembered in the ended index, so that the same call replayed is refused.
        ``policy``: the member's (on_death="hold", thread_rate_limit); ``max_waiting``: refused
        ("full") when that many members wait."""
        maxr = -1 if max_retries is None else int(max_retries)
        admission = f"\0replaced:{replaced}:{task_id}" if replaced else None
        if admission is not None and self._ended_lately(admission):
            return Outcome(NOOP, "")
        sched = self._schedule(delay_ms, at_ms)
        if coalesce is None or admission is not None:
            added = self._add_member(
                thread_id,
                task_id,
                sched,
                maxr,
                retry_delay_ms,
                envelope,
                again=admission is not None,
                policy=policy,
                cap=max_waiting,
            )
            if added == "full":
                return Outcome(2, "full")
            if not added:
                return self._duplicate(thread_id, task_id, "")
            if admission is not None:
                self.ended[admission] = self.now
            return Outcome(DONE, "", self._release_head(thread_id))
        # coalesce / debounce: supersede the task's latest call when it waits and never ran,
        # and take its place (arrival number and scheduled_at; its own scheduled_at when that
        # is later and in the future).
        fields = dict(self.policy.get(thread_id, {}))
        latest = f"c:{coalesce}"
        prev: Optional[str] = None
        start, told = self.now, ""
        if latest in fields:
            prev, begun, told = fields[latest].split("\n", 2)
            start = int(begun)
        if task_id in self.tasks or self._ended_lately(task_id):  # a replay: told again
            return self._duplicate(thread_id, task_id, told if prev == task_id else "")
        place: Optional[tuple[int, int]] = None
        superseded = ""
        waits = prev is not None and f"w:{prev}" in fields
        thread = self.threads.get(thread_id)
        if (
            not waits
            and max_waiting is not None
            and thread is not None
            and len(thread.waiting()) >= max_waiting
        ):
            return Outcome(2, "full")  # a call that supersedes a waiting one adds none
        if waits:
            fields.pop(f"w:{prev}")
            # It waits, never released: it leaves and this call takes its place.
            thread = self.threads[thread_id]
            m = thread.members.pop(prev)
            del self.tasks[prev]
            self._mark_ended(prev)
            self._count_ending("deleted")  # superseded
            place = (m.seq, m.sched)
            superseded = prev + ("\n" + told.split("\n")[0] if told else "")
        else:
            start = self.now
            fields["n"] = str(int(fields.get("n", "0")) + 1)
        fields[latest] = f"{task_id}\n{start}\n{superseded}"
        fields[f"w:{task_id}"] = "1"
        self.policy[thread_id] = fields
        self.policy_lingers.discard(thread_id)
        if debounce_ms > 0:
            due = self.now + debounce_ms
            if debounce_max_ms > 0:
                due = min(due, max(self.now, start + debounce_max_ms))
            sched = max(sched, due)
        if place is not None:
            sched = place[1] if sched <= self.now else max(sched, place[1])
        self._add_member(
            thread_id,
            task_id,
            sched,
            maxr,
            retry_delay_ms,
            envelope,
            seq=place[0] if place is not None else None,
            policy=policy,
        )
        self.threads[thread_id].members[task_id].coalescable = True
        return Outcome(DONE, superseded, self._release_head(thread_id))

    def _duplicate(self, thread_id: str, task_id: str, superseded: str) -> Outcome:
        thread = self.threads.get(thread_id)
        active = thread.active if thread is not None else None
        if (
            thread is not None
            and active is not None
            and active.task_id == task_id
            and active.state == RELEASED
        ):
            return Outcome(NOOP, superseded, self._release_of(thread))  # a replay: publish again
        return Outcome(NOOP, superseded)

    @_publishes
    def release(self, thread_id: str) -> Outcome:
        return Outcome(DONE, "", self._release_head(thread_id))

    def claim(
        self,
        thread_id: str,
        task_id: str,
        token: str,
        keepalive_ms: int,
        worker: str,
        claimant: str = "",
        *,
        stoppable: bool = False,
    ) -> int:
        active = self._active(thread_id, task_id, token)
        if active is None:
            return STALE
        if active.state == RUNNING:
            # The same claimant's claim replayed is answered as the first.
            return CLAIMED if claimant != "" and active.by == claimant else ALREADY_CLAIMED
        self._claimed(self.threads[thread_id])
        active.state, active.deadline, active.worker = RUNNING, self.now + keepalive_ms, worker
        active.by, active.claimed, active.stop = claimant, self.now, stoppable
        if active.rate is not None:
            self.rate_stamps[thread_id] = (self.now, self.now + active.rate)
        return CLAIMED

    def renew(self, thread_id: str, task_id: str, token: str, keepalive_ms: int, claimant: str = "") -> int:
        """The holder of (task, token) vouches for it: a RUNNING member's lease (its claimant
        only), or the release deadline of a RELEASED one sitting unclaimed in its prefetch buffer
        (no claimant), is now + keepalive.  1 renewed, 0 stale, 2 not this caller's."""
        active = self._active(thread_id, task_id, token)
        if active is None:
            return STALE
        if (active.by != claimant) if active.state == RUNNING else claimant != "":
            return 2
        active.deadline = self.now + keepalive_ms
        return 1

    @_publishes
    def hand_back(self, thread_id: str, task_id: str, token: str) -> Outcome:
        """A worker shutting down returns a release it holds unstarted: it stays RELEASED under
        the same token, its release deadline restarts, and it is published again."""
        active = self._active(thread_id, task_id, token)
        if active is None or active.state != RELEASED:
            return Outcome(NOOP, "")
        active.deadline = self.now + self.release_timeout_ms
        thread = self.threads[thread_id]
        return Outcome(REPUBLISH, "republish", self._release_of(thread))

    def peek(self, thread_id: str, task_id: str, token: str) -> Optional[str]:
        """The state of (task, token) when it is the active member (exact token), else None."""
        thread = self.threads.get(thread_id)
        active = thread.active if thread is not None else None
        if active is None or active.task_id != task_id or active.token != token:
            return None
        return active.state

    def _not_the_claimants(self, thread_id: str, caller: Optional[str]) -> bool:
        """A finish or requeue of a member RUNNING for a claimant is that claim's own (its caller
        id is the claimant); another caller's is refused as stale.  So is a kill that says it is
        the claimant's (``fenced``); others are not: a worker's main process kills a member
        without knowing the claim."""
        active = self.threads[thread_id].active
        assert active is not None
        return active.state == RUNNING and bool(active.by) and active.by != caller

    def _held_elsewhere(self, thread_id: str, holder: Optional[str]) -> bool:
        """A worker's main process ends what one of its pool processes ran (``holder``: that
        process's claimant prefix): refused while another process's claim runs the member."""
        active = self.threads[thread_id].active
        assert active is not None
        return (
            active.state == RUNNING
            and bool(holder)
            and bool(active.by)
            and not active.by.startswith(holder or "")
        )

    @_publishes
    def finish(
        self,
        thread_id: str,
        task_id: str,
        token: str,
        *,
        keep_release: bool = False,
        claim: Optional[tuple[Any, ...]] = None,
        caller: Optional[str] = None,
    ) -> Outcome:
        """``claim``: ``(keepalive_ms, worker[, claimant])``; the member released is claimed for
        that worker at once (the in-process handoff's one round trip), and ``info`` is the time."""
        claimant = str(claim[2]) if claim is not None and len(claim) > 2 else ""
        self._direct_off = keep_release  # the caller runs the release itself
        if self._active(thread_id, task_id, token) is None:
            again = self._replayed(thread_id, "f", task_id, token, caller, claimant)
            if again is not None:
                return again
            return Outcome(DONE, "") if self._ended_lately(task_id) else Outcome(NOOP, "")
        if self._not_the_claimants(thread_id, caller):
            return Outcome(NOOP, "")
        if self._ends_deleted(thread_id):  # nothing claimed for the caller
            self._direct_off = False  # published as any release (lua/finish.lua)
            return Outcome(
                DONE, DELETED, self._release_after(thread_id, "f", task_id, token, DONE, DELETED, caller)
            )
        self._count_ending("succeeded")
        self._drop_active(self.threads[thread_id])
        release = self._release_after(thread_id, "f", task_id, token, DONE, "", caller)
        if release is None or claim is None:
            return Outcome(DONE, "", release)
        active = self.threads[thread_id].active
        assert active is not None
        self._claimed(self.threads[thread_id])
        active.state, active.deadline, active.worker = RUNNING, self.now + claim[0], claim[1]
        active.by, active.claimed, active.stop = claimant, self.now, True
        return Outcome(DONE, str(self.now), release)

    @_publishes
    def unclaim(self, thread_id: str, task_id: str, token: str) -> Outcome:
        """A member ``finish(claim=...)`` claimed for a worker that cannot run it: RELEASED again
        under the same token, its release deadline restarting, and published again."""
        active = self._active(thread_id, task_id, token)
        if active is None:
            return Outcome(NOOP, "")
        if active.state == RUNNING and active.deleted:  # it never started: it ends
            self._count_ending("deleted")
            self._drop_active(self.threads[thread_id])
            return Outcome(DELETED_LAPSE, task_id, self._release_head(thread_id))
        if active.state == RUNNING:
            self._count("running", -1)
        active.state, active.worker, active.by, active.claimed = RELEASED, None, None, None
        active.stop = False
        return self.hand_back(thread_id, task_id, token)

    @_publishes
    def requeue(
        self,
        thread_id: str,
        task_id: str,
        token: str,
        *,
        retries: int,
        delay_ms: int = 0,
        at_ms: Optional[int] = None,
        envelope: bytes = b"",
        caller: Optional[str] = None,
    ) -> Outcome:
        return self._reenter(
            thread_id, task_id, token, caller, self._schedule(delay_ms, at_ms), retries, envelope, None
        )

    @_publishes
    def replace(
        self,
        thread_id: str,
        task_id: str,
        token: str,
        envelope: bytes,
        *,
        at_ms: Optional[int] = None,
        max_retries: Optional[int] = None,
        retry_delay_ms: int = 0,
        caller: Optional[str] = None,
    ) -> Outcome:
        """``Task.replace`` in the same thread: the member waits again with the replacement's
        message and retry settings, retries 0, its scheduled_at kept unless ``at_ms``."""
        maxr = -1 if max_retries is None else int(max_retries)
        return self._reenter(thread_id, task_id, token, caller, at_ms, 0, envelope, (maxr, retry_delay_ms))

    def _reenter(
        self,
        thread_id: str,
        task_id: str,
        token: str,
        caller: Optional[str],
        sched: Optional[int],
        retries: int,
        envelope: bytes,
        settings: Optional[tuple[int, int]],
    ) -> Outcome:
        """lua/requeue.lua: the active member waits again at ``sched`` (None: the scheduled_at
        it was released at).  ``settings``: a replacement's (max_retries, retry delay), a new
        task in the member's place, not a retry (no count)."""
        if self._active(thread_id, task_id, token) is None:
            again = self._replayed(thread_id, "r", task_id, token, caller)
            return again if again is not None else Outcome(NOOP, "")
        if self._not_the_claimants(thread_id, caller):
            return Outcome(NOOP, "")
        if self._ends_deleted(thread_id):
            return Outcome(
                DONE, DELETED, self._release_after(thread_id, "r", task_id, token, DONE, DELETED, caller)
            )
        thread = self.threads[thread_id]
        m = thread.members[task_id]
        if settings is not None:
            m.max_retries, m.retry_delay_ms = settings
        self._requeue_active(thread, m.sched if sched is None else sched, retries, envelope)
        if settings is None:
            self._count("retries")
        return Outcome(DONE, "", self._release_after(thread_id, "r", task_id, token, DONE, "", caller))

    @_publishes
    def kill(
        self,
        thread_id: str,
        task_id: str,
        token: str,
        meta: dict[str, Any],
        *,
        keep: bool = True,
        caller: Optional[str] = None,
        fenced: bool = False,
        holder: Optional[str] = None,
    ) -> Outcome:
        if self._active(thread_id, task_id, token) is None:
            again = self._replayed(thread_id, "k", task_id, token, caller)
            if again is not None:
                return again
            return Outcome(DONE, "") if self._killed_by(task_id, caller) else Outcome(NOOP, "")
        if fenced and self._not_the_claimants(thread_id, caller):
            return Outcome(NOOP, "")
        if self._held_elsewhere(thread_id, holder):
            return Outcome(NOOP, "")
        if self._ends_deleted(thread_id):
            return Outcome(
                DONE, DELETED, self._release_after(thread_id, "k", task_id, token, DONE, DELETED, caller)
            )
        self._kill_active(self.threads[thread_id], keep, {"thread_id": thread_id, **meta}, caller)
        return Outcome(DONE, "", self._release_after(thread_id, "k", task_id, token, DONE, "", caller))

    @_publishes
    def delete(
        self,
        task_id: str,
        *,
        token: str = "",
        only_waiting: bool = False,
        only_released: bool = False,
        stop: bool = False,
        holder: Optional[str] = None,
    ) -> Outcome:
        """``stop``: a RUNNING member whose claim is stoppable is marked deleted and stays
        active (``STOPPING``); its worker ends it once its process has exited."""
        thread_id = self.tasks.get(task_id)
        if thread_id is None:
            return Outcome(NOOP, "")
        thread = self.threads[thread_id]
        if thread.active is not None and thread.active.task_id == task_id:
            state = thread.active.state
            if (
                only_waiting
                or (token != "" and thread.active.token != token)
                or (only_released and state != RELEASED)
            ):
                return Outcome(NOOP, state)
            if self._held_elsewhere(thread_id, holder):
                return Outcome(NOOP, state)
            if stop and state == RUNNING and thread.active.stop:
                thread.active.deleted = True
                return Outcome(DONE, STOPPING)
            current = thread.active.token
            self._count_ending("deleted")
            self._drop_active(thread)
            return Outcome(
                DONE, state, self._release_after(thread_id, "d", task_id, current, DONE, state, None)
            )
        else:
            if token != "":
                return Outcome(NOOP, WAITING)
            state = WAITING
            self._left_waiting(thread_id, thread.members.pop(task_id), "deleted")
            del self.tasks[task_id]
            self._mark_ended(task_id)
            self._count_ending("deleted")
        return Outcome(DONE, state, self._release_head(thread_id))

    @_publishes
    def expire(self, thread_id: str) -> Outcome:
        thread = self.threads.get(thread_id)
        if thread is None or thread.active is None:
            # An idle thread in a stale sweep: its due head is released (see the test's notes).
            return Outcome(NOOP, "", self._release_head(thread_id))
        active = thread.active
        if active.deadline > self.now:
            return Outcome(NOOP, "")
        if active.state == RELEASED:
            active.n += 1
            backoff = min(active.n, self.max_republish_backoff)
            active.deadline = self.now + self.release_timeout_ms * 2**backoff
            return Outcome(REPUBLISH, "republish", self._release_of(thread))
        task_id = active.task_id
        self._count("lapses")
        if active.deleted:  # no worker is left to stop it
            self._count_ending("deleted")
            self._drop_active(thread)
            return Outcome(DELETED_LAPSE, task_id, self._release_head(thread_id))
        reason = (
            f"LeaseExpired: the worker running it sent no keepalive for "
            f"{self.keepalive_text} (worker lost?), and no retries were left"
        )
        status = self._fail_active(thread, reason)
        return Outcome(status, task_id, self._release_head(thread_id))

    @_publishes
    def fail(
        self,
        thread_id: str,
        task_id: str,
        token: str,
        reason: str,
        *,
        caller: Optional[str] = None,
        holder: Optional[str] = None,
    ) -> Outcome:
        active = self._active(thread_id, task_id, token)
        if active is None:
            again = self._replayed(thread_id, "x", task_id, token, caller)
            if again is not None:
                return again
            return Outcome(DIED, task_id) if self._killed_by(task_id, caller) else Outcome(NOOP, "")
        if active.state != RUNNING or self._held_elsewhere(thread_id, holder):
            return Outcome(NOOP, "")
        if active.deleted:
            self._count_ending("deleted")
            self._drop_active(self.threads[thread_id])
            status = DELETED_LAPSE
        else:
            self._count("lapses")
            status = self._fail_active(self.threads[thread_id], reason, caller)
        return Outcome(
            status, task_id, self._release_after(thread_id, "x", task_id, token, status, task_id, caller)
        )

    @_publishes
    def restart(self, task_id: str, *, max_retries: Optional[int] = None, retry_delay_ms: int = 0) -> Outcome:
        record = self.dead.get(task_id)
        if record is None:
            return Outcome(NOOP, "")
        thread_id = record.meta["thread_id"]
        maxr = -1 if max_retries is None else int(max_retries)
        if not self._add_member(
            thread_id,
            task_id,
            self.now,
            maxr,
            retry_delay_ms,
            record.envelope,
            again=True,
            policy=record.meta.get("policy", ""),
        ):
            return Outcome(2, "")
        del self.dead[task_id]
        self.ended.pop(task_id, None)  # live again: its old run no longer counts as ended
        self._lift_hold(thread_id, task_id)
        return Outcome(DONE, "", self._release_head(thread_id))

    @_publishes
    def forget(self, task_id: str) -> Outcome:
        """lua/forget.lua: the dead letter goes; a hold its death made is lifted."""
        record = self.dead.pop(task_id, None)
        if record is None:
            return Outcome(NOOP, "")
        thread_id = record.meta["thread_id"]
        if self._lift_hold(thread_id, task_id):
            return Outcome(DONE, "", self._release_head(thread_id))
        return Outcome(DONE, "")

    def pause(self, thread_id: str, reason: str) -> Outcome:
        """Nothing of the thread is released until :meth:`resume`; 1 when it was not paused."""
        new = thread_id not in self.paused
        self.paused[thread_id] = reason
        return Outcome(DONE if new else NOOP, "")

    @_publishes
    def resume(self, thread_id: str) -> Outcome:
        """1 and the due head's release, if any, when the thread was paused; else 0."""
        if self.paused.pop(thread_id, None) is None:
            return Outcome(NOOP, "")
        return Outcome(DONE, "", self._release_head(thread_id))

    @_publishes
    def redrive(
        self, thread_id: str, letters: list[tuple[str, Optional[int], int]], *, caller: Optional[str] = None
    ) -> tuple[list[str], Optional[Release]]:
        """lua/redrive.lua: each dead letter of the thread back at its place (scheduled_at and
        arrival number at death), retries reset; the head released once all are back."""
        codes: list[str] = []
        again: set[str] = set()
        for task_id, max_retries, retry_delay_ms in letters:
            mark = f"\0redriven:{caller or ''}:{task_id}"
            record = self.dead.get(task_id)
            if record is not None and record.meta.get("thread_id") == thread_id:
                sched, seq = self.dead_places[task_id]
                maxr = -1 if max_retries is None else int(max_retries)
                if not self._add_member(
                    thread_id,
                    task_id,
                    sched,
                    maxr,
                    retry_delay_ms,
                    record.envelope,
                    again=True,
                    seq=seq,
                    policy=record.meta.get("policy", ""),
                ):
                    codes.append("a")
                    continue
                del self.dead[task_id]
                self._lift_hold(thread_id, task_id)
                self.ended.pop(task_id, None)  # live again: its old run no longer ended
                if caller:
                    self.ended[mark] = self.now
                codes.append("r")
            elif record is None and caller and self._ended_lately(mark):
                codes.append("r")
                again.add(task_id)
            else:
                codes.append("-")
        release = self._release_head(thread_id)
        thread = self.threads.get(thread_id)
        if (
            release is None
            and thread is not None
            and thread.active is not None
            and thread.active.task_id in again
            and thread.active.state == RELEASED
        ):
            release = self._release_of(thread)
        return codes, release

    def purge(self, thread_id: str, limit: int = 100) -> tuple[list[str], int]:
        """lua/purge.lua: drop at most ``limit`` waiting members, the last in release order
        first; nothing is released.  (task ids dropped, how many still wait)."""
        thread = self.threads.get(thread_id)
        if thread is None:
            return [], 0
        waiting = thread.waiting()
        dropped = [m.task_id for m in reversed(waiting[-limit:])] if limit > 0 else []
        for task_id in dropped:
            self._left_waiting(thread_id, thread.members.pop(task_id), "purged")
            del self.tasks[task_id]
            self._mark_ended(task_id)
        if dropped:
            self._count_ending("deleted", len(dropped))
        left = len(waiting) - len(dropped)
        if not thread.members:
            del self.threads[thread_id]
        return dropped, left

    def trim_dead(self, keep: Optional[int], limit: int) -> tuple[int, bool]:
        """lua/trim_dead.lua by count (its TTL rests on the shard counter's scores, which the
        model does not keep): the oldest deaths past ``keep`` go, at most ``limit``."""
        over = max(0, len(self.dead) - keep) if keep is not None else 0
        for task_id in list(self.dead)[: min(over, limit)]:
            del self.dead[task_id]
        self.dead_dropped += min(over, limit)
        return min(over, limit), over > limit

    # -- the dispatcher's view ----------------------------------------------------------------
    def due_index(self) -> dict[str, int]:
        """thread id -> head's scheduled_at, for every existing thread with nothing active that
        is not paused."""
        return {
            t.thread_id: t.rate_due or t.waiting()[0].sched
            for t in self.threads.values()
            if t.active is None and t.thread_id not in self.paused
        }

    def lease_index(self) -> dict[str, int]:
        """thread id -> the active member's deadline, for every thread with an active member."""
        return {t.thread_id: t.active.deadline for t in self.threads.values() if t.active is not None}

    def scan_due(self, limit: int) -> Scan:
        """What GateReads.scan_due reads: at most ``limit`` due entries of each index (ZSET order:
        score, then member bytes), and the earliest future entry of either."""

        def order(index: dict[str, int]) -> list[tuple[str, int]]:
            return sorted(index.items(), key=lambda kv: (kv[1], kv[0].encode()))

        due, leases = order(self.due_index()), order(self.lease_index())
        later = [score for _, score in (*due, *leases) if score > self.now]
        return Scan(
            [t for t, s in due if s <= self.now][:limit],
            [t for t, s in leases if s <= self.now][:limit],
            min(later, default=None),
        )

    def thread_of(self, task_id: str) -> Optional[str]:
        return self.tasks.get(task_id)

    # -- health reads -------------------------------------------------------------------------
    def overdue(self, before_ms: int, limit: int) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
        """(lapsed, due): threads whose deadline / idle head's scheduled_at is at or before
        ``before_ms``, at most ``limit`` of each, in index order."""

        def upto(index: dict[str, int]) -> list[tuple[str, int]]:
            rows = sorted(index.items(), key=lambda kv: (kv[1], kv[0].encode()))
            return [(t, score) for t, score in rows if score <= before_ms][:limit]

        return upto(self.lease_index()), upto(self.due_index())

    def index_counts(self, now_ms: int, overdue_before_ms: int) -> dict[str, Any]:
        lapsed, _ = self.overdue(overdue_before_ms, len(self.threads))
        _, overdue_heads = self.overdue(overdue_before_ms, len(self.threads))
        _, due_now = self.overdue(now_ms, 1)
        return {
            "idle": len(self.due_index()),
            "active": len(self.lease_index()),
            "members": len(self.tasks),
            "dead": len(self.dead),
            "lapsed": len(lapsed),
            "overdue_heads": len(overdue_heads),
            "oldest_due": due_now[0] if due_now else None,
        }

    def active_states(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for thread in self.threads.values():
            if thread.active is not None:
                counts[thread.active.state] = counts.get(thread.active.state, 0) + 1
        return counts
