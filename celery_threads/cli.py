"""``celery -A proj threads ...``: inspect and steer threads and the dead-letter store.

A ``celery.commands`` entry point: Celery loads the app from its own ``-A`` option and hands it to
these commands as ``ctx.obj.app`` (a :class:`celery.bin.base.CLIContext`).  Every command takes
``--json``; ``stats`` exits with :data:`EX_STUCK` when a thread is stuck, and with
:data:`EX_EVICTING` when the gate's Redis may evict waiting members, so it doubles as a health
check.  Times are the gate's Redis server clock, printed in UTC.

Errors exit with one status per kind (:data:`EXIT_STATUSES`, shown by ``celery threads --help``)
and, under ``--json``, print one object ``{"error", "kind", "exit_code"}`` on stdout as well as
the message on stderr.  Text output shows an id holding a control or non-printable character as
:func:`repr` does (``'a\\nb'``); JSON keeps it raw.
"""

from __future__ import annotations

import contextlib
import functools
import heapq
import itertools
import json
import logging
import os
import shlex
import shutil
import sys
import textwrap
import traceback
from collections.abc import Iterable, Iterator, Sequence
from datetime import datetime
from typing import Any, Callable, Generic, NamedTuple, Optional, TypeVar, cast

import click
import redis
from kombu.utils.url import maybe_sanitize_url

from .admin import DISPATCHER_HINT, NO_REASON, StuckThread, Threads, ThreadSummary
from .config import read_config
from .errors import (
    ConfigurationError,
    GateUnavailable,
    InvalidThreadId,
    MissingRights,
    NotReplicated,
    ReadOnlyGate,
    ThreadsError,
    TransportMismatch,
    UnknownTask,
    error_text,
)
from .gate import transport
from .gate.eviction import Eviction
from .logs import get_logger
from .runtime import unreachable

# Exit statuses (sysexits-style where one fits; `celery threads --help` lists them):
EX_NOTHING = 1  # what the command names is not there or not in a state it acts on; declined;
# or `metrics` cannot start
EX_USAGE = 2  # a wrong command line or argument (click's own code for usage errors)
EX_STUCK = 3  # `stats`: at least one thread is stuck
EX_EVICTING = 4  # `stats`: the gate's Redis may evict waiting members, or is full (and none is stuck)
EX_UNAVAILABLE = 69  # the gate's Redis cannot be reached (sysexits EX_UNAVAILABLE, as Celery)
EX_SOFTWARE = 70  # an unexpected error: a bug, reported with its traceback (sysexits EX_SOFTWARE)
EX_TEMPFAIL = 75  # the gate refused for now (out of memory, replicas late): retry (EX_TEMPFAIL)
EX_PROTOCOL = 76  # the gate's Redis answered with an error the CLI does not know (EX_PROTOCOL)
EX_NOPERM = 77  # the gate's Redis user lacks a right (ACL) or the password is wrong (EX_NOPERM)
EX_CONFIG = 78  # a threads_* setting is wrong (sysexits EX_CONFIG)
EX_PIPE = 141  # stdout's reader went away (`| head`): the status of a process SIGPIPE ends
DEAD_LIMIT = 100  # `dead`: the latest deaths listed unless --limit says otherwise
SHOW_LIMIT = 100  # `show`: the waiting members listed unless --limit says otherwise
PROGRESS_FROM = 1000  # `purge`, `redrive`: a progress bar on a terminal from this many items

F = TypeVar("F", bound=Callable[..., Any])
T = TypeVar("T")

EXIT_STATUSES = f"""\b
Exit status:
  0   done, or nothing to do (purge, redrive, resume of a thread not paused)
  {EX_NOTHING}   not found (show, delete, restart, forget), not dead (restart), declined,
      or metrics cannot start (no prometheus_client, the port taken)
  {EX_USAGE}   wrong command line or argument (an empty or too long thread id)
  {EX_STUCK}   stats: a thread is stuck;  {EX_EVICTING}  stats: the gate's Redis may evict members, or is full
  {EX_UNAVAILABLE}  the gate's Redis cannot be reached (or is a read-only replica)
  {EX_SOFTWARE}  unexpected error: a bug (with a traceback)
  {EX_TEMPFAIL}  the gate's Redis is out of memory, or replicas did not confirm: retry later
  {EX_PROTOCOL}  the gate's Redis answered with another error
  {EX_NOPERM}  the gate's Redis user lacks a right, or its password is wrong
  {EX_CONFIG}  a threads_* setting is wrong
  {EX_PIPE} the reader of the output went away (| head), as for a process SIGPIPE ends

\b
With --json, an error prints one JSON object on stdout,
  {{"error": MESSAGE, "kind": KIND, "exit_code": STATUS}}
KIND: not_found, conflict, aborted, error (1); usage (2); unavailable (69);
internal (70); out_of_memory, not_replicated (75); redis_error (76);
permission (77); config (78).
The message also goes to stderr, as without --json."""


class CommandError(click.ClickException):
    """An error a command expects: one line on stderr (``Error: ...``), under --json also one
    JSON object on stdout (:func:`_echo_error`); ``kind`` names it there, ``exit_code`` is the
    process's exit status."""

    def __init__(self, message: str, kind: str = "not_found", exit_code: int = EX_NOTHING) -> None:
        super().__init__(message)
        self.kind = kind
        self.exit_code = exit_code


class GateUnreachable(CommandError):
    def __init__(self, message: str) -> None:
        super().__init__(message, "unavailable", EX_UNAVAILABLE)


class BadSettings(CommandError):
    def __init__(self, message: str) -> None:
        super().__init__(message, "config", EX_CONFIG)


# -- the app, its gate, and errors ------------------------------------------------------------


