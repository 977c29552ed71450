"""Capture the message plain Celery would publish, store it as an envelope, publish it on release.

An envelope is ``header_json + b"\\n" + body``: the body already serialized by the app's serializer
(so an argument it cannot encode fails before anything is stored), the header holding everything
``Producer.publish`` needs to send exactly that message later.
"""

from __future__ import annotations

import json
import threading
from datetime import datetime, timezone
from typing import Any, Optional

from celery import Celery
from kombu import Exchange, Queue
from kombu.serialization import dumps as _kombu_dumps
from kombu.serialization import loads as _kombu_loads
from kombu.serialization import prepare_accept_content
from kombu.utils.json import JSONEncoder as KombuJSONEncoder
from kombu.utils.json import loads as kombu_json_loads

from .errors import ReleaseExpired, UndecodableEnvelope
from .gate import Release
from .logs import get_logger
from .protocol import OUR_HEADERS, REPUBLISHED_HEADER, THREAD_HEADER, TOKEN_HEADER

logger = get_logger(__name__)

_PROPERTY_KEYS = (
    "correlation_id",
    "reply_to",
    "priority",
    "delivery_mode",
    "expiration",
    "message_id",
    "user_id",
    "app_id",
    "type",
    "timestamp",
)
# Properties the gate's own publish copies as they are (strings and small integers).
_DIRECT_PROPERTIES = {"correlation_id", "reply_to", "delivery_mode", "priority"}


