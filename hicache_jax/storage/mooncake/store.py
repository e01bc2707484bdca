"""``mooncake`` L3 backend: pages in a Mooncake Store (``mooncake-transfer-engine-non-cuda``).

Every engine whose client talks to the same master shares the pages: a page one process
stores, another reads. A page lives in the memory one Mooncake client lends the store (its
global segment) and goes away with that client, or when Mooncake evicts it for room once its
lease ran out. So the deployment that survives engine restarts is a long-lived store node
lending the memory (``MooncakeMaster`` starts one: the wheel's ``mooncake_client``) with
engines lending none (``mooncake_global_segment_bytes=0``): every put then lands in the node.
An engine that lends memory itself (the default, 1 GiB) may get its own pages placed there,
lost when it exits.

Objects: one per page, named ``hcjx1/{pool}/{key hex}`` (the key already carries the
namespace digest: model, dtype, layout, page size, TP, pool, salt). The value is a 64-byte
header and then the page bytes (``PageCodec`` order)::

    magic b"HCJXMC01" | algo u8 | 0 u8 | 0 u16 | crc u32 | page_bytes u64 | key 32 bytes | 8 zero bytes

``crc`` is the CRC (``integrity``'s algorithm ``algo``) of ``key || page bytes``. A read is a
hit only if the value is exactly ``64 + page_bytes`` long (Mooncake refuses a read into a
buffer of another size), the header matches (magic, size, key) and, per ``config.integrity``,
the CRC matches; anything else is a miss (counted ``corrupt``), the page is zero-filled and the
object is removed so that the next write of that key stores it afresh (Mooncake keeps the first
value put under a key; an overwritten or damaged one would otherwise shadow it). The client
answers both "value shorter than the buffers" and "segment unreachable" (its owner died) with
``TRANSFER_FAIL``; the object's size tells them apart: a short value is ``corrupt``, an
unreachable one a read error (a miss; the object is left alone). Until the master notices a
dead segment's owner (its ``client_ttl``), its objects still exist: writes of those keys are
skipped as stored and reads of them miss.

Zero copy: each pool's host array is registered with the client once; writes are
``batch_put_from_multi_buffers`` straight from the host pages (one pointer per contiguous run
of the page: one per component in the page-first layouts, one per component and layer in
``layer_first``) after the header; reads are ``batch_get_into_multi_buffers`` straight into the
host pages, verified there. The headers go through a small per-call buffer.

Pipelined: a call's pages move in sequential pieces of about ``PIPELINE_CHUNK_BYTES`` (one
batch call each, one in flight at a time, on a store worker); the CRCs of the piece before
(reads: checks) or after (writes: headers) run meanwhile on ``read_concurrency`` CRC threads,
the CRC-32C without the GIL (``integrity``). Concurrent batch calls are slower than one
(4-16 of them ran at ~0.6x one call, 64 x 2 MiB pages to a store node), and small pieces pay a
batch call's fixed cost (master RPCs) each: measured on the project VM (2 vCPUs, quiet,
2026-12-07, 256 x 2 MiB pages, median of 6 paired rounds), writes took 135 ms in one call after
every CRC, 142 / 134 / 123 ms in pieces of 32 / 64 / 128 MiB with the client's own segment
(456 / 486 / 457 / 459 ms to a store node, where the loopback transfer keeps both cores busy
and nothing overlaps for free); reads 135 / 142 / 125 ms in one call / pieces of 32 / 128 MiB
(436 / 482 / 449 ms from a store node). A piece that cannot start because the store went down
meanwhile is a miss (reads: its host pages left untouched) or a dropped write for its pages.
No call returns, nor raises, with a piece still in flight (its transfer reads or writes the
caller's host pages), except one abandoned at the op timeout (below).

Timeouts and faults: every store call runs on a worker thread and the caller waits at most
``mooncake_op_timeout_s`` (the client's own RPC timeout, ``MC_RPC_TIMEOUT_MS``, is set to the
same bound when it is not already set in the environment). A call that fails with an RPC
error (master gone or hung), or that overruns the bound, is a miss / failed set, and for
``mooncake_retry_interval_s`` afterwards every call misses without touching the store; then
the client's health check decides whether it is tried again (the client reconnects to a
restarted master by itself; a restarted master has lost the pages: misses). Residual risk,
stated plainly: a read that overruns the bound is abandoned while the client may still be
running it; if the client's own timeouts failed and the transfer completed later, it would
write those keys' (verified-at-write) bytes into host pages the caller may have reused. The
client's RPC timeout is set below the bound so that this needs a client bug.

Construction checks the addresses (``StorageConfig``), then that the master's RPC port and
the metadata URL answer within ``mooncake_connect_timeout_s``, then ``setup`` (bounded by the
same timeout): a clear ``ConnectionError`` naming the setting that is wrong, before any page
is touched.

Contents listeners (``HiCacheStorage.add_listener``): ``stored`` for the pages a put stored, once
the put returned; ``removed`` for objects this store removed after a failed check. The client
cannot report Mooncake's own evictions (lease expiry, room for other puts) nor objects that went
with a client that left: those go unreported (``KVEventSource.observe_storage``'s ``probe_pages``
finds them by asking the master). There is no store-wide lock here: a put and a removal of the
same key racing on two threads may be reported in either order (a stale page costs a counted
miss at prefetch, never wrong KV).

Threading: public calls may run concurrently (the client is thread-safe); the worker pool
has ``read_concurrency`` threads for store calls and as many for CRCs, and a call returns
only when all of its CRC ranges are done; registration bookkeeping is under one lock. Metrics are
counted from the workers (``StorageMetrics`` has its own lock).
"""

