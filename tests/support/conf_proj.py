"""tests.support.proj with more ``app.conf`` from the environment: CT_CONF_JSON, a JSON object (TLS
options, ``threads_redis_options``...) applied over what tests/support/proj.py sets.  Run it as
``celery -A tests.support.conf_proj``; the tasks keep their tests.support.proj names."""

from __future__ import annotations

import json
import os

from tests.support.proj import app

app.conf.update(json.loads(os.environ.get("CT_CONF_JSON") or "{}"))

__all__ = ["app"]
