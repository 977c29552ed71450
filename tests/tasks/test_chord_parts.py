"""A chord's threaded part that ends without running (removed from its thread while it waited)
counts in its chord as a revoked plain task does: the chord fails with a ChordError and its body
never runs.  It was marked REVOKED without its request, so the chord waited for it for good (a
part superseded by a later call, ``coalesce``/``debounce``, until the enqueue that superseded it
returned its stored message)."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest
from celery import chord
from celery.exceptions import ChordError

from celery_threads import Threads
from tests.support.helpers import starts, tid, wait_for


@pytest.mark.parametrize("how", ["revoke", "delete", "purge", "expire", "supersede"])
def test_a_chord_part_removed_while_it_waits_fails_its_chord(proj, worker, how):
    """``expire``: its ``expires`` passes while it waits, and its release ends it unpublished.
    ``supersede``: a later call of its task with ``coalesce="latest"`` takes its place."""
    r = proj.history()
    thread, go = tid(), f"go:{tid()}"
    expires = datetime.now(timezone.utc) + timedelta(seconds=2)
    second = proj.record.si(thread, "h1")
    header = [
        proj.record.si(thread, "h0", until=go),
        second.set(expires=expires)
        if how == "expire"
        else second.set(coalesce="latest")
        if how == "supersede"
        else second,
    ]
    body = proj.plain.si(thread, "body")
    res = chord(header)(body)
    h0, h1 = res.parent.results
    wait_for(lambda: starts(r, thread) == ["h0"], what="h0 to hold the thread")
    if how == "revoke":
        h1.revoke()
    elif how == "delete":
        assert Threads(proj.app).delete(h1.id)
    elif how == "purge":
        assert Threads(proj.app).purge(thread) == 1
    elif how == "supersede":
        later = proj.record.apply_async((thread, "h2"), coalesce="latest")
    else:
        wait_for(lambda: datetime.now(timezone.utc) > expires, what="h1's expiry")
        r.set(go, 1)
    wait_for(lambda: h1.state == "REVOKED", what="h1 revoked")
    r.set(go, 1)
    assert h0.get(timeout=30) == "h0"
    res.get(timeout=30, propagate=False)  # the body's own outcome, not its parts' errors
    assert res.state == "FAILURE" and isinstance(res.result, ChordError), (res.state, res.result)
    assert "TaskRevokedError" in str(res.result)
    assert "body" not in starts(r, thread)
    if how == "supersede":
        assert later.get(timeout=30) == "h2"
