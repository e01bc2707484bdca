"""Transfer API between the cache manager and a KV backend (JAX, torch, numpy reference).

Only integer page ids cross this boundary, never arrays. The manager owns both allocators;
an engine only moves bytes.

* ``backup(device_ids, host_ids)``: D2H copy of whole device pages (all layers, all
  components) into host pages. Returns at once with a handle; the caller is never blocked
  on the copy. The device pages must stay allocated and unmodified, and the host pages
  reserved, until the handle is done (the manager keeps the node locked until the ack).
* ``load(host_ids, device_ids)``: H2D copy of host pages into device pages. Returns a
  ``LoadHandle`` with per-layer readiness, so a forward pass can start layer 0 while later
  layers are still in flight. The host pages must stay allocated until the handle is done.

Handles: ``done()`` polls without blocking; ``wait()`` blocks and re-raises a failure as
``TransferError``. Handles are completed in any order; the manager polls them.
``completed_at`` is the ``time.perf_counter()`` at which the copy finished, stamped by
whoever saw it finish first (a worker's completion callback, the engine, or the first
``wait``/poll that found it done), or None while unknown: the cache's duration histograms
measure issue -> completion with it, not issue -> the caller's next poll.

Threading: ``backup``/``load`` are called from the owner thread (the one that owns the
device pool: with JAX, the thread that donates the pool to the model step). Handles may be
polled from that thread; engines run the copies on their own workers.
"""

from __future__ import annotations

import concurrent.futures as cf
import threading
import time
from abc import ABC, abstractmethod
from typing import Callable, Sequence

import numpy as np

from .allocator import check_page_ids
from .host_pool import HostKVPool
from .kv_geometry import KVGeometry
from .workers import DEFAULT_WORKER_NICE, background_executor


class TransferError(RuntimeError):
    """A transfer failed; the pages it named hold undefined bytes."""


class TransferHandle(ABC):
    """A transfer in flight."""

    @property
    def completed_at(self) -> float | None:
        """``time.perf_counter()`` when the copy finished, or None (not finished, or the engine
        does not stamp it: the cache then takes the time it acknowledged the copy)."""
        return None

    @abstractmethod
    def done(self) -> bool:
        """True once the copy finished (successfully or not). Never blocks."""

    @abstractmethod
    def wait(self, timeout: float | None = None) -> None:
        """Block until done. Raises TransferError if the copy failed, TimeoutError on timeout."""


class LoadHandle(TransferHandle):
    """An H2D load with per-layer readiness."""

    num_layers: int

    @abstractmethod
    def layer_done(self, layer: int) -> bool:
        """True once ``layer`` has landed on the device. Never blocks."""

    @abstractmethod
    def wait_layer(self, layer: int, timeout: float | None = None) -> None:
        """Block until ``layer`` has landed."""

    def done(self) -> bool:
        return all(self.layer_done(l) for l in range(self.num_layers))

    def wait(self, timeout: float | None = None) -> None:
        for l in range(self.num_layers):
            self.wait_layer(l, timeout)


class CompletedHandle(LoadHandle):
    """A transfer that finished synchronously (e.g. zero pages). ``completed_at`` is its
    creation time (an engine may share one instance: the cache ignores a stamp older than
    the copy's issue)."""

    def __init__(self, num_layers: int = 1) -> None:
        self.num_layers = num_layers
        self._t_done = time.perf_counter()

    @property
    def completed_at(self) -> float | None:
        return self._t_done

    def layer_done(self, layer: int) -> bool:
        return True

    def wait_layer(self, layer: int, timeout: float | None = None) -> None:
        return None

    def done(self) -> bool:
        return True

    def wait(self, timeout: float | None = None) -> None:
        return None


class FutureHandle(TransferHandle):
    """Wraps a ``concurrent.futures.Future`` run on an engine's worker."""

    def __init__(self, future: cf.Future) -> None:
        self._future = future
        self._t_done: float | None = None
        future.add_done_callback(self._stamp)  # runs on the worker as the job ends

    def _stamp(self, _future: cf.Future) -> None:
        self._t_done = time.perf_counter()

    @property
    def completed_at(self) -> float | None:
        return self._t_done

    def done(self) -> bool:
        return self._future.done()

    def wait(self, timeout: float | None = None) -> None:
        try:
            self._future.result(timeout)
        except cf.TimeoutError:
            raise TimeoutError(f"transfer not done after {timeout} s") from None
        except Exception as e:  # noqa: BLE001 - surfaced to the manager as one error type
            raise TransferError(f"transfer failed: {e!r}") from e


class KVTransferEngine(ABC):
    """Moves KV pages between one device pool and one host pool."""

    geom: KVGeometry
    host_pool: HostKVPool
    device_num_pages: int

    @property
    def replicated(self) -> bool:
        """Whether every tensor-parallel rank holds the whole of every page (so rank 0 alone
        writes it to L3, under keys every rank shares): an MLA latent pool by default; an
        engine whose device pool says otherwise overrides this (``JaxDevicePool.replicated``)."""
        return self.geom.kind == "mla"

    def validate(self, device_ids: object, host_ids: object) -> tuple[np.ndarray, np.ndarray]:
        """Check a (device, host) id pair before anything is launched; raises ValueError/TypeError."""
        d = check_page_ids(device_ids, self.device_num_pages, "device_ids")
        h = check_page_ids(host_ids, self.host_pool.num_pages, "host_ids")
        if d.size != h.size:
            raise ValueError(f"device_ids and host_ids: expected equal lengths, got {d.size} and {h.size}")
        return d, h

    @abstractmethod
    def backup(self, device_ids: Sequence[int] | np.ndarray, host_ids: Sequence[int] | np.ndarray) -> TransferHandle:
        """Start a D2H copy of device pages into host pages; returns at once."""

    @abstractmethod
    def load(self, host_ids: Sequence[int] | np.ndarray, device_ids: Sequence[int] | np.ndarray) -> LoadHandle:
        """Start an H2D copy of host pages into device pages; returns at once."""

    # The cache's entry points. The cache passes only page ids it owns: int32 arrays of equal
    # length, in range, no repeats (its ownership bitmaps and allocators guarantee it, and
    # ``sanity_check`` verifies it), never modified while the copy is in flight. An engine may
    # skip ``validate`` for them; by default they are ``backup`` / ``load``, validation included.
    def backup_owned(self, device_ids: np.ndarray, host_ids: np.ndarray) -> TransferHandle:
        """``backup`` of ids the cache owns (see above)."""
        return self.backup(device_ids, host_ids)

    def load_owned(self, host_ids: np.ndarray, device_ids: np.ndarray) -> LoadHandle:
        """``load`` of ids the cache owns (see above)."""
        return self.load(host_ids, device_ids)

    def close(self) -> None:  # noqa: B027 (a no-op default: engines with workers override it)
        """Finish outstanding work and release workers."""


class SerialWorker:
    """One background thread running jobs in submission order (a D2H or H2D "stream"), at
    ``nice`` above the creating thread's priority (``workers``: it yields cores to the
    serving thread)."""

    def __init__(self, name: str, nice: int = DEFAULT_WORKER_NICE) -> None:
        self._pool = background_executor(name, nice)
        self._lock = threading.Lock()

    def submit(self, fn: Callable[[], object]) -> cf.Future:
        with self._lock:
            return self._pool.submit(fn)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)