from __future__ import annotations

import concurrent.futures as cf
import http.client
import logging
import os
import socket
import struct
import threading
import time
from typing import Mapping, Sequence
from urllib.parse import urlsplit

import numpy as np

from ...host_pool import HostKVPool
from ...workers import background_executor
from .. import integrity
from ..base import HiCacheStorage, PoolSpec
from ..config import StorageConfig, split_host_port
from ..host_pages import PageRuns
from .server import quiet_client_logs

log = logging.getLogger("hicache_jax.storage")

MAGIC = b"HCJXMC01"
_HEADER = struct.Struct("<8sBBHIQ32s8x")
HEADER_BYTES = _HEADER.size
assert HEADER_BYTES == 64
KEY_PREFIX = "hcjx1"

# Mooncake error codes (mooncake-store types.h) the backend tells apart.
OBJECT_NOT_FOUND = -704
INVALID_PARAMS = -600  # a read: the value does not fit the buffers (too long)
TRANSFER_FAIL = -800  # a read: the value is shorter than the buffers, or its owner is unreachable
_RPC_FAIL_MAX = -900  # -900 RPC_FAIL, -901 RPC_TIMEOUT, ...: the master is unreachable
# Page ranges per CRC thread in one call (see ``_in_parallel``).
RANGES_PER_THREAD = 2
# A call's pages move in pieces of about this many bytes, one batch call each, so that the
# CRCs of one piece run while another moves (see "Pipelined" in the module doc).
PIPELINE_CHUNK_BYTES = 128 << 20


class _StoreDown(Exception):
    """The store is in its retry interval after a fault: the call misses without trying."""


def object_name(pool: str, key: bytes) -> str:
    return f"{KEY_PREFIX}/{pool}/{key.hex()}"


def _probe_tcp(name: str, host: str, port: int, timeout: float) -> None:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            pass
    except OSError as e:
        raise ConnectionError(
            f"{name}: no Mooncake master reachable at {host}:{port} ({e.strerror or e!r}); "
            "start one (hicache-jax mooncake-server) or fix the address"
        ) from e


def _probe_http(name: str, url: str, timeout: float) -> None:
    u = urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port or 80, timeout=timeout)
    try:
        conn.request("GET", f"{u.path}?key=hicache_jax_probe")
        conn.getresponse().read()  # any HTTP answer (404 for an unknown key) means it serves
    except (OSError, http.client.HTTPException) as e:
        raise ConnectionError(f"{name}: no HTTP metadata server answering at {url} ({e!r})") from e
    finally:
        conn.close()


