"""Every use of a non-public name or format of Celery, kombu, billiard and redis-py, in one place.

Each speed path that reaches into a library's private parts goes through one named :class:`Seam`
here.  A seam is checked once per process, at worker start (:func:`check_worker`, which logs one
line naming the active seams and those fallen back) and at first use elsewhere (:func:`active`):
the private names must exist and behave as the path assumes, on the installed versions (a
behavioural probe where it is cheap).  Where a check fails, the path falls back to the public way
and one warning names the seam and the installed versions; the one seam without a safe fallback
(``utf8-bodies``) stops the worker with an error naming the supported versions.

``CELERY_THREADS_SEAMS_OFF`` (``name,name`` or ``all``) turns seams off by hand: the benchmarks
measure each fast path against its fallback this way, and an operator can take one out of use.
``python -m celery_threads.seams`` prints the table for the installed versions.

The seams (docs/compatibility.md has what each buys, measured):

* ``direct-release`` (kombu): the gate's Lua pushes a release onto the Redis broker's queue as
  kombu's Redis transport would (lua/_common.lua ``publish_direct``).  Fallback: releases are
  published through kombu.
* ``utf8-bodies`` (kombu before 5.4): such a release's text body is marked ``body_encoding:
  utf-8``, which kombu reads from 5.4 on; an older kombu is taught to (``Channel.codecs``).  No
  fallback: a worker that cannot read them refuses to start.
* ``handoff`` (Celery): a prefork pool process wraps ``celery.app.trace.fast_trace_task`` and
  ``trace_task_ret`` and runs the next member of a thread itself, from a request dict built as
  the worker's ``Request`` builds it.  Fallback: the next member goes through the broker.
* ``untracked-releases`` (kombu): kombu's Redis ``QoS.append`` skips releases, ``QoS._delivered``
  tells an untracked delivery, ``QoS.can_consume`` bounds the prefetch, and
  ``Transport._reject_inbound_message`` puts back an unconsumed one.  Fallback: kombu tracks and
  acks releases (``threads_track_releases``).
* ``settle-fetch`` (kombu): at shutdown, the Redis channel's pending BRPOP (``_in_poll``,
  ``_brpop_read``) is settled so that handed-back releases reach other workers.  Fallback: not
  settled (a message that fetch pops is restored by kombu or republished at its release deadline).
* ``revoke-command`` (Celery): ``Panel.data["revoke"]`` is wrapped so that a plain ``revoke`` of a
  waiting member deletes it from its thread.  Fallback: it is dropped when it is released
  (Celery's revoked set, then ``task_revoked``).
* ``request-state`` (Celery): ``Request._already_revoked`` / ``_already_cancelled`` /
  ``_context`` in the main process's ending of a lost member.  Fallback: read as not revoked
  (the gate's token fences the ending anyway), the retry stored without the request's context.
* ``direct-line`` (redis-py): ``Connection._sock`` and ``_parser.parse_error`` for the pool
  processes' EVALSHA/FCALL line (gate.ScriptLine; on a cluster, one to each master:
  gate.cluster.ClusterScriptLine).  Fallback: redis-py's client (on a cluster, its cluster client).
"""

from __future__ import annotations

import inspect
import json
import logging
import os
import socket
import threading
from dataclasses import dataclass
from typing import Any, Callable, Optional

import billiard
import celery
import kombu
import redis

from .errors import SeamRefused
from .logs import get_logger

logger = get_logger(__name__)

#: ``name,name`` or ``all``: seams turned off by hand (benchmarks, operators).
OFF_ENV = "CELERY_THREADS_SEAMS_OFF"


def versions() -> str:
    return (
        f"celery {celery.__version__}, kombu {kombu.__version__}, "
        f"billiard {billiard.__version__}, redis-py {redis.__version__}"
    )


@dataclass(frozen=True)
class Seam:
    """A private name or format a fast path relies on."""

    name: str
    library: str
    uses: str  # the private names, as a reader looks them up
    check: Callable[[Any], Optional[str]]  # (app or None) -> None when it holds, else what not
    fallback: str  # the public path taken instead; "" when none


