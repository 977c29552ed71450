"""The gate: the Redis side of celery-threads, the single source of truth.

Each transition is one atomic Lua script (``lua/*.lua``, sharing ``lua/_common.lua``).  This module
only names the transitions and turns their replies into Python values; it never publishes to the
broker (see :mod:`celery_threads.publish`) and never decides policy (see the task and worker modules).
"""
from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import secrets
import threading
import time
import uuid
from dataclasses import dataclass
from enum import IntEnum
from importlib import resources
from typing import Any, Callable, Iterator, NamedTuple, Optional, Sequence

import redis
from redis.backoff import ExponentialBackoff
from redis.commands.core import Script
from redis.retry import Retry

from . import cluster
from . import seams
from .errors import ConfigurationError, NotReplicated
from .keys import Keys, ShardKeys, ThreadKeys
from .redis_options import checked, client_kwargs
from .seams import health_check_interval
from .sentinel import is_sentinel_url, master_client

logger = logging.getLogger(__name__)

SCRIPT_NAMES = ("enqueue", "release", "claim", "renew", "finish", "requeue", "kill", "delete",
                "expire", "fail", "restart", "handback")
DEAD_CHUNK = 500           # dead records read per HMGET
MAX_REPUBLISH_BACKOFF = 6  # a lost release is republished after 1, 2, 4, ... 64 release timeouts



# Each script's reply status, named (the Lua scripts' headers say when each is returned).
class Done(IntEnum):
    """enqueue, release, finish, requeue (and replace), kill, delete: whether it happened."""
    NOOP = 0
    DONE = 1


class Claim(IntEnum):
    """claim: the release no longer holds its thread, or it is now the caller's, or another
    delivery's."""
    STALE = 0
    CLAIMED = 1
    ALREADY_CLAIMED = 2


class Renewal(IntEnum):
    """renew: the token no longer holds the thread, or the lease (release deadline) is renewed,
    or the member is claimed by another delivery (or its claim is gone)."""
    STALE = 0
    RENEWED = 1
    NOT_YOURS = 2


class Lapse(IntEnum):
    """expire, fail, handback: what became of an active member whose release or lease lapsed, or
    whose attempt failed: nothing, published again under its token, re-entered for a retry, or
    dead."""
    NOOP = 0
    REPUBLISH = 2
    RETRIED = 3
    DIED = 4


class Restart(IntEnum):
    """restart: not in the dead-letter store, back in its thread, or a member again already."""
    UNKNOWN = 0
    RESTARTED = 1
    ALREADY_MEMBER = 2


#: The statuses each script replies with (``Done`` for the others).
REPLIES: dict[str, type[IntEnum]] = {"claim": Claim, "renew": Renewal, "expire": Lapse,
                                     "fail": Lapse, "handback": Lapse, "restart": Restart}
# The names callers use most.
DONE, NOOP = Done.DONE, Done.NOOP
CLAIMED, ALREADY_CLAIMED, STALE = Claim.CLAIMED, Claim.ALREADY_CLAIMED, Claim.STALE
RENEWED, NOT_YOURS = Renewal.RENEWED, Renewal.NOT_YOURS
REPUBLISH, RETRIED, DIED = Lapse.REPUBLISH, Lapse.RETRIED, Lapse.DIED
#: delete's info when a replayed call finds the member already gone (it may have been RUNNING).
ENDED = "ENDED"


def _load_lua(name: str) -> str:
    return resources.files("celery_threads").joinpath("lua").joinpath(name).read_text(encoding="utf-8")


def _prelude() -> str:
    return "\n".join(_load_lua(f"{part}.lua") for part in ("_clock", "_member", "_common"))


def script_sources() -> dict[str, str]:
    """Each transition's full source: the clock, the shared prelude, the call's context, then its
    own body."""
    common = _prelude()
    return {name: f"{common}\nbegin(KEYS, ARGV)\n{_load_lua(f'{name}.lua')}"
            for name in SCRIPT_NAMES}


class Library(NamedTuple):
    """The transitions as one Redis function library (Redis 7+): ``FCALL <functions[name]>``
    runs the same body as ``EVALSHA`` of ``script_sources()[name]``, without defining the
    prelude's functions again on every call (most of a script call's cost in Redis)."""

    name: str
    source: str
    functions: dict[str, str]


@functools.lru_cache(maxsize=None)
def function_library() -> Library:
    """The library of this version of the transitions (built once per process).  Its name
    carries a digest of its source, so processes running different versions against one Redis
    each call their own."""
    common = _prelude().replace(
        "if redis.replicate_commands then pcall(redis.replicate_commands) end", "")
    bodies = {name: _load_lua(f"{name}.lua") for name in SCRIPT_NAMES}
    digest = hashlib.sha1("\0".join([common, *bodies.values()]).encode()).hexdigest()[:12]
    lib = f"celery_threads_{digest}"
    functions = {name: f"{lib}_{name}" for name in SCRIPT_NAMES}
    registered = "".join(
        f"\nredis.register_function('{functions[name]}', function(KEYS, ARGV)\n"
        f"begin(KEYS, ARGV)\n{body}\nend)\n" for name, body in bodies.items())
    return Library(lib, f"#!lua name={lib}\n{common}\n{registered}", functions)


@dataclass(frozen=True)
class Release:
    """A member the gate has just released: publish its envelope with this fencing token (unless
    the script has already published it: then ``published`` is true and ``envelope`` empty)."""

    thread_id: str
    task_id: str
    token: str
    retries: int
    envelope: bytes
    published: bool = False   # the gate published it itself (Gate(direct=...)); nothing to send


@dataclass(frozen=True)
class Outcome:
    status: int         # the script's status, as its enum (:data:`REPLIES`)
    info: str
    release: Optional[Release]

    @property
    def done(self) -> bool:
        return self.status == DONE


