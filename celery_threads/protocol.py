"""The protocol's names and rules, shared by every layer: message header names, the dispatch
task's name, what a valid thread id is, how a threaded task's retry settings and an ``eta`` become
the gate's numbers, and how any module recognises a threaded task without importing the task class.

Nothing here imports another module of the package but :mod:`celery_threads.errors`.
"""

from __future__ import annotations

import math
from datetime import datetime, timezone
from typing import Any, Optional
from uuid import UUID

from celery.utils.saferepr import saferepr

from .errors import ConfigurationError, InvalidArgument, InvalidThreadId
from .logs import get_logger

logger = get_logger(__name__)

#: Message headers a threaded delivery carries (and the ones ``apply_async`` takes as options).
THREAD_HEADER = "thread_id"
TOKEN_HEADER = "thread_token"
REPUBLISHED_HEADER = "thread_republished"  # a release that may reach the broker twice
OUR_HEADERS = (THREAD_HEADER, TOKEN_HEADER, REPUBLISHED_HEADER)
#: The threads_key_prefix of the gate that stored a member (in its stored message): a worker
#: whose gate has another says so, where it would only find the release stale.
GATE_HEADER = "thread_gate"


def foreign_gate(headers: Any, ours: str) -> Optional[str]:
    """What a worker whose gate's key prefix is ``ours`` says of a delivery (``headers``: its
    message's headers, or a request) that another gate released, else ``None``."""
    theirs = headers.get(GATE_HEADER) if isinstance(headers, dict) else getattr(headers, GATE_HEADER, None)
    if not isinstance(theirs, str) or theirs == ours:
        return None
    return (
        f"its release came from the gate with threads_key_prefix={theirs!r}, and this worker's gate "
        f"has {ours!r}: it cannot run here. Give producers and workers the same "
        "threads_key_prefix (and threads_redis_url)"
    )


#: The dispatcher's task and its beat entry.
DISPATCH_TASK = "celery_threads.dispatch"
BEAT_ENTRY = "celery-threads-dispatch"

#: The remote control command by which one worker announces dead letters put back into their
#: threads (``restart``, ``redrive``) with ``task-retried`` (celery_threads/worker/revoke.py).
RETRIED_COMMAND = "celery_threads_retried"

#: ``ThreadedTask.Request``: the worker's request class for members, named as Celery names one.
THREADED_REQUEST = "celery_threads.worker.request:ThreadedRequest"

#: The class attribute that marks a threaded task (``ThreadedTask`` sets it).
THREADED_MARK = "__celery_threads__"


def is_threaded(task: Any) -> bool:
    """Whether ``task`` is a threaded task (an instance of ``ThreadedTask``)."""
    return getattr(task, THREADED_MARK, False) is True


#: The plain tasks already warned of in this process (:func:`warn_unthreaded`).
_warned_unthreaded: set[str] = set()


def warn_unthreaded(task: Any, thread_id: Any = None) -> None:
    """Warn, once per task and process, of a plain task (not a ``ThreadedTask``) declared with a
    ``thread_key`` or called with ``thread_id``: a ``base=ThreadedTask`` left out, whose calls
    run in no thread, beside the members of the thread they name (Celery keeps an unknown
    decorator option as an attribute, and sends an unknown call option as a message property,
    without a word)."""
    if task is None or is_threaded(task) or task.name in _warned_unthreaded:
        return
    if getattr(task, "thread_key", None) is None and thread_id is None:
        return
    _warned_unthreaded.add(task.name)
    how = (
        "called with thread_id" if getattr(task, "thread_key", None) is None else "declared with a thread_key"
    )
    logger.warning(
        "celery-threads: task %s is %s but is not a ThreadedTask: its calls are in no thread, and "
        "run beside that thread's members. Declare it with base=ThreadedTask.",
        task.name,
        how,
    )


MAX_THREAD_ID_BYTES = 1024
#: An int of more bits has more than 1,024 decimal digits: refused before it is turned into text
#: (Python refuses to turn an int of more than 4,300 digits into text, with a bare ValueError).
_MAX_THREAD_ID_BITS = 3402
_KINDS = "a non-empty str, an int or a uuid.UUID"


