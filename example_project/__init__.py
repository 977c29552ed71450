"""A ledger whose postings are serialized per account with celery-threads (see README.md here)."""
