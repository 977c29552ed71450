"""Signals sent by celery-threads (Celery's own signal class, so ``.connect`` works as usual)."""

from celery.utils.dispatch import Signal

#: Sent when a member dies: retries exhausted, a final exception, a hard time limit, a lapsed lease
#: with no retries left, or ``Reject(requeue=False)``.  Sent in the process that saw the death (a
#: worker's pool child, its main process, or the dispatcher).
#: Arguments: ``task_id``, ``thread_id``, ``name``, ``exception`` (a string), ``retries``.
member_dead = Signal(
    name="member_dead",
    providing_args={"task_id", "thread_id", "name", "exception", "retries"},
)
