"""The gate: the Redis side of celery-threads, the single source of truth.

Each transition is one atomic Lua script (``lua/*.lua``, sharing ``lua/_common.lua``), loaded as
a function library where the server allows it (:mod:`.library`).  :class:`Gate`
(:mod:`.transitions`) names the transitions and turns their replies (:mod:`.replies`) into Python
values; :class:`GateReads` (:mod:`.reads`, a gate's ``reads``) reads what they left, changing
nothing.  Both go over a client for the topology (:mod:`.client`: a single Redis, Sentinel, a
Redis Cluster); the transitions, on the hot path, over a line of their own (:mod:`.wire`).
"""

from .client import RETRY_BUDGET, SOCKET_TIMEOUT, BoundedRetry, make_client, wait_timeout_ms  # noqa: F401
from .library import SCRIPT_NAMES, Library, function_library, script_sources  # noqa: F401
from .reads import DEAD_CHUNK, ID_PAGE, GateReads  # noqa: F401
from .records import (  # noqa: F401
    HOLD_MARK,
    NO_HOLDER,
    Record,
    ReleasePush,
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
    DELETED,
    ENDED,
    REPLIES,
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
from .transitions import MAX_REPUBLISH_BACKOFF, OPERATOR_BATCH, Gate  # noqa: F401
from .wire import ScriptLine  # noqa: F401
