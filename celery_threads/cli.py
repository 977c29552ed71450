"""``celery -A proj threads ...``: inspect and steer threads and the dead-letter store.

A ``celery.commands`` entry point: Celery loads the app from its own ``-A`` option and hands it to
these commands as ``ctx.obj.app`` (a :class:`celery.bin.base.CLIContext`).  Every command takes
``--json``; ``stats`` exits with :data:`EX_STUCK` when a thread is stuck, and with
:data:`EX_EVICTING` when the gate's Redis may evict waiting members, so it doubles as a health
check.  Times are the gate's Redis server clock, printed in UTC.
"""

from __future__ import annotations

import contextlib
import functools
import heapq
import itertools
import json
import shutil
import sys
import textwrap
from collections.abc import Iterable, Iterator, Sequence
from datetime import datetime
from typing import Any, Callable, Generic, NamedTuple, Optional, TypeVar, cast

import click
import redis
from kombu.utils.url import maybe_sanitize_url

from .admin import DISPATCHER_HINT, NO_REASON, StuckThread, Threads, ThreadSummary
from .config import read_config
from .errors import ConfigurationError, ThreadsError, UnknownTask
from .gate.eviction import Eviction
from .runtime import unreachable

EX_STUCK = 3  # `stats`: at least one thread is stuck
EX_EVICTING = 4  # `stats`: the gate's Redis may evict waiting members (and none is stuck)
EX_UNAVAILABLE = 69  # the gate's Redis cannot be reached (sysexits EX_UNAVAILABLE, as Celery)
EX_CONFIG = 78  # a threads_* setting is wrong (sysexits EX_CONFIG)
DEAD_LIMIT = 100  # `dead`: the latest deaths listed unless --limit says otherwise
PROGRESS_FROM = 1000  # `purge`, `redrive`: a progress bar on a terminal from this many items

F = TypeVar("F", bound=Callable[..., Any])
T = TypeVar("T")


class GateUnreachable(click.ClickException):
    exit_code = EX_UNAVAILABLE


class BadSettings(click.ClickException):
    exit_code = EX_CONFIG


# -- the app, its gate, and errors ------------------------------------------------------------


