"""The gate: the Redis side of celery-threads, the single source of truth.

Each transition is one atomic Lua script (``lua/*.lua``, sharing ``lua/_common.lua``), loaded as
a function library where the server allows it (:mod:`.library`).  :class:`Gate` (:mod:`.api`)
names the transitions and turns their replies (:mod:`.replies`) into Python values, over a
client for the topology (:mod:`.client`: a single Redis, Sentinel, a Redis Cluster) and, on the
hot path, a line of its own (:mod:`.wire`).
"""
from .api import DEAD_CHUNK, ID_PAGE, MAX_REPUBLISH_BACKOFF, OPERATOR_BATCH, Gate  # noqa: F401
from .client import RETRY_BUDGET, SOCKET_TIMEOUT, BoundedRetry, make_client, wait_timeout_ms  # noqa: F401
from .library import SCRIPT_NAMES, Library, function_library, script_sources  # noqa: F401
from .records import (  # noqa: F401
    HOLD_MARK,
    NO_HOLDER,
    DirectRelease,
    Record,
    call_id,
    claimant_prefix,
    find_record,
    held_by,
    member_field,
    parse_record,
    pause_reason,
    record_task,
    task_field,
)
from .replies import (  # noqa: F401
    ALREADY_CLAIMED,
    CLAIMED,
    DELETED,
    DIED,
    DONE,
    ENDED,
    NOOP,
    NOT_YOURS,
    RENEWED,
    REPLIES,
    REPUBLISH,
    RETRIED,
    STALE,
    STOPPING,
    Claim,
    DeadRecord,
    Done,
    Enqueue,
    Lapse,
    Outcome,
    Pause,
    Redriven,
    Release,
    Renewal,
    Restart,
    Resume,
    Scan,
    ThreadSnapshot,
)
from .wire import DirectLine  # noqa: F401
