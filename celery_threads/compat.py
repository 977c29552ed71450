"""Adapters for the oldest releases of the libraries the package supports.

kombu before 5.4: its virtual transports' consumer (kombu's Redis transport among them) decodes a
message's ``body_encoding`` through ``Channel.codecs``, which holds only ``base64``, so a message
marked ``utf-8`` kills the worker that fetches it (``'NoneType' object has no attribute
'decode'``) and is lost.  kombu 5.4 reads ``utf-8`` as the text it is.  The gate publishes
releases with ``utf-8`` bodies (``lua/_common.lua`` ``publish_direct``: base64 in Lua costs Redis
about 50 µs per 360-byte body, escaping the text 1 µs), and the process that publishes a release
(a producer, a worker, beat) may run a newer kombu than the worker that reads it.  So each worker
of threaded tasks (its step, before its consumer starts) teaches an older kombu to read ``utf-8``
bodies as kombu 5.4 does.
The released kombu versions this touches no longer change; newer ones are left alone.  Also: no
health checks on redis-py before 6 (see :func:`health_check_interval`).
"""
from __future__ import annotations

import logging
from typing import Any

import kombu
import redis

logger = logging.getLogger(__name__)

_done = False


class _Utf8Codec:
    """kombu 5.4's reading of ``body_encoding: utf-8``: the body is already the text."""

    def encode(self, s: Any) -> Any:
        return s

    def decode(self, s: Any) -> Any:
        return s


def ensure_utf8_bodies() -> None:
    """Make this process's kombu read ``utf-8`` message bodies (idempotent, logged once)."""
    global _done
    if _done:
        return
    _done = True
    if tuple(kombu.VERSION[:2]) >= (5, 4):
        return
    from kombu.transport.virtual.base import Channel

    codecs = getattr(Channel, "codecs", None)
    if not isinstance(codecs, dict):
        logger.error("celery-threads: kombu %s has no Channel.codecs to teach utf-8 message "
                     "bodies to; upgrade kombu to 5.4 or newer", kombu.__version__)
        return
    if "utf-8" not in codecs:
        codecs["utf-8"] = _Utf8Codec()
        logger.info("celery-threads: kombu %s reads utf-8 message bodies as kombu 5.4 does "
                    "(a codec added to its virtual transports)", kombu.__version__)


def health_check_interval(wanted: int) -> int:
    """``wanted``, or 0 (no health checks) on redis-py before 6.

    redis-py 5's health check reconnects through ``on_connect``, whose first command checks health
    again on the fresh connection: against a server (or a proxy) that accepts connections and
    closes them at once, that recurses until ``RecursionError``, which escapes the client's retries
    and fails the call (redis-py 6 reconnects without the check).  Without health checks a dead
    idle connection fails its next command instead, which the gate's client retries.
    """
    major = int(redis.__version__.split(".")[0])
    return wanted if major >= 6 else 0