_results: dict[str, Optional[str]] = {}
_lock = threading.Lock()


def forced_off() -> set[str]:
    """The seams ``CELERY_THREADS_SEAMS_OFF`` names (never one without a fallback: turning
    ``utf8-bodies`` off would only make an old kombu's worker die on the gate's messages)."""
    names = {n.strip() for n in os.environ.get(OFF_ENV, "").split(",") if n.strip()}
    if "all" in names:
        names = set(SEAMS)
    return {n for n in names if n in SEAMS and SEAMS[n].fallback}


def active(name: str) -> bool:
    """Whether seam ``name`` holds on the installed versions and is not turned off (checked once
    per process; a failed check warns once and the caller takes the public path)."""
    return problem(name) is None


def problem(name: str, app: Any = None) -> Optional[str]:
    """Why seam ``name`` is not in use in this process, or ``None`` when it is (``app``: the
    worker's, for the checks that probe its servers)."""
    if name in _results:
        return _results[name]
    with _lock:
        if name in _results:
            return _results[name]
        seam = SEAMS[name]
        if name in forced_off():
            why: Optional[str] = f"turned off ({OFF_ENV})"
            logger.info("celery-threads: seam %s turned off by %s; %s", name, OFF_ENV, seam.fallback)
        else:
            try:
                why = seam.check(app)
            except Exception as exc:  # a check that cannot even run: the seam does not hold
                why = f"{type(exc).__name__}: {exc}"
            if why is not None:
                if not seam.fallback:
                    raise SeamRefused(_refusal(seam, why))
                logger.warning(
                    "celery-threads: %s (%s) does not hold on %s: %s. Falling back: %s.",
                    seam.name,
                    seam.uses,
                    versions(),
                    why,
                    seam.fallback,
                )
        _results[name] = why
        return why


def _refusal(seam: Seam, why: str) -> str:
    return (
        f"celery-threads: {seam.name} ({seam.uses}) does not hold on {versions()}: {why}. "
        f"Supported: celery 5.3.6+, kombu 5.3.7+ (5.4+ reads these messages natively), "
        f"redis-py 5.0.8+, as tested by the matrix in docs/compatibility.md."
    )


def report() -> dict[str, Optional[str]]:
    """``{seam: None (active) or why it is not}`` for every seam, checking those not yet checked
    (a refusing seam reports its error instead of raising)."""
    out: dict[str, Optional[str]] = {}
    for name in SEAMS:
        try:
            out[name] = problem(name)
        except SeamRefused as exc:
            out[name] = str(exc)
    return out


_gate_client: Any = None  # the worker's gate client, for the direct-line check (check_worker)


def check_worker(app: Any, gate_client: Any = None) -> int:
    """At worker start: every seam, once; one line naming the active ones and those fallen back.
    :class:`SeamRefused` when one without a fallback does not hold (a Redis broker only for
    ``utf8-bodies``: other brokers never carry the gate's own messages).  ``gate_client``: the
    worker's gate client (a connection of its is probed for the direct line; ``None`` when the
    gate did not answer: the line is then judged at first use).  Returns how many fell back."""
    global _gate_client
    _gate_client = gate_client
    names = [n for n in SEAMS if n != "utf8-bodies" or _redis_broker(app)]
    found = {name: problem(name, app) for name in names}
    on = [n for n, why in found.items() if why is None]
    off = [f"{n} ({why})" for n, why in found.items() if why is not None]
    # A detail for maintainers while every seam holds; a warning when one fell back (the worker
    # then says so in its ready line too).
    logger.log(
        logging.WARNING if off else logging.DEBUG,
        "celery-threads: private seams on %s: active: %s; fallen back: %s",
        versions(),
        ", ".join(on) or "none",
        "; ".join(off) or "none",
    )
    return len(off)


def _redis_broker(app: Any) -> bool:
    try:
        conn = app.connection_for_write()
    except Exception:
        return False
    conn.release()
    return conn.transport_cls in ("redis", "rediss")


