"""``celery threads`` errors: one JSON object on stdout under --json, an exit status per kind, no
traceback for an expected error, and ids with control characters escaped in text output.

The commands run through click's CliRunner (and one as a real process) on a redis-server of this
module's own: some tests fill its memory or restrict its users, which no other test may see.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from celery.bin.celery import celery as celery_command
from click.testing import CliRunner, Result

from celery_threads import Threads
from celery_threads.gate import access
from celery_threads.runtime import reset
from tests.conftest import RedisServer
from tests.operations.test_cli import celery_process
from tests.support.helpers import tid
from tests.support.isolated import (
    GATE_DB,
    isolated,
    isolated_env,
    kill_member,
    own_server,
    pointed_at,
    run_cli,
)

ODD = "line1\nline2\x1b[31mRED\x1b[0m\r\t"  # a newline, an ANSI colour, CR and tab


@pytest.fixture(scope="module")
def server() -> Iterator[RedisServer]:
    yield from own_server()


@pytest.fixture
def app(proj, server):
    with isolated(proj.app, server) as app:
        yield app


@pytest.fixture
def env(server) -> dict[str, str]:
    return {**isolated_env(server), "COLUMNS": "80"}


@pytest.fixture
def cli(app, env):
    """``celery -A tests.support.proj threads ARGS`` in this process; an exception that escaped
    the command (a traceback) fails the test."""

    def run(*args: str, input: str | None = None) -> Result:
        result = run_cli(env, *args, input=input)
        assert "Traceback" not in result.output
        return result

    return run


def json_error(result: Result, kind: str, exit_code: int) -> dict[str, Any]:
    """The one JSON object on stdout of a failed --json command, its exit status checked."""
    assert result.exit_code == exit_code, (result.stdout, result.stderr)
    error = json.loads(result.stdout)
    assert (error["kind"], error["exit_code"]) == (kind, exit_code)
    assert error["error"] and error["error"] in result.stderr  # the message, on stderr too
    return error


# -- --json errors ----------------------------------------------------------------------------


def test_json_errors_of_what_is_not_there(proj, app, cli):
    thread = tid("cli-err")
    proj.record.delay(thread, "a")
    waiting = proj.record.delay(thread, "b").id

    error = json_error(cli("show", "no-such-thread", "--json"), "not_found", 1)
    assert "no thread 'no-such-thread'" in error["error"]
    json_error(cli("delete", "no-such-task", "--json"), "not_found", 1)
    json_error(cli("restart", "no-such-task", "--json"), "not_found", 1)
    json_error(cli("forget", "no-such-task", "--json"), "not_found", 1)
    error = json_error(cli("restart", waiting, "--json"), "conflict", 1)
    assert "live member" in error["error"]


def test_json_errors_of_the_command_line(cli):
    error = json_error(cli("show", "", "--json"), "usage", 2)  # an empty thread id
    assert "thread id is empty" in error["error"]
    json_error(cli("show", "L" * 1025, "--json"), "usage", 2)
    error = json_error(cli("show", "--json"), "usage", 2)
    assert "THREAD_ID" in error["error"]
    json_error(cli("forget", "--json"), "usage", 2)
    json_error(cli("no-such-command", "--json"), "usage", 2)


def test_json_error_of_a_question_answered_no(proj, app, cli):
    thread = tid("cli-err")
    proj.record.delay(thread, "a")
    proj.record.delay(thread, "b")  # waits: a question to answer
    result = cli("purge", "--json", input="n\n")
    json_error(result, "aborted", 1)
    assert "Aborted" in result.stderr


def test_json_errors_of_settings_and_an_unreachable_gate(app, env, cli):
    port = RedisServer().port  # a free port, with no server on it
    with pointed_at(app, threads_redis_url=f"redis://127.0.0.1:{port}/0"):
        error = json_error(cli("ls", "--json"), "unavailable", 69)
    assert f"127.0.0.1:{port}" in error["error"] and "threads_redis_url" in error["error"]
    with pointed_at(app, threads_redis_url=None, broker_url="amqp://guest@127.0.0.1:1//"):
        error = json_error(cli("stats", "--json"), "config", 78)
    assert "threads_redis_url" in error["error"]
    # A database the server does not have is a setting to fix, not an error of the server.
    with pointed_at(app, threads_redis_url=app.conf.threads_redis_url.rsplit("/", 1)[0] + "/99"):
        error = json_error(cli("ls", "--json"), "config", 78)
    assert "no database of the URL's number" in error["error"], error

    # A real process too: stdout is the JSON object, stderr the message.
    done = celery_process({**env, "CT_REDIS_URL": f"redis://127.0.0.1:{port}/0"}, "stats", "--json")
    assert done.returncode == 69 and "Traceback" not in done.stderr
    assert json.loads(done.stdout)["kind"] == "unavailable"
    assert "cannot reach the gate's Redis" in done.stderr


def test_a_full_gate_is_a_clear_error_not_a_traceback(app, server, cli):
    thread = tid("cli-oom")
    admin = redis.Redis(port=server.port)
    admin.config_set("maxmemory-policy", "noeviction")
    admin.config_set("maxmemory", 1)  # every write is refused: OOM
    try:
        result = cli("pause", thread)
        text, as_json = result, cli("pause", thread, "--json")
    finally:
        admin.config_set("maxmemory", 0)
    assert text.exit_code == 75 and text.stdout == ""
    [line] = text.stderr.splitlines()
    assert "out of memory" in line and "maxmemory" in line
    json_error(as_json, "out_of_memory", 75)
    assert Threads(app).status(thread) is None  # nothing was paused


def test_a_redis_user_without_rights_is_a_clear_error_not_a_traceback(app, server, cli):
    thread = tid("cli-noperm")
    admin = redis.Redis(port=server.port)
    admin.execute_command("ACL", "SETUSER", "ct-op", "on", ">secret", "~*", "&*", "+@all")
    user_url = f"redis://ct-op:{{}}@127.0.0.1:{server.port}/{GATE_DB}"
    try:
        with pointed_at(app, threads_redis_url=user_url.format("secret")):
            assert cli("pause", thread).exit_code == 0  # the gate's rights checked, in this process
            # A right taken away after that check: Redis itself refuses the command (NOPERM).
            admin.execute_command("ACL", "SETUSER", "ct-op", "-@scripting")
            text, as_json = cli("resume", thread), cli("resume", thread, "--json")
            # Checked at start (a new process): the rights it names are permissions, 77 (78).
            access._checked.clear()
            reset(app)
            missing = cli("ls", "--json")
        with pointed_at(app, threads_redis_url=user_url.format("wrong")):
            wrong = cli("ls", "--json")
    finally:
        admin.acl_deluser("ct-op")
    assert text.exit_code == 77 and text.stdout == ""
    [line] = text.stderr.splitlines()
    assert "refused the command for its user" in line and "no permissions" in line
    assert "secret" not in line
    json_error(as_json, "permission", 77)
    assert "+evalsha" in json_error(missing, "permission", 77)["error"]
    error = json_error(wrong, "permission", 77)  # a wrong password (WRONGPASS)
    assert "ct-op:**@" in error["error"] and ":wrong@" not in error["error"]


def test_an_unexpected_error_is_a_bug_with_its_own_status(app, cli, monkeypatch):
    def broken(self, thread_id, limit=None):
        raise RuntimeError("a bug")

    monkeypatch.setattr(Threads, "status", broken)
    result = CliRunner().invoke(
        celery_command, ["-A", "tests.support.proj", "threads", "show", "x", "--json"], env={}
    )
    error = json_error(result, "internal", 70)
    assert "RuntimeError: a bug" in error["error"]
    assert "Traceback" in result.stderr  # a bug is reported with where it happened


# -- nothing to do ----------------------------------------------------------------------------


def test_nothing_to_do_is_done(cli):
    result = cli("resume", "no-such-thread")
    assert result.exit_code == 0, result.output
    assert "is not paused: nothing to resume" in result.stdout
    result = cli("resume", "no-such-thread", "--json")
    assert result.exit_code == 0
    assert json.loads(result.stdout) == {"thread_id": "no-such-thread", "resumed": False}
    for args in (("purge", "-f", "no-such-thread"), ("redrive", "no-such-thread")):
        result = cli(*args, "--json")
        assert result.exit_code == 0, (args, result.output)
        assert set(json.loads(result.stdout).values()) == {0}
    # `dead --limit 0` lists every letter: `redrive --limit 0` is refused, not read as "none".
    result = cli("redrive", "--limit", "0")
    assert result.exit_code == 2 and "0 is not in the range x>=1" in result.output, result.output
    # Nothing to drop: no question (with no answer to give, it aborted with status 1).
    result = cli("purge", "no-such-thread", input="")
    assert result.exit_code == 0 and "Dropped 0 waiting members" in result.stdout, result.output
    # Both commands that ask take both spellings of "do not ask".
    for args in (
        ("purge", "-y", "no-such-thread"),
        ("purge", "--yes", "no-such-thread"),
        ("forget", "--all", "-f"),
    ):
        result = cli(*args, "--json")
        assert result.exit_code == 0, (args, result.output)


# -- ids with control characters --------------------------------------------------------------


def test_ids_with_control_characters_are_escaped_in_text_and_raw_in_json(proj, app, cli):
    plain = tid("cli-plain")
    first = proj.record.delay(ODD, "a").id
    proj.record.delay(plain, "b")
    shown = repr(ODD)

    out = cli("ls").stdout
    assert "\x1b" not in out and "\r" not in out and "\t" not in out
    lines = out.splitlines()
    assert len(lines) == 4 and lines[-1] == "2 threads"  # header, two rows, count
    rows = {line.split()[0] + line[-len(plain) :]: line for line in lines[1:-1]}
    assert any(line.endswith(shown) for line in rows.values())
    assert any(line.endswith(f"  {plain}") for line in rows.values())  # a plain id as it is
    data = json.loads(cli("ls", "--json").stdout)
    assert sorted(row["thread_id"] for row in data) == sorted([ODD, plain])

    out = cli("show", ODD).stdout
    assert out.startswith(f"Thread {shown}: 1 member") and "\x1b" not in out
    assert json.loads(cli("show", ODD, "--json").stdout)["thread_id"] == ODD

    out = cli("pause", ODD, "--reason", "two\nlines").stdout
    assert out.startswith(f"Paused thread {shown}: two\\nlines.") and len(out.splitlines()) == 1
    assert "\x1b" not in cli("ls", "--paused").stdout
    assert cli("resume", ODD).stdout == f"Resumed thread {shown}.\n"

    assert cli("delete", first).stdout == f"Deleted member {first} of thread {shown}.\n"
    kill_member(Threads(app).gate, ODD, "dead\x1b[2J")
    out = cli("dead").stdout
    assert "\x1b" not in out and f"{'dead' + chr(27) + '[2J'!r}" in out and shown in out
    assert [d["thread_id"] for d in json.loads(cli("dead", "--json").stdout)] == [ODD]
    out = cli("redrive", "--dry-run").stdout
    assert "\x1b" not in out and shown in out
    out = cli("restart", "dead\x1b[2J").stdout
    assert out == f"Restarted {'dead' + chr(27) + '[2J'!r} in thread {shown} as a new arrival.\n"


def test_ids_that_would_read_alike_are_told_apart_and_hints_are_shell_quoted(proj, cli):
    """ "trail" and "trail " printed the same row, a printable "'a\\x00b'" read as the id holding a
    NUL, and the commands a hint gives were unquoted (``resume trail `` loses the space, an id
    starting with a dash reads as an option)."""
    base = tid("cli-alike")
    spaced, quoted, dashed = f"{base} ", f"'{base}\\x00'", f"-{base}"
    for thread in (base, spaced, quoted, dashed):
        proj.record.delay(thread, "a")
    out = cli("ls").stdout
    assert any(line.endswith(f"  {base}") for line in out.splitlines())
    assert any(line.endswith(f"  {spaced!r}") for line in out.splitlines())
    assert any(line.endswith(f"  {quoted!r}") for line in out.splitlines())
    for thread, hint in (
        (spaced, f"`celery -A tests.support.proj threads resume '{spaced}'`"),
        (dashed, f"`celery -A tests.support.proj threads resume -- {dashed}`"),
    ):
        out = cli("pause", "--", thread).stdout
        assert hint in out, out
        assert cli("resume", "--", thread).exit_code == 0  # the hint's command works as given
    out = cli("pause", "--", quoted).stdout
    assert f"""`celery -A tests.support.proj threads resume ''"'"'{base}\\x00'"'"''`""" in out, out
    cli("resume", quoted)


def test_ticks_that_expired_unrun_are_discarded_at_debug(proj, caplog):
    """Beat's dispatch ticks queued while no worker ran expire; the first worker discarded each
    with an INFO line ("Discarding revoked task"), hundreds at once after a few minutes."""
    import logging

    from celery_threads.protocol import DISPATCH_TASK

    name = proj.record.name  # the app's threaded tasks bound: the package installed
    logger = logging.getLogger("celery.worker.request")
    with caplog.at_level(logging.INFO, logger="celery.worker.request"):
        logger.info("Discarding revoked task: %s[%s]", DISPATCH_TASK, "tick-id")
        logger.info("Discarding revoked task: %s[%s]", name, "task-id")
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO]
    assert said == [f"Discarding revoked task: {name}[task-id]"], said


def test_log_lines_show_ids_with_control_characters_escaped(caplog):
    """The package's own log lines (a member died, a lost attempt...) wrote ids raw: a NUL made
    grep take the worker's log for a binary file, and escape sequences reached terminals."""
    import logging

    import celery_threads.dispatcher
    import celery_threads.worker.request  # noqa: F401

    for name in ("celery_threads.dispatcher", "celery_threads.worker.request", "celery_threads.gate.client"):
        with caplog.at_level(logging.INFO, logger=name):
            logging.getLogger(name).warning("member %s of thread %s: %d", "a\x00b", "t\x1b[2J\n", 3)
        message = caplog.records[-1].getMessage()
        assert message == "member 'a\\x00b' of thread 't\\x1b[2J\\n': 3", (name, message)


