"""Every publication path goes through the gate; bad input leaves nothing behind."""

from __future__ import annotations

import logging
import uuid
from datetime import datetime, timezone

import pytest
import redis
from celery import chain, chord, group
from kombu.exceptions import EncodeError

from celery_threads import InvalidThreadId, Threads, ThreadsError
from celery_threads.errors import ConfigurationError, UnknownTask
from tests.support.helpers import assert_serial, collect_events, gate_keys, starts, tid, wait_for


@pytest.fixture
def r(proj):
    return proj.history()


def _broker_depth(proj) -> int:
    """Messages in the default queue: with ``isolated_app``, a broker database no worker consumes,
    so a message sent stays there to be counted."""
    with proj.app.connection_for_write() as conn:
        return conn.default_channel.client.llen(proj.app.conf.task_default_queue)


def test_signature_with_thread_id_option(proj, worker, r):
    thread = tid()
    sig = proj.free.s("sig").set(thread_id=thread)
    assert sig.apply_async().get(timeout=30) == "sig"
    assert starts(r, thread) == ["sig"]


def test_int_thread_id_is_its_decimal_string(proj, worker, r):
    n = int(tid("").replace("-", "")[:8], 16)
    assert proj.free.apply_async(("int",), thread_id=n).get(timeout=30) == "int"
    assert starts(r, str(n)) == ["int"]


def test_chain_steps_are_published_through_the_gate(proj, worker, r):
    thread = tid()
    blocker = proj.record.delay(thread, "blocker", sleep=1.0)
    wait_for(lambda: starts(r, thread) == ["blocker"], what="blocker")
    # Each step joins the thread when the worker publishes it, behind what is already waiting.
    c = chain(proj.record.si(thread, "c1"), proj.record.si(thread, "c2"))
    waiting = proj.record.delay(thread, "waiting")
    res = c.apply_async()
    assert res.get(timeout=30) == "c2"
    assert starts(r, thread) == ["blocker", "waiting", "c1", "c2"]
    assert_serial(r, thread)
    assert waiting.get(timeout=10) == "waiting"
    blocker.get(timeout=10)


def test_group_members_join_their_threads(proj, worker, r):
    a, b = tid(), tid()
    g = group(
        proj.record.si(a, "a1", sleep=0.1),
        proj.record.si(b, "b1"),
        proj.record.si(a, "a2"),
        proj.record.si(b, "b2"),
    )
    assert g.apply_async().get(timeout=30) == ["a1", "b1", "a2", "b2"]
    assert starts(r, a) == ["a1", "a2"] and starts(r, b) == ["b1", "b2"]
    assert_serial(r, a)


def test_chord_body_goes_through_the_gate(proj, worker, r):
    thread = tid()
    header = [proj.record.si(thread, f"h{i}") for i in range(3)]
    res = chord(header)(proj.free.si("body").set(thread_id=thread))
    assert res.get(timeout=30) == "body"
    assert starts(r, thread) == ["h0", "h1", "h2", "body"]


@pytest.mark.parametrize("bad", [None, "", "x" * 1025, 3.5, b"bytes", ["a"], True])
def test_invalid_thread_id_stores_and_sends_nothing(proj, isolated_app, bad):
    before = _broker_depth(proj)
    with pytest.raises(InvalidThreadId) as info:
        proj.free.apply_async(("x",), thread_id=bad)
    assert isinstance(info.value, ValueError) and isinstance(info.value, ThreadsError)
    assert "thread" in str(info.value)
    assert _broker_depth(proj) == before
    proj.free.apply_async(("x",), thread_id=tid())  # a valid id is released: the probe sees it
    assert _broker_depth(proj) == before + 1


def test_missing_thread_key_argument(proj):
    with pytest.raises(InvalidThreadId, match="argument 'thread'"):
        proj.record.apply_async(kwargs={"label": "x"})


