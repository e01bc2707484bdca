"""Errors the cache raises beyond ``ValueError`` / ``TypeError`` for bad arguments."""

from __future__ import annotations


class CacheInvariantError(AssertionError):
    """``sanity_check`` found violations; the message lists all of them."""


class CacheFailedError(RuntimeError):
    """A KV copy failed even after its retries. The cache refuses every call until
    ``reset()`` (the pages the copy named hold undefined bytes and must never be served)."""


class OwnerThreadError(RuntimeError):
    """A cache call came from a thread other than the cache's owner thread (see
    ``HiRadixCache``: the first thread that called it). The cache is not thread-safe: one
    thread, the scheduler's, makes every call; nothing changed."""


class CacheClosedError(RuntimeError):
    """The cache was closed (``HiRadixCache.close``, which ``CacheStack.close`` calls): it
    serves nothing any more; build a new cache to serve again. Nothing changed."""
