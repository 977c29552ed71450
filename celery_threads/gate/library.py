"""The gate's Lua: the scripts (``lua/*.lua`` with ``lua/_common.lua``) and the function
library built from them.
"""

from __future__ import annotations

import functools
import hashlib
from importlib import resources
from typing import NamedTuple

SCRIPT_NAMES = (
    "enqueue",
    "release",
    "claim",
    "renew",
    "finish",
    "requeue",
    "kill",
    "delete",
    "expire",
    "fail",
    "restart",
    "handback",
    "pause",
    "resume",
    "redrive",
    "purge",
    "forget",
)


def _load_lua(name: str) -> str:
    return resources.files(__package__).joinpath("lua").joinpath(name).read_text(encoding="utf-8")


def _prelude() -> str:
    return "\n".join(_load_lua(f"{part}.lua") for part in ("_clock", "_member", "_common"))


def script_sources() -> dict[str, str]:
    """Each transition's full source: the clock, the shared prelude, the call's context, then its
    own body."""
    common = _prelude()
    return {name: f"{common}\nbegin(KEYS, ARGV)\n{_load_lua(f'{name}.lua')}" for name in SCRIPT_NAMES}


class Library(NamedTuple):
    """The transitions as one Redis function library (Redis 7+): ``FCALL <functions[name]>``
    runs the same body as ``EVALSHA`` of ``script_sources()[name]``, without defining the
    prelude's functions again on every call (most of a script call's cost in Redis)."""

    name: str
    source: str
    functions: dict[str, str]


#: Transitions that run when the server is at its ``maxmemory`` (the ``allow-oom`` flag):
#: those that end, hand out or keep members already stored, which hold or free memory.  A full
#: ``noeviction`` gate refused them too: a member that had run could not end (its lease lapsed
#: and it ran again), and nothing drained the gate.  New work (``enqueue``, and the operator's
#: ``restart``, ``redrive``, ``pause``, ``resume``) is still refused with the server's error.
#: (Scripts, the way without functions, keep Redis's own rule.)
ALLOW_OOM = frozenset(SCRIPT_NAMES) - {"enqueue", "restart", "redrive", "pause", "resume"}


@functools.cache
def function_library() -> Library:
    """The library of this version of the transitions (built once per process).  Its name
    carries a digest of its source, so processes running different versions against one Redis
    each call their own."""
    common = _prelude().replace("if redis.replicate_commands then pcall(redis.replicate_commands) end", "")
    bodies = {name: _load_lua(f"{name}.lua") for name in SCRIPT_NAMES}
    flags = ",".join(sorted(ALLOW_OOM))  # part of what a version's library is
    digest = hashlib.sha1("\0".join([common, *bodies.values(), flags]).encode()).hexdigest()[:12]
    lib = f"celery_threads_{digest}"
    functions = {name: f"{lib}_{name}" for name in SCRIPT_NAMES}
    registered = "".join(
        f"\nredis.register_function{{function_name='{functions[name]}', callback=function(KEYS, ARGV)\n"
        f"begin(KEYS, ARGV)\n{body}\nend{_flags(name)}}}\n"
        for name, body in bodies.items()
    )
    return Library(lib, f"#!lua name={lib}\n{common}\n{registered}", functions)


def _flags(name: str) -> str:
    return ", flags={'allow-oom'}" if name in ALLOW_OOM else ""
