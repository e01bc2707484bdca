"""The L3 storage interface: pages keyed by 32-byte digests, moved to and from host (L2) pages.

Pure numpy. Backends subclass ``HiCacheStorage`` and implement protected hooks; the public
methods are this class's alone (no backend overrides one) and own everything around the hooks:
argument checks, packing host pages into page bytes and back, hit policies across pools, the
consecutive-hit rule, metrics, and turning every storage fault into a miss.

Hooks a backend implements (raw page bytes, arguments already checked, keys non-empty):

* ``_contains(pool, keys)``: whether each key is stored (or accepted and in flight).
* ``_read(pool, keys)``: verified page bytes per key, or None.
* ``_write(pool, keys, pages)``: store packed pages (none of the keys stored yet).

and may override, where it can do better than the default built on the three above:

* ``_read_into_host(pool, keys, ids, loaded)``: read pages straight into host pages (every
  shipped backend does: the bytes land in the host page's runs, ``PageCodec.runs()``, and are
  verified there, with no page-sized array per read); the default reads through ``_read``
  and then publishes every page (one extra copy per page, ``PageCodec.unpack_one``).
* ``_reads_in_place()``: True if ``get_multi`` over ``ALL_PAGES`` pools may read pool by
  pool through ``_read_into_host`` instead of reading everything before publishing anything.
* ``_write_from_host(pool, keys, ids)``: store host pages (``file`` and ``mooncake`` write
  straight out of the host page's runs, orbax packs them into its segment buffers); the
  default packs them into a new array for ``_write``.
* ``_writes_pending()``, ``_flush(timeout)``, ``_close()``: the lifecycle of an
  asynchronous backend (defaults: nothing pending, nothing to release).
* ``_contains_answered(pool, keys)``: ``_contains``, or None where the store could not be
  asked (``mooncake``, whose ``_contains`` reports an unreachable master as absent keys);
  ``exists_each`` uses it, so that an unknown is never taken for an absence.

A hook may raise on a storage fault; the public method that called it logs it, counts it and
reports misses / failed sets. A hook must never report a page it did not verify.

Page bytes: for each component of the pool's geometry (``k``, ``v`` or ``kv``), the page's slab
in the host layout's transfer order with the page axis first, concatenated: ``uint8[page_bytes]``.
The layout is part of the key namespace (``keys.Namespace.layout``), so a reader with another
layout never sees these bytes.

Pools and hit policies (as upstream's HiCache storage and its unified components, sglang #23391 and #21125): a request's pages exist in several pools (e.g.
``target``, ``draft``, ``swa``), each a ``HostKVPool`` with its own keys (its own namespace).

* ``ALL_PAGES``: every page in ``[0, hit)`` must be stored.
* ``TRAILING_PAGES(window)``: only the ``window`` pages before the hit point must be stored
  (``[max(0, hit - window), hit)``); SWA backups write only those.

The multi-pool hit is the largest ``hit`` satisfying every pool. Nothing is reported for a
page unless all pools have it, so a target page never counts without its draft (stronger
than upstream's draft-first). ``get_multi`` reads everything first and only then writes host
pages, unless the backend reads in place and every pool is ``ALL_PAGES`` (``file``,
``memory``, ``mooncake``, orbax's direct path): then it reads pool by pool (draft before target) straight into the host pages, and
host pages of the call beyond the hit may hold bytes: the caller's pages, never hits.

Error contract: caller mistakes (unknown pool, wrong key size, mismatched lengths, bad host
ids, a flush timeout that is not a number) raise ``TypeError``/``ValueError`` before any
storage is touched. Storage faults (I/O errors, corruption, vanished files, disk full,
read-only directories) never raise: they are logged, counted in ``metrics`` and reported as
misses / failed sets.

Contents listeners (``add_listener`` / ``remove_listener``): a listener ``fn(kind, pool, keys)``
is told, in the order the changes take effect, that ``keys`` (a non-empty list) became readable
from ``pool`` (``kind="stored"``: written, or accepted and served from a write buffer) or stopped
being readable (``kind="removed"``: evicted for capacity, dropped after a failed check, a failed
buffered save, a segment another process evicted). A backend calls it from whatever thread made
the change (the caller of ``batch_set`` / ``batch_get``, a writer thread, a refresh) while it
holds the lock that makes the change visible, so the calls for one store are serialised and a
``stored`` never overtakes the ``removed`` of the same key: a listener must be quick (queue the
keys) and must not call into the store. With no listener ``_notify`` is None and each change
site costs one ``is not None`` test. What each backend can and cannot report is stated in its
module (``mooncake``'s own evictions, and pages other processes remove, go unreported).

Threading: public methods may be called from several threads at once (the controller's
prefetch, IO and backup threads), so hooks may run concurrently; each backend documents its
own locking. ``close`` runs ``_close`` once (concurrent callers wait for it). Reads into host
pages write only the given host ids (``HostKVPool.write_pages`` on disjoint ids is
thread-safe); the caller owns those ids for the duration of the call. ``batch_set`` copies the
page bytes out of the host pool before it returns, so the caller may release or reuse those
host pages immediately.
"""

