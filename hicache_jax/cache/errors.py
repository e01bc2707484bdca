"""Errors the cache raises beyond ``ValueError`` / ``TypeError`` for bad arguments."""

from __future__ import annotations


class CacheInvariantError(AssertionError):
    """``sanity_check`` found violations; the message lists all of them."""


class CacheFailedError(RuntimeError):
    """A KV copy failed even after its retries. The cache refuses every call until
    ``reset()`` (the pages the copy named hold undefined bytes and must never be served)."""