# -- restart of a live member -----------------------------------------------------------------


def test_restart_of_a_live_member_says_it_is_live_not_dead(proj, cli):
    thread = tid("cli-live")
    proj.record.delay(thread, "a")
    waiting = proj.record.delay(thread, "b").id
    result = cli("restart", waiting)
    assert result.exit_code == 1 and result.stdout == ""
    message = result.stderr
    assert f"'{waiting}' is a live member of thread '{thread}' (not dead)" in message
    assert "nothing to restart" in message and "dead-letter store" not in message
    assert f"celery -A tests.support.proj threads show {thread}" in message


def test_a_reader_that_goes_away_ends_the_command_quietly(proj, app, env):
    """``celery threads ls | head -1``: the command stops as a process SIGPIPE ends, with no
    traceback (it exited 70, reporting a bug)."""
    import os
    import subprocess
    import sys

    from tests.operations.test_cli import ROOT

    for i in range(1500):  # a listing longer than a pipe's buffer
        proj.record.apply_async((f"{tid('pipe')}-{i}", "later"), countdown=3600)
    proc = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "tests.support.proj", "threads", "ls", "--limit", "1500"],
        env={**os.environ, **env, "PYTHONPATH": str(ROOT)},
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout is not None and proc.stderr is not None
    assert proc.stdout.readline().split()[0] == b"MEMBERS"
    proc.stdout.close()  # as `head -1` does once it has its line
    assert proc.wait(60) == 141
    assert b"Traceback" not in proc.stderr.read()