def task_field(task_id: str) -> tuple[bytes, Optional[bytes]]:
    """A member's short field in the shard's tasks hash (``task_field`` in lua/_member.lua), and for
    a UUID the two bytes its record keeps: a lowercase UUID as its first 14 bytes, another id as
    written when shorter than 14 bytes, else behind ``\\1``."""
    if len(task_id) == 36 and task_id == task_id.lower():
        try:
            parsed = uuid.UUID(task_id)
        except ValueError:
            parsed = None
        if parsed is not None and str(parsed) == task_id:
            return parsed.bytes[:14], parsed.bytes[14:]
    raw = task_id.encode()
    return (raw if len(raw) < 14 else b"\x01" + raw), None


def find_record(client: Any, tasks_key: str, task_id: str) -> tuple[Optional[bytes], Optional[bytes]]:
    """``(field, record)`` of a member, or ``(None, None)`` (``find_member`` in lua/_member.lua):
    a UUID whose first 14 bytes another member held when it arrived is keyed by its long form."""
    field, tail = task_field(task_id)
    fields = [field] if tail is None else [field, b"\x01" + task_id.encode()]
    found = client.hmget(tasks_key, fields)
    for field, record in zip(fields, found):
        if record is not None and (len(field) != 14 or record[1:3] == tail):
            return field, record
    return None, None


def record_task(field: bytes, record: bytes) -> str:
    """The task id a tasks-hash field names (a 14-byte field's record holds the id's last bytes)."""
    if len(field) == 14:
        return str(uuid.UUID(bytes=field + record[1:3]))
    return (field if len(field) < 14 else field[1:]).decode()


def member_field(member: Any) -> bytes:
    """The tasks-hash field in a thread queue's member (``queue_member`` in lua/_member.lua): a
    length byte, the seq big-endian, then the field."""
    raw = member if isinstance(member, bytes) else str(member).encode()
    return raw[raw[0] + 1:]


class Record(NamedTuple):
    """A member's record: its value in the shard's tasks hash (see ``make_record`` in Lua)."""

    seq: int                # arrival order (the shard counter)
    retries: int
    max_retries: int        # -1: unlimited
    retry_delay_ms: int
    thread_id: str
    envelope: bytes


def parse_record(record: bytes) -> Record:
    """``[\\2 <two bytes>]seq|retries|max_retries|retry_delay_ms|<length of thread id>\\n<thread id>
    <envelope>`` (the two bytes: the end of a UUID keyed by its first 14, see ``task_field``)."""
    if record[:1] == b"\x02":
        record = record[3:]
    header, _, rest = record.partition(b"\n")
    seq, retries, max_retries, delay, tlen = (int(x) for x in header.split(b"|"))
    return Record(seq, retries, max_retries, delay, rest[:tlen].decode(), rest[tlen:])


#: How long a gate call waits for Redis to accept a connection, or to answer, before it counts as
#: failed (and is retried): no call waits forever on a link that went silent.
SOCKET_TIMEOUT = 5.0
#: A call's retries give up this long after its first failure: the last replay of a call is sent
#: at most this plus ``SOCKET_TIMEOUT`` after the call, within the gate's ENDED_WINDOW (30 s,
#: lua/_common.lua) of remembering what ended.
RETRY_BUDGET = 15.0