# -- utf8-bodies: kombu before 5.4 reading body_encoding utf-8 ---------------------------------
class _Utf8Codec:
    """kombu 5.4's reading of ``body_encoding: utf-8``: the body is already the text."""

    def encode(self, s: Any) -> Any:
        return s

    def decode(self, s: Any) -> Any:
        return s


def _check_utf8_bodies(app: Any = None) -> Optional[str]:
    """kombu 5.4+ reads ``utf-8`` bodies as text; before, its virtual ``Channel.codecs`` (which
    holds only ``base64``) is taught to, so a worker that fetches a release the gate pushed does
    not die on it (``'NoneType' object has no attribute 'decode'``) and lose it."""
    from kombu.transport.virtual.base import Channel

    if tuple(kombu.VERSION[:2]) < (5, 4):
        codecs = getattr(Channel, "codecs", None)
        if not isinstance(codecs, dict):
            return "kombu.transport.virtual.Channel has no codecs dict"
        codecs.setdefault("utf-8", _Utf8Codec())
    return _decodes_like_lua(utf8=True)


def _decodes_like_lua(utf8: bool) -> Optional[str]:
    """Build a message as ``publish_direct`` does and read it back through kombu's virtual
    transport (``Message`` and ``Channel.decode_body``, as the Redis transport's consumer does)."""
    from kombu.transport.virtual import base

    Channel: Any = base.Channel
    Message: Any = base.Message
    body = '{"x": "é"}'
    raw = json.loads(lua_message(body, utf8=utf8))

    class _Reader:  # the parts of a virtual Channel that reading a message touches
        codecs = Channel.codecs
        decode_body = Channel.decode_body

    message: Any = Message(raw, channel=_Reader())
    if message.body not in (body, body.encode()):
        return f"a body_encoding {'utf-8' if utf8 else 'base64'} message read as {message.body!r}"
    if message.delivery_tag != "seq:1:2" or message.headers.get("thread_token") != "1":
        return "a message built as the gate's Lua builds it lost its delivery tag or headers"
    if message.delivery_info.get("routing_key") != "q" or message.content_type != "application/json":
        return "a message built as the gate's Lua builds it lost its routing key or content type"
    return None


def lua_message(body: str, utf8: bool) -> str:
    """A message laid out exactly as lua/_common.lua ``publish_direct`` lays it out (the test of
    this seam compares the two, byte layout and keys)."""
    import base64

    encoded = json.dumps(body) if utf8 else '"' + base64.b64encode(body.encode()).decode() + '"'
    props = {
        "correlation_id": "i",
        "reply_to": "r",
        "delivery_mode": 2,
        "delivery_info": {"exchange": "", "routing_key": "q"},
        "priority": 0,
        "delivery_tag": "seq:1:2",
        "body_encoding": "utf-8" if utf8 else "base64",
    }
    return (
        '{"body":' + encoded + ',"content-encoding":"utf-8","content-type":'
        '"application/json","headers":{"task":"t","id":"i","retries":0,"eta":null,'
        '"thread_id":"th","thread_token":"1"},"properties":' + json.dumps(props) + "}"
    )


# -- direct-release: kombu's Redis message format, built in Lua ---------------------------------
def _check_direct_release(app: Any = None) -> Optional[str]:
    try:
        import kombu.transport.redis  # noqa: F401
    except ImportError as exc:
        return f"no kombu Redis transport ({exc})"
    # Producers publish what workers read: a worker's kombu must read both bodies.
    return _decodes_like_lua(utf8=False)


# -- handoff: the pool job's trace functions, looked up by name ----------------------------------
_TRACE_PARAMETERS = ["uuid", "request", "body", "content_type", "content_encoding"]


