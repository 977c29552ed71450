"""The gate spread over shards: on one Redis (``threads_shards=4``) and on a real 3-master Redis
Cluster the suite starts, with real workers.  The broker, result backend and the tasks' history
stay on the suite's plain redis-server; the heartbeats' clock is that server's ``TIME``, one clock
for every node's members.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from celery.bin.celery import celery as celery_command
from click.testing import CliRunner
from redis.crc import key_slot

from celery_threads import Threads
from celery_threads.errors import ConfigurationError
from celery_threads.gate import Gate, make_client
from celery_threads.gate.cluster import check_shards
from celery_threads.keys import Keys, shard_tag
from tests.conftest import Deployment, RedisServer, configure_client, deployment_env
from tests.support.helpers import assert_serial, starts, tid, wait_for
from tests.support.isolated import point_app
from tests.support.scenarios import RECOVERY_RELEASE_TIMEOUT, crash_recovery, mixed_load


@pytest.fixture
def r(proj):
    return proj.history()


@pytest.fixture
def sharded(proj, redis_server: RedisServer) -> Iterator[Any]:
    """``make(gate_url, shards, cluster, **env)``: a deployment whose gate is at ``gate_url``
    with that many shards, the broker, backend and history on the suite's redis-server; the
    in-test app pointed at it until the test ends."""
    made: list[Deployment] = []

    def make(gate_url: str, shards: int, cluster: bool, **overrides: str) -> Deployment:
        name = uuid.uuid4().hex[:8]
        env = deployment_env(
            redis_server,
            **{
                "CT_KEY_PREFIX": f"ct-{name}",
                "CT_QUEUE": f"q-{name}",
                "CT_REDIS_URL": gate_url,
                "CT_HISTORY_URL": redis_server.url(0),
                "CT_SHARDS": str(shards),
                "CT_CLUSTER": "1" if cluster else "0",
                **overrides,
            },
        )
        d = Deployment(env)
        configure_client(proj.app, **env)
        point_app(
            proj.app,
            {"threads_shards": shards, "threads_redis_options": {"cluster": True} if cluster else {}},
        )
        made.append(d)
        return d

    yield make
    for d in made:
        d.stop()
    point_app(proj.app, {"threads_shards": 1, "threads_redis_options": {}})
    configure_client(proj.app, **deployment_env(redis_server))


def _threads_cli(env: dict[str, str], *args: str) -> Any:
    cli_env = {**env, "COLUMNS": "200"}
    result = CliRunner().invoke(
        celery_command, ["-A", "tests.support.proj", "threads", *args, "--json"], env=cli_env
    )
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


# -- shards without a server ---------------------------------------------------------------------
def test_shard_tags_spread_over_the_slots_and_one_shard_keeps_its_tag():
    assert Keys("p").shard(0).seq == "p:{0}:seq"
    for shards in (2, 3, 4, 16):
        slots = [key_slot(Keys("p", shards).shard(i).seq.encode()) for i in range(shards)]
        assert [s * shards // 16384 for s in slots] == list(range(shards)), slots
        assert len({shard_tag(i, shards) for i in range(shards)}) == shards
    keys = Keys("p", 4).thread("acct-1")
    assert len({key_slot(k.encode()) for k in keys.script_keys()}) == 1


def test_changing_the_shard_count_is_refused_until_the_operator_clears_it(redis_server):
    client = make_client(redis_server.url(12))
    prefix = f"sc-{uuid.uuid4().hex[:6]}"
    four = Keys(prefix, 4)
    check_shards(client, four)
    gate = Gate(client, four, release_timeout_ms=60_000)
    outcome = gate.enqueue("acct-1", str(uuid.uuid4()), b"envelope")
    check_shards(client, four)
    with pytest.raises(ConfigurationError, match="threads_shards=4"):
        check_shards(client, Keys(prefix, 2))
    assert outcome.release is not None
    gate.delete(outcome.release.task_id, thread_id="acct-1")
    # An empty gate keeps its count too: processes with the old one may still run (a rolling
    # deploy), and two layouts at once would each hold an active member of a thread.
    with pytest.raises(ConfigurationError, match=f"delete the key '{prefix}:shards'"):
        check_shards(client, Keys(prefix, 2))
    assert int(client.get(Keys(prefix).meta)) == 4
    client.delete(Keys(prefix).meta)  # the operator's act, once every process uses the new count
    check_shards(client, Keys(prefix, 2))
    assert int(client.get(Keys(prefix).meta)) == 2
    # A gate from before the count was recorded holds its members under the one-shard tag.
    legacy = f"sc-{uuid.uuid4().hex[:6]}"
    Gate(client, Keys(legacy), release_timeout_ms=60_000).enqueue("a", "t-1", b"envelope")
    with pytest.raises(ConfigurationError, match="threads_shards=1"):
        check_shards(client, Keys(legacy, 4))


def spread(keys: Keys, per_shard: int, prefix: str) -> list[str]:
    """Thread ids, ``per_shard`` of them in each shard of ``keys``."""
    found: dict[int, list[str]] = {i: [] for i in range(keys.shards)}
    while any(len(ids) < per_shard for ids in found.values()):
        thread = tid(prefix)
        if len(found[keys.shard_of(thread)]) < per_shard:
            found[keys.shard_of(thread)].append(thread)
    return [thread for ids in zip(*found.values()) for thread in ids]


def test_waiting_for_replicas_is_refused_on_a_cluster(redis_cluster):
    """threads_wait_replicas needs WAIT on the transition's own connection, which the cluster
    client does not give: a gate asked for it on a cluster refuses to be built."""
    from celery_threads.errors import ConfigurationError

    client = make_client(redis_cluster.url(), {"cluster": True})
    with pytest.raises(ConfigurationError, match="threads_wait_replicas"):
        Gate(client, Keys(f"wr-{uuid.uuid4().hex[:6]}", 3), release_timeout_ms=60_000, wait_replicas=1)


def test_cluster_gate_reloads_what_a_master_lost(redis_cluster):
    """A master without the library or the scripts (restarted, or new) gets them again: calls on
    their own (FCALL, then EVALSHA where FUNCTION is refused) and pipelined ones (EVALSHA)."""
    gate = Gate(
        make_client(redis_cluster.url(), {"cluster": True}),
        Keys(f"rl-{uuid.uuid4().hex[:6]}", 3),
        release_timeout_ms=60_000,
    )
    threads = spread(gate.keys, 2, "rl")

    def forget_everything() -> None:
        for port in redis_cluster.ports:
            redis_cluster.node(port).function_flush()
            redis_cluster.node(port).script_flush()

    released = []
    for thread in threads:
        outcome = gate.enqueue(thread, str(uuid.uuid4()), b"first")
        assert outcome.release is not None
        forget_everything()
        assert gate.claim(thread, outcome.release.task_id, outcome.release.token, "w", "c") == 1
        gate.enqueue(thread, str(uuid.uuid4()), b"second")
        forget_everything()
        ended = gate.finish(thread, outcome.release.task_id, outcome.release.token, caller="c")
        assert ended.done and ended.release is not None
        released.append((thread, ended.release.task_id, ended.release.token))
    forget_everything()
    assert gate.renew_many(released) == [1] * len(released)  # pipelined: Renewal.RENEWED
    assert all(gate.reads.snapshot(t).active["state"] == "RELEASED" for t in threads)


def _lives(gate: Gate, threads: list[str]) -> None:
    """Each thread's member enqueued, claimed and finished."""
    for thread in threads:
        task = str(uuid.uuid4())
        outcome = gate.enqueue(thread, task, b'{"headers":{}}\n{}')
        assert outcome.release is not None
        assert gate.claim(thread, task, outcome.release.token, "w", "c") == 1
        assert gate.finish(thread, task, outcome.release.token, caller="c").done


