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

Several engines (a restarted one reading L3) can share one audit: pass it to
``Engine.enable_page_audit``. Threading: the engine's scheduler thread (which owns the pools).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import jax
import numpy as np

TIERS = ("device", "host", "storage")


@jax.jit
def _gather(layers, ids):
    return [a[ids] for a in layers]


def _read_pages(pool, component: str, ids: np.ndarray) -> np.ndarray:
    """Pages ``ids`` of every layer ``(L, n, page, H, D)`` as the container dtype's bits. The
    ids are padded to a power of two, so one program per size class serves every request (a
    gather compiled per prefix length would cost more than the audit itself)."""
    n = ids.shape[0]
    padded = np.full(1 << max(0, (n - 1).bit_length()), ids[0], np.int32)
    padded[:n] = ids
    out = np.stack([np.asarray(a) for a in _gather(tuple(pool.layers(component)), padded)])[:, :n]
    return out.view(pool.geom.container_dtype)


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

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self._seen: dict[bytes, set[bytes]] = {}  # prefix digest -> page byte digests
        self.counts = AuditCounts()

    @staticmethod
    def warm(pools, max_pages: int) -> None:
        """Compile the page reads of every size class up to ``max_pages`` now, so that none
        compiles while requests are served."""
        for pool in pools:
            for c in pool.geom.components:
                for b in range(max(1, max_pages - 1).bit_length() + 1):
                    _read_pages(pool, c, np.zeros(1 << b, np.int32))

    def _page_digests(self, pools, ids: np.ndarray) -> list[bytes]:
        """A digest of each page's bytes over every pool, component and layer."""
        hs = [hashlib.blake2b(digest_size=16) for _ in range(ids.shape[0])]
        for pool in pools:
            for c in pool.geom.components:
                pages = _read_pages(pool, c, ids)  # (L, n, page, H, D)
                for j, h in enumerate(hs):
                    h.update(np.ascontiguousarray(pages[:, j]).tobytes())
        return [h.digest() for h in hs]

    def record(self, pools, key_tokens: np.ndarray, page_ids: np.ndarray, first: int, end: int) -> None:
        """Record pages ``[first, end)`` of a request (``page_ids`` by logical page) as computed
        for the prefixes of ``key_tokens``."""
        if end <= first:
            return
        ids = np.asarray(page_ids[first:end])
        prefixes = _prefix_digests(key_tokens, self.page_size, range(first, end))
        for p, d in zip(prefixes, self._page_digests(pools, ids)):
            self._seen.setdefault(p, set()).add(d)
        self.counts.recorded += end - first

    def check(self, pools, key_tokens: np.ndarray, page_ids: np.ndarray, tiers: list[str],
              request: int) -> list[int]:
        """Compare the served pages ``page_ids[:len(tiers)]`` (``tiers[j]``: where page j came
        from) with the digests recorded for their prefixes; returns the mismatched pages."""
        n = len(tiers)
        if n == 0:
            return []
        c = self.counts
        prefixes = _prefix_digests(key_tokens, self.page_size, range(n))
        bad = []
        for j, (p, d) in enumerate(zip(prefixes, self._page_digests(pools, np.asarray(page_ids[:n])))):
            tier = tiers[j]
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
            c.first_mismatch.append((request, bad[0], tiers[bad[0]]))
        return bad

    @property
    def byte_identical(self) -> bool | None:
        """True when every checked page matched; None when no page was checked."""
        c = self.counts
        if not sum(c.checked.values()):
            return None
        return not sum(c.mismatched.values())

    def stats(self) -> dict:
        c = self.counts
        return {"pages_checked": dict(c.checked), "pages_mismatched": dict(c.mismatched),
                "pages_unknown": dict(c.unknown), "pages_recorded": c.recorded,
                "requests_served": c.requests_served, "requests_mismatched": c.requests_mismatched,
                "first_mismatches": [list(x) for x in c.first_mismatch[:20]], "seconds": c.seconds,
                "byte_identical": self.byte_identical}
