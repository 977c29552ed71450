"""``ThreadedTask``: the Celery task base class whose publications go through the gate."""

from __future__ import annotations

import functools
import inspect
import types
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from datetime import datetime, timedelta
from typing import Any, Callable, NamedTuple, NoReturn, Optional, Union

import redis
from celery import Task
from celery.utils import uuid
from celery.utils.saferepr import saferepr

from . import policies
from .config import ThreadsConfig, read_config
from .errors import (
    ConfigurationError,
    GateUnavailable,
    InvalidArgument,
    InvalidThreadId,
    MissingRights,
    NotReplicated,
    ThreadFull,
    TransportMismatch,
    error_text,
)
from .gate import Enqueue, Outcome, Release, deadline, transport
from .install import install
from .logs import get_logger
from .protocol import (
    GATE_HEADER,
    OUR_HEADERS,
    SUPERSEDE_OPTIONS,
    THREAD_HEADER,
    THREADED_REQUEST,
    TOKEN_HEADER,
    eta_ms,
    normalize_task_id,
    normalize_thread_id,
    retry_settings,
    supersede_policy,
)
from .publish import CapturingProducer, eta_text
from .runtime import Runtime, get_runtime
from .worker import member

logger = get_logger(__name__)

ThreadKey = Union[str, Callable[[tuple[Any, ...], dict[str, Any]], Any], None]