def _app(ctx: click.Context) -> Any:
    app = getattr(ctx.obj, "app", None)
    named = ctx.find_root().params.get("app")  # -A; an app named so whose settings lack a URL
    if app is None or (  # is told so by read_config, not asked to name itself
        not named
        and not app.conf.get("threads_redis_url")
        and not app.conf.broker_url
        and not getattr(app, "_celery_threads_installed", False)
    ):
        # Celery's default app, when no -A named the user's: no setting of it is the user's.
        raise click.UsageError("name your Celery app, which configures the gate: celery -A proj threads ...")
    return app


def _redis_url(ctx: click.Context) -> str:
    try:
        return read_config(_app(ctx)).redis_url
    except ConfigurationError as exc:
        raise BadSettings(str(exc)) from None


def _unreachable(url: str, exc: BaseException) -> GateUnreachable:
    reason = error_text(exc)
    return GateUnreachable(
        f"cannot reach the gate's Redis at {maybe_sanitize_url(url)}: {reason}.\n"
        "Start that server, or set threads_redis_url in the app's configuration to the Redis "
        "the workers use."
    )


def _threads(ctx: click.Context) -> Threads:
    """The app's :class:`Threads`, once Redis answered a PING (failing fast: the gate's own client
    retries for ~10 s, right for workers but not for a person at a shell)."""
    url = _redis_url(ctx)
    problem = unreachable(read_config(_app(ctx)))
    if isinstance(problem, ValueError):
        raise BadSettings(
            f"threads_redis_url {maybe_sanitize_url(url)!r} is not a Redis URL ({problem}); fix that setting"
        ) from None
    if problem is not None:
        raise _redis_error(url, problem) from None
    return Threads(_app(ctx))


def _redis_error(url: str, exc: BaseException) -> CommandError:
    """What a Redis error means to an operator, and the exit status it deserves."""
    where = f"the gate's Redis at {maybe_sanitize_url(url)}"
    reason = error_text(exc)
    if isinstance(exc, NotReplicated):  # a redis.TimeoutError, but the master did answer
        return CommandError(
            f"{reason}: the change may not be durable; run the command again (it is safe to)",
            "not_replicated",
            EX_TEMPFAIL,
        )
    if isinstance(exc, redis.AuthenticationError) or transport.missing_right(exc):
        return CommandError(
            f"{where} refused the command for its user: {reason}. Grant that user the gate's "
            "rights (docs/redis-tls-acl.md), or set threads_redis_url with the right credentials.",
            "permission",
            EX_NOPERM,
        )
    if isinstance(exc, redis.exceptions.OutOfMemoryError):
        return CommandError(
            f"{where} is out of memory (maxmemory) and refused the change: {reason}. Nothing was "
            "changed; free memory or raise its maxmemory, then run the command again.",
            "out_of_memory",
            EX_TEMPFAIL,
        )
    if isinstance(exc, redis.exceptions.ReadOnlyError):
        return CommandError(
            f"{where} is a read-only replica and refused the change: {reason}. Point "
            "threads_redis_url at its master, or use a sentinel:// URL.",
            "unavailable",
            EX_UNAVAILABLE,
        )
    if isinstance(exc, TransportMismatch):
        return BadSettings(f"threads_redis_url {maybe_sanitize_url(url)!r}: {reason}.")
    refused = transport.refusal(exc) if isinstance(exc, redis.ResponseError) else None
    if refused is not None:  # a database the server lacks (credentials: a permission, above)
        return BadSettings(f"threads_redis_url {maybe_sanitize_url(url)!r}: {refused}.")
    if isinstance(exc, (redis.ConnectionError, redis.TimeoutError)):
        return _unreachable(url, exc)
    return CommandError(f"{where} answered with an error: {reason}.", "redis_error", EX_PROTOCOL)


def _gate_url() -> str:
    ctx = click.get_current_context(silent=True)
    try:
        return _redis_url(ctx) if ctx is not None else "?"
    except (click.ClickException, ConfigurationError):
        return "?"


def _command_error(exc: Exception) -> CommandError:
    """``exc`` as the :class:`CommandError` it is reported as."""
    if isinstance(exc, CommandError):
        return exc
    if isinstance(exc, click.ClickException):  # click's own: usage errors (exit 2), mostly
        kind = "usage" if exc.exit_code == EX_USAGE else "error"
        return CommandError(exc.format_message(), kind, exc.exit_code)
    if isinstance(exc, redis.RedisError):
        return _redis_error(_gate_url(), exc)
    if isinstance(exc, MissingRights):
        return CommandError(_message(exc), "permission", EX_NOPERM)
    if isinstance(exc, ReadOnlyGate):
        return CommandError(_message(exc), "unavailable", EX_UNAVAILABLE)
    if isinstance(exc, ConfigurationError):
        return BadSettings(str(exc))
    if isinstance(exc, GateUnavailable):
        return CommandError(_message(exc), "unavailable", EX_UNAVAILABLE)
    if isinstance(exc, InvalidThreadId):
        # Its text is written for a call (apply_async): a command stores and sends nothing anyway.
        return CommandError(_message(exc).replace("; nothing was stored or sent", ""), "usage", EX_USAGE)
    if isinstance(exc, UnknownTask):
        return CommandError(_message(exc), "not_found", EX_NOTHING)
    if isinstance(exc, ThreadsError):
        return CommandError(_message(exc), "error", EX_NOTHING)
    return CommandError(
        f"unexpected error, a bug in celery-threads: {type(exc).__name__}: {_message(exc)} "
        "(the traceback above says where; please report it)",
        "internal",
        EX_SOFTWARE,
    )