class MooncakeStorage(HiCacheStorage):
    backend_name = "mooncake"

    def __init__(
        self, config: StorageConfig, pools: Mapping[str, HostKVPool], specs: Sequence[PoolSpec] | None = None
    ) -> None:
        super().__init__(config, pools, specs)
        if config.backend != "mooncake":
            raise ValueError(f"config.backend: expected 'mooncake', got {config.backend!r}")
        quiet_client_logs()  # glog reads its level when the client library loads
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as e:
            raise ImportError(
                "the 'mooncake' L3 backend needs the Mooncake Store client "
                "(pip install 'hicache-jax[mooncake]', i.e. mooncake-transfer-engine-non-cuda; "
                "Debian: apt-get install libibverbs1 librdmacm1 libnuma1)"
            ) from e
        self._timeout = float(config.mooncake_op_timeout_s)
        self._retry = float(config.mooncake_retry_interval_s)
        ct = float(config.mooncake_connect_timeout_s)
        host, port = split_host_port("mooncake_master", config.mooncake_master)
        _probe_tcp("mooncake_master", host, port, ct)
        _probe_http("mooncake_metadata", config.mooncake_metadata, ct)
        # The client reads its RPC timeouts from the environment when it is set up.
        os.environ.setdefault("MC_RPC_TIMEOUT_MS", str(max(100, int(self._timeout * 1000 * 0.8))))
        os.environ.setdefault("MC_RPC_CONNECT_TIMEOUT_MS", str(max(100, int(min(ct, self._timeout) * 1000))))
        self._lock = threading.Lock()
        # Client calls running on workers, and whether close began: the native client must not
        # be closed under a call still inside it (one that outlived its op timeout), or the
        # process crashes (seen: a segfault closing after the master was killed mid-put).
        self._calls = threading.Condition()
        self._running = 0
        self._closing = False
        self._down_until = 0.0
        self._registered: dict[int, int] = {}  # address -> bytes registered with the client
        self._executor = background_executor("l3-mooncake", config.worker_nice, config.read_concurrency)
        # CRCs of a call's pages, in parallel (apart from the store calls' workers: a store call
        # hung past its timeout never holds up a CRC)
        self._crc_executor = background_executor("l3-mooncake-crc", config.worker_nice, config.read_concurrency)
        store = MooncakeDistributedStore()
        fut = self._executor.submit(
            store.setup,
            config.mooncake_local_hostname,
            config.mooncake_metadata,
            config.mooncake_global_segment_bytes,
            config.mooncake_local_buffer_bytes,
            config.mooncake_protocol,
            config.mooncake_device,
            config.mooncake_master,
        )
        try:
            rc = fut.result(timeout=ct)
        except cf.TimeoutError:
            self._executor.shutdown(wait=False)
            raise ConnectionError(
                f"mooncake_master: client setup against {config.mooncake_master} "
                f"(metadata {config.mooncake_metadata}) did not finish within "
                f"mooncake_connect_timeout_s={ct}"
            ) from None
        except Exception:
            self._executor.shutdown(wait=False)
            raise
        if rc != 0:
            self._executor.shutdown(wait=False)
            raise ConnectionError(
                f"mooncake_master: client setup against {config.mooncake_master} "
                f"(metadata {config.mooncake_metadata}, local hostname "
                f"{config.mooncake_local_hostname!r}, protocol {config.mooncake_protocol}) "
                f"failed with code {rc}"
            )
        self._store = store
        try:
            for name in self.codecs:
                self._layout(name)
        except Exception:
            self._close()
            raise

    @property
    def client(self):
        """The underlying ``MooncakeDistributedStore`` (benchmarks use it as their raw baseline:
        the same client and segment). None once closed."""
        return self._store

    # ---- plumbing ----------------------------------------------------------------------------
    def _layout(self, pool: str) -> PageRuns:
        """The pool's page runs, its host array registered with the client on first use (tests
        may swap a codec's pool for another)."""
        runs = self.codecs[pool].runs()
        nbytes = runs.pool.array.nbytes
        if self._registered.get(runs.base, 0) < nbytes:
            with self._lock:
                if self._registered.get(runs.base, 0) < nbytes:
                    rc = self._store.register_buffer(runs.base, nbytes)
                    if rc != 0:
                        log.warning(
                            "L3 mooncake: register_buffer(%s pool, %d bytes) returned %d; transfers may copy",
                            pool,
                            nbytes,
                            rc,
                        )
                    else:
                        self._registered[runs.base] = nbytes
        return runs

    def _call(self, what: str, fn, *args):
        """Run a client call on a worker within the op timeout; raises on a fault (after
        starting the retry interval), ``_StoreDown`` inside one."""
        return self._wait(what, self._start(what, fn, *args))

    def _start(self, what: str, fn, *args) -> cf.Future:
        """Start a client call on a worker (``_wait`` collects it); ``_StoreDown`` inside a
        retry interval."""
        now = time.monotonic()
        if now < self._down_until:
            raise _StoreDown(what)
        if self._down_until and (self._store.health_check() != 0 or not self._master_answers()):
            self._down_until = now + self._retry
            raise _StoreDown(what)
        return self._executor.submit(self._run_call, fn, args)

    def _wait(self, what: str, fut: cf.Future):
        """The result of a call ``_start`` began, waiting at most the op timeout from now."""
        try:
            return fut.result(timeout=self._timeout)
        except cf.TimeoutError:
            fut.cancel()
            self._fault(f"{what} did not finish within mooncake_op_timeout_s={self._timeout}")
            raise TimeoutError(f"L3 mooncake: {what} timed out") from None

    def _chunks(self, n: int, pb: int) -> list[tuple[int, int]]:
        """``[lo, hi)`` page ranges of about ``PIPELINE_CHUNK_BYTES`` each over ``n`` pages of
        ``pb`` bytes: a call's pieces, whose transfers and CRCs overlap (see the module doc)."""
        per = max(1, PIPELINE_CHUNK_BYTES // max(1, pb))
        return [(lo, min(n, lo + per)) for lo in range(0, n, per)]

    def _master_answers(self) -> bool:
        """The master's RPC port accepts a connection. Asked after a fault beside the client's
        ``health_check``, which reports 0 with the master killed: without this every retry
        interval ended with a call that waited the whole op timeout on a dead master."""
        try:
            _probe_tcp(
                "mooncake_master",
                *split_host_port("mooncake_master", self.config.mooncake_master),
                min(self._timeout, 0.5),
            )
        except ConnectionError:
            return False
        return True

    def _in_parallel(self, n: int, fn) -> list:
        """``fn(lo, hi)`` (a list, one item per page of ``[lo, hi)``) over ``n`` pages split into
        about ``RANGES_PER_THREAD`` ranges per CRC thread, run on those threads; the
        concatenated results, once every range is done."""
        per = max(1, -(-n // (RANGES_PER_THREAD * self.config.read_concurrency)))
        ranges = [(lo, min(n, lo + per)) for lo in range(0, n, per)]
        if len(ranges) == 1:
            return fn(0, n)
        futs = [self._crc_executor.submit(fn, lo, hi) for lo, hi in ranges]
        cf.wait(futs)
        return [x for f in futs for x in f.result()]

    def _run_call(self, fn, args):  # worker thread
        with self._calls:
            if self._closing:
                raise _StoreDown("closed")
            self._running += 1
        try:
            return fn(*args)
        finally:
            with self._calls:
                self._running -= 1
                self._calls.notify_all()

    def _fault(self, why: str) -> None:
        log.warning("L3 mooncake: %s; missing for %.1fs", why, self._retry)
        self._down_until = time.monotonic() + self._retry

    def _rpc_codes(self, what: str, codes: Sequence[int]) -> None:
        bad = [c for c in codes if c <= _RPC_FAIL_MAX]
        if bad:
            self._fault(f"{what}: master unreachable (code {bad[0]})")

    # ---- hooks -------------------------------------------------------------------------------
    def _contains(self, pool: str, keys: list[bytes]) -> list[bool]:
        names = [object_name(pool, k) for k in keys]
        try:
            codes = list(self._call("batch_is_exist", self._store.batch_is_exist, names))
        except _StoreDown:
            return [False] * len(keys)
        if len(codes) != len(keys):
            raise RuntimeError(f"batch_is_exist returned {len(codes)} results for {len(keys)} keys")
        if any(c < 0 for c in codes):
            self.metrics.add(read_errors=1)
            self._rpc_codes("batch_is_exist", codes)
        return [c == 1 for c in codes]

    def _contains_answered(self, pool: str, keys: list[bytes]) -> list[bool] | None:
        names = [object_name(pool, k) for k in keys]
        try:
            codes = list(self._call("batch_is_exist", self._store.batch_is_exist, names))
        except _StoreDown:
            return None
        if len(codes) != len(keys):
            raise RuntimeError(f"batch_is_exist returned {len(codes)} results for {len(keys)} keys")
        if any(c < 0 for c in codes):  # an RPC error is no answer; counted as _contains counts it
            self.metrics.add(read_errors=1)
            self._rpc_codes("batch_is_exist", codes)
            return None
        return [c == 1 for c in codes]

    def _check(self, pool: str, key: bytes, head: np.ndarray, runs: list, pb: int) -> bool:
        """Whether a value read as ``head`` + the bytes at ``runs`` is this key's page; counts
        what it checks. Runs on a worker (the CRC releases the GIL)."""
        magic, algo, _, _, crc, nbytes, fkey = _HEADER.unpack(head.tobytes())
        if magic != MAGIC or nbytes != pb or fkey != key:
            log.warning(
                "L3 mooncake: bad header for %s/%s (magic=%r, size=%d want %d, key match=%s)",
                pool,
                key.hex(),
                magic,
                nbytes,
                pb,
                fkey == key,
            )
            return False
        mode = self.config.integrity
        if mode == "full" or (mode == "sampled" and integrity.sample_hit(self.config.integrity_sample_rate)):
            try:
                ok = integrity.checksum_at(runs, algo, key) == crc
            except integrity.ChecksumUnavailable as e:
                log.warning("L3 mooncake: cannot verify %s/%s: %s", pool, key.hex(), e)
                self.metrics.add(read_errors=1)
                return False
            self.metrics.add(verified=1)
            if not ok:
                log.warning("L3 mooncake: CRC mismatch for %s/%s", pool, key.hex())
                return False
        return True

    def _drop_bad(self, pool: str, names: list[str]) -> None:
        """Count and remove objects that failed a check (so a later write stores the page afresh)."""
        self.metrics.add(corrupt=len(names))
        try:
            codes = self._call("batch_remove", self._store.batch_remove, names, True)
            self.metrics.add(quarantined=sum(1 for c in codes if c == 0))
            gone = [bytes.fromhex(n.rsplit("/", 1)[1]) for n, c in zip(names, codes) if c == 0]
            if gone and self._notify is not None:
                self._notify("removed", pool, gone)
        except Exception as e:  # it stays a miss for every read until removed or evicted
            log.warning("L3 mooncake: removing %d bad objects failed: %r", len(names), e)

    def _get(self, pool: str, keys: list[bytes], heads: np.ndarray, runs: list[list], zero) -> list[bool]:
        """Read each key's value into ``heads[i]`` (its 64-byte header) and the page's ``runs[i]``
        (``(address, nbytes)`` in page order), a batch call per piece of ``_chunks``, and check
        each piece's pages (header, CRC) on the CRC threads in parallel while the next piece
        moves; ``zero(i)`` scrubs page i after a failed read."""
        names = [object_name(pool, k) for k in keys]
        pb = self.codecs[pool].page_bytes
        hp = heads.ctypes.data
        ptrs = [[hp + i * HEADER_BYTES] + [a for a, _ in runs[i]] for i in range(len(keys))]
        sizes = [[HEADER_BYTES] + [n for _, n in runs[i]] for i in range(len(keys))]
        what = "batch_get_into_multi_buffers"
        get = self._store.batch_get_into_multi_buffers
        codes: list = [None] * len(keys)  # None: not read (the store went down mid-call)
        ok = [False] * len(keys)

        def check(lo: int, hi: int) -> list[bool]:  # a CRC thread (the CRC releases the GIL)
            out = []
            for i in range(lo, hi):
                c = codes[i]
                good = c == HEADER_BYTES + pb and self._check(pool, keys[i], heads[i], runs[i], pb)
                if not good and c != OBJECT_NOT_FOUND:
                    zero(i)  # a page not loaded keeps no bytes that failed a check
                out.append(good)
            return out

        # Pipelined: piece k+1 moves (on a store worker) while piece k is checked (CRC threads).
        chunks = self._chunks(len(keys), pb)
        try:
            fut = self._start(what, get, names[: chunks[0][1]], ptrs[: chunks[0][1]], sizes[: chunks[0][1]])
        except _StoreDown:
            return ok
        for j, (lo, hi) in enumerate(chunks):
            codes[lo:hi] = self._got(what, self._wait(what, fut), (lo, hi))
            fut = None
            if j + 1 < len(chunks):
                a, b = chunks[j + 1]
                try:
                    fut = self._start(what, get, names[a:b], ptrs[a:b], sizes[a:b])
                except _StoreDown:
                    pass  # the pages of the pieces not read are misses, left untouched
            try:
                ok[lo:hi] = self._in_parallel(hi - lo, lambda x, y: check(lo + x, lo + y))
            except BaseException:  # never return with the next piece still landing in host pages
                if fut is not None:
                    try:
                        self._wait(what, fut)
                    except Exception:
                        pass
                raise
            if fut is None:
                break
        bad, failed = [], []
        errors = False
        for i, c in enumerate(codes):
            if ok[i] or c == OBJECT_NOT_FOUND or c is None:
                continue
            if c == HEADER_BYTES + pb:  # read whole, failed a check
                bad.append(names[i])
            elif c >= 0 or c == INVALID_PARAMS:  # a value of another size (too long for the buffers)
                log.warning(
                    "L3 mooncake: %s has the wrong size (code %d, want %d bytes)", names[i], c, HEADER_BYTES + pb
                )
                bad.append(names[i])
            elif c == TRANSFER_FAIL:  # too short, or the segment holding it is unreachable: see below
                failed.append(i)
            else:
                errors = True
        if failed:
            short = self._short_values(pool, [names[i] for i in failed], HEADER_BYTES + pb)
            bad += short
            errors = errors or len(short) < len(failed)
        if errors:
            self.metrics.add(read_errors=1)
            self._rpc_codes("batch_get_into_multi_buffers", [c for c in codes if c is not None])
        if bad:
            self._drop_bad(pool, bad)
        return ok

    def _short_values(self, pool: str, names: list[str], want: int) -> list[str]:
        """Of reads that failed with ``TRANSFER_FAIL``, the objects whose size is not ``want``
        (a damaged value: drop it). The others are transfer errors (the segment's owner is
        unreachable, e.g. a store node died): misses, but the objects stay, they may be fine."""
        try:
            sizes = self._call("get_size", lambda: [self._store.get_size(n) for n in names])
        except Exception:  # cannot tell: treat as transfer errors (misses; nothing removed)
            return []
        short = [n for n, size in zip(names, sizes) if size >= 0 and size != want]
        for n in short:
            log.warning("L3 mooncake: %s has the wrong size (want %d bytes)", n, want)
        return short

    def _read_into_host(self, pool: str, keys: list[bytes], ids: Sequence[int], loaded: list[bool]) -> int:
        pr = self._layout(pool)
        hid = [int(h) for h in ids]
        heads = np.zeros((len(keys), HEADER_BYTES), np.uint8)
        ok = self._get(pool, keys, heads, [pr.runs(h) for h in hid], lambda i: pr.zero(hid[i]))
        for i, o in enumerate(ok):
            loaded[i] = o
        return 0  # _check counts the pages it verified

    def _reads_in_place(self) -> bool:
        return True

    def _read(self, pool: str, keys: list[bytes]) -> list[np.ndarray | None]:
        pb = self.codecs[pool].page_bytes
        pages = np.empty((len(keys), pb), np.uint8)
        base = pages.ctypes.data
        heads = np.zeros((len(keys), HEADER_BYTES), np.uint8)
        ok = self._get(pool, keys, heads, [[(base + i * pb, pb)] for i in range(len(keys))], lambda i: pages[i].fill(0))
        return [pages[i] if o else None for i, o in enumerate(ok)]

    def _put(self, pool: str, keys: list[bytes], runs: list[list]) -> list[bool]:
        """Store page i from the bytes at ``runs[i]`` (registered memory) after a 64-byte
        header, a batch call per piece of ``_chunks``: piece k+1's CRCs run on the CRC threads
        while piece k moves on a store worker (see "Pipelined" in the module doc). Pages of
        pieces not started (the store went down meanwhile) are dropped (False)."""
        t0 = time.perf_counter()
        algo = integrity.DEFAULT_ALGO
        pb = self.codecs[pool].page_bytes
        heads = np.empty((len(keys), HEADER_BYTES), np.uint8)  # alive until no piece is in flight

        def head(lo: int, hi: int) -> list[None]:  # a CRC thread (the CRC releases the GIL)
            for i in range(lo, hi):
                crc = integrity.checksum_at(runs[i], algo, keys[i])
                heads[i] = np.frombuffer(_HEADER.pack(MAGIC, algo, 0, 0, crc, pb, keys[i]), np.uint8)
            return [None] * (hi - lo)

        hp = heads.ctypes.data
        names = [object_name(pool, k) for k in keys]
        ptrs = [[hp + i * HEADER_BYTES] + [a for a, _ in runs[i]] for i in range(len(keys))]
        sizes = [[HEADER_BYTES] + [n for _, n in runs[i]] for i in range(len(keys))]
        what = "batch_put_from_multi_buffers"
        put = self._store.batch_put_from_multi_buffers
        codes: list = [None] * len(keys)  # None: not written (the store went down mid-call)
        fut, moving = None, (0, 0)
        try:
            for lo, hi in self._chunks(len(keys), pb):
                self._in_parallel(hi - lo, lambda x, y: head(lo + x, lo + y))  # while the last piece moves
                if fut is not None:  # (cleared first: a call that timed out is not waited for twice)
                    f, fut = fut, None
                    codes[moving[0] : moving[1]] = self._got(what, self._wait(what, f), moving)
                try:
                    fut, moving = self._start(what, put, names[lo:hi], ptrs[lo:hi], sizes[lo:hi]), (lo, hi)
                except _StoreDown:
                    break  # this piece and the later ones are not written
            if fut is not None:
                f, fut = fut, None
                codes[moving[0] : moving[1]] = self._got(what, self._wait(what, f), moving)
        finally:  # never return (nor raise) with a piece still reading ``heads`` and host pages
            if fut is not None:
                try:
                    self._wait(what, fut)
                except Exception:
                    pass
        ok = [c == 0 for c in codes]
        n = sum(ok)
        if n < len(keys):
            failed = [c for c in codes if c is not None and c != 0]
            self.metrics.add(pages_dropped=len(keys) - n)
            if failed:
                log.warning("L3 mooncake: %d of %d puts failed (first code %d)", len(failed), len(keys), failed[0])
                self.metrics.add(write_errors=1)
                self._rpc_codes(what, failed)
        self.metrics.add(pages_written=n, bytes_written=n * pb, write_seconds=time.perf_counter() - t0)
        if n and self._notify is not None:
            self._notify("stored", pool, [k for k, good in zip(keys, ok) if good])
        return ok

    @staticmethod
    def _got(what: str, codes, piece: tuple[int, int]) -> list:
        """A piece's result codes, checked for one per key."""
        codes = list(codes)
        if len(codes) != piece[1] - piece[0]:
            raise RuntimeError(f"{what} returned {len(codes)} results for {piece[1] - piece[0]} keys")
        return codes

    def _write(self, pool: str, keys: list[bytes], pages: np.ndarray) -> list[bool]:
        pages = np.ascontiguousarray(pages)
        base, row = pages.ctypes.data, pages.strides[0]
        return self._put(pool, keys, [[(base + i * row, pages.shape[1])] for i in range(len(keys))])

    def _write_from_host(self, pool: str, keys: list[bytes], ids: np.ndarray) -> list[bool]:
        pr = self._layout(pool)
        return self._put(pool, keys, [pr.runs(int(h)) for h in ids])

    def _close(self) -> None:
        store = getattr(self, "_store", None)
        self._store = None
        for name in ("_executor", "_crc_executor"):
            ex = getattr(self, name, None)
            if ex is not None:
                ex.shutdown(wait=False, cancel_futures=True)
        if store is None:
            return
        with self._calls:  # no call starts from now on; wait (bounded) for those inside the client
            self._closing = True
            deadline = time.monotonic() + self._timeout + 1.0
            while self._running and self._calls.wait(max(0.0, deadline - time.monotonic())):
                pass
            if self._running:
                log.warning(
                    "L3 mooncake: %d client calls still running %.1fs after close; the client is left "
                    "open (closing it under them would crash the process)",
                    self._running,
                    self._timeout + 1,
                )
                return
        for addr in list(self._registered):
            try:
                store.unregister_buffer(addr)
            except Exception:
                pass
        self._registered.clear()
        try:
            store.close()
        except Exception as e:
            log.warning("L3 mooncake: close failed: %r", e)