def _check_handoff(app: Any = None) -> Optional[str]:
    import pickle

    from celery.app import trace
    from celery.worker import request as worker_request

    for name in ("fast_trace_task", "trace_task_ret"):
        function = getattr(trace, name, None)
        if not callable(function):
            return f"celery.app.trace.{name} is missing"
        if getattr(function, "_celery_threads", False):
            continue  # this process wrapped it already (a pool process after its start)
        # The worker's Request sends the pool this function; the pool process finds it by name.
        if getattr(worker_request, name, None) is not function:
            return f"celery.worker.request no longer sends celery.app.trace.{name} to the pool"
        if pickle.loads(pickle.dumps(function)) is not function:
            return f"celery.app.trace.{name} does not travel to the pool by name"
        parameters = list(inspect.signature(function).parameters)[1:6]
        if parameters != _TRACE_PARAMETERS:
            return f"celery.app.trace.{name} takes {parameters}, not {_TRACE_PARAMETERS}"
    return None


def trace_functions() -> list[tuple[str, Callable[..., Any]]]:
    """``(name, function)`` of the two functions a pool job runs (``handoff`` seam)."""
    from celery.app import trace

    return [(name, getattr(trace, name)) for name in ("fast_trace_task", "trace_task_ret")]


def wrap_trace_function(name: str, wrapper: Callable[..., Any]) -> None:
    from celery.app import trace

    setattr(trace, name, wrapper)


def pool_hostname(default: Any) -> Any:
    """The node name the pool process's tracer uses (Celery keeps it in ``trace._localized``)."""
    from celery.app import trace

    localized = getattr(trace, "_localized", None)
    if isinstance(localized, (list, tuple)) and len(localized) > 2:
        return localized[2]
    return default


# -- untracked-releases: kombu's Redis QoS ------------------------------------------------------
def _check_untracked_releases(app: Any = None) -> Optional[str]:
    from kombu.transport import redis as kombu_redis

    QoS: Any = kombu_redis.QoS
    Transport: Any = kombu_redis.Transport
    append = vars(QoS).get("append")
    if not callable(append) or list(inspect.signature(append).parameters) != [
        "self",
        "message",
        "delivery_tag",
    ]:
        return "kombu.transport.redis.QoS.append(message, delivery_tag) is missing or changed"
    if not callable(getattr(Transport, "_reject_inbound_message", None)):
        return "kombu's virtual Transport._reject_inbound_message is missing"
    qos: Any = QoS(_ChannelStub(), prefetch_count=2)
    if not isinstance(getattr(qos, "_delivered", None), dict):
        return "kombu's virtual QoS._delivered is not a dict of the deliveries it tracks"
    if qos.can_consume() is not True:
        return "kombu's virtual QoS.can_consume() does not answer True with nothing delivered"
    return None


class _ChannelStub:
    """What constructing a QoS reads of its channel."""

    connection = None
    do_restore = False  # the QoS's restore at exit does nothing


def qos_delivered(qos: Any) -> Any:
    """The deliveries a virtual QoS tracks (``_delivered``), or ``None``."""
    return getattr(qos, "_delivered", None) if active("untracked-releases") else None


def reject_inbound_hook(transport: Any) -> tuple[Callable[..., Any], Callable[[Any], None]]:
    """``(kombu's _reject_inbound_message of transport, a setter for its replacement)``."""

    def install(replacement: Any) -> None:
        transport._reject_inbound_message = replacement

    return transport._reject_inbound_message, install


# -- settle-fetch: the Redis channel's pending BRPOP --------------------------------------------
def _check_settle_fetch(app: Any = None) -> Optional[str]:
    from kombu.transport.redis import Channel

    if not callable(getattr(Channel, "_brpop_read", None)) or not hasattr(Channel, "_in_poll"):
        return "kombu.transport.redis.Channel._brpop_read/_in_poll are missing"
    return None


def settle_fetch(channel: Any) -> None:
    """Read the reply of the BRPOP the Redis channel has outstanding, if any."""
    if active("settle-fetch") and getattr(channel, "_in_poll", None) and hasattr(channel, "_brpop_read"):
        channel._brpop_read()