def _guarded(fn: F) -> F:
    """Turn the errors a command may meet into messages that say what to do (no traceback but
    for a bug), with an exit status per kind, and under --json one JSON object on stdout."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        as_json = bool(kwargs.get("as_json"))
        try:
            return fn(*args, **kwargs)
        except click.exceptions.Exit:  # ctx.exit(): a status, not an error
            raise
        except click.Abort:  # a question answered no (or ^C, ^D): click prints "Aborted!"
            if as_json:
                _echo_error(CommandError("Aborted!", "aborted", EX_NOTHING))
            raise
        except BrokenPipeError:
            # The reader went away (`| head`): stop quietly, as a process SIGPIPE ends; stdout goes
            # to /dev/null so that the interpreter's last flush does not fail again.
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            sys.exit(EX_PIPE)
        except Exception as exc:
            error = _command_error(exc)
            if error.kind == "internal":
                traceback.print_exception(exc, file=sys.stderr)
            if as_json:
                _echo_error(error)
            if isinstance(exc, click.ClickException):
                raise
            raise error from None

    return cast(F, wrapper)


def _message(exc: BaseException) -> str:
    # KeyError subclasses (UnknownTask) would print their message quoted.
    return str(exc.args[0]) if exc.args else type(exc).__name__


def _echo_error(error: CommandError) -> None:
    """The --json form of an error: one object on stdout (the message still goes to stderr)."""
    _echo_json({"error": error.format_message(), "kind": error.kind, "exit_code": error.exit_code})


def _json_in(args: Sequence[str]) -> bool:
    """Whether a command line asks for --json (before a ``--``, after which it is an argument)."""
    return "--json" in (args[: list(args).index("--")] if "--" in args else args)


class _Command(click.Command):
    """A command whose usage errors (a missing argument, an unknown option) print JSON too."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        asked = _json_in(args)
        try:
            return super().parse_args(ctx, args)
        except click.UsageError as exc:
            if asked:
                _echo_error(_command_error(exc))
            raise


class _Group(click.Group):
    command_class = _Command

    def resolve_command(
        self, ctx: click.Context, args: list[str]
    ) -> tuple[Optional[str], Optional[click.Command], list[str]]:
        try:
            return super().resolve_command(ctx, args)
        except click.UsageError as exc:  # an unknown command
            if _json_in(args):
                _echo_error(_command_error(exc))
            raise


json_option = click.option("--json", "as_json", is_flag=True, help="Print JSON instead of text.")


# -- output -----------------------------------------------------------------------------------


def _jsonable(value: Any) -> Any:
    if isinstance(value, tuple) and hasattr(value, "_asdict"):
        return {k: _jsonable(v) for k, v in value._asdict().items()}
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, datetime):
        return value.isoformat(timespec="milliseconds")
    if isinstance(value, float):
        return round(value, 3)
    if value is None or isinstance(value, (str, int, bool)):
        return value
    return repr(value)


def _echo_json(data: Any) -> None:
    click.echo(json.dumps(_jsonable(data), indent=2))


def _id(value: Any) -> str:
    """A thread or task id as text shows it: as is when every character is printable, else
    quoted and escaped as :func:`repr` does (``'a\\nb'``), so that no newline, carriage return,
    tab or terminal escape in an id can break or fake a line.  Quoted too when it could be taken
    for another id so shown: empty, with a space at either end ("trail" and "trail " would read
    alike), or starting with a quote (a printable "'a\\x00b'" would read as the id holding a
    NUL).  JSON keeps the raw id."""
    text = str(value)
    if text.isprintable() and text.strip() == text and text and text[0] not in "'\"":
        return text
    return repr(text)


def _command(command: str, value: Any) -> str:
    """``celery threads COMMAND ID`` as a shell takes it: the id quoted for a POSIX shell (after
    ``--`` when it starts with a dash; ``$'...'`` for control characters, as bash and zsh read
    it).  An id holding a NUL cannot be given on any command line: the Python API then."""
    text = str(value)
    if "\0" in text:
        return f"Threads(app).{command}(...) in Python (its id holds a NUL, which no command line carries)"
    if text.isprintable():
        quoted = shlex.quote(text)
    else:
        quoted = (
            "$'"
            + "".join(
                c if c.isprintable() and c not in "'\\" else "\\" + c if c in "'\\" else repr(c)[1:-1]
                for c in text
            )
            + "'"
        )
    return f"`{_celery()} {command} {'-- ' if text.startswith('-') else ''}{quoted}`"


def _celery() -> str:
    """``celery -A APP threads``, with the app as this command was given it (a hint copied
    without it fails: "name your Celery app")."""
    ctx = click.get_current_context(silent=True)
    app = ctx.find_root().params.get("app") if ctx is not None else None
    return f"celery -A {shlex.quote(app)} threads" if isinstance(app, str) and app else "celery threads"


def _printable(text: str) -> str:
    """Free text (a reason, a name, arguments, an exception) on one line: each control or
    non-printable character escaped as :func:`repr` escapes it, without quotes."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def _width() -> int:
    """The terminal's width, never under 80 columns."""
    return max(80, shutil.get_terminal_size((80, 24)).columns)


def _when(at: Optional[datetime]) -> str:
    return "-" if at is None else at.strftime("%Y-%m-%dT%H:%M:%SZ")


def _duration(seconds: float) -> str:
    s = abs(seconds)
    if s < 10:
        return f"{s:.1f}s"
    if s < 60:
        return f"{s:.0f}s"
    minutes, s_ = divmod(int(s), 60)
    if minutes < 60:
        return f"{minutes}m{s_:02d}s"
    hours, minutes = divmod(minutes, 60)
    if hours < 24:
        return f"{hours}h{minutes:02d}m"
    days, hours = divmod(hours, 24)
    return f"{days}d{hours:02d}h"


