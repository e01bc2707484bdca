"""Plain ``file`` L3 backend: one file per page.

Layout: ``{path}/pages-v1/{pool}/{hex[:2]}/{hex}.kv``; corrupt files move to
``{path}/pages-v1/quarantine/``. A file is a 64-byte header then the page bytes::

    magic b"HCJXKV01" | algo u8 | 0 u8 | 0 u16 | crc u32 | page_bytes u64 | key 32 bytes | 8 zero bytes

Writes go to a unique temp file in the same directory, are fsync'ed, then ``os.replace``d
into place: a reader sees the whole page or no page, a process killed mid-write leaves only a
temp file (ignored, and removed by the next ``FileStorage`` on that directory if older than a
minute), and two processes writing the same key replace equal bytes with equal bytes.

Existence is checked on the file system (not an in-process index), so pages written by other
processes are visible at once. Only a file inconsistent with itself (bad magic, key or CRC,
a body that disagrees with its header) is quarantined; a sound page of another size (written
by a store configured with another page size) is a miss counted as a read error, and stays:
``batch_exists`` still reports it (existence reads no headers), ``batch_get`` misses it. Capacity: each process tracks the files it knows (scanned at
start-up, oldest mtime first, plus its own writes, a rewrite counting as the newest) and deletes
the oldest over the bound. A file this process counts may be gone (another process evicted it)
and its key written again here; so that the eviction of such a stale entry never deletes the
new file, a write publishes its file (the rename) and counts it in one step under the capacity
lock, and an eviction chooses its victims and unlinks them under that lock too: a rewrite lands
either before the choice (and is counted as the newest, so it is not chosen) or after the
unlink. Another process's eviction can still delete a file this process just wrote (nothing is
locked across processes): a counted miss later, never wrong KV.

Straight into / out of host pages: a read is one ``preadv`` of the header and the page's runs
in the host pool (``host_pages.PageRuns``: one per component in the page-first layouts, one per
component and layer in ``layer_first``), with the CRC-32C then taken over the page where it
landed; a write is one ``pwritev`` of the header and those runs. No packed copy of the page
is made either way. A read that fails after it began (bad header, short body, CRC mismatch, an
I/O error) zero-fills its host page and is a miss; a key that is not stored leaves its host
page untouched.

Contents listeners (``HiCacheStorage.add_listener``): ``stored`` for the pages this process
wrote, once each file is in place (from the thread that wrote it); ``removed`` for the files this
process evicts for capacity (before it unlinks them) or quarantines; each called under the
capacity lock, so a key's events come in the order its file changed. Files another
process evicts, and a file that vanished under a read, are not reported: this process does not
see them go (``KVEventSource.observe_storage``'s ``probe_pages`` can find them).

Threading: the pages of one call are read (or written: CRC, write, fsync, rename) up to
``read_concurrency`` at once on the store's read (or write) thread pool, at the workers' nice
level; the CRC releases the GIL (``integrity``), so those threads really run in parallel. A
call returns only when all of its pages are done. Calls may run concurrently; the capacity
bookkeeping is under one lock, which is also held for a write's rename and an eviction's unlinks
(metadata operations, no data I/O; the data write and fsync run outside it).
"""

from __future__ import annotations

import logging
import os
import struct
import threading
import time
import uuid
from collections import OrderedDict
from concurrent.futures import wait
from typing import Mapping, Sequence

import numpy as np

from ..host_pool import HostKVPool
from ..workers import background_executor
from . import integrity
from .base import HiCacheStorage, PoolSpec
from .config import StorageConfig, prepare_store_dir
from .vectored_io import preadv_upto, pwritev_full

log = logging.getLogger("hicache_jax.storage")

MAGIC = b"HCJXKV01"
_HEADER = struct.Struct("<8sBBHIQ32s8x")
HEADER_BYTES = _HEADER.size
assert HEADER_BYTES == 64
_STALE_TMP_S = 60.0


def _pool_and_key(path: str) -> tuple[str, list[bytes]]:
    """``(pool, [key])`` of a page file ``{root}/{pool}/{xx}/{hex}.kv``."""
    head, name = os.path.split(path)
    return os.path.basename(os.path.dirname(head)), [bytes.fromhex(name[: -len(".kv")])]


class _Corrupt(Exception):
    """The file is inconsistent with itself: quarantined."""