class ThreadedTask(Task):
    """A task whose calls join a thread: at most one member of a thread runs at a time.

    Give the thread with ``apply_async(..., thread_id=...)`` or declare ``thread_key`` (an argument
    name or a callable ``(args, kwargs) -> id``).  ``dead_letter = False`` drops members that die
    instead of keeping them in the dead-letter store.

    Policies (docs/policies.md), each also an ``apply_async`` option of the same name for one
    call: ``on_death = "hold"`` pauses the thread when a member dies; ``max_waiting = N`` refuses
    a call (:class:`~celery_threads.ThreadFull`) that finds N members waiting in its thread;
    ``thread_rate_limit = "10/s"`` spaces the releases of the thread's members;
    ``coalesce = "latest"``: a call supersedes its task's call in its
    thread that waits and has not run yet (it ends ``REVOKED``) and takes its place;
    ``debounce = S``: as ``coalesce``, and the call runs no earlier than S seconds after it
    reached the gate, so a burst runs once, S after its last call; ``debounce_max = M``: a burst
    that goes on runs no later than M seconds after its first call.
    """

    thread_key: ThreadKey = None
    dead_letter: bool = True
    on_death: Optional[str] = None  # None: "advance"
    max_waiting: Optional[int] = None
    thread_rate_limit: Optional[Union[str, int, float]] = None
    coalesce: Optional[str] = None
    debounce: Optional[float] = None
    debounce_max: Optional[float] = None

    Strategy = "celery_threads.worker.strategy:threaded_strategy"
    Request = THREADED_REQUEST
    __celery_threads__ = True  # protocol.is_threaded: how lower layers recognise it

    # Celery's own worker-lost retry would publish from the main process; the gate does it instead.
    retry_on_worker_lost = False

    @classmethod
    def on_bound(cls, app: Any) -> None:
        if isinstance(cls.__dict__.get("thread_key"), types.FunctionType):
            # app.task(thread_key=fn) puts fn in the task class: a method there, called with the
            # task as a third argument. The documented form is fn(args, kwargs).
            cls.thread_key = staticmethod(cls.__dict__["thread_key"])
        _check_thread_key(cls)
        policies.check_task(cls)
        supersede_policy(cls.name, cls.coalesce, cls.debounce, cls.debounce_max)
        install(app)

    # -- publishing ---------------------------------------------------------------------------
    def resolve_thread_id(self, args: Any, kwargs: Any, explicit: Any = None) -> str:
        if explicit is not None:
            return self._thread_id_from(explicit, "its thread_id=")
        key = self.thread_key
        args, kwargs = tuple(args or ()), dict(kwargs or {})
        if callable(key):
            try:
                found = key(args, kwargs)
            except Exception as exc:  # the call lacks what the key reads: no thread id
                raise InvalidThreadId(
                    f"task {self.name}'s thread_key raised {exc!r} for this call; nothing was stored or sent"
                ) from exc
            return self._thread_id_from(found, "its thread_key's value")
        if isinstance(key, str):
            if key in kwargs:
                return self._thread_id_from(kwargs[key], f"its argument {key!r} (thread_key)")
            try:
                bound = _signature(self.run).bind_partial(*args, **kwargs)
            except TypeError:
                bound = None
            if bound is not None and key in bound.arguments:
                return self._thread_id_from(bound.arguments[key], f"its argument {key!r} (thread_key)")
            problem = _thread_key_problem(type(self))
            if problem is not None:  # a typo the task's binding reported once already
                raise ConfigurationError(problem)
            raise InvalidThreadId(
                f"task {self.name} takes its thread id from argument {key!r}, which this call does not pass"
            )
        raise InvalidThreadId(
            f"task {self.name} needs a thread id: pass apply_async(..., thread_id=...) or declare "
            "the task with thread_key='<argument name>'"
        )

    def _thread_id_from(self, value: Any, where: str) -> str:
        """``value`` as a thread id; refused, the error names the task and where it came from."""
        try:
            return normalize_thread_id(value)
        except InvalidThreadId as exc:
            raise InvalidThreadId(f"task {self.name}, {where}: {exc}") from None

    def apply_async(
        self,
        args: Any = None,
        kwargs: Any = None,
        task_id: Optional[str] = None,
        producer: Any = None,
        link: Any = None,
        link_error: Any = None,
        shadow: Any = None,
        **options: Any,
    ) -> Any:
        """Store the call as a member of its thread; it is published when the thread releases it.

        Calls from inside a running member (docs/internals.md, "Calls from inside a member"):
        Celery's ``self.retry()`` (it names the member's task id and passes its request's
        headers) re-enters the member once its body has unwound.  ``self.replace(sig)`` gives
        ``sig`` the member's task id; a threaded replacement is applied once the body has unwound
        as well: in the member's thread it takes the member's place (its arrival order and
        scheduled_at, retries 0), in another thread it joins as a new arrival once the member has
        ended.  Any other call carrying a member's headers (``headers=self.request.headers``) is a
        new member: the internal headers are dropped, and the copied ``thread_id`` counts only
        for a task without a ``thread_key``.
        """
        explicit = options.pop("thread_id", None)
        # Never seen by Celery (in eager mode too): the gate applies them.
        supersede_options = _supersede_options(self, options)
        policy = policies.resolve(self, options)
        app = self._get_app()
        if task_id is not None:
            task_id = normalize_task_id(task_id, amqp=not app.conf.task_always_eager and _amqp_broker(app))
        if app.conf.task_always_eager:
            options["thread_id"] = explicit  # for apply(), which Celery's eager path calls
            return self._apply_eagerly(args, kwargs, task_id, producer, link, link_error, shadow, options)
        headers = dict(options.pop("headers", None) or {})
        call = self._place(app, args, kwargs, task_id, explicit, headers, options, policy, supersede_options)
        if options.get("kwargsrepr") is None:
            # Flower shows kwargsrepr: the thread id is visible on every member there.
            options["kwargsrepr"] = f"{saferepr(kwargs or {}, 1024)} thread={call.thread_id!r}"
        countdown = options.pop("countdown", None)
        eta = options.pop("eta", None)
        task_id = task_id or uuid()
        config = read_config(app)
        headers[GATE_HEADER] = config.key_prefix  # kept in its stored message, for every release
        # A producer's call waits for the gate threads_publish_timeout in all; a member's calls
        # ride out outages as the rest of its worker does (its lease covers the wait).
        bound = nullcontext(None) if call.from_member else deadline.within(config.publish_timeout)
        with app.producer_or_acquire(producer) as real:
            capture = CapturingProducer(real)
            # countdown and eta do not reach Celery, which would route the message to RabbitMQ's
            # delayed delivery (with a quorum queue behind a topic or fanout exchange, Celery
            # 5.5+): the gate schedules it.  Only the task-sent event tells them (Flower shows
            # when the member is due).
            result = super().apply_async(
                args,
                kwargs,
                task_id=task_id,
                producer=capture,
                link=link,
                link_error=link_error,
                shadow=shadow,
                headers=headers,
                **options,
            )
            message = _message(capture, countdown, eta, call, options)
            capture.set_sent_eta(_event_eta(app, countdown, eta))
            # The gate's part, bounded from here: what Celery's own part took (its result
            # backend's subscription, signal handlers) does not spend the gate's time, and its
            # errors are not reported as the gate's.
            with bound as limit, gate_errors(config, task_id, limit):
                runtime = get_runtime(app)
                retried = member.running(task_id, call.token) if call.token is not None else None
                added = True  # a retry or a replacement is the member's own: its event goes
                if call.replaced is not None:
                    stored = self._replace_once_unwound(runtime, call, call.replaced, message)
                elif retried is not None:
                    stored = self._retry_once_unwound(runtime, retried, message)
                elif call.token is not None:
                    stored = self._retry_now(runtime, call, call.token, task_id, message)
                else:
                    stored = self._enqueue(runtime, call, task_id, message)
                    # A repeated call of a member's task id adds nothing: its task-sent event
                    # (with this call's arguments) would show a call that never runs.
                    added = stored.added
                if stored.due_ms is not None:  # a debounce put it off: Flower shows when
                    capture.set_sent_eta(eta_text(stored.due_ms))
                capture.flush(send=added)
                _publish_stored(runtime, call, task_id, stored, producer, capture)
        return result

    def apply(
        self,
        args: Any = None,
        kwargs: Any = None,
        link: Any = None,
        link_error: Any = None,
        task_id: Optional[str] = None,
        retries: Optional[int] = None,
        throw: Optional[bool] = None,
        logfile: Any = None,
        loglevel: Any = None,
        headers: Optional[dict[str, Any]] = None,
        **options: Any,
    ) -> Any:
        """An eager call (``apply()``, or any call under ``task_always_eager``) runs inline without
        the gate, as Celery runs any task's.  Its thread id is resolved and checked as for a call
        through the gate (:class:`InvalidThreadId`), and its body reads it as
        ``self.request.thread_id``; ``self.request.thread_token`` is ``None`` (no gate fenced it)."""
        thread_id = self.resolve_thread_id(args, kwargs, options.pop("thread_id", None))
        return super().apply(
            args,
            kwargs,
            link=link,
            link_error=link_error,
            task_id=task_id,
            retries=retries,
            throw=throw,
            logfile=logfile,
            loglevel=loglevel,
            headers={**(headers or {}), THREAD_HEADER: thread_id},
            **options,
        )

    def _apply_eagerly(
        self,
        args: Any,
        kwargs: Any,
        task_id: Optional[str],
        producer: Any,
        link: Any,
        link_error: Any,
        shadow: Any,
        options: dict[str, Any],
    ) -> Any:
        """In eager mode (``task_always_eager``) a call runs inline as Celery runs any task's."""
        return super().apply_async(
            args,
            kwargs,
            task_id=task_id,
            producer=producer,
            link=link,
            link_error=link_error,
            shadow=shadow,
            **options,
        )

    def _place(
        self,
        app: Any,
        args: Any,
        kwargs: Any,
        task_id: Optional[str],
        explicit: Any,
        headers: dict[str, Any],
        options: dict[str, Any],
        policy: policies.Policy,
        supersede_options: list[Any],
    ) -> _Call:
        """Where a call goes and what it is: its thread, and whether it is a retry of a member
        (it carries the member's token) or the replacement of the member running here.  Drops
        the internal headers from ``headers``."""
        token = headers.get(TOKEN_HEADER) or None
        header_thread = headers.get(THREAD_HEADER)
        for key in OUR_HEADERS:
            headers.pop(key, None)
        nesting = int(options.get("replaced_task_nesting") or 0)
        inside = member.current(app)  # called from inside a running member (a worker's call)
        current = inside if token is not None or nesting else None
        if token is not None and not (
            task_id is not None
            and (member.running(task_id, token) is not None or (task_id, token) == current)
        ):
            # Not Celery's retry of the member holding the token (which names its task id, with
            # its request's headers): headers copied from a member's request into a new call
            # (headers=self.request.headers).  Their thread id is the gate's, not the caller's
            # choice, so it only counts for a task without a thread_key.
            token = None
            if self.thread_key is not None:
                header_thread = None
        if explicit is None:
            explicit = header_thread
        thread_id = self.resolve_thread_id(args, kwargs, explicit)
        # self.replace(sig) inside the running member: sig took the member's task id.
        replaced = (
            member.running(*current)
            if token is None and nesting and current is not None and current[0] == task_id
            else None
        )
        max_retries, retry_delay_ms = retry_settings(self) if token is None else (None, 0)
        # A retry or a replacement is not a new call: it supersedes nothing.
        supersede = (
            supersede_policy(self.name, *supersede_options) if token is None and replaced is None else None
        )
        return _Call(
            thread_id,
            token,
            nesting,
            replaced,
            inside is not None,
            policy,
            max_retries,
            retry_delay_ms,
            supersede,
        )

    def _replace_once_unwound(
        self, runtime: Runtime, call: _Call, replaced: member.Running, message: _Message
    ) -> _Stored:
        """``self.replace(sig)`` inside the member running here: held for the member's ending,
        which applies it once the body has unwound (as a retry's re-entry), so that the task id
        is never a member twice and at most one member of a thread runs."""
        replaced.reentry = member.Reentry(
            0,
            0,
            message.at_ms
            if message.at_ms is not None
            else (replaced.server_now_ms(runtime.gate) + message.delay_ms if message.delay_ms else None),
            message.envelope,
            member.Replacement(
                call.thread_id, call.nesting, call.max_retries, call.retry_delay_ms, call.policy.text
            ),
        )
        return _NOTHING_STORED

    def _retry_once_unwound(self, runtime: Runtime, retried: member.Running, message: _Message) -> _Stored:
        """``self.retry()`` inside the member running here: it re-enters once its body has
        unwound (the member's ending), so that nothing the body still runs on the way out
        (finally blocks, context managers) overlaps the next member; its schedule is fixed now,
        on the Redis server's clock."""
        retried.reentry = member.Reentry(
            message.retries,
            0,
            message.at_ms or (retried.server_now_ms(runtime.gate) + message.delay_ms),
            message.envelope,
        )
        return _NOTHING_STORED

    def _retry_now(
        self, runtime: Runtime, call: _Call, token: str, task_id: str, message: _Message
    ) -> _Stored:
        """A retry of Celery's current member whose body no longer runs here: it re-enters its
        thread at once while the member still holds it.  One that has ended already (an
        ``on_failure`` handler runs once its exception has ended it) is refused by the gate,
        and the worker logs why (:func:`member.reenter`)."""
        reentry = member.Reentry(message.retries, message.delay_ms, message.at_ms, message.envelope)
        outcome = self._reenter(runtime, call.thread_id, task_id, token, reentry)
        return _Stored(outcome.release, False, [])

    def _enqueue(self, runtime: Runtime, call: _Call, task_id: str, message: _Message) -> _Stored:
        """A new call: the gate stores it as a member of its thread (and releases it when the
        thread is free), or refuses it (:class:`ThreadFull`)."""
        policy, supersede = call.policy, call.supersede
        outcome = runtime.gate.enqueue(
            call.thread_id,
            task_id,
            message.envelope,
            delay_ms=message.delay_ms,
            at_ms=message.at_ms,
            max_retries=call.max_retries,
            retry_delay_ms=call.retry_delay_ms,
            replaced=call.nesting,
            policy=policy.text,
            max_waiting=policy.max_waiting,
            coalesce=self.name if supersede is not None else None,
            debounce_ms=supersede[0] if supersede else 0,
            debounce_max_ms=supersede[1] if supersede else 0,
        )
        if outcome.status == Enqueue.FULL:
            # Nothing stored; leaving here also drops the held task-sent event.
            raise ThreadFull(
                f"thread {call.thread_id!r} already has {policy.max_waiting} or more waiting "
                f"members (max_waiting of {self.name}): {task_id} was not stored nor sent; call "
                "again once it has drained (`celery threads show` says whether it is paused)",
                call.thread_id,
                task_id,
            )
        if not outcome.done:
            # A replay of a call whose reply was lost, or a task id used again: the second
            # call's arguments never run, and its result is the first call's.
            logger.warning(
                "celery-threads: %s[%s] is already a member of thread %s, or ended less than "
                "30 s ago: this call was not enqueued again, and its result is that member's. "
                "Give a new call a new task id.",
                self.name,
                task_id,
                call.thread_id,
            )
        return _Stored(
            outcome.release, outcome.done, outcome.superseded, outcome.gone_envelope, outcome.due_ms
        )

    def _reenter(
        self,
        runtime: Runtime,
        thread_id: str,
        task_id: str,
        token: str,
        reentry: member.Reentry,
        caller: Optional[str] = None,
    ) -> Outcome:
        """Where every re-entry of a member (a retry's, a replacement's) reaches the gate, from
        a call or from the member's ending (:func:`celery_threads.worker.member.reenter`); a
        subclass may watch it here."""
        return member.reenter(self, runtime, thread_id, task_id, token, reentry, caller)

    # -- canvas that would run outside any thread ---------------------------------------------
    def map(self, it: Any) -> Any:
        self._not_in_one_task("map")

    def starmap(self, it: Any) -> Any:
        self._not_in_one_task("starmap")

    def chunks(self, it: Any, n: int) -> Any:
        self._not_in_one_task("chunks")

    def _not_in_one_task(self, how: str) -> NoReturn:
        """Celery's ``map``, ``starmap`` and ``chunks`` call the task's body as a function inside a
        task of their own (``celery.map``...): outside any thread, beside its members."""
        raise InvalidArgument(
            f"{self.name}.{how}() would run the task's body inside one Celery task of its own, "
            "outside any thread, beside the thread's members; nothing was sent. Send a group of "
            f"calls instead: group({self.name.rsplit('.', 1)[-1]}.s(*args) for args in items)"
        )

    # -- running ------------------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # A released member runs claimed, under its lease, and ends in the gate (worker.member).
        return member.run(self, functools.partial(super().__call__, *args, **kwargs))


