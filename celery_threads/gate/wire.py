"""The hot path's own line to Redis: packed commands on a pooled connection's socket and a small
reply parser (redis-py's private parts behind :mod:`celery_threads.seams`); anything unusual goes
the client's way.
"""

from __future__ import annotations

import os
import select
import threading
from collections.abc import Sequence
from typing import Any, Callable, NamedTuple, Optional

import redis

from .. import seams
from ..keys import ShardKeys
from ..logs import get_logger
from . import deadline
from .library import Library
from .records import (
    _text,
)

logger = get_logger(__name__)


_MISSED = object()
#: A cluster master's refusals of a call it did not run (the client's way follows them).
_REDIRECTED = (redis.exceptions.AskError, redis.exceptions.TryAgainError, redis.exceptions.ClusterDownError)


class ScriptLine:
    """The hot path's line for the gate's script calls: EVALSHA (or FCALL) on a connection each
    thread keeps for itself.

    redis-py's client layer (pool checkout, retry wrapper, event hooks) costs more CPU per call
    than the call itself (``python -m bench.poolcost`` measures both), and every threaded task makes two
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

    def __init__(self, client: redis.Redis, library: Optional[Library] = None, then: bytes = b"") -> None:
        pool = client.connection_pool
        self._connect: Callable[[], Any] = lambda: pool.connection_class(**pool.connection_kwargs)
        self._local = threading.local()
        self._library = library
        #: a command sent after each call on the same connection (the gate's WAIT): the call
        #: then returns both replies, as a tuple
        self._then = then
        self._usable = True  # false once the seam turned out not to hold: the client's way

    def call(self, command: Callable[[bool], bytes], shard: int = 0) -> Any:
        """The reply to ``command(functions)`` (a packed ``FCALL`` of the library's function when
        ``functions`` is true, else ``EVALSHA``), or ``_MISSED``.  ``shard``: the call's shard
        (one server holds them all here;
        :class:`~celery_threads.gate.cluster.ClusterScriptLine` picks the shard's master by it).
        The connection is the thread's own, outside the client's pool; it closes when the gate
        (and so this object) is dropped.
        It calls functions when it could load the library when it connected (Redis 7+)."""
        local = self._local
        sock = getattr(local, "sock", None)
        if sock is None or local.pid != os.getpid():
            if not self._usable:
                return _MISSED
            self._open()
            return _MISSED  # this call goes the client's way; the next ones come here
        conn = local.conn  # kept: _drop below forgets it, its parser still names errors
        try:
            bound = getattr(conn, "_bound_socket", None)  # the caller's deadline (.deadline)
            if bound is not None:
                bound()
        except redis.TimeoutError:
            return _MISSED  # no time left: the client's way says so
        if _closed(local):
            # The server closed the connection while it was idle (it stopped, or dropped us): a
            # call written now could not run there, so it must not count as one that may have
            # (deadline.note_sent). The client's way reconnects, or fails before sending.
            self._drop()
            return _MISSED
        try:
            packed = command(local.functions)
            extra = deadline.allowance(len(packed))
            if extra and bound is not None:
                bound(extra)  # a large message: Redis takes longer to read it and run the call
            sock.sendall(packed + self._then)
            deadline.note_sent(packed)
            data: Any = sock.recv(65536)
            replies: list[Any] = []
            end = 0
            while len(replies) < (2 if self._then else 1):
                try:
                    reply, end = _parse_reply(data, end)
                    replies.append(reply)
                except _Incomplete:
                    more = sock.recv(1 << 20)
                    if not more:  # closed in the middle of a reply (or before it)
                        raise ConnectionError("connection closed by the server") from None
                    # A bytearray grows in place: bytes joined chunk by chunk took quadratic
                    # time (a 150 MB message held the GIL for minutes, and its lease lapsed).
                    if not isinstance(data, bytearray):
                        data = bytearray(data)
                    data += more
        except (OSError, redis.TimeoutError) as exc:  # a timeout: also no time left for the reply
            deadline.note_failed(exc)
            self._drop()
            return _MISSED
        deadline.note_answered()
        if end != len(data):  # never seen: one command at a time on this connection
            self._drop()
        reply = replies[0]
        if self._then and isinstance(replies[1], _ErrorReply):
            self._drop()  # WAIT refused: a replica now (the script only read)
            return _MISSED
        if isinstance(reply, _ErrorReply):
            error = seams.parse_error(conn, reply.message)
            if isinstance(error, redis.exceptions.NoScriptError):
                return _MISSED
            if reply.message.startswith("ERR Function not found"):
                self._drop()  # FUNCTION FLUSH or DELETE: the next connection loads it
                return _MISSED
            # READONLY: the server is a replica now (a Sentinel failover); the client's way
            # finds the master.
            if isinstance(error, (redis.ConnectionError, redis.TimeoutError, redis.exceptions.ReadOnlyError)):
                self._drop()
                return _MISSED
            # On a cluster: the slot is served elsewhere (MOVED, ASK) or moving (TRYAGAIN,
            # CLUSTERDOWN).  The call did not run; the cluster client follows the redirect.
            if isinstance(error, _REDIRECTED):
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
        local.poll = _poller(sock)

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
        conn, local.conn, local.sock, local.poll = local.conn, None, None, None
        if conn is not None:
            conn.disconnect()


_foreign_libraries: set[str] = set()  # warned of once per process


def _holds_library(conn: Any, library: Library) -> bool:
    """Whether the library the server has under ``library.name`` holds exactly its code; when it
    does not (loaded by hand, or a digest collision), the caller keeps to ``EVALSHA`` of the
    scripts, which the server keys by their full SHA1."""
    try:
        conn.send_command("FUNCTION", "LIST", "LIBRARYNAME", library.name, "WITHCODE")
        listed = conn.read_response() or []
    except redis.ResponseError:  # refused (ACL): the scripts, as when LOAD is refused
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
        logger.warning(
            "celery-threads: the Redis function library %s on the gate's server does "
            "not hold this version's code; calling the scripts (EVALSHA) instead. "
            "Remove it (FUNCTION DELETE %s) to use the library.",
            library.name,
            library.name,
        )
    return False


def _poller(sock: Any) -> Any:
    """A zero-timeout readability check of ``sock`` (``None`` where ``select.poll`` is missing)."""
    if not hasattr(select, "poll"):
        return None
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    return poller


def _closed(local: Any) -> bool:
    """Whether the line's idle connection has something to read: between calls a Redis server
    sends nothing, so it is the end of the connection (the server stopped or closed it), or a
    broken one."""
    poller = getattr(local, "poll", None)
    return poller is not None and bool(poller.poll(0))


class _Incomplete(Exception):
    """The bytes read so far hold part of a reply."""


class _ErrorReply(NamedTuple):
    message: str


def _parse_reply(data: Any, at: int) -> tuple[Any, int]:
    """One RESP2/RESP3 reply of the kinds a script returns, from ``data[at:]`` (bytes or a
    bytearray): ``(value, end)``.  Bulk strings are bytes, as redis-py returns them without
    ``decode_responses``."""
    nl = data.find(b"\r\n", at)
    if nl < 0:
        raise _Incomplete
    kind, line, at = data[at], data[at + 1 : nl], nl + 2
    if kind == 36:  # $ bulk string
        n = int(line)
        if n < 0:
            return None, at
        if at + n + 2 > len(data):
            raise _Incomplete
        return bytes(data[at : at + n]), at + n + 2
    if kind == 42:  # * array
        n = int(line)
        if n < 0:
            return None, at
        items = []
        for _ in range(n):
            item, at = _parse_reply(data, at)
            items.append(item)
        return items, at
    if kind == 58:  # : integer
        return int(line), at
    if kind == 43:  # + status
        return bytes(line), at
    if kind == 45:  # - error
        return _ErrorReply(line.decode("utf-8", "replace")), at
    if kind == 95:  # _ null (RESP3)
        return None, at
    if kind == 35:  # # boolean (RESP3)
        return line == b"t", at
    if kind == 44:  # , double (RESP3)
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

    Every script call takes the shard's keys and the thread's keys (keys.py's order), then the
    server's clock (empty here), the thread id, three settings and the script's own arguments;
    only the thread's parts and the own arguments are packed per call.  Gives the bytes redis-py
    would send for the same call (tests/gate/test_wire.py), in a fraction of the time
    (``python -m bench.callcost`` shows the client's side).
    """

    _MARK = "\x00thread\x00"

    def __init__(self, shard: ShardKeys, release_timeout_ms: int, direct_arg: str) -> None:
        keys = shard.thread(self._MARK).script_keys()
        # The keys as runs of constant bytes between the thread's keys, each of those kept as the
        # parts around its id (the names are keys.py's alone).
        self.parts: list[bytes | tuple[bytes, bytes]] = []
        run = b""
        for key in keys:
            if self._MARK in key:
                before, after = key.split(self._MARK)
                self.parts.extend([run, (before.encode(), after.encode())])
                run = b""
            else:
                run += _bulk(key.encode())
        self.parts.append(run + _bulk(b""))  # then the clock (empty: the server's)
        self.settings = b"".join(_bulk(_arg(v)) for v in (release_timeout_ms, shard.wake_channel, direct_arg))
        self.key_count = len(keys)

    def head(self, script: str, command: bytes = b"EVALSHA") -> bytes:
        """``EVALSHA <sha>``, or ``FCALL <function name>``, and the key count."""
        return _bulk(command) + _bulk(script.encode()) + _bulk(b"%d" % self.key_count)

    def pack(self, head: bytes, thread_id: str, args: Sequence[Any]) -> bytes:
        thread = thread_id.encode()
        out = [b"*%d\r\n" % (3 + self.key_count + 5 + len(args)), head]
        for part in self.parts:
            if isinstance(part, tuple):
                out.append(_bulk(part[0] + thread + part[1]))
            else:
                out.append(part)
        out.append(_bulk(thread))
        out.append(self.settings)
        out.extend(_bulk(_arg(a)) for a in args)
        return b"".join(out)


def _arg(value: Any) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return repr(value).encode()
    raise redis.DataError(f"invalid script argument {value!r}: use bytes, str, int or float")
