"""SWA (and draft sidecar) state in the agreed rank protocol (pure numpy; both environments).

What is checked here: the digest covers the SWA component's state (per node and its counters)
while a full-only cache digests byte for byte as before; SWA host reservations go reserve ->
agree -> commit (a full part and a component part per backup); window slides go to the
agreed (MIN) length; the L3 facade's component reservations; one exchange per step.
The serving traces over several ranks are in ``test_swa_fuzz_ranks.py``.
"""

from __future__ import annotations

import numpy as np
from rank_trace import rank_cache, run_trace
from swa_harness import SWADriver, make_swa_cache

from hicache_jax.cache import RadixKey
from hicache_jax.cache.digest import state_digest

# ``run_trace(rank_cache(None), steps=12)``'s digests (sha256 of their concatenation) and its
# final digest with page ids, recorded before components took part in the digest: a full-only
# cache must keep digesting exactly as it did (ranks of different versions compare digests).
FULL_ONLY_TRACE = "46a8773474934f2226466a7163ae3f305fe6915f017e4cb4d4dde649ca87c6cf"
FULL_ONLY_PAGES = "f49b2629f10fb0a5d9220c38fd9019081403b56deb2df45e48e6ea877c20ff78"


def key(start, n):
    return RadixKey(np.arange(start, start + n, dtype=np.int64))


# ---------------------------------------------------------------------------------------------- digest
def test_a_full_only_digest_is_byte_identical_to_before():
    import hashlib

    cache, be, _ = rank_cache(None)
    out = run_trace(cache, be, steps=12)
    assert hashlib.sha256("".join(out["digests"]).encode()).hexdigest() == FULL_ONLY_TRACE
    assert cache.debug_view().digest(pages=True) == FULL_ONLY_PAGES


def _full_part(cache):
    v = cache.debug_view()
    return state_digest(v.root, cache._tree.clock, v.counters, v.pending())


def test_the_digest_sees_swa_state_the_full_tree_does_not(monkeypatch):
    cache, full, swa_be, swa = make_swa_cache(window=5, swa_device_pages=16)
    drv = SWADriver(cache, full, swa_be, swa)
    assert drv.serve(key(0, 20), chunk=4) is not None
    cache.sanity_check(0, {"swa": 0})
    d0, f0 = cache.debug_view().digest(), _full_part(cache)
    assert d0 != f0  # the SWA state is in it
    m = cache.match_prefix(key(0, 20))
    receipt = cache.inc_lock_ref(m.last_device_node)
    monkeypatch.setattr(swa, "digest_state", lambda: {})  # the per-node part alone must see it
    f1, d1 = _full_part(cache), cache.debug_view().digest()
    # Tombstone an out-of-window node: only SWA state changes.
    assert swa.evict(1) >= 1 and swa.metrics.tombstoned_tokens > 0
    assert _full_part(cache) == f1 and cache.debug_view().digest() != d1
    monkeypatch.undo()
    cache.dec_lock_ref(receipt)
    cache.sanity_check(0, {"swa": 0})


def test_the_digest_sees_swa_holds_and_counters():
    cache, full, swa_be, swa = make_swa_cache(window=5)
    drv = SWADriver(cache, full, swa_be, swa)
    drv.serve(key(0, 12))
    m = cache.match_prefix(key(0, 12))
    d0, f0 = cache.debug_view().digest(), _full_part(cache)
    r = cache.inc_lock_ref(m.last_device_node)  # a window hold: full locks change too
    d1 = cache.debug_view().digest()
    assert d1 != d0
    # the window hold released early leaves the full lock: only SWA state differs
    f1 = _full_part(cache)
    assert swa.release_window(m.last_device_node)
    assert _full_part(cache) == f1 and cache.debug_view().digest() != d1
    cache.dec_lock_ref(r)
    assert cache.debug_view().digest() == d0 and _full_part(cache) == f0
