"""The reference engine serving a hybrid (full + sliding-window) model through the cache.

* Exactness: greedy tokens with L1, L2 and L3 (a new engine on the same L3 directory) hits
  equal the no-cache run's; the hit's pages (full pages of the whole prefix, SWA pages of the
  window before its end) are byte for byte the pages the first engine computed; the tokens
  the model computed are counted at the model step (not by the engine) and equal the prompt
  minus the hit the page arithmetic predicts; free pages of both pools are NaN before every
  hit, so a step that read a page the cache did not fill would change the tokens.
* SWA pages go back to the pool as the window slides: the SWA pages allocated at every model
  step stay within the window's page span, however long the decode, while the full pages grow.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from hicache_jax.cache import RadixKey
from hicache_jax.engine import Engine, EngineCacheConfig
from hicache_jax.host_pool import HostPoolConfig
from hicache_jax.reference_model import HYBRID_TINY, swa_first_needed_page, swa_table_width
from hicache_jax.storage.config import StorageConfig

W = HYBRID_TINY.sliding_window  # 24: W - 1 = 23 ends inside a page of 16 or 4
NEW = 5


def count_steps(engine: Engine) -> list:
    """Wrap the model step: record, per call, the tokens of each sequence, the pages of both
    pools allocated at that moment and the SWA pages in each sequence's SWA table."""
    calls = []
    step = engine.runner.step

    def counting(pools, tokens, starts, tables, *a, **kw):
        held = [int((np.asarray(t) >= 0).sum()) for t in kw["swa_page_tables"]]
        calls.append(
            ([len(t) for t in tokens], engine.device_pool.allocator.used, engine.swa_pool.allocator.used, held)
        )
        return step(pools, tokens, starts, tables, *a, **kw)

    engine.runner.step = counting
    return calls


def poison_free_pages(engine: Engine) -> None:
    """NaN into every free page of both device pools."""
    for pool in (engine.device_pool, engine.swa_pool):
        free = np.flatnonzero(~pool.allocator.is_allocated(np.arange(pool.allocator.num_pages)))
        if free.size:
            shape = (pool.geom.num_layers, free.size) + pool.geom.page_shape
            pool.write_pages(free, {c: np.full(shape, np.nan, np.float32) for c in pool.geom.components})


def prefix_kv(engine: Engine, tokens: list, hit: int) -> dict:
    """The bytes of the cached prefix ``tokens[:hit]`` as the tree hands it out: every full
    page, and the SWA pages of the window before its end (a step after it reads those)."""
    p = engine.page_size
    req, lb = engine.cache.begin_request(RadixKey(tokens[:hit]), load_back=False)
    try:
        assert lb is None and req.device_pages.shape[0] * p == hit, (req.device_pages.shape, hit)
        out = {
            ("full", c): engine.device_pool.read_pages_host(c, req.device_pages)
            for c in engine.device_pool.geom.components
        }
        window = req.component_pages["swa"][swa_first_needed_page(hit, W, p) :]
        assert (window >= 0).all(), f"the tree holds no SWA page for part of the window: {window}"
        out.update({("swa", c): engine.swa_pool.read_pages_host(c, window) for c in engine.swa_pool.geom.components})
        return out
    finally:
        engine.cache.dec_lock_ref(req.last_node)


