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
start-up, oldest mtime first, plus its own writes) and deletes the oldest over the bound.

Threading: reads of different keys run concurrently (a thread pool of ``read_concurrency``);
the capacity bookkeeping is under one lock.
"""

from __future__ import annotations

import errno
import logging
import os
import struct
import threading
import time
import uuid
from collections import OrderedDict
from typing import Mapping, Sequence

import numpy as np

from ..host_pool import HostKVPool
from ..workers import background_executor
from . import integrity
from .base import HiCacheStorage, PoolSpec
from .config import StorageConfig

log = logging.getLogger("hicache_jax.storage")

MAGIC = b"HCJXKV01"
_HEADER = struct.Struct("<8sBBHIQ32s8x")
HEADER_BYTES = _HEADER.size
assert HEADER_BYTES == 64
_STALE_TMP_S = 60.0


class _Corrupt(Exception):
    """The file is inconsistent with itself: quarantined."""


class _Mismatch(Exception):
    """A sound file this store cannot use (written with another page size): a miss, left in place."""


class FileStorage(HiCacheStorage):
    backend_name = "file"

    def __init__(self, config: StorageConfig, pools: Mapping[str, HostKVPool],
                 specs: Sequence[PoolSpec] | None = None) -> None:
        super().__init__(config, pools, specs)
        self.root = os.path.join(os.path.abspath(config.path), "pages-v1")
        self._qdir = os.path.join(self.root, "quarantine")
        self._lock = threading.Lock()
        self._known: OrderedDict[str, int] = OrderedDict()  # path -> file bytes, oldest first
        self._known_bytes = 0
        self._executor = None  # read pool, started on first use
        try:
            for p in self.codecs:
                os.makedirs(os.path.join(self.root, p), exist_ok=True)
            self._scan()
        except OSError as e:  # a read-only or missing store still serves what it can
            log.warning("L3 file: cannot prepare %s: %r", self.root, e)

    def _scan(self) -> None:
        found = []
        now = time.time()
        for p in self.codecs:
            base = os.path.join(self.root, p)
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

    def _read_one(self, pool: str, key: bytes) -> np.ndarray | None:
        path = self._path(pool, key)
        pb = self.codecs[pool].page_bytes
        try:
            with open(path, "rb", buffering=0) as f:
                head = f.read(HEADER_BYTES)
                if len(head) != HEADER_BYTES:
                    raise _Corrupt(f"short header ({len(head)} bytes)")
                magic, algo, _, _, crc, nbytes, fkey = _HEADER.unpack(head)
                if magic != MAGIC or fkey != key:
                    raise _Corrupt(f"bad header (magic={magic!r}, key match={fkey == key})")
                if nbytes != pb:  # another page size: corrupt only if the file disagrees with its header
                    size = os.fstat(f.fileno()).st_size
                    if size != HEADER_BYTES + nbytes:
                        raise _Corrupt(f"{size - HEADER_BYTES} body bytes, header says {nbytes}")
                    raise _Mismatch(f"{nbytes}-byte page, this store reads {pb}-byte pages")
                page = np.empty(pb, np.uint8)
                got = f.readinto(memoryview(page))
                if got != pb or f.read(1):
                    raise _Corrupt(f"truncated or overlong body ({got} of {pb} bytes)")
        except FileNotFoundError:
            return None  # never written, or evicted / quarantined by another process
        except _Corrupt as e:
            self._quarantine(path, str(e))
            return None
        except _Mismatch as e:  # a reader configured otherwise than the writer: never delete
            log.warning("L3 file: %s: %s; a miss (left in place)", path, e)
            self.metrics.add(read_errors=1)
            return None
        except OSError as e:
            log.warning("L3 file: reading %s failed: %r", path, e)
            self.metrics.add(read_errors=1)
            return None
        mode = self.config.integrity
        if mode == "full" or (mode == "sampled" and integrity.sample_hit(self.config.integrity_sample_rate)):
            try:
                ok = integrity.checksum(page, algo, key) == crc
            except integrity.ChecksumUnavailable as e:
                log.warning("L3 file: cannot verify %s: %s", path, e)
                self.metrics.add(read_errors=1)
                return None
            self.metrics.add(verified=1)
            if not ok:
                self._quarantine(path, "CRC mismatch")
                return None
        return page

    def _quarantine(self, path: str, why: str) -> None:
        log.warning("L3 file: %s: %s; quarantined", path, why)
        self.metrics.add(corrupt=1)
        try:
            os.makedirs(self._qdir, exist_ok=True)
            os.replace(path, os.path.join(self._qdir, f"{os.path.basename(path)}.{uuid.uuid4().hex[:8]}.bad"))
            self.metrics.add(quarantined=1)
        except OSError as e:  # read-only store: it stays a miss for this read, checked again next time
            log.warning("L3 file: cannot quarantine %s: %r", path, e)
        with self._lock:
            size = self._known.pop(path, None)
            if size is not None:
                self._known_bytes -= size

    def _read(self, pool: str, keys: list[bytes]) -> list[np.ndarray | None]:
        if len(keys) == 1 or self.config.read_concurrency == 1:
            return [self._read_one(pool, k) for k in keys]
        with self._lock:
            if self._executor is None:
                self._executor = background_executor("l3-file-read", self.config.worker_nice,
                                                     self.config.read_concurrency)
            ex = self._executor
        return list(ex.map(lambda k: self._read_one(pool, k), keys))

    def _write_one(self, path: str, key: bytes, page: np.ndarray) -> bool:
        algo = integrity.DEFAULT_ALGO
        head = _HEADER.pack(MAGIC, algo, 0, 0, integrity.checksum(page, algo, key), page.nbytes, key)
        tmp = f"{path}.{os.getpid()}.{uuid.uuid4().hex[:12]}.tmp"
        fd = -1
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            for chunk in (memoryview(head), memoryview(page).cast("B")):
                while chunk:
                    n = os.write(fd, chunk)
                    if n <= 0:
                        raise OSError(errno.EIO, "short write")
                    chunk = chunk[n:]
            os.fsync(fd)
            os.close(fd)
            fd = -1
            os.replace(tmp, path)  # atomic publish
            return True
        except OSError as e:
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

    def _write(self, pool: str, keys: list[bytes], pages: np.ndarray) -> list[bool]:
        t0 = time.perf_counter()
        ok = []
        written = 0
        for k, page in zip(keys, pages):
            path = self._path(pool, k)
            good = self._write_one(path, k, page)
            ok.append(good)
            if good:
                written += 1
                with self._lock:
                    if path not in self._known:
                        self._known[path] = HEADER_BYTES + page.nbytes
                        self._known_bytes += HEADER_BYTES + page.nbytes
        self.metrics.add(pages_written=written, bytes_written=written * pages.shape[1],
                         write_seconds=time.perf_counter() - t0)
        self._evict()
        return ok

    def _evict(self) -> None:
        cap = self.config.capacity_bytes
        if not cap:
            return
        victims = []
        with self._lock:
            while self._known_bytes > cap and self._known:
                path, size = self._known.popitem(last=False)
                self._known_bytes -= size
                victims.append(path)
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
            ex, self._executor = self._executor, None
        if ex is not None:
            ex.shutdown(wait=True)
