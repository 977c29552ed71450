"""The package's loggers: ids and texts from outside (thread ids, task ids, reasons, exception
texts) may hold any character, and a log line must stay one line that says what it is.

Every module's logger gets :data:`PRINTABLE`, which shows a ``%s`` argument holding a control or
non-printable character (a newline, NUL, a terminal escape) as :func:`repr` shows it: a NUL made
``grep`` take a worker's log for a binary file, and an escape sequence reached the terminal.
"""

from __future__ import annotations

import logging


class _Printable(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and any(isinstance(a, str) and not a.isprintable() for a in args):
            record.args = tuple(repr(a) if isinstance(a, str) and not a.isprintable() else a for a in args)
        return True


PRINTABLE = _Printable()


def get_logger(name: str) -> logging.Logger:
    """``logging.getLogger(name)`` with :data:`PRINTABLE`."""
    logger = logging.getLogger(name)
    if PRINTABLE not in logger.filters:
        logger.addFilter(PRINTABLE)
    return logger
