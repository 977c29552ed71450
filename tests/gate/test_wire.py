"""The hot path's script calls, packed by the gate itself (gate._Packer), are byte for byte what
redis-py would send for the same call."""

from __future__ import annotations

import pytest
import redis

from celery_threads.gate import Gate, ReleasePush
from celery_threads.keys import Keys


def test_packed_calls_are_redis_pys():
    conn = redis.Connection()
    for direct in (None, ReleasePush(gate_db=0, broker_db=1, key_prefix="pfx:")):
        for shards in (1, 4):
            gate = Gate(redis.Redis(), Keys("P", shards), release_timeout_ms=1234, direct=direct)
            for thread in ("t1", "é-ü:{x}", "a" * 300, ""):
                for name, args in (
                    ("claim", ("task", "7", 30_000, "w@h")),
                    ("finish", ("task", "7")),
                    ("enqueue", ("x", b"\x00\xff\n", 1.5, -1, "in", 0)),
                ):
                    keys, argv = gate._arguments(thread, args)
                    expected = b"".join(
                        conn.pack_command("EVALSHA", gate._scripts[name].sha, len(keys), *keys, *argv)
                    )
                    assert gate._command(name, thread, args) == expected, (name, thread)


def test_the_model_clock_goes_the_generic_way():
    conn = redis.Connection()
    gate = Gate(redis.Redis(), Keys("P"), release_timeout_ms=1, clock=lambda: 42)
    keys, argv = gate._arguments("t", ("task", "1"))
    assert argv[0] == "42"
    assert gate._command("finish", "t", ("task", "1")) == b"".join(
        conn.pack_command("EVALSHA", gate._scripts["finish"].sha, len(keys), *keys, *argv)
    )


def test_fields_and_queue_members(redis_server):
    """lua/_member.lua: a task id's field in the tasks hash (14 bytes for a UUID, whose record keeps
    the other two) and its queue member (a seq before the field), the same in Lua and Python;
    members ordered by Redis as a thread queue orders equal scores are in seq order."""
    from celery_threads.gate import member_field, record_task, task_field
    from celery_threads.gate.library import _load_lua

    client = redis.Redis(port=redis_server.port)
    encode = client.register_script(
        _load_lua("_member.lua")
        + """
        local out = {}
        for i = 1, #ARGV, 2 do
          local f, tail = task_field(ARGV[i + 1])
          local m = queue_member(ARGV[i], f)
          local rec = tail and '\\2' .. tail .. '1|0|-1|0|1\\nt' or '1|0|-1|0|1\\nt'
          redis.call('ZADD', KEYS[1], 0, m)
          out[#out + 1] = f
          out[#out + 1] = m
          out[#out + 1] = rec
          out[#out + 1] = field_task(member_field(m), rec)
        end
        return out"""
    )
    ids = [
        "0b6f3c1e-9a2d-4c57-8e1f-2a3b4c5d6e7f",
        "0B6F3C1E-9A2D-4C57-8E1F-2A3B4C5D6E7F",
        "not-a-uuid",
        "",
        "u",
        "x" * 13,
        "x" * 14,
        "x" * 16,
        "\x01" * 14,
        "é" * 7,
        "é\x00x",
        "0b6f3c1e9a2d4c578e1f2a3b4c5d6e7f",
        "00000000-0000-0000-0000-000000000000",
        "ffffffff-ffff-ffff-ffff-ffffffffffff",
        "0b6f3c1e-9a2d-4c57-8e1f-2a3b4c5d0000",
    ]
    seqs = [1, 255, 256, 65_535, 65_536, 2**24, 2**40 + 7, 2**53 - 1, 9, 10, 11, 12, 13, 14, 15]
    key = "test-wire:members"
    client.delete(key)
    argv = [x for seq, task in zip(seqs, ids) for x in (str(seq), task)]
    out = encode(keys=[key], args=argv)
    fields, members, records, decoded = out[::4], out[1::4], out[2::4], out[3::4]
    print(out)
    assert [d.decode() for d in decoded] == ids
    assert fields == [task_field(t)[0] for t in ids]  # Lua and Python agree
    assert [r[1:3] if r[:1] == b"\x02" else None for r in records] == [task_field(t)[1] for t in ids]
    assert [record_task(f, r) for f, r in zip(fields, records)] == ids
    assert [member_field(m) for m in members] == fields
    # Only lowercase UUIDs shrink; two sharing their first 14 bytes share a short field (the gate
    # keys the second one to arrive by its long form, see test_uuid_prefix_collisions).
    assert [len(f) for f in fields][:2] == [14, 37]
    assert fields[0] == fields[-1] and len(set(fields)) == len(ids) - 1
    assert len(members[0]) == 1 + 1 + 14  # a one-byte seq and a UUID
    by_seq = [m for _, m in sorted(zip(seqs, members))]
    assert client.zrange(key, 0, -1) == by_seq
    client.delete(key)


