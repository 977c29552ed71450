"""Every error the package raises derives from ``ThreadsError`` (keeping the standard base a caller
may catch already), and the package's public names export every one of them."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import click

import celery_threads
from celery_threads import errors
from celery_threads.errors import ThreadsError


def _modules() -> list[str]:
    return [celery_threads.__name__] + [
        info.name for info in pkgutil.walk_packages(celery_threads.__path__, celery_threads.__name__ + ".")
    ]


def _errors_defined_in(module_name: str) -> list[type[BaseException]]:
    module = importlib.import_module(module_name)
    return [
        cls
        for _, cls in inspect.getmembers(module, inspect.isclass)
        if issubclass(cls, BaseException) and cls.__module__ == module_name
    ]


def test_every_error_class_of_the_package_is_a_threads_error():
    """Every exception class any module defines, but two kinds: a private one (``_Name``) never
    leaves its module (control flow), and the command line's own ``click.ClickException``s are
    the messages click prints as it exits (they must not be ThreadsErrors: the command line turns
    a ThreadsError into a message of exit status 1, and these carry exit statuses of their own)."""
    found = [cls for name in _modules() for cls in _errors_defined_in(name)]
    assert found, "no error class found: the walk of the package is broken"
    outside = [
        f"{cls.__module__}.{cls.__qualname__}"
        for cls in found
        if not cls.__name__.startswith("_")
        and not issubclass(cls, click.ClickException)
        and not issubclass(cls, ThreadsError)
    ]
    assert not outside, f"not ThreadsErrors: {outside}"


def test_the_errors_keep_the_standard_bases_callers_catch():
    assert issubclass(errors.InvalidThreadId, ValueError)
    assert issubclass(errors.UndecodableEnvelope, ValueError)
    assert issubclass(errors.UnknownTask, KeyError)
    import redis

    assert issubclass(errors.NotReplicated, redis.TimeoutError)
    assert issubclass(errors.DeadlinePassed, redis.TimeoutError)


def test_every_error_of_errors_py_is_a_public_name():
    defined = {cls.__name__ for cls in _errors_defined_in(errors.__name__)}
    assert defined <= set(celery_threads.__all__), sorted(defined - set(celery_threads.__all__))
    for name in defined:
        assert getattr(celery_threads, name) is getattr(errors, name)


def test_lease_expired_still_resolves_where_stored_results_name_it():
    """A result the dispatcher stored before the class moved to ``errors`` names
    ``celery_threads.dispatcher.LeaseExpired``: a reader of that result finds the same class."""
    from celery_threads import dispatcher

    assert dispatcher.LeaseExpired is errors.LeaseExpired