def assert_same_bytes(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for k in want:
        assert got[k].shape == want[k].shape, k
        np.testing.assert_array_equal(got[k], want[k], err_msg=str(k))


def serve(engine, calls, prompts, tier, hits, want_tokens):
    """Serve ``prompts`` with the cache after poisoning the free pages; every prefix must come
    from ``tier`` with ``hits[i]`` tokens, the tokens equal ``want_tokens`` and the model
    computes exactly the rest of the prompts."""
    poison_free_pages(engine)
    del calls[:]
    res = engine.generate(prompts, NEW)
    assert [r.tokens for r in res] == want_tokens
    for r, h in zip(res, hits):
        assert r.cached_tokens == {"device": 0, "host": 0, "storage": 0, tier: h}, (tier, r.cached_tokens, h)
    computed = sum(n for lens, *_ in calls for n in lens) - len(prompts) * (NEW - 1)  # less the decodes
    assert computed == sum(len(q) - h for q, h in zip(prompts, hits))
    engine.cache.sanity_check(0, {"swa": 0})


@pytest.mark.parametrize("page", [1, 16])
def test_hybrid_engine_l1_l2_l3_hits_equal_cold(page, tmp_path):
    l3 = StorageConfig(
        backend="file", path=str(tmp_path / "l3"), prefetch_policy="wait_complete", prefetch_threshold_tokens=page
    )
    cfg = EngineCacheConfig(
        page_size=page, device_pages=320 // page, max_batch=2, prefill_chunk=16, max_context=128, storage=l3
    )
    rng = np.random.default_rng(page)
    first = [rng.integers(0, HYBRID_TINY.vocab_size, n).tolist() for n in (45, 38)]  # not page multiples
    e = Engine(HYBRID_TINY, cfg)
    e2 = None
    try:
        calls = count_steps(e)
        out1 = e.generate(first, NEW)
        prompts = [f + r.tokens + rng.integers(0, HYBRID_TINY.vocab_size, 9).tolist() for f, r in zip(first, out1)]
        want = [r.tokens for r in e.generate(prompts, NEW, use_cache=False)]
        # L1: the first turn's KV (prompt + answer but its last token), whole pages.
        hits = [(len(f) + NEW - 1) // page * page for f in first]
        before = [prefix_kv(e, q, h) for q, h in zip(prompts, hits)]
        serve(e, calls, prompts, "device", hits, want)
        for q, h, b in zip(prompts, hits, before):
            assert_same_bytes(prefix_kv(e, q, h), b)
        # L2: the second turn is in the tree now; everything leaves the device.
        hits = [(len(q) - 1) // page * page for q in prompts]
        before = [prefix_kv(e, q, h) for q, h in zip(prompts, hits)]
        e.flush()
        e.evict_device_cache()
        assert e.device_pool.allocator.used == 0 and e.swa_pool.allocator.used == 0
        loaded = e.swa.metrics.loaded_tokens
        serve(e, calls, prompts, "host", hits, want)
        # Only the window's SWA pages came back from the host, not the whole prefix's.
        assert e.swa.metrics.loaded_tokens - loaded == sum(h - swa_first_needed_page(h, W, page) * page for h in hits)
        for q, h, b in zip(prompts, hits, before):
            assert_same_bytes(prefix_kv(e, q, h), b)
        e.flush()
        e.close()
        # L3: a new engine on the same directory.
        e2 = Engine(HYBRID_TINY, cfg)
        calls2 = count_steps(e2)
        serve(e2, calls2, prompts, "storage", hits, want)
        for q, h, b in zip(prompts, hits, before):
            assert_same_bytes(prefix_kv(e2, q, h), b)
    finally:
        e.close()
        if e2 is not None:
            e2.close()


@pytest.mark.parametrize("use_cache", [False, True])
def test_hybrid_engine_frees_swa_pages_as_the_window_slides(use_cache):
    page, chunk = 4, 16
    cfg = EngineCacheConfig(
        page_size=page, device_pages=64, max_batch=1, prefill_chunk=chunk, max_context=160, storage=None
    )
    e = Engine(HYBRID_TINY, cfg)
    try:
        rng = np.random.default_rng(3)
        prompt = rng.integers(0, HYBRID_TINY.vocab_size, 30).tolist()
        if use_cache:  # the decode then also slides past a window the request's lock held in the tree
            prompt = prompt + e.generate([prompt], 3)[0].tokens + rng.integers(0, 512, 5).tolist()
        released = e.swa.metrics.released_windows
        calls = count_steps(e)
        n_new = 100  # 4 windows
        e.generate([prompt], n_new, use_cache=use_cache)
        decode = [(full, swa, held[0]) for lens, full, swa, held in calls if lens == [1]][-(n_new - 1) :]
        # The request's SWA table holds its own pages of one step's window, and, while that
        # window still reaches into the tree's part, the tree's window pages its lock holds
        # (one window: the tree caps the node) ...
        tree_window = -(-(W - 1) // page) if use_cache else 0
        for lens, _full, _swa, held in calls:
            assert held[0] <= tree_window + swa_table_width(W, lens[0], page)
        # ... and once the window has moved past the prompt, only one step's window.
        assert max(h for *_x, h in decode[W + 2 * page :]) <= swa_table_width(W, 1, page)
        # ... while the full pool holds a page for every page of the sequence (reserved at
        # admission), four windows' worth: without freeing, the SWA pages would have grown so.
        pages = -(-(len(prompt) + n_new - 1) // page)
        assert decode[-1][0] >= pages > 4 * swa_table_width(W, 1, page)
        if not use_cache:  # the request's SWA pages are all the pool has allocated
            assert all(swa == held[0] for _l, _f, swa, held in calls)
        if use_cache:
            assert e.swa.metrics.released_windows > released  # the tree's window hold went early
        else:  # nothing cached: the engine's peak counters see the allocators
            assert e.metrics.peak_swa_device_pages == max(swa for _l, _f, swa, _h in calls)
            assert e.metrics.peak_device_pages == max(full for _l, full, *_x in calls)
            assert e.swa_pool.allocator.used == 0 and e.device_pool.allocator.used == 0
        e.cache.sanity_check(0, {"swa": 0})
    finally:
        e.close()


def test_hybrid_engine_checks_the_swa_pool_size():
    cfg = EngineCacheConfig(
        page_size=4, device_pages=64, max_batch=2, prefill_chunk=16, max_context=64, swa_device_pages=29
    )
    need = Engine.swa_pages_needed(HYBRID_TINY, cfg)
    assert need == swa_table_width(W, 16, 4) + swa_table_width(W, 1, 4) + 2 * 6  # + a tree window each
    with pytest.raises(ValueError, match="swa_device_pages"):
        Engine(HYBRID_TINY, cfg)
    with pytest.raises(ValueError, match="swa_device_pages"):
        EngineCacheConfig(swa_device_pages=1)


@pytest.mark.slow
def test_hybrid_engine_soak_under_heavy_eviction(tmp_path):
    """Multi-turn conversations on small pools of both kinds (device and host evict all the
    time, prefixes come back from every tier): every round's tokens equal the no-cache run's,
    ``sanity_check`` holds after every round, and after ``reset()`` every allocator is full."""
    l3 = StorageConfig(
        backend="file", path=str(tmp_path / "l3"), prefetch_policy="wait_complete", prefetch_threshold_tokens=4
    )
    cfg = EngineCacheConfig(
        page_size=4,
        device_pages=64,
        max_batch=3,
        prefill_chunk=16,
        max_context=400,
        storage=l3,
        host=HostPoolConfig(ratio=1.0),
    )
    # The smallest SWA pool the engine accepts: SWA allocation evicts (tombstones) all the time.
    cfg = replace(cfg, swa_device_pages=Engine.swa_pages_needed(HYBRID_TINY, cfg))
    e = Engine(HYBRID_TINY, cfg)
    try:
        rng = np.random.default_rng(11)
        hist = [rng.integers(0, HYBRID_TINY.vocab_size, int(n)).tolist() for n in rng.integers(20, 60, 8)]
        tiers = {"device": 0, "host": 0, "storage": 0}
        for _round in range(14):  # 3 of the 8 conversations a round: some come back soon, some late
            pick = sorted(rng.choice(len(hist), 3, replace=False).tolist())
            prompts = [hist[i] for i in pick]
            want = e.generate(prompts, 4, use_cache=False)
            got = e.generate(prompts, 4)
            assert [r.tokens for r in got] == [r.tokens for r in want]
            e.cache.sanity_check(0, {"swa": 0})
            # Each round's L3 writes land before the next round: with a slow disk (other tests
            # fsyncing; seen in a -m slow run, 0 storage tokens) the small host pool evicted the
            # pages before their writes completed and every later turn missed L3. Writes in flight
            # during a round's requests stay (they are issued and served within the round).
            e.flush()
            for i, r in zip(pick, got):
                for t, n in r.cached_tokens.items():
                    tiers[t] += n
                hist[i] = (
                    hist[i] + r.tokens + rng.integers(0, HYBRID_TINY.vocab_size, int(rng.integers(3, 20))).tolist()
                )
        m, sm = e.cache.metrics, e.swa.metrics
        assert all(tiers.values()), tiers
        assert m.evicted_device_tokens and m.evicted_host_tokens and sm.tombstoned_tokens, (m, sm)
        e.flush()
        e.cache.reset()
        for alloc in (e.device_pool.allocator, e.swa_pool.allocator, e.cache.host_allocator, e.swa.host_allocator):
            assert alloc.available == alloc.num_pages, alloc
    finally:
        e.close()