def _client_calls(gate: Gate, monkeypatch: Any) -> list[Any]:
    """The transitions that go the cluster client's way from now on (its FCALL/EVALSHA)."""
    seen: list[Any] = []
    for name in ("fcall", "evalsha"):
        original = getattr(gate.client, name)

        def counted(*args: Any, _original: Any = original, **kwargs: Any) -> Any:
            seen.append(args[0])
            return _original(*args, **kwargs)

        monkeypatch.setattr(gate.client, name, counted)
    return seen


def test_cluster_hot_path_has_its_own_line_per_master_and_follows_a_moved_slot(redis_cluster, monkeypatch):
    """A cluster gate's transitions go over its own line to each shard's master (not the cluster
    client), one line per master; when a shard's slot moves to another master, the call the old
    master refuses (MOVED) goes the client's way, and the next ones take the line to the new
    master."""
    keys = Keys(f"cl-{uuid.uuid4().hex[:6]}", 6)
    gate = Gate(make_client(redis_cluster.url(), {"cluster": True}), keys, release_timeout_ms=60_000)
    threads = spread(keys, 2, "cl")
    _lives(gate, threads)  # connections opened, the library loaded
    through_client = _client_calls(gate, monkeypatch)
    _lives(gate, threads)
    assert through_client == []
    line = gate._line
    assert sorted(line._lines) == sorted(f"127.0.0.1:{p}" for p in redis_cluster.ports)
    slot = key_slot(keys.shard(0).seq.encode())
    old = redis_cluster.owner(slot)
    new = next(p for p in redis_cluster.ports if p != old)
    redis_cluster.migrate_slot(slot, new, batch=100, pace=0)
    try:
        moved = [t for t in threads if keys.shard_of(t) == 0]
        _lives(gate, moved)
        assert through_client, "the old master's MOVED went the client's way"
        del through_client[:]
        _lives(gate, moved)
        assert through_client == []
        assert line._shard_lines[0] is line._lines[f"127.0.0.1:{new}"]
    finally:  # the module's other tests expect the cluster's first layout
        redis_cluster.migrate_slot(slot, old, batch=100, pace=0)