# -- revoke-command: Celery's remote-control revoke ---------------------------------------------
def _check_revoke_command(app: Any = None) -> Optional[str]:
    from celery.worker.control import Panel

    data = getattr(Panel, "data", None)
    revoke = data.get("revoke") if isinstance(data, dict) else None
    if not callable(revoke):
        return "celery.worker.control.Panel.data['revoke'] is missing"
    parameters = list(inspect.signature(revoke).parameters)
    if parameters[:4] != ["state", "task_id", "terminate", "signal"]:
        return f"Panel.data['revoke'] takes {parameters}"
    return None


def revoke_command() -> tuple[Callable[..., Any], Callable[[Any], None]]:
    """``(Celery's revoke command, a setter for its replacement)``.  The replacement serves the
    ``terminate`` command too (``celery control terminate``), which Celery's own calls its
    module's ``revoke`` function directly, past the registry."""
    from celery.worker.control import Panel

    def install(replacement: Any) -> None:
        Panel.data["revoke"] = replacement
        if "terminate" in Panel.data:

            def terminate(state: Any, signal: Any, task_id: Any, **kwargs: Any) -> Any:
                return replacement(state, task_id, terminate=True, signal=signal)

            terminate.__doc__ = Panel.data["terminate"].__doc__
            Panel.data["terminate"] = terminate

    return Panel.data["revoke"], install


# -- request-state: a worker Request's revoked flags and context --------------------------------
def _check_request_state(app: Any = None) -> Optional[str]:
    from celery.worker.request import Request

    for name in ("_already_revoked", "_already_cancelled"):
        if not isinstance(getattr(Request, name, None), bool):
            return f"celery.worker.request.Request.{name} is missing"
    if "_context" not in dir(Request):
        return "celery.worker.request.Request._context is missing"
    return None


def request_revoked(request: Any) -> bool:
    """Whether Celery revoked or cancelled this request already."""
    if not active("request-state"):
        return False
    return bool(request._already_revoked or request._already_cancelled)


def request_context(request: Any) -> Any:
    return request._context if active("request-state") else None


# -- direct-line: a redis-py connection's socket and error parser --------------------------------
def _check_direct_line(app: Any = None) -> Optional[str]:
    connection_class: Any = redis.Connection
    conn = connection_class()
    parser: Any = getattr(conn, "_parser", None)
    if not callable(getattr(parser, "parse_error", None)):
        return "redis.Connection._parser.parse_error is missing"
    if not isinstance(parser.parse_error("NOSCRIPT No matching script."), redis.exceptions.NoScriptError):
        return "redis.Connection._parser.parse_error no longer names a NOSCRIPT error"
    if app is not None and _gate_client is not None:  # a worker: its gate's socket is plain
        pool = _gate_pool(_gate_client)
        conn = pool.connection_class(**pool.connection_kwargs)
        try:
            conn.connect()
            sock = getattr(conn, "_sock", None)
        except redis.RedisError:
            return None  # the gate is away: judged at first use (connection_socket)
        finally:
            conn.disconnect()
        if not isinstance(sock, socket.socket):
            return f"redis.Connection._sock is a {type(sock).__name__}, not a socket"
    return None


def _gate_pool(client: Any) -> Any:
    """The connection pool of the gate's server; on a Redis Cluster, of one master's (the line
    connects to each master the same way)."""
    if hasattr(client, "get_default_node"):
        return client.get_redis_connection(client.get_default_node()).connection_pool
    return client.connection_pool


def connection_socket(conn: Any) -> Optional[socket.socket]:
    """The socket of a connected redis-py connection, or ``None`` (the caller uses the client)
    when it is not a plain socket (the seam changed) or the seam is off."""
    sock = getattr(conn, "_sock", None)
    if not active("direct-line"):
        return None
    if not isinstance(sock, socket.socket):
        _fall_back("direct-line", f"redis.Connection._sock is a {type(sock).__name__}, not a socket")
        return None
    return sock


def _fall_back(name: str, why: str) -> None:
    """A seam found not to hold at use, after its check passed: warned once, off from now on."""
    with _lock:
        if _results.get(name) is None:
            _results[name] = why
            logger.warning(
                "celery-threads: %s (%s) does not hold on %s: %s. Falling back: %s.",
                name,
                SEAMS[name].uses,
                versions(),
                why,
                SEAMS[name].fallback,
            )


