"""The cache's byte contract, checked in the engine: every page a hit serves holds bytes that
were computed for that prefix (device -> host -> storage -> host -> device round trips change
no bit). Opt-in (``Engine.enable_page_audit``): it reads pages back from the device.

What it compares. When a request has computed pages that enter the tree (after its prefill,
and when it finishes), the audit reads each full page from the device and records a digest of
its bytes (every layer and component of the full pool, and of the draft pool with speculative
decoding: same page ids) under the page's *prefix*: the request's tree key up to the page's
end. When a later request is served a prefix from the cache (any tier), the audit reads the
served pages once their load-back has landed, before the prefill reads them, and compares
each with the digests recorded for its prefix. A page's bytes depend on every token before
it, so the prefix names what the page must hold, whatever tier it came from.

A prefix can be computed more than once (evicted from every tier, then recomputed; or two
requests in flight computing the same prompt): every digest seen for it is kept, and a served
page matches when it equals one of them. In the default mode a recomputation can round
differently (other chunk or batch shapes), so the set is what the cache may legitimately
serve; a wrong page, a page of another prefix, or pages landed in a permuted order match none.
A served page whose prefix the audit never saw computed (L3 pages written by another process
whose audit was not shared) counts as ``unknown``, not as a match.

The SWA pool of a hybrid model is not audited (its pages are a window, tombstoned outside it;
``tests/jax_backend/test_engine_swa.py`` compares them byte for byte).

Deferred comparison. ``record`` and ``check`` read and compare at once (the page ids' bytes
now). The engine uses ``submit_record`` / ``submit_check`` instead: they only dispatch the page
gather (ordered on the device before any later write to those pages, so it sees exactly the bytes
the request was served) and start its copy to the host; hashing and comparing happen in
``settle()``, in submission order (a check sees every record submitted before it). ``stats()``,
``counts`` and ``byte_identical`` settle first. Pending gathers hold device memory, so more than
``max_pending_bytes`` of them settle at once. This keeps the audit's host work (blocking reads,
hashing: ~2.6 s of a 3.8 s multi-turn run on an H200, inflating every queued request's wait)
out of the serving loop; a benchmark settles between its timed rounds.

Several engines (a restarted one reading L3) can share one audit: pass it to
``Engine.enable_page_audit``. Threading: the engine's scheduler thread (which owns the pools);
``settle`` on that thread or while the engine is idle.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field

import jax
import numpy as np

TIERS = ("device", "host", "storage")


@jax.jit
def _gather(layers, ids):
    return [a[ids] for a in layers]


def _dispatch_read(pool, component: str, ids: np.ndarray) -> list:
    """Start reading pages ``ids`` of every layer (device arrays, copying to the host). The ids
    are padded to a power of two, so one program per size class serves every request (a gather
    compiled per prefix length would cost more than the audit itself)."""
    n = ids.shape[0]
    padded = np.full(1 << max(0, (n - 1).bit_length()), ids[0], np.int32)
    padded[:n] = ids
    arrays = _gather(tuple(pool.layers(component)), padded)
    for a in arrays:
        a.copy_to_host_async()
    return arrays


def _landed(arrays: list, n: int, container_dtype) -> np.ndarray:
    """The read pages ``(L, n, page, H, D)`` as the container dtype's bits (waits for them)."""
    return np.stack([np.asarray(a) for a in arrays])[:, :n].view(container_dtype)


def _read_pages(pool, component: str, ids: np.ndarray) -> np.ndarray:
    """Pages ``ids`` of every layer ``(L, n, page, H, D)`` as the container dtype's bits, now."""
    return _landed(_dispatch_read(pool, component, ids), ids.shape[0], pool.geom.container_dtype)


@dataclass
class _Pending:
    """A submitted record or check whose page reads are in flight."""

    prefixes: list[bytes]
    reads: list[tuple[list, object]]  # per pool and component: (device arrays, container dtype)
    n: int
    nbytes: int
    tiers: list[str] | None = None  # a check: where each page came from; None: a record
    request: int = -1


