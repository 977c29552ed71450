"""The gate's transitions: :class:`Gate` names each script call that changes the gate (enqueue,
claim, finish, ...), and the few plain writes beside them (the deleted-member notes, dead letters
dropped in batches), and turns their replies into Python values; its plain reads are
:class:`~.reads.GateReads`' (``Gate.reads``).  It never publishes to the broker
(:mod:`celery_threads.publish`) and never decides policy (the task and worker modules).
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Sequence
from typing import Any, Callable, Optional, cast

import redis
from redis.commands.core import Script

from ..errors import ConfigurationError, InvalidArgument, NotReplicated
from ..keys import Keys, ShardKeys
from ..logs import get_logger
from . import cluster
from . import deadline as caller_deadline
from .client import RETRY_BUDGET, SOCKET_TIMEOUT, wait_timeout_ms
from .library import _load_lua, function_library, script_sources
from .reads import GateReads, clock_argument
from .records import (
    HOLD_MARK,
    Record,
    ReleasePush,
    _max_retries,
    _text,
    call_id,
    parse_record,
)
from .replies import (
    REPLIES,
    Claim,
    Done,
    Outcome,
    Redriven,
    Release,
    Renewal,
)
from .wire import (
    _MISSED,
    ScriptLine,
    _pack,
    _Packer,
)

logger = get_logger(__name__)

#: The most one transition waits in all when its caller set no bound (a worker's calls): its
#: retries give up ``RETRY_BUDGET`` after the first failure and an attempt waits at most
#: ``SOCKET_TIMEOUT``, but the client retries at several levels (the hot path's line, the
#: connection's connect, the command), each with a budget of its own, which add up.  One bound
#: over the call keeps its last replay within the gate's ENDED_WINDOW (lua/_common.lua).
CALL_BOUND = RETRY_BUDGET + SOCKET_TIMEOUT
CALL_BOUND_NAME = "the gate client's retries"
#: Dead letters redriven, waiting members purged and dead letters dropped by retention per script
#: call: each call is short, so a long operator action never blocks Redis.
OPERATOR_BATCH = 100
MAX_REPUBLISH_BACKOFF = 6  # a lost release is republished after 1, 2, 4, ... 64 release timeouts


class Gate:
    """Transitions of the gate for one Redis client and key prefix; ``reads``, its plain reads
    (:class:`~.reads.GateReads`, on the same client).

    ``clock`` returns the time in milliseconds to use instead of the Redis server's ``TIME``; only
    the model-based test sets it.  ``direct`` (a :class:`ReleasePush`) lets the scripts publish
    releases themselves when the broker is kombu's Redis transport on the gate's own server.
    ``functions``: the hot path calls the transitions as the functions of :func:`function_library`
    where the server has them (Redis 7+); false keeps it on ``EVALSHA`` (tests of both ways).
    ``wait_replicas`` (``threads_wait_replicas``): each transition is followed by ``WAIT`` on
    its connection, and one that fewer replicas confirm raises :class:`NotReplicated`; an
    enqueue is sent again for up to ``replicated_budget`` seconds first.
    """

    def __init__(
        self,
        client: redis.Redis,
        keys: Keys,
        *,
        release_timeout_ms: int,
        keepalive_ms: int = 30_000,
        clock: Optional[Callable[[], int]] = None,
        direct: Optional[ReleasePush] = None,
        functions: bool = True,
        wait_replicas: int = 0,
    ) -> None:
        self.client = client
        self.before_call: Optional[Callable[[], None]] = None
        if wait_replicas > 0 and cluster.is_cluster(client):
            raise ConfigurationError(
                "threads_wait_replicas is not supported on a Redis Cluster (each master has its "
                "own replicas): set it to 0, or point the gate at a single Redis or Sentinel"
            )
        self.wait = (wait_replicas, wait_timeout_ms(keepalive_ms)) if wait_replicas > 0 else None
        self.replicated_budget = RETRY_BUDGET
        self.direct = direct
        self._direct_arg = direct.argument() if direct is not None else ""
        self.keepalive_ms = keepalive_ms  # the lease a claim or a renewal gives
        self._keepalive_text = f"{keepalive_ms / 1000:g}s"
        self.keys = keys
        self.release_timeout_ms = release_timeout_ms
        self.clock = clock
        self.reads = GateReads(client, keys, clock)
        self._scripts: dict[str, Script] = {
            name: client.register_script(source) for name, source in script_sources().items()
        }
        self.library = function_library()
        # On a cluster, a line to each master, picked by the call's shard (cluster.py).
        self._line = (
            cluster.ClusterScriptLine(
                cast(Any, client), self.library if functions else None, keys.all_shards()
            )
            if cluster.is_cluster(client)
            else ScriptLine(
                client, self.library if functions else None, _pack(("WAIT", *self.wait)) if self.wait else b""
            )
        )
        self._functions = (
            cluster.Functions(client, self.library.source, self.library.functions)
            if functions and cluster.is_cluster(client)
            else None
        )
        self._packers = [_Packer(shard, release_timeout_ms, self._direct_arg) for shard in keys.all_shards()]
        self._heads = {name: self._packers[0].head(script.sha) for name, script in self._scripts.items()}
        self._fcall_heads = {
            name: self._packers[0].head(function, b"FCALL")
            for name, function in self.library.functions.items()
        }
        self._trim_dead = client.register_script(_load_lua("_clock.lua") + "\n" + _load_lua("trim_dead.lua"))

    # -- plumbing ---------------------------------------------------------------------------
    def _arguments(self, thread_id: str, args: Sequence[Any]) -> tuple[list[str], list[Any]]:
        keys = self.keys.thread(thread_id)
        argv = [
            clock_argument(self.clock),
            thread_id,
            self.release_timeout_ms,
            keys.shard.wake_channel,
            self._direct_arg,
            *args,
        ]
        return keys.script_keys(), argv

    def _command(
        self,
        name: str,
        thread_id: str,
        args: Sequence[Any],
        arguments: Optional[tuple[list[str], list[Any]]] = None,
        functions: bool = False,
    ) -> bytes:
        """The packed EVALSHA of a script call (the call :meth:`_run` makes through the client),
        or with ``functions`` the FCALL of the library's function.  With the model's clock,
        ``arguments`` (from :meth:`_arguments`) carry its reading."""
        if self.clock is not None:
            script_keys, argv = arguments or self._arguments(thread_id, args)
            head = (
                ("FCALL", self.library.functions[name]) if functions else ("EVALSHA", self._scripts[name].sha)
            )
            return _pack((*head, len(script_keys), *script_keys, *argv))
        packer = self._packers[self.keys.shard_of(thread_id)]
        return packer.pack((self._fcall_heads if functions else self._heads)[name], thread_id, args)

    def _run(self, name: str, thread_id: str, *args: Any, client: Any = None, fence: bool = False) -> Any:
        """``fence`` (with ``wait_replicas``): a write of the call's own connection after the
        script, so that its ``WAIT`` covers every write made before it, even when the script
        wrote nothing (:meth:`_replicated`).  A call whose caller set no bound of its own
        (:mod:`.deadline`) gets :data:`CALL_BOUND`."""
        if client is None:  # else a pipeline's part: _pipeline bounds the call
            with caller_deadline.at_most(CALL_BOUND, bound=CALL_BOUND_NAME):
                return self._send(name, thread_id, args, fence)
        return self._send(name, thread_id, args, fence, client)

    def _send(self, name: str, thread_id: str, args: Sequence[Any], fence: bool, client: Any = None) -> Any:
        if self.before_call is not None:
            self.before_call()
        # The clock is read once per call, whichever way the call goes.
        arguments = self._arguments(thread_id, args) if self.clock is not None else None
        if client is None and self._line is not None and not fence:
            reply = self._line.call(
                lambda functions: self._command(name, thread_id, args, arguments, functions),
                self.keys.shard_of(thread_id),
            )
            if reply is not _MISSED:
                return self._confirmed(*reply) if self.wait else reply
        # Loads the script when the server does not have it; rides out outages with retries.
        script_keys, argv = arguments or self._arguments(thread_id, args)
        if client is None and self._functions is not None:
            return self._functions.call(
                name,
                script_keys,
                argv,
                functools.partial(self._scripts[name], keys=script_keys, args=argv, client=self.client),
            )
        if client is None and self.wait:  # WAIT on the script's own connection: a pipeline
            pipe = self.client.pipeline(transaction=False)
            self._scripts[name](keys=script_keys, args=argv, client=pipe)
            if fence:
                pipe.set(f"{self.keys.prefix}:wait-fence", 1, px=1000)
            pipe.wait(*self.wait)
            replies = pipe.execute()
            return self._confirmed(replies[0], replies[-1])
        return self._scripts[name](keys=script_keys, args=argv, client=client or self.client)

    def _confirmed(self, reply: Any, replicas: Any) -> Any:
        """``reply``, once ``WAIT`` said that enough replicas hold the call's writes."""
        assert self.wait is not None
        if int(replicas) < self.wait[0]:
            raise NotReplicated(
                f"{int(replicas)} of the {self.wait[0]} replicas (threads_wait_replicas) "
                f"confirmed a gate transition within {self.wait[1]} ms; it counts as not done",
                reply,
            )
        return reply

    def _outcome(self, name: str, thread_id: str, reply: Sequence[Any], own: bytes = b"") -> Outcome:
        """``name``'s reply; ``own``: the envelope the call sent, which a reply releasing it
        leaves out."""
        status, info = REPLIES.get(name, Done)(int(reply[0])), _text(reply[1])
        gone, gone_retries, due_ms = b"", None, None
        if len(reply) > 6:  # an enqueue's under coalesce or debounce, an expire's of a deleted member
            if reply[6]:  # the record of the member that left (gone_envelope)
                left = parse_record(reply[6])
                gone, gone_retries = left.envelope, left.retries
            if len(reply) > 7:  # its member is due later than now
                due_ms = int(reply[7])
            reply = reply[:2] if not reply[2] else reply[:5] if not reply[5] else reply[:6]
        release = None
        if len(reply) > 5:
            published = int(reply[5]) == 1
            release = Release(
                thread_id, _text(reply[2]), _text(reply[3]), 0, b"" if published else own, published=published
            )
        elif len(reply) > 2:
            record = parse_record(reply[4])
            release = Release(thread_id, _text(reply[2]), _text(reply[3]), record.retries, record.envelope)
        return Outcome(status, info, release, gone, gone_retries=gone_retries, due_ms=due_ms)

    def _call(self, name: str, thread_id: str, *args: Any) -> Outcome:
        return self._outcome(name, thread_id, self._run(name, thread_id, *args))

    # -- transitions --------------------------------------------------------------------------
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
        """A new member.  ``replaced``: the ``replaced_task_nesting`` of a replacement
        (``Task.replace``), admitted once although its task id (the replaced task's) ended in the
        last 30 s (lua/enqueue.lua).  ``policy``: the member's, kept in its record
        (:func:`celery_threads.policies.policy_text`); ``max_waiting``: status ``FULL`` (nothing
        stored) when the thread already has that many waiting members.  ``coalesce``: the task's
        name, when the call supersedes the waiting call of that task in its thread that has not
        run yet (``coalesce="latest"``, ``debounce``); ``debounce_ms``, ``debounce_max_ms``: its
        debounce (0: none).  The outcome's info names what it superseded
        (:func:`superseded_ids`).  A call without policies sends the arguments it always did."""
        mode, value = ("at", at_ms) if at_ms is not None else ("in", delay_ms)
        extra: tuple[Any, ...] = (replaced,) if replaced else ()
        if policy or max_waiting is not None or coalesce is not None:
            extra = (
                replaced or "",
                policy,
                "" if max_waiting is None else int(max_waiting),
                "" if coalesce is None else f"{int(debounce_ms)}|{int(debounce_max_ms)}|{coalesce}",
            )
        return self._outcome(
            "enqueue",
            thread_id,
            self._replicated(
                lambda fence: self._run(
                    "enqueue",
                    thread_id,
                    task_id,
                    mode,
                    value,
                    _max_retries(max_retries),
                    retry_delay_ms,
                    envelope,
                    *extra,
                    fence=fence,
                )
            ),
            own=envelope,
        )

    def _replicated(self, send: Callable[[bool], Any]) -> Any:
        """``send(fence)``, sent again while the replicas do not confirm it
        (:class:`NotReplicated`: a replica lags, or none is connected), backing off, for at most
        ``replicated_budget`` seconds, as the client rides out a short outage.  Only an enqueue
        waits so: a producer has nothing else to do with its message, while a worker's calls have
        a lease to keep and their own handling of a call not done.

        The gate knows the call sent again (its task id): it answers "already a member" when the
        first send's writes are still there, and that send's reply stands once this one is
        confirmed (sent with a ``fence``, a write of its own connection, so that its ``WAIT``
        covers the first send's writes too); a failover that lost them makes it a new arrival."""
        if self.wait is None:
            return send(False)
        deadline, pause, first = time.monotonic() + self.replicated_budget, 0.05, None
        while True:
            try:
                reply = send(first is not None)
            except NotReplicated as exc:
                if first is None:
                    first = exc.reply
                if (
                    time.monotonic() + pause > deadline or caller_deadline.backoff(pause) < pause
                ):  # the caller's bound
                    raise
                time.sleep(pause)
                pause = min(1.0, pause * 2)
                continue
            return reply if first is None or int(reply[0]) else first

    def release(self, thread_id: str) -> Outcome:
        return self._call("release", thread_id)

    def claim(
        self,
        thread_id: str,
        task_id: str,
        token: str,
        worker: str,
        claimant: str = "",
        *,
        stoppable: bool = False,
    ) -> Claim:
        return self.claim_with_time(thread_id, task_id, token, worker, claimant, stoppable=stoppable)[0]

    def claim_with_time(
        self,
        thread_id: str,
        task_id: str,
        token: str,
        worker: str,
        claimant: str = "",
        *,
        stoppable: bool = False,
    ) -> tuple[Claim, int]:
        """``claim``'s status, and the Redis server's time of the claim (ms; 0 unless claimed).

        ``claimant``: this delivery's own id; only it renews the lease (:meth:`renew`), and the
        same claimant's claim replayed is answered ``CLAIMED`` with the first claim's time.
        ``stoppable``: the claiming process can be stopped from outside (a prefork pool
        process), so that a delete of the running member waits until it has stopped
        (:meth:`delete` with ``stop``)."""
        reply = self._run(
            "claim", thread_id, task_id, token, self.keepalive_ms, worker, claimant, "1" if stoppable else ""
        )
        status = Claim(int(reply[0]))
        return status, int(_text(reply[1])) if status == Claim.CLAIMED else 0

    def renew(
        self, thread_id: str, task_id: str, token: str, claimant: str = "", *, for_ms: Optional[int] = None
    ) -> Renewal:
        """Renew the lease of a RUNNING member for its ``claimant``, or (no claimant) the release
        deadline of a RELEASED one: ``RENEWED``, ``STALE`` (the token no longer holds the
        thread), or ``NOT_YOURS`` (claimed by another delivery, or the claim is gone).  The
        deadline becomes now plus the keepalive, or plus ``for_ms`` (a release deadline brought
        to a message's TTL: ``Runtime._deadline_at_ttl``)."""
        ms = self.keepalive_ms if for_ms is None else for_ms
        return Renewal(int(self._run("renew", thread_id, task_id, token, ms, claimant)[0]))

    def renew_many(self, members: Sequence[tuple[str, str, str]]) -> list[Renewal]:
        """Renew the release deadlines of ``(thread_id, task_id, token)`` members a worker holds
        unclaimed, in one round trip; a status per member as :meth:`renew`'s."""
        replies = self._pipeline("renew", [(t, (k, tok, self.keepalive_ms)) for t, k, tok in members])
        return [Renewal(int(r[0])) for r in replies]

    def hand_back(self, members: Sequence[tuple[str, str, str]]) -> list[Outcome]:
        """Return ``(thread_id, task_id, token)`` releases a worker holds unstarted, in one round
        trip: each still RELEASED under its token comes back as a ``REPUBLISH`` outcome, for the
        caller to publish again under the same token."""
        replies = self._pipeline("handback", [(t, (k, tok)) for t, k, tok in members])
        return [self._outcome("handback", m[0], r) for m, r in zip(members, replies)]

    def unclaim(self, thread_id: str, task_id: str, token: str) -> Outcome:
        """Give back a member that ``finish(claim=...)`` claimed for the caller, who cannot run it
        after all: RELEASED again under the same token, as a ``REPUBLISH`` outcome for the caller
        to publish (also when it was still RELEASED)."""
        return self._call("handback", thread_id, task_id, token, "1")

    # Every ending takes ``caller``: the call's own id (lua/_common.lua CALLER), by which the gate
    # tells the call sent again after its reply was lost from any other call.  A fresh one by
    # default: the client's own retries send the same arguments; a caller that sends an ending
    # again itself (a pool process keeping it through an outage) passes the same id each time.
    def finish(
        self,
        thread_id: str,
        task_id: str,
        token: str,
        *,
        keep_release: bool = False,
        claim: Optional[tuple[str, str]] = None,
        caller: Optional[str] = None,
    ) -> Outcome:
        """The member ended; the next one is released.  ``keep_release``: the release comes back
        to the caller, who runs it (in-process handoff), even where the gate would publish it.
        ``claim`` (with ``keep_release``): ``(worker, claimant)``, and the released member is
        also claimed for the caller, for the keepalive; the outcome's ``info`` is then the
        claim's time on the Redis server's clock (ms), else empty.  Such a claim is stoppable (see
        :meth:`claim_with_time`): only a prefork pool process runs members by handoff.  A member that
        was marked deleted while it ran ends as deleted: ``info`` is :data:`DELETED`, and the
        next member is released (not claimed) for the caller to publish, as without
        ``keep_release``."""
        if claim is not None and not keep_release:
            raise ValueError("finish(claim=...) needs keep_release=True")
        handoff = (
            ("1", *((self.keepalive_ms, *claim) if claim else ("", "", "")))
            if keep_release
            else ("", "", "", "")
        )
        return self._call(
            "finish", thread_id, task_id, token, *handoff, call_id(caller), "1" if claim is not None else ""
        )

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
        mode, value = ("at", at_ms) if at_ms is not None else ("in", delay_ms)
        return self._call(
            "requeue", thread_id, task_id, token, mode, value, retries, envelope, "", "", call_id(caller)
        )

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
        """The active member's replacement (``Task.replace``, same task id, same thread) takes its
        place: the member re-enters WAITING with the replacement's message and retry settings,
        retries 0, its arrival order and (unless ``at_ms`` is given) its scheduled_at kept."""
        mode, value = ("at", at_ms) if at_ms is not None else ("keep", 0)
        return self._call(
            "requeue",
            thread_id,
            task_id,
            token,
            mode,
            value,
            0,
            envelope,
            _max_retries(max_retries),
            retry_delay_ms,
            call_id(caller),
        )

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
        """The member died.  ``fenced``: ``caller`` is the claimant it ran under (a worker's own
        ending), and a member RUNNING for another claimant (after a lost claim) is not killed.
        ``holder``: the claimant prefix of the worker process that ran it
        (:func:`~celery_threads.gate.records.claimant_prefix`; :data:`NO_HOLDER` for a message
        no process started), when the worker's main process ends it: a member RUNNING under
        another process's claim is not killed."""
        meta = {"thread_id": thread_id, **meta}
        return self._call(
            "kill",
            thread_id,
            task_id,
            token,
            "1" if keep else "0",
            json.dumps(meta, default=repr),
            call_id(caller),
            "1" if fenced else "",
            holder or "",
        )

    def delete(
        self,
        task_id: str,
        *,
        token: str = "",
        only_waiting: bool = False,
        only_released: bool = False,
        stop: bool = False,
        thread_id: Optional[str] = None,
        caller: Optional[str] = None,
        holder: Optional[str] = None,
    ) -> Outcome:
        """Detach a member; pass ``thread_id`` when it is known, to save looking it up.
        ``only_waiting``: only a WAITING member; ``only_released``: only the active member
        RELEASED under ``token`` (not once a worker has claimed it).  ``stop``: a member RUNNING
        in a process that can be stopped (a stoppable claim) is only marked deleted, and stays
        active until its code has stopped (info :data:`STOPPING`; lua/delete.lua).  ``holder``:
        refused while the member is RUNNING under another worker process's claim (see
        :meth:`kill`)."""
        thread_id = thread_id or self.reads.thread_of(task_id)
        if thread_id is None:
            return Outcome(Done.NOOP, "", None)
        mode = "1" if only_waiting else "2" if only_released else "3" if stop else "0"
        return self._call("delete", thread_id, task_id, token, mode, call_id(caller), holder or "")

    def expire(self, thread_id: str) -> Outcome:
        return self._call("expire", thread_id, MAX_REPUBLISH_BACKOFF, self._keepalive_text)

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
        """A failed attempt the task itself could not report: retry if retries remain, else die.
        ``holder``: the lost pool process's claimant prefix (see :meth:`kill`)."""
        return self._call("fail", thread_id, task_id, token, reason, call_id(caller), holder or "")

    def pause(self, thread_id: str, reason: str) -> Outcome:
        """Stop releasing the thread's members until :meth:`resume` (lua/pause.lua): status
        ``PAUSED``, or ``ALREADY_PAUSED`` (the reason is replaced)."""
        if not isinstance(reason, str):
            raise InvalidArgument(f"a pause's reason is a str, not a {type(reason).__name__}")
        if reason.startswith(HOLD_MARK):
            raise InvalidArgument(
                "a pause's reason cannot start with a NUL character (it marks the "
                "pauses that on_death='hold' makes)"
            )
        return self._call("pause", thread_id, reason)

    def resume(self, thread_id: str) -> Outcome:
        """Release again (lua/resume.lua): ``RESUMED``, with the due head's release if any, or
        ``NOT_PAUSED``."""
        return self._call("resume", thread_id)

    def restart(
        self,
        task_id: str,
        *,
        max_retries: Optional[int] = None,
        retry_delay_ms: int = 0,
        thread_id: Optional[str] = None,
    ) -> Outcome:
        """Re-enter a dead task; pass ``thread_id`` (its dead record's) when it is known."""
        if thread_id is None:
            record = self.reads.dead_record(task_id)
            if record is None:
                return Outcome(Done.NOOP, "", None)
            thread_id = str(record.meta["thread_id"])
        return self._call("restart", thread_id, task_id, _max_retries(max_retries), retry_delay_ms)

    def redrive(
        self,
        thread_id: str,
        letters: Sequence[tuple[str, Optional[int], int]],
        *,
        caller: Optional[str] = None,
    ) -> tuple[list[Redriven], Optional[Release]]:
        """Put dead letters of ``thread_id``, ``(task id, max_retries, retry_delay_ms)`` each
        (at most :data:`OPERATOR_BATCH` per call), back at their original place in one script
        (lua/redrive.lua); a code per letter, and the release of the thread's head, if any."""
        args = [a for task_id, maxr, delay in letters for a in (task_id, _max_retries(maxr), delay)]
        outcome = self._call("redrive", thread_id, call_id(caller), *args)
        return [Redriven(c) for c in outcome.info], outcome.release

    def purge(
        self, thread_id: str, limit: int = OPERATOR_BATCH, records: Optional[dict[str, Record]] = None
    ) -> tuple[list[str], int]:
        """Drop at most ``limit`` waiting members of ``thread_id``, the last in release order
        first (lua/purge.lua): the task ids dropped, and how many still wait.  ``records`` is
        given the record of each dropped member (its stored message and retries: its request in
        the result backend)."""
        _, left, dropped, *rest = self._run("purge", thread_id, limit)
        if records is not None and rest:
            pairs = rest[0]
            records.update((_text(t), parse_record(r)) for t, r in zip(pairs[::2], pairs[1::2]))
        return [_text(t) for t in dropped], int(left)

    def trim_dead(
        self, shard: ShardKeys, keep: Optional[int], ttl_ms: Optional[int], limit: int = OPERATOR_BATCH
    ) -> tuple[int, bool]:
        """Dead-letter retention on ``shard``: drop its oldest letters past ``keep`` letters or
        older than ``ttl_ms``, at most ``limit`` (lua/trim_dead.lua).  How many were dropped, and
        whether more are due."""
        dropped, more = self._trim_dead(
            keys=[shard.dead, shard.dead_records, shard.dead_dropped],
            args=[
                clock_argument(self.clock),
                "" if keep is None else keep,
                "" if ttl_ms is None else ttl_ms,
                limit,
            ],
        )
        return int(dropped), bool(int(more))

    def release_many(self, thread_ids: Sequence[str]) -> list[Outcome]:
        return self._pipelined("release", thread_ids)

    def expire_many(self, thread_ids: Sequence[str]) -> list[Outcome]:
        return self._pipelined("expire", thread_ids, MAX_REPUBLISH_BACKOFF, self._keepalive_text)

    def _pipelined(self, name: str, thread_ids: Sequence[str], *args: Any) -> list[Outcome]:
        replies = self._pipeline(name, [(t, args) for t in thread_ids])
        return [self._outcome(name, t, r) for t, r in zip(thread_ids, replies)]

    def _pipeline(self, name: str, calls: Sequence[tuple[str, Sequence[Any]]]) -> list[Any]:
        """Run ``name`` once per ``(thread_id, args)`` in one round trip; the raw replies."""
        if not calls:
            return []
        with caller_deadline.at_most(CALL_BOUND, bound=CALL_BOUND_NAME):
            pipe = self.client.pipeline(transaction=False)
            for thread_id, args in calls:
                self._run(name, thread_id, *args, client=pipe)
            if self.wait:
                pipe.wait(*self.wait)
                *replies, replicas = pipe.execute()
                return list(self._confirmed(replies, replicas))
            replies = pipe.execute(raise_on_error=False)
        return cluster.rerun_unrun(replies, lambda i: self._run(name, calls[i][0], *calls[i][1]))

    def note_deleted(self, thread_id: str, *task_ids: str, ttl: int = 600, expired: bool = False) -> None:
        """Note members of ``thread_id`` that left it unstarted (``expired``: their ``expires``
        passed), for :meth:`take_deleted_note`."""
        shard = self.keys.thread(thread_id).shard
        pipe = self.client.pipeline(transaction=False)
        for task_id in task_ids:
            pipe.set(shard.deleted_note(task_id), "expired" if expired else 1, ex=ttl)
        try:
            pipe.execute()
        except redis.RedisError as exc:
            # After the members left (a full gate refuses the notes): only Flower's task-revoked
            # event is missed, which must not make the caller think nothing was done.
            logger.warning(
                "celery-threads: could not note %d member(s) that left thread %s for the "
                "task-revoked event (%s); their results read REVOKED all the same",
                len(task_ids),
                thread_id,
                exc,
            )

    def take_deleted_note(self, task_id: str) -> Optional[bool]:
        """Once per note, whether its member expired (else ``None``): elects the one worker that
        announces a deleted member."""
        for shard in self.keys.all_shards():
            note = self.client.getdel(shard.deleted_note(task_id))
            if note is not None:
                return note == b"expired"
        return None

    # -- announcements: one worker sends task-retried for letters put back (Threads.restart) --
    def _announcement(self, note_id: str) -> str:
        return self.keys.all_shards()[0].announcement(note_id)

    def note_announcement(self, note_id: str, ttl: int = 60) -> None:
        self.client.set(self._announcement(note_id), "1", ex=ttl)

    def take_announcement(self, note_id: str) -> bool:
        """Whether this caller is the one to send the announcement (once per note)."""
        return _text(self.client.set(self._announcement(note_id), "taken", xx=True, get=True)) == "1"

    def end_announcement(self, note_id: str) -> None:
        self.client.getdel(self._announcement(note_id))

    def announcement_state(self, note_id: str, cancel: bool = False) -> Optional[str]:
        """'1' (no worker took it yet), 'taken' (one sends it now) or ``None`` (sent, or gone).
        ``cancel``: no worker takes it after this (the state it had is returned; one that had
        taken it ends it all the same)."""
        key = self._announcement(note_id)
        if not cancel:
            return _text(self.client.get(key)) or None
        state = _text(self.client.set(key, "cancelled", xx=True, get=True)) or None
        if state != "taken":
            self.client.getdel(key)
        return state

    def forget(self, task_id: str) -> Outcome:
        """Drop a dead letter (lua/forget.lua): ``DONE`` if it was in the store, with the release
        of its thread's head when its death held the thread (``on_death="hold"``), which goes on
        without it."""
        record = self.reads.dead_record(task_id)
        if record is None:
            return Outcome(Done.NOOP, "", None)
        return self._call("forget", str(record.meta.get("thread_id", "")), task_id)

    def forget_batch(self, shard: ShardKeys, up_to: int, limit: int) -> list[str]:
        """Forget at most ``limit`` of ``shard``'s dead tasks, oldest first, among those whose
        score is at most ``up_to`` (:meth:`.GateReads.last_death`); the ids forgotten.  O(limit log n)."""
        ids = [_text(t) for t in self.client.zrangebyscore(shard.dead, "-inf", up_to, start=0, num=limit)]
        if not ids:
            return []
        for transaction in (True, False):
            pipe = self.client.pipeline(transaction=transaction)
            pipe.zrem(shard.dead, *ids)
            pipe.hdel(shard.dead_records, *ids)
            try:
                pipe.execute()
                break
            except redis.exceptions.OutOfMemoryError:
                # A full server refuses whatever a MULTI queues, these deletes too, which free
                # memory: they go one after the other (the index first: a record left by a
                # cut between them is never listed).
                if not transaction:
                    raise
        return ids
