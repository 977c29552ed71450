"""What a user who got the gate's settings wrong is told: a worker whose gate URL nobody answers
says which URL and setting, and what to check (and runs members once it answers); a malformed URL
names its setting."""

from __future__ import annotations

import re
import uuid

import pytest
import redis
from celery import Celery

from celery_threads import Threads
from celery_threads.config import read_config
from celery_threads.errors import ConfigurationError
from tests.conftest import Deployment, RedisServer, configure_client, deployment_env
from tests.support.helpers import tid, wait_for


def test_a_worker_whose_gate_nobody_answers_says_where_and_what_to_check(redis_server, proj):
    """...and starts without waiting out the gate client's retries; once the gate answers, its
    checks pass and members run."""
    gate = RedisServer(args=("--requirepass", "secret"))  # started later, on the URL's port
    name = uuid.uuid4().hex[:8]
    dead = f"redis://:secret@127.0.0.1:{gate.port}/0"
    d = Deployment(
        {
            "CT_REDIS_URL": dead,
            "CT_BROKER_URL": redis_server.url(1),
            "CT_BACKEND_URL": redis_server.url(2),
            "CT_HISTORY_URL": redis_server.url(3),
            "CT_DISPATCH_INTERVAL": "0.5",
            # Its own queue: another worker on this broker would take its releases and find them stale.
            "CT_KEY_PREFIX": f"ct-{name}",
            "CT_QUEUE": f"q-{name}",
        }
    )
    try:
        worker = d.worker(wait=False)
        wait_for(
            lambda: "cannot reach the gate's Redis" in worker.output(),
            timeout=60,
            what="the worker to say it cannot reach the gate",
        )
        line = next(x for x in worker.output().splitlines() if "cannot reach the gate's" in x)
        assert "ERROR" in line
        assert f"127.0.0.1:{gate.port}" in line and "secret" not in line
        assert "threads_redis_url" in line and "Check that the server runs" in line
        assert "the worker starts and keeps trying" in line  # said at start, at once
        # Then the dispatch loop's failures, rate-limited: its ticks go on, the log does not.
        wait_for(
            lambda: "failure(s) in" in worker.output(),
            timeout=60,
            what="the dispatch loop to report its failures",
        )
        output = worker.output()
        assert output.count("cannot reach the gate's Redis") <= 3
        # Counted from the first failed tick's start: its client retried for its budget first.
        first = re.search(r"(\d+) failure\(s\) in (\d+)s", output)
        assert first is not None and int(first.group(2)) >= 1, first
        # Ready before the gate answered; its checks wait for it (said once, not per process).
        assert " ready." in output and output.count("did not answer its start-up checks") == 1
        gate.start()
        configure_client(proj.app, **d.env)
        assert proj.record.delay(tid("late-gate"), "runs").get(timeout=60) == "runs"
    finally:
        for proc in d.processes:
            proc.stop()
        gate.stop(kill=True)
        configure_client(proj.app, **deployment_env(redis_server))


@pytest.mark.parametrize(
    "url, why",
    [
        ("http://localhost:6379/0", "scheme must be one of"),
        ("redis://:pw@localhost:99999/0", "Port out of range"),
        ("sentinel://a:26379;sentinel://b:x/0", "could not be cast"),
        # redis-py reads a database that is no number as 0: another app's gate, maybe.
        ("redis://:pw@localhost:6379/abc", "the database must be a number"),
        ("unix:///tmp/redis.sock?db=x", "the database must be a number"),
    ],
)
def test_a_malformed_gate_url_names_its_setting(url, why):
    app = Celery("bad-url", set_as_current=False)
    app.conf.threads_redis_url = url
    with pytest.raises(ConfigurationError, match="threads_redis_url=") as info:
        read_config(app)
    assert why in str(info.value) and "redis://[user:password@]host:6379/0" in str(info.value)
    assert "pw@" not in str(info.value)


