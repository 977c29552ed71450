"""Hundreds of members tied on scheduled_at run in arrival order on real workers, with arrival
numbers crossing a byte boundary of the queue member's encoding (lua/_member.lua: a length byte,
then the seq big-endian), which is what orders members with equal scores."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest
import redis

from celery_threads.keys import Keys
from tests.support.helpers import assert_serial, starts, tid, wait_for

MEMBERS = 300


# 250: arrival numbers 251-551 cross 2^8 (one byte -> two) and 0x1ff -> 0x200 (the higher byte
# at the same length); 65530: they cross 2^16 (two bytes -> three).
@pytest.mark.parametrize("counter", [250, 65530])
def test_hundreds_of_tied_members_run_in_arrival_order(proj, make_deployment, counter):
    d = make_deployment()
    gate = redis.Redis.from_url(d.env["CT_REDIS_URL"])
    seq_key = Keys(d.env["CT_KEY_PREFIX"]).shard(0).seq
    gate.set(seq_key, counter)
    thread = tid("tied")
    labels = [f"m{i:03d}" for i in range(MEMBERS)]
    # One scheduled_at for all, in the past: the first is released at once, the others wait
    # tied behind it, ordered by their arrival numbers alone.
    when = datetime.now(timezone.utc) - timedelta(seconds=10)
    for label in labels:
        proj.record.apply_async((thread, label), eta=when)
    assert int(gate.get(seq_key)) > counter + MEMBERS
    d.worker("w", concurrency=2)
    r = proj.history()
    wait_for(
        lambda: len(starts(r, thread)) >= MEMBERS, timeout=45, interval=0.2, what=f"{MEMBERS} members to run"
    )
    ran = starts(r, thread)
    out_of_order = [(i, want, got) for i, (want, got) in enumerate(zip(labels, ran)) if want != got]
    assert ran == labels, f"first out of order (position, expected, ran): {out_of_order[:5]}"
    assert_serial(r, thread)
    gate.close()
