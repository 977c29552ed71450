"""The chaos run's history checker: a pure function over what the run recorded and what the gate holds.

Inputs (all times in microseconds of the history server's clock, which is the gate's clock too: both
redis-servers run on the same host and ``TIME`` reads the system clock):

* ``history``: :class:`Event` rows the tasks, the workers and the fault injector appended:
  ``recv`` (a worker's main process received a delivery that the gate still had RELEASED under
  its token, so active: the ``task_received`` signal, after the strategy's token check),
  ``start`` / ``end`` (the task's user code, in the pool child; ``end`` carries the outcome
  ``success``, ``retry`` or ``die``), ``fin`` (the task's ``__call__`` returned after the gate
  recorded the success), ``kill`` (a worker or a pool child was SIGKILLed: the pids and the time
  read just before the signal).  Every row names the task id, the thread, the attempt
  (``request.retries``) and the release token (``headers['thread_token']``).
* ``gate``: :class:`GateState`, read after the run quiesced.
* ``deleted``: :class:`Deletion` of each member a ``Threads.delete`` call detached (it returned
  ``True``), with the times read around the call.
* ``enqueues``: :class:`Enqueue` of each member attempt the run itself put into the gate: the
  producer's ``apply_async`` (attempt 0) and each ``self.retry`` (attempt n + 1), with the time
  read before the call and after it returned, and the countdown.
* ``results``: the state the result backend holds for each member (task id -> state; a member
  with no stored result is ``PENDING``), read after the run quiesced, or ``None`` when the run
  kept no results.

The gate never reads any of this; only the last step (the gate state) comes from the gate.

What is checked, and the approximations it rests on:

* **Overlaps.**  An attempt is *active* from its ``recv`` (or its ``start`` when no ``recv`` was
  recorded) to its ``end``, or to the ``kill`` of its process, or forever when neither came.  Two
  active intervals of one thread that intersect are an overlap.  The ``end`` row is written
  before the gate is told (``finish``, ``kill``, ``requeue``), so a correct gate never releases
  the next member before it; a ``recv`` is written after the worker saw the member RELEASED
  under its token, which needs the release.  A start is matched with the latest ``recv`` of its
  release.  Attempts that were received but never started (a prefetched request a consumer
  restart dropped, one in a killed worker, a duplicate delivery that lost the claim) have no
  known end and are left out.  An attempt of a deleted member that had not ended when the
  delete began counts only until then: what runs beside it after is exempt ("deletion is
  authoritative; the thread does not wait for the worker"), what overlapped it before is not.
* **Endings.**  Per member: successes (``end`` with ``success``), the dead-letter store, the
  deletions, and whether it is still a member.  It must end exactly once.  A success whose
  process was killed before ``fin`` was written may or may not have reached the gate (the
  at-least-once window between user code returning and the gate's ``finish``); it counts only
  when nothing else ended the member, and a re-run after it is reported as information, not as
  a violation.  A deleted member may also have one success (the delete raced the finish).  A
  dead letter is a valid ending only when the history explains it: an attempt ended ``die``
  (user code failed for good), or the attempt at the last retry the task allows failed without
  an ending (killed, or no end), and the gate's count of retries says they were exhausted.
* **Order.**  Exact release times and ``scheduled_at`` values live only inside the gate's
  scripts, so the check works with bounds and reports only *certain* violations.  Each attempt
  the run enqueued has ``scheduled_at`` in ``[before + countdown, after + countdown]`` (less
  2 ms for the gate's millisecond clock and countdown rounding).  A ``self.retry``'s re-entry
  is fixed when it is called but reaches the gate only once the body has unwound; it is a
  witness only when the task recorded that the gate took it (``landed``), and waiting from then.
  Attempts the gate re-entered by itself (a killed pool child, a lapsed lease) are scheduled at
  ``failure + retry delay``; their lower bound is the last thing seen of the previous attempt
  plus the retry delay (or a retry's own schedule, when it may have landed unrecorded), and they
  are never used as witnesses.  Each release has a token from one counter, so tokens order
  releases.  A release X (token tx) is a violation when some other member's attempt Y with a
  known schedule was certainly waiting and certainly scheduled earlier:
  Y was enqueued before X's earliest possible release time (the later of X's schedule, X's
  enqueue, and the end of any attempt of the thread released before X), Y's own release has a
  token above tx (so Y was still waiting), and Y's latest possible ``scheduled_at`` is before X's
  earliest.  Ties: the producer sends some members in bursts with one exact ``eta`` (a multiple
  of 250 ms); a release of one of them while a sibling with the same exact schedule that arrived
  earlier (its enqueue returned before this one's began) certainly waited breaks arrival order.
* **Not before scheduled_at.**  No attempt is received or started before its schedule's lower
  bound: the producer's enqueue's ``sched_lo``; for a retry, the retrying attempt's ``recv``
  (its claim, whose time the re-entry is scheduled from, came after it) plus the countdown, less
  the clocks' resolution (``SLACK_US``).  The gate's own re-entries are not checked.
* **Stored results.**  What Celery shows must follow how the member ended: ``SUCCESS`` for one
  that succeeded, ``FAILURE`` for one that died, ``REVOKED`` for one that was deleted (or
  ``SUCCESS`` when it also succeeded: the delete raced the finish, and Celery's backend never
  overwrites a success).  A member whose ending attempt was cut short between its ending and
  Celery's store (a success killed before ``fin``, or an attempt killed after its ``end`` row)
  may hold no final state at all: reported as information when it holds none, a mismatch when
  it holds a wrong one.  Members that did not end exactly once are left to the endings' check.
* **Stuck threads and leftover keys.**  The run ends every member, so any thread still in the
  gate's ``due`` or ``leases`` index after it quiesced is stuck; a thread key, a ``tasks`` entry
  or an index entry for a thread that is not in both places consistently is an orphan.  So are
  a dead index entry without its record (or the reverse), an ``ended`` entry at +inf, of a task
  the run never had, or older than a minute before the newest (untrimmed), a deleted note
  without a TTL or of a member that was not deleted, and any key under the prefix of no known
  shape.  Deleted notes of deleted members (no worker announced them yet) are reported as
  information: they expire.
* **Operator actions.**  An operator pauses and resumes threads, purges paused ones and redrives
  dead letters while the faults happen (:class:`Operations`).  A release token is a value of the
  shard counter, which never falls below the gate's clock in microseconds and stays within a few
  units of it (lua/_common.lua next_seq): a token is the time of its release, to ``SLACK_US``.
  So an attempt whose token lies certainly after a pause's call returned and before its resume's
  began was released while its thread was paused: a violation (a pause stops releases; the
  member released or running at the pause goes on, and so do its republications, which keep
  its token).  A purged member (its waiting entry dropped; Celery stores it ``REVOKED``) counts
  as deleted by the purge for its ending and its stored result, and an attempt of it that starts
  after the purge returned is a violation.  Dead letters redriven by one call go back at their
  places: their first attempts after it (retries reset: attempt 0, token after the call began)
  must be released in that order.  A thread paused at the end, with no member left, still
  exists: listed, and in the shard's paused hash (``GateState.paused``), which is no orphan.
* **Recovery.**  For each SIGKILL, each attempt its processes held (started and not ended, or
  received by that worker's main process and not started, with no later release of the thread
  before the kill): the time from the kill to the thread's next activity seen by a worker (a
  ``recv`` or ``start``, including a redelivery of the same release), less the part of that
  wait that the next member's schedule explains (the retry delay for the killed member's own
  re-entry), or to the killed member's death in the dead-letter store.  This bounds, from
  above, the time the gate took to notice the death.  A pool child whose whole worker is killed
  before the thread moved on is measured from the worker's kill (the worker never got to report
  its child's death).  A window that overlaps a time when the deployment could not move any
  thread on (the gate's Redis down: ``redis_down`` to ``redis_up``; no healthy worker: a
  ``healthy`` row with count 0 until the next one), or during which another worker was killed
  (the next member may have been lost with that one, and its recovery started over), is kept
  apart as *confounded*: it measures the outage or the second fault, not the gate.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

INF = float("inf")
SLACK_US = 2_000  # the gate's clock is in ms, and countdowns are truncated to ms
ENDED_WINDOW_MS = 30_000  # ENDED_WINDOW in lua/_common.lua: how long the ended index keeps an entry


@dataclass(frozen=True)
class Event:
    kind: str  # "recv", "start", "end", "fin", "kill", "redis_down",
    # "redis_up", "healthy"
    t: int  # µs; a kill's time is the one read just before the signal
    task: str = ""
    thread: str = ""
    attempt: int = 0  # request.retries
    token: str = ""
    pid: int = 0
    outcome: str = ""  # end: "success", "retry" or "die"
    pids: tuple[int, ...] = ()  # kill: every process that was killed
    what: str = ""  # kill: "worker" or "child"
    count: int = 0  # healthy: how many workers could take work from then on


@dataclass(frozen=True)
class Enqueue:
    task: str
    thread: str
    attempt: int
    at_lo: int  # µs, read before the call
    at_hi: int  # µs, read after it returned
    countdown: int = 0  # µs
    # A self.retry's re-entry (attempt >= 1) reaches the gate when the body has unwound:
    # ``in_gate_by`` is when the task saw the gate take it, None when it never did (a process
    # killed, the gate unreachable: the member was left to its lapsing lease, scheduled at the
    # lapse plus the retry delay).  The producer's enqueue (attempt 0) is in the gate when the
    # call returns.
    in_gate_by: Optional[int] = None
    # The exact scheduled_at (µs) when the producer gave an ``eta`` the gate takes as it is (a
    # multiple of 250 ms, exact in binary), else None: the schedule is known only within bounds.
    exact: Optional[int] = None
    # A call with coalesce or debounce: when it superseded a waiting call it took that call's
    # place (an earlier scheduled_at than its own), and a debounce puts it later: its schedule
    # is not known from the call's times, so it is neither checked nor a witness.
    coalesced: bool = False

    @property
    def landed(self) -> bool:
        return self.attempt == 0 or self.in_gate_by is not None

    @property
    def in_gate(self) -> int:
        return self.at_hi if self.in_gate_by is None else self.in_gate_by

    @property
    def sched_lo(self) -> int:
        if self.exact is not None:
            return self.exact
        return self.at_lo + self.countdown - SLACK_US

    @property
    def sched_hi(self) -> int:
        if self.exact is not None:
            return self.exact
        return self.at_hi + self.countdown + SLACK_US


@dataclass(frozen=True)
class Deletion:
    task: str
    lo: int
    hi: int
    # Superseded by a later call of its task (coalesce="latest", debounce) while it waited:
    # never released, so it never starts.
    superseded: bool = False


@dataclass(frozen=True)
class Redrive:
    thread: str
    lo: int  # µs, read before the call
    tasks: tuple[str, ...]  # the letters it put back, in their places' order


@dataclass
class Operations:
    """What the operator did: pauses (thread, when the pause call returned, when its resume's
    call began: INF while still paused), purged members (each with the purge call's times), and
    redrives."""

    pauses: list[tuple[str, int, float]] = field(default_factory=list)
    purged: list[Deletion] = field(default_factory=list)
    redrives: list[Redrive] = field(default_factory=list)


@dataclass(frozen=True)
class DeadLetter:
    thread: str
    reason: str
    died_at_ms: int
    retries: int = -1  # the gate's count of failed attempts (-1: not read)


@dataclass(frozen=True)
class GateState:
    due: dict[str, int] = field(default_factory=dict)  # thread -> head scheduled_at (ms)
    leases: dict[str, int] = field(default_factory=dict)  # thread -> deadline (ms)
    members: dict[str, str] = field(default_factory=dict)  # the tasks hash: task -> thread
    dead: dict[str, DeadLetter] = field(default_factory=dict)  # the dead-letter store
    thread_keys: dict[str, list[str]] = field(default_factory=dict)  # thread -> its key names
    # Policy hashes of threads that ended (not in thread_keys): thread -> ms to live (-1: none).
    lingering: dict[str, int] = field(default_factory=dict)
    active: dict[str, dict[str, str]] = field(default_factory=dict)  # thread -> its active hash
    # The shard's other keys, as read (None: not read, not checked).
    dead_index: Optional[list[str]] = None  # the dead zset's members
    dead_records: Optional[list[str]] = None  # the dead:records hash's fields
    ended: Optional[dict[str, float]] = None  # the ended index: task -> ended_at (ms)
    notes: Optional[dict[str, int]] = None  # deleted notes: task -> seconds to live (-1: none)
    other_keys: Optional[list[str]] = None  # keys under the prefix of no known shape
    paused: Optional[dict[str, str]] = None  # the shard's paused hash: thread -> reason
    listed: Optional[list[str]] = None  # Threads.ids() after the run
    stats: Optional[dict[str, int]] = None  # the shard's metrics counters (its stats hash)


@dataclass(frozen=True)
class Limits:
    keepalive: float  # s
    dispatch_interval: float  # s
    retry_delay: float  # s: default_retry_delay, used by the gate's own re-entries
    max_retries: int = 3  # the task's max_retries: a failed attempt past it dies
    # Threads whose members had a thread_rate_limit: thread -> the interval (µs) between two
    # releases.
    rates: dict[str, int] = field(default_factory=dict)
    # Threads whose members had on_death="hold": after a member's death, nothing of the thread
    # starts before the operator's next act on it (an "act" event).
    holding: frozenset[str] = frozenset()


@dataclass
class Attempt:
    task: str
    thread: str
    attempt: int
    token: str
    recv: Optional[int] = None
    recv_pid: int = 0
    start: Optional[int] = None
    pid: int = 0
    end: Optional[int] = None
    outcome: str = ""
    fin: Optional[int] = None
    killed: Optional[int] = None
    exempt: bool = False  # deleted while it ran: its part after the delete is exempt
    unrecorded: bool = False  # its worker could not record its end in the gate in time
    cut: Optional[int] = None  # when the delete of its member began (exempt attempts)

    @property
    def lo(self) -> int:
        times = [t for t in (self.recv, self.start) if t is not None]
        return min(times)

    @property
    def hi(self) -> float:
        if self.end is not None:
            return self.end
        if self.killed is not None:
            return self.killed
        return INF

    @property
    def until(self) -> float:
        """The end of the part of the attempt that must not overlap a sibling's: a deleted
        member's attempt only until its delete began."""
        return self.hi if self.cut is None else min(self.hi, self.cut)

    @property
    def tok(self) -> int:
        try:
            return int(self.token)
        except ValueError:
            return -1

    def describe(self) -> str:
        hi = "open" if self.hi == INF else _s(self.hi)
        how = self.outcome or ("killed" if self.killed is not None else "no end")
        return (
            f"{self.task}#{self.attempt} token {self.token} pid {self.pid or self.recv_pid} "
            f"[{_s(self.lo)} .. {hi}] {how}"
        )


@dataclass
class Report:
    members: int = 0
    attempts: int = 0
    succeeded: int = 0
    dead_lettered: int = 0
    deleted: int = 0
    overlaps: list[str] = field(default_factory=list)
    bad_endings: list[str] = field(default_factory=list)
    order_violations: list[str] = field(default_factory=list)
    superseded_started: list[str] = field(default_factory=list)
    superseded: int = 0
    early_starts: list[str] = field(default_factory=list)
    rate_violations: list[str] = field(default_factory=list)
    rates_checked: int = 0
    hold_violations: list[str] = field(default_factory=list)
    holds_checked: int = 0
    releases_checked: int = 0
    waiting_compared: int = 0
    ties_compared: int = 0
    schedules_checked: int = 0
    stuck: list[str] = field(default_factory=list)
    orphans: list[str] = field(default_factory=list)
    recoveries: dict[str, list[float]] = field(default_factory=dict)  # kind -> seconds
    worst_recovery: dict[str, float] = field(default_factory=dict)  # kind -> seconds
    confounded: dict[str, list[float]] = field(default_factory=dict)  # kind -> seconds
    result_mismatches: list[str] = field(default_factory=list)
    results_checked: int = 0
    operator_violations: list[str] = field(default_factory=list)
    paused_checked: int = 0  # attempts compared with a pause of their thread
    redriven_checked: int = 0  # redriven letters whose order was checked
    keepalive: float = 0.0
    dispatch_interval: float = 0.0
    info: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (
            self.overlaps
            or self.bad_endings
            or self.order_violations
            or self.superseded_started
            or self.early_starts
            or self.rate_violations
            or self.hold_violations
            or self.stuck
            or self.orphans
            or self.result_mismatches
            or self.operator_violations
        )

    def counts(self) -> dict[str, int]:
        return {
            "overlaps": len(self.overlaps),
            "bad_endings": len(self.bad_endings),
            "order_violations": len(self.order_violations),
            "superseded_started": len(self.superseded_started),
            "early_starts": len(self.early_starts),
            "rate_violations": len(self.rate_violations),
            "hold_violations": len(self.hold_violations),
            "stuck": len(self.stuck),
            "orphans": len(self.orphans),
            "result_mismatches": len(self.result_mismatches),
            "operator_violations": len(self.operator_violations),
        }

    def as_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["counts"] = self.counts()
        data["ok"] = self.ok
        return data

    def format(self, limit: int = 10) -> str:
        lines = [
            f"members {self.members} (attempts {self.attempts}): succeeded {self.succeeded}, "
            f"dead-lettered {self.dead_lettered}, deleted {self.deleted}",
            f"overlaps: {len(self.overlaps)}",
            *_first(self.overlaps, limit),
            f"members not ended exactly once: {len(self.bad_endings)}",
            *_first(self.bad_endings, limit),
            f"order violations: {len(self.order_violations)} "
            f"({self.releases_checked} releases checked against {self.waiting_compared} "
            f"siblings certainly waiting at the time, {self.ties_compared} of them tied on "
            "scheduled_at)",
            *_first(self.order_violations, limit),
            f"superseded members that were received or started: "
            f"{len(self.superseded_started)} ({self.superseded} superseded)",
            *_first(self.superseded_started, limit),
            f"attempts received or started before their scheduled_at: {len(self.early_starts)} "
            f"({self.schedules_checked} checked)",
            *_first(self.early_starts, limit),
            f"releases of a rate-limited thread closer than its interval: "
            f"{len(self.rate_violations)} ({self.rates_checked} checked)",
            *_first(self.rate_violations, limit),
            f"starts in a thread held by a death before the operator acted: "
            f"{len(self.hold_violations)} ({self.holds_checked} deaths checked)",
            *_first(self.hold_violations, limit),
            f"stored results that disagree with how their member ended: "
            f"{len(self.result_mismatches)} ({self.results_checked} checked)",
            *_first(self.result_mismatches, limit),
            f"stuck threads: {len(self.stuck)}",
            *_first(self.stuck, limit),
            f"gate keys left over: {len(self.orphans)}",
            *_first(self.orphans, limit),
            f"operator violations: {len(self.operator_violations)} ({self.paused_checked} "
            f"attempts compared with a pause, {self.redriven_checked} redriven letters' order)",
            *_first(self.operator_violations, limit),
        ]
        bound = self.keepalive + self.dispatch_interval
        for kind in ("worker", "child"):
            values = self.recoveries.get(kind, [])
            if values:
                lines.append(
                    f"recovery after a {kind} kill: worst {max(values):.2f}s, median "
                    f"{sorted(values)[len(values) // 2]:.2f}s over {len(values)} held "
                    f"members (keepalive {self.keepalive:g}s + tick "
                    f"{self.dispatch_interval:g}s = {bound:g}s)"
                )
            else:
                lines.append(f"recovery after a {kind} kill: nothing measured")
            apart = self.confounded.get(kind, [])
            if apart:
                lines.append(
                    f"  and {len(apart)} more whose window overlapped an outage (gate "
                    f"Redis down, or no healthy worker) or another worker's kill: worst "
                    f"{max(apart):.2f}s"
                )
        lines += [f"info: {x}" for x in self.info]
        lines.append("RESULT: " + ("OK" if self.ok else "VIOLATIONS"))
        return "\n".join(lines)


def _first(items: list[str], limit: int) -> list[str]:
    shown = [f"  - {x}" for x in items[:limit]]
    if len(items) > limit:
        shown.append(f"  ... and {len(items) - limit} more")
    return shown


def _s(us: float) -> str:
    return f"{us / 1e6:.3f}"


# -- building attempts ------------------------------------------------------------------------


def build_attempts(history: Sequence[Event]) -> tuple[list[Attempt], list[Event]]:
    """Attempts (one per release seen by a worker, or per start) and the kill events."""
    attempts: list[Attempt] = []
    by_release: dict[tuple[str, str], list[Attempt]] = defaultdict(list)
    kills: list[Event] = []
    latest: dict[int, Attempt] = {}  # pid -> the attempt it started last
    for e in sorted(history, key=lambda e: e.t):
        key = (e.task, e.token)
        if e.kind == "recv":
            a = Attempt(e.task, e.thread, e.attempt, e.token, recv=e.t, recv_pid=e.pid)
            attempts.append(a)
            by_release[key].append(a)
        elif e.kind == "start":
            waiting = [a for a in by_release[key] if a.start is None]
            if waiting:
                a = waiting[-1]
            else:
                a = Attempt(e.task, e.thread, e.attempt, e.token)
                attempts.append(a)
                by_release[key].append(a)
            a.start, a.pid = e.t, e.pid
            latest[e.pid] = a
        elif e.kind in ("end", "fin"):
            mine = [
                a
                for a in by_release[key]
                if a.start is not None
                and a.pid == e.pid
                and (a.end is None if e.kind == "end" else a.end is not None and a.fin is None)
            ]
            if mine:
                if e.kind == "end":
                    mine[0].end, mine[0].outcome = e.t, e.outcome
                else:
                    mine[0].fin = e.t
        elif e.kind == "unrecorded":
            # The worker logged that this task's ending could not reach the gate while its lease
            # held (the gate counts the attempt as failed): its latest attempt that had ended.
            ended = [a for a in attempts if a.task == e.task and a.end is not None and a.end <= e.t]
            if ended:
                ended[-1].unrecorded = True
        elif e.kind == "kill":
            kills.append(e)
            pids = set(e.pids)
            for pid in pids:
                # A pool child runs one attempt at a time: its latest one was cut short if it had
                # not ended, or had ended in success without reaching ``fin``.
                cut = latest.pop(pid) if pid in latest else None
                if (
                    cut is not None
                    and cut.killed is None
                    and (cut.end is None or (cut.outcome == "success" and cut.fin is None))
                ):
                    cut.killed = e.t
            for held in attempts:
                if (
                    held.killed is None
                    and held.start is None
                    and held.recv_pid in pids
                    and held.recv is not None
                    and held.recv <= e.t
                ):
                    held.killed = e.t  # received by a killed main process, never started
    return attempts, kills


# -- the check --------------------------------------------------------------------------------


def check(
    history: Sequence[Event],
    gate: GateState,
    deleted: Sequence[Deletion],
    enqueues: Sequence[Enqueue],
    limits: Limits,
    results: Optional[dict[str, str]] = None,
    operations: Optional[Operations] = None,
) -> Report:
    report = Report(keepalive=limits.keepalive, dispatch_interval=limits.dispatch_interval)
    attempts, kills = build_attempts(history)
    ops = operations or Operations()
    # A purged member ends as a deleted one does (REVOKED), by the purge.
    deletions = {d.task: d for d in (*deleted, *ops.purged)}
    known = {(e.task, e.attempt): e for e in enqueues if e.landed and not e.coalesced}
    unlanded = {(e.task, e.attempt): e for e in enqueues if not e.landed and not e.coalesced}

    thread_of: dict[str, str] = {}
    for e in enqueues:
        thread_of.setdefault(e.task, e.thread)
    for a in attempts:
        thread_of.setdefault(a.task, a.thread)
    for task, dead in gate.dead.items():
        thread_of.setdefault(task, dead.thread)
    for task, thread in gate.members.items():
        thread_of.setdefault(task, thread)
    for task in deletions:
        thread_of.setdefault(task, "?")

    for a in attempts:
        d = deletions.get(a.task)
        if d is not None and a.hi > d.lo:
            a.exempt, a.cut = True, d.lo

    report.members = len(thread_of)
    report.attempts = sum(1 for a in attempts if a.start is not None)
    unended = [a for a in attempts if a.start is not None and a.hi == INF and not a.exempt]
    if unended:
        report.info.append(
            f"{len(unended)} attempt(s) started and neither ended nor were killed: "
            + "; ".join(a.describe() for a in unended[:5])
        )
    first = {e.task: e for e in enqueues if e.attempt == 0}
    _check_overlaps(attempts, report)
    _check_superseded(attempts, deletions, report)
    _check_endings(thread_of, attempts, kills, gate, deletions, limits, report)
    if ops.redrives:
        # A redriven member lives again from attempt 0: its attempts and retries after a redrive
        # are another life's, which order and schedules tell apart by name.
        life = _lives(ops)
        lived = [dataclasses.replace(a, task=life(a.task, a.lo)) for a in attempts]
        again = [dataclasses.replace(e, task=life(e.task, e.at_lo)) for e in enqueues]
        _check_order(
            lived,
            {(e.task, e.attempt): e for e in again if e.landed and not e.coalesced},
            {(e.task, e.attempt): e for e in again if not e.landed and not e.coalesced},
            {e.task: e for e in again if e.attempt == 0},
            limits,
            report,
        )
        _check_schedules(
            lived, {(e.task, e.attempt): e for e in again if e.landed and not e.coalesced}, report
        )
    else:
        _check_order(attempts, known, unlanded, first, limits, report)
        _check_schedules(attempts, known, report)
    _check_rates(attempts, limits, report)
    _check_holds(history, attempts, gate, limits, report)
    if results is not None:
        _check_results(thread_of, attempts, kills, gate, deletions, results, report)
    _check_gate(gate, thread_of, deletions, report)
    _check_operations(attempts, ops, gate, thread_of, report)
    _check_counters(gate, ops, report)
    _measure_recovery(history, attempts, kills, gate, deletions, known, limits, report)
    return report


def _lives(ops: Operations) -> Any:
    """``life(task, t)``: the name of ``task``'s life at ``t`` µs: the task id itself before its
    first redrive, ``<task id>~<n>`` after its n-th."""
    redriven: dict[str, list[int]] = defaultdict(list)
    for r in ops.redrives:
        for task in r.tasks:
            redriven[task].append(r.lo)

    def life(task: str, t: int) -> str:
        n = sum(1 for lo in redriven.get(task, ()) if lo < t)
        return f"{task}~{n}" if n else task

    return life


def _by_thread(attempts: Iterable[Attempt]) -> dict[str, list[Attempt]]:
    threads: dict[str, list[Attempt]] = defaultdict(list)
    for a in attempts:
        threads[a.thread].append(a)
    return threads


def _check_overlaps(attempts: list[Attempt], report: Report) -> None:
    # A deleted member's attempt counts until its delete began: what it overlapped before is a
    # violation, what runs beside it after is not (the thread does not wait for its worker).
    started = [a for a in attempts if a.start is not None and a.until > a.lo]
    for thread, spans in sorted(_by_thread(started).items()):
        spans.sort(key=lambda a: a.lo)
        for i, a in enumerate(spans):
            for b in spans[i + 1 :]:
                if b.lo >= a.until:
                    break
                report.overlaps.append(
                    f"thread {thread}: {a.describe()} overlaps "
                    f"{b.describe()}" + (" before its delete" if a.cut or b.cut else "")
                )


def _check_superseded(attempts: list[Attempt], deletions: dict[str, Deletion], report: Report) -> None:
    """A superseded member was never released: no worker received or started it."""
    report.superseded = sum(1 for d in deletions.values() if d.superseded)
    for a in attempts:
        d = deletions.get(a.task)
        if d is not None and d.superseded:
            report.superseded_started.append(
                f"thread {a.thread}: {a.describe()} ran, but a later call of its task "
                f"superseded it at {_s(d.lo)}"
            )


def _dead_letter_unexplained(
    dead: DeadLetter, rows: list[Attempt], kills: list[Event], limits: Limits
) -> Optional[str]:
    """Why the history does not explain a dead letter, or None when it does: an attempt's user
    code failed for good (``end`` with ``die``), or an attempt that was the last one its retries
    allowed failed without an ending (its process killed, or no end at all) and the gate counted
    its retries as exhausted.  An attempt killed after its claim but before it wrote ``start``
    leaves no row: a kill after the member's last row, with the previous attempt the last but
    one, explains it too."""
    if any(a.outcome == "die" for a in rows):
        return None
    if 0 <= dead.retries < limits.max_retries:
        return (
            f"its retries were not exhausted ({dead.retries} of {limits.max_retries}) and "
            f"no attempt failed for good: {dead.reason[:80]}"
        )
    started = [a for a in rows if a.start is not None]
    if any(a.attempt >= limits.max_retries and a.end is None for a in started):
        return None
    last = max((a.attempt for a in started), default=-1)
    seen = max((t for a in rows for t in (a.recv, a.start, a.end) if t is not None), default=0)
    if last == limits.max_retries - 1 and any(k.t > seen for k in kills):
        return None
    return (
        f"no attempt failed for good and none at its last retry ({limits.max_retries}) was "
        f"cut short (attempts seen: {sorted({a.attempt for a in rows})}): "
        f"{dead.reason[:80]}"
    )


def _check_endings(
    thread_of: dict[str, str],
    attempts: list[Attempt],
    kills: list[Event],
    gate: GateState,
    deletions: dict[str, Deletion],
    limits: Limits,
    report: Report,
) -> None:
    by_task: dict[str, list[Attempt]] = defaultdict(list)
    for a in attempts:
        by_task[a.task].append(a)
    completed: dict[str, int] = defaultdict(int)
    interrupted: dict[str, int] = defaultdict(int)
    for a in attempts:
        if a.outcome != "success":
            continue
        if (a.fin is None and a.killed is not None) or a.unrecorded:
            interrupted[a.task] += 1
        else:
            completed[a.task] += 1
    reruns = 0
    for task, thread in sorted(thread_of.items()):
        c, i = completed[task], interrupted[task]
        dead, gone = task in gate.dead, task in deletions
        where = f"member {task} of thread {thread}"
        if task in gate.members:
            report.bad_endings.append(f"{where} is still a member after the run quiesced")
            continue
        if gone:
            report.deleted += 1
            if dead:
                report.bad_endings.append(f"{where} was deleted and is also dead-lettered")
            elif c > 1:
                report.bad_endings.append(f"{where} was deleted and also succeeded {c} times")
            continue
        if c + (1 if dead else 0) == 0:
            if i:
                report.succeeded += 1  # killed after user code returned; the gate had it
                continue
            report.bad_endings.append(
                f"{where} was lost: it never succeeded, is not dead-lettered and was not deleted"
            )
        elif c + (1 if dead else 0) > 1:
            what = f"succeeded {c} times" + (" and is dead-lettered" if dead else "")
            report.bad_endings.append(f"{where} {what}")
        else:
            if dead:
                report.dead_lettered += 1
                why = _dead_letter_unexplained(gate.dead[task], by_task[task], kills, limits)
                if why is not None:
                    report.bad_endings.append(f"{where} is dead-lettered but {why}")
            else:
                report.succeeded += 1
            reruns += 1 if i else 0
    if reruns:
        report.info.append(
            f"{reruns} member(s) ran again after their process was killed, or "
            "their ending could not reach the gate while their lease held, between "
            "the end of user code and the gate's finish (at-least-once window)"
        )


FINAL_STATES = ("SUCCESS", "FAILURE", "REVOKED")


def _check_results(
    thread_of: dict[str, str],
    attempts: list[Attempt],
    kills: list[Event],
    gate: GateState,
    deletions: dict[str, Deletion],
    results: dict[str, str],
    report: Report,
) -> None:
    by_task: dict[str, list[Attempt]] = defaultdict(list)
    starts: dict[int, list[int]] = defaultdict(list)  # pid -> its attempts' starts
    for a in attempts:
        by_task[a.task].append(a)
        if a.start is not None:
            starts[a.pid].append(a.start)

    def cut_short(a: Attempt) -> bool:
        """Its process was killed after its ``end`` row and before it started anything else
        (or, for a success, before ``fin``): Celery may not have stored its state."""
        if a.end is None or a.start is None:
            return False
        after = min((t for t in starts[a.pid] if t > a.start), default=INF)
        return any(a.pid in k.pids and a.end <= k.t < after for k in kills)

    unstored: list[str] = []
    for task, thread in sorted(thread_of.items()):
        if task in gate.members:
            continue
        rows = by_task[task]
        succeeded = any(a.outcome == "success" for a in rows)
        if task in deletions and task not in gate.dead:
            how, expected = "was deleted", {"REVOKED", *(("SUCCESS",) if succeeded else ())}
        elif task in gate.dead and task not in deletions:
            how, expected = "died", {"FAILURE"}
        elif succeeded:
            how, expected = "succeeded", {"SUCCESS"}
        else:
            continue  # not ended exactly once: the endings' check says so
        report.results_checked += 1
        stored = results.get(task, "PENDING")
        if stored in expected:
            continue
        if any(cut_short(a) for a in rows) and stored not in FINAL_STATES:
            unstored.append(f"{task} ({how}, reads {stored})")
            continue
        report.result_mismatches.append(
            f"member {task} of thread {thread} {how} but its stored result reads {stored}"
        )
    if unstored:
        report.info.append(
            f"{len(unstored)} member(s) whose ending attempt was killed between "
            "its ending and Celery's store hold no final state: " + ", ".join(unstored[:5])
        )


def _check_order(
    attempts: list[Attempt],
    known: dict[tuple[str, int], Enqueue],
    unlanded: dict[tuple[str, int], Enqueue],
    first: dict[str, Enqueue],
    limits: Limits,
    report: Report,
) -> None:
    retry_delay_us = int(limits.retry_delay * 1e6)
    for thread, rows in sorted(_by_thread(attempts).items()):
        released = sorted((a for a in rows if a.tok >= 0), key=lambda a: a.tok)
        # The release token of each (member, attempt) that a worker saw.
        token_of: dict[tuple[str, int], int] = {}
        for a in released:
            token_of.setdefault((a.task, a.attempt), a.tok)
        witnesses = [(known[key], tok) for key, tok in token_of.items() if key in known]
        last_seen: dict[str, list[tuple[int, int]]] = defaultdict(list)  # task -> (attempt, t)
        # A copy received but never started while another copy of its release started lost the
        # claim: the kill of the process that received it says nothing about the attempt.
        started = {(a.task, a.tok) for a in rows if a.start is not None}
        for a in rows:
            lost_claim = a.start is None and (a.task, a.tok) in started
            for t in (a.recv, a.start, a.end, None if lost_claim else a.killed):
                if t is not None:
                    last_seen[a.task].append((a.attempt, t))
        for x in released:
            enq = known.get((x.task, x.attempt))
            if enq is not None:
                sched_lo = enq.sched_lo
                floor = max(enq.sched_lo, enq.at_lo)
            else:
                before = [t for n, t in last_seen[x.task] if n < x.attempt]
                tried = unlanded.get((x.task, x.attempt))
                lows = ([max(before) + retry_delay_us - SLACK_US] if before else []) + (
                    [tried.sched_lo] if tried is not None else []
                )
                if not lows:
                    continue
                # Re-entered by the gate (a lapse), or by a retry whose landing went unrecorded.
                sched_lo = min(lows)
                floor = sched_lo
            upper = x.lo
            for p in released:
                if p.tok >= x.tok:
                    break
                if p.start is not None and not p.exempt and p.hi != INF and p.hi <= upper:
                    floor = max(floor, int(p.hi) - SLACK_US)
            report.releases_checked += 1
            for y, y_tok in witnesses:
                if y.task == x.task or y_tok <= x.tok or y.in_gate >= floor:
                    continue
                report.waiting_compared += 1  # y certainly waited while x was released
                if y.sched_hi < sched_lo:
                    report.order_violations.append(
                        f"thread {thread}: {x.task}#{x.attempt} (token {x.tok}, scheduled at or "
                        f"after {_s(sched_lo)}, released after {_s(floor)}) went before "
                        f"{y.task}#{y.attempt} (token {y_tok}, enqueued by {_s(y.in_gate)}, "
                        f"scheduled by {_s(y.sched_hi)})"
                    )
                    break
                if _tied_and_first(y, enq, first, report):
                    report.order_violations.append(
                        f"thread {thread}: {x.task}#{x.attempt} (token {x.tok}) went before "
                        f"{y.task}#{y.attempt} (token {y_tok}), both scheduled at exactly "
                        f"{_s(sched_lo)}, although {y.task} arrived first (by "
                        f"{_s(first[y.task].at_hi)}, {x.task} after {_s(first[x.task].at_lo)})"
                    )
                    break


def _check_rates(attempts: list[Attempt], limits: Limits, report: Report) -> None:
    """thread_rate_limit: two releases of a rate-limited thread are at least its interval apart
    on the gate's clock.  A release's token is the shard counter's value, which never falls
    below the clock in microseconds and follows it within a few units (lua/_common.lua
    next_seq): consecutive tokens a worker saw are the interval apart, less the gate clock's
    millisecond resolution.  (A release no worker saw only widens the gap.)"""
    for thread, interval in sorted(limits.rates.items()):
        tokens = sorted({a.tok for a in attempts if a.thread == thread and a.tok >= 0})
        for t1, t2 in zip(tokens, tokens[1:]):
            report.rates_checked += 1
            if t2 - t1 < interval - SLACK_US:
                report.rate_violations.append(
                    f"thread {thread}: releases {t1} and {t2} came {_s(t2 - t1)} apart, under "
                    f"its thread_rate_limit's interval {_s(interval)}"
                )


def _check_holds(
    history: Sequence[Event], attempts: list[Attempt], gate: GateState, limits: Limits, report: Report
) -> None:
    """on_death="hold": after a member of a holding thread died (its body recorded the death,
    and it is in the dead-letter store), no attempt of the thread starts until the operator's
    next act on it (the time read before its resume)."""
    acts: dict[str, list[int]] = defaultdict(list)
    for e in history:
        if e.kind == "act":
            acts[e.thread].append(e.t)
    for thread, rows in sorted(_by_thread(attempts).items()):
        if thread not in limits.holding:
            continue
        for a in rows:
            if a.outcome != "die" or a.end is None or a.exempt or a.task not in gate.dead:
                continue
            report.holds_checked += 1
            until = min((t for t in acts[thread] if t > a.end), default=INF)
            early = [b for b in rows if b.start is not None and a.end < b.start < until]
            if early:
                report.hold_violations.append(
                    f"thread {thread}: {early[0].describe()} started after {a.describe()} died "
                    f"and before the operator acted ({'never' if until == INF else _s(until)})"
                )


def _tied_and_first(y: Enqueue, x: Optional[Enqueue], first: dict[str, Enqueue], report: Report) -> bool:
    """Whether ``y`` is certainly scheduled at the same time as ``x`` (both exact) and arrived
    before it (its first enqueue returned before ``x``'s began): equal schedules go by arrival
    order, which a retry keeps."""
    if x is None or x.exact is None or y.exact != x.exact:
        return False
    report.ties_compared += 1
    fy, fx = first.get(y.task), first.get(x.task)
    return fy is not None and fx is not None and fy.at_hi < fx.at_lo


def _check_schedules(attempts: list[Attempt], known: dict[tuple[str, int], Enqueue], report: Report) -> None:
    """No attempt is received or started before its scheduled_at.  The producer's enqueue has a
    schedule the gate computes on its own clock during the call (or takes exactly from an eta):
    at least ``sched_lo``.  A retry's re-entry is scheduled from its claim's time (read on the
    gate's clock after the retrying attempt was received) plus its countdown: at least that
    attempt's ``recv`` plus the countdown, less the clock's resolution."""
    ran = {(a.task, a.attempt): a.recv for a in attempts if a.start is not None and a.recv}
    for a in attempts:
        enq = known.get((a.task, a.attempt))
        if enq is None:
            continue
        if a.attempt == 0:
            bound = enq.sched_lo
        else:
            before = ran.get((a.task, a.attempt - 1))
            if before is None:
                continue
            bound = before + enq.countdown - SLACK_US
        report.schedules_checked += 1
        if a.lo < bound:
            report.early_starts.append(
                f"thread {a.thread}: {a.describe()} began {(bound - a.lo) / 1e3:.1f} ms before "
                f"its scheduled_at (at or after {_s(bound)})"
            )


def _check_gate(
    gate: GateState, thread_of: dict[str, str], deletions: dict[str, Deletion], report: Report
) -> None:
    indexed = set(gate.due) | set(gate.leases)
    for thread in sorted(set(gate.due) & set(gate.leases)):
        report.orphans.append(f"thread {thread} is in both the due and the leases index")
    for thread in sorted(indexed):
        active = gate.active.get(thread) or {}
        if active:
            what = (
                f"active member {active.get('task')} {active.get('state')} "
                f"(worker {active.get('worker') or '-'}), deadline {active.get('deadline')}"
            )
        else:
            what = f"idle, head due at {gate.due.get(thread)}"
        waiting = sum(1 for t in gate.members.values() if t == thread) - (1 if active else 0)
        report.stuck.append(f"thread {thread}: {what}; {waiting} waiting")
        if not gate.thread_keys.get(thread):
            report.orphans.append(f"thread {thread} is indexed but has no keys")
    for thread, keys in sorted(gate.thread_keys.items()):
        if thread not in indexed:
            report.orphans.append(f"thread {thread} has keys {sorted(keys)} but is in no index")
    # A thread's policy hash outlives its last member by the ended window, no more.
    for thread, ttl in sorted(gate.lingering.items()):
        if not 0 < ttl <= ENDED_WINDOW_MS:
            report.orphans.append(
                f"policy hash of ended thread {thread} with {ttl} ms to live "
                f"(not within the {ENDED_WINDOW_MS} ms window)"
            )
    for task, thread in sorted(gate.members.items()):
        if thread not in indexed:
            report.orphans.append(f"tasks entry {task} -> {thread}, a thread in no index")
    _check_shard_keys(gate, thread_of, deletions, report)


def _check_shard_keys(
    gate: GateState, thread_of: dict[str, str], deletions: dict[str, Deletion], report: Report
) -> None:
    """The shard's keys besides the threads' once the run quiesced: the dead store's two keys
    name the same tasks; the ended index holds only members that ended, none at +inf (a member
    keyed by its long form, which would still be a member) and none older than the window before
    the newest (each end trims them); a deleted note lives only with its TTL, for a member that
    was deleted (a worker takes it when it announces the delete); and no key of another shape."""
    if gate.dead_index is not None and gate.dead_records is not None:
        index, records = set(gate.dead_index), set(gate.dead_records)
        for task in sorted(index - records):
            report.orphans.append(f"dead index entry {task} has no dead record")
        for task in sorted(records - index):
            report.orphans.append(f"dead record {task} is in no dead index")
    if gate.ended is not None:
        finite = [at for at in gate.ended.values() if at != INF]
        newest = max(finite, default=0.0)
        for entry, at in sorted(gate.ended.items()):
            # A redrive's or a replacement's admission is remembered there for the window too,
            # as "\0redriven:<call>:<task id>" or "\0replaced:<nesting>:<task id>".
            task = entry.rsplit(":", 1)[-1] if entry.startswith("\0") else entry
            if at == INF:
                report.orphans.append(
                    f"ended index entry {task} at +inf (a long-form member that never ended)"
                )
            elif task not in thread_of:
                report.orphans.append(f"ended index entry {task}: not a member of this run")
            elif at < newest - ENDED_WINDOW_MS:
                report.orphans.append(
                    f"ended index entry {task} at {at:.0f} ms, more than "
                    f"{ENDED_WINDOW_MS} ms before the newest ({newest:.0f}): "
                    "not trimmed"
                )
    if gate.notes is not None:
        pending = 0
        for task, ttl in sorted(gate.notes.items()):
            if task not in deletions:
                report.orphans.append(f"deleted note of {task}, which was not deleted")
            elif ttl < 0:
                report.orphans.append(f"deleted note of {task} without a TTL")
            else:
                pending += 1
        if pending:
            report.info.append(
                f"{pending} deleted note(s) not taken by a worker (no "
                "task-revoked sent; they expire with their TTL)"
            )
    for key in sorted(gate.other_keys or ()):
        report.orphans.append(f"gate key {key} of no known shape")


def _impaired(history: Sequence[Event]) -> list[tuple[float, float]]:
    """Intervals when nothing could move a thread on: the gate's Redis down, or no healthy
    worker (an open interval runs to the end)."""
    spans: list[tuple[float, float]] = []
    down: Optional[float] = None
    idle: Optional[float] = None
    for e in sorted(history, key=lambda e: e.t):
        if e.kind == "redis_down" and down is None:
            down = e.t
        elif e.kind == "redis_up" and down is not None:
            spans.append((down, e.t))
            down = None
        elif e.kind == "healthy":
            if e.count == 0 and idle is None:
                idle = e.t
            elif e.count > 0 and idle is not None:
                spans.append((idle, e.t))
                idle = None
    spans += [(t, INF) for t in (down, idle) if t is not None]
    return spans


def _check_operations(
    attempts: list[Attempt], ops: Operations, gate: GateState, thread_of: dict[str, str], report: Report
) -> None:
    """What each operator action allows (see the module's notes)."""
    pauses: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for thread, paused, resumed in ops.pauses:
        pauses[thread].append((paused, resumed))
    for a in attempts:
        if a.start is None or a.tok < 0:
            continue
        for paused, resumed in pauses.get(a.thread, ()):
            report.paused_checked += 1
            if paused + SLACK_US < a.tok < resumed - SLACK_US:
                report.operator_violations.append(
                    f"thread {a.thread}: {a.describe()} was released while the thread was "
                    f"paused ({_s(paused)} .. {_s(resumed) if resumed != INF else 'the end'})"
                )
    started: dict[str, list[Attempt]] = defaultdict(list)
    for a in attempts:
        if a.start is not None:
            started[a.task].append(a)
    for d in ops.purged:
        for a in started.get(d.task, ()):
            if a.start is not None and a.start > d.hi:
                report.operator_violations.append(
                    f"purged member {d.task}: {a.describe()} started after its purge (by {_s(d.hi)})"
                )
    for r in ops.redrives:
        first: dict[str, int] = {}
        for a in attempts:
            if a.task in r.tasks and a.attempt == 0 and a.tok > r.lo:
                first[a.task] = min(first.get(a.task, a.tok), a.tok)
        ordered = [t for t in r.tasks if t in first]
        report.redriven_checked += len(ordered)
        for before, after in zip(ordered, ordered[1:]):
            if first[before] > first[after]:
                report.operator_violations.append(
                    f"thread {r.thread}: redriven {after} (token {first[after]}) was released "
                    f"before {before} (token {first[before]}), which died before it in place "
                    "order"
                )
    known = set(thread_of.values()) | {t for t, _, _ in ops.pauses}
    for thread in sorted(gate.paused or {}):
        if thread not in known:
            report.orphans.append(f"paused entry of {thread}, not a thread of this run")
        elif gate.listed is not None and thread not in gate.listed:
            report.operator_violations.append(f"paused thread {thread} is not listed")


def _measure_recovery(
    history: Sequence[Event],
    attempts: list[Attempt],
    kills: list[Event],
    gate: GateState,
    deletions: dict[str, Deletion],
    known: dict[tuple[str, int], Enqueue],
    limits: Limits,
    report: Report,
) -> None:
    retry_delay_us = int(limits.retry_delay * 1e6)
    impaired = _impaired(history)
    threads = _by_thread(a for a in attempts if a.tok >= 0)
    for rows in threads.values():
        rows.sort(key=lambda a: a.lo)
    for first in kills:
        held = [a for a in attempts if a.killed == first.t and a.task not in deletions]
        for a in held:
            rows = threads.get(a.thread, [])
            if any(
                b is not a and b.tok >= a.tok and b.lo <= first.t
                for b in rows
                if b.start is not None or b.tok > a.tok
            ):
                continue  # the thread had moved on already (a dropped prefetch)
            nxt = next((b for b in rows if b.lo > first.t), None)
            kill = first
            if first.what == "child" and a.recv_pid:
                # The worker whose child it was died too before the thread moved on: the worker's
                # death is the one the gate had to notice.
                kill = next(
                    (
                        k
                        for k in kills
                        if k.t > first.t and a.recv_pid in k.pids and (nxt is None or k.t < nxt.lo)
                    ),
                    first,
                )
            candidates: list[float] = []
            if nxt is not None:
                enq = known.get((nxt.task, nxt.attempt))
                if enq is not None:
                    candidates.append(nxt.lo - max(kill.t, enq.sched_hi))
                elif nxt.task == a.task:
                    candidates.append(nxt.lo - kill.t - retry_delay_us)
                else:
                    candidates.append(nxt.lo - kill.t)
            dead = gate.dead.get(a.task)
            if dead is not None and dead.died_at_ms * 1000 > kill.t:
                candidates.append(dead.died_at_ms * 1000 - kill.t)
            if candidates:
                took = max(0.0, min(candidates))
                end = kill.t + took
                apart = any(lo <= end and kill.t <= hi for lo, hi in impaired) or any(
                    k.what == "worker" and kill.t < k.t < end for k in kills
                )
                (report.confounded if apart else report.recoveries).setdefault(kill.what, []).append(
                    round(took / 1e6, 3)
                )
    report.worst_recovery = {k: max(v) for k, v in report.recoveries.items() if v}


def _check_counters(gate: GateState, ops: Operations, report: Report) -> None:
    """The metrics' counters, kept by the transitions themselves: after the run nothing runs,
    and every life of a member ended once, counted once: each member that ended, and each death
    a redrive undid (the letter lived again)."""
    if gate.stats is None:
        return
    ended = {k: v for k, v in gate.stats.items() if k.startswith("ended:")}
    lives = report.succeeded + report.dead_lettered + report.deleted + sum(len(r.tasks) for r in ops.redrives)
    report.info.append(
        f"metrics counters: {ended}, running {gate.stats.get('running', 0)}, "
        f"retries {gate.stats.get('retries', 0)}, lapses "
        f"{gate.stats.get('lapses', 0)}; {lives} lives ended"
    )
    if gate.stats.get("running", 0) != 0:
        report.bad_endings.append(
            f"metrics: {gate.stats.get('running')} members counted as running after the run quiesced"
        )
    if sum(ended.values()) != lives:
        report.bad_endings.append(
            f"metrics: {sum(ended.values())} endings counted {ended}, but {lives} lives ended"
        )
