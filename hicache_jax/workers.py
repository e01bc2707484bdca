"""Background worker threads of the cache, run at a lower OS priority than the serving thread.

The cache's copies and storage I/O (D2H completion, L3 hashing / writes / reads, segment
saves) run on worker threads so the scheduler never waits for them. On an accelerator the
bytes move by DMA, but the host side of that work (memcpy into the host pool, CRCs, file
I/O, orbax's bookkeeping) still needs CPU cores, and on a host with few cores per device
it takes them from the thread that drives the model. Workers therefore raise their own
nice value (``DEFAULT_WORKER_NICE``): the kernel runs them whenever a core is idle and
hands the core to the serving thread when it wants it. Backups are delayed under load,
never dropped; ``nice=0`` turns this off.

The default is the lowest priority, 19. Measured on the project's 2-vCPU VM (reference
engine decoding a batch of 8 while a 2k-token prompt's write-through and orbax L3 save run;
``bench ttft``'s overlapping-step ratio, 5 rounds per run): nice 10 gave x0.96-1.12 over 7
runs (mean x1.048), nice 19 x0.99-1.09 over 5 runs (mean x1.029). ``SCHED_IDLE`` was no
better (x0.99, x1.08), plausibly because a starved worker that holds the GIL stalls the
serving thread. Single runs scatter by about +-0.05, as much as the effect.

Threading: ``lower_thread_priority`` changes only the calling thread (Linux keeps the nice
value per thread); threads that thread starts later inherit it, so libraries' helper
threads spawned from a worker (orbax's commit threads, for instance) run at the same
priority. On platforms without per-thread nice values it does nothing and says so once.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

from ._checks import check_int

log = logging.getLogger(__name__)

DEFAULT_WORKER_NICE = 19
MAX_NICE = 19
_warned = False


def check_nice(value: object, name: str = "worker_nice") -> int:
    """``value`` as a nice increment in [0, 19]; TypeError / ValueError naming ``name`` otherwise."""
    return check_int(name, value, 0, MAX_NICE, numpy_ints=False)


def lower_thread_priority(nice: int) -> bool:
    """Add ``nice`` to the calling thread's nice value (capped at 19). True when it took effect
    (or ``nice`` is 0); False where the platform has no per-thread priority or refused it."""
    global _warned
    if nice == 0:
        return True
    if not sys.platform.startswith("linux") or not hasattr(os, "setpriority"):
        if not _warned:
            _warned = True
            log.info("worker threads keep the default priority: no per-thread nice values on %s", sys.platform)
        return False
    tid = threading.get_native_id()
    try:
        current = os.getpriority(os.PRIO_PROCESS, tid)
        os.setpriority(os.PRIO_PROCESS, tid, min(MAX_NICE, current + nice))
        return True
    except OSError as e:  # e.g. a seccomp sandbox: run at the default priority
        if not _warned:
            _warned = True
            log.warning("could not lower worker thread priority: %r", e)
        return False


def thread_nice() -> int | None:
    """The calling thread's nice value (None where the platform cannot tell)."""
    if not sys.platform.startswith("linux") or not hasattr(os, "getpriority"):
        return None
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def background_executor(name: str, nice: int, max_workers: int = 1) -> ThreadPoolExecutor:
    """A ``ThreadPoolExecutor`` whose threads run at ``nice`` above the caller's priority."""
    check_nice(nice, "nice")
    return ThreadPoolExecutor(max_workers, thread_name_prefix=name, initializer=lower_thread_priority, initargs=(nice,))
