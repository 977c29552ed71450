"""What a user who set a ``threads_*`` setting to a value of the wrong kind is told, and how values
given as strings (``app.conf.update(os.environ)``, ``config_from_envvar``) are read: a boolean as
Celery reads one, a number as the number it holds; anything else is a ConfigurationError that
names the setting and the value.  No Redis needed: ``read_config`` only reads ``app.conf``."""

from __future__ import annotations

from typing import Any

import pytest
from celery import Celery

from celery_threads.config import read_config
from celery_threads.errors import ConfigurationError

FLAGS = ("threads_worker_dispatch", "threads_direct_release", "threads_track_releases")
#: setting -> its smallest value
SECONDS = {
    "threads_keepalive": 0.001,
    "threads_dispatch_interval": 0.001,
    "threads_release_timeout": 0.001,
    "threads_publish_timeout": 0.001,
    "threads_dead_letter_ttl": 0.001,
    "threads_local_handoff": 0.0,
}
COUNTS = {
    "threads_dispatch_batch": 1,
    "threads_shards": 1,
    "threads_wait_replicas": 0,
    "threads_dead_letter_max": 0,
}


def read(setting: str, value: Any) -> Any:
    app = Celery("t", broker="redis://127.0.0.1:1/0", set_as_current=False)
    app.conf[setting] = value
    return getattr(read_config(app), setting.removeprefix("threads_"))


def refused(setting: str, value: Any) -> str:
    with pytest.raises(ConfigurationError) as info:
        read(setting, value)
    message = str(info.value)
    assert f"{setting}={value!r}" in message, message
    return message


@pytest.mark.parametrize(
    "setting, value",
    [
        *((flag, bad) for flag in FLAGS for bad in ("maybe", "", "2", 2, 0.5)),
        *((s, bad) for s in SECONDS for bad in ("abc", "", "nan", "inf", "-inf", -1)),
        *((s, bad) for s in SECONDS if SECONDS[s] for bad in (1e-9, "0", 0)),
        *((c, bad) for c in COUNTS for bad in ("ten", "2.5", 2.5, "nan", "inf", -1)),
        ("threads_dispatch_batch", 0),
        ("threads_dispatch_batch", "-5"),
        ("threads_keepalive", True),
        ("threads_shards", True),
    ],
)
def test_a_bad_value_raises_a_configuration_error_naming_setting_and_value(setting, value):
    message = refused(setting, value)
    if setting in SECONDS:
        assert "number of seconds" in message
    elif setting in COUNTS:
        assert "whole number" in message
    else:
        assert "True or False" in message


@pytest.mark.parametrize(
    "setting, false, true",
    [
        ("threads_worker_dispatch", "false", "true"),
        ("threads_direct_release", "False", "TRUE"),
        ("threads_track_releases", "0", "1"),
        ("threads_worker_dispatch", "no", "yes"),
        ("threads_direct_release", " off ", " On "),
        ("threads_track_releases", "NO", "Yes"),
    ],
)
def test_a_boolean_given_as_a_string_reads_as_celery_reads_it(setting, false, true):
    assert read(setting, false) is False
    assert read(setting, true) is True
    assert read(setting, 0) is False and read(setting, True) is True


@pytest.mark.parametrize("setting", [*SECONDS, *COUNTS])
def test_a_number_given_as_a_string_reads_as_that_number_down_to_its_minimum(setting):
    if setting in SECONDS:
        minimum = SECONDS[setting]
        assert read(setting, "30") == 30.0 and isinstance(read(setting, "30"), float)
        assert read(setting, " 2.5 ") == 2.5
        assert read(setting, "1e1") == 10.0
        below = minimum - 0.0001 if minimum else -0.0001
    else:
        minimum = COUNTS[setting]
        assert read(setting, "30") == 30 and isinstance(read(setting, "30"), int)
        assert read(setting, " 8 ") == 8
        assert read(setting, "2.0") == 2 and read(setting, 3.0) == 3
        assert read(setting, "1e3") == 1000
        below = minimum - 1
    assert read(setting, str(minimum)) == minimum
    assert read(setting, minimum) == minimum
    refused(setting, below)
    refused(setting, str(below))


def test_a_broker_that_is_not_redis_is_named_without_its_password() -> None:
    app = Celery("t", broker="amqp://guest:secretpw@localhost:5672//", set_as_current=False)
    with pytest.raises(ConfigurationError, match="threads_redis_url") as info:
        read_config(app)
    assert "secretpw" not in str(info.value) and "amqp://guest:**@localhost:5672//" in str(info.value)


@pytest.mark.parametrize("password", ["xq7/zk9", "Tr0ub4dor#3x", "pq8?rt5"])
def test_a_password_written_unencoded_is_never_shown(password: str) -> None:
    """A '/', '#' or '?' in a password makes the URL parser misread it: the error printed the
    URL in full, or quoted part of the password in the parser's own words.  It masks it and
    says to percent-encode it."""
    app = Celery("t", set_as_current=False)
    app.conf.threads_redis_url = f"redis://gate:{password}@127.0.0.1:6399/0"
    with pytest.raises(ConfigurationError, match="must be percent-encoded") as info:
        read_config(app)
    shown = str(info.value)
    assert "redis://gate:**@127.0.0.1:6399/0" in shown
    assert not any(
        part in shown for part in password.replace("/", " ").replace("#", " ").replace("?", " ").split()
    )