def _relative(seconds_ahead: Optional[float]) -> str:
    """``in 3.0s`` for the future, ``3.0s ago`` for the past."""
    if seconds_ahead is None:
        return "-"
    if abs(seconds_ahead) < 0.05:
        return "now"
    if seconds_ahead > 0:
        return f"in {_duration(seconds_ahead)}"
    return f"{_duration(seconds_ahead)} ago"


def _fit(text: str, width: int) -> str:
    return text if len(text) <= width else text[: max(width - 1, 0)] + "…"


class Column(NamedTuple):
    header: str
    right: bool = False  # align right (numbers)
    shrink: int = 0  # may be cut, with "…", to fit the width: 1 first, then 2, ...


def _table(
    columns: Sequence[Column], rows: Sequence[Sequence[Any]], width: Optional[int] = None
) -> list[str]:
    """Aligned lines (header first), shrinking the shrinkable columns to fit ``width``."""
    width = width or _width()
    cells = [["-" if v is None else _printable(str(v)) for v in row] for row in rows]
    widths = [max([len(c.header), *(len(r[i]) for r in cells)]) for i, c in enumerate(columns)]
    excess = sum(widths) + 2 * (len(columns) - 1) - width
    while excess > 0:
        shrinkable = [i for i, c in enumerate(columns) if c.shrink and widths[i] > max(len(c.header), 8)]
        if not shrinkable:
            break
        first = min(columns[i].shrink for i in shrinkable)
        widest = max((i for i in shrinkable if columns[i].shrink == first), key=lambda i: widths[i])
        widths[widest] -= 1
        excess -= 1

    def line(values: Sequence[str]) -> str:
        parts = [
            _fit(v, w).rjust(w) if c.right else _fit(v, w).ljust(w)
            for c, v, w in zip(columns, values, widths)
        ]
        return "  ".join(parts).rstrip()

    return [line([c.header for c in columns]), *(line(r) for r in cells)]


def _echo_lines(lines: Sequence[str]) -> None:
    for text in lines:
        click.echo(text)


def _pairs(pairs: Sequence[tuple[str, Any]], indent: int = 2) -> list[str]:
    """``label  value`` lines, the values aligned."""
    label_width = max(len(label) for label, _ in pairs)
    return [f"{' ' * indent}{label.ljust(label_width)}  {'-' if v is None else v}" for label, v in pairs]


# -- commands ---------------------------------------------------------------------------------


@click.group(name="threads", cls=_Group, epilog=EXIT_STATUSES)
@click.pass_context
def threads(ctx: click.Context) -> None:
    """Inspect and steer celery-threads: threads, members, dead letters, health."""
    # The gate's start-up warnings (eviction, persistence) are for a worker's log; here
    # `celery threads stats` prints them, and no other command repeats them on stderr.
    findings = get_logger("celery_threads.gate.eviction")
    level = findings.level
    findings.setLevel(logging.ERROR)
    ctx.call_on_close(lambda: findings.setLevel(level))


_SORTS: dict[str, Callable[[ThreadSummary], Any]] = {
    "id": lambda s: s.thread_id,
    "members": lambda s: (-s.members, s.thread_id),
    # Longest active first; then idle threads, the longest-eligible head first.
    "age": lambda s: (
        (0, -s.active_for, s.thread_id)
        if s.active_for is not None
        else (1, -(s.head_age or 0.0), s.thread_id)
    ),
}


@threads.command("ls")
@click.option(
    "--sort",
    type=click.Choice(list(_SORTS)),
    default=None,
    help="id; members (most first); age (longest active first).  Sorting reads "
    "every thread; unsorted (the default), threads come in the gate's order "
    "and --limit N reads only N of them.",
)
@click.option("--limit", type=click.IntRange(min=1), default=None, help="Show at most this many threads.")
@click.option(
    "--paused",
    "only_paused",
    is_flag=True,
    help="List only the paused threads (read without reading the others).",
)
@json_option
@click.pass_context
@_guarded
def ls(
    ctx: click.Context, sort: Optional[str], limit: Optional[int], only_paused: bool, as_json: bool
) -> None:
    """List threads: members, active member, when the head is eligible, pause."""
    summaries = _threads(ctx).summaries(limit=None if sort or not limit else limit + 1, paused=only_paused)
    if sort is None:
        # One more than shown tells whether more exist, without counting them all.
        read = list(itertools.islice(summaries, limit + 1) if limit else summaries)
        shown, total = read[:limit], None if limit and len(read) > limit else len(read)
    else:
        counted = _Counted(summaries)
        key = _SORTS[sort]
        shown = heapq.nsmallest(limit, counted, key=key) if limit else sorted(counted, key=key)
        total = counted.n
    if as_json:
        _echo_json(shown)
        return
    if not shown:
        click.echo("No paused threads." if only_paused else "No threads.")
        return
    # Ids are printed whole (they are pasted into show and delete), the thread's last; the
    # PAUSED column (a pause's reason) only when a thread shown is paused.
    pauses = any(s.paused is not None for s in shown)
    columns = [
        Column("MEMBERS", right=True),
        Column("STATE"),
        Column("ACTIVE FOR", right=True),
        Column("NEXT ELIGIBLE"),
        Column("ACTIVE TASK"),
        *([Column("PAUSED", shrink=1)] if pauses else []),
        Column("THREAD"),
    ]
    _echo_lines(
        _table(
            columns,
            [
                (
                    s.members,
                    s.active_state,
                    None if s.active_for is None else _duration(s.active_for),
                    None if s.head_age is None else _relative(-s.head_age),
                    None if s.active_task is None else _id(s.active_task),
                    *([s.paused] if pauses else []),
                    _id(s.thread_id),
                )
                for s in shown
            ],
        )
    )
    if total is None:
        click.echo(f"first {len(shown)} threads shown; more exist (`{_celery()} stats` counts them)")
        return
    more = f" (first {len(shown)} shown)" if len(shown) < total else ""
    kind = " paused" if only_paused else ""
    click.echo(f"{total}{kind} thread{'s' if total != 1 else ''}{more}")


