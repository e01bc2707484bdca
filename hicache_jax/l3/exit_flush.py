"""At process exit, flush the L3 writes of every storage controller that was never closed.

A controller registers here when it is built (``track``) and leaves when it is closed
(``untrack``). A process that ends with a controller still open gets it closed here: pending
D2H backups are acknowledged, their L3 writes made, the store flushed and closed. Where that
cannot be done, or the store then reports pages it dropped, an error names the number of L3
writes lost (never a silent loss).

When: CPython forbids starting threads once interpreter shutdown has begun (3.12: before any
``atexit`` or threading-exit hook runs), and both the ``file`` store (its I/O pool, started on
first use) and ``orbax`` (every segment save) start threads to write. So the flush runs at
the first of:

1. the end of the main script's module code (``sys.monitoring``, Python 3.12+, armed when
   the first controller is built on the main thread; not under ``python -i`` or in a REPL,
   where the session goes on), when the main thread owns the cache: the interpreter is still
   whole, so every store writes (``orbax`` included, which starts a thread per save). Both
   ways out are caught: its return (one local ``PY_RETURN`` event on that one code object,
   no cost anywhere else) and its unwinding by an exception, ``sys.exit()`` / ``SystemExit``,
   an uncaught exception or ``KeyboardInterrupt`` (``PY_UNWIND``, an event CPython only
   delivers globally: while armed, every Python frame that an exception unwinds costs one
   identity check; disarmed once the flush ran);
2. interpreter shutdown (``threading._register_atexit``, the hook ``concurrent.futures`` uses
   to stop its workers; ours runs before that): covers 3.11, a ``python -i`` session, and
   whatever the first could not flush. Our executors still take work, but a store that must
   start a thread fails its write there, and the loss is reported with its count.

Not flushed, error logged with the count: several ranks (``cache.agreed``: closing needs
agreement steps, and the other ranks may be gone), a cache owned by another thread. A killed
process (SIGKILL, ``os._exit``) runs no hook: only ``close()`` is a guarantee.

Threading: ``track`` / ``untrack`` may run on any thread (a lock guards the registry); the
hooks run on the main thread. The registry holds controllers weakly: a controller that was
garbage-collected is not flushed.
"""

from __future__ import annotations

import atexit
import inspect
import logging
import sys
import threading
import weakref

log = logging.getLogger("hicache_jax.cache.storage")

_lock = threading.Lock()
_open: "weakref.WeakSet" = weakref.WeakSet()
_hooked = False
_armed = False


def _register() -> None:
    import concurrent.futures.thread  # noqa: F401 - its exit hook first, so ours runs before it

    if hasattr(threading, "_register_atexit"):  # CPython 3.9+
        threading._register_atexit(flush_at_exit)  # run in reverse order: before concurrent.futures' own
    else:
        atexit.register(flush_at_exit)


def _arm_main_return() -> bool:
    """Call ``flush_at_main_return`` when the main script's module code returns or an
    exception unwinds it (see the module docstring). False where that cannot be armed (before 3.12, not on the main thread,
    no free monitoring tool id, no main script frame on this stack)."""
    mon = getattr(sys, "monitoring", None)
    main = sys.modules.get("__main__")
    if mon is None or main is None or threading.current_thread() is not threading.main_thread():
        return False
    if sys.flags.interactive or (not hasattr(main, "__file__") and sys.argv[:1] != ["-c"]):
        return False  # python -i / a REPL: the session goes on after the script, so it is no exit
    frame = inspect.currentframe()
    while frame is not None and not (frame.f_code.co_name == "<module>" and frame.f_globals is vars(main)):
        frame = frame.f_back
    if frame is None:
        return False
    code = frame.f_code
    del frame
    tool = next((t for t in (4, 3, 2, 1, 0, 5) if mon.get_tool(t) is None), None)
    if tool is None:
        return False

    def on_return(returned_code, _offset, _value):
        if returned_code is code:
            mon.set_events(tool, 0)  # the unwind hook below is no longer needed
            flush_at_main_return()
        return mon.DISABLE

    def on_unwind(unwound_code, _offset, _exc):
        # Global event (no DISABLE): called for every frame an exception unwinds, any thread.
        if unwound_code is code:  # the main script ends by an exception: the process is exiting
            mon.set_events(tool, 0)
            flush_at_main_return()

    mon.use_tool_id(tool, "hicache_jax L3 exit flush")
    mon.register_callback(tool, mon.events.PY_RETURN, on_return)
    mon.register_callback(tool, mon.events.PY_UNWIND, on_unwind)
    mon.set_local_events(tool, code, mon.events.PY_RETURN)
    mon.set_events(tool, mon.events.PY_UNWIND)
    return True