def test_a_thread_key_naming_no_argument_is_refused_where_the_task_is_declared():
    from celery import Celery

    from celery_threads import ThreadedTask

    app = Celery("typo", broker="redis://127.0.0.1:1/0", set_as_current=False)

    # shared=False: Celery adds a shared task (its default) to every app finalized after it, which
    # would carry this one's refusal into the apps of the tests that follow.
    @app.task(base=ThreadedTask, thread_key="account_id", shared=False)
    def by_kwargs(**kwargs):  # **kwargs may carry it: checked per call
        return kwargs

    @app.task(base=ThreadedTask, bind=True, thread_key="acount_id", shared=False)
    def settle(self, account_id, amount):
        return amount

    # The worker, beat and every caller finalize the app first, and stop there.
    with pytest.raises(ConfigurationError, match="thread_key='acount_id'.*account_id, amount"):
        app.finalize(auto=True)
    # Every later call says the same (it said "which this call does not pass", passing it),
    # and the bound task's own argument is not offered as one to name.
    for _ in range(2):
        with pytest.raises(
            ConfigurationError, match=r"thread_key='acount_id'.*arguments: account_id, amount\)"
        ):
            settle.delay("acct-1", 1)


def test_a_callable_thread_key_names_the_thread(proj, worker, r):
    """app.task(thread_key=<a lambda or function>) is called with (args, kwargs), as documented:
    Celery makes it an attribute of the task's class, where a plain function would be a method."""
    thread = tid()
    blocker = proj.keyed.apply_async((thread, "k1"), {"suffix": "x"})
    second = proj.keyed.delay(thread, "k2", suffix="x")
    assert [blocker.get(timeout=30), second.get(timeout=30)] == ["k1", "k2"]
    assert starts(r, f"{thread}-x") == ["k1", "k2"]
    assert proj.keyed.resolve_thread_id((thread, "k3"), {"suffix": "y"}) == f"{thread}-y"
    with pytest.raises(InvalidThreadId, match="KeyError"):  # suffix passed by position
        proj.keyed.delay(thread, "k4", "y")


def test_thread_id_of_1024_bytes_is_accepted(proj, worker, r):
    thread = "é" * 512
    assert proj.free.apply_async(("long",), thread_id=thread).get(timeout=30) == "long"


def test_unencodable_arguments_store_and_send_nothing(proj, isolated_app):
    thread = tid()
    gate = redis.Redis.from_url(isolated_app.conf.threads_redis_url)
    before = _broker_depth(proj)
    with pytest.raises(EncodeError):
        proj.record.delay(thread, object())
    assert gate_keys(gate, thread) == []
    assert Threads(proj.app).get(thread) is None
    assert _broker_depth(proj) == before
    # The same call with arguments that encode is stored and released: the probes see it.
    proj.record.delay(thread, "encodes")
    assert gate_keys(gate, thread) != [] and _broker_depth(proj) == before + 1
    gate.close()


def test_eager_mode_runs_inline(proj, r):
    thread = tid()
    proj.app.conf.task_always_eager = True
    try:
        assert proj.record.delay(thread, "eager").get() == "eager"
    finally:
        proj.app.conf.task_always_eager = False
    assert starts(r, thread) == ["eager"]
    assert gate_keys(r, thread) == []


def test_eager_mode_gives_the_body_its_thread_id_and_checks_it(proj, r):
    """A test of a task's body in eager mode sees the request a worker's run has (thread_token
    aside: no gate fenced it), and an invalid thread id fails as it would through the gate."""
    thread = tid()
    proj.app.conf.task_always_eager = True
    try:
        assert proj.record_request.delay(thread, "eager").get() == [thread, None]
        assert proj.record_request.apply((thread, "apply")).get() == [thread, None]
        with pytest.raises(InvalidThreadId):
            proj.record_request.delay(None, "no thread")
    finally:
        proj.app.conf.task_always_eager = False
    assert gate_keys(r, thread) == []


def test_send_task_by_name_enters_the_gate_at_the_worker(proj, worker, r):
    thread = tid()
    blocker = proj.record.delay(thread, "blocker", sleep=1.0)
    wait_for(lambda: starts(r, thread) == ["blocker"], what="blocker")
    res = proj.app.send_task("tests.support.proj.record", (thread, "by-name"))
    assert res.get(timeout=30) == "by-name"
    assert starts(r, thread) == ["blocker", "by-name"]
    assert_serial(r, thread)
    blocker.get(timeout=10)


def test_send_task_by_name_joins_the_thread_id_it_is_given(proj, worker, r):
    """``send_task(name, ..., thread_id=X)`` as ``apply_async(thread_id=X)``: kombu sends an
    unknown option as a message property, where the worker did not look (it joined the thread of
    its arguments, beside X's running member)."""
    thread, other = tid(), tid()
    go = f"go:{thread}"
    blocker = proj.record.apply_async((thread, "blocker"), {"until": go})
    wait_for(lambda: starts(r, thread) == ["blocker"], what="blocker")
    sent = proj.app.send_task("tests.support.proj.record", (other, "by-name"), thread_id=thread)

    def waits_there() -> bool:
        info = Threads(proj.app).get(thread)
        return info is not None and sent.id in [m.task_id for m in info.waiting]

    wait_for(waits_there, what="the call to wait in the thread it was given")
    assert starts(r, other) == []
    r.set(go, 1)
    assert sent.get(timeout=30) == "by-name" and blocker.get(timeout=30) == "blocker"
    assert Threads(proj.app).get(other) is None


