"""Who may call the cache, and when it refuses calls: the owner thread, the failure latch's
refusal and ``close``.

``CallGate`` is ``HiRadixCache``'s base class (its facade's calls read ``self._owner`` with one
thread-id compare per call, so the gate's state lives on the cache itself). What it asks of
the class built on it: ``failure`` (the latched ``CacheFailedError`` or None), ``reset()`` and
``flush()``, used by ``close``.

Threading: every method here but the ``closed`` / ``owner_thread`` properties runs on the
owner thread (or binds it); the refusals are instance attributes that shadow the public
methods, so an open gate costs the calls nothing.
"""

from __future__ import annotations

import threading
from threading import get_ident

from .errors import CacheClosedError, CacheFailedError, OwnerThreadError

# The public calls a closed failure latch refuses (see ``CallGate._refuse_calls``).
REFUSED_AFTER_FAILURE = (
    "match_prefix",
    "peek_prefix",
    "insert",
    "insert_host",
    "inc_lock_ref",
    "dec_lock_ref",
    "writing_check",
    "loading_check",
    "check_events",
    "agree_step",
    "flush",
    "alloc_device",
    "evict",
    "evict_host",
    "load_back",
    "begin_request",
    "cache_unfinished_req",
    "cache_finished_req",
    "alloc_component",
    "reserve_component_host_pages",
    "reserve_component_host_pages_agreed",
    "slide_window",
    "abort_request",
)

# The public calls a closed cache refuses (``close``): every one that serves or changes it.
REFUSED_WHEN_CLOSED = REFUSED_AFTER_FAILURE + (
    "reset",
    "enable_retention",
    "add_watch",
    "remove_watch",
    "backed_up_prefix",
    "tree_match_tokens",
    "pin_host",
    "unpin_host",
    "reserve_host_pages",
    "reserve_host_pages_agreed",
    "settle_host_pages",
    "settle_component_host_pages",
    "device_fit",
)


class CallGate:
    """The owner thread and the refusals of a cache (see the module docstring)."""

    failure: CacheFailedError | None  # provided by the class built on the gate

    def _open_gate(self, check_owner_thread: bool) -> None:
        """Construction (any thread): no owner yet (the first checked call binds it), open."""
        self._owner: int | None = None
        self._owner_name = ""
        self._check_owner_thread = check_owner_thread
        self._closed = False  # ``close``

    # ------------------------------------------------------------------ failure latch
    def _refuse_calls(self, failure: CacheFailedError) -> None:
        """The failure latch closed: until ``reset``, every public call in
        ``REFUSED_AFTER_FAILURE`` raises ``failure`` before doing anything. The refusal is an
        instance attribute shadowing the method, so an open latch costs the calls nothing."""
        if self._closed:
            return  # a closed cache refuses every call already, for good

        def refuse(*_args, **_kwargs):
            raise failure

        for name in REFUSED_AFTER_FAILURE:
            setattr(self, name, refuse)

    def _accept_calls(self) -> None:
        """``reset`` after a failure: the refused calls serve again."""
        for name in REFUSED_AFTER_FAILURE:
            self.__dict__.pop(name, None)

    # ------------------------------------------------------------------ close
    def close(self) -> None:
        """Close the cache for good: finish the copies in flight (``flush``; after a
        ``CacheFailedError``, ``reset`` first: the failed copies' bytes are dropped), then
        refuse every call that serves or changes the cache (``REFUSED_WHEN_CLOSED``) with
        ``CacheClosedError``, even if the flush raised. Read-only views (``stats``,
        ``gauges``, ``sanity_check``, ``debug_view``, the properties) still answer.

        Owner thread only (``OwnerThreadError`` from another, with nothing changed);
        idempotent. An L3 controller attached to the cache must be closed first (it still
        uses the cache while closing): ``CacheStack.close`` does both in that order."""
        if self._closed:
            return
        if get_ident() != self._owner:
            self._not_owner("close")
        try:
            if self.failure is not None:
                self.reset()
            self.flush()
        finally:
            self._closed = True

            def refusal(name: str):
                def refuse(*_args, **_kwargs):
                    raise CacheClosedError(
                        f"{name}: the cache is closed (close() or CacheStack.close() was "
                        f"called); build a new cache to serve again"
                    )

                return refuse

            for name in REFUSED_WHEN_CLOSED:
                setattr(self, name, refusal(name))

    @property
    def closed(self) -> bool:
        """True once ``close()`` ran."""
        return self._closed

    # ------------------------------------------------------------------ owner thread
    def _not_owner(self, call: str) -> None:
        """A checked call from a thread that is not the owner's: the first call binds the
        owner; with the check off the owner follows the caller; otherwise OwnerThreadError."""
        tid = get_ident()
        if self._owner is None or not self._check_owner_thread:
            self._owner, self._owner_name = tid, threading.current_thread().name
            return
        raise OwnerThreadError(
            f"{call}: called from thread {threading.current_thread().name!r} (id {tid}), but this cache belongs to "
            f"thread {self._owner_name!r} (id {self._owner}): every call to a cache and its StorageController must "
            f"come from one thread, the owner (the first thread that called it). Make the calls from the owner "
            f"thread, hand the cache over with cache.release_owner() on the owner thread, or turn the check off "
            f"with HiCacheConfig(check_owner_thread=False) if your engine serialises the calls itself"
        )

    def check_owner(self, call: str = "call") -> None:
        """Raise ``OwnerThreadError`` naming ``call`` unless the current thread is the cache's
        owner (binding the owner if none is yet). For a caller's own entry points that use the
        cache, e.g. the L3 controller's; the cache's own calls check themselves."""
        if get_ident() != self._owner:
            self._not_owner(call)

    def release_owner(self) -> None:
        """On the owner thread: give up ownership; the next thread that calls becomes the
        owner (a deliberate hand-over, e.g. to a new scheduler thread)."""
        if get_ident() != self._owner:
            self._not_owner("release_owner")
        self._owner, self._owner_name = None, ""

    @property
    def owner_thread(self) -> int | None:
        """The owner thread's id (``threading.get_ident()``), None until the first call."""
        return self._owner