class CapturingProducer:
    """Stands in for a kombu ``Producer`` during ``apply_async``: the task message is kept, not sent.

    Any other publish made on it (the ``task-sent`` event) is held until :meth:`flush`, so nothing
    reaches the broker unless the gate stored the member.
    """

    def __init__(self, real: Any) -> None:
        self._real = real
        self.envelope: Optional[bytes] = None
        # The envelope's header and body as built, before encoding (release_message's parts).
        self.parts: Optional[tuple[dict[str, Any], bytes]] = None
        self._held: list[tuple[Any, dict[str, Any]]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def publish(self, body: Any, **kwargs: Any) -> None:
        if self.envelope is None:
            header, payload, self.envelope = _envelope(body, kwargs)
            self.parts = (header, payload)
        else:
            self._held.append((body, kwargs))

    def set_sent_eta(self, eta: Optional[str]) -> None:
        """The held ``task-sent`` event's ``eta`` (ISO 8601): the call's countdown or eta, which
        Celery never sees, or when the gate scheduled the member where that is later."""
        for body, _ in self._held:
            if isinstance(body, dict) and body.get("type") == "task-sent":
                body["eta"] = eta

    def flush(self, send: bool = True) -> None:
        """Publish what is held, or (``send`` false) drop it: the call stored nothing."""
        held, self._held = self._held, []
        if not send:
            return
        for body, kwargs in held:
            try:
                self._real.publish(body, **kwargs)
            except Exception:  # an event is best effort, as in Celery
                logger.warning("celery-threads: could not publish a held event", exc_info=True)


def eta_text(ms: int) -> str:
    """A time on the gate's clock (ms since 1970) as an event's ``eta``."""
    return datetime.fromtimestamp(ms / 1000, tz=timezone.utc).isoformat()


def _name(entity: Any) -> Any:
    return entity.name if isinstance(entity, (Exchange, Queue)) else entity


def request_member(request: Any) -> tuple[str, str]:
    """The (thread id, token) of a released member's worker request; ``("", "")`` for any other."""
    headers = request.request_dict
    return str(headers.get(THREAD_HEADER) or ""), str(headers.get(TOKEN_HEADER) or "")


def encode_envelope(body: Any, kwargs: dict[str, Any]) -> bytes:
    return _envelope(body, kwargs)[2]


def _envelope(body: Any, kwargs: dict[str, Any]) -> tuple[dict[str, Any], bytes, bytes]:
    """The envelope of a ``Producer.publish`` call, and its header (as ``decode_envelope`` would
    return it, but with the caller's objects) and body before encoding."""
    serializer = kwargs.get("serializer")
    content_type = kwargs.get("content_type")
    if content_type is None:
        content_type, content_encoding, payload = _dumps(body, serializer)
    else:
        content_encoding = kwargs.get("content_encoding") or "utf-8"
        payload = body
    payload = payload.encode(content_encoding or "utf-8") if isinstance(payload, str) else bytes(payload)
    headers = dict(kwargs.get("headers") or {})
    # Set again on every release (release_message, and the gate's publish_direct).
    for key in (*OUR_HEADERS, "retries", "eta"):
        headers.pop(key, None)
    rest = {
        "exchange": _name(kwargs.get("exchange")) or "",
        "routing_key": kwargs.get("routing_key"),
        "declare": [_name(q) for q in (kwargs.get("declare") or []) if isinstance(q, Queue)],
        "content_type": content_type,
        "content_encoding": content_encoding,
        "compression": kwargs.get("compression"),
        "retry": kwargs.get("retry", True),
        "retry_policy": kwargs.get("retry_policy"),
        "properties": {k: kwargs[k] for k in _PROPERTY_KEYS if kwargs.get(k) is not None},
    }
    # Compact separators: the gate holds this for every waiting member.
    headers_json = _compact(headers)
    if _direct_ok(headers, rest):
        # 2: the body is UTF-8 text, which the gate can publish as a JSON string.
        lead = f'{{"d":{2 if _is_utf8(payload) else 1},"hl":{len(headers_json)},'
    else:
        lead = "{"
    header = f'{lead}"headers":{headers_json},{_compact(rest)[1:]}'
    return {"headers": headers, **rest}, payload, header.encode() + b"\n" + payload


def _is_utf8(payload: bytes) -> bool:
    try:
        payload.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


class _HeaderEncoder(KombuJSONEncoder):
    """kombu's JSON, so that a header value of the types kombu carries (a datetime, a UUID, a
    Decimal, bytes...) comes back as itself (:func:`decode_envelope`), and reaches the task as
    kombu's own Redis transport brings it; the ``repr`` of anything else."""

    def default(self, o: Any) -> Any:
        try:
            return super().default(o)  # type: ignore[no-untyped-call]
        except TypeError:
            return repr(o)


def _compact(value: Any) -> str:
    # ASCII only (ensure_ascii), so the length of the text is its length in bytes.
    return json.dumps(value, separators=(",", ":"), cls=_HeaderEncoder)


def _direct_ok(headers: dict[str, Any], rest: dict[str, Any]) -> bool:
    """Whether the gate may publish this message itself, on a Redis broker on its own server
    (lua/_common.lua, publish_direct): it can build the message kombu would, without kombu's
    routing tables, priority queues, compression or expiry."""
    properties = rest["properties"]
    return (
        rest["exchange"] == ""
        and isinstance(rest["routing_key"], str)
        and bool(rest["routing_key"])
        and rest["compression"] is None
        and isinstance(rest["content_type"], str)
        and isinstance(rest["content_encoding"], str)
        and not headers.get("expires")
        and properties.get("priority") in (None, 0)
        and isinstance(properties.get("delivery_mode"), int)
        and set(properties) <= _DIRECT_PROPERTIES
    )


def _dumps(body: Any, serializer: Optional[str]) -> tuple[str, str, Any]:
    """kombu's ``dumps`` (untyped): the serializer's error propagates, nothing is stored."""
    content_type, content_encoding, payload = _kombu_dumps(  # type: ignore[no-untyped-call]
        body, serializer=serializer
    )
    return str(content_type), str(content_encoding), payload


def _loads(body: bytes, content_type: str, content_encoding: str, accept: Optional[set[str]]) -> Any:
    return _kombu_loads(
        body,
        content_type,
        content_encoding,  # type: ignore[no-untyped-call]
        accept=accept,
    )


def decode_envelope(envelope: bytes) -> tuple[dict[str, Any], bytes]:
    header, _, body = envelope.partition(b"\n")
    try:
        decoded = kombu_json_loads(header)  # type: ignore[no-untyped-call]
        if not isinstance(decoded, dict) or not isinstance(decoded.get("headers"), dict):
            raise ValueError("no message headers")
    except ValueError as exc:
        raise UndecodableEnvelope(f"stored message envelope cannot be decoded: {exc}") from exc
    return decoded, body


def member_request(app: Celery, task_id: str, envelope: bytes) -> Optional[dict[str, Any]]:
    """What Celery's result backend needs to end a member that no worker's request ends (a
    ``backend.mark_as_failure`` or ``mark_as_revoked`` ``request=``): its message's headers, its
    arguments and its body's embedded options (``callbacks``, ``errbacks``, ``chain``, ``chord``),
    as a worker's request holds them, so that its chord counts it, its chain fails with it, its
    errbacks are called and an extended result names it.  ``None`` for a message that cannot be
    read, or of a content type the app does not accept."""
    try:
        header, body = decode_envelope(envelope)
        headers = header["headers"]
        accept = prepare_accept_content(app.conf.accept_content)  # type: ignore[no-untyped-call]
        payload = _loads(body, header["content_type"], header["content_encoding"], accept)
    except Exception:  # any content a serializer refuses: nothing to tell the backend
        return None
    args, kwargs, embed = (
        payload if isinstance(payload, (list, tuple)) and len(payload) == 3 else ((), {}, {})
    )
    if not isinstance(embed, dict):
        embed = {}
    # Where it was published, as a worker's request has it (an extended result's queue), and
    # where its result goes (the rpc:// backend replies to reply_to under correlation_id).
    delivery = {"exchange": header.get("exchange") or "", "routing_key": header.get("routing_key") or ""}
    properties = header.get("properties") or {}
    return {
        **headers,
        **embed,
        "id": task_id,
        "args": args,
        "kwargs": kwargs,
        "delivery_info": delivery,
        "reply_to": properties.get("reply_to"),
        "correlation_id": properties.get("correlation_id") or task_id,
    }


def task_name(envelope: bytes) -> str:
    """The task name a stored message names ("" when the envelope cannot be decoded)."""
    try:
        header, _ = decode_envelope(envelope)
    except UndecodableEnvelope:
        return ""
    return str(header["headers"].get("task", ""))


def route_of(envelope: bytes) -> str:
    """Where a stored message is published: its routing key, after its exchange when it names
    one ("" when the envelope cannot be decoded)."""
    try:
        header, _ = decode_envelope(envelope)
    except UndecodableEnvelope:
        return ""
    key, exchange = str(header.get("routing_key") or ""), str(header.get("exchange") or "")
    return f"{exchange}/{key}" if exchange else key


def arguments_repr(envelope: bytes) -> str:
    """The arguments a stored message shows, as Celery's ``argsrepr`` and ``kwargsrepr`` (what
    Flower shows; "" when the envelope cannot be decoded)."""
    try:
        header, _ = decode_envelope(envelope)
    except UndecodableEnvelope:
        return ""
    headers = header["headers"]
    return " ".join(str(headers.get(k) or "") for k in ("argsrepr", "kwargsrepr")).strip()


def decode_arguments(app: Celery, envelope: bytes) -> tuple[list[Any], dict[str, Any]]:
    """The ``(args, kwargs)`` of a stored task message (protocol 2).

    Decoded only when the app's ``accept_content`` accepts its content type, as its workers
    would: else kombu's ``ContentDisallowed`` is raised and the body is never deserialized (a
    pickled message is not unpickled by an app that accepts only JSON)."""
    header, body = decode_envelope(envelope)
    accept = prepare_accept_content(app.conf.accept_content)  # type: ignore[no-untyped-call]
    payload = _loads(body, header["content_type"], header["content_encoding"], accept)
    if isinstance(payload, (list, tuple)) and len(payload) == 3:
        return list(payload[0]), dict(payload[1])
    return list(payload.get("args", [])), dict(payload.get("kwargs", {}))


def release_message(
    app: Celery,
    release: Release,
    extra_headers: Optional[dict[str, Any]] = None,
    queue: Optional[str] = None,
    parts: Optional[tuple[dict[str, Any], bytes]] = None,
    expired_ok: bool = False,
) -> tuple[bytes, dict[str, Any]]:
    """The ``(body, Producer.publish keyword arguments)`` of a released member: its stored message,
    plus the thread id and fencing token.  ``parts``: the envelope's header and body as captured
    (:class:`CapturingProducer`), when the release is of the message the caller has just stored:
    the same message, without decoding the envelope again.

    The AMQP ``expiration`` (the broker's TTL, counted from the publish) is computed now from the
    absolute ``expires`` header, never replayed as captured.  A member whose ``expires`` has
    passed raises :class:`ReleaseExpired`, unless ``expired_ok`` (a dead letter: it goes out with
    a TTL of 1 ms)."""
    header, body = parts if parts is not None else decode_envelope(release.envelope)
    headers = dict(header["headers"])
    headers["retries"] = release.retries
    headers["eta"] = None
    headers[THREAD_HEADER] = release.thread_id
    headers[TOKEN_HEADER] = release.token
    if extra_headers:
        headers.update(extra_headers)
    properties = dict(header["properties"])
    properties.pop("expiration", None)
    remaining = _seconds_until(headers.get("expires"))
    if remaining is not None:
        if remaining <= 0 and not expired_ok:
            raise ReleaseExpired(f"task {release.task_id} expired at {headers['expires']}")
        properties["expiration"] = max(remaining, 0.001)
    exchange, routing_key = header["exchange"], header["routing_key"]
    declare = [app.amqp.queues[name] for name in header["declare"]]
    if queue is not None:
        declare = [app.amqp.queues[queue]]
        exchange, routing_key = declare[0].exchange.name, declare[0].routing_key
    return body, dict(
        exchange=exchange,
        routing_key=routing_key,
        headers=headers,
        content_type=header["content_type"],
        content_encoding=header["content_encoding"],
        compression=header["compression"],
        declare=declare,
        retry=header["retry"],
        retry_policy=header["retry_policy"],
        **properties,
    )


def publish_release(
    app: Celery,
    release: Release,
    producer: Any = None,
    extra_headers: Optional[dict[str, Any]] = None,
    queue: Optional[str] = None,
) -> None:
    """Publish a dead member's message through ``producer`` (or one from the app's pool), expired
    or not."""
    body, options = release_message(app, release, extra_headers, queue, expired_ok=True)
    with app.producer_or_acquire(producer) as P:
        P.publish(body, **options)


class ReleasePublisher:
    """Publishes a process's releases through one producer it keeps, on a broker connection of its
    own.

    The pool process that ran a member publishes the next one's release, so this is on the hot
    path of every threaded task.  Celery's way (acquire a producer from the pool, publish with
    retry, declare the queue) costs about a third more than the publish itself; here the kept
    producer's first publish declares and retries as Celery would, and the next ones publish
    straight through.  The kept producer serves one thread at a time; a thread that finds it busy
    takes Celery's way.  When a direct publish fails, the connection is dropped and the release
    goes out Celery's way, with the ``thread_republished`` header: the failed attempt may have
    reached the broker, and that header makes the receiving worker check for a duplicate.
    """

    def __init__(self, app: Celery) -> None:
        self.app = app
        self._lock = threading.Lock()
        self._producer: Any = None
        self._declared: set[str] = set()

    def publish(
        self,
        release: Release,
        producer: Any = None,
        republish: bool = False,
        parts: Optional[tuple[dict[str, Any], bytes]] = None,
    ) -> Optional[float]:
        """Publish ``release``; returns the TTL it went out with (seconds), if it has
        ``expires``.  :class:`ReleaseExpired` when that has passed: nothing is sent."""
        extra = {REPUBLISHED_HEADER: True} if republish else None
        body, options = release_message(self.app, release, extra, parts=parts)
        ttl: Optional[float] = options.get("expiration")
        if producer is None and self._lock.acquire(blocking=False):
            try:
                if self._publish_kept(body, options):
                    return ttl
            finally:
                self._lock.release()
            options["headers"][REPUBLISHED_HEADER] = True
        with self.app.producer_or_acquire(producer) as P:
            P.publish(body, **options)
        return ttl

    def _publish_kept(self, body: bytes, options: dict[str, Any]) -> bool:
        """Publish through the kept producer; ``False`` when that failed (nothing is known of
        whether the message went out)."""
        fresh = self._producer is None
        try:
            if fresh:
                self._producer = self.app.amqp.Producer(self.app.connection_for_write(), auto_declare=False)
                self._declared = set()
            declare = [q for q in options["declare"] if q.name not in self._declared]
            direct = dict(options, declare=declare)
            if not fresh and not declare:
                direct.update(retry=False, retry_policy=None)
            self._producer.publish(body, **direct)
            self._declared.update(q.name for q in declare)
            return True
        except Exception:
            logger.debug("celery-threads: the kept producer failed; publishing Celery's way", exc_info=True)
            self.close()
            if fresh:
                raise  # nothing was sent: Celery's way would fail the same way, and say why
            return False

    def close(self) -> None:
        producer, self._producer = self._producer, None
        if producer is not None:
            try:
                producer.connection.close()
            except Exception:
                pass


def _seconds_until(expires: Any) -> Optional[float]:
    if not expires:
        return None
    try:
        when = datetime.fromisoformat(str(expires))
    except ValueError:
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)
    return (when - datetime.now(timezone.utc)).total_seconds()