class _Counted(Generic[T]):
    """An iterable that counts the items taken from it (``n``)."""

    def __init__(self, items: Iterable[T]) -> None:
        self.items, self.n = items, 0

    def __iter__(self) -> Iterator[T]:
        for item in self.items:
            self.n += 1
            yield item


@threads.command()
@click.argument("thread_id")
@click.option(
    "--limit",
    type=click.IntRange(min=0),
    default=SHOW_LIMIT,
    show_default=True,
    help="Show only this many of the waiting members, first in release order; 0 shows them all "
    "(Redis reads every one it returns: a thread of many thousands holds up the gate meanwhile).",
)
@json_option
@click.pass_context
@_guarded
def show(ctx: click.Context, thread_id: str, limit: int, as_json: bool) -> None:
    """Show a thread: active member, waiting members in release order."""
    threads = _threads(ctx)
    status = threads.status(thread_id, limit or None)
    if status is None:
        member = threads.reads.record(thread_id)  # a task id given for a thread id?
        hint = (
            f"{thread_id!r} is the task id of a member of thread {member.thread_id!r}: "
            f"`{_celery()} show {shlex.quote(member.thread_id)}`"
            if member is not None
            else f"`{_celery()} ls` lists the existing threads"
        )
        raise CommandError(
            f"no thread {thread_id!r}: a thread exists only while it has members or is paused. {hint}."
        )
    more = status.waiting_total - len(status.waiting)
    if as_json:
        _echo_json({**_jsonable(status), "members": status.members})
        if more:  # as `dead` does: the JSON keeps its shape; what it leaves out is said beside it
            click.echo(
                f"the first {len(status.waiting)} of {status.waiting_total} waiting members listed; "
                "--limit 0 lists them all",
                err=True,
            )
        return
    n = status.members
    click.echo(
        f"Thread {_id(status.thread_id)}: {n} member{'s' if n != 1 else ''} (Redis time {_when(status.now)})"
    )
    if status.paused is not None and status.paused.startswith("on_death=hold: "):
        # resume alone goes on without the dead member, which the hold is there to prevent
        click.echo(
            f"PAUSED: {_printable(status.paused)}. Nothing more of it is released until its dead "
            f"member is redriven ({_command('redrive', status.thread_id)}), restarted or forgotten "
            f"(`{_celery()} dead` lists it), or {_command('resume', status.thread_id)} goes on "
            "without it."
        )
    elif status.paused is not None:
        click.echo(
            f"PAUSED: {_printable(status.paused)}. Nothing more of it is released until "
            f"{_command('resume', status.thread_id)}."
        )
    click.echo("")
    a = status.active
    if a is None and status.paused is not None:
        click.echo("Active member: none (paused).")
    elif a is None:
        click.echo(
            f"Active member: none; the head is eligible "
            f"{_relative(None if status.head_age is None else -status.head_age)}."
        )
    else:
        # A RELEASED member's deadline is the release timeout: unclaimed by then, it is republished.
        lease_label = "lease expires" if a.state == "RUNNING" else "release deadline"
        lease = _relative(a.expires_in) if a.expires_in >= 0 else f"LAPSED {_relative(a.expires_in)}"
        scheduled_ahead = (a.scheduled_at - status.now).total_seconds()
        pairs: list[tuple[str, Any]] = [
            ("task id", _id(a.task_id)),
            ("name", _printable(a.name or "?")),
            ("state", a.state),
            ("scheduled at", f"{_when(a.scheduled_at)} ({_relative(scheduled_ahead)})"),
            ("active for", f"{_duration(a.active_for)} (released {_when(a.since)})"),
            (lease_label, f"{_when(a.deadline)} ({lease})"),
            ("worker", None if a.worker is None else _printable(a.worker)),
            ("retries", a.retries),
            ("arguments", _printable(a.arguments or "-")),
        ]
        if a.route:
            pairs.append(("routing key", _printable(a.route)))
        if a.republished:
            pairs.append(
                (
                    "republished",
                    f"{a.republished} time(s): no worker claimed it (does a worker consume the "
                    "queue of its routing key?)",
                )
            )
        if a.stopping:
            pairs.append(("deleted", "its worker is stopping it; the next member starts once it has stopped"))
        click.echo("Active member")
        _echo_lines(_pairs(pairs))
    click.echo("")
    if not status.waiting:
        click.echo("Waiting members: none.")
        return
    if more:
        click.echo(
            f"Waiting members: the first {len(status.waiting)} of {status.waiting_total}, in release "
            "order (ARRIVAL ranks them among those shown)"
        )
    else:
        click.echo("Waiting members, in release order")
    columns = [
        Column("#", right=True),
        Column("SCHEDULED AT"),
        Column("ARRIVAL", right=True),
        Column("RETRIES", right=True),
        Column("TASK ID"),
    ]
    width = _width()
    lines = _table(
        columns,
        [
            (i, _when(m.scheduled_at), m.arrival, m.retries, _id(m.task_id))
            for i, m in enumerate(status.waiting, start=1)
        ],
        width,
    )
    click.echo(lines[0])
    for line, m in zip(lines[1:], status.waiting):
        click.echo(line)
        click.echo(_fit(_printable(f"    {m.name or '?'} {m.arguments or ''}".rstrip()), width))
    if more:
        click.echo(f"... and {more} more waiting; --limit 0 lists them all")


