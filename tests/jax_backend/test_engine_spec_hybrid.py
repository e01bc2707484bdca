"""Speculative decoding of a hybrid (full + sliding-window) target in the reference engine.

* Exactness: the tokens equal plain greedy decoding (a plain hybrid engine, ``use_cache=False``)
  without the cache, cold, and with the prefix served from L1, L2 and L3 (a new engine on the
  same storage); before every hit the free pages of all three device pools (full, SWA, draft)
  are NaN, so a step that read a page the cache did not fill, or a verify position given the
  wrong SWA page, changes the tokens. The hit's pages (full and draft pages of the prefix, the
  SWA pages of the window before its end) are byte for byte those the first engine computed.
* The window slides during speculative decoding: the SWA pages a request holds at every target
  step (its key's, then the look-ahead pages of the positions a verify writes past the key)
  stay within one window plus the look-ahead, however long the decode; nothing is left
  allocated after a run without the cache; the smallest SWA pool the engine accepts
  (``swa_pages_needed`` with ``spec``) serves a batch with every window evicted and reloaded.

The engines share one cache configuration (page 8, chunk 16), so the compiled steps are shared.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from hicache_jax.engine import Engine, EngineCacheConfig, SpecConfig
from hicache_jax.reference_model import HYBRID_TINY, swa_first_needed_page, swa_table_width
from hicache_jax.storage.config import StorageConfig

W = HYBRID_TINY.sliding_window  # 24: W - 1 = 23 ends inside a page of 8
PAGE, K, NEW = 8, 3, 12
CFG = EngineCacheConfig(page_size=PAGE, device_pages=96, max_batch=4, prefill_chunk=16, max_context=160)
SPEC = SpecConfig(num_draft_tokens=K)


def _aligned(n: int) -> int:
    return n - n % PAGE


def _prompts(seed: int, lengths=(50, 61, 45)) -> list[list[int]]:
    """Prompts behind a shared 24-token prefix, ending mid-page."""
    rng = np.random.default_rng(seed)
    system = rng.integers(0, HYBRID_TINY.vocab_size, 24).tolist()
    return [system + rng.integers(0, HYBRID_TINY.vocab_size, n - 24).tolist() for n in lengths]


_MANY = _prompts(1) + _prompts(2) + _prompts(3)
LONG_PROMPT, LONG_NEW = _prompts(5, (70,))[0], 80  # five prefill chunks, over three windows of decode


@pytest.fixture(scope="module")
def plain_tokens():
    """Plain greedy decoding (no speculation, no cache) of the prompts both tests use."""
    engine = Engine(HYBRID_TINY, CFG)
    try:
        many = [r.tokens for r in engine.generate(_MANY, NEW, use_cache=False)]
        return {
            "tiers": many[:3],
            "many": many,
            "long": engine.generate([LONG_PROMPT], LONG_NEW, use_cache=False)[0].tokens,
        }
    finally:
        engine.close()


def _poison_free_pages(engine: Engine) -> None:
    """NaN into every free page of the full, SWA and draft device pools (the draft pool's
    pages are the full pool's ids)."""
    full_free = np.flatnonzero(~engine.device_pool.allocator.is_allocated(np.arange(engine.device_pool.num_pages)))
    swa = engine.swa_pool
    swa_free = np.flatnonzero(~swa.allocator.is_allocated(np.arange(swa.num_pages)))
    for pool, free in ((engine.device_pool, full_free), (engine.spec.device_pool, full_free), (swa, swa_free)):
        if free.size:
            shape = (pool.geom.num_layers, free.size) + pool.geom.page_shape
            pool.write_pages(free, {c: np.full(shape, np.nan, np.float32) for c in pool.geom.components})


def _prefix_kv(engine: Engine, prompt: list[int], hit: int, page: int = PAGE) -> dict:
    """The bytes of the cached prefix (``hit`` positions of the prompt's pair keys) as the tree
    hands it out: full and draft pages of the whole prefix, SWA pages of the window before its end."""
    req, lb = engine.cache.begin_request(engine.spec.key(np.asarray(prompt), hit), load_back=False)
    try:
        assert lb is None and req.device_pages.shape[0] * page == hit, (req.device_pages.shape, hit)
        out = {}
        for name, pool in (("full", engine.device_pool), ("draft", engine.spec.device_pool)):
            out.update({(name, c): pool.read_pages_host(c, req.device_pages) for c in pool.geom.components})
        window = req.component_pages["swa"][swa_first_needed_page(hit, W, page) :]
        assert (window >= 0).all(), f"the tree holds no SWA page for part of the window: {window}"
        out.update({("swa", c): engine.swa_pool.read_pages_host(c, window) for c in engine.swa_pool.geom.components})
        return out
    finally:
        engine.cache.dec_lock_ref(req.last_node)


def _assert_same_bytes(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=str(k))


def _serve(engine: Engine, prompts, tier: str, want: list) -> list:
    _poison_free_pages(engine)
    res = engine.generate(prompts, NEW)
    assert [r.tokens for r in res] == want, tier
    for r in res:
        assert r.cached_total == _aligned(r.prompt_len - 1), (tier, r.cached_tokens)
        assert r.accept_lengths and r.prefill_tokens == r.prompt_len - r.cached_total
    # The first prompt's prefix comes from the tier itself; the others may find the shared
    # prefix's full pages on the device after it.
    assert res[0].cached_tokens[tier] == _aligned(len(prompts[0]) - 1), (tier, res[0].cached_tokens)
    engine.cache.sanity_check(0, {"swa": 0})
    return res


def test_tokens_equal_plain_greedy_from_every_tier_with_the_pages_byte_exact(plain_tokens, tmp_path):
    want = plain_tokens["tiers"]
    prompts = _prompts(1)
    l3 = StorageConfig(
        backend="file", path=str(tmp_path / "l3"), prefetch_policy="wait_complete", prefetch_threshold_tokens=PAGE
    )
    cfg = replace(CFG, storage=l3)
    engine = Engine(HYBRID_TINY, cfg, spec=SPEC)
    fresh = None
    try:
        assert [r.tokens for r in engine.generate(prompts, NEW, use_cache=False)] == want
        assert engine.swa_pool.allocator.used == 0 and engine.device_pool.allocator.used == 0
        assert [r.tokens for r in engine.generate(prompts, NEW)] == want  # cold, then cached
        hits = [_aligned(len(p) - 1) for p in prompts]
        computed = [_prefix_kv(engine, p, h) for p, h in zip(prompts, hits)]
        _serve(engine, prompts, "device", want)
        for p, h, b in zip(prompts, hits, computed):
            _assert_same_bytes(_prefix_kv(engine, p, h), b)
        engine.flush()
        engine.evict_device_cache()
        assert engine.device_pool.allocator.used == 0 and engine.swa_pool.allocator.used == 0
        loaded = engine.swa.metrics.loaded_tokens
        _serve(engine, prompts, "host", want)
        assert engine.swa.metrics.loaded_tokens > loaded  # the windows came back from the host
        for p, h, b in zip(prompts, hits, computed):
            _assert_same_bytes(_prefix_kv(engine, p, h), b)
        engine.flush()
        engine.close()
        fresh = Engine(HYBRID_TINY, cfg, spec=SPEC)
        _serve(fresh, prompts, "storage", want)
        for p, h, b in zip(prompts, hits, computed):
            _assert_same_bytes(_prefix_kv(fresh, p, h), b)
    finally:
        engine.close()
        if fresh is not None:
            fresh.close()


def _count_target_steps(engine: Engine) -> list:
    """Wrap the target's step: per call, the token counts and the SWA pages each sequence's
    table holds (its own and look-ahead ones), and the SWA pool's allocated pages."""
    calls = []
    runner = engine.spec.runner
    step_all = runner.step_all

    def counting(pools, tokens, starts, tables, *a, **kw):
        held = [int((np.asarray(t) >= 0).sum()) for t in kw["swa_page_tables"]]
        calls.append(([len(t) for t in tokens], held, engine.swa_pool.allocator.used))
        return step_all(pools, tokens, starts, tables, *a, **kw)

    runner.step_all = counting
    return calls


@pytest.mark.parametrize("use_cache", [False, True])
def test_the_window_slides_during_speculative_decoding(plain_tokens, use_cache):
    """A 70-token prompt decoding 80 tokens: the SWA pages a request holds stay within one
    step's window - a prefill chunk's (``swa_table_width``), then its key's window plus the
    verify's look-ahead, at most ``ceil((W - 1) / page) + 1 + ceil(k / page)`` (plus one tree
    window while the window still reaches into the tree's part, with the cache) - while its
    full pages grow with the sequence."""
    engine = Engine(HYBRID_TINY, CFG, spec=SPEC)
    try:
        prompt = LONG_PROMPT
        if use_cache:  # a first turn: the second's window starts in the tree (its lock holds it)
            engine.generate([prompt], 2)
        calls = _count_target_steps(engine)
        r = engine.generate([prompt], LONG_NEW, use_cache=use_cache)[0]
        assert r.tokens == plain_tokens["long"]
        tree_window = -(-(W - 1) // PAGE)
        bound = tree_window + 1 + -(-K // PAGE)
        extra = tree_window if use_cache else 0
        prefill = [held[0] for lens, held, _used in calls if lens != [K + 1]]
        assert len(prefill) == -(-(len(prompt) - r.cached_total) // CFG.prefill_chunk)
        assert max(prefill) <= swa_table_width(W, CFG.prefill_chunk, PAGE) + extra  # the window slid per chunk
        verify = [held[0] for lens, held, _used in calls if lens == [K + 1]]
        assert len(verify) == len(r.accept_lengths) > 4 * bound
        assert max(verify) <= bound + extra
        assert max(verify[len(verify) // 2 :]) <= bound  # long past the prompt: the window only
        pages = -(-(len(prompt) + LONG_NEW) // PAGE)
        assert pages > 3 * bound  # without the slide the SWA pages would grow as these
        if not use_cache:  # the request's SWA pages are all the pool has allocated
            assert all(used == held[0] for _l, held, used in calls)
            assert engine.metrics.peak_swa_device_pages == max(used for *_x, used in calls)
            assert engine.swa_pool.allocator.used == 0 and engine.device_pool.allocator.used == 0
        engine.cache.sanity_check(0, {"swa": 0})
    finally:
        engine.close()


def test_the_smallest_swa_pool_serves_a_batch_of_speculative_requests(plain_tokens):
    """``swa_pages_needed(..., spec)`` counts a decoding request's look-ahead: an engine with
    exactly that SWA pool serves nine requests, four at a time, twice (evicting cached windows
    as it must), tokens exact; one page less is refused."""
    need = Engine.swa_pages_needed(HYBRID_TINY, CFG, SPEC)
    assert need - Engine.swa_pages_needed(HYBRID_TINY, CFG) == (CFG.max_batch - 1) * -(-K // PAGE)
    with pytest.raises(ValueError, match="swa_device_pages"):
        Engine(HYBRID_TINY, replace(CFG, swa_device_pages=need - 1), spec=SPEC)
    engine = Engine(HYBRID_TINY, replace(CFG, swa_device_pages=need), spec=SPEC)
    try:
        for _round in range(2):
            res = engine.generate(_MANY, NEW)
            assert [r.tokens for r in res] == plain_tokens["many"]
            engine.cache.sanity_check(0, {"swa": 0})
        assert engine.swa.metrics.tombstoned_tokens or engine.swa.metrics.leaf_evictions
    finally:
        engine.close()


def test_warmup_compiles_every_step_a_hybrid_target_serves_with():
    """``Engine.warmup`` compiles the target's steps with the SWA pool (prefill chunks, one-token
    tails, verifies at every batch size) and the draft's rounds: serving a batch cold and then
    from the cache (a prompt whose uncached tail is one token) compiles nothing more."""
    from hicache_jax.reference_model.draft import _ROUND
    from hicache_jax.reference_model.paged_forward import _STEP

    cfg = replace(CFG, max_context=152, max_batch=2)  # a table width no other test compiles
    engine = Engine(HYBRID_TINY, cfg, spec=SPEC)
    try:
        before = (_STEP._cache_size(), _ROUND._cache_size())
        engine.warmup()
        compiled = (_STEP._cache_size(), _ROUND._cache_size())
        assert compiled[0] > before[0] and compiled[1] > before[1]
        prompts = _prompts(9, (49, 61))  # 49: the hit covers 48 positions, one token is prefilled
        engine.generate(prompts, NEW)
        res = engine.generate(prompts, NEW)
        assert res[0].prefill_tokens == 1 and res[1].cached_total == _aligned(60)
        assert (_STEP._cache_size(), _ROUND._cache_size()) == compiled
    finally:
        engine.close()


def test_a_copy_failure_mid_decode_is_recovered_with_the_look_ahead_pages_freed(plain_tokens, caplog):
    """A write-through backup that fails after every retry latches ``CacheFailedError`` while
    the requests decode (each holding look-ahead SWA pages): the engine abandons them, frees
    their own pages of all pools (the look-ahead ones included: the reset finds none left
    over), re-admits them and serves plain greedy decoding's tokens."""
    from test_engine_recovery import FailingCopies

    engine = Engine(HYBRID_TINY, CFG, spec=SPEC)
    try:
        failing = FailingCopies(engine)
        failing.arm("backup", 1)  # the first prompt's, issued after its prefill
        with caplog.at_level("WARNING", logger="hicache_jax.engine.engine"):
            res = engine.generate(_prompts(1), NEW)
        assert failing.failed["backup"] == 1 + engine.cache.config.transfer_retries
        assert engine.metrics.cache_failures_recovered == 1 and engine.metrics.requests_readmitted >= 1
        assert [r.tokens for r in res] == plain_tokens["tiers"]
        assert "still allocated after a cache reset" not in caplog.text
        engine.flush()
        engine.cache.sanity_check(0, {"swa": 0})
        engine.cache.reset()
        for alloc in (engine.device_pool.allocator, engine.swa_pool.allocator):
            assert alloc.available == alloc.num_pages, alloc
    finally:
        engine.close()


def test_deterministic_mode_pages_of_a_second_turn_equal_a_cold_prefill():
    """Deterministic mode (one fixed step shape): a second turn served on top of the first
    turn's cache (its answer's KV written by verify steps and draft extends, its window slid
    round by round) leaves pages - full and the SWA window - byte for byte those a fresh engine
    computes by prefilling the same conversation cold, draft pages equal to float rounding;
    same tokens. Page 2 < k:
    a verify then writes into two look-ahead pages, and ``sync_key`` must hand the request
    the first (the page of the key's next positions), not any other."""
    page = 2
    cfg = replace(CFG, page_size=page, device_pages=320, deterministic=True, deterministic_step_tokens=8)
    first = _prompts(4, (37, 44))
    warm = Engine(HYBRID_TINY, cfg, spec=SPEC)
    cold = None
    try:
        answers = warm.generate(first, NEW)
        rng = np.random.default_rng(4)
        second = [f + r.tokens + rng.integers(0, HYBRID_TINY.vocab_size, 7).tolist() for f, r in zip(first, answers)]
        got = warm.generate(second, NEW)
        assert all(r.cached_total == (len(f) + NEW - 1) // page * page for f, r in zip(first, got))
        cold = Engine(HYBRID_TINY, cfg, spec=SPEC)
        want = cold.generate(second, NEW, use_cache=False)
        cold.generate(second, NEW)  # cached now, computed from scratch
        assert [r.tokens for r in got] == [r.tokens for r in want]
        for q in second:
            hit = (len(q) - 1) // page * page
            got_kv, want_kv = _prefix_kv(warm, q, hit, page), _prefix_kv(cold, q, hit, page)
            # The draft head keeps its bucketed shapes in deterministic mode (docs/exactness.md):
            # a verify round's extend and a prefill chunk's run other matmul shapes, so its KV may
            # differ in the last bits (jax 0.12.1: 282 of 1,728 values of one page, relative
            # 3.7e-7; equal on 0.11.2). The full and SWA pages are the contract: byte-exact.
            for c in ("k", "v"):
                g, w = (np.asarray(x).view(np.float32) for x in (got_kv.pop(("draft", c)), want_kv.pop(("draft", c))))
                np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6, err_msg=f"draft {c}")
            _assert_same_bytes(got_kv, want_kv)
    finally:
        warm.close()
        if cold is not None:
            cold.close()