from __future__ import annotations

import logging
import numbers
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from enum import Enum
from typing import Callable, Mapping, Sequence

import numpy as np

from ..host_layout import HostLayout, page_major_shape
from ..host_pool import HostKVPool
from .config import StorageConfig
from .host_pages import PageRuns
from .keys import check_key
from .metrics import StorageMetrics

log = logging.getLogger("hicache_jax.storage")


class _SetPlan:
    """Which pages of a ``batch_set`` to write, and its per-page result list."""

    def __init__(self, keys: list[bytes], present: list[bool]) -> None:
        self.present, self.result, self.first, self.todo = present, [False] * len(keys), {}, []
        for i, (k, p) in enumerate(zip(keys, present)):
            if p:  # content-addressed: an equal key means equal bytes, so skip it
                self.result[i] = True
            elif k not in self.first:
                self.first[k] = i
                self.todo.append(i)

    def finish(self, keys: list[bytes]) -> list[bool]:
        for i, k in enumerate(keys):  # a repeated key shares its first occurrence's outcome
            if not self.present[i] and self.first[k] != i:
                self.result[i] = self.result[self.first[k]]
        return self.result


class PoolHitPolicy(str, Enum):
    ALL_PAGES = "all_pages"
    TRAILING_PAGES = "trailing_pages"


@dataclass(frozen=True)
class PoolSpec:
    """A pool name and its hit policy. ``window_pages`` (>= 1) is for ``TRAILING_PAGES`` only."""

    name: str
    policy: PoolHitPolicy = PoolHitPolicy.ALL_PAGES
    window_pages: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name or not all(c.isalnum() or c in "_-" for c in self.name):
            raise ValueError(f"name: expected a non-empty [A-Za-z0-9_-] pool name, got {self.name!r}")
        object.__setattr__(self, "policy", PoolHitPolicy(self.policy))
        if isinstance(self.window_pages, bool) or not isinstance(self.window_pages, int):
            raise TypeError(f"window_pages: expected an int, got {type(self.window_pages).__name__}")
        if self.policy is PoolHitPolicy.TRAILING_PAGES and self.window_pages < 1:
            raise ValueError(f"window_pages: TRAILING_PAGES needs >= 1, got {self.window_pages}")
        if self.policy is PoolHitPolicy.ALL_PAGES and self.window_pages != 0:
            raise ValueError("window_pages: only meaningful for TRAILING_PAGES; leave it 0")


@dataclass(frozen=True)
class PoolTransfer:
    """One pool's part of a multi-pool call: its keys (one per page of the request, for every
    pool, aligned) and, for get/set, the host page ids (aligned with ``keys``; for a
    ``TRAILING_PAGES`` pool only the entries inside the window are used, others may be -1)."""

    pool: str
    keys: Sequence[bytes]
    host_page_ids: object = None


@dataclass(frozen=True)
class HitResult:
    """``hit_pages``: pages ``[0, hit_pages)`` usable for every pool. ``pool_hits``: per pool,
    pages found (ALL_PAGES: consecutive from the start; TRAILING_PAGES: pages of the final
    window found)."""

    hit_pages: int
    pool_hits: Mapping[str, int] = field(default_factory=dict)