def normalize_thread_id(value: Any) -> str:
    """A valid thread id as a string, or :class:`InvalidThreadId`.

    A ``str`` is itself, an ``int`` its decimal string, a ``uuid.UUID`` its canonical string
    (``str(value)``: lowercase, with hyphens), so each names the same thread as its text.  A
    ``bool`` is refused, although an ``int``: ``True`` as thread ``"1"`` is a bug waiting."""
    if isinstance(value, UUID):
        return str(value)
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise InvalidThreadId(
            f"thread id {saferepr(value, 80)} is a {type(value).__name__}: use {_KINDS}; "
            "nothing was stored or sent"
        )
    if isinstance(value, int):
        if value.bit_length() > _MAX_THREAD_ID_BITS:
            raise InvalidThreadId(
                f"thread id is an int of {value.bit_length()} bits, more than "
                f"{MAX_THREAD_ID_BYTES} decimal digits; the limit is {MAX_THREAD_ID_BYTES} bytes "
                "of its decimal string: use a shorter id (a hash of it, for example); nothing "
                "was stored or sent"
            )
        text = str(int(value))
    else:
        # A str subclass (a `class Region(str, Enum)` member) as its text: its str() or
        # f-string may be another text ("Region.EU"), and every key and message must name one.
        text = str.__str__(value)
    if not text:
        raise InvalidThreadId(f"thread id is empty: use {_KINDS}; nothing was stored or sent")
    try:
        size = len(text.encode("utf-8"))
    except UnicodeEncodeError as exc:
        raise InvalidThreadId(
            f"thread id {text[:60]!r}{'...' if len(text) > 60 else ''} holds "
            f"{text[exc.start]!r} at position {exc.start}, "
            "a lone surrogate that UTF-8 cannot encode (text decoded with "
            "errors='surrogateescape' keeps undecodable bytes so): decode it into valid text, "
            "or use its bytes' hex; nothing was stored or sent"
        ) from None
    if size > MAX_THREAD_ID_BYTES:
        raise InvalidThreadId(
            f"thread id is {size} bytes long in UTF-8; the limit is {MAX_THREAD_ID_BYTES} bytes: "
            "use a shorter id (a hash of it, for example); nothing was stored or sent"
        )
    return text


#: The longest delay the gate keeps, 100 years in ms: a ``thread_rate_limit``'s interval and a
#: ``default_retry_delay`` beyond it are refused, a ``Retry(when=...)`` raised by hand waits at
#: most that long.  The gate adds delays to its clock in ms: far beyond this the sum is no integer
#: Redis takes (a call failed halfway) or no datetime (``threads ls`` and ``Threads.get`` failed).
MAX_DELAY_MS = 100 * 365 * 86_400_000


def retry_settings(task: Any) -> tuple[Optional[int], int]:
    """A threaded task's ``(max_retries, default_retry_delay in ms)`` as the gate stores them with
    each member, or :class:`ConfigurationError` when either cannot be: the gate keeps them in the
    member's record, which a negative delay or a fractional or negative retry count would make
    unreadable to every later transition of its thread."""
    max_retries = task.max_retries
    if max_retries is not None and (
        isinstance(max_retries, bool) or not isinstance(max_retries, int) or max_retries < 0
    ):
        raise ConfigurationError(
            f"task {task.name} has max_retries={max_retries!r}: a threaded task needs an int of 0 "
            "or more, or None for unlimited retries. Fix the task's max_retries; nothing was "
            "stored or sent"
        )
    delay = task.default_retry_delay
    if delay is None:
        delay = 0
    if (
        isinstance(delay, bool)
        or not isinstance(delay, (int, float))
        or not math.isfinite(delay)
        or delay < 0
        or delay * 1000 > MAX_DELAY_MS
    ):
        raise ConfigurationError(
            f"task {task.name} has default_retry_delay={delay!r}: a threaded task needs a number "
            "of seconds, 0 or more (at most 100 years). Fix the task's default_retry_delay; "
            "nothing was stored or sent"
        )
    return max_retries, int(float(delay) * 1000)


