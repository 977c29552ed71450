"""celery-threads: Celery tasks serialized per thread id, earliest scheduled first."""

from . import install as _install  # noqa: F401  (connects the app-finalize and worker hooks)
from .admin import (
    ActiveStatus,
    DeadTask,
    MemberInfo,
    Stats,
    StuckThread,
    ThreadInfo,
    Threads,
    ThreadStatus,
    ThreadSummary,
    WaitingStatus,
)
from .errors import (
    ConfigurationError,
    DeadlinePassed,
    GateUnavailable,
    InvalidArgument,
    InvalidThreadId,
    LeaseExpired,
    NotReplicated,
    ReleaseExpired,
    SeamRefused,
    ThreadFull,
    ThreadsError,
    TransportMismatch,
    UndecodableEnvelope,
    UnknownTask,
)
from .task import ThreadedTask

__all__ = [
    "ActiveStatus",
    "ConfigurationError",
    "DeadTask",
    "DeadlinePassed",
    "GateUnavailable",
    "InvalidArgument",
    "InvalidThreadId",
    "LeaseExpired",
    "MemberInfo",
    "NotReplicated",
    "ReleaseExpired",
    "SeamRefused",
    "Stats",
    "StuckThread",
    "ThreadInfo",
    "ThreadStatus",
    "ThreadSummary",
    "ThreadFull",
    "ThreadedTask",
    "Threads",
    "ThreadsError",
    "TransportMismatch",
    "UndecodableEnvelope",
    "UnknownTask",
    "WaitingStatus",
]
__version__ = "0.1.0"