def _server_of_its_own(binary=None):
    """A redis-server started for one test, stopped and its directory removed after it."""
    import shutil

    from tests.conftest import RedisServer

    server = RedisServer(binary=binary)
    server.start()
    yield server
    server.stop()
    shutil.rmtree(server.dir, ignore_errors=True)


@pytest.fixture
def private_redis():
    """For a test that flushes its scripts and kills every client's connection: on the session's
    server, those would be the other tests' and the session worker's (a control broadcast of a
    later test then met a connection closed)."""
    yield from _server_of_its_own()


def test_the_direct_line_reads_what_the_server_replies(private_redis):
    """The hot path's own reply reader (gate.ScriptLine, _parse_reply): a script's array of bulk
    strings (one longer than a socket read) and integers; nested arrays and nulls; the server's
    error raised as redis-py would raise it; a script the server lost (SCRIPT FLUSH) and a
    connection the server closed both go the client's way, which loads and reconnects."""
    from celery_threads.gate import make_client
    from celery_threads.gate.wire import _MISSED, _pack, _parse_reply

    client = make_client(private_redis.url())
    gate = Gate(client, Keys("W"), release_timeout_ms=1000, keepalive_ms=1000)
    line = gate._line
    big = "x" * 200_000
    sha = client.script_load("return {1, '', ARGV[1], 7, {2, false}}")

    def call(*argv):
        return line.call(lambda functions: _pack(("EVALSHA", sha, 0, *argv)))

    assert call(big) is _MISSED  # the first call opens the line
    assert call(big) == [1, b"", big.encode(), 7, [2, None]]
    # A reply of many reads (a handed-off member's 30 MB message) is read into one growing
    # buffer (bytes joined read by read took quadratic time: minutes for 150 MB), and its
    # strings are bytes all the same.
    huge = call("y" * 30_000_000)
    assert huge[2] == b"y" * 30_000_000 and type(huge[2]) is bytes
    assert _parse_reply(b"*2\r\n$3\r\nabc\r\n:5\r\n", 0) == ([b"abc", 5], 17)
    assert _parse_reply(bytearray(b"*1\r\n$3\r\nabc\r\n"), 0) == ([b"abc"], 13)
    failing = client.script_load("return redis.call('INCR', KEYS[1])")
    client.set("W:text", "not a number")
    with pytest.raises(redis.ResponseError, match="not an integer"):
        line.call(lambda functions: _pack(("EVALSHA", failing, 1, "W:text")))
    client.script_flush()
    assert call("a") is _MISSED  # NOSCRIPT: the client's way loads it
    client.script_load("return {1, '', ARGV[1], 7, {2, false}}")
    assert call("a") == [1, b"", b"a", 7, [2, None]]
    client.client_kill_filter(_type="normal", skipme=True)
    assert call("a") is _MISSED  # closed by the server: the line reopens
    assert call("a") is _MISSED
    assert call("b") == [1, b"", b"b", 7, [2, None]]
    # the gate's own calls through the line, end to end
    released = gate.enqueue("t", "task-1", b"envelope").release
    assert released is not None and gate.claim("t", "task-1", released.token, "w") == 1
    assert gate.finish("t", "task-1", released.token).done


def test_a_call_on_a_line_its_stopped_server_closed_is_not_one_that_may_have_run(private_redis):
    """A server that stopped while the line was idle (a worker's body ran meanwhile) closed its
    connection: the next call is not written into it and then counted as one that went out
    unanswered (deadline.unanswered), which would make a worker store the result of an ending the
    gate never received (member._record_end) while the gate runs the member again."""
    from celery_threads.gate import deadline, make_client

    client = make_client(private_redis.url())
    gate = Gate(client, Keys("W"), release_timeout_ms=1000, keepalive_ms=1000)
    for thread in ("t1", "t2"):  # the first calls open the line, the next go through it
        released = gate.enqueue(thread, f"task-{thread}", b"envelope").release
        assert released is not None and gate.claim(thread, f"task-{thread}", released.token, "w") == 1
    private_redis.stop(kill=True)
    with deadline.within(1.0, bound="the test") as limit:
        with pytest.raises(redis.RedisError):
            gate.finish("t2", "task-t2", released.token)
    assert limit.unanswered is False


@pytest.fixture
def own_redis():
    """A redis-server of the test's own: it counts the commands of this test alone.  The newest
    found (these tests are about Redis 7's functions), whichever CT_REDIS_SERVER names."""
    from tests.conftest import redis_binaries

    newest = next(iter(redis_binaries().items()), None)
    if newest is None or int(newest[0].split(".")[0]) < 7:
        pytest.skip("no redis-server 7 or newer")
    yield from _server_of_its_own(newest[1])


