"""celery-threads: Celery tasks serialized per thread id, earliest scheduled first."""
from . import install as _install  # noqa: F401  (connects the app-finalize and worker hooks)
from .errors import InvalidThreadId, ThreadsError
from .task import ThreadedTask
from .threads import DeadTask, MemberInfo, ThreadInfo, Threads

__all__ = [
    "DeadTask",
    "InvalidThreadId",
    "MemberInfo",
    "ThreadInfo",
    "ThreadedTask",
    "Threads",
    "ThreadsError",
]
__version__ = "0.1.0"