def test_a_replica_or_a_full_server_is_named_as_such_not_as_missing_rights(proj, isolated_app, caplog):
    """A gate URL naming a replica is told to name the master; a server over its maxmemory is
    said to be full, and the call that it refused stored nothing.  Both refuse writes, which the
    start-up check of rights (gate.access) took for rights the user lacked."""
    from celery_threads.errors import GateUnavailable
    from tests.support.isolated import pointed_at

    master = RedisServer()
    master.start()
    replica = RedisServer(args=("--replicaof", "127.0.0.1", str(master.port)))
    replica.start()
    full = RedisServer(args=("--maxmemory", "1"))
    full.start()
    try:
        with pointed_at(proj.app, threads_redis_url=replica.url(), threads_publish_timeout=2.0):
            with pytest.raises(ConfigurationError, match="is a read-only replica.*its master"):
                proj.record.delay(tid(), "to a replica")
        task_id = str(uuid.uuid4())
        with pointed_at(proj.app, threads_redis_url=full.url(), threads_publish_timeout=2.0):
            with pytest.raises(GateUnavailable, match="is out of memory and refused to store") as info:
                proj.record.apply_async((tid(), "to a full server"), task_id=task_id)
        assert "ACL" not in str(info.value)
        assert any("is out of memory (maxmemory)" in r.getMessage() for r in caplog.records)
        client = redis.Redis(port=full.port)
        assert not any(task_id.encode() in k + (client.dump(k) or b"") for k in client.keys())
    finally:
        for server in (replica, master, full):
            server.stop()


def test_a_misspelled_setting_is_warned_of_with_the_likely_one(caplog):
    """A ``threads_*`` name that is no setting was ignored without a word (its default used)."""

    class Django:
        CELERY_BROKER_URL = "redis://127.0.0.1:1/0"
        CELERY_THREADS_KEEP_ALIVE = 10
        CELERY_THREAD_KEY_PREFIX = "mine"  # a setting but for its s

    plain = Celery("typo", broker="redis://127.0.0.1:1/0", set_as_current=False)
    plain.conf.update(
        threads_keep_alive=10,
        threads_dispatch_intervall=2,
        threads_keepalive=5,
        threads_xyz=1,
        thread_redis_url="redis://127.0.0.1:2/0",
        thread_pool_size=4,  # not one of ours, nor one but for its s: the user's own
    )
    django = Celery("typo-django", set_as_current=False)
    django.config_from_object(Django, namespace="CELERY")
    with caplog.at_level("WARNING", logger="celery_threads.config"):
        assert read_config(plain).keepalive == 5
        assert read_config(django).keepalive == 30.0
    said = [r.getMessage() for r in caplog.records]
    assert any("threads_keep_alive" in m and "did you mean threads_keepalive?" in m for m in said), said
    assert any(
        "threads_dispatch_intervall" in m and "did you mean threads_dispatch_interval?" in m for m in said
    )
    assert any("threads_xyz, which is no celery-threads setting; it is ignored (" in m for m in said), said
    assert any("did you mean CELERY_THREADS_KEEPALIVE?" in m for m in said), said
    assert any("thread_redis_url" in m and "did you mean threads_redis_url?" in m for m in said), said
    assert any(
        "CELERY_THREAD_KEY_PREFIX" in m and "did you mean CELERY_THREADS_KEY_PREFIX?" in m for m in said
    )
    assert len(said) == 6 and not any("threads_keepalive," in m for m in said), said