def wait_timeout_ms(keepalive_ms: int) -> int:
    """How long a transition's ``WAIT`` (``threads_wait_replicas``) waits for the replicas: a
    tenth of the keepalive, within 0.1 to 1 s.  A replica on a working link confirms in about a
    millisecond, so the bound only matters when one lags or is gone; then every call waits it out,
    and it must stay well inside the lease that a claim's caller starts counting before it sends
    the claim (celery_threads.lease), and below ``SOCKET_TIMEOUT``."""
    return int(min(1000, max(100, keepalive_ms // 10)))


class BoundedRetry(Retry):
    """redis-py's :class:`~redis.retry.Retry`, which also gives up ``budget`` seconds after a
    call's first failure (attempts on a silent link each wait ``SOCKET_TIMEOUT``)."""

    def __init__(self, backoff: Any, retries: int, budget: float) -> None:
        super().__init__(backoff, retries)
        self.budget = budget

    def call_with_retry(  # its signature varies across redis-py 5-8: the rest passes through
            self, do: Callable[[], Any], fail: Callable[..., Any], *args: Any,
            **kwargs: Any) -> Any:
        started: list[float] = []

        def fail_within_budget(error: Any, *count: Any) -> Any:
            if not started:
                started.append(time.monotonic())
            result = fail(error, *count)
            if time.monotonic() - started[0] > self.budget:
                raise error
            return result

        return super().call_with_retry(do, fail_within_budget, *args, **kwargs)


def make_client(url: str, options: Optional[dict[str, Any]] = None) -> "redis.Redis":
    """A client that rides out short Redis outages: each command is retried with backoff for at
    most ``RETRY_BUDGET`` seconds, and a connection that gives no answer for ``SOCKET_TIMEOUT``
    seconds counts as broken.  ``options``: ``ThreadsConfig.redis_options`` (TLS, timeouts...),
    over these; a URL's query (``?ssl_ca_certs=...``) wins over both, as in redis-py.
    ``cluster: True`` makes it a Redis Cluster client (:mod:`celery_threads.cluster`).

    A script call replayed after its reply was lost gives the reply of the call that ran: each
    transition recognizes its own replay (lua/_common.lua ``replayed``; claim by its claimant).
    """
    kwargs: dict[str, Any] = {
        "retry": BoundedRetry(ExponentialBackoff(cap=1.0, base=0.05), 20, RETRY_BUDGET),
        "retry_on_error": [redis.ConnectionError, redis.TimeoutError],
        "health_check_interval": health_check_interval(30),
        "socket_keepalive": True,
        "socket_timeout": SOCKET_TIMEOUT,
        "socket_connect_timeout": SOCKET_TIMEOUT,
    }
    cluster_mode = bool((options or {}).get("cluster"))
    kwargs.update(client_kwargs(options))
    if cluster_mode:
        return cluster.make_cluster_client(url, kwargs, RETRY_BUDGET)  # type: ignore[return-value]
    if is_sentinel_url(url):
        return master_client(url, kwargs, options)
    return checked(redis.Redis.from_url(url, **kwargs))


@dataclass(frozen=True)
class DirectRelease:
    """Where the scripts push a release's message: kombu's Redis transport on the gate's server.

    ``broker_db`` is the broker's database, ``gate_db`` the gate client's (a script switches to the
    first for the push and back), ``key_prefix`` kombu's ``global_keyprefix`` transport option.
    """

    gate_db: int
    broker_db: int
    key_prefix: str = ""

    def argument(self) -> str:
        return f"{self.gate_db}|{self.broker_db}|{self.key_prefix}"


_MISSED = object()


class DirectLine:
    """The hot path's way to Redis: EVALSHA on a connection each thread keeps for itself.

    redis-py's client layer (pool checkout, retry wrapper, event hooks) costs more CPU per call
    than the call itself (0.125 against 0.055 ms measured here), and every threaded task makes two
    such calls in its pool process.  So does its reply parser, made for every kind of reply: the
    line writes the packed command to the socket and reads the reply with :func:`_parse_reply`
    (a script's reply is an array of integers and bulk strings).  redis-py still makes the
    connection (handshake, AUTH, SELECT, TLS) and names the errors.  Anything unusual (no
    connection yet, a broken one, a script the server does not have) returns ``_MISSED``, and the
    caller goes the client's way, which connects, retries and loads scripts.  Only a reply the
    server sent is returned or raised.  The connection's socket and error parser are redis-py's
    private parts (the ``direct-line`` seam, :mod:`celery_threads.seams`): where they are not as
    assumed, every call goes the client's way.
    """

    def __init__(self, client: "redis.Redis", library: Optional[Library] = None,
                 then: bytes = b"") -> None:
        pool = client.connection_pool
        self._connect: Callable[[], Any] = lambda: pool.connection_class(**pool.connection_kwargs)
        self._local = threading.local()
        self._library = library
        #: a command sent after each call on the same connection (the gate's WAIT): the call
        #: then returns both replies, as a tuple
        self._then = then
        self._usable = True         # false once the seam turned out not to hold: the client's way

    def call(self, command: Callable[[bool], bytes]) -> Any:
        """The reply to ``command(functions)`` (a packed ``FCALL`` of the library's function when
        ``functions`` is true, else ``EVALSHA``), or ``_MISSED``.  The connection is the thread's
        own, outside the client's pool; it closes when the gate (and so this object) is dropped.
        It calls functions when it could load the library when it connected (Redis 7+)."""
        local = self._local
        sock = getattr(local, "sock", None)
        if sock is None or local.pid != os.getpid():
            if not self._usable:
                return _MISSED
            self._open()
            return _MISSED          # this call goes the client's way; the next ones come here
        conn = local.conn           # kept: _drop below forgets it, its parser still names errors
        try:
            sock.sendall(command(local.functions) + self._then)
            data = sock.recv(65536)
            replies: list[Any] = []
            end = 0
            while len(replies) < (2 if self._then else 1):
                try:
                    reply, end = _parse_reply(data, end)
                    replies.append(reply)
                except _Incomplete:
                    more = sock.recv(65536)
                    if not more:    # closed in the middle of a reply (or before it)
                        raise ConnectionError("connection closed by the server") from None
                    data += more
        except OSError:
            self._drop()
            return _MISSED
        if end != len(data):        # never seen: one command at a time on this connection
            self._drop()
        reply = replies[0]
        if self._then and isinstance(replies[1], _ErrorReply):
            self._drop()            # WAIT refused: a replica now (the script only read)
            return _MISSED
        if isinstance(reply, _ErrorReply):
            error = seams.parse_error(conn, reply.message)
            if isinstance(error, redis.exceptions.NoScriptError):
                return _MISSED
            if reply.message.startswith("ERR Function not found"):
                self._drop()        # FUNCTION FLUSH or DELETE: the next connection loads it
                return _MISSED
            # READONLY: the server is a replica now (a Sentinel failover); the client's way
            # finds the master.
            if isinstance(error, (redis.ConnectionError, redis.TimeoutError,
                                  redis.exceptions.ReadOnlyError)):
                self._drop()
                return _MISSED
            raise error
        return (reply, replies[1]) if self._then else reply

    def _open(self) -> None:
        local = self._local
        local.conn, local.sock, local.pid, local.functions = None, None, os.getpid(), False
        conn = self._connect()
        try:
            conn.connect()
            local.functions = self._load_library(conn)
        except (redis.ConnectionError, redis.TimeoutError, OSError):
            conn.disconnect()
            return
        sock = seams.connection_socket(conn)
        if sock is None:
            self._usable = False
            conn.disconnect()
            return
        local.conn, local.sock = conn, sock

    def _load_library(self, conn: Any) -> bool:
        """Whether the server has the library (loaded now, or by another process before, with
        exactly this code: a library is trusted by its code, never by its name alone)."""
        if self._library is None:
            return False
        try:
            conn.send_command("FUNCTION", "LOAD", self._library.source)
            conn.read_response()
        except redis.ResponseError as exc:
            # A Redis before 7 (no FUNCTION command), or one that refuses it (ACL): scripts.
            return "already exists" in str(exc) and _holds_library(conn, self._library)
        return True

    def _drop(self) -> None:
        local = self._local
        conn, local.conn, local.sock = local.conn, None, None
        if conn is not None:
            conn.disconnect()


_foreign_libraries: set[str] = set()    # warned of once per process


def _holds_library(conn: Any, library: Library) -> bool:
    """Whether the library the server has under ``library.name`` holds exactly its code; when it
    does not (loaded by hand, or a digest collision), the caller keeps to ``EVALSHA`` of the
    scripts, which the server keys by their full SHA1."""
    try:
        conn.send_command("FUNCTION", "LIST", "LIBRARYNAME", library.name, "WITHCODE")
        listed = conn.read_response() or []
    except redis.ResponseError:     # refused (ACL): the scripts, as when LOAD is refused
        return False
    for entry in listed:
        fields = entry if isinstance(entry, dict) else dict(zip(entry[::2], entry[1::2]))
        fields = {_text(k): v for k, v in fields.items()}
        if _text(fields.get("library_name", "")) == library.name:
            if _text(fields.get("library_code", "")) == library.source:
                return True
            break
    if library.name not in _foreign_libraries:
        _foreign_libraries.add(library.name)
        logger.warning("celery-threads: the Redis function library %s on the gate's server does "
                       "not hold this version's code; calling the scripts (EVALSHA) instead. "
                       "Remove it (FUNCTION DELETE %s) to use the library.", library.name,
                       library.name)
    return False


class _Incomplete(Exception):
    """The bytes read so far hold part of a reply."""


class _ErrorReply(NamedTuple):
    message: str


def _parse_reply(data: bytes, at: int) -> tuple[Any, int]:
    """One RESP2/RESP3 reply of the kinds a script returns, from ``data[at:]``: ``(value, end)``.
    Bulk strings are bytes, as redis-py returns them without ``decode_responses``."""
    nl = data.find(b"\r\n", at)
    if nl < 0:
        raise _Incomplete
    kind, line, at = data[at], data[at + 1:nl], nl + 2
    if kind == 36:                  # $ bulk string
        n = int(line)
        if n < 0:
            return None, at
        if at + n + 2 > len(data):
            raise _Incomplete
        return data[at:at + n], at + n + 2
    if kind == 42:                  # * array
        n = int(line)
        if n < 0:
            return None, at
        items = []
        for _ in range(n):
            item, at = _parse_reply(data, at)
            items.append(item)
        return items, at
    if kind == 58:                  # : integer
        return int(line), at
    if kind == 43:                  # + status
        return line, at
    if kind == 45:                  # - error
        return _ErrorReply(line.decode("utf-8", "replace")), at
    if kind == 95:                  # _ null (RESP3)
        return None, at
    if kind == 35:                  # # boolean (RESP3)
        return line == b"t", at
    if kind == 44:                  # , double (RESP3)
        return float(line), at
    raise ConnectionError(f"unexpected reply type {chr(kind)!r} from Redis")


def _pack(args: Sequence[Any]) -> bytes:
    """One command in RESP, as redis-py's ``Connection.pack_command`` writes it for these argument
    types (the hot path packs its script calls with :class:`_Packer`)."""
    return b"".join([b"*%d\r\n" % len(args), *(_bulk(_arg(arg)) for arg in args)])


def _bulk(value: bytes) -> bytes:
    return b"$%d\r\n%b\r\n" % (len(value), value)


class _Packer:
    """The hot path's EVALSHA commands for one shard, their constant parts packed once.

    Every script call takes the shard's keys, the thread's two keys, then the server's clock (empty
    here), the thread id, three settings and the script's own arguments; only the thread's parts
    and the own arguments are packed per call.  Gives the bytes redis-py would send for the same
    call (tests/test_wire.py), in a third of the time (cProfile of 15,000 calls: 13 µs per call
    against 41 µs for naming the keys and packing them with :func:`_pack`; client CPU per
    enqueue/claim/finish life 166 against 193 µs).
    """

    _MARK = "\x00thread\x00"

    def __init__(self, shard: ShardKeys, release_timeout_ms: int, direct_arg: str) -> None:
        keys = shard.thread(self._MARK).script_keys()
        # The thread's keys as the parts around its id (the names are keys.py's alone).
        if [i for i, key in enumerate(keys) if self._MARK in key] != [6, 7]:
            raise AssertionError(f"script keys moved; _Packer expects the thread's at 6, 7: {keys}")
        self.queue = [part.encode() for part in keys[6].split(self._MARK)]
        self.active = [part.encode() for part in keys[7].split(self._MARK)]
        self.shard_keys = b"".join(_bulk(key.encode()) for key in keys[:6])
        self.last_key_and_clock = _bulk(keys[8].encode()) + _bulk(b"")
        self.settings = b"".join(_bulk(_arg(v)) for v in (release_timeout_ms,
                                                            shard.wake_channel, direct_arg))
        self.key_count = len(keys)

    def head(self, script: str, command: bytes = b"EVALSHA") -> bytes:
        """``EVALSHA <sha>``, or ``FCALL <function name>``, and the key count."""
        return _bulk(command) + _bulk(script.encode()) + _bulk(b"%d" % self.key_count)

    def pack(self, head: bytes, thread_id: str, args: Sequence[Any]) -> bytes:
        thread = thread_id.encode()
        parts = [b"*%d\r\n" % (3 + self.key_count + 5 + len(args)), head, self.shard_keys,
                 _bulk(self.queue[0] + thread + self.queue[1]),
                 _bulk(self.active[0] + thread + self.active[1]),
                 self.last_key_and_clock, _bulk(thread), self.settings]
        parts.extend(_bulk(_arg(a)) for a in args)
        return b"".join(parts)


def _arg(value: Any) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return repr(value).encode()
    raise redis.DataError(f"invalid script argument {value!r}: use bytes, str, int or float")


class Gate:
    """Transitions of the gate for one Redis client and key prefix.

    ``clock`` returns the time in milliseconds to use instead of the Redis server's ``TIME``; only
    the model-based test sets it.  ``direct`` (a :class:`DirectRelease`) lets the scripts publish
    releases themselves when the broker is kombu's Redis transport on the gate's own server.
    ``functions``: the hot path calls the transitions as the functions of :func:`function_library`
    where the server has them (Redis 7+); false keeps it on ``EVALSHA`` (tests of both ways).
    ``wait_replicas`` (``threads_wait_replicas``): each transition is followed by ``WAIT`` on
    its connection, and one that fewer replicas confirm raises :class:`NotReplicated`.
    """

    def __init__(self, client: "redis.Redis", keys: Keys, *, release_timeout_ms: int,
                 keepalive_ms: int = 30_000, clock: Optional[Callable[[], int]] = None,
                 direct: Optional["DirectRelease"] = None, functions: bool = True,
                 wait_replicas: int = 0) -> None:
        self.client = client
        if wait_replicas > 0 and cluster.is_cluster(client):
            raise ConfigurationError(
                "threads_wait_replicas is not supported on a Redis Cluster (each master has its "
                "own replicas): set it to 0, or point the gate at a single Redis or Sentinel")
        self.wait = (wait_replicas, wait_timeout_ms(keepalive_ms)) if wait_replicas > 0 else None
        self.direct = direct
        self._direct_arg = direct.argument() if direct is not None else ""
        self._keepalive_text = f"{keepalive_ms / 1000:g}s"
        self.keys = keys
        self.release_timeout_ms = release_timeout_ms
        self.clock = clock
        self._scripts: dict[str, Script] = {
            name: client.register_script(source) for name, source in script_sources().items()
        }
        self.library = function_library()
        # A cluster routes each call by its slot: no line of the gate's own (cluster.py).
        self._direct = (None if cluster.is_cluster(client)
                        else DirectLine(client, self.library if functions else None,
                                        _pack(("WAIT", *self.wait)) if self.wait else b""))
        self._functions = (cluster.Functions(client, self.library.source, self.library.functions)
                           if functions and cluster.is_cluster(client) else None)
        self._packers = [_Packer(shard, release_timeout_ms, self._direct_arg)
                         for shard in keys.all_shards()]
        self._heads = {name: self._packers[0].head(script.sha)
                       for name, script in self._scripts.items()}
        self._fcall_heads = {name: self._packers[0].head(function, b"FCALL")
                             for name, function in self.library.functions.items()}
        self._scan = client.register_script(_load_lua("_clock.lua") + "\n" + _load_lua("scan.lua"))
        self._snapshot = client.register_script(_load_lua("_member.lua") + "\n"
                                                + _load_lua("snapshot.lua"))
        self._summaries = client.register_script(_load_lua("_member.lua") + "\n"
                                                 + _load_lua("summaries.lua"))

    # -- plumbing ---------------------------------------------------------------------------
    def _now_arg(self) -> str:
        return "" if self.clock is None else str(int(self.clock()))

    def _arguments(self, thread_id: str, args: Sequence[Any]) -> tuple[list[str], list[Any]]:
        keys = self.keys.thread(thread_id)
        argv = [self._now_arg(), thread_id, self.release_timeout_ms, keys.shard.wake_channel,
                self._direct_arg, *args]
        return keys.script_keys(), argv

    def _command(self, name: str, thread_id: str, args: Sequence[Any],
                 arguments: Optional[tuple[list[str], list[Any]]] = None,
                 functions: bool = False) -> bytes:
        """The packed EVALSHA of a script call (the call :meth:`_run` makes through the client),
        or with ``functions`` the FCALL of the library's function.  With the model's clock,
        ``arguments`` (from :meth:`_arguments`) carry its reading."""
        if self.clock is not None:
            script_keys, argv = arguments or self._arguments(thread_id, args)
            head = (("FCALL", self.library.functions[name]) if functions
                    else ("EVALSHA", self._scripts[name].sha))
            return _pack((*head, len(script_keys), *script_keys, *argv))
        packer = self._packers[self.keys.shard_of(thread_id)]
        return packer.pack((self._fcall_heads if functions else self._heads)[name], thread_id,
                           args)

    def _run(self, name: str, thread_id: str, *args: Any, client: Any = None) -> Any:
        # The clock is read once per call, whichever way the call goes.
        arguments = self._arguments(thread_id, args) if self.clock is not None else None
        if client is None and self._direct is not None:
            reply = self._direct.call(
                lambda functions: self._command(name, thread_id, args, arguments, functions))
            if reply is not _MISSED:
                return self._confirmed(*reply) if self.wait else reply
        # Loads the script when the server does not have it; rides out outages with retries.
        script_keys, argv = arguments or self._arguments(thread_id, args)
        if client is None and self._functions is not None:
            return self._functions.call(name, script_keys, argv, functools.partial(
                self._scripts[name], keys=script_keys, args=argv, client=self.client))
        if client is None and self.wait:    # WAIT on the script's own connection: a pipeline
            pipe = self.client.pipeline(transaction=False)
            self._scripts[name](keys=script_keys, args=argv, client=pipe)
            pipe.wait(*self.wait)
            return self._confirmed(*pipe.execute())
        return self._scripts[name](keys=script_keys, args=argv, client=client or self.client)

    def _confirmed(self, reply: Any, replicas: Any) -> Any:
        """``reply``, once ``WAIT`` said that enough replicas hold the call's writes."""
        assert self.wait is not None
        if int(replicas) < self.wait[0]:
            raise NotReplicated(
                f"{int(replicas)} of the {self.wait[0]} replicas (threads_wait_replicas) "
                f"confirmed a gate transition within {self.wait[1]} ms; it counts as not done")
        return reply

    def _outcome(self, name: str, thread_id: str, reply: Sequence[Any],
                 own: bytes = b"") -> Outcome:
        """``name``'s reply; ``own``: the envelope the call sent, which a reply releasing it
        leaves out."""
        status, info = REPLIES.get(name, Done)(int(reply[0])), _text(reply[1])
        release = None
        if len(reply) > 5:
            published = int(reply[5]) == 1
            release = Release(thread_id, _text(reply[2]), _text(reply[3]), 0,
                              b"" if published else own, published=published)
        elif len(reply) > 2:
            record = parse_record(reply[4])
            release = Release(thread_id, _text(reply[2]), _text(reply[3]), record.retries,
                              record.envelope)
        return Outcome(status, info, release)

    def _call(self, name: str, thread_id: str, *args: Any) -> Outcome:
        return self._outcome(name, thread_id, self._run(name, thread_id, *args))

    # -- transitions --------------------------------------------------------------------------
    def enqueue(self, thread_id: str, task_id: str, envelope: bytes, *, delay_ms: int = 0,
                at_ms: Optional[int] = None, max_retries: Optional[int] = None,
                retry_delay_ms: int = 0, replaced: int = 0) -> Outcome:
        """A new member.  ``replaced``: the ``replaced_task_nesting`` of a replacement
        (``Task.replace``), admitted once although its task id (the replaced task's) ended in the
        last 30 s (lua/enqueue.lua)."""
        mode, value = ("at", at_ms) if at_ms is not None else ("in", max(0, delay_ms))
        extra = (replaced,) if replaced else ()
        return self._outcome("enqueue", thread_id, self._run(
            "enqueue", thread_id, task_id, mode, value, _max_retries(max_retries), retry_delay_ms,
            envelope, *extra), own=envelope)

    def release(self, thread_id: str) -> Outcome:
        return self._call("release", thread_id)

    def claim(self, thread_id: str, task_id: str, token: str, keepalive_ms: int,
              worker: str, claimant: str = "") -> Claim:
        return self.claim_at(thread_id, task_id, token, keepalive_ms, worker, claimant)[0]

    def claim_at(self, thread_id: str, task_id: str, token: str, keepalive_ms: int,
                 worker: str, claimant: str = "") -> tuple[Claim, int]:
        """``claim``'s status, and the Redis server's time of the claim (ms; 0 unless claimed).

        ``claimant``: this delivery's own id; only it renews the lease (:meth:`renew`), and the
        same claimant's claim replayed is answered ``CLAIMED`` with the first claim's time."""
        reply = self._run("claim", thread_id, task_id, token, keepalive_ms, worker, claimant)
        status = Claim(int(reply[0]))
        return status, int(_text(reply[1])) if status == Claim.CLAIMED else 0

    def peek(self, thread_id: str, task_id: str, token: str) -> Optional[str]:
        """The state of (task, token) when it is the thread's active member, else ``None``.

        A plain read (no script): a worker's cheap filter of stale deliveries on receipt.
        """
        task, current, state = self.client.hmget(self.keys.thread(thread_id).active,
                                                  ["task", "token", "state"])
        if task is None or _text(task) != task_id or _text(current) != token:
            return None
        return _text(state)

    def renew(self, thread_id: str, task_id: str, token: str, keepalive_ms: int,
              claimant: str = "") -> Renewal:
        """Renew the lease of a RUNNING member for its ``claimant``, or (no claimant) the release
        deadline of a RELEASED one: ``RENEWED``, ``STALE`` (the token no longer holds the
        thread), or ``NOT_YOURS`` (claimed by another delivery, or the claim is gone)."""
        return Renewal(int(self._run("renew", thread_id, task_id, token, keepalive_ms,
                                     claimant)[0]))

    def renew_many(self, members: Sequence[tuple[str, str, str]],
                   keepalive_ms: int) -> list[Renewal]:
        """Renew the release deadlines of ``(thread_id, task_id, token)`` members a worker holds
        unclaimed, in one round trip; a status per member as :meth:`renew`'s."""
        replies = self._pipeline("renew", [(t, (k, tok, keepalive_ms)) for t, k, tok in members])
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
    def finish(self, thread_id: str, task_id: str, token: str, *,
               keep_release: bool = False,
               claim: Optional[tuple[int, str, str]] = None,
               caller: Optional[str] = None) -> Outcome:
        """The member ended; the next one is released.  ``keep_release``: the release comes back
        to the caller, who runs it (in-process handoff), even where the gate would publish it.
        ``claim`` (with ``keep_release``): ``(keepalive_ms, worker, claimant)``, and the released
        member is also claimed for the caller; the outcome's ``info`` is then the claim's time on
        the Redis server's clock (ms), else empty."""
        if claim is not None and not keep_release:
            raise ValueError("finish(claim=...) needs keep_release=True")
        handoff = ("1", *(claim or ("", "", ""))) if keep_release else ("", "", "", "")
        return self._call("finish", thread_id, task_id, token, *handoff, call_id(caller))

    def requeue(self, thread_id: str, task_id: str, token: str, *, retries: int,
                delay_ms: int = 0, at_ms: Optional[int] = None,
                envelope: bytes = b"", caller: Optional[str] = None) -> Outcome:
        mode, value = ("at", at_ms) if at_ms is not None else ("in", max(0, delay_ms))
        return self._call("requeue", thread_id, task_id, token, mode, value, retries, envelope,
                          "", "", call_id(caller))

    def replace(self, thread_id: str, task_id: str, token: str, envelope: bytes, *,
                at_ms: Optional[int] = None, max_retries: Optional[int] = None,
                retry_delay_ms: int = 0, caller: Optional[str] = None) -> Outcome:
        """The active member's replacement (``Task.replace``, same task id, same thread) takes its
        place: the member re-enters WAITING with the replacement's message and retry settings,
        retries 0, its arrival order and (unless ``at_ms`` is given) its scheduled_at kept."""
        mode, value = ("at", at_ms) if at_ms is not None else ("keep", 0)
        return self._call("requeue", thread_id, task_id, token, mode, value, 0, envelope,
                          _max_retries(max_retries), retry_delay_ms, call_id(caller))

    def kill(self, thread_id: str, task_id: str, token: str, meta: dict[str, Any], *,
             keep: bool = True, caller: Optional[str] = None) -> Outcome:
        meta = {"thread_id": thread_id, **meta}
        return self._call("kill", thread_id, task_id, token, "1" if keep else "0",
                          json.dumps(meta, default=repr), call_id(caller))

    def delete(self, task_id: str, *, token: str = "", only_waiting: bool = False,
               only_released: bool = False, thread_id: Optional[str] = None,
               caller: Optional[str] = None) -> Outcome:
        """Detach a member; pass ``thread_id`` when it is known, to save looking it up.
        ``only_waiting``: only a WAITING member; ``only_released``: only the active member
        RELEASED under ``token`` (not once a worker has claimed it)."""
        thread_id = thread_id or self.thread_of(task_id)
        if thread_id is None:
            return Outcome(NOOP, "", None)
        mode = "1" if only_waiting else "2" if only_released else "0"
        return self._call("delete", thread_id, task_id, token, mode, call_id(caller))

    def expire(self, thread_id: str) -> Outcome:
        return self._call("expire", thread_id, MAX_REPUBLISH_BACKOFF, self._keepalive_text)

    def fail(self, thread_id: str, task_id: str, token: str, reason: str, *,
             caller: Optional[str] = None) -> Outcome:
        """A failed attempt the task itself could not report: retry if retries remain, else die."""
        return self._call("fail", thread_id, task_id, token, reason, call_id(caller))

    def restart(self, task_id: str, *, max_retries: Optional[int] = None,
                retry_delay_ms: int = 0, thread_id: Optional[str] = None) -> Outcome:
        """Re-enter a dead task; pass ``thread_id`` (its dead record's) when it is known."""
        if thread_id is None:
            record = self.dead_record(task_id)
            if record is None:
                return Outcome(NOOP, "", None)
            thread_id = str(record.meta["thread_id"])
        return self._call("restart", thread_id, task_id, _max_retries(max_retries),
                          retry_delay_ms)

    # -- dispatcher reads ---------------------------------------------------------------------
    def now_ms(self) -> int:
        if self.clock is not None:
            return int(self.clock())
        seconds, micros = self.client.time()
        return int(seconds) * 1000 + int(micros) // 1000

    def scan_due(self, shard: ShardKeys, limit: int) -> "Scan":
        """Threads with a due head and threads with a lapsed deadline (at most ``limit`` of each),
        the earliest future entry of either index, and the server's time: one read-only script,
        O(log n + limit)."""
        now, due, lapsed, next_due, next_lease = self._scan(
            keys=[shard.due, shard.leases], args=[self._now_arg(), limit])
        future = [int(float(x)) for x in (next_due, next_lease) if x not in (b"", "")]
        return Scan(now_ms=int(now), due=[_text(t) for t in due],
                    lapsed=[_text(t) for t in lapsed], next_ms=min(future, default=None))

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
        pipe = self.client.pipeline(transaction=False)
        for thread_id, args in calls:
            self._run(name, thread_id, *args, client=pipe)
        if self.wait:
            pipe.wait(*self.wait)
            *replies, replicas = pipe.execute()
            return list(self._confirmed(replies, replicas))
        return _rerun_unrun(pipe.execute(raise_on_error=False),
                            lambda i: self._run(name, calls[i][0], *calls[i][1]))

    # -- inspection ---------------------------------------------------------------------------
    def thread_of(self, task_id: str) -> Optional[str]:
        for shard in self.keys.all_shards():
            _, value = find_record(self.client, shard.tasks, task_id)
            if value is not None:
                return parse_record(value).thread_id
        return None

    def snapshot(self, thread_id: str) -> Optional["ThreadSnapshot"]:
        """A consistent read of one thread (a read-only script: its members' records live in the
        shard's tasks hash, under ids the thread's own keys name)."""
        keys = self.keys.thread(thread_id)
        active, queue, records, due_at = self._snapshot(
            keys=[keys.active, keys.queue, keys.shard.tasks, keys.shard.due], args=[thread_id])
        if not active and not queue:
            return None
        return ThreadSnapshot(
            thread_id=thread_id,
            active={_text(k): _text(v) for k, v in zip(active[::2], active[1::2])},
            waiting=[(_text(t), int(score)) for t, score in zip(queue[::2], queue[1::2])],
            records={_text(t): r for t, r in zip(records[::2], records[1::2])},
            due_at=None if due_at in (b"", "", None) else int(due_at),
        )

    def thread_ids(self) -> Iterator[str]:
        """Every existing thread: each is in exactly one of the due and leases indexes.

        A thread that moves between the two during the scan is yielded once (or, when it moves
        from the index not yet read to the one already read, missed, as with any SCAN).
        """
        seen: set[str] = set()
        for shard in self.keys.all_shards():
            for index in (shard.due, shard.leases):
                for member, _ in self.client.zscan_iter(index):
                    thread_id = _text(member)
                    if thread_id not in seen:
                        seen.add(thread_id)
                        yield thread_id

    def dead_record(self, task_id: str) -> Optional["DeadRecord"]:
        for shard in self.keys.all_shards():
            raw: Optional[bytes] = self.client.hget(shard.dead_records, task_id)  # type: ignore[assignment]
            if raw is not None:
                return DeadRecord.parse(task_id, raw)
        return None

    def dead_records(self, limit: Optional[int] = None) -> list["DeadRecord"]:
        """The dead-letter store, oldest first; with ``limit``, only the ``limit`` latest deaths.
        Records are read ``DEAD_CHUNK`` at a time, so a large store is never one huge reply."""
        records: list[DeadRecord] = []
        for shard in self.keys.all_shards():
            start = -limit if limit is not None else 0
            ids: list[Any] = self.client.zrange(shard.dead, start, -1) if limit != 0 else []
            for at in range(0, len(ids), DEAD_CHUNK):
                chunk = ids[at:at + DEAD_CHUNK]
                raws: list[Any] = self.client.hmget(shard.dead_records, chunk)
                records.extend(DeadRecord.parse(_text(task_id), raw)
                               for task_id, raw in zip(chunk, raws) if raw is not None)
        if self.keys.shards > 1:   # each shard is in death order; merge them by time
            records.sort(key=lambda r: r.died_at_ms)
            if limit is not None:
                records = records[-limit:] if limit else []
        return records

    def dead_count(self) -> int:
        return sum(int(self.client.zcard(shard.dead)) for shard in self.keys.all_shards())

    def note_deleted(self, thread_id: str, task_id: str, ttl: int = 600) -> None:
        self.client.set(self.keys.thread(thread_id).shard.deleted_note(task_id), 1, ex=ttl)

    def take_deleted_note(self, task_id: str) -> bool:
        """True once per note: elects the one worker that announces a deleted member."""
        return any(self.client.getdel(shard.deleted_note(task_id)) is not None
                   for shard in self.keys.all_shards())

    def forget(self, task_id: str) -> bool:
        for shard in self.keys.all_shards():
            pipe = self.client.pipeline(transaction=True)
            pipe.zrem(shard.dead, task_id)
            pipe.hdel(shard.dead_records, task_id)
            if any(pipe.execute()):
                return True
        return False

    # -- health reads (read-only, for Threads' health API and the command line) ---------------
    def thread_summaries(self, thread_ids: Sequence[str]
                         ) -> list[tuple[dict[str, str], int, Optional[tuple[str, int]]]]:
        """For each thread: its active hash, how many members wait, and its head as
        ``(task id, scheduled_at ms)`` (``None`` when none waits); a read-only script per shard
        (a head's task id needs its record), pipelined."""
        if not thread_ids:
            return []
        by_shard: dict[int, list[int]] = {}
        for i, thread_id in enumerate(thread_ids):
            by_shard.setdefault(self.keys.shard_of(thread_id), []).append(i)
        pipe = self.client.pipeline(transaction=False)
        calls: list[list[str]] = []
        for shard, indexes in by_shard.items():
            keys = [self.keys.shard(shard).tasks]
            for i in indexes:
                thread = self.keys.thread(thread_ids[i])
                keys += [thread.active, thread.queue]
            calls.append(keys)
            self._summaries(keys=keys, args=[], client=pipe)
        rows: list[Any] = [None] * len(thread_ids)
        results = _rerun_unrun(pipe.execute(raise_on_error=False),
                               lambda n: self._summaries(keys=calls[n], args=[]))
        for indexes, replies in zip(by_shard.values(), results):
            for i, (active, waiting, head, at) in zip(indexes, replies):
                rows[i] = ({_text(k): _text(v) for k, v in zip(active[::2], active[1::2])},
                           int(waiting), (_text(head), int(at)) if at not in (b"", "") else None)
        return rows

    def overdue(self, shard: ShardKeys, before_ms: int, limit: int
                ) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
        """Threads of ``shard`` whose active member's deadline (leases index), or whose idle head's
        scheduled_at (due index), is at or before ``before_ms``: at most ``limit`` of each, earliest
        first, as ``(thread id, ms)``.  O(log n + limit): never a scan of all threads."""
        pipe = self.client.pipeline(transaction=False)
        pipe.zrangebyscore(shard.leases, "-inf", before_ms, start=0, num=limit, withscores=True)
        pipe.zrangebyscore(shard.due, "-inf", before_ms, start=0, num=limit, withscores=True)
        lapsed, due = pipe.execute()
        return ([(_text(m), int(score)) for m, score in lapsed],
                [(_text(m), int(score)) for m, score in due])

    def index_counts(self, shard: ShardKeys, now_ms: int, overdue_before_ms: int
                     ) -> dict[str, Any]:
        """Sizes of ``shard``'s indexes, each O(1) or O(log n): ``idle`` and ``active`` threads,
        ``members``, ``dead`` tasks, ``lapsed`` deadlines and ``overdue_heads`` at or before
        ``overdue_before_ms``, and ``oldest_due``, the idle thread whose head has been due the
        longest at ``now_ms`` as ``(thread id, scheduled_at ms)`` or ``None``."""
        pipe = self.client.pipeline(transaction=True)
        pipe.zcard(shard.due)
        pipe.zcard(shard.leases)
        pipe.hlen(shard.tasks)
        pipe.zcard(shard.dead)
        pipe.zcount(shard.leases, "-inf", overdue_before_ms)
        pipe.zcount(shard.due, "-inf", overdue_before_ms)
        pipe.zrangebyscore(shard.due, "-inf", now_ms, start=0, num=1, withscores=True)
        idle, active, members, dead, lapsed, overdue_heads, oldest = pipe.execute()
        return {
            "idle": int(idle), "active": int(active), "members": int(members), "dead": int(dead),
            "lapsed": int(lapsed), "overdue_heads": int(overdue_heads),
            "oldest_due": (_text(oldest[0][0]), int(oldest[0][1])) if oldest else None,
        }

    def active_states(self, shard: ShardKeys, batch: int = 1000) -> dict[str, int]:
        """How many active members of ``shard`` are in each state (``RELEASED``, ``RUNNING``).

        O(active threads): the leases index is walked incrementally, each batch's states read in
        one pipelined round trip."""
        counts: dict[str, int] = {}
        pending: list[str] = []
        seen: set[str] = set()  # ZSCAN may return an entry twice while the ZSET is rehashed

        def count(thread_ids: list[str]) -> None:
            pipe = self.client.pipeline(transaction=False)
            for thread_id in thread_ids:
                pipe.hget(self.keys.thread(thread_id).active, "state")
            for state in pipe.execute():
                if state is not None:
                    counts[_text(state)] = counts.get(_text(state), 0) + 1

        for member, _ in self.client.zscan_iter(shard.leases, count=batch):
            thread_id = _text(member)
            if thread_id in seen:
                continue
            seen.add(thread_id)
            pending.append(thread_id)
            if len(pending) >= batch:
                count(pending)
                pending = []
        if pending:
            count(pending)
        return counts


@dataclass(frozen=True)
class Scan:
    now_ms: int
    due: list[str]
    lapsed: list[str]
    next_ms: Optional[int]    # earliest future entry of either index; None when there is none


@dataclass(frozen=True)
class ThreadSnapshot:
    thread_id: str
    active: dict[str, str]
    waiting: list[tuple[str, int]]      # (task id, scheduled_at ms) in release order
    records: dict[str, bytes]
    due_at: Optional[int]


@dataclass(frozen=True)
class DeadRecord:
    task_id: str
    meta: dict[str, Any]
    envelope: bytes
    died_at_ms: int

    @classmethod
    def parse(cls, task_id: str, raw: bytes) -> "DeadRecord":
        """``died_at_ms[|caller] \n meta_json \n envelope`` (the caller: the call that killed
        it, lua/_common.lua ``kill_active``)."""
        died_at, meta, envelope = raw.split(b"\n", 2)
        return cls(task_id, json.loads(meta), envelope, int(died_at.split(b"|", 1)[0]))


def _rerun_unrun(replies: Sequence[Any], rerun: Callable[[int], Any]) -> list[Any]:
    """A pipeline's replies, each call a cluster's master refused unrun (NOSCRIPT from a master
    without the script: a cluster's pipeline does not load scripts; TRYAGAIN while its slot
    moves) run again on its own (``rerun(index)``), which loads the script where needed."""
    results = list(replies)
    for i, reply in enumerate(results):
        if isinstance(reply, Exception):
            if not cluster.not_run(reply):
                raise reply
            results[i] = rerun(i)
    return results


def call_id(caller: Optional[str] = None) -> str:
    """``caller``, or a fresh id for a call that is its own (see ``Gate.finish``)."""
    return caller or secrets.token_hex(8)


def _max_retries(value: Optional[int]) -> int:
    return -1 if value is None else int(value)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
