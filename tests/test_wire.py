"""The hot path's script calls, packed by the gate itself (gate._Packer), are byte for byte what
redis-py would send for the same call."""
from __future__ import annotations

import redis

from celery_threads.gate import DirectRelease, Gate
from celery_threads.keys import Keys


def test_packed_calls_are_redis_pys():
    conn = redis.Connection()
    for direct in (None, DirectRelease(gate_db=0, broker_db=1, key_prefix="pfx:")):
        for shards in (1, 4):
            gate = Gate(redis.Redis(), Keys("P", shards), release_timeout_ms=1234, direct=direct)
            for thread in ("t1", "é-ü:{x}", "a" * 300, ""):
                for name, args in (("claim", ("task", "7", 30_000, "w@h")),
                                   ("finish", ("task", "7")),
                                   ("enqueue", ("x", b"\x00\xff\n", 1.5, -1, "in", 0))):
                    keys, argv = gate._arguments(thread, args)
                    expected = b"".join(conn.pack_command(
                        "EVALSHA", gate._scripts[name].sha, len(keys), *keys, *argv))
                    assert gate._command(name, thread, args) == expected, (name, thread)


def test_the_model_clock_goes_the_generic_way():
    conn = redis.Connection()
    gate = Gate(redis.Redis(), Keys("P"), release_timeout_ms=1, clock=lambda: 42)
    keys, argv = gate._arguments("t", ("task", "1"))
    assert argv[0] == "42"
    assert gate._command("finish", "t", ("task", "1")) == b"".join(
        conn.pack_command("EVALSHA", gate._scripts["finish"].sha, len(keys), *keys, *argv))
