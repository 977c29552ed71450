"""The policy task options (``on_death``, ``max_waiting``, ``thread_rate_limit``): their values
checked, and turned into what the gate's enqueue carries.  Each policy is decided inside the
gate's scripts (lua/_common.lua); this module only reads the options."""

from __future__ import annotations

import math
from typing import Any, NamedTuple, Optional

from celery.utils.time import rate

from .errors import ConfigurationError
from .protocol import MAX_DELAY_MS

ON_DEATH = ("advance", "hold")
#: The options, each a task attribute and an ``apply_async`` option of the same name.
OPTIONS = ("on_death", "max_waiting", "thread_rate_limit")


class Policy(NamedTuple):
    """One call's policies, as the gate takes them: ``text`` for the member's record
    (:func:`celery_threads.gate.policy_text`) and the enqueue's ``max_waiting``."""

    text: str
    max_waiting: Optional[int]


NO_POLICY = Policy("", None)


def check_on_death(value: Any, where: str) -> bool:
    """Whether ``value`` is ``"hold"``; ``None`` counts as the default ``"advance"``."""
    if value is None or value == "advance":
        return False
    if value == "hold":
        return True
    raise ConfigurationError(
        f"{where}: on_death must be one of {', '.join(map(repr, ON_DEATH))}, not {value!r}"
    )


def check_max_waiting(value: Any, where: str) -> Optional[int]:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigurationError(
            f"{where}: max_waiting must be None or an int of 1 or more (the "
            f"waiting members a call may find in its thread), not {value!r}"
        )
    return value


def rate_interval_ms(value: Any, where: str) -> Optional[int]:
    """The interval between two releases that Celery's rate form (``"10/s"``, ``"30/m"``,
    ``"100/h"``, or a number per second) allows, in whole milliseconds rounded up; ``None`` for
    no limit."""
    if value is None:
        return None
    try:
        if isinstance(value, bool):  # True is no rate (it read as 1/s)
            raise TypeError(value)
        per_second = float(rate(value))
    except (TypeError, ValueError, KeyError, AttributeError) as exc:
        raise ConfigurationError(
            f"{where}: thread_rate_limit must be Celery's rate form such as "
            f"'10/s', '30/m' or '100/h', not {value!r}"
        ) from exc
    if not per_second > 0:
        raise ConfigurationError(
            f"{where}: thread_rate_limit must allow more than 0 releases (None for no limit), not {value!r}"
        )
    interval = 1000 / per_second  # inf for the smallest floats
    if interval > MAX_DELAY_MS:
        raise ConfigurationError(
            f"{where}: thread_rate_limit {value!r} allows fewer than one release per 100 years, "
            "the slowest rate the gate keeps"
        )
    return max(1, math.ceil(interval))


def resolve(task: Any, options: dict[str, Any]) -> Policy:
    """The call's policies: each ``apply_async`` option (popped from ``options``, so that Celery
    never sees it) or else the task's attribute.  Raises :class:`ConfigurationError` naming the
    option when a value is not allowed."""
    values = {name: options.pop(name) if name in options else getattr(task, name, None) for name in OPTIONS}
    if not any(v is not None for v in values.values()):
        return NO_POLICY
    where = f"task {task.name}"
    text = policy_text(
        check_on_death(values["on_death"], where), rate_interval_ms(values["thread_rate_limit"], where)
    )
    return Policy(text, check_max_waiting(values["max_waiting"], where))


def policy_text(hold: bool = False, rate_interval_ms: Optional[int] = None) -> str:
    """A member's policies as its record keeps them (``make_record`` in lua/_common.lua): ``h``
    for ``on_death="hold"``, ``r<ms>`` for ``thread_rate_limit`` (the interval between two
    releases); ``""`` for none."""
    return ("h" if hold else "") + (f"r{rate_interval_ms}" if rate_interval_ms else "")


def check_task(cls: Any) -> None:
    """A task's policy attributes, checked where it is declared (not at its first call)."""
    where = f"task {cls.name}"
    check_on_death(getattr(cls, "on_death", None), where)
    check_max_waiting(getattr(cls, "max_waiting", None), where)
    rate_interval_ms(getattr(cls, "thread_rate_limit", None), where)