class _Call(NamedTuple):
    """A call as the gate takes it (:meth:`ThreadedTask._place`)."""

    thread_id: str
    token: Optional[str]  # a retry of the member holding it; else None
    nesting: int  # replaced_task_nesting
    replaced: Optional[member.Running]  # self.replace(sig) in the member running here
    from_member: bool  # made inside a running member (a worker's call)
    policy: policies.Policy
    max_retries: Optional[int]
    retry_delay_ms: int
    supersede: Optional[tuple[int, int]]  # (debounce ms, debounce_max ms) when it supersedes


class _Message(NamedTuple):
    """The call's message as Celery built it, and its schedule, for the gate."""

    envelope: bytes
    delay_ms: int
    at_ms: Optional[int]
    retries: int  # a retry's (Celery's ``retries`` option); 0 for any other call


def _supersede_options(task: Any, options: dict[str, Any]) -> list[Any]:
    """The call's ``coalesce``, ``debounce`` and ``debounce_max`` (popped from ``options``), each
    the task's where the call gives none.  A call's ``debounce=None`` turns the task's debounce
    off, and its ``debounce_max`` with it (which bounds only a debounce)."""
    given = {option: options.pop(option) for option in SUPERSEDE_OPTIONS if option in options}
    if given.get("debounce", 0) is None:
        given.setdefault("debounce_max", None)
    return [given.get(option, getattr(task, option)) for option in SUPERSEDE_OPTIONS]