@dataclass
class AuditCounts:
    """Pages compared per tier, and how they compared."""

    checked: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    mismatched: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    unknown: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    recorded: int = 0  # computed pages whose digest was recorded
    requests_served: int = 0  # requests that were served at least one page
    requests_mismatched: int = 0  # ... of which at least one page matched no recorded digest
    first_mismatch: list[tuple[int, int, str]] = field(default_factory=list)  # (request index, page, tier)
    seconds: float = 0.0  # spent reading and hashing pages (the engine adds it)


def _prefix_digests(key_tokens: np.ndarray, page: int, pages: range) -> list[bytes]:
    """Per page j in ``pages``: a digest of ``key_tokens[:(j + 1) * page]`` (incremental)."""
    h = hashlib.blake2b(digest_size=16)
    data = np.ascontiguousarray(key_tokens, np.int64)
    out, done = [], 0
    for j in pages:
        end = (j + 1) * page
        h.update(data[done:end].tobytes())
        done = end
        out.append(h.copy().digest())
    return out


class PageAudit:
    """Digests of computed pages by prefix, and the comparison of served pages (module docstring)."""

    def __init__(self, page_size: int, max_pending_bytes: int = 512 << 20) -> None:
        if not isinstance(page_size, int) or page_size < 1:
            raise ValueError(f"page_size: expected a positive int, got {page_size!r}")
        if not isinstance(max_pending_bytes, int) or max_pending_bytes < 0:
            raise ValueError(f"max_pending_bytes: expected an int >= 0, got {max_pending_bytes!r}")
        self.page_size = page_size
        self.max_pending_bytes = max_pending_bytes
        self._seen: dict[bytes, set[bytes]] = {}  # prefix digest -> page byte digests
        self._counts = AuditCounts()
        self._pending: list[_Pending] = []
        self._pending_bytes = 0

    @staticmethod
    def warm(pools, max_pages: int) -> None:
        """Compile the page reads of every size class up to ``max_pages`` now, so that none
        compiles while requests are served."""
        for pool in pools:
            for c in pool.geom.components:
                for b in range(max(1, max_pages - 1).bit_length() + 1):
                    _read_pages(pool, c, np.zeros(1 << b, np.int32))

    @property
    def counts(self) -> AuditCounts:
        """The tallies, once every submitted comparison has been made."""
        self.settle()
        return self._counts

    def add_seconds(self, seconds: float) -> None:
        """Time a caller spent on the audit (the engine's dispatch), added to ``counts.seconds``."""
        self._counts.seconds += seconds

    @property
    def pending(self) -> int:
        """Submitted records and checks not compared yet."""
        return len(self._pending)

    def _read(
        self,
        pools,
        key_tokens: np.ndarray,
        page_ids: np.ndarray,
        first: int,
        end: int,
        tiers: list[str] | None,
        request: int,
    ) -> _Pending:
        """Dispatch the reads of pages ``[first, end)`` of every pool and component."""
        ids = np.asarray(page_ids[first:end], np.int32)
        reads = [
            (_dispatch_read(pool, c, ids), pool.geom.container_dtype) for pool in pools for c in pool.geom.components
        ]
        nbytes = sum(a.nbytes for arrays, _dtype in reads for a in arrays)
        return _Pending(
            _prefix_digests(key_tokens, self.page_size, range(first, end)), reads, end - first, nbytes, tiers, request
        )

    def _submit(
        self,
        pools,
        key_tokens: np.ndarray,
        page_ids: np.ndarray,
        first: int,
        end: int,
        tiers: list[str] | None,
        request: int,
    ) -> None:
        op = self._read(pools, key_tokens, page_ids, first, end, tiers, request)
        self._pending.append(op)
        self._pending_bytes += op.nbytes
        if self._pending_bytes > self.max_pending_bytes:
            self.settle()

    def submit_record(self, pools, key_tokens: np.ndarray, page_ids: np.ndarray, first: int, end: int) -> None:
        """``record`` without waiting: the pages are read now, compared at ``settle()``."""
        if end > first:
            self._submit(pools, key_tokens, page_ids, first, end, None, -1)

    def submit_check(self, pools, key_tokens: np.ndarray, page_ids: np.ndarray, tiers: list[str], request: int) -> None:
        """``check`` without waiting: the served pages are read now, compared at ``settle()``."""
        if tiers:
            self._submit(pools, key_tokens, page_ids, 0, len(tiers), list(tiers), request)

    def settle(self) -> None:
        """Compare every submitted record and check, in submission order (waits for their reads)."""
        if not self._pending:
            return
        t0 = time.perf_counter()
        pending, self._pending, self._pending_bytes = self._pending, [], 0
        for op in pending:
            self._apply(op)
        self._counts.seconds += time.perf_counter() - t0

    def _apply(self, op: _Pending) -> list[int]:
        hs = [hashlib.blake2b(digest_size=16) for _ in range(op.n)]
        for arrays, dtype in op.reads:  # every pool and component, in one fixed order
            pages = _landed(arrays, op.n, dtype)
            for j, h in enumerate(hs):
                h.update(np.ascontiguousarray(pages[:, j]).tobytes())
        digests = [h.digest() for h in hs]
        c = self._counts
        if op.tiers is None:
            for p, d in zip(op.prefixes, digests):
                self._seen.setdefault(p, set()).add(d)
            c.recorded += op.n
            return []
        bad = []
        for j, (p, d) in enumerate(zip(op.prefixes, digests)):
            tier = op.tiers[j]
            c.checked[tier] += 1
            seen = self._seen.get(p)
            if seen is None:
                c.unknown[tier] += 1
            elif d not in seen:
                c.mismatched[tier] += 1
                bad.append(j)
        c.requests_served += 1
        if bad:
            c.requests_mismatched += 1
            c.first_mismatch.append((op.request, bad[0], op.tiers[bad[0]]))
        return bad

    def record(self, pools, key_tokens: np.ndarray, page_ids: np.ndarray, first: int, end: int) -> None:
        """Record pages ``[first, end)`` of a request (``page_ids`` by logical page) as computed
        for the prefixes of ``key_tokens`` (now: earlier submissions are settled first)."""
        self.submit_record(pools, key_tokens, page_ids, first, end)
        self.settle()

    def check(self, pools, key_tokens: np.ndarray, page_ids: np.ndarray, tiers: list[str], request: int) -> list[int]:
        """Compare the served pages ``page_ids[:len(tiers)]`` (``tiers[j]``: where page j came
        from) with the digests recorded for their prefixes, now; returns the mismatched pages."""
        if not tiers:
            return []
        self.settle()
        op = self._read(pools, key_tokens, page_ids, 0, len(tiers), list(tiers), request)
        t0 = time.perf_counter()
        bad = self._apply(op)
        self._counts.seconds += time.perf_counter() - t0
        return bad

    @property
    def byte_identical(self) -> bool | None:
        """True when every checked page matched; None when no page was checked."""
        c = self.counts  # settles
        if not sum(c.checked.values()):
            return None
        return not sum(c.mismatched.values())

    def stats(self) -> dict:
        c = self.counts  # settles
        return {
            "pages_checked": dict(c.checked),
            "pages_mismatched": dict(c.mismatched),
            "pages_unknown": dict(c.unknown),
            "pages_recorded": c.recorded,
            "requests_served": c.requests_served,
            "requests_mismatched": c.requests_mismatched,
            "first_mismatches": [list(x) for x in c.first_mismatch[:20]],
            "seconds": c.seconds,
            "byte_identical": self.byte_identical,
        }