def test_a_wrong_password_or_database_is_a_setting_to_fix_not_an_outage(redis_server, proj, isolated_app):
    """The server answers at once that the URL is wrong: a producer gets a ConfigurationError
    (it got GateUnavailable, which says to call again later), and a worker stops at start, as for
    TLS on one side only (it said "ready" and failed every call)."""
    from tests.conftest import CeleryProcess
    from tests.support.isolated import pointed_at

    locked = RedisServer(args=("--requirepass", "right"))
    locked.start()
    try:
        for url, said in (
            (f"redis://:NotThePassword@127.0.0.1:{locked.port}/0", "refused the URL's credentials"),
            (f"redis://:right@127.0.0.1:{locked.port}/99", "no database of the URL's number"),
        ):
            task_id = str(uuid.uuid4())
            with pointed_at(proj.app, threads_redis_url=url, threads_publish_timeout=5.0):
                with pytest.raises(ConfigurationError, match=said) as info:
                    proj.record.apply_async((tid("refused"), "x"), task_id=task_id)
            assert "NotThePassword" not in str(info.value) and "threads_redis_url" in str(info.value)
            assert task_id.encode() not in b"".join(redis.Redis(port=locked.port, password="right").keys())
        name = uuid.uuid4().hex[:8]
        env = {
            **deployment_env(redis_server),
            "CT_REDIS_URL": f"redis://:NotThePassword@127.0.0.1:{locked.port}/0",
            "CT_QUEUE": f"q-{name}",
        }
        worker = CeleryProcess("worker", env, ["-c", "1", "-n", f"refused-{name}@%h"], "refused").start()
        try:
            wait_for(lambda: worker.proc.poll() is not None, timeout=120, what="the worker to stop")
            assert worker.proc.returncode == 78  # EX_CONFIG, with one CRITICAL line, no traceback
            assert "Traceback" not in worker.output()
            assert (
                "refused the URL's credentials" in worker.output() and "NotThePassword" not in worker.output()
            )
        finally:
            worker.stop()
    finally:
        locked.stop()


def test_a_gate_url_naming_rabbitmqs_port_says_it_is_amqp(proj):
    """``threads_redis_url = "redis://host:5672/0"`` (the broker's port, from ``broker_url``): the
    server closes the connection on Redis's first command, which read as an outage, retried for
    threads_publish_timeout and reported as a Redis that could not be reached.  It is named, at
    once, as a setting to fix."""
    from tests.conftest import rabbitmq_url
    from tests.support.isolated import pointed_at

    rabbitmq_url()  # RabbitMQ answers on 5672 (CI starts it)
    with pointed_at(proj.app, threads_redis_url="redis://127.0.0.1:5672/0", threads_publish_timeout=5.0):
        with pytest.raises(ConfigurationError, match="speaks AMQP") as info:
            proj.record.apply_async((tid("amqp-port"), "x"))
    assert "threads_redis_url" in str(info.value), info.value


def test_beat_with_a_wrong_setting_stops_as_a_worker_does(tmp_path):
    """Its dispatch entry would only fail on every worker; it logged the error and went on."""
    import subprocess
    import sys

    (tmp_path / "bx.py").write_text(
        "from celery import Celery\n"
        "from celery_threads import ThreadedTask\n"
        "app = Celery('bx', broker='redis://127.0.0.1:1/0')\n"
        "app.conf.threads_keepalive = 'abc'\n"
        "@app.task(base=ThreadedTask, thread_key='a')\n"
        "def t(a):\n"
        "    return a\n"
    )
    done = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "bx", "beat", "-s", str(tmp_path / "schedule")],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 78, done.stdout + done.stderr
    assert "threads_keepalive='abc' is not a number of seconds" in done.stdout + done.stderr


def test_a_worker_whose_gate_has_another_prefix_says_so(proj, make_deployment):
    """A producer whose threads_key_prefix is not its workers' stores its members in a gate no
    worker serves: a worker found each release stale and said so at INFO.  It now names both
    prefixes, at WARNING (the release's stored message names the gate that stored it)."""
    from tests.support.isolated import pointed_at

    d = make_deployment()
    worker = d.worker("prefix", concurrency=1)
    ours = d.env["CT_KEY_PREFIX"]
    theirs = f"{ours}-producer"
    with pointed_at(proj.app, threads_key_prefix=theirs):
        result = proj.record.delay(tid("prefix"), "lost")
    wait_for(lambda: "threads_key_prefix=" in worker.output(), timeout=60, what="the worker to say why")
    line = next(x for x in worker.output().splitlines() if "threads_key_prefix=" in x)
    assert "WARNING" in line and result.id in line, line
    assert f"threads_key_prefix={theirs!r}" in line and f"has {ours!r}" in line, line


