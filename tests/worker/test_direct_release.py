"""Releases the gate publishes itself: kombu's Redis transport on the gate's own server.

When the broker is that Redis, the script that releases a member also pushes its message onto the
queue's list, in the same atomic step (lua/_common.lua, publish_direct).  The message must be the
one kombu would have published, and every message the gate cannot build exactly (priorities,
expiry, other exchanges, compression) must still go out through kombu.
"""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest
import redis

from celery_threads.gate import Release, ReleasePush, find_record, parse_record
from celery_threads.runtime import direct_release, get_runtime
from tests.support.helpers import starts, tid, wait_for
from tests.support.isolated import BROKER_DB, GATE_DB, pointed_at


def _queue(app: Any) -> str:
    return str(app.conf.task_default_queue)


def _messages(server: Any, key: str) -> list[dict[str, Any]]:
    client = redis.Redis(port=server.port, db=BROKER_DB)
    return [json.loads(raw) for raw in client.lrange(key, 0, -1)]


def _through_kombu(app: Any, thread: str, task_id: str, token: str) -> None:
    """Publish the same release again, Python's way (kombu's Producer)."""
    runtime = get_runtime(app)
    record = parse_record(find_record(runtime.client, runtime.keys.thread(thread).shard.tasks, task_id)[1])
    runtime.publisher.publish(Release(thread, task_id, token, record.retries, record.envelope))


def _without_tag(message: dict[str, Any]) -> dict[str, Any]:
    """The message as kombu's consumer reads it, less the delivery tag: the body as bytes whether
    it went as base64 (kombu's default) or as UTF-8 text (what the gate sends for a text body)."""
    properties = dict(message["properties"])
    properties.pop("delivery_tag")
    encoding = properties.pop("body_encoding")
    body = base64.b64decode(message["body"]) if encoding == "base64" else message["body"].encode("utf-8")
    return {**message, "body": body, "properties": properties}


def test_the_gate_publishes_what_kombu_would(proj, isolated_app, redis_server):
    runtime = get_runtime(isolated_app)
    assert runtime.gate.direct == ReleasePush(gate_db=GATE_DB, broker_db=BROKER_DB)
    thread = tid('dé/"q')  # escapes in the thread id survive the splice
    result = proj.record.apply_async(
        (thread, 'ünïcode "quoted" \\ /'),
        thread_id=thread,
        headers={"custom": {"nested": [1, [], {}], "n": 2**60}},
    )
    [direct] = _messages(redis_server, _queue(isolated_app))
    token = direct["headers"]["thread_token"]
    _through_kombu(isolated_app, thread, result.id, token)
    kombu_way, same = _messages(redis_server, _queue(isolated_app))
    assert same == direct
    assert _without_tag(direct) == _without_tag(kombu_way)
    assert direct["headers"]["custom"] == {"nested": [1, [], {}], "n": 2**60}
    # kombu's Redis transport keys unacknowledged messages by the tag: it must be unique.
    assert direct["properties"]["delivery_tag"] != kombu_way["properties"]["delivery_tag"]
    assert token in direct["properties"]["delivery_tag"]


def test_a_text_body_goes_as_text_and_a_binary_one_as_base64(proj, isolated_app, redis_server):
    """kombu reads either body encoding back to the same bytes; the gate sends a UTF-8 body as a
    JSON string (escaped by cjson) and anything else base64-encoded (the long binary body crosses
    the Lua encoder's 3,000-byte chunks)."""
    for serializer, encoding, blob in (
        ("json", "utf-8", b"\xff" * 7),
        ("pickle", "base64", bytes(range(256)) * 25 + b"\x00"),
    ):
        thread = tid(serializer)
        result = proj.record.apply_async(
            (thread, 'ü \x00 \u2028 "/\\', blob), thread_id=thread, serializer=serializer
        )
        [direct] = _messages(redis_server, _queue(isolated_app))
        assert direct["properties"]["body_encoding"] == encoding
        _through_kombu(isolated_app, thread, result.id, direct["headers"]["thread_token"])
        kombu_way, _ = _messages(redis_server, _queue(isolated_app))
        assert kombu_way["properties"]["body_encoding"] == "base64"
        assert _without_tag(direct) == _without_tag(kombu_way)
        redis.Redis(port=redis_server.port, db=BROKER_DB).delete(_queue(isolated_app))


def test_a_release_published_by_the_gate_is_not_published_again(proj, isolated_app):
    runtime = get_runtime(isolated_app)
    gate, thread = runtime.gate, tid()
    first = proj.record.apply_async((thread, "a"), thread_id=thread)
    proj.record.apply_async((thread, "b"), thread_id=thread)
    token = gate.reads.snapshot(thread).active["token"]
    assert gate.claim(thread, first.id, token, "w") == 1
    outcome = gate.finish(thread, first.id, token)
    assert outcome.release is not None and outcome.release.published
    assert outcome.release.envelope == b""
    with isolated_app.connection_for_write() as conn:
        assert conn.default_channel.client.llen(_queue(isolated_app)) == 2  # a, then b: once


