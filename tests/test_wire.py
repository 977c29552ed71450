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


def test_queue_members_sort_by_arrival_and_name_their_task(redis_server):
    """lua/_member.lua's members, ordered by Redis as a thread queue orders equal scores, are in
    seq order and give back their task ids (UUIDs in 16 bytes, anything else as written)."""
    from celery_threads.gate import _load_lua, queued_task

    client = redis.Redis(port=redis_server.port)
    encode = client.register_script(_load_lua("_member.lua") + """
        local out = {}
        for i = 1, #ARGV, 2 do
          local m = queue_member(ARGV[i], ARGV[i + 1])
          redis.call('ZADD', KEYS[1], 0, m)
          out[#out + 1] = m
          out[#out + 1] = task_of(m)
        end
        return out""")
    ids = ["0b6f3c1e-9a2d-4c57-8e1f-2a3b4c5d6e7f", "0B6F3C1E-9A2D-4C57-8E1F-2A3B4C5D6E7F",
           "not-a-uuid", "", "u", ":", "é\x00x", "0b6f3c1e9a2d4c578e1f2a3b4c5d6e7f",
           "0b6f3c1e-9a2d-4c57-8e1f-2a3b4c5d6e7f-x"]
    seqs = [1, 255, 256, 65_535, 65_536, 2**24, 2**40 + 7, 2**53 - 1, 9]
    key = "test-wire:members"
    client.delete(key)
    argv = [x for seq, task in zip(seqs, ids) for x in (str(seq), task)]
    out = encode(keys=[key], args=argv)
    members, decoded = out[::2], out[1::2]
    assert [d.decode() for d in decoded] == ids
    assert [queued_task(m) for m in members] == ids
    assert len(members[0]) == 1 + 1 + 1 + 16          # a UUID and a one-byte seq: 19 bytes
    by_seq = [m for _, m in sorted(zip(seqs, members))]
    assert client.zrange(key, 0, -1) == by_seq
    client.delete(key)