def test_a_message_sent_by_name_without_a_thread_id_fails_its_result(proj, worker):
    """A message by name whose thread id cannot be resolved is rejected with a log line, and
    its result says why (it read PENDING for ever), as Celery does for an unregistered task."""
    sent = proj.app.send_task("tests.support.proj.keyed", (tid(), "no-suffix"))
    with pytest.raises(InvalidThreadId):
        sent.get(timeout=30)
    assert proj.app.AsyncResult(sent.id).state == "FAILURE"


def test_a_plain_task_with_a_thread_key_is_warned_of(proj, worker, caplog):
    """A ``base=ThreadedTask`` left out: Celery keeps ``thread_key`` as an attribute and sends
    ``thread_id`` as a message property, without a word, and the calls run in no thread, beside
    its members.  The producer and the worker say so."""
    said = "unthreaded is declared with a thread_key but is not a ThreadedTask"
    with caplog.at_level(logging.WARNING, logger="celery_threads"):
        assert proj.unthreaded.apply_async((tid(), "x"), thread_id="acct").get(timeout=30) == "x"
    assert any(said in rec.getMessage() for rec in caplog.records), caplog.records
    assert said in worker.output()


def test_same_task_id_is_not_enqueued_twice(proj, r, caplog):
    thread = tid()
    first = proj.record.apply_async((thread, "a"), countdown=30)
    with caplog.at_level(logging.WARNING, logger="celery_threads"):
        proj.record.apply_async((thread, "a"), countdown=30, task_id=first.id)
    # A task id used again says so where a producer's log shows it (it was an INFO line).
    assert any(
        rec.levelno == logging.WARNING and "Give a new call a new task id" in rec.getMessage()
        for rec in caplog.records
    )
    info = Threads(proj.app).get(thread)
    assert [m.task_id for m in info.waiting] == [first.id]
    assert Threads(proj.app).delete(first.id)
    assert Threads(proj.app).get(thread) is None


def test_a_repeated_task_id_sends_no_task_sent_event(proj):
    """The repeated call stores nothing: its task-sent event (Flower then showed its arguments
    as the member's, though they never run) is dropped; the first call's is sent."""
    thread = tid()
    got, stop = collect_events(proj.app)
    try:
        first = proj.record.apply_async((thread, "first"), countdown=30)
        proj.record.apply_async((thread, "again"), countdown=30, task_id=first.id)
        after = proj.record.apply_async((thread, "after"), countdown=30)
        wait_for(lambda: any(e.get("uuid") == after.id for e in got), what="the last call's task-sent")
        sent = [e for e in got if e["type"] == "task-sent" and e.get("uuid") == first.id]
        assert len(sent) == 1 and "first" in sent[0]["args"]
        # Its countdown, which Celery never sees (the gate holds it), is the event's eta.
        due = datetime.fromisoformat(sent[0]["eta"]) - datetime.now(timezone.utc)
        assert 20 < due.total_seconds() <= 30, sent[0]["eta"]
    finally:
        stop()
        Threads(proj.app).purge(thread)


def test_a_task_id_that_just_ended_is_not_enqueued_again(proj, worker, r):
    """What the client does when a Redis restart loses the reply to an enqueue that ran: it
    replays the call.  If the member has run and ended in between, the replay must not make it a
    member again (it would run twice)."""
    from celery_threads.runtime import get_runtime

    thread = tid()
    ran = proj.record.apply_async((thread, "once"))
    assert ran.get(timeout=30) == "once"
    wait_for(lambda: Threads(proj.app).get(thread) is None, what="the member to leave the gate")
    gate = get_runtime(proj.app).gate
    # The replay, as the gate sees it: the same task id and message, once more.
    assert not gate.enqueue(thread, ran.id, b'{"headers":{}}\n[]').done
    proj.record.apply_async((thread, "once"), task_id=ran.id)  # and through apply_async
    after = proj.record.delay(thread, "after")
    assert after.get(timeout=30) == "after"
    assert starts(r, thread) == ["once", "after"]
    assert gate.client.zscore(gate.keys.thread(thread).shard.ended, ran.id) is not None


