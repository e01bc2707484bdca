"""One ``close()`` for a serving stack: the cache, its L3 storage controller, its transfer engines.

Usage (your engine builds the parts; the stack owns their shutdown)::

    with CacheStack(cache, storage=controller, transfers=[transfer]) as stack:
        ...                        # serve: stack.cache, stack.storage
    # or: stack = CacheStack(...); ...; stack.close()

``close()`` shuts down in the order that loses nothing:

1. stop admitting: the stack refuses every further use (``stack.cache`` / ``stack.storage`` /
   ``stack.check_events()`` raise ``StackClosedError``; a prefetch on the closed controller is
   a ``closed`` no-op);
2. finish the cache's copies (``cache.flush()``): every D2H backup is acknowledged, so its L3
   write is queued; a latched copy failure resets the cache first (its copies are waited for,
   their errors ignored: the bytes are not trusted);
3. the controller (``StorageController.close``): cancels the prefetches in flight (their host
   pages are freed once their reads let go), waits for every L3 write, makes the store durable
   and closes the store it built;
4. the cache itself (``HiRadixCache.close``): from then on the raw ``cache`` object refuses to
   serve too (``CacheClosedError``), not only ``stack.cache``;
5. the transfer engines, then any other ``closers``, in the order given.

A step that raises does not stop the later ones (a transfer engine is closed even if the store
failed); the first error is raised at the end. ``close()`` is idempotent: a second call does
nothing. Without ``close()`` a process exit still flushes the controller's pending L3 writes
where it can, or logs how many it loses (``hicache_jax.l3.exit_flush``).

Threading: like the cache, the stack belongs to the cache's owner thread; ``close()`` runs
there: from another thread it raises ``OwnerThreadError`` before anything changes (the stack
stays open, and a close() on the owner thread then closes it). The stack owns nothing but the
order: each part keeps its own threads and state.
"""

from __future__ import annotations

import logging
from typing import Iterable

log = logging.getLogger("hicache_jax.stack")


class StackClosedError(RuntimeError):
    """The stack was closed; build a new cache and stack to serve again."""


class CacheStack:
    """Shutdown order for a cache, its L3 controller and its transfer engines (see the module
    docstring). ``storage``: a ``StorageController`` attached to ``cache``, or None;
    ``transfers``: objects with ``close()`` (transfer engines, closed after the controller);
    ``closers``: anything else with ``close()``, closed last."""

    def __init__(self, cache, storage=None, transfers: Iterable = (), *, closers: Iterable = ()) -> None:
        from .cache.hiradix_cache import HiRadixCache  # the package imports with numpy alone
        from .l3.controller import StorageController

        if not isinstance(cache, HiRadixCache):
            raise TypeError(f"cache: expected a HiRadixCache, got {type(cache).__name__}")
        if storage is not None:
            if not isinstance(storage, StorageController):
                raise TypeError(f"storage: expected a StorageController or None, got {type(storage).__name__}")
            if storage.cache is not cache:
                raise ValueError("storage: this controller is attached to another cache")
        transfers, closers = [t for t in transfers if t is not None], [c for c in closers if c is not None]
        for name, items in (("transfers", transfers), ("closers", closers)):
            for i, x in enumerate(items):
                if not callable(getattr(x, "close", None)):
                    raise TypeError(f"{name}[{i}]: expected an object with close(), got {type(x).__name__}")
        self._cache = cache
        self._storage = storage
        self._transfers = transfers
        self._closers = closers
        self._closed = False

    # ------------------------------------------------------------------ while open
    def _open(self, what: str) -> None:
        if self._closed:
            raise StackClosedError(
                f"{what}: the stack is closed (close() was called); build a new cache and stack to serve again"
            )

    @property
    def cache(self):
        self._open("CacheStack.cache")
        return self._cache

    @property
    def storage(self):
        """The L3 controller, or None."""
        self._open("CacheStack.storage")
        return self._storage

    @property
    def transfers(self) -> list:
        self._open("CacheStack.transfers")
        return list(self._transfers)

    @property
    def closed(self) -> bool:
        return self._closed

    def check_events(self) -> None:
        """``cache.check_events()`` (once per scheduler step)."""
        self._open("CacheStack.check_events")
        self._cache.check_events()

    # ------------------------------------------------------------------ shutdown
    def close(self) -> None:
        """Shut everything down in order (see the module docstring). Idempotent. Owner
        thread only: ``OwnerThreadError`` from another, with nothing changed."""
        if self._closed:
            return
        self._cache.check_owner("CacheStack.close")  # before anything changes
        self._closed = True  # 1. stop admitting
        errors: list[BaseException] = []

        def step(what: str, fn) -> None:
            try:
                fn()
            except Exception as e:  # noqa: BLE001 - every later step still runs; the first error is raised
                log.exception("CacheStack.close: %s failed", what)
                errors.append(e)

        cache = self._cache
        if not cache.closed:  # (closed by hand already: its copies are finished)
            step(
                "finishing the cache's copies",
                lambda: (cache.reset() if cache.failure is not None else None, cache.flush()),
            )
        if self._storage is not None:
            step("closing the L3 controller", self._storage.close)
        step("closing the cache", cache.close)
        for t in self._transfers:
            step(f"closing {type(t).__name__}", t.close)
        for c in self._closers:
            step(f"closing {type(c).__name__}", c.close)
        if errors:
            raise errors[0]

    def __enter__(self) -> "CacheStack":
        self._open("CacheStack.__enter__")
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return (
            f"CacheStack({state}, storage={'yes' if self._storage is not None else 'no'}, "
            f"transfers={len(self._transfers)}, closers={len(self._closers)})"
        )