def eta_ms(eta: Any) -> int:
    """An ``eta`` (a datetime, naive meaning UTC, or its ISO text) as epoch milliseconds."""
    if isinstance(eta, str):
        eta = datetime.fromisoformat(eta)
    if eta.tzinfo is None:
        eta = eta.replace(tzinfo=timezone.utc)
    return int(eta.timestamp() * 1000)


#: The supersede policies' option names (task options and ``apply_async`` options alike).
#: ``debounce_max`` is this package's addition to the contract's ``coalesce`` and ``debounce``.
SUPERSEDE_OPTIONS = ("coalesce", "debounce", "debounce_max")


def supersede_policy(name: str, coalesce: Any, debounce: Any, debounce_max: Any) -> Optional[tuple[int, int]]:
    """``(debounce ms, debounce_max ms)`` (0: none) when a call of task ``name`` supersedes its
    task's waiting call in its thread (``coalesce="latest"`` or a ``debounce``), else ``None``;
    :class:`ConfigurationError` naming the option for a value the gate cannot take."""
    if coalesce is not None and coalesce != "latest":
        raise ConfigurationError(
            f"task {name}: coalesce={coalesce!r}; the one policy is coalesce='latest' (or None). "
            "Nothing was stored or sent"
        )
    debounce_ms = _seconds_ms(name, "debounce", debounce)
    most_ms = _seconds_ms(name, "debounce_max", debounce_max)
    if most_ms and not debounce_ms:
        raise ConfigurationError(
            f"task {name}: debounce_max={debounce_max!r} without a debounce: it bounds how long "
            "a debounce may put a burst off. Give debounce=<seconds> too. Nothing was stored or "
            "sent"
        )
    if most_ms and most_ms < debounce_ms:
        raise ConfigurationError(
            f"task {name}: debounce_max={debounce_max!r} is shorter than debounce={debounce!r}; "
            "it must be at least as long. Nothing was stored or sent"
        )
    if coalesce is None and not debounce_ms:
        return None
    return debounce_ms, most_ms


def _seconds_ms(name: str, option: str, value: Any) -> int:
    """A policy's duration in seconds (``None``: none) as whole milliseconds."""
    if value is None:
        return 0
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value <= 0
        or value > 365 * 86400
    ):
        raise ConfigurationError(
            f"task {name}: {option}={value!r}; give a number of seconds above 0 (at most a "
            "year), or None. Nothing was stored or sent"
        )
    return max(1, int(round(float(value) * 1000)))


#: The longest task id AMQP carries (its correlation_id, a short string of at most 255 bytes).
MAX_AMQP_TASK_ID_BYTES = 255


def normalize_task_id(value: Any, amqp: bool = False) -> str:
    """A task id as a plain ``str``: a ``str`` (a subclass as its text) or a ``uuid.UUID`` (its
    canonical string), else :class:`InvalidArgument`.  ``amqp``: the task is sent to an AMQP
    broker, which refuses a task id longer than 255 bytes (a member stored with one could never
    be published)."""
    if isinstance(value, UUID):
        return str(value)
    if not isinstance(value, str) or not value:
        raise InvalidArgument(
            f"task id {saferepr(value, 80)} is a {type(value).__name__}: use a non-empty str or a "
            "uuid.UUID; nothing was stored or sent"
        )
    text = str.__str__(value)
    try:
        encoded = text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidArgument(
            f"task id {text[:60]!r}{'...' if len(text) > 60 else ''} holds {text[exc.start]!r} at "
            f"position {exc.start}, a lone surrogate that UTF-8 cannot encode: use valid text or "
            "a uuid.UUID; nothing was stored or sent"
        ) from None
    if amqp and len(encoded) > MAX_AMQP_TASK_ID_BYTES:
        raise InvalidArgument(
            f"task id {text[:40]!r}... is longer than the {MAX_AMQP_TASK_ID_BYTES} bytes an AMQP "
            "broker carries (its correlation_id); use a shorter one; nothing was stored or sent"
        )
    return text