def parse_error(conn: Any, message: str) -> Exception:
    """redis-py's exception for an error reply."""
    error: Exception = conn._parser.parse_error(message)
    return error


SEAMS: dict[str, Seam] = {
    s.name: s
    for s in (
        Seam(
            "direct-release",
            "kombu",
            "kombu's Redis message format built in lua/_common.lua",
            _check_direct_release,
            "releases are published through kombu",
        ),
        Seam(
            "utf8-bodies",
            "kombu",
            "kombu.transport.virtual.Channel.codecs (kombu < 5.4)",
            _check_utf8_bodies,
            "",
        ),
        Seam(
            "handoff",
            "celery",
            "celery.app.trace.fast_trace_task/trace_task_ret by name, "
            "the worker Request's request dict, trace._localized",
            _check_handoff,
            "the next member of a thread goes through the broker",
        ),
        Seam(
            "untracked-releases",
            "kombu",
            "kombu.transport.redis.QoS.append/_delivered/can_consume, Transport._reject_inbound_message",
            _check_untracked_releases,
            "kombu tracks and acks releases (threads_track_releases)",
        ),
        Seam(
            "settle-fetch",
            "kombu",
            "kombu.transport.redis.Channel._in_poll/_brpop_read",
            _check_settle_fetch,
            "a fetch pending at shutdown is left to kombu",
        ),
        Seam(
            "revoke-command",
            "celery",
            "celery.worker.control.Panel.data['revoke']",
            _check_revoke_command,
            "a revoked waiting member is dropped when it is released",
        ),
        Seam(
            "request-state",
            "celery",
            "celery.worker.request.Request._already_revoked/_already_cancelled/_context",
            _check_request_state,
            "a lost member's ending is fenced by its token alone",
        ),
        Seam(
            "direct-line",
            "redis-py",
            "redis.Connection._sock/_parser",
            _check_direct_line,
            "gate calls go through redis-py's client",
        ),
    )
}


def pool_process_index() -> Optional[int]:
    """This prefork pool process's number (0 to concurrency - 1), or ``None``.  Billiard's pool
    sets ``index`` on each process it starts (``billiard.pool``: ``w.index = i``), undocumented:
    the slots the lease watchdog and the handoff share with the main process are found by it.
    Without it a pool process takes no slot, and the watchdog cannot stop its member (as under the
    threads pool: the worker logs an error instead); tests/project/test_seams.py checks that billiard still
    numbers its processes."""
    from billiard.process import current_process

    index = getattr(current_process(), "index", None)
    return index if isinstance(index, int) else None


def forget_app_connections(app: Any) -> None:
    """Drop Celery's cached broker connection pool, producer pool and routing table of ``app``
    (``app._pool``, ``app.amqp._producer_pool``, ``app.amqp._rtable``: private, Celery has no
    public way), so that the next use builds them from ``app.conf`` again.  Only
    :func:`celery_threads.runtime.reset` uses it, for tools and tests that point one app at
    another broker; no worker or producer path does."""
    app._pool = None
    app.amqp._producer_pool = None
    app.amqp._rtable = None


def health_check_interval(wanted: int) -> int:
    """``wanted``, or 0 (no health checks) on redis-py before 6 (a version switch, not a seam).

    redis-py 5's health check reconnects through ``on_connect``, whose first command checks health
    again on the fresh connection: against a server (or a proxy) that accepts connections and
    closes them at once, that recurses until ``RecursionError``, which escapes the client's retries
    and fails the call (redis-py 6 reconnects without the check).  Without health checks a dead
    idle connection fails its next command instead, which the gate's client retries.
    """
    major = int(redis.__version__.split(".")[0])
    return wanted if major >= 6 else 0


def main() -> int:
    """``python -m celery_threads.seams``: each seam on the installed versions."""
    logging.basicConfig(level=logging.ERROR)
    print(versions())
    for name, why in report().items():
        print(f"  {name:<20} {'active' if why is None else 'off: ' + why}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
