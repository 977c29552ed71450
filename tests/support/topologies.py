"""Redis topologies the suite starts on free ports: a Sentinel setup (a master, its replica and
one sentinel) and a Redis Cluster of three masters.  Their fixtures (``sentinel_setup``,
``redis_cluster``) are in conftest.py."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from typing import Optional

import redis

from bench.cluster import cluster_node_args, cluster_port
from tests.conftest import default_redis_binary, free_port, redis_binaries
from tests.support.helpers import terminate, wait_for

MASTER = "ctmaster"


# A sentinel fails over a master that has not answered its PINGs for down-after-milliseconds.
# A busy machine can stall a server for a second or more, so the setup waits a minute: a test
# not about failover never sees one.  The failover test shortens it just before its kill
# (``watch_closely``).  failover-timeout starts nothing; it bounds each step of a failover under
# way, and a failover that timed out is tried again after twice that time.
QUIET_DOWN_AFTER_MS = 60_000
CLOSE_DOWN_AFTER_MS = 1_000
FAILOVER_TIMEOUT_MS = 10_000


class SentinelSetup:
    """A master, a replica of it, and one sentinel watching them (quorum 1).  The sentinel
    leaves a stalled master alone (``QUIET_DOWN_AFTER_MS``) until ``watch_closely``; who is
    master is what ``master()`` (the sentinel's answer) says, never assumed from the ports."""

    def __init__(self) -> None:
        self.binary = default_redis_binary()
        self.dir = tempfile.mkdtemp(prefix="ct-redis-sentinel-")
        self.master_port, self.replica_port, self.sentinel_port = (free_port() for _ in range(3))
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def _server(self, name: str, port: int, *args: str) -> None:
        self.procs[name] = subprocess.Popen(
            [
                self.binary,
                "--port",
                str(port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--dir",
                self.dir,
                "--dbfilename",
                f"{name}.rdb",
                "--logfile",
                os.path.join(self.dir, f"{name}.log"),
                "--repl-diskless-sync-delay",
                "0",
                *args,
            ],  # a replica syncs at once, not in 5 s
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

    def start(self) -> None:
        self._server("master", self.master_port)
        self._server("replica", self.replica_port, "--replicaof", "127.0.0.1", str(self.master_port))
        conf = os.path.join(self.dir, "sentinel.conf")
        with open(conf, "w") as f:
            f.write(
                f"port {self.sentinel_port}\nbind 127.0.0.1\ndir {self.dir}\n"
                f"sentinel monitor {MASTER} 127.0.0.1 {self.master_port} 1\n"
                f"sentinel down-after-milliseconds {MASTER} {QUIET_DOWN_AFTER_MS}\n"
                f"sentinel failover-timeout {MASTER} {FAILOVER_TIMEOUT_MS}\n"
                # told of the replica up front: it would find it within 10 s on its own
                f"sentinel known-replica {MASTER} 127.0.0.1 {self.replica_port}\n"
            )
        self.procs["sentinel"] = subprocess.Popen(
            [self.binary, conf, "--sentinel", "--logfile", os.path.join(self.dir, "sentinel.log")],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        master = redis.Redis(port=self.master_port)
        wait_for(
            lambda: (
                _ping(master)
                and master.info("replication").get("connected_slaves") == 1
                and _replica_in_sync(self.replica_port)
            ),
            timeout=20,
            interval=0.05,
            what="the replica to sync",
        )
        sentinel = redis.Redis(port=self.sentinel_port)
        wait_for(
            lambda: _ping(sentinel) and sentinel.execute_command("SENTINEL", "REPLICAS", MASTER),
            timeout=20,
            interval=0.05,
            what="the sentinel to see the replica",
        )

    def url(self, db: int = 0) -> str:
        return f"sentinel://127.0.0.1:{self.sentinel_port}/{db}"

    def master(self) -> Optional[int]:
        host_port = redis.Redis(port=self.sentinel_port).execute_command(
            "SENTINEL", "GET-MASTER-ADDR-BY-NAME", MASTER
        )
        return int(host_port[1]) if host_port else None

    def port(self, name: str) -> int:
        """The port of the server started as ``name`` ("master" or "replica"), whatever its
        role now."""
        return self.master_port if name == "master" else self.replica_port

    def roles(self) -> tuple[int, int]:
        """(master, replica): the ports of the master the sentinel names and of the other
        server."""
        master = self.master()
        assert master in (self.master_port, self.replica_port), master
        return master, self.replica_port if master == self.master_port else self.master_port

    def name_of(self, port: int) -> str:
        return "master" if port == self.master_port else "replica"

    def watch_closely(self) -> None:
        """From now on the sentinel counts the master as down after ``CLOSE_DOWN_AFTER_MS`` of
        silence: for the failover test, right before it kills the master."""
        redis.Redis(port=self.sentinel_port).execute_command(
            "SENTINEL", "SET", MASTER, "down-after-milliseconds", CLOSE_DOWN_AFTER_MS
        )

    def restart_as_replica(self, name: str) -> None:
        """The killed server ``name`` started again as a replica of the other one, as its
        operator would (the sentinel would too, after its next look at it, up to 10 s later).
        Until then, with ``threads_wait_replicas=1``, no transition counts as done."""
        other = self.replica_port if name == "master" else self.master_port
        self._server(name, self.port(name), "--replicaof", "127.0.0.1", str(other))
        new_master = redis.Redis(port=other)
        wait_for(
            lambda: (
                new_master.info("replication").get("connected_slaves") == 1
                and _replica_in_sync(self.port(name))
            ),
            timeout=60,
            interval=0.1,
            what="the old master to become a replica of the new one",
        )

    def kill(self, name: str) -> None:
        proc = self.procs[name]
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)

    def stop(self) -> None:
        for name in self.procs:
            self.kill(name)
        shutil.rmtree(self.dir, ignore_errors=True)


def _ping(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.ConnectionError:
        return False


def _replica_in_sync(port: int) -> bool:
    info = redis.Redis(port=port).info("replication")
    return bool(info.get("master_link_status") == "up")


REDIS_CLI = shutil.which("redis-cli", path="/usr/bin:/usr/local/bin") or "redis-cli"


# A master that answers no other master's PING for cluster-node-timeout (15 s by default) is
# marked failed; having no replica to take over, it leaves the cluster down (CLUSTERDOWN) until it
# answers again and, for a master with slots, twice that time has passed.  A busy machine must
# not do that to a test: no test here is about a node failing.
CLUSTER_NODE_TIMEOUT_MS = 120_000


class RedisClusterServers:
    """Three ``redis-server --cluster-enabled yes`` masters joined by ``redis-cli --cluster
    create``, none of them marked failed by the others while the test runs
    (``CLUSTER_NODE_TIMEOUT_MS``)."""

    def __init__(self, masters: int = 3) -> None:
        self.binary = next(iter(redis_binaries().values()))
        self.dir = tempfile.mkdtemp(prefix="ct-cluster-")
        self.ports = [cluster_port() for _ in range(masters)]
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self) -> None:
        for port in self.ports:
            self.procs.append(
                subprocess.Popen(
                    [
                        *cluster_node_args(self.binary, port, self.dir),
                        "--cluster-node-timeout",
                        str(CLUSTER_NODE_TIMEOUT_MS),
                        "--logfile",
                        f"{self.dir}/{port}.log",
                    ],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )
        for port in self.ports:
            wait_for(lambda port=port: self._pings(port), timeout=10, what=f"redis-server on {port}")
        subprocess.run(
            [
                REDIS_CLI,
                "--cluster",
                "create",
                *[f"127.0.0.1:{p}" for p in self.ports],
                "--cluster-replicas",
                "0",
                "--cluster-yes",
            ],
            check=True,
            capture_output=True,
            timeout=60,
        )
        wait_for(
            lambda: all(self.node(p).cluster("info")["cluster_state"] == "ok" for p in self.ports),
            timeout=30,
            what="the cluster to be ok",
        )

    def _pings(self, port: int) -> bool:
        try:
            return bool(redis.Redis(port=port).ping())
        except redis.ConnectionError:
            return False

    def url(self) -> str:
        return f"redis://127.0.0.1:{self.ports[0]}/0"

    def node(self, port: int) -> redis.Redis[bytes]:
        return redis.Redis(port=port)

    def node_id(self, port: int) -> str:
        return str(self.node(port).execute_command("CLUSTER", "MYID").decode())

    def owner(self, slot: int) -> int:
        for port in self.ports:
            for start, end, *nodes in self.node(port).execute_command("CLUSTER", "SLOTS"):
                if start <= slot <= end:
                    return int(nodes[0][1])
        raise AssertionError(f"slot {slot} unassigned")

    def keys_per_node(self, prefix: str) -> dict[int, int]:
        return {port: sum(1 for _ in self.node(port).scan_iter(match=f"{prefix}:*")) for port in self.ports}

    def redirections(self) -> dict[str, int]:
        """Redirections and refusals the masters answered so far (Redis 7 ``INFO errorstats``)."""
        counts = {"MOVED": 0, "ASK": 0, "TRYAGAIN": 0}
        for port in self.ports:
            stats = self.node(port).info("errorstats")
            for kind in counts:
                counts[kind] += int(stats.get(f"errorstat_{kind}", {}).get("count", 0))
        return counts

    def migrate_slot(self, slot: int, to_port: int, batch: int = 1, pace: float = 0.01) -> None:
        """Move ``slot`` as ``redis-cli --cluster reshard`` does, key by key (``pace`` between
        MIGRATEs, as a busy reshard would take), so calls meet the slot half moved (ASK,
        TRYAGAIN) before it is handed over (MOVED)."""
        src_port = self.owner(slot)
        src, dst = self.node(src_port), self.node(to_port)
        dst.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", self.node_id(src_port))
        src.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", self.node_id(to_port))
        while True:
            keys = src.execute_command("CLUSTER", "GETKEYSINSLOT", slot, batch)
            if not keys:
                break
            src.execute_command("MIGRATE", "127.0.0.1", to_port, "", 0, 60_000, "KEYS", *keys)
            time.sleep(pace)
        for port in (to_port, src_port, *[p for p in self.ports if p not in (to_port, src_port)]):
            self.node(port).execute_command("CLUSTER", "SETSLOT", slot, "NODE", self.node_id(to_port))

    def slots_below(self, slot: int) -> int:
        """How many slots ``slot``'s owner serves below it."""
        owner = self.owner(slot)
        ranges = self.node(owner).execute_command("CLUSTER", "SLOTS")
        return sum(
            max(0, min(end + 1, slot) - start) for start, end, *nodes in ranges if int(nodes[0][1]) == owner
        )

    def reshard(self, slot: int, to_port: int) -> None:
        """``redis-cli --cluster reshard`` from ``slot``'s owner to ``to_port``, of as many
        slots as it takes to move ``slot`` (it moves a node's slots lowest first), one key per
        MIGRATE."""
        src_port = self.owner(slot)
        subprocess.run(
            [
                REDIS_CLI,
                "--cluster",
                "reshard",
                f"127.0.0.1:{src_port}",
                "--cluster-from",
                self.node_id(src_port),
                "--cluster-to",
                self.node_id(to_port),
                "--cluster-slots",
                str(self.slots_below(slot) + 1),
                "--cluster-pipeline",
                "1",
                "--cluster-yes",
            ],
            check=True,
            capture_output=True,
            timeout=120,
        )

    def stop(self) -> None:
        for proc in self.procs:
            terminate(proc)
        shutil.rmtree(self.dir, ignore_errors=True)