def test_restart_and_forget_of_unknown_task(proj):
    threads = Threads(proj.app)
    with pytest.raises(UnknownTask):
        threads.restart("no-such-task")
    assert threads.forget("no-such-task") is False
    assert threads.delete("no-such-task") is False


def test_dead_letter_queue_receives_the_dead_members_message(proj, make_deployment, r):
    d = make_deployment(CT_DLQ="threads-dead")
    d.worker("w", concurrency=1)
    thread = tid()
    dying = proj.boom.delay(thread, "dlq")
    with pytest.raises(ValueError):
        dying.get(timeout=30)
    with proj.app.connection_for_read() as conn:
        queue = conn.SimpleQueue("threads-dead", no_ack=True)
        message = queue.get(timeout=10)
        queue.close()
    assert message.headers["id"] == dying.id
    assert message.headers["thread_id"] == thread
    assert "ValueError" in message.headers["thread_exception"]
    assert [d.task_id for d in Threads(proj.app).dead() if d.thread_id == thread] == [dying.id]


def test_a_release_at_enqueue_is_published_as_its_stored_message(proj):
    """When an enqueue releases the member it adds, the producer publishes the message it has just
    captured (``release_message(parts=...)``) instead of decoding the stored envelope: both ways
    give the same message, with every option Celery set (expiry, priority, time limits...)."""
    import json

    from celery.app.task import Task as CeleryTask

    from celery_threads.gate import Release
    from celery_threads.publish import CapturingProducer, release_message

    app = proj.app
    with app.producer_or_acquire() as real:
        capture = CapturingProducer(real)
        CeleryTask.apply_async(
            proj.record,
            (tid(), "x"),
            {"sleep": 0.5},
            producer=capture,
            task_id="t-1",
            expires=600,
            priority=3,
            time_limit=9,
            headers={"custom": {"a": [1, 2]}},
            countdown=None,
        )
    assert capture.envelope is not None and capture.parts is not None
    release = Release("th", "t-1", "42", 0, capture.envelope)
    fast_body, fast = release_message(app, release, parts=capture.parts)
    slow_body, slow = release_message(app, release)
    assert fast_body == slow_body
    assert fast.pop("expiration") == pytest.approx(slow.pop("expiration"), abs=5)

    def plain(options):  # tuples and lists alike, as the envelope's JSON stores them
        return json.loads(json.dumps(options, default=repr))

    assert plain(fast) == plain(slow)
    assert fast["headers"]["thread_token"] == "42" and fast["headers"]["custom"] == {"a": [1, 2]}
    assert fast["priority"] == 3 and fast["headers"]["timelimit"] in ((9, None), [9, None])


def _gate_and_broker_are_empty(app) -> None:
    """Nothing in the isolated gate's database, no message in the isolated broker's."""
    from tests.support.isolated import BROKER_DB, GATE_DB

    port = int(app.conf.threads_redis_url.rsplit(":", 1)[1].split("/")[0])
    gate, broker = (redis.Redis(port=port, db=db) for db in (GATE_DB, BROKER_DB))
    assert gate.keys() == []
    assert [k for k in broker.keys() if broker.type(k) == b"list"] == []


@pytest.mark.parametrize("name", ["negative_retry_delay", "endless_retry_delay", "negative_max_retries"])
def test_invalid_retry_settings_store_and_send_nothing(proj, isolated_app, name):
    """The gate stores max_retries and default_retry_delay with each member; values its record
    cannot hold are refused at publish time, with what to fix."""
    task = getattr(proj, name)
    option = "default_retry_delay" if "delay" in name else "max_retries"
    with pytest.raises(ConfigurationError, match=option) as info:
        task.delay(tid(), "x")
    assert isinstance(info.value, ThreadsError)
    _gate_and_broker_are_empty(isolated_app)


def test_restart_of_a_task_with_invalid_retry_settings_keeps_it_dead(proj, isolated_app):
    from tests.support.isolated import envelope

    gate = Threads(isolated_app).gate
    thread = tid()
    outcome = gate.enqueue(
        thread, "bad-1", envelope("bad-1", thread, name="tests.support.proj.negative_retry_delay")
    )
    assert outcome.release is not None
    assert gate.claim(thread, "bad-1", outcome.release.token, "w") == 1
    assert gate.kill(thread, "bad-1", outcome.release.token, {"exception": "E"}).done
    with pytest.raises(ConfigurationError, match="default_retry_delay"):
        Threads(isolated_app).restart("bad-1")
    assert [d.task_id for d in Threads(isolated_app).dead()] == ["bad-1"]
    assert Threads(isolated_app).get(thread) is None