def test_the_hot_path_calls_the_library_and_recovers_it(own_redis):
    """On Redis 7 the gate's hot path calls the transitions as the functions of its library
    (FCALL), loaded when its line connects; after FUNCTION FLUSH it goes the scripts' way once
    and loads the library again.  Packed FCALLs are what redis-py would send."""
    from celery_threads.gate import make_client

    client = make_client(own_redis.url())
    gate = Gate(client, Keys("F"), release_timeout_ms=1000, keepalive_ms=1000)
    conn = redis.Connection()
    keys, argv = gate._arguments("t", ("task", "7"))
    assert gate._command("finish", "t", ("task", "7"), functions=True) == b"".join(
        conn.pack_command("FCALL", gate.library.functions["finish"], len(keys), *keys, *argv)
    )

    def life(task: str) -> None:
        released = gate.enqueue("t", task, b"envelope").release
        assert released is not None and gate.claim("t", task, released.token, "w") == 1
        assert gate.finish("t", task, released.token).done

    def calls() -> dict:
        stats = client.info("commandstats")
        return {k: stats.get(f"cmdstat_{k}", {}).get("calls", 0) for k in ("fcall", "evalsha")}

    life("a")  # opens the line, loading the library
    before = calls()
    life("b")
    assert calls() == {"fcall": before["fcall"] + 3, "evalsha": before["evalsha"]}
    names = [dict(zip(lib[::2], lib[1::2]))[b"library_name"] for lib in client.function_list()]
    assert names == [gate.library.name.encode()]
    client.function_flush()
    life("c")
    life("d")
    after = calls()
    assert after["fcall"] >= before["fcall"] + 5, after  # back on the library
    assert client.function_list()


def test_a_library_of_our_name_with_other_code_is_not_called(own_redis, caplog):
    """A library already on the server under the gate's library name is used only when it holds
    exactly the gate's code: one of that name with other bodies (here, functions answering a
    fixed reply) is never called; the transitions go through the scripts, and one warning names
    the library."""
    from celery_threads.gate import function_library, make_client

    library = function_library()
    client = make_client(own_redis.url())
    client.function_load(
        f"#!lua name={library.name}\n"
        + "".join(
            f"redis.register_function('{name}', function() return {{1, '0'}} end)\n"
            for name in library.functions.values()
        )
    )
    caplog.set_level("WARNING", logger="celery_threads.gate")
    for n in range(2):  # two gates: two lines, each checks the library, one warning
        gate = Gate(client, Keys("L"), release_timeout_ms=1000, keepalive_ms=1000)
        for task in (f"a{n}", f"b{n}", f"c{n}"):
            released = gate.enqueue("t", task, b"envelope").release
            assert released is not None and released.task_id == task
            assert gate.claim("t", task, released.token, "w") == 1
            assert gate.finish("t", task, released.token).done
            assert gate.reads.snapshot("t") is None
    assert client.info("commandstats").get("cmdstat_fcall", {}).get("calls", 0) == 0
    warned = [r for r in caplog.records if library.name in r.getMessage()]
    assert len(warned) == 1 and "EVALSHA" in warned[0].getMessage()


def test_a_gate_on_a_unix_socket_serves_producers_and_workers(proj, make_deployment, redis_server):
    """``threads_redis_url = "unix:///path/redis.sock"``, a scheme the settings name: the client
    gave the socket's connection TCP keepalive options, which it refuses, so every producer call
    raised ConfigurationError ("UnixDomainSocketConnection does not take them").  Now a producer
    and a prefork worker (its hot path's own line included) run a thread's members in order,
    and the thread's keys vanish with its last member."""
    import shutil
    import tempfile

    from celery_threads import Threads
    from tests.conftest import RedisServer
    from tests.support.helpers import assert_serial, starts, tid, wait_for

    socket_dir = tempfile.mkdtemp(prefix="ct-sock-")
    gate = RedisServer(args=("--unixsocket", f"{socket_dir}/r.sock", "--unixsocketperm", "700"))
    gate.start()
    d = None
    try:
        d = make_deployment(
            CT_REDIS_URL=f"unix://{socket_dir}/r.sock?db=0",
            CT_BACKEND_URL=redis_server.url(2),
            CT_HISTORY_URL=redis_server.url(0),
        )
        d.worker("unix", concurrency=2)
        thread = tid("unix")
        results = [proj.record.delay(thread, f"m{i}") for i in range(4)]
        assert [result.get(timeout=30) for result in results] == [f"m{i}" for i in range(4)]
        r = proj.history()
        assert starts(r, thread) == [f"m{i}" for i in range(4)]
        assert_serial(r, thread)
        wait_for(lambda: Threads(proj.app).get(thread) is None, what="the thread's end")
        keys = redis.Redis(unix_socket_path=f"{socket_dir}/r.sock").keys(f"*{thread}*")
        assert keys == []
    finally:
        try:
            if d is not None:
                d.stop()  # raises when its worker met an unrecoverable error
        finally:
            gate.stop()
            shutil.rmtree(gate.dir, ignore_errors=True)
            shutil.rmtree(socket_dir, ignore_errors=True)