def consecutive(flags: Sequence[bool]) -> int:
    """Number of leading True values."""
    n = 0
    for f in flags:
        if not f:
            break
        n += 1
    return n


class PageCodec:
    """Packs host pages into page bytes and back for one ``HostKVPool``."""

    def __init__(self, pool: HostKVPool) -> None:
        self.pool = pool
        self.geom = pool.geom
        self.layer_first = pool.layout is HostLayout.LAYER_FIRST
        one = page_major_shape(self.geom, pool.layout, 1)
        self.comp_bytes = int(np.prod(one)) * self.geom.itemsize
        self.page_bytes = self.comp_bytes * len(self.geom.components)
        # Page-first shape of one component's slab for n pages (page axis moved first).
        self._slab = (one[:1] + one[2:]) if self.layer_first else one[1:]
        self._runs: PageRuns | None = None

    def runs(self) -> PageRuns:
        """Where each host page's bytes lie in ``pool`` (rebuilt if ``pool`` was replaced; two
        threads racing here build equal objects)."""
        r = self._runs
        if r is None or r.pool is not self.pool:
            r = self._runs = PageRuns(self.pool)
        return r

    def pack(self, ids: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """``uint8[n, page_bytes]`` copy of host pages ``ids`` (into ``out``, C-contiguous rows,
        when given): each page's runs (``PageRuns``) copied straight into its row, one copy of
        each byte. Not ``np.take`` per component: its destination is a strided view of the rows
        (components interleave per page), so numpy gathered into a fresh temporary and copied
        that back (0.3-0.6 GB/s against 0.9-1.5 for the runs, 64 x 2 MiB pages on the project
        VM). The copies keep the GIL (``PageRuns.copy_out``): a per-call GIL drop could wait a
        whole switch interval (5 ms) for a Python-heavy writer thread (orbax) each time."""
        ids = np.asarray(ids, np.intp)
        n = len(ids)
        if out is None:
            out = np.empty((n, self.page_bytes), np.uint8)
        self.runs().copy_out(ids.tolist(), out)
        return out

    def unpack_one(self, host_id: int, page: np.ndarray) -> None:
        """Write one page (``uint8[page_bytes]``) straight into the host pool's views: one copy,
        no staging buffer (reads of many 2 MiB pages are memory-bandwidth bound)."""
        dt = self.geom.container_dtype
        for i, c in enumerate(self.geom.components):
            part = page[i * self.comp_bytes : (i + 1) * self.comp_bytes].view(dt).reshape(self._slab)
            view = self.pool.component_view(c)
            if self.layer_first:
                view[:, host_id] = part
            else:
                view[host_id] = part

    def unpack(self, ids: np.ndarray, pages: np.ndarray) -> None:
        """Write ``uint8[n, page_bytes]`` into host pages ``ids``."""
        n = len(ids)
        dt = self.geom.container_dtype
        for i, c in enumerate(self.geom.components):
            part = np.ascontiguousarray(pages[:, i * self.comp_bytes : (i + 1) * self.comp_bytes]).view(dt)
            part = part.reshape((n,) + self._slab)
            if self.layer_first:
                part = np.moveaxis(part, 0, 1)
            self.pool.write_pages(c, ids, part)


class HiCacheStorage(ABC):
    """Abstract L3 store. See the module docstring for the contract and the hooks."""

    backend_name = "abstract"

    def __init__(
        self, config: StorageConfig, pools: Mapping[str, HostKVPool], specs: Sequence[PoolSpec] | None = None
    ) -> None:
        if not isinstance(config, StorageConfig):
            raise TypeError(f"config: expected StorageConfig, got {type(config).__name__}")
        if not isinstance(pools, Mapping) or not pools:
            raise ValueError("pools: expected a non-empty mapping of pool name -> HostKVPool")
        for name, p in pools.items():
            if not isinstance(p, HostKVPool):
                raise TypeError(f"pools[{name!r}]: expected HostKVPool, got {type(p).__name__}")
        if specs is None:
            specs = [PoolSpec(name) for name in pools]
        specs = list(specs)
        names = [s.name for s in specs]
        if sorted(names) != sorted(pools) or len(set(names)) != len(names):
            raise ValueError(f"specs: expected one PoolSpec per pool {sorted(pools)}, got {names}")
        if not any(s.policy is PoolHitPolicy.ALL_PAGES for s in specs):
            raise ValueError("specs: at least one pool (the target) must use ALL_PAGES")
        self.config = config
        self.specs: dict[str, PoolSpec] = {s.name: s for s in specs}
        self.primary = next(s.name for s in specs if s.policy is PoolHitPolicy.ALL_PAGES)
        self.codecs: dict[str, PageCodec] = {name: PageCodec(p) for name, p in pools.items()}
        self.metrics = StorageMetrics()
        self._close_lock = threading.Lock()
        self._closed = False
        # Contents listeners (module docstring): None while there are none, so each change
        # site in a backend costs one test; else one callable calling each in attach order.
        self._listeners: tuple = ()
        self._listen_lock = threading.Lock()
        self._notify: Callable[[str, str, list[bytes]], None] | None = None

    # ---- contents listeners --------------------------------------------------------------------
    def add_listener(self, fn: Callable[[str, str, list[bytes]], None]) -> None:
        """Tell ``fn(kind, pool, keys)`` of every page this store stores or drops from now on
        (module docstring: order, threads, what a listener may do)."""
        if not callable(fn):
            raise TypeError(f"fn: expected a callable fn(kind, pool, keys), got {type(fn).__name__}")
        with self._listen_lock:
            if any(f is fn for f in self._listeners):
                raise ValueError("fn: already a listener of this store")
            self._set_listeners(self._listeners + (fn,))

    def remove_listener(self, fn: Callable[[str, str, list[bytes]], None]) -> None:
        """Stop telling ``fn``; a call already under way may still reach it."""
        with self._listen_lock:
            rest = tuple(f for f in self._listeners if f is not fn)
            if len(rest) == len(self._listeners):
                raise ValueError("fn: not a listener of this store")
            self._set_listeners(rest)

    def _set_listeners(self, fns: tuple) -> None:  # under _listen_lock
        self._listeners = fns
        if not fns:
            self._notify = None
        elif len(fns) == 1:
            self._notify = fns[0]
        else:

            def fan_out(kind: str, pool: str, keys: list[bytes]) -> None:
                for f in fns:
                    f(kind, pool, keys)

            self._notify = fan_out

    # ---- hooks every backend implements --------------------------------------------------------
    @abstractmethod
    def _contains(self, pool: str, keys: list[bytes]) -> list[bool]:
        """Whether each key is stored (or accepted and in flight) in ``pool``."""

    @abstractmethod
    def _read(self, pool: str, keys: list[bytes]) -> list[np.ndarray | None]:
        """Verified ``uint8[page_bytes]`` per key, or None (absent / failed a check). The
        backend counts ``corrupt``/``quarantined``/``read_errors``/``verified``; the caller
        counts hits and misses."""

    @abstractmethod
    def _write(self, pool: str, keys: list[bytes], pages: np.ndarray) -> list[bool]:
        """Store ``pages`` (``uint8[n, page_bytes]``, owned by the callee) under ``keys``
        (none already stored). True = durably stored, or accepted for an asynchronous write."""

    # ---- hooks a backend may override ------------------------------------------------------------
    def _read_into_host(self, pool: str, keys: list[bytes], ids: Sequence[int], loaded: list[bool]) -> int:
        """Read page ``keys[i]`` into host page ``ids[i]`` and set ``loaded[i]`` for each page
        loaded (flags set before a raise still count); returns how many pages had their CRC
        checked here (the caller counts them with the hits). A page not loaded holds no stored
        bytes: untouched if its key is not stored, else untouched or zero-filled. This default
        reads every page through ``_read`` before writing any host page."""
        pages = self._checked_read(pool, keys)
        codec = self.codecs[pool]
        for i, page in enumerate(pages):
            if page is not None:
                codec.unpack_one(int(ids[i]), page)
                loaded[i] = True
        return 0

    def _reads_in_place(self) -> bool:
        """Whether ``get_multi`` over ``ALL_PAGES`` pools reads each pool straight into its host
        pages through ``_read_into_host`` (see the module docstring)."""
        return False

    def _write_from_host(self, pool: str, keys: list[bytes], ids: np.ndarray) -> list[bool]:
        """Store host pages ``ids`` under ``keys`` (distinct, none stored); same result as
        ``_write``. The page bytes must be copied out of the host pool before this returns."""
        return self._write(pool, keys, self.codecs[pool].pack(ids))

    def _contains_answered(self, pool: str, keys: list[bytes]) -> list[bool] | None:
        """``_contains``, or None where the backend knows it could not ask (a backend whose
        ``_contains`` reports an unreachable store as absent keys says so here)."""
        return self._contains(pool, keys)

    def _writes_pending(self) -> bool:
        return False

    def _flush(self, timeout: float | None) -> bool:
        return True

    def _close(self) -> None:  # noqa: B027 (a no-op default: backends with workers override it)
        pass

    # ---- lifecycle -----------------------------------------------------------------------------
    def writes_pending(self) -> bool:
        """Whether pages accepted by ``batch_set`` are not yet committed (never blocks)."""
        return self._writes_pending()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until accepted pages are durable (or dropped), at most ``timeout`` seconds (None:
        no limit; <= 0: do not wait). True if nothing is left pending."""
        if timeout is not None:
            if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real):
                raise TypeError(f"timeout: expected seconds or None, got {type(timeout).__name__}")
            if timeout != timeout:
                raise ValueError("timeout: expected seconds or None, got NaN")
        return self._flush(timeout)

    def close(self) -> None:
        """Flush and release resources. Idempotent; a second caller waits for the first."""
        with self._close_lock:
            if self._closed:
                return
            try:
                self._close()
            finally:
                self._closed = True

    def __enter__(self) -> "HiCacheStorage":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- argument checks ---------------------------------------------------------------------
    def _pool(self, pool: str | None) -> str:
        pool = self.primary if pool is None else pool
        if pool not in self.codecs:
            raise ValueError(f"pool: expected one of {sorted(self.codecs)}, got {pool!r}")
        return pool

    @staticmethod
    def _keys(keys: Sequence[bytes]) -> list[bytes]:
        if isinstance(keys, (bytes, str)):
            raise TypeError("keys: expected a sequence of 32-byte keys, got a single bytes/str")
        return [check_key(k) for k in keys]

    def _ids(self, pool: str, ids: object, n: int) -> np.ndarray:
        if ids is None:
            raise ValueError("host_page_ids: required")
        arr = np.asarray(ids)
        if arr.size and (arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer)):
            raise TypeError(f"host_page_ids: expected integers, got dtype {arr.dtype}")
        arr = arr.astype(np.int64).reshape(-1)
        if arr.size != n:
            raise ValueError(f"host_page_ids: expected {n} ids (one per key), got {arr.size}")
        return arr

    def _check_used_ids(self, pool: str, ids: np.ndarray, unique: bool) -> None:
        num = self.codecs[pool].pool.num_pages
        if ids.size and (ids.min() < 0 or ids.max() >= num):
            raise ValueError(f"host_page_ids: out of range [0, {num}) for pool {pool!r}")
        if unique and np.unique(ids).size != ids.size:
            raise ValueError("host_page_ids: duplicate host page ids")

    def _read_ids(self, pool: str, host_page_ids: object, n: int) -> Sequence[int]:
        """The checked host ids of a read (in range, distinct). A small, plainly valid call (a
        list/tuple/range of distinct in-range Python ints) is checked without numpy: one-page
        reads are frequent, and after a 2 MiB copy has flushed the CPU caches the numpy checks
        cost ~0.1 ms of a ~3 ms read. Anything else goes through the numpy checks (and their
        errors)."""
        num = self.codecs[pool].pool.num_pages
        if n == 1 and type(host_page_ids) is list and len(host_page_ids) == 1:  # the common lone page
            v = host_page_ids[0]
            if type(v) is int and 0 <= v < num:
                return [v]
        elif n <= 16 and isinstance(host_page_ids, (list, tuple, range)) and len(host_page_ids) == n:
            vals = list(host_page_ids)
            if all(type(v) is int for v in vals) and (
                not vals or (min(vals) >= 0 and max(vals) < num and len(set(vals)) == n)
            ):
                return vals
        ids = self._ids(pool, host_page_ids, n)
        self._check_used_ids(pool, ids, unique=True)
        return ids

    # ---- fault-tolerant wrappers around the hooks --------------------------------------------
    def _safe_contains(self, pool: str, keys: list[bytes]) -> list[bool]:
        if not keys:
            return []
        try:
            return [bool(x) for x in self._contains(pool, keys)]
        except Exception as e:  # a storage fault is a miss, never an exception
            log.warning("L3 %s: exists(%s, %d keys) failed: %r", self.backend_name, pool, len(keys), e)
            self.metrics.add(read_errors=1)
            return [False] * len(keys)

    def _checked_read(self, pool: str, keys: list[bytes]) -> list[np.ndarray | None]:
        """``_read``, with pages of the wrong size or dtype dropped (counted as corrupt)."""
        out = list(self._read(pool, keys))
        if len(out) != len(keys):
            raise RuntimeError(f"backend returned {len(out)} pages for {len(keys)} keys")
        pb = self.codecs[pool].page_bytes
        for i, page in enumerate(out):
            if page is not None and (page.dtype != np.uint8 or page.size != pb):
                # Wrong size can only mean a mismatched geometry sharing a namespace: refuse.
                self.metrics.add(corrupt=1)
                out[i] = None
        return out

    def _read_failed(self, pool: str, n: int, e: Exception) -> None:
        log.warning("L3 %s: read(%s, %d keys) failed: %r", self.backend_name, pool, n, e)
        self.metrics.add(read_errors=1)

    def _count_read(self, pool: str, n: int, good: int, t0: float, verified: int) -> None:
        self.metrics.add_read(good, n - good, good * self.codecs[pool].page_bytes, time.perf_counter() - t0, verified)

    def _safe_read(self, pool: str, keys: list[bytes]) -> list[np.ndarray | None]:
        """Page bytes per key (None: a miss), counted; never raises."""
        if not keys:
            return []
        t0 = time.perf_counter()
        try:
            out = self._checked_read(pool, keys)
        except Exception as e:
            self._read_failed(pool, len(keys), e)
            out = [None] * len(keys)
        self._count_read(pool, len(keys), sum(p is not None for p in out), t0, 0)
        return out

    def _safe_read_into_host(self, pool: str, keys: list[bytes], ids: Sequence[int]) -> list[bool]:
        """Per page, whether it was loaded into its host page, counted; never raises."""
        if not keys:
            return []
        t0 = time.perf_counter()
        loaded = [False] * len(keys)
        verified = 0
        try:
            verified = self._read_into_host(pool, keys, ids, loaded)
        except Exception as e:  # pages loaded before the fault keep their flag
            self._read_failed(pool, len(keys), e)
        self._count_read(pool, len(keys), sum(loaded), t0, verified)
        return loaded

    def _safe_write_from_host(self, pool: str, keys: list[bytes], ids: np.ndarray) -> list[bool]:
        try:
            ok = [bool(x) for x in self._write_from_host(pool, keys, ids)]
            if len(ok) != len(keys):
                raise RuntimeError(f"backend returned {len(ok)} flags for {len(keys)} keys")
            return ok
        except Exception as e:  # never lose the caller's (backup) thread
            log.warning("L3 %s: write(%s, %d pages) failed: %r", self.backend_name, pool, len(keys), e)
            self.metrics.add(write_errors=1, pages_dropped=len(keys))
            return [False] * len(keys)

    # ---- single-pool API ---------------------------------------------------------------------
    def batch_exists(self, keys: Sequence[bytes], pool: str | None = None) -> int:
        """Number of consecutive stored pages from the start (a missing first page gives 0)."""
        pool = self._pool(pool)
        return consecutive(self._safe_contains(pool, self._keys(keys)))

    def exists_each(self, keys: Sequence[bytes], pool: str | None = None) -> list[bool] | None:
        """Per key, whether it is stored (not only the leading run ``batch_exists`` counts);
        None when the store could not answer (a fault, counted and logged): an unknown is not
        an absence."""
        pool = self._pool(pool)
        keys = self._keys(keys)
        if not keys:
            return []
        try:
            got = self._contains_answered(pool, keys)
            if got is None:
                return None
            out = [bool(x) for x in got]
        except Exception as e:
            log.warning("L3 %s: exists(%s, %d keys) failed: %r", self.backend_name, pool, len(keys), e)
            self.metrics.add(read_errors=1)
            return None
        return out if len(out) == len(keys) else None

    def batch_get(self, keys: Sequence[bytes], host_page_ids: object, pool: str | None = None) -> list[bool]:
        """Read pages into host pages; per page, whether it was loaded. Callers use
        ``consecutive(result)`` as the hit count. A page flagged False holds no stored bytes:
        if its key is not stored its host page is left untouched; if a read into it failed
        (a storage fault) a backend that reads in place may have overwritten it and
        zero-fills it, so it never keeps bytes that failed a check. Backends that read through
        ``_read`` read every page before writing any host page, so they leave them all untouched."""
        pool = self._pool(pool)
        keys = self._keys(keys)
        ids = self._read_ids(pool, host_page_ids, len(keys))
        return self._safe_read_into_host(pool, keys, ids)

    def batch_set(self, keys: Sequence[bytes], host_page_ids: object, pool: str | None = None) -> list[bool]:
        """Store host pages under ``keys``; per page, whether it is stored (or accepted for an
        asynchronous write). Keys already stored or in flight are skipped and reported True."""
        pool = self._pool(pool)
        keys = self._keys(keys)
        ids = self._ids(pool, host_page_ids, len(keys))
        self._check_used_ids(pool, ids, unique=False)
        plan = _SetPlan(keys, self._safe_contains(pool, keys))
        self.metrics.add(sets_skipped=len(keys) - len(plan.todo))
        if plan.todo:
            ok = self._safe_write_from_host(pool, [keys[i] for i in plan.todo], ids[plan.todo])
            for i, o in zip(plan.todo, ok):
                plan.result[i] = o
        return plan.finish(keys)

    def _publish(self, pool: str, ids: np.ndarray, pages: list, which) -> None:
        codec = self.codecs[pool]
        for i in which:
            if pages[i] is not None:
                codec.unpack_one(int(ids[i]), pages[i])

    # ---- multi-pool API ----------------------------------------------------------------------
    def _transfers(self, transfers: Sequence[PoolTransfer], need_ids: bool):
        if not transfers:
            raise ValueError("transfers: expected at least one PoolTransfer")
        by_pool: dict[str, PoolTransfer] = {}
        for t in transfers:
            if not isinstance(t, PoolTransfer):
                raise TypeError(f"transfers: expected PoolTransfer items, got {type(t).__name__}")
            name = self._pool(t.pool)
            if name in by_pool:
                raise ValueError(f"transfers: pool {name!r} given twice")
            by_pool[name] = t
        if not any(self.specs[p].policy is PoolHitPolicy.ALL_PAGES for p in by_pool):
            raise ValueError("transfers: need at least one ALL_PAGES pool")
        keys = {p: self._keys(t.keys) for p, t in by_pool.items()}
        n = {len(k) for k in keys.values()}
        if len(n) != 1:
            raise ValueError(
                f"transfers: every pool needs one key per page; got lengths { {p: len(k) for p, k in keys.items()} }"
            )
        ids = {p: self._ids(p, t.host_page_ids, len(keys[p])) for p, t in by_pool.items()} if need_ids else {}
        return keys, ids, n.pop()

    def _window(self, pool: str, hit: int) -> range:
        spec = self.specs[pool]
        return range(max(0, hit - spec.window_pages), hit)

    def _best_hit(self, hit: int, trailing: dict[str, dict[int, bool]]) -> int:
        """Largest h <= hit whose trailing windows are all present (h = 0 always qualifies)."""
        h = hit
        while h > 0:
            bad = [i for p, flags in trailing.items() for i in self._window(p, h) if not flags.get(i, False)]
            if not bad:
                return h
            h = max(bad)  # every window ending above a missing page contains it
        return 0

    def exists_multi(self, transfers: Sequence[PoolTransfer]) -> HitResult:
        """Pages usable for every pool under its hit policy (no data moved)."""
        keys, _, _ = self._transfers(transfers, need_ids=False)
        return self._stored_hit(keys)

    def _stored_hit(self, keys: dict[str, list[bytes]]) -> HitResult:
        all_pools = [p for p in keys if self.specs[p].policy is PoolHitPolicy.ALL_PAGES]
        pool_hits = {p: consecutive(self._safe_contains(p, keys[p])) for p in all_pools}
        hit = min(pool_hits.values())
        trailing = {}
        for p in keys:
            if p not in pool_hits:
                flags = self._safe_contains(p, keys[p][:hit])
                trailing[p] = dict(enumerate(flags))
        hit = self._best_hit(hit, trailing)
        for p in trailing:
            pool_hits[p] = sum(trailing[p].get(i, False) for i in self._window(p, hit))
        return HitResult(hit, pool_hits)

    def get_multi(self, transfers: Sequence[PoolTransfer]) -> HitResult:
        """Read every pool's pages for the largest prefix all pools can serve into host pages;
        nothing beyond the returned hit is reported (see the module docstring for which host
        pages beyond it a backend that reads in place may have written)."""
        keys, ids, n = self._transfers(transfers, need_ids=True)
        all_pools = [p for p in keys if self.specs[p].policy is PoolHitPolicy.ALL_PAGES]
        for p in all_pools:
            self._check_used_ids(p, ids[p], unique=True)
        hit = self._stored_hit(keys).hit_pages  # index only; avoids reading pages we cannot use
        # non-target pools first (draft before target, as upstream)
        all_pools.sort(key=lambda p: p == self.primary)
        if len(all_pools) == len(keys) and self._reads_in_place():
            for p in all_pools:  # straight into host pages: no page array, no second copy
                if not hit:
                    break
                hit = min(hit, consecutive(self._safe_read_into_host(p, keys[p][:hit], ids[p][:hit])))
            return HitResult(hit, {p: hit for p in keys})
        pages: dict[str, dict[int, np.ndarray | None]] = {}
        for p in all_pools:  # nothing is published until every pool is read
            got = self._safe_read(p, keys[p][:hit])
            pages[p] = dict(enumerate(got))
            hit = min(hit, consecutive([g is not None for g in got]))
        trailing_pools = [p for p in keys if p not in all_pools]
        for p in trailing_pools:
            pages[p] = {}
        while True:
            for p in trailing_pools:
                need = [i for i in self._window(p, hit) if i not in pages[p]]
                got = self._safe_read(p, [keys[p][i] for i in need])
                pages[p].update(zip(need, got))
            flags = {p: {i: g is not None for i, g in pages[p].items()} for p in trailing_pools}
            new_hit = self._best_hit(hit, flags)
            if new_hit == hit:
                break
            hit = new_hit
        pool_hits = {}
        for p in keys:
            rng = range(hit) if p in all_pools else self._window(p, hit)
            sel = [i for i in rng if pages[p].get(i) is not None]
            self._check_used_ids(p, ids[p][sel], unique=True)
            self._publish(p, ids[p], [pages[p].get(i) for i in range(n)], sel)
            pool_hits[p] = len(sel)
        return HitResult(hit, pool_hits)

    def set_multi(self, transfers: Sequence[PoolTransfer]) -> dict[str, list[bool]]:
        """``batch_set`` per pool. Keys may differ in length per pool here: a TRAILING_PAGES pool
        is given only the window pages it should store."""
        out = {}
        for t in transfers:
            if not isinstance(t, PoolTransfer):
                raise TypeError(f"transfers: expected PoolTransfer items, got {type(t).__name__}")
            out[self._pool(t.pool)] = self.batch_set(t.keys, t.host_page_ids, t.pool)
        return out