def test_a_message_sent_by_name_with_invalid_retry_settings_is_rejected(proj, make_deployment):
    """A message that reaches a worker without the gate (send_task by name) enters its thread at
    the worker, which refuses the same values: the message is rejected with a log line."""
    d = make_deployment()
    w = d.worker("bad-retry", concurrency=1)
    thread = tid()
    sent = proj.app.send_task("tests.support.proj.negative_retry_delay", (thread, "x"))
    wait_for(
        lambda: f"rejected tests.support.proj.negative_retry_delay[{sent.id}]" in w.output(),
        what="the worker to reject the message",
    )
    assert "default_retry_delay=-1" in w.output()
    with pytest.raises(ConfigurationError, match="default_retry_delay"):
        sent.get(timeout=30)
    threads = Threads(proj.app)
    assert threads.get(thread) is None and threads.gate.reads.thread_of(sent.id) is None


def test_custom_headers_reach_every_member_as_they_were_sent(proj, worker, r):
    """Header values of the types kombu's JSON carries (a datetime, a UUID, a Decimal) reach
    the task as themselves, as they reach a plain task on the Redis broker, whichever way the
    member was released (its own call's publish, the gate's, a pool process's handoff).  The
    stored message kept their repr, so a member that had waited got text."""
    import decimal

    thread, go = tid("headers"), f"go:{tid()}"
    headers = {
        "custom_dt": datetime(2021, 5, 6, 7, 8, 9, tzinfo=timezone.utc),
        "custom_uuid": uuid.uuid4(),
        "custom_decimal": decimal.Decimal("1.5"),
    }
    names = tuple(headers)
    blocker = proj.record.apply_async((thread, "busy"), {"until": go}, headers=headers)
    wait_for(lambda: starts(r, thread) == ["busy"], what="busy to start")
    waited = [proj.header_types.apply_async((thread, f"m{i}", *names), headers=headers) for i in range(3)]
    r.set(go, 1)
    assert blocker.get(timeout=30) == "busy"
    first = proj.header_types.apply_async((tid("headers-idle"), "idle", *names), headers=headers)
    expected = ["datetime", "UUID", "Decimal"]
    assert first.get(timeout=30) == expected
    assert [x.get(timeout=30) for x in waited] == [expected] * 3


def test_map_starmap_and_chunks_are_refused_and_send_nothing(proj):
    """Celery runs them as one task of its own that calls the body as a function: outside any
    thread, beside the thread's members (two chunks ran at once, beside a running member)."""
    from celery_threads import InvalidArgument

    thread = tid("chunks")
    for make in (
        lambda: proj.record.map([(thread, "a")]),
        lambda: proj.record.starmap([(thread, "a")]),
        lambda: proj.record.chunks([(thread, f"c{i}") for i in range(4)], 2),
    ):
        with pytest.raises(InvalidArgument, match=r"outside any thread.*group\(record.s\(\*args\)"):
            make()
    assert Threads(proj.app).get(thread) is None


def test_canvas_chunks_xmap_and_xstarmap_of_a_threaded_task_never_run_its_body(proj, worker, r):
    """Celery's own constructors (``celery.chunks``, ``xstarmap``; ``xmap`` is the same) skip the task's
    methods and send one task of Celery's that calls the body as a function: it ran beside the
    thread's running member.  That task fails, and the body never runs."""
    from celery import chunks, xstarmap

    from celery_threads import InvalidArgument

    thread = tid("canvas-chunks")
    go = f"go:{thread}"
    blocker = proj.record.apply_async((thread, "blocker"), {"until": go})
    wait_for(lambda: starts(r, thread) == ["blocker"], what="the blocker to start")
    sent = [
        chunks(proj.record.s(), [(thread, "chunked")], 1).apply_async(),
        xstarmap(proj.record.s(), [(thread, "starmapped")]).apply_async(),
    ]
    for result in sent:
        with pytest.raises(InvalidArgument, match=r"outside any thread"):
            result.get(timeout=30, propagate=True)
    r.set(go, 1)
    assert blocker.get(timeout=30) == "blocker"
    assert starts(r, thread) == ["blocker"]