class _Stored(NamedTuple):
    """What a call left in the gate: a release to publish, whether the call added its member
    (its own message is then the one released), and the members it superseded."""

    release: Optional[Release]
    added: bool
    superseded: list[str]
    gone_envelope: bytes = b""  # the stored message of superseded[0], when the gate gave it
    due_ms: Optional[int] = None  # when the gate scheduled a debounced member (Outcome.due_ms)


_NOTHING_STORED = _Stored(None, False, [])


def _message(
    capture: CapturingProducer, countdown: Any, eta: Any, call: _Call, options: dict[str, Any]
) -> _Message:
    """The message Celery published into ``capture``, with the call's schedule: as Celery reads
    them (``AMQP.as_task_v2``), a countdown other than 0 wins over an eta, and a negative one
    is an eta in the past."""
    assert capture.envelope is not None, "Celery published no task message"
    at_ms = eta_ms(eta) if eta is not None and not countdown else None
    delay_ms = int(float(countdown or 0) * 1000)
    retries = int(options.get("retries") or 0) if call.token is not None else 0
    return _Message(capture.envelope, delay_ms, at_ms, retries)


def _event_eta(app: Any, countdown: Any, eta: Any) -> Optional[str]:
    """The ``eta`` of a call's task-sent event, as Celery writes it (``AMQP.as_task_v2``): a
    countdown wins over an eta."""
    if countdown:
        eta = app.now() + timedelta(seconds=float(countdown))
    if isinstance(eta, datetime):
        return eta.isoformat()
    return None if eta is None else str(eta)