def track(controller: object) -> None:
    """``controller`` is open: flush it at exit unless it is closed first."""
    global _hooked, _armed
    with _lock:
        if not _hooked:
            _register()
            _hooked = True
        if not _armed:
            _armed = _arm_main_return()
        _open.add(controller)


def untrack(controller: object) -> None:
    with _lock:
        _open.discard(controller)


def open_controllers() -> list:
    with _lock:
        return list(_open)


def describe(pending: dict) -> str:
    return (
        f"{pending['l3_pages']} page(s) in L3 backup jobs, {pending['unacknowledged_backups']} host "
        f"backup(s) not yet acknowledged (each becomes L3 writes), store buffer "
        f"{'not ' if not pending['store_buffered'] else ''}pending"
    )


def _owned_here(controller) -> str:
    """Why this thread cannot close ``controller`` ('' if it can)."""
    if controller.cache.agreed:
        return "it runs with several ranks (closing needs agreement steps, and the other ranks may be gone)"
    try:
        controller.cache.check_owner("the exit-time L3 flush")
    except RuntimeError as e:  # OwnerThreadError
        return f"the exit runs on a thread that does not own the cache ({e})"
    return ""


def flush_one(controller) -> bool:
    """Close ``controller`` if that is safe here (see the module docstring), else log how many
    writes are lost. True if nothing was left pending. Either way it leaves the registry."""
    untrack(controller)
    pending = controller.pending_writes()
    if not pending["total"]:
        return True
    why = _owned_here(controller)
    if not why:
        m = controller.cache.metrics
        failed = m.storage_backup_failed_tokens
        dropped = controller.storage.metrics.snapshot().get("pages_dropped", 0)
        try:
            controller.close()
            left = controller.pending_writes()
            # A page the store refused counts as a failed backup, one it dropped after accepting it
            # (a failed segment save) as dropped; a store may count one page as both.
            lost = max(
                (m.storage_backup_failed_tokens - failed) // controller.page_size,
                controller.storage.metrics.snapshot().get("pages_dropped", 0) - dropped,
            )
            if lost:
                why, pending = (
                    "the store failed or dropped some of the writes",
                    {**left, "l3_pages": lost, "total": lost},
                )
            elif left["total"]:
                why, pending = "some writes were still pending after closing", left
            else:
                log.warning(
                    "L3: the storage controller was not closed; flushed its pending writes at exit (%s). "
                    "Call close() (or use CacheStack / a with block) before exiting.",
                    describe(pending),
                )
                return True
        except Exception as e:  # noqa: BLE001 - reported below, with the count
            why = f"closing failed ({type(e).__name__}: {e})"
    log.error(
        "L3: L3 writes LOST at exit (%s): the storage controller was never closed and %s. "
        "Call StorageController.close() (or CacheStack.close()) before the process exits.",
        describe(pending),
        why,
    )
    return False


def flush_at_main_return() -> None:
    """The main script returned or an exception ended it: flush the controllers this (the main) thread owns; the others
    are left to ``flush_at_exit`` (their owner thread may still be serving)."""
    for controller in open_controllers():
        try:
            if not _owned_here(controller):
                flush_one(controller)
        except Exception:  # noqa: BLE001 - one controller must not stop the others' flush
            log.exception("L3: the exit-time flush failed")


def flush_at_exit() -> None:
    for controller in open_controllers():
        try:
            flush_one(controller)
        except Exception:  # noqa: BLE001 - one controller must not stop the others' flush
            log.exception("L3: the exit-time flush failed")