@pytest.mark.parametrize(
    "options",
    [
        {"priority": 5},
        {"expires": 600},
        {"exchange": "direct-x", "routing_key": "direct-rk"},
        {"compression": "zlib"},
    ],
    ids=["priority", "expires", "exchange", "compression"],
)
def test_messages_the_gate_cannot_build_go_through_kombu(proj, isolated_app, redis_server, options):
    runtime = get_runtime(isolated_app)
    thread = tid()
    proj.record.apply_async((thread, "x"), thread_id=thread, **options)
    snapshot = runtime.gate.reads.snapshot(thread)
    assert snapshot is not None and snapshot.active["state"] == "RELEASED"
    client = redis.Redis(port=redis_server.port, db=BROKER_DB)
    messages = [
        json.loads(client.lrange(key, 0, -1)[0]) for key in client.keys("*") if client.type(key) == b"list"
    ]
    if options.get("exchange"):
        assert messages == []  # kombu found no queue bound to that exchange: nothing to check
        return
    [message] = messages
    assert message["headers"]["thread_token"] == snapshot.active["token"]
    assert not message["properties"]["delivery_tag"].startswith(runtime.keys.prefix)


def test_global_keyprefix_is_the_brokers(proj, isolated_app, redis_server):
    with pointed_at(isolated_app, broker_transport_options={"global_keyprefix": "pfx:"}):
        runtime = get_runtime(isolated_app)
        assert runtime.gate.direct is not None and runtime.gate.direct.key_prefix == "pfx:"
        thread = tid()
        result = proj.record.apply_async((thread, "p"), thread_id=thread)
        [direct] = _messages(redis_server, "pfx:" + _queue(isolated_app))
        _through_kombu(isolated_app, thread, result.id, direct["headers"]["thread_token"])
        kombu_way, _ = _messages(redis_server, "pfx:" + _queue(isolated_app))
        assert _without_tag(direct) == _without_tag(kombu_way)


def test_direct_release_only_on_the_gates_own_server(proj, isolated_app, redis_server):
    client = get_runtime(isolated_app).client
    app = isolated_app
    here = f"redis://127.0.0.1:{redis_server.port}"
    cases = {
        f"{here}/3": ReleasePush(gate_db=GATE_DB, broker_db=3),
        f"{here}": ReleasePush(gate_db=GATE_DB, broker_db=0),
        f"redis://127.0.0.1:{redis_server.port + 1}/3": None,
        f"redis://:secret@127.0.0.1:{redis_server.port}/3": None,
        "amqp://guest:guest@127.0.0.1:5672//": None,
    }
    for url, expected in cases.items():
        with pointed_at(app, broker_url=url):
            assert direct_release(app, client) == expected, url
    with pointed_at(app, threads_direct_release=False):
        assert get_runtime(app).gate.direct is None


def test_members_published_either_way_run_in_order(proj, worker):
    r = proj.history()
    thread = tid()
    labels = ["d1", "p2", "d3", "e4", "d5"]
    results = []
    for label in labels:
        options: dict[str, Any] = {}
        if label.startswith("p"):
            options["priority"] = 3
        if label.startswith("e"):
            options["expires"] = 600
        results.append(proj.record.apply_async((thread, label), thread_id=thread, **options))
    for res in results:
        res.get(timeout=30)
    wait_for(lambda: starts(r, thread) == labels, what="all five in order")


def test_a_refused_push_leaves_the_publish_to_kombu(proj, isolated_app, redis_server):
    """The queue's key holds a string: the script's push fails, it switches back to the gate's
    database and hands the release to the caller, whose publish through kombu fails and is
    logged; the member stays RELEASED for the dispatcher to republish."""
    broker = redis.Redis(port=redis_server.port, db=BROKER_DB)
    broker.set(_queue(isolated_app), "not a list")
    gate = get_runtime(isolated_app).gate
    thread = tid()
    result = proj.record.apply_async((thread, "refused"), thread_id=thread)
    snapshot = gate.reads.snapshot(thread)
    assert snapshot is not None and snapshot.active["state"] == "RELEASED"
    assert snapshot.active["task"] == result.id
    assert broker.get(_queue(isolated_app)) == b"not a list"
    # The gate hands such a release back whole, for the caller to publish.
    envelope = parse_record(
        find_record(gate.client, gate.keys.thread(thread).shard.tasks, result.id)[1]
    ).envelope
    other = tid()
    outcome = gate.enqueue(other, "refused-too", envelope)
    assert outcome.release is not None and not outcome.release.published
    assert outcome.release.envelope == envelope
    assert gate.reads.snapshot(other).active["state"] == "RELEASED"  # and the gate's db is back