class _Mismatch(Exception):
    """A sound file this store cannot use (written with another page size): a miss, left in place."""


class FileStorage(HiCacheStorage):
    backend_name = "file"

    def __init__(
        self, config: StorageConfig, pools: Mapping[str, HostKVPool], specs: Sequence[PoolSpec] | None = None
    ) -> None:
        super().__init__(config, pools, specs)
        self.root = os.path.join(os.path.abspath(config.path), "pages-v1")
        self._qdir = os.path.join(self.root, "quarantine")
        self._lock = threading.Lock()
        self._known: OrderedDict[str, int] = OrderedDict()  # path -> file bytes, oldest first
        self._known_bytes = 0
        self._executors: dict = {}  # "read" / "write" thread pools, started on first use
        # Raises StorageSetupError naming `path` for a store that cannot be used; False: a
        # read-only store (strict=False) serving its pages, storing nothing.
        self._writable = prepare_store_dir(config, "pages-v1")
        if not self._writable:
            log.warning("L3 file: %s is not writable; serving its pages, storing nothing (strict=False)", self.root)
        try:
            if self._writable:
                for p in self.codecs:
                    os.makedirs(os.path.join(self.root, p), exist_ok=True)
            self._scan()
        except OSError as e:  # a store that vanished or breaks while scanning still serves what it can
            log.warning("L3 file: cannot prepare %s: %r", self.root, e)

    def _scan(self) -> None:
        found = []
        now = time.time()
        for p in self.codecs:
            base = os.path.join(self.root, p)
            if not os.path.isdir(base):  # a read-only store that never held this pool
                continue
            for sub in os.scandir(base):
                if not sub.is_dir():
                    continue
                for ent in os.scandir(sub.path):
                    try:
                        st = ent.stat()
                    except OSError:
                        continue
                    if ent.name.endswith(".kv"):
                        found.append((st.st_mtime, ent.path, st.st_size))
                    elif ent.name.endswith(".tmp") and now - st.st_mtime > _STALE_TMP_S:
                        try:  # left by a killed writer
                            os.unlink(ent.path)
                        except OSError:
                            pass
        found.sort()
        with self._lock:
            for _, path, size in found:
                self._known[path] = size
                self._known_bytes += size

    def _path(self, pool: str, key: bytes) -> str:
        h = key.hex()
        return os.path.join(self.root, pool, h[:2], h + ".kv")

    # ---- primitives --------------------------------------------------------------------------
    def _contains(self, pool: str, keys: list[bytes]) -> list[bool]:
        return [os.path.isfile(self._path(pool, k)) for k in keys]

    def _read_page(self, pool: str, key: bytes, views: list, runs: list, zero) -> bool:
        """Read the page of ``key`` into its destination (``views``: writable buffers taking the
        page's bytes in order, ``runs`` their ``(address, nbytes)``) with one ``preadv`` of
        header + page, and verify it there. On a failure after the read began the destination
        is zero-filled (``zero()``): it never keeps bytes that failed a check; a key that is not
        stored leaves it untouched. Never raises."""
        path = self._path(pool, key)
        pb = sum(n for _, n in runs)
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except FileNotFoundError:
            return False  # never written, or evicted / quarantined by another process
        except OSError as e:
            log.warning("L3 file: opening %s failed: %r", path, e)
            self.metrics.add(read_errors=1)
            return False
        try:
            head, extra = bytearray(HEADER_BYTES), bytearray(1)  # extra: an overlong file fills it
            got = preadv_upto(fd, [memoryview(head)] + views + [memoryview(extra)], 0, HEADER_BYTES + pb)
            if got < HEADER_BYTES:
                raise _Corrupt(f"short header ({got} bytes)")
            magic, algo, _, _, crc, nbytes, fkey = _HEADER.unpack(head)
            if magic != MAGIC or fkey != key:
                raise _Corrupt(f"bad header (magic={magic!r}, key match={fkey == key})")
            if nbytes != pb:  # another page size: corrupt only if the file disagrees with its header
                size = os.fstat(fd).st_size
                if size != HEADER_BYTES + nbytes:
                    raise _Corrupt(f"{size - HEADER_BYTES} body bytes, header says {nbytes}")
                raise _Mismatch(f"{nbytes}-byte page, this store reads {pb}-byte pages")
            if got != HEADER_BYTES + pb:
                raise _Corrupt(f"truncated or overlong body ({got - HEADER_BYTES} of {pb} bytes)")
            mode = self.config.integrity
            if mode == "full" or (mode == "sampled" and integrity.sample_hit(self.config.integrity_sample_rate)):
                ok = integrity.checksum_at(runs, algo, key) == crc  # in place, GIL released
                self.metrics.add(verified=1)
                if not ok:
                    raise _Corrupt("CRC mismatch")
            return True
        except _Corrupt as e:
            zero()
            self._quarantine(path, str(e))
        except _Mismatch as e:  # a reader configured otherwise than the writer: never delete
            zero()
            log.warning("L3 file: %s: %s; a miss (left in place)", path, e)
            self.metrics.add(read_errors=1)
        except integrity.ChecksumUnavailable as e:
            zero()
            log.warning("L3 file: cannot verify %s: %s", path, e)
            self.metrics.add(read_errors=1)
        except Exception as e:  # I/O errors; anything else is our bug, still only a miss
            zero()
            log.warning("L3 file: reading %s failed: %r", path, e)
            self.metrics.add(read_errors=1)
        finally:
            os.close(fd)
        return False

    def _quarantine(self, path: str, why: str) -> None:
        log.warning("L3 file: %s: %s; quarantined", path, why)
        self.metrics.add(corrupt=1)
        moved = False
        try:
            os.makedirs(self._qdir, exist_ok=True)
            os.replace(path, os.path.join(self._qdir, f"{os.path.basename(path)}.{uuid.uuid4().hex[:8]}.bad"))
            self.metrics.add(quarantined=1)
            moved = True
        except OSError as e:  # read-only store: it stays a miss for this read, checked again next time
            log.warning("L3 file: cannot quarantine %s: %r", path, e)
        with self._lock:
            size = self._known.pop(path, None)
            if size is not None:
                self._known_bytes -= size
            if moved and self._notify is not None:  # a file left in place still exists
                self._notify("removed", *_pool_and_key(path))

    def _pool_for(self, kind: str):
        """The read or write thread pool (``read_concurrency`` threads each), started on first use."""
        with self._lock:
            ex = self._executors.get(kind)
            if ex is None:
                ex = self._executors[kind] = background_executor(
                    f"l3-file-{kind}", self.config.worker_nice, self.config.read_concurrency
                )
            return ex

    def _each(self, kind: str, n: int, fn) -> list:
        """``[fn(i) for i in range(n)]``, up to ``read_concurrency`` at once on the ``kind`` pool
        (inline for one page). Returns only when every call has finished, so no worker still
        writes into a caller's host page after the call returned."""
        if n == 1 or self.config.read_concurrency == 1:
            return [fn(i) for i in range(n)]
        futs = []
        try:
            pool = self._pool_for(kind)
            for i in range(n):
                futs.append(pool.submit(fn, i))
        except RuntimeError:
            # Interpreter shutdown (an exit-time flush of a controller never closed): CPython
            # starts no new threads then, so the pages not handed to a worker are done inline.
            rest = [fn(i) for i in range(len(futs), n)]
        else:
            rest = []
        wait(futs)
        return [f.result() for f in futs] + rest  # fn never raises (a fault is its result)

    def _reads_in_place(self) -> bool:
        return True

    def _read_into_host(self, pool: str, keys: list[bytes], ids: Sequence[int], loaded: list[bool]) -> int:
        pr = self.codecs[pool].runs()

        def one(i: int) -> bool:
            h = int(ids[i])
            return self._read_page(pool, keys[i], pr.views(h), pr.runs(h), lambda: pr.zero(h))

        for i, ok in enumerate(self._each("read", len(keys), one)):
            loaded[i] = ok
        return 0  # _read_page counts the pages it verified

    def _read(self, pool: str, keys: list[bytes]) -> list[np.ndarray | None]:
        pages = np.empty((len(keys), self.codecs[pool].page_bytes), np.uint8)

        def one(i: int) -> bool:
            row = pages[i]
            return self._read_page(
                pool, keys[i], [memoryview(row)], [(row.ctypes.data, row.nbytes)], lambda: row.fill(0)
            )

        return [pages[i] if ok else None for i, ok in enumerate(self._each("read", len(keys), one))]

    def _write_page(self, pool: str, path: str, key: bytes, views: list, runs: list) -> bool:
        """Write header + page (``views`` / ``runs`` as for ``_read_page``, read only) with one
        ``pwritev`` into a temp file, fsync it, then publish it by rename and count it as the
        newest file (``_put_in_place``). Never raises."""
        algo = integrity.DEFAULT_ALGO
        tmp = f"{path}.{os.getpid()}.{uuid.uuid4().hex[:12]}.tmp"
        fd = -1
        try:
            nbytes = sum(n for _, n in runs)
            head = _HEADER.pack(MAGIC, algo, 0, 0, integrity.checksum_at(runs, algo, key), nbytes, key)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
            pwritev_full(fd, [head] + views, 0)
            os.fsync(fd)
            os.close(fd)
            fd = -1
            self._put_in_place(tmp, path, pool, key, HEADER_BYTES + nbytes)
            return True
        except Exception as e:  # OSError (disk full, read-only, ...) or ChecksumUnavailable
            log.warning("L3 file: writing %s failed: %r", path, e)
            self.metrics.add(write_errors=1, pages_dropped=1)
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass
            try:
                os.unlink(tmp)
            except OSError:
                pass
            return False

    def _put_in_place(self, tmp: str, path: str, pool: str, key: bytes, size: int) -> None:
        """Rename ``tmp`` into place (atomic) and count ``path`` as the newest file, in one step
        under the capacity lock: an eviction (which unlinks under the same lock) sees either
        the old entry with the old file or the new entry with the new file (module docstring).
        A path already counted (a stale entry: its file was deleted by another process, or an
        equal page replaced) moves to the end."""
        with self._lock:
            os.replace(tmp, path)
            old = self._known.pop(path, None)
            if old is not None:
                self._known_bytes -= old
            self._known[path] = size
            self._known_bytes += size
            if self._notify is not None:
                self._notify("stored", pool, [key])

    def _write_pages(self, pool: str, keys: list[bytes], dst) -> list[bool]:
        """Write page i from ``dst(i)`` (its views and runs), several files in flight."""
        if not self._writable:  # a read-only store: counted, warned about once at construction
            self.metrics.add(write_errors=1, pages_dropped=len(keys))
            return [False] * len(keys)
        t0 = time.perf_counter()
        pb = self.codecs[pool].page_bytes
        paths = [self._path(pool, k) for k in keys]
        ok = self._each("write", len(keys), lambda i: self._write_page(pool, paths[i], keys[i], *dst(i)))
        written = sum(ok)
        self.metrics.add(pages_written=written, bytes_written=written * pb, write_seconds=time.perf_counter() - t0)
        self._evict()
        return ok

    def _write_from_host(self, pool: str, keys: list[bytes], ids: np.ndarray) -> list[bool]:
        pr = self.codecs[pool].runs()  # straight from the host pages: no packed copy
        return self._write_pages(pool, keys, lambda i: (pr.views(int(ids[i])), pr.runs(int(ids[i]))))

    def _write(self, pool: str, keys: list[bytes], pages: np.ndarray) -> list[bool]:
        pages = np.ascontiguousarray(pages)
        return self._write_pages(
            pool, keys, lambda i: ([memoryview(pages[i])], [(pages[i].ctypes.data, pages.shape[1])])
        )

    def _evict(self) -> None:
        cap = self.config.capacity_bytes
        if not cap:
            return
        victims = []
        # Choice and unlinks under the lock a write publishes under: a rewrite of a victim's key
        # cannot land between them and be deleted (module docstring).
        with self._lock:
            while self._known_bytes > cap and self._known:
                path, size = self._known.popitem(last=False)
                self._known_bytes -= size
                victims.append(path)
            if victims and self._notify is not None:  # before the unlinks: see the module docstring
                gone = [_pool_and_key(v) for v in victims]
                for pool in dict.fromkeys(p for p, _ in gone):
                    self._notify("removed", pool, [k[0] for p, k in gone if p == pool])
            for path in victims:
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    pass
                except OSError as e:
                    log.warning("L3 file: evicting %s failed: %r", path, e)
        self.metrics.add(pages_evicted=len(victims))

    def _close(self) -> None:
        with self._lock:
            exs, self._executors = list(self._executors.values()), {}
        for ex in exs:
            ex.shutdown(wait=True)
