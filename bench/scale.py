"""scale: what a member costs the gate when the gate is big.

Drives the gate directly (``celery_threads.gate.Gate`` on a ``make_client`` client, as workers do),
on two private redis-servers filled side by side:

* small: 1,000 waiting members over 100 threads; large: 1,000,000 waiting members over 100,000
  threads.  Every thread has 10 waiting members; half the threads also have an active (released,
  never claimed) member, the other half are idle with heads scheduled a day ahead, so both indexes
  (due, leases) hold half the threads and the tasks hash holds every member.  Each member stores a
  real task message (an envelope captured from ``bench.noop_threaded``).

Then, alternating between the two servers, three kinds of member life on fresh threads:

* idle thread: ``enqueue`` (released at once) -> ``claim`` -> ``finish``;
* busy thread: ``enqueue`` behind the active member -> released by its predecessor's ``finish``
  -> ``claim``; per member, one of each script;
* dispatcher: ``enqueue`` with a short countdown -> (due) ``scan_due`` + ``release_many`` of the
  batch -> ``claim`` -> ``finish``, in batches of 100 members.

When the fill leaves the large case's tasks hash mid-growth (its table doubled and being moved one
bucket per operation on the hash, as ``DEBUG HTSTATS-KEY`` shows; 1,050,000 entries is just past
2^20), the lives are measured in that state first, then again once as many lookups as the hash has
entries have finished the growth; both are reported.  The growth is a transient: it ends after
about as many operations as the hash has entries, and the next comes when they have doubled.  So
its rows carry no target; instead the whole growth's extra Redis time (the lives measured during
it over the same lives settled, plus the lookups that finished it over the same lookups on the
settled table) is shared among the members the grown table takes before its next growth, and
added to the settled time per life ("the growth amortized").

Reported: the client's wall time per life (p50 over lives; for the dispatcher, the batch's time
over its members), the Redis server's execution time per life (sum of the ``SLOWLOG`` durations of
the top-level commands, logged with ``slowlog-log-slower-than 0`` during the probes only), Redis
memory per waiting member beyond its message bytes (``used_memory`` before/after adding the waiting
members, minus the stored envelope), and Redis commands per life (``INFO commandstats``: script
calls, every command including those run inside scripts).
Targets: large within 1.2x of small (settled, and with the growth amortized); at most 200 bytes
of gate overhead per waiting member; at most three script calls per member life on the hot path
(idle and busy threads).
"""

from __future__ import annotations

import argparse
import re
import time
import uuid
from typing import Any, Callable, Optional

from bench import harness as h

DAY_MS = 86_400_000
FAR_MS = 10 * DAY_MS  # release timeout / keepalive: nothing lapses during the run
PER_THREAD = 10  # waiting members per thread, both cases
CHUNK = 100  # lives per turn when alternating between the servers
# Five repeats, not three: one disturbed repeat (ratios 0.98-1.25 between the repeats of one run
# on a quiet VM) moved the median of three past the target.
REPEATS = 5


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--small", type=int, default=None, help="waiting members, small case (1,000)")
    p.add_argument("--large", type=int, default=None, help="waiting members, large case (1,000,000)")
    p.add_argument("--lives", type=int, default=None, help="member lives per kind and repeat (2,000)")


def _gate(server: h.RedisServer, prefix: str) -> Any:
    from celery_threads.gate import Gate, make_client
    from celery_threads.keys import Keys

    return Gate(make_client(server.url()), Keys(prefix), release_timeout_ms=FAR_MS, keepalive_ms=FAR_MS)