def test_a_worker_that_does_not_know_a_task_of_another_gate_says_so(proj, make_deployment):
    """The same mismatch, for a task this worker does not register: Celery logs only "Received
    unregistered task", and the worker tried to dead-letter the member in its own gate, which
    does not hold it (its gate keeps it released and republishes it).  It names both prefixes."""
    from celery_threads import ThreadedTask
    from tests.support.isolated import pointed_at

    d = make_deployment()
    worker = d.worker("prefix-unknown", concurrency=1)
    ours = d.env["CT_KEY_PREFIX"]
    theirs = f"{ours}-elsewhere"

    @proj.app.task(base=ThreadedTask, thread_key="thread", name="tests.only_in_this_process", shared=False)
    def only_here(thread):
        return thread

    with pointed_at(proj.app, threads_key_prefix=theirs):
        result = only_here.delay(tid("prefix-unknown"))
        try:
            wait_for(
                lambda: "threads_key_prefix=" in worker.output(), timeout=60, what="the worker to say why"
            )
        finally:
            Threads(proj.app).delete(result.id)
    line = next(x for x in worker.output().splitlines() if "threads_key_prefix=" in x)
    assert "WARNING" in line and result.id in line and "tests.only_in_this_process" in line, line
    assert f"threads_key_prefix={theirs!r}" in line and f"has {ours!r}" in line, line


def test_beat_keeps_the_dispatchers_entry_when_beat_schedule_is_replaced_after_finalize(
    redis_server, tmp_path, caplog
):
    """A ``beat_schedule`` assigned in an ``on_after_finalize`` handler replaced the entry the
    first ThreadedTask added: beat sent no tick (countdowns waited where workers do not dispatch)
    and said it sent one "every Nones".  Beat's scheduler gets it back, with a warning."""
    from celery import Celery
    from celery.beat import Service

    from celery_threads import ThreadedTask
    from celery_threads.install import _on_beat_start
    from celery_threads.protocol import BEAT_ENTRY

    app = Celery("late-schedule", broker=redis_server.url(0), set_as_current=False)

    @app.task(base=ThreadedTask, thread_key="thread", shared=False)
    def periodic(thread):
        return thread

    @app.on_after_finalize.connect
    def schedule(sender, **kwargs):
        sender.conf.beat_schedule = {"mine": {"task": periodic.name, "schedule": 60.0, "args": ("t",)}}

    app.finalize()
    assert BEAT_ENTRY not in app.conf.beat_schedule
    service = Service(app, schedule_filename=str(tmp_path / "schedule"))
    with caplog.at_level("INFO", logger="celery_threads"):
        _on_beat_start(sender=service)
    assert {"mine", BEAT_ENTRY} <= set(service.scheduler.schedule)
    said = [r.getMessage() for r in caplog.records]
    assert any("is added back" in m for m in said), said
    assert any("beat sends celery_threads.dispatch every 1.0s" in m for m in said), said
    service.scheduler.close()


def test_the_tick_log_filter_leaves_other_log_arguments_alone():
    """redbeat logs its ScheduleEntry objects on celery.beat; comparing each argument with the
    tick's name raised (a ScheduleEntry's __eq__ reads .task), and beat died at --loglevel DEBUG."""
    import logging

    from celery import Celery
    from celery.beat import ScheduleEntry

    from celery_threads.install import _TickAtDebug

    entry = ScheduleEntry(name="x", task="y", schedule=1.0, app=Celery("f", set_as_current=False))
    record = logging.LogRecord(
        "celery.beat", logging.INFO, __file__, 1, "beat: Stored entry: %s", (entry,), None
    )
    assert _TickAtDebug().filter(record) is True and record.levelno == logging.INFO