@threads.command()
@click.argument("task_id")
@json_option
@click.pass_context
@_guarded
def delete(ctx: click.Context, task_id: str, as_json: bool) -> None:
    """Detach a member now and promote the next.

    A running member is also revoked with terminate; a released one is revoked.
    """
    t = _threads(ctx)
    thread_id = t.thread_of(task_id)
    if thread_id is None or not t.delete(task_id):
        hint = (
            f"it is in the dead-letter store (see `{_celery()} forget`)"
            if t.dead_task(task_id) is not None
            else f"it may have ended or been deleted already; `{_celery()} show THREAD_ID` "
            "lists a thread's members"
        )
        raise CommandError(f"no thread has a member with task id {task_id!r}: {hint}.")
    if as_json:
        _echo_json({"task_id": task_id, "thread_id": thread_id, "deleted": True})
    else:
        click.echo(f"Deleted member {_id(task_id)} of thread {_id(thread_id)}.")


@threads.command()
@click.argument("thread_id")
@click.option("--reason", default=None, help="Why, shown by show and ls.")
@json_option
@click.pass_context
@_guarded
def pause(ctx: click.Context, thread_id: str, reason: Optional[str], as_json: bool) -> None:
    """Stop releasing a thread's members until `resume`.

    The member released or running goes on to its end; new calls still join the thread.  The
    pause stays, even while the thread has no member, until resumed.
    """
    t = _threads(ctx)
    new = t.pause(thread_id, reason)
    reason = reason or NO_REASON
    if as_json:
        _echo_json({"thread_id": thread_id, "paused": True, "reason": reason, "was_paused": not new})
        return
    again = "" if new else " (it was paused already; the reason is replaced)"
    click.echo(
        f"Paused thread {_id(thread_id)}: {_printable(reason)}{again}.  A member released or "
        f"running goes on to its end; {_command('resume', thread_id)} releases the rest."
    )


@threads.command()
@click.argument("thread_id")
@json_option
@click.pass_context
@_guarded
def resume(ctx: click.Context, thread_id: str, as_json: bool) -> None:
    """Release a paused thread's members again, its due head at once.

    A thread that is not paused (or does not exist) is left as it is, with exit status 0.
    """
    # Like pause (which replaces a pause) and purge, resume is idempotent: a thread that is not
    # paused is already in the state asked for, so that is "nothing to do" (exit 0, saying so),
    # not an error: a script resuming after a pause, or a retry of a resume, must not fail.
    resumed = _threads(ctx).resume(thread_id)
    if as_json:
        _echo_json({"thread_id": thread_id, "resumed": resumed})
    elif resumed:
        click.echo(f"Resumed thread {_id(thread_id)}.")
    else:
        click.echo(
            f"Thread {_id(thread_id)} is not paused: nothing to resume. "
            f"(`{_celery()} ls --paused` lists the paused threads.)"
        )


@threads.command()
@click.option(
    "--limit",
    type=click.IntRange(min=0),
    default=DEAD_LIMIT,
    show_default=True,
    help="Show only this many of the latest deaths; 0 shows them all.",
)
@json_option
@click.pass_context
@_guarded
def dead(ctx: click.Context, limit: int, as_json: bool) -> None:
    """List the dead-letter store, newest last, with exceptions."""
    t = _threads(ctx)
    tasks = t.dead(limit or None)
    total = t.dead_count() if limit and len(tasks) == limit else len(tasks)
    shown = f"the {len(tasks)} latest of " if total > len(tasks) else ""
    if as_json:
        _echo_json(tasks)
        if shown:  # the JSON stays a list; what it leaves out is said beside it
            click.echo(f"{shown}{total} dead tasks listed; --limit 0 lists them all", err=True)
        return
    if not tasks:
        click.echo("The dead-letter store is empty.")
        return
    width = _width()
    lines = _table(
        [Column("DIED AT"), Column("TASK ID"), Column("THREAD")],
        [(_when(d.died_at), _id(d.task_id), _id(d.thread_id)) for d in tasks],
        width,
    )
    click.echo(lines[0])
    for line, d in zip(lines[1:], tasks):
        click.echo(line)
        exception = (d.exception.strip().splitlines() or ["?"])[0]
        retries = f"{d.retries} retr{'y' if d.retries == 1 else 'ies'}"
        click.echo(_fit(_printable(f"    {d.name or '?'}, {retries}: {exception}"), width))
    click.echo(
        f"{shown}{total} dead task{'s' if total != 1 else ''}; "
        f"`{_celery()} restart TASK_ID` runs one again" + ("; --limit 0 lists them all" if shown else "")
    )


@threads.command()
@click.argument("task_id")
@json_option
@click.pass_context
@_guarded
def restart(ctx: click.Context, task_id: str, as_json: bool) -> None:
    """Run a dead task again, as a new arrival of its thread.

    Same task id; its retries start again from zero.
    """
    t = _threads(ctx)
    dead = t.dead_task(task_id)
    if dead is None:
        live = t.thread_of(task_id)
        if live is not None:
            raise CommandError(
                f"{task_id!r} is a live member of thread {live!r} (not dead): there is nothing to "
                f"restart; {_command('show', live)} shows it",
                "conflict",
            )
        raise CommandError(
            f"{task_id!r} is not in the dead-letter store; `{_celery()} dead` lists the dead tasks"
        )
    try:
        # The task's max_retries and default_retry_delay come from its registered class.
        t.app.loader.import_default_modules()
    except Exception as exc:
        click.echo(
            f"warning: could not import the app's task modules ({exc}); the task keeps "
            "default retry settings",
            err=True,
        )
    t.restart(task_id)
    thread_id = dead.thread_id
    if as_json:
        _echo_json({"task_id": task_id, "thread_id": thread_id, "restarted": True})
    else:
        click.echo(f"Restarted {_id(task_id)} in thread {_id(thread_id)} as a new arrival.")