def _publish_stored(
    runtime: Runtime, call: _Call, task_id: str, stored: _Stored, producer: Any, capture: CapturingProducer
) -> None:
    """Publish the release the call's transition gave (through the caller's producer when
    given; else the runtime's kept one, which skips the declare and retry wrapping Celery's way
    repeats on every publish), and revoke the members it superseded."""
    release = stored.release
    # The captured message only when the release is of the member this call added: a release of
    # a member that was there already (an enqueue replayed after its reply was lost) publishes
    # the message stored then, not this call's.
    own = release is not None and release.task_id == task_id and stored.added
    runtime.publish(release, producer, parts=capture.parts if own else None)
    if stored.superseded:
        runtime.revoke_superseded(call.thread_id, stored.superseded, stored.gone_envelope)


_signatures: dict[tuple[Any, bool], inspect.Signature] = {}


def _check_thread_key(cls: Any) -> None:
    """A ``thread_key`` naming no argument of the task is a typo: refused where the task is
    bound, and at every call after (``resolve_thread_id``)."""
    problem = _thread_key_problem(cls)
    if problem is not None:
        raise ConfigurationError(problem)


def _thread_key_problem(cls: Any) -> Optional[str]:
    """What is wrong with a ``thread_key`` naming no argument of the task, or ``None``."""
    key, run = cls.thread_key, cls.__dict__.get("run")
    if not isinstance(key, str) or run is None:
        return None
    try:
        parameters = list(inspect.signature(getattr(run, "__func__", run)).parameters.values())
    except (TypeError, ValueError):
        return None
    if not isinstance(run, staticmethod) and parameters:
        parameters = parameters[1:]  # bind=True: the task itself, never the thread's argument
    if any(p.name == key or p.kind == p.VAR_KEYWORD for p in parameters):
        return None
    return (
        f"task {cls.name} declares thread_key={key!r}, but it takes no argument of that name "
        f"(its arguments: {', '.join(p.name for p in parameters) or 'none'}): name one of them, "
        "or give a callable (args, kwargs) -> thread id"
    )


