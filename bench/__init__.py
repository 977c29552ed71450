"""Benchmarks of celery-threads against plain Celery: ``python -m bench <name> [--quick]``.

Each benchmark starts its own redis-server, workers and beat, runs both sides in the same run on the
same worker configuration, and prints one table (see docs/benchmarks.md).
"""
