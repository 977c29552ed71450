"""The gate on Redis Sentinel: a master, a replica and a sentinel, all started here on free ports.

``threads_redis_url="sentinel://..."`` with ``threads_redis_options={"master_name": ...}``, kombu's
form.  The failover test SIGKILLs the master while real workers run members with
``threads_wait_replicas=1``; the sentinel promotes the replica, and every client (workers, their
pool processes' direct lines, the dispatcher, the producer, ``Threads``, the CLI) follows it.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import redis
from celery.bin.celery import celery as celery_command
from click.testing import CliRunner

from celery_threads import Threads
from celery_threads.config import read_config
from celery_threads.errors import ConfigurationError
from celery_threads.gate import make_client
from celery_threads.gate.sentinel import SentinelAddress
from celery_threads.runtime import direct_release
from tests.conftest import Deployment, configure_client, deployment_env
from tests.gate.test_durability import load_env, run_through_fault
from tests.support.helpers import tid, wait_for
from tests.support.isolated import point_app, pointed_at
from tests.support.scenarios import RECOVERY_RELEASE_TIMEOUT, crash_recovery, mixed_load
from tests.support.topologies import MASTER


def test_kombus_sentinel_url_names_the_sentinels_the_database_and_the_password():
    address = SentinelAddress("sentinel://:s3cret@h1:26380;sentinel://h2;sentinel://h3:1/4")
    assert address.sentinels == [("h1", 26380), ("h2", 26379), ("h3", 1)]
    assert (address.db, address.password, address.username) == (4, "s3cret", None)
    with pytest.raises(ConfigurationError, match="master_name"):
        make_client("sentinel://h1:26379/0", {})
    with pytest.raises(ConfigurationError, match="sentinel://host:port"):
        make_client("sentinel://h1:26379;redis://h2/0", {"master_name": "m"})


def test_the_gate_follows_the_master_through_sentinel(proj, redis_server, sentinel_setup):
    """Producer, admin API and CLI reach the master the sentinel names; direct releases are off
    (the broker is elsewhere here, and a Sentinel gate never pushes into the broker: see
    docs/durability.md); the broker's own Sentinel options serve as the gate's when the gate's
    URL is the broker's."""
    settings = {
        "threads_redis_url": sentinel_setup.url(3),
        "threads_redis_options": {"master_name": MASTER},
        "threads_wait_replicas": 1,
    }
    with pointed_at(proj.app, **settings):
        master, _ = sentinel_setup.roles()
        client = make_client(sentinel_setup.url(3), {"master_name": MASTER})
        assert client.connection_pool.get_master_address()[1] == master
        assert direct_release(proj.app, client) is None
        thread = tid("sentinel")
        proj.record.apply_async((thread, "a"), countdown=3600)
        assert Threads(proj.app).get(thread).waiting[0].task_id
        assert redis.Redis(port=master, db=3).dbsize() > 0
        listed = CliRunner().invoke(
            celery_command, ["-A", "tests.support.proj", "threads", "show", thread], catch_exceptions=False
        )
        assert listed.exit_code == 0 and thread in listed.output, listed.output
    with pointed_at(
        proj.app,
        threads_redis_url=None,
        broker_url=sentinel_setup.url(3),
        broker_transport_options={"master_name": MASTER},
    ):
        config = read_config(proj.app)
        assert config.redis_url == sentinel_setup.url(3)
        assert config.redis_options["master_name"] == MASTER


def test_a_master_sigkilled_under_load_fails_over_and_loses_or_doubles_nothing(
    proj, redis_server, sentinel_setup
):
    """``threads_wait_replicas=1``: every transition a caller acted on is on the replica when
    the master dies; the sentinel promotes the replica, the old master comes back as its replica
    (the new master has none before: no transition counts as done meanwhile), and the run ends
    with each member run exactly once and never two of a thread at a time
    (tests/gate/test_durability.py)."""
    options = f'{{"master_name": "{MASTER}"}}'
    # The default keepalive: an ending is kept and sent again while the lease holds, and the
    # stall (the master's silence noticed, the replica promoted, a replica attached to it again)
    # took 3 to 19 s on this busy machine.
    env = load_env(
        sentinel_setup.url(0), redis_server, CT_REDIS_OPTIONS=options, CT_WAIT_REPLICAS="1", CT_KEEPALIVE="30"
    )
    failover: dict[str, Any] = {}

    def kill_master() -> None:
        # The master the sentinel names, and the sentinel told to notice its silence within a
        # second (until now it gave a stalled master a minute: tests/support/topologies.py).
        master, survivor = sentinel_setup.roles()
        sentinel_setup.watch_closely()
        name = sentinel_setup.name_of(master)
        killed = time.monotonic()
        sentinel_setup.kill(name)
        # A sentinel whose own timer a busy machine delayed by 2 s stays passive for 30 s (its
        # TILT mode), and a failover that timed out is tried again 20 s later.
        wait_for(
            lambda: sentinel_setup.master() == survivor,
            timeout=90,
            interval=0.1,
            what="the sentinel to promote the replica",
        )
        failover["seconds"] = time.monotonic() - killed
        print(f"the replica was promoted {failover['seconds']:.1f}s after the kill")
        sentinel_setup.restart_as_replica(name)
        failover["replicated"] = time.monotonic() - killed
        print(f"the new master had a replica again {failover['replicated']:.1f}s after it")

    settings = {"threads_redis_options": {"master_name": MASTER}, "threads_wait_replicas": 1}
    run_through_fault(proj, env, redis_server, kill_master, settings)


def test_semantics_on_a_sentinel_gate(proj, redis_server, sentinel_setup):
    """Order, a retry, a death, a delete while waiting, and a crashed worker's recovery, with
    every client reaching the gate through the sentinel and each transition confirmed by the
    replica (``threads_wait_replicas=1``)."""
    # A keepalive of 6 s: WAIT waits up to 0.6 s for the replica on this busy machine, and a
    # crashed worker's lease lapses soon.
    env = load_env(
        sentinel_setup.url(0),
        redis_server,
        CT_REDIS_OPTIONS=f'{{"master_name": "{MASTER}"}}',
        CT_WAIT_REPLICAS="1",
        CT_KEEPALIVE="6",
        CT_RELEASE_TIMEOUT=RECOVERY_RELEASE_TIMEOUT,
    )
    d = Deployment(env)
    configure_client(proj.app, **env)
    point_app(proj.app, {"threads_redis_options": {"master_name": MASTER}, "threads_wait_replicas": 1})
    r = proj.history()
    try:
        d.worker("w1", concurrency=2)
        threads = [tid("sent") for _ in range(3)]
        assert set(threads) <= mixed_load(proj, r, threads)["listed"]
        crash_recovery(d, proj, r)
        # Whichever server the sentinel names master (none fails over here: the sentinel gives
        # a stalled master a minute), the other one replicated the run.
        master, replica = sentinel_setup.roles()
        assert redis.Redis(port=replica).info("replication")["role"] == "slave"
        assert redis.Redis(port=master).info("replication")["connected_slaves"] == 1
        assert not Threads(proj.app).get(threads[0])
    finally:
        d.stop()
        configure_client(proj.app, **deployment_env(redis_server))
        point_app(proj.app, {"threads_redis_options": None, "threads_wait_replicas": 0})