@pytest.fixture
def fresh_seams() -> Iterator[None]:
    """The seams checked anew, and no broken result left for the module's other tests."""
    from celery_threads import seams

    seams._results.clear()
    yield
    seams._results.clear()


def test_a_cluster_workers_direct_line_check_probes_a_master(redis_cluster, monkeypatch, fresh_seams):
    """At worker start the direct-line seam is probed on a connection to the gate's server; on a
    cluster, to a master (the cluster client has no pool of its own): the seam holds, and the
    worker's pool processes take the line."""
    from celery_threads import seams

    monkeypatch.setattr(seams, "_gate_client", make_client(redis_cluster.url(), {"cluster": True}))
    assert seams._check_direct_line(app=object()) is None


def test_cluster_gate_goes_through_the_client_when_the_direct_line_does_not_hold(
    proj, redis_cluster, monkeypatch, fresh_seams
):
    """The direct-line seam broken (a connection whose socket is not a plain socket): every
    transition on a cluster takes the cluster client's way, and works."""
    import redis

    from tests.support.seam_faults import _Socket  # after proj (the fixture): it imports tests.support.proj

    original = redis.Connection._connect
    monkeypatch.setattr(redis.Connection, "_connect", lambda self: _Socket(original(self)))
    keys = Keys(f"cf-{uuid.uuid4().hex[:6]}", 3)
    gate = Gate(make_client(redis_cluster.url(), {"cluster": True}), keys, release_timeout_ms=60_000)
    threads = spread(keys, 1, "cf")
    _lives(gate, threads)
    through_client = _client_calls(gate, monkeypatch)
    _lives(gate, threads)
    assert len(through_client) == 3 * len(threads)
    assert all(line._usable is False for line in gate._line._lines.values())


# -- with workers ---------------------------------------------------------------------------------
def test_four_shards_on_one_redis(proj, sharded, redis_server, r):
    d = sharded(redis_server.url(0), 4, False)
    d.worker("w1", concurrency=2)
    threads = spread(Keys(d.env["CT_KEY_PREFIX"], 4), 2, "s4")
    seen = mixed_load(proj, r, threads)
    assert set(threads) <= seen["listed"]
    wait_for(lambda: all(Threads(proj.app).get(t) is None for t in threads), what="threads to end")


def test_cluster_semantics_spread_and_listing(proj, sharded, redis_cluster, r):
    d = sharded(redis_cluster.url(), 3, True)
    d.worker("w1", concurrency=2)
    threads = spread(Keys(d.env["CT_KEY_PREFIX"], 3), 3, "cl")  # the first 3: one per shard
    for thread in threads[:3]:  # still waiting while the listing is read
        proj.record.apply_async((thread, "later"), countdown=120)
    prefix = d.env["CT_KEY_PREFIX"]
    per_node = redis_cluster.keys_per_node(prefix)
    assert all(per_node.values()), per_node
    listing = _threads_cli(d.env, "ls")
    assert {row["thread_id"] for row in listing} >= set(threads[:3]), listing
    seen = mixed_load(proj, r, threads[3:])
    assert set(threads) <= seen["listed"]
    dead = _threads_cli(d.env, "dead")
    assert {row["task_id"] for row in dead} >= set(seen["dead"].values()), dead
    info = Threads(proj.app).get(threads[0])
    assert info is not None and [m.state for m in info.waiting] == ["WAITING"]
    shown = _threads_cli(d.env, "show", threads[1])
    assert shown["thread_id"] == threads[1] and shown["members"] == 1, shown
    stats = Threads(proj.app).stats()
    assert stats.threads >= 3 and stats.members["WAITING"] >= 3 and stats.dead >= 6, stats
    for thread in threads[:3]:
        for member in Threads(proj.app).get(thread).waiting:
            Threads(proj.app).delete(member.task_id)


def test_a_large_message_goes_through_a_cluster_gate_within_a_short_bound(proj, sharded, redis_cluster):
    """A call of 64 MB waits for its reply as long as its size needs (gate.deadline
    ``allowance``) on a cluster's connections too, and within the caller's bound: they were not
    bounded connections, so a producer's first call, which goes the cluster client's way, timed
    out after the socket's timeout (5 s: a 150 MB message; here 0.2 s) while Redis still ran it,
    its member stored."""
    import redis

    from tests.support.isolated import pointed_at

    d = sharded(redis_cluster.url(), 3, True)
    thread = tid("cluster-big")
    options = {"cluster": True, "socket_timeout": 0.2}
    with pointed_at(proj.app, threads_publish_timeout=0.2, threads_redis_options=options):
        result = proj.record.apply_async((thread, "x" * (64 << 20)))
    info = Threads(proj.app).get(thread)
    assert info is not None and info.active is not None and info.active.task_id == result.id
    assert Threads(proj.app).delete(result.id)
    redis.Redis.from_url(d.env["CT_BROKER_URL"]).delete(d.env["CT_QUEUE"])


