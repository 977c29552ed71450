"""Whether a connection failed because its URL and its server disagree: about TLS, the
credentials, or the database.

``rediss://`` to a port that speaks plain Redis waits out the TLS handshake (the server waits for
a command line that never comes); ``redis://`` to a TLS port is closed by the server after the
first command.  Both looked like an outage: retried for the client's whole budget, then reported
as a server that could not be reached.  After such a failure, :func:`mismatch` asks the same port
the other way, once and briefly: a plain ``PING`` answered in RESP, or a TLS handshake that the
server answers, names the mismatch (:class:`~celery_threads.errors.TransportMismatch`).  A
server that refuses the URL's credentials, or has no database of the URL's number, answers at
once: :func:`refusal` says which, for the callers that report it as a setting to fix.  A user's
right revoked after the process checked its rights is met inside a call: :func:`missing_right`
tells that refusal from the other errors a server answers with.
"""

from __future__ import annotations

import socket
import ssl
from typing import Any, Optional

import redis

from ..errors import ConfigurationError, TransportMismatch

#: How long the probe waits for the server's answer (at most the caller's remaining bound).
PROBE_WAIT = 1.0
#: The least it waits, even past an exhausted bound: a local server answers in a millisecond.
PROBE_FLOOR = 0.25


def check(connection: Any, error: BaseException, wait: float = PROBE_WAIT) -> None:
    """Raise :class:`TransportMismatch` when ``connection`` (a redis-py connection to a host and
    port) failed with ``error`` because of TLS; else return, and the caller raises ``error``."""
    host, port = getattr(connection, "host", None), getattr(connection, "port", None)
    if not host or not port or isinstance(error, TransportMismatch):
        return
    tls = isinstance(connection, redis.SSLConnection)
    if tls and not _handshake_failure(error):
        return
    if not tls and not isinstance(error, redis.ConnectionError):
        return  # a timeout: a silent server, not one that closed the connection on us
    found = mismatch(host, port, tls, wait)
    if found:
        raise TransportMismatch(found) from error


def _handshake_failure(error: BaseException) -> bool:
    seen: Optional[BaseException] = error
    while seen is not None:
        if isinstance(seen, ssl.SSLError) or "handshake" in str(seen):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def mismatch(host: str, port: int, tls: bool, wait: float = PROBE_WAIT) -> Optional[str]:
    """What is wrong when a ``rediss://`` (``tls``) or ``redis://`` connection to ``host:port``
    failed and the port answers the other way, or as an AMQP broker, else ``None`` (the port
    does not answer either way: an outage, or not Redis)."""
    where = f"{host}:{port}"
    answer = _answer_to_ping(host, port, wait)
    if answer.startswith(b"AMQP"):
        return (
            f"the server at {where} speaks AMQP (a RabbitMQ broker's port), not Redis: "
            "threads_redis_url must name a Redis server, such as redis://host:6379/0"
        )
    plain = answer[:1] in (b"+", b"-")  # +PONG, or -NOAUTH...: a Redis without TLS
    if tls and plain:
        return (
            f"the Redis server at {where} speaks plain Redis, not TLS, and the URL "
            "says rediss://: use redis://, or the port of the server's tls-port"
        )
    if tls or plain:
        return None
    try:
        with socket.create_connection((host, port), timeout=wait) as sock:
            context = ssl.create_default_context()
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
            try:
                with context.wrap_socket(sock, server_hostname=host):
                    pass
            except ssl.SSLError as exc:
                if "ALERT" not in str(getattr(exc, "reason", "")):
                    return None  # not a TLS server's refusal
            return (
                f"the Redis server at {where} expects TLS, and the URL says redis://: use "
                "rediss:// (docs/redis-tls-acl.md)"
            )
    except OSError:
        return None


def _answer_to_ping(host: str, port: int, wait: float) -> bytes:
    """The first bytes ``host:port`` answers a plain ``PING`` with (``b""`` for none).  The PING
    is sent as redis-py sends it, 14 bytes: more than an AMQP server reads before it answers
    with its own protocol header."""
    try:
        with socket.create_connection((host, port), timeout=wait) as sock:
            sock.sendall(b"*1\r\n$4\r\nPING\r\n")
            return sock.recv(64)
    except OSError:
        return b""


def refusal(error: BaseException) -> Optional[str]:
    """What the server's answer to a connection's first commands says is wrong with the URL (a
    setting to fix: no retry makes it right), else ``None``."""
    if isinstance(error, redis.AuthenticationError):
        said = str(error).rstrip(".")
        return f"the server refused the URL's credentials ({said}): set the user and password it expects"
    if isinstance(error, redis.ResponseError) and "DB index is out of range" in str(error):
        return (
            "the server has no database of the URL's number (its `databases` setting): "
            "name one below it, such as /0"
        )
    return None


#: How Redis words a refused right: a command's own (``NOPERM``, redis-py's ``NoPermissionError``),
#: and a command or key a script ran (Redis 7.0: "The user executing the script can't run this
#: command or subcommand"; "No permissions to access a key").
_NO_RIGHT = ("NOPERM", "can't run this command", "no permissions to ")


def missing_right(error: BaseException) -> bool:
    """Whether ``error`` is the server refusing the user a right (ACL)."""
    if isinstance(error, redis.exceptions.NoPermissionError):
        return True
    text = str(error).lower()
    return isinstance(error, redis.ResponseError) and any(part.lower() in text for part in _NO_RIGHT)


def refused(shown_url: str, error: BaseException) -> Optional[ConfigurationError]:
    """:func:`refusal` as the :class:`ConfigurationError` a process raises for it (``shown_url``:
    the gate's URL with its password masked), else ``None``."""
    found = refusal(error)
    return None if found is None else ConfigurationError(f"threads_redis_url {shown_url}: {found}")