def _signature(run: Any) -> inspect.Signature:
    """``inspect.signature`` of a task's ``run``, computed once per function (about 20 µs)."""
    key = (getattr(run, "__func__", run), hasattr(run, "__self__"))
    found = _signatures.get(key)
    if found is None:
        found = _signatures[key] = inspect.signature(run)
    return found


def _amqp_broker(app: Any) -> bool:
    """Whether the app's tasks go to an AMQP broker (RabbitMQ), whose messages carry a task id
    of at most 255 bytes."""
    url = app.conf.broker_write_url or app.conf.broker_url or ""
    if not isinstance(url, str):  # a list of failover URLs: the first one's scheme
        url = next(iter(url), "")
    scheme = str(url).split("://", 1)[0].split("+", 1)[0].lower()
    return scheme in ("amqp", "amqps", "pyamqp", "librabbitmq")


@contextmanager
def gate_errors(
    config: ThreadsConfig, task_id: str, limit: Optional[deadline.Deadline] = None
) -> Iterator[None]:
    """Turn a gate that does not answer into :class:`GateUnavailable`.  ``limit``: the call's
    deadline, which knows whether a script call went out without its reply (it may have run);
    without one, the message allows for that."""
    try:
        yield
    except TransportMismatch as exc:
        raise TransportMismatch(
            f"threads_redis_url {config.shown_url}: {exc}; task {task_id} was neither stored nor sent."
        ) from exc
    except redis.exceptions.OutOfMemoryError as exc:
        # It answered: it refused the call's first write, so the call stored nothing.
        raise GateUnavailable(
            f"the gate's Redis at {config.shown_url} (threads_redis_url) is out of "
            f"memory and refused to store task {task_id}: {exc} Nothing was stored nor sent to "
            "the broker: free memory or raise its maxmemory, then call again."
        ) from exc
    except redis.RedisError as exc:
        found = transport.refusal(exc)  # wrong credentials, or a database the server lacks
        if found is not None:
            raise ConfigurationError(
                f"threads_redis_url {config.shown_url}: {found}; task {task_id} was neither stored nor sent."
            ) from exc
        if transport.missing_right(exc):  # revoked since this process checked its rights
            raise MissingRights(
                f"the gate's Redis at {config.shown_url} (threads_redis_url) refused the call for "
                f"task {task_id}: its user lacks a right the gate needs ({error_text(exc)}), "
                "revoked since this process checked them. Nothing was sent to the broker, but the "
                "gate's script may have stopped part-way (Redis keeps what a script wrote before a "
                "refused command): grant the user the rules docs/redis-tls-acl.md lists, then call "
                "again with a new task id (docs/redis-tls-acl.md, 'Rights revoked while running')."
            ) from exc
        if isinstance(exc, redis.ResponseError) and not isinstance(exc, NotReplicated):
            # It answered, with an error: no outage (a script's error where keys were evicted).
            raise GateUnavailable(
                f"the gate's Redis at {config.shown_url} (threads_redis_url) answered the call "
                f"for task {task_id} with an error: {error_text(exc)}. Nothing was sent to the broker; "
                "`celery threads stats` says whether that Redis evicts keys (which breaks the "
                "gate's records)."
            ) from exc
        where = (
            f"could not reach the gate's Redis at {config.shown_url} (threads_redis_url)"
            + (f" within {limit.seconds:g}s (threads_publish_timeout)" if limit else "")
            + f" to publish task {task_id}: {error_text(exc)}. Nothing was sent to the broker."
        )
        if limit is not None and not limit.unanswered and not isinstance(exc, NotReplicated):
            raise GateUnavailable(
                f"{where} Nothing was stored in the gate either: call again once it is back."
            ) from exc
        raise GateUnavailable(
            f"{where} If Redis received the call before the connection broke, the member may be "
            "stored whole and will run; calling again with the same task_id is safe either way "
            "(a member is never stored twice, nor again within 30 s of its end)."
        ) from exc