def test_cluster_wake_reaches_the_dispatch_loop(proj, sharded, redis_cluster, r):
    """The workers' loop sleeps for its whole interval (30 s) when nothing is due: a countdown
    member that becomes a shard's earliest head is published on that shard's wake channel, and
    the loop, subscribed on one node, hears it from every master."""
    d = sharded(redis_cluster.url(), 3, True, CT_DISPATCH_INTERVAL="30")
    d.worker("w1", concurrency=1)
    threads = spread(Keys(d.env["CT_KEY_PREFIX"], 3), 1, "wake")
    t0 = time.monotonic()
    results = [proj.record.apply_async((thread, "soon"), countdown=1.0) for thread in threads]
    assert [x.get(timeout=20) for x in results] == ["soon"] * 3
    assert time.monotonic() - t0 < 15, "released by the loop's interval, not by its wake-up"


def test_cluster_crash_recovery(proj, sharded, redis_cluster, r):
    crash_recovery(
        sharded(
            redis_cluster.url(),
            3,
            True,
            CT_KEEPALIVE="2",
            CT_DISPATCH_INTERVAL="0.2",
            CT_RELEASE_TIMEOUT=RECOVERY_RELEASE_TIMEOUT,
        ),
        proj,
        r,
    )


def test_cluster_slot_migration_during_a_run(proj, sharded, redis_cluster, r):
    """Each shard's slot moves to another master while members of every shard run (the first
    by ``redis-cli --cluster reshard``, the others key by key): nothing is lost, nothing runs
    twice, no two members of a thread overlap (the tasks' own start/end records on one
    clock).  The producer keeps each thread a round ahead of its workers until the last slot
    has moved, and a round more: calls meet every move, however long the moves take."""
    d = sharded(redis_cluster.url(), 3, True)
    d.worker("w1", concurrency=2)
    d.worker("w2", concurrency=2)
    keys = Keys(d.env["CT_KEY_PREFIX"], 3)
    threads = spread(keys, 2, "mig")
    moved = threading.Event()

    def migrate() -> None:
        try:
            wait_for(
                lambda: sum(len(starts(r, t)) for t in threads) >= 10,
                timeout=60,
                what="the run to be under way",
            )
            for i in range(3):
                slot = key_slot(keys.shard(i).seq.encode())
                owner = redis_cluster.owner(slot)
                others = [p for p in redis_cluster.ports if p != owner]
                if i == 0:  # redis-cli's own reshard (it refuses while a slot is half moved)
                    redis_cluster.reshard(slot, others[0])
                else:  # key by key, paced: calls meet the slot half moved
                    redis_cluster.migrate_slot(slot, others[0])
        finally:
            moved.set()

    redirected = redis_cluster.redirections()
    before = {i: redis_cluster.owner(key_slot(keys.shard(i).seq.encode())) for i in range(3)}
    mover = threading.Thread(target=migrate)
    mover.start()
    results, rounds, after_moves = [], 0, 0
    while after_moves < 2:
        if moved.is_set():
            after_moves += 1
        for thread in threads:
            results.append(proj.record.delay(thread, f"m{rounds}", sleep=0.1))
        rounds += 1
        wait_for(
            lambda n=rounds - 1: all(len(starts(r, t)) >= n for t in threads),
            timeout=60,
            what=f"round {rounds - 1} to start",
        )
        assert rounds < 2000, "the slots did not move"
    mover.join(30)
    after = {i: redis_cluster.owner(key_slot(keys.shard(i).seq.encode())) for i in range(3)}
    assert all(before[i] != after[i] for i in range(3)), (before, after)
    assert sorted(x.get(timeout=90) for x in results) == sorted(
        f"m{n}" for n in range(rounds) for _ in threads
    )
    redirected = {k: v - redirected[k] for k, v in redis_cluster.redirections().items()}
    print(f"{rounds} rounds; redirections during the run:", redirected)
    assert redirected["MOVED"] > 0, redirected
    for thread in threads:
        assert starts(r, thread) == [f"m{n}" for n in range(rounds)]
        assert_serial(r, thread)
    assert r.llen("overlaps") == 0 or not any(
        x.decode().split("|")[0] in threads for x in r.lrange("overlaps", 0, -1)
    )