@threads.command()
@click.argument("task_id", required=False)
@click.option("--all", "forget_all", is_flag=True, help="Forget every dead task.")
@click.option(
    "--yes", "-y", "--force", "-f", "yes", is_flag=True, help="Do not ask for confirmation (with --all)."
)
@json_option
@click.pass_context
@_guarded
def forget(ctx: click.Context, task_id: Optional[str], forget_all: bool, yes: bool, as_json: bool) -> None:
    """Drop dead tasks from the dead-letter store.

    TASK_ID drops one; --all drops every dead task, after asking (--yes skips the question).
    """
    if bool(task_id) == forget_all:
        raise click.UsageError("give either a TASK_ID or --all")
    t = _threads(ctx)
    if task_id:
        if not t.forget(task_id):
            raise CommandError(
                f"{task_id!r} is not in the dead-letter store; `{_celery()} dead` lists the dead tasks"
            )
        if as_json:
            _echo_json({"forgotten": [task_id]})
        else:
            click.echo(f"Forgot dead task {_id(task_id)}.")
        return
    total = t.dead_count()
    if total and not yes:
        click.confirm(
            f"Forget all {total} dead task{'s' if total != 1 else ''}? This cannot be undone.",
            abort=True,
            err=True,
        )
    forgotten: list[str] = []
    with _progress(total, "Forgetting dead tasks", as_json, at_least=1) as progress:
        for batch in t.forget_all():
            forgotten += batch
            progress(len(batch))
    if as_json:
        _echo_json({"forgotten": forgotten})
    else:
        click.echo(f"Forgot {len(forgotten)} dead task{'s' if len(forgotten) != 1 else ''}.")


@contextlib.contextmanager
def _progress(
    total: int, label: str, as_json: bool = False, at_least: int = PROGRESS_FROM
) -> Iterator[Callable[[int], None]]:
    """click's progress bar on stderr for a batched operator action of at least ``at_least``
    items, on a terminal only (none with --json, or when stderr is a pipe, a file, a script);
    yields the callback told after each batch."""
    if as_json or total < at_least or not sys.stderr.isatty():
        yield lambda n: None
        return
    with click.progressbar(length=total, label=label, file=sys.stderr) as bar:
        yield bar.update


@threads.command()
@click.argument("thread_id", required=False)
@click.option(
    "--limit",
    # Not 0: `dead --limit 0` lists every letter, and a redrive of none is not what that asks.
    type=click.IntRange(min=1),
    default=None,
    help="Redrive at most this many, oldest death first (without it: every one).",
)
@click.option("--dry-run", is_flag=True, help="List what would be redriven; change nothing.")
@json_option
@click.pass_context
@_guarded
def redrive(
    ctx: click.Context, thread_id: Optional[str], limit: Optional[int], dry_run: bool, as_json: bool
) -> None:
    """Put dead letters back into their threads at their original place.

    Those of THREAD_ID, or of every thread; oldest death first.  Each keeps its task id, its
    scheduled time and its arrival order, with its retries reset, so a thread's redriven members
    run in their original order and before members that arrived after them.
    """
    # A thread without dead letters (or unknown) redrives nothing, with exit status 0: redrive is
    # a bulk, idempotent operation (run again, it finds nothing left), so "nothing to do" is done.
    t = _threads(ctx)
    letters = t.redrivable(thread_id, limit)
    if dry_run:
        if as_json:
            _echo_json({"dry_run": True, "would_redrive": letters})
            return
        for d in letters:
            click.echo(
                f"{_when(d.died_at)}  {_id(d.task_id)}  thread {_id(d.thread_id)}  "
                f"{_printable(d.name or '?')}"
            )
        click.echo(f"would redrive {len(letters)} dead task{'s' if len(letters) != 1 else ''}")
        return
    try:
        # The tasks' max_retries and default_retry_delay come from their registered classes.
        t.app.loader.import_default_modules()
    except Exception as exc:
        click.echo(
            f"warning: could not import the app's task modules ({exc}); the tasks keep "
            "default retry settings",
            err=True,
        )
    with _progress(len(letters), "redriving") as progress:
        count = t.redrive(thread_id, limit, progress=progress)
    if as_json:
        _echo_json({"redriven": count})
    else:
        click.echo(f"Redrove {count} dead task{'s' if count != 1 else ''} to their original place.")


@threads.command()
@click.argument("thread_id", required=False)
@click.option("--force", "-f", "--yes", "-y", "force", is_flag=True, help="Do not ask for confirmation.")
@json_option
@click.pass_context
@_guarded
def purge(ctx: click.Context, thread_id: Optional[str], force: bool, as_json: bool) -> None:
    """Drop the waiting members of THREAD_ID, or of every thread.

    A released or running member goes on.  Dropped members end as REVOKED in the result
    backend.  Asks first when there are any, unless -f (or -y).
    """
    # A thread without waiting members (or unknown) drops nothing, with exit status 0: purge is a
    # bulk, idempotent operation (run again, it finds nothing left), so "nothing to do" is done.
    t = _threads(ctx)
    waiting = t.waiting_count(thread_id)
    where = f"thread {_id(thread_id)}" if thread_id is not None else "every thread"
    if not force and waiting:
        click.confirm(
            f"Drop the {waiting} waiting member{'s' if waiting != 1 else ''} of "
            f"{where}? This cannot be undone.",
            abort=True,
            err=True,
        )
    with _progress(waiting, "purging") as progress:
        count = t.purge(thread_id, progress=progress)
    if as_json:
        _echo_json({"purged": count})
    else:
        click.echo(f"Dropped {count} waiting member{'s' if count != 1 else ''} of {where}.")


