"""``celery -A tests.support.seam_faults worker``: tests.support.proj's app on libraries whose
private parts named in ``CT_BREAK_SEAMS`` (comma-separated seam names) are gone or changed, as a
later release of Celery, kombu or redis-py might leave them.  Applied at import, in the worker's
main process before anything else runs; its pool processes inherit them (fork).
"""

from __future__ import annotations

import os
import socket
from typing import Any


def _handoff() -> None:
    # The worker's Request sends the pool functions other than celery.app.trace's.
    from celery.app import trace
    from celery.worker import request

    request.fast_trace_task = fast_trace_task
    request.trace_task_ret = trace_task_ret
    _originals.update(fast_trace_task=trace.fast_trace_task, trace_task_ret=trace.trace_task_ret)


_originals: dict[str, Any] = {}


def fast_trace_task(*args: Any, **kwargs: Any) -> Any:
    return _originals["fast_trace_task"](*args, **kwargs)


def trace_task_ret(*args: Any, **kwargs: Any) -> Any:
    return _originals["trace_task_ret"](*args, **kwargs)


def _untracked_releases() -> None:
    # kombu's Redis QoS no longer has an append of its own (the virtual one records in memory).
    from kombu.transport.redis import QoS

    del QoS.append


def _revoke_command() -> None:
    from celery.worker.control import Panel

    original = Panel.data["revoke"]

    def revoke(state: Any, task_id: Any, **kwargs: Any) -> Any:  # options as keywords only
        return original(state, task_id, **kwargs)

    Panel.data["revoke"] = revoke


def _request_state() -> None:
    from celery.worker.request import Request

    del Request._already_cancelled


class _Socket:
    """A socket wrapper: what a redis-py connection holding something other than a plain
    ``socket.socket`` looks like."""

    def __init__(self, sock: socket.socket) -> None:
        self._wrapped = sock

    def __getattr__(self, name: str) -> Any:
        return getattr(self._wrapped, name)


def _direct_line() -> None:
    import redis

    original = redis.Connection._connect

    def _connect(self: Any) -> Any:
        return _Socket(original(self))

    redis.Connection._connect = _connect


def _utf8_bodies() -> None:
    # kombu 5.3's reading of a body encoding (through Channel.codecs only), with codecs that
    # cannot be taught utf-8.
    import types

    import kombu
    from kombu.transport.virtual.base import Channel

    def decode_body(self: Any, body: Any, encoding: Any = None) -> Any:
        if encoding:
            return self.codecs.get(encoding).decode(body)
        return body

    Channel.decode_body = decode_body
    Channel.codecs = types.MappingProxyType(dict(Channel.codecs))
    kombu.VERSION = kombu.version_info_t(5, 3, 7, "", "")


FAULTS = {
    "handoff": _handoff,
    "untracked-releases": _untracked_releases,
    "revoke-command": _revoke_command,
    "request-state": _request_state,
    "direct-line": _direct_line,
    "utf8-bodies": _utf8_bodies,
}

for _name in filter(None, os.environ.get("CT_BREAK_SEAMS", "").split(",")):
    FAULTS[_name]()

from tests.support.proj import app  # noqa: E402,F401  (the app celery -A finds here)