def _fill(gate: Any, client: Any, waiting: int, envelope: bytes, label: str) -> dict[str, float]:
    threads = max(1, waiting // PER_THREAD)
    client.config_set("slowlog-log-slower-than", 10_000)
    m0 = int(client.info("memory")["used_memory"])
    h.progress(f"{label}: {threads:,} threads, active members for half of them")
    busy = [f"bg-{i}" for i in range(0, threads, 2)]
    h.enqueue_many(gate, [(t, f"a-{t}", 0) for t in busy], envelope)
    m1 = int(client.info("memory")["used_memory"])
    h.progress(f"{label}: {threads * PER_THREAD:,} waiting members")
    rows = []
    for i in range(threads):
        t = f"bg-{i}"
        delay = 0 if i % 2 == 0 else DAY_MS  # behind the active member / a future head
        rows += [(t, f"w-{t}-{j}-{uuid.uuid4().hex[:12]}", delay) for j in range(PER_THREAD)]
    # uuid-like task ids, as Celery's (36 characters)
    rows = [(t, str(uuid.uuid5(uuid.NAMESPACE_OID, task)), d) for t, task, d in rows]
    t0 = time.monotonic()
    h.enqueue_many(gate, rows, envelope)
    fill_s = time.monotonic() - t0
    m2 = int(client.info("memory")["used_memory"])
    shard = gate.keys.shard(0)
    counts = (client.zcard(shard.due), client.zcard(shard.leases), client.hlen(shard.tasks))
    assert counts == (threads - len(busy), len(busy), len(busy) + len(rows)), counts
    return {
        "threads": threads,
        "waiting": len(rows),
        "m0": m0,
        "m1": m1,
        "m2": m2,
        "per_waiting": (m2 - m1) / len(rows),
        "fill_s": fill_s,
    }


# "\2" + a UUID's last two bytes + "seq|retries|max|delay|len\n" + thread id: a 16-digit seq (the
# shard counter follows the server's clock in microseconds: next_seq in _common.lua)
RECORD_HEADER_BYTES = 3 + len("1796559196514608|0|-1|0|8\nbg-12345")
SDS16_OVERHEAD = 6  # sdshdr16 (5 bytes) + NUL


def _jemalloc_class(size: int) -> int:
    """jemalloc's size class for an allocation of ``size`` bytes (4 classes per doubling)."""
    if size <= 8:
        return 8
    if size <= 128:
        return (size + 15) // 16 * 16
    delta = 1 << ((size - 1).bit_length() - 3)
    return (size + delta - 1) // delta * delta


def _memory_breakdown(client: Any, gate: Any, threads: int) -> dict[str, float]:
    """Bytes per waiting member by key (``MEMORY USAGE``, sampled threads of the large case)."""
    sample = range(0, threads, max(1, threads // 200))
    queue, n = 0.0, 0
    for i in sample:
        queue += int(client.memory_usage(gate.keys.thread(f"bg-{i}").queue) or 0)
        n += PER_THREAD
    out = {"queue": queue / n}
    shard = gate.keys.shard(0)
    members = client.hlen(shard.tasks)
    out["tasks hash (records)"] = int(client.memory_usage(shard.tasks, samples=1000) or 0) / members
    out["due + leases index"] = (
        int(client.memory_usage(shard.due, samples=1000) or 0)
        + int(client.memory_usage(shard.leases, samples=1000) or 0)
    ) / members
    return out


def _idle_lives(gate: Any, n: int, tag: str) -> tuple[list[float], int]:
    times = []
    for i in range(n):
        thread, task = f"p-{tag}-{i}", str(uuid.uuid4())
        t0 = time.perf_counter()
        rel = gate.enqueue(thread, task, ENVELOPE[0]).release
        assert gate.claim(thread, task, rel.token, "bench@host") == 1
        assert gate.finish(thread, task, rel.token).done
        times.append((time.perf_counter() - t0) * 1e6)
    return times, n


def _busy_lives(gate: Any, n: int, tag: str) -> tuple[list[float], int]:
    thread = f"b-{tag}"
    first = str(uuid.uuid4())
    rel = gate.enqueue(thread, first, ENVELOPE[0]).release
    assert gate.claim(thread, first, rel.token, "bench@host") == 1
    current, token = first, rel.token
    times = []
    for _ in range(n):
        task = str(uuid.uuid4())
        t0 = time.perf_counter()
        assert gate.enqueue(thread, task, ENVELOPE[0]).release is None  # waits behind current
        nxt = gate.finish(thread, current, token).release  # releases it
        assert nxt is not None and nxt.task_id == task
        assert gate.claim(thread, task, nxt.token, "bench@host") == 1
        times.append((time.perf_counter() - t0) * 1e6)
        current, token = task, nxt.token
    assert gate.finish(thread, current, token).done
    # one more member lived in this block: the first one's enqueue and claim came before the
    # timed loop, the last one's finish after it
    return times, n + 1


def _dispatched_lives(gate: Any, n: int, tag: str, batch: int = 100) -> tuple[list[float], int]:
    shard = gate.keys.shard(0)
    per_member = []
    for b in range(0, n, batch):
        size = min(batch, n - b)
        members = [(f"d-{tag}-{b + i}", str(uuid.uuid4())) for i in range(size)]
        spent = 0.0
        for thread, task in members:
            t0 = time.perf_counter()
            assert gate.enqueue(thread, task, ENVELOPE[0], delay_ms=20).release is None
            spent += time.perf_counter() - t0
        time.sleep(0.03)  # they fall due
        t0 = time.perf_counter()
        scan = gate.reads.scan_due(shard, size)
        outcomes = gate.release_many(scan.due)
        for thread, outcome in zip(scan.due, outcomes):
            rel = outcome.release
            assert gate.claim(thread, rel.task_id, rel.token, "bench@host") == 1
            assert gate.finish(thread, rel.task_id, rel.token).done
        spent += time.perf_counter() - t0
        assert len(scan.due) == size, (len(scan.due), size)
        per_member.append(spent / size * 1e6)
    return per_member, n


Results = dict[tuple[str, str], list[dict[str, Any]]]


def _measure(
    servers: dict[str, h.RedisServer],
    gates: dict[str, Any],
    cases: dict[str, int],
    repeats: int,
    lives: int,
    phase: str,
) -> Results:
    """Every kind of life, ``repeats`` times, alternating between the servers; per (server, kind),
    one dict of measures per repeat."""
    results: Results = {}
    for rep in range(repeats):
        for kind, fn in KINDS.items():
            h.progress(f"{phase}, repeat {rep + 1}/{repeats}: {lives:,} lives per server, {kind}")
            times: dict[str, list[float]] = {name: [] for name in cases}
            members = dict.fromkeys(cases, 0)
            probes = {name: h.Probe(servers[name].client()) for name in cases}
            for probe in probes.values():
                probe.__enter__()
            try:
                # chunks of CHUNK lives, alternating between the servers, so that the noise of
                # a shared machine falls on both alike
                for c, start in enumerate(range(0, lives, CHUNK)):
                    size = min(CHUNK, lives - start)
                    for name in list(cases) if c % 2 == 0 else list(reversed(cases)):
                        got, lived = fn(gates[name], size, f"{phase[0]}{rep}-{c}")
                        times[name] += got
                        members[name] += lived
            finally:
                for probe in probes.values():
                    probe.__exit__(None, None, None)
            for name in cases:
                probe, count = probes[name], members[name]
                results.setdefault((name, kind), []).append(
                    {
                        "p50": h.pct(times[name], 50),
                        "p99": h.pct(times[name], 99),
                        "server_us": probe.server_us / count,
                        "members": count,
                        "scripts": sum(v for k, v in probe.top.items() if k.startswith("script")) / count,
                        "top": sum(probe.top.values()) / count,
                        "all": probe.all_calls / count,
                        "breakdown": {k: v / count for k, v in sorted(probe.top.items())},
                        "breakdown_us": {
                            k: probe.top_us[k] / max(1, probe.top[k]) for k in sorted(probe.top)
                        },
                        "per_call_us": probe.per_call_us,
                    }
                )
    return results


def _htstats(client: Any, key: str) -> Optional[str]:
    try:
        return client.execute_command("DEBUG", "HTSTATS-KEY", key).decode()
    except Exception:  # redis-server < 7, or DEBUG not enabled
        return None


def _tables(client: Any, gate: Any) -> Optional[tuple[list[int], list[int]]]:
    """The tasks hash's table sizes and entries (two of each while it is rehashed into a bigger
    table), from DEBUG HTSTATS-KEY; None without DEBUG."""
    stats = _htstats(client, gate.keys.shard(0).tasks)
    if stats is None:
        return None
    return (
        [int(x) for x in re.findall(r"table size: (\d+)", stats)],
        [int(x) for x in re.findall(r"number of elements: (\d+)", stats)],
    )


def _growing(client: Any, gate: Any) -> Optional[str]:
    """'' unless the tasks hash's table is being rehashed into a bigger one (Redis grows a hash
    table by doubling it when its entries reach its size, then moves one bucket per operation on
    the hash), else what DEBUG HTSTATS-KEY says of the two tables.  Without DEBUG: None."""
    tables = _tables(client, gate)
    if tables is None:
        return None
    sizes, used = tables
    if len(sizes) < 2:
        return ""
    return f"{sum(used):,} entries, table of {sizes[0]:,} buckets moving into one of {sizes[1]:,}"


SETTLE_SCRIPT = """
for i = 1, tonumber(ARGV[1]) do redis.call('HEXISTS', KEYS[1], 'settle') end
return 0
"""


def _lookups(client: Any, gate: Any) -> float:
    """As many lookups in the tasks hash as it has entries; returns their Redis execution time
    (µs, INFO commandstats).  Each lookup moves one bucket of a pending growth, so this finishes
    it, as that many gate operations would.  In chunks of 100,000, not to block the server for
    long."""
    key = gate.keys.shard(0).tasks
    left = int(client.hlen(key))
    before = int(client.info("commandstats").get("cmdstat_eval", {}).get("usec", 0))
    while left > 0:
        client.eval(SETTLE_SCRIPT, 1, key, min(left, 100_000))
        left -= 100_000
    return int(client.info("commandstats")["cmdstat_eval"]["usec"]) - before


def _settle(client: Any, gate: Any) -> Optional[dict[str, float]]:
    """Finish a pending growth of the tasks hash's table (:func:`_lookups`).  When there was one,
    returns what the rest of it cost: the lookups' Redis time minus that of the same lookups on
    the settled table (µs), and how many members the grown table takes before the next growth
    (its new size minus the old: Redis doubles a table when its entries reach its size)."""
    tables = _tables(client, gate)
    finishing = _lookups(client, gate)
    assert not _growing(client, gate)
    if tables is None or len(tables[0]) < 2:
        return None
    return {"extra_us": finishing - _lookups(client, gate), "room": tables[0][1] - tables[0][0]}


ENVELOPE: list[bytes] = []
KINDS: dict[str, Callable[[Any, int, str], tuple[list[float], int]]] = {
    "idle thread": _idle_lives,
    "busy thread": _busy_lives,
    "dispatcher": _dispatched_lives,
}


def run(args: argparse.Namespace) -> int:
    small = args.small or 1_000
    # --quick: 7,850 waiting leave the tasks hash just past 2^13 entries, as 1,000,000 leave it
    # just past 2^20, so that the quick run takes the growth's path too
    large = args.large or (7_850 if args.quick else 1_000_000)
    lives = args.lives or (200 if args.quick else 2_000)
    from bench import tasks

    cases = {"small": small, "large": large}
    fills: dict[str, dict[str, float]] = {}
    results_growing: Results = {}
    growth: Optional[dict[str, float]] = None
    with h.Stack("scale") as stack:
        servers = {name: stack.redis(f"redis-{name}") for name in cases}
        tasks.configure(h.celery_env(servers["small"]))
        ENVELOPE[:] = [h.captured_envelope(tasks.noop_threaded)]
        where = h.machine(servers["small"])
        gates = {name: _gate(servers[name], "bench-scale") for name in cases}
        for name, waiting in cases.items():
            fills[name] = _fill(gates[name], servers[name].client(), waiting, ENVELOPE[0], name)
            for fn in KINDS.values():  # warm up: scripts loaded, connections open
                fn(gates[name], 5, "warm")
        growing = _growing(servers["large"].client(), gates["large"])
        if growing:
            # the lives first measured while the large tasks hash's table grows, then once it is done
            h.progress(f"large: tasks hash mid-growth ({growing}); measuring that state first")
            results_growing = _measure(servers, gates, cases, args.repeats, lives, "growing")
        if growing or growing is None:  # None: no DEBUG, the state is unknown
            h.progress("finishing the growth, then the same lookups on the settled table")
            growth = _settle(servers["large"].client(), gates["large"])
            _settle(servers["small"].client(), gates["small"])
        results = _measure(servers, gates, cases, args.repeats, lives, "settled")
        breakdown_mem = _memory_breakdown(
            servers["large"].client(), gates["large"], int(fills["large"]["threads"])
        )
    envelope_bytes = len(ENVELOPE[0])

    def med(name: str, kind: str, what: str, source: Optional[Results] = None) -> float:
        return h.median(r[what] for r in (source or results)[(name, kind)])

    rows = []
    for source, state in ((results, ""), (results_growing, ", tasks hash growing (transient)")):
        for kind in KINDS if source else ():
            for what, label in (
                ("p50", "client wall time per life, p50 (µs)"),
                ("server_us", "Redis execution time per life (µs)"),
            ):
                s, big = med("small", kind, what, source), med("large", kind, what, source)
                r = h.ratio(big, s)
                # The target is the steady state's, and the amortized growth's below: a growth
                # lasts about as many operations as the hash has entries (the note says more).
                target = source is results
                rows.append(
                    [
                        f"{kind}{state}: {label}",
                        s,
                        big,
                        r,
                        "<= 1.2x" if target else "-",
                        h.verdict(r <= 1.2) if target else "-",
                    ]
                )
    amortized = None
    if growth is not None and results_growing:
        # The whole growth's extra Redis time: what the lives measured during it paid over the
        # same lives on the settled table, plus what finishing it cost over the same lookups
        # on the settled table; shared by the members the grown table takes before the next.
        during = sum(
            (med("large", kind, "server_us", results_growing) - med("large", kind, "server_us"))
            * sum(r["members"] for r in results_growing[("large", kind)])
            for kind in KINDS
        )
        amortized = (during + growth["extra_us"]) / growth["room"]
        for kind in KINDS:
            s, big = med("small", kind, "server_us"), med("large", kind, "server_us") + amortized
            r = h.ratio(big, s)
            rows.append(
                [
                    f"{kind}, the growth amortized: Redis execution time per life (µs)",
                    s,
                    big,
                    r,
                    "<= 1.2x",
                    h.verdict(r <= 1.2),
                ]
            )
    for kind in KINDS:
        s, big = med("small", kind, "scripts"), med("large", kind, "scripts")
        hot = kind != "dispatcher"
        rows.append(
            [
                f"{kind}: script calls per life",
                s,
                big,
                "-",
                "<= 3" if hot else "-",
                h.verdict(max(s, big) <= 3) if hot else "-",
            ]
        )
        rows.append(
            [
                f"{kind}: top-level commands / all commands per life",
                f"{med('small', kind, 'top'):.2f} / {med('small', kind, 'all'):.1f}",
                f"{med('large', kind, 'top'):.2f} / {med('large', kind, 'all'):.1f}",
                "-",
                "-",
                "-",
            ]
        )
    over = {n: fills[n]["per_waiting"] - envelope_bytes for n in cases}
    rows.append(
        [
            "Redis memory per waiting member (bytes)",
            fills["small"]["per_waiting"],
            fills["large"]["per_waiting"],
            "-",
            "-",
            "-",
        ]
    )
    rows.append(
        [
            "  of which gate overhead beyond the message (bytes)",
            over["small"],
            over["large"],
            "-",
            "<= 200",
            h.verdict(over["large"] <= 200),
        ]
    )
    record = RECORD_HEADER_BYTES + envelope_bytes + SDS16_OVERHEAD
    rounding = _jemalloc_class(record) - record
    rows.append(
        [
            "    of which the allocator's rounding of the stored record (bytes)",
            rounding,
            rounding,
            "-",
            "-",
            "-",
        ]
    )

    def per_call(name: str, kind: str, command: str) -> float:
        return h.median(r["breakdown_us"].get(command, float("nan")) for r in results[(name, kind)])

    breakdown = "; ".join(
        f"{kind}: "
        + ", ".join(
            f"{k} {v:.2f} x ({per_call('small', kind, k):.0f} / {per_call('large', kind, k):.0f} µs)"
            for k, v in results[("large", kind)][0]["breakdown"].items()
        )
        for kind in KINDS
    )

    def inner(source: Results) -> str:
        """The commands the idle-thread life's scripts run: Redis µs per call, small / large."""
        runs = {name: source[(name, "idle thread")] for name in cases}
        names = sorted(set(runs["small"][0]["per_call_us"]) - {"fcall", "evalsha"})

        def us(name: str, command: str) -> str:
            values = (r["per_call_us"].get(command, float("nan")) for r in runs[name])
            return f"{h.median(values):.2f}"

        return ", ".join(f"{c} {us('small', c)} / {us('large', c)}" for c in names)

    notes = [
        f"small = {fills['small']['waiting']:,} waiting members over {fills['small']['threads']:,} "
        f"threads, large = {fills['large']['waiting']:,} over {fills['large']['threads']:,} "
        f"(filled in {fills['large']['fill_s']:.0f} s); {lives:,} lives per kind, server and "
        f"repeat; medians over {args.repeats} repeat(s); ratio = large / small.",
        f"stored message (envelope) = {envelope_bytes} bytes per member; memory = (used_memory "
        "after the waiting members - before) / waiting members, so per-thread keys (a queue per "
        "thread, the idle half's entry in the due index) are spread over its 10 members.",
        "top-level commands per life (large, first repeat), and their Redis execution time per "
        f"call (median over repeats, small / large): {breakdown}.",
        "the commands inside an idle-thread life's scripts, Redis µs per call (INFO "
        f"commandstats, median over repeats, small / large): {inner(results)}"
        + (f"; tasks hash growing: {inner(results_growing)}" if results_growing else "")
        + ".",
        "memory by key, bytes per member (MEMORY USAGE, large case: sampled threads' queues, "
        "the tasks hash whose records hold the message): "
        + ", ".join(f"{k} {v:.0f}" for k, v in breakdown_mem.items())
        + ".",
        "the dispatcher kind's client time is per member of a 100-member batch (its scan and "
        "release are one pipelined round trip each for the whole batch).",
    ]

    def per_repeat(source: Results) -> str:
        return "; ".join(
            f"{kind} "
            + ", ".join(
                f"{h.ratio(big['server_us'], s['server_us']):.2f}"
                for s, big in zip(source[("small", kind)], source[("large", kind)])
            )
            for kind in KINDS
        )

    notes.append(
        "per-repeat ratios of Redis execution time per life (large / small; each repeat "
        f"alternates the servers every {CHUNK} lives): settled: {per_repeat(results)}"
        + (f"; tasks hash growing: {per_repeat(results_growing)}" if results_growing else "")
        + "."
    )
    if growing is None:
        notes.append(
            "tasks hash: this redis-server gives no DEBUG HTSTATS-KEY, so whether the "
            "fill left it mid-growth is unknown; as many lookups as it has entries "
            "finished any pending growth before the lives were measured."
        )
    if growing:
        notes.append(
            f"tasks hash growing: after the fill, the large case's tasks hash was mid-growth "
            f"({growing}); Redis moves one bucket per operation on the hash, so a gate finishes "
            "such a growth after about as many operations as it has members, and the next "
            "comes when its entries have doubled. The rows marked 'tasks hash growing "
            "(transient)' were measured in that state; then as many lookups as the hash "
            "has entries finished it on both servers, and the other rows were measured."
        )
    if amortized is not None and growth is not None:
        notes.append(
            "the growth amortized: the large case's settled time plus the whole growth's extra "
            "Redis time per member the grown table takes before its next growth "
            f"({growth['room']:,.0f}): {amortized:.2f} µs per member (the lives measured "
            "during it, over the same lives settled, plus the lookups that finished it, "
            f"{growth['extra_us'] / 1e6:.2f} s over the same lookups on the settled table). "
            "The small case is given its settled time: its own growths, of a 1,024-bucket "
            "table, are left out, which only raises the ratio."
        )
    h.report(
        "scale (gate only)",
        "scale",
        args.quick,
        where,
        "Gate driven directly (enqueue, claim, finish, scan_due + release_many) on two "
        "private redis-servers, one small, one large; client = this Python process",
        ["measure", f"{small:,} waiting", f"{large:,} waiting", "ratio", "target", "verdict"],
        rows,
        notes,
    )
    return 0