@threads.command()
@click.option(
    "--stuck-after",
    type=click.FloatRange(min=0),
    default=None,
    metavar="SECONDS",
    help="How late counts as stuck (default: 3 dispatcher ticks).",
)
@json_option
@click.pass_context
@_guarded
def stats(ctx: click.Context, stuck_after: Optional[float], as_json: bool) -> None:
    """Counts, stuck threads, and an evicting Redis; exit status 3 when a thread is stuck, else 4
    when the gate's Redis may evict waiting members.

    A thread is stuck when an active member's lease or release deadline lapsed, or an idle
    head has been due, for longer than --stuck-after without the dispatcher acting on it: no
    dispatcher is running (a paused thread is never stuck).  The gate's Redis may evict members
    when its maxmemory-policy is allkeys-* with a maxmemory set (a warning is shown for any
    other policy but noeviction).  Use it as a health check.
    """
    t = _threads(ctx)
    numbers = t.stats(grace=stuck_after)
    stuck = t.stuck(grace=stuck_after)
    eviction = t.eviction()
    evicting = any(risk.level == "error" for risk in eviction)
    gaps = t.persistence()
    if as_json:
        _echo_json(
            {
                **_jsonable(numbers),
                "stuck_threads": stuck,
                "eviction": eviction,
                "persistence": [gap.removeprefix("celery-threads: ") for gap in gaps],
                "healthy": not stuck and not evicting,
            }
        )
    else:
        head = numbers.oldest_waiting_head
        waiting = numbers.members["WAITING"]
        if head is not None:
            oldest = f"due {_relative(-head.age)}: {_id(head.task_id or '?')} of thread {_id(head.thread_id)}"
        elif waiting:
            oldest = (
                f"none (the {waiting} waiting wait behind an active member of their "
                "thread, in a paused thread, or are not due yet)"
            )
        else:
            oldest = "none"
        click.echo(
            "\n".join(
                _pairs(
                    [
                        ("threads", numbers.threads),
                        ("members", sum(numbers.members.values())),
                        ("  waiting", numbers.members["WAITING"]),
                        ("  released", numbers.members["RELEASED"]),
                        ("  running", numbers.members["RUNNING"]),
                        ("paused threads", numbers.paused),
                        ("dead letters", numbers.dead),
                        ("  retention drops", numbers.dead_dropped),
                        ("oldest due idle head", oldest),
                        ("stuck", max(numbers.stuck, len(stuck)) if stuck else 0),
                    ],
                    indent=0,
                )
            )
        )
        if stuck:
            _echo_stuck(stuck)
        _echo_eviction(eviction)
        for gap in gaps:  # a warning: the exit status is not the health of a gate without one
            _echo_finding("warning", gap)
    if stuck:
        ctx.exit(EX_STUCK)
    if evicting:
        ctx.exit(EX_EVICTING)


@threads.command()
@click.option(
    "--port",
    type=click.IntRange(0, 65535),
    default=9808,
    show_default=True,
    help="TCP port of the /metrics endpoint.",
)
@click.option(
    "--address",
    default="127.0.0.1",
    show_default=True,
    help="Address to listen on (0.0.0.0: every interface).",
)
@click.option(
    "--top",
    type=click.IntRange(min=0),
    default=0,
    metavar="N",
    help="Also celery_threads_thread_waiting{thread_id} for the N threads with the "
    "most waiting members (reads every thread's queue length per scrape).",
)
@click.option("--once", is_flag=True, help="Print the metrics once in Prometheus' text format and exit.")
@click.pass_context
@_guarded
def metrics(ctx: click.Context, port: int, address: str, top: int, once: bool) -> None:
    """Serve Prometheus metrics at /metrics, read from the gate on each scrape.

    The counters live in the gate, kept by its transitions: any number of exporters can run,
    restart, or none at all.  Needs prometheus_client (the 'metrics' extra).
    """
    try:
        from . import exporter  # an optional extra: imported only for this command
    except ImportError as exc:
        raise CommandError(
            f"celery threads metrics needs prometheus_client ({exc}): pip install prometheus_client "
            "(the package's metrics extra)",
            "error",
        ) from None
    t = _threads(ctx)
    if once:
        # color=True: click strips what looks like a terminal's escape sequence from a pipe's
        # output, from the thread ids too (another id; the textfile collector reads a pipe).
        click.echo(exporter.render(t, top), nl=False, color=True)
        return
    try:
        server = exporter.listen(t, address, port, top)
    except OSError as exc:
        raise CommandError(
            f"cannot listen on {address}:{port}: {exc.strerror or exc}; choose another --port or --address",
            "error",
        ) from None
    click.echo(f"Serving celery-threads metrics at http://{address}:{port}/metrics", err=True)
    server.join()


def _echo_eviction(eviction: Sequence[Eviction]) -> None:
    for risk in eviction:
        _echo_finding(risk.level, risk.message)


def _echo_finding(level: str, message: str) -> None:
    """A start-up finding about the gate's Redis (its log line's text), as a paragraph."""
    click.echo("")
    click.echo(textwrap.fill(f"{level.upper()}: {message.removeprefix('celery-threads: ')}", _width()))


def _echo_stuck(stuck: Sequence[StuckThread]) -> None:
    click.echo("")
    click.echo("Stuck threads, most overdue first")
    labels = {"lease": "lease lapsed", "release": "release lapsed", "head": "head not released"}
    _echo_lines(
        _table(
            [
                Column("PROBLEM"),
                Column("OVERDUE", right=True),
                Column("WORKER", shrink=1),
                Column("TASK ID"),
                Column("THREAD"),
            ],
            [
                (
                    labels.get(s.kind, s.kind),
                    _duration(s.overdue_for),
                    s.worker,
                    _id(s.task_id or "?"),
                    _id(s.thread_id),
                )
                for s in stuck
            ],
        )
    )
    click.echo("")
    click.echo(textwrap.fill(f"These threads did not move on: {DISPATCHER_HINT}.", _width()))