def _app(ctx: click.Context) -> Any:
    app = getattr(ctx.obj, "app", None)
    if app is None or (
        not app.conf.get("threads_redis_url")
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
    reason = str(exc).rstrip(".") or type(exc).__name__
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
        raise _unreachable(url, problem) from None
    return Threads(_app(ctx))


def _guarded(fn: F) -> F:
    """Turn the errors a command may meet into messages that say what to do (no traceback)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            raise _unreachable(_redis_url(click.get_current_context()), exc) from None
        except ConfigurationError as exc:
            raise BadSettings(str(exc)) from None
        except ThreadsError as exc:
            raise click.ClickException(_message(exc)) from None

    return cast(F, wrapper)


def _message(exc: BaseException) -> str:
    # KeyError subclasses (UnknownTask) would print their message quoted.
    return str(exc.args[0]) if exc.args else type(exc).__name__


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
    cells = [["-" if v is None else str(v) for v in row] for row in rows]
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


@click.group(name="threads")
def threads() -> None:
    """Inspect and steer celery-threads: threads, members, dead letters, health."""


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
                    s.active_task,
                    *([s.paused] if pauses else []),
                    s.thread_id,
                )
                for s in shown
            ],
        )
    )
    if total is None:
        click.echo(f"first {len(shown)} threads shown; more exist (`celery threads stats` counts them)")
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
@json_option
@click.pass_context
@_guarded
def show(ctx: click.Context, thread_id: str, as_json: bool) -> None:
    """Show a thread: active member, waiting members in release order."""
    status = _threads(ctx).status(thread_id)
    if status is None:
        raise click.ClickException(
            f"no thread {thread_id!r}: a thread exists only while it has members or is paused. "
            "`celery threads ls` lists the existing threads."
        )
    if as_json:
        _echo_json({**_jsonable(status), "members": status.members})
        return
    n = status.members
    click.echo(
        f"Thread {status.thread_id}: {n} member{'s' if n != 1 else ''} (Redis time {_when(status.now)})"
    )
    if status.paused is not None:
        click.echo(
            f"PAUSED: {status.paused}. Nothing more of it is released until "
            f"`celery threads resume {status.thread_id}`."
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
            ("task id", a.task_id),
            ("name", a.name or "?"),
            ("state", a.state),
            ("scheduled at", f"{_when(a.scheduled_at)} ({_relative(scheduled_ahead)})"),
            ("active for", f"{_duration(a.active_for)} (released {_when(a.since)})"),
            (lease_label, f"{_when(a.deadline)} ({lease})"),
            ("worker", a.worker),
            ("retries", a.retries),
            ("arguments", a.arguments or "-"),
        ]
        if a.republished:
            pairs.append(("republished", f"{a.republished} time(s): no worker claimed it"))
        if a.stopping:
            pairs.append(("deleted", "its worker is stopping it; the next member starts once it has stopped"))
        click.echo("Active member")
        _echo_lines(_pairs(pairs))
    click.echo("")
    if not status.waiting:
        click.echo("Waiting members: none.")
        return
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
            (i, _when(m.scheduled_at), m.arrival, m.retries, m.task_id)
            for i, m in enumerate(status.waiting, start=1)
        ],
        width,
    )
    click.echo(lines[0])
    for line, m in zip(lines[1:], status.waiting):
        click.echo(line)
        click.echo(_fit(f"    {m.name or '?'} {m.arguments or ''}".rstrip(), width))


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
            "it is in the dead-letter store (see `celery threads forget`)"
            if t.dead_task(task_id) is not None
            else "it may have ended or been deleted already; `celery threads show THREAD_ID` "
            "lists a thread's members"
        )
        raise click.ClickException(f"no thread has a member with task id {task_id!r}: {hint}.")
    if as_json:
        _echo_json({"task_id": task_id, "thread_id": thread_id, "deleted": True})
    else:
        click.echo(f"Deleted member {task_id} of thread {thread_id}.")


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
        f"Paused thread {thread_id}: {reason}{again}.  A member released or running goes "
        f"on to its end; `celery threads resume {thread_id}` releases the rest."
    )


@threads.command()
@click.argument("thread_id")
@json_option
@click.pass_context
@_guarded
def resume(ctx: click.Context, thread_id: str, as_json: bool) -> None:
    """Release a paused thread's members again, its due head at once."""
    if not _threads(ctx).resume(thread_id):
        raise click.ClickException(
            f"thread {thread_id!r} is not paused; `celery threads ls --paused` lists the paused threads."
        )
    if as_json:
        _echo_json({"thread_id": thread_id, "resumed": True})
    else:
        click.echo(f"Resumed thread {thread_id}.")


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
    if as_json:
        _echo_json(tasks)
        return
    if not tasks:
        click.echo("The dead-letter store is empty.")
        return
    width = _width()
    lines = _table(
        [Column("DIED AT"), Column("TASK ID"), Column("THREAD")],
        [(_when(d.died_at), d.task_id, d.thread_id) for d in tasks],
        width,
    )
    click.echo(lines[0])
    for line, d in zip(lines[1:], tasks):
        click.echo(line)
        exception = (d.exception.strip().splitlines() or ["?"])[0]
        retries = f"{d.retries} retr{'y' if d.retries == 1 else 'ies'}"
        click.echo(_fit(f"    {d.name or '?'}, {retries}: {exception}", width))
    total = t.dead_count() if limit and len(tasks) == limit else len(tasks)
    shown = f"the {len(tasks)} latest of " if total > len(tasks) else ""
    click.echo(
        f"{shown}{total} dead task{'s' if total != 1 else ''}; "
        "`celery threads restart TASK_ID` runs one again" + ("; --limit 0 lists them all" if shown else "")
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
        raise UnknownTask(f"{task_id!r} is not in the dead-letter store; `celery threads dead` lists it")
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
        click.echo(f"Restarted {task_id} in thread {thread_id} as a new arrival.")


@threads.command()
@click.argument("task_id", required=False)
@click.option("--all", "forget_all", is_flag=True, help="Forget every dead task.")
@click.option("--yes", "-y", is_flag=True, help="Do not ask for confirmation (with --all).")
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
            raise UnknownTask(f"{task_id!r} is not in the dead-letter store; `celery threads dead` lists it")
        if as_json:
            _echo_json({"forgotten": [task_id]})
        else:
            click.echo(f"Forgot dead task {task_id}.")
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
    "--limit", type=click.IntRange(min=0), default=None, help="Redrive at most this many, oldest death first."
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
    t = _threads(ctx)
    letters = t.redrivable(thread_id, limit)
    if dry_run:
        if as_json:
            _echo_json({"dry_run": True, "would_redrive": letters})
            return
        for d in letters:
            click.echo(f"{_when(d.died_at)}  {d.task_id}  thread {d.thread_id}  {d.name or '?'}")
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
@click.option("--force", "-f", is_flag=True, help="Do not ask for confirmation.")
@json_option
@click.pass_context
@_guarded
def purge(ctx: click.Context, thread_id: Optional[str], force: bool, as_json: bool) -> None:
    """Drop the waiting members of THREAD_ID, or of every thread.

    A released or running member goes on.  Dropped members end as REVOKED in the result
    backend.  Asks first, unless -f.
    """
    t = _threads(ctx)
    waiting = t.waiting_count(thread_id)
    where = f"thread {thread_id}" if thread_id is not None else "every thread"
    if not force:
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
    if as_json:
        _echo_json(
            {
                **_jsonable(numbers),
                "stuck_threads": stuck,
                "eviction": eviction,
                "healthy": not stuck and not evicting,
            }
        )
    else:
        head = numbers.oldest_waiting_head
        waiting = numbers.members["WAITING"]
        if head is not None:
            oldest = f"due {_relative(-head.age)}: {head.task_id or '?'} of thread {head.thread_id}"
        elif waiting:
            oldest = (
                f"none (the {waiting} waiting wait behind an active member of their "
                "thread, or are not due yet)"
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
        raise click.ClickException(
            f"celery threads metrics needs prometheus_client ({exc}): pip install 'celery-threads[metrics]'"
        ) from None
    t = _threads(ctx)
    if once:
        click.echo(exporter.render(t, top), nl=False)
        return
    try:
        server = exporter.listen(t, address, port, top)
    except OSError as exc:
        raise click.ClickException(
            f"cannot listen on {address}:{port}: {exc.strerror or exc}; choose another --port or --address"
        ) from None
    click.echo(f"Serving celery-threads metrics at http://{address}:{port}/metrics", err=True)
    server.join()


def _echo_eviction(eviction: Sequence[Eviction]) -> None:
    for risk in eviction:
        click.echo("")
        click.echo(
            textwrap.fill(f"{risk.level.upper()}: {risk.message.removeprefix('celery-threads: ')}", _width())
        )


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
                    s.task_id or "?",
                    s.thread_id,
                )
                for s in stuck
            ],
        )
    )
    click.echo("")
    click.echo(textwrap.fill(f"These threads did not move on: {DISPATCHER_HINT}.", _width()))
