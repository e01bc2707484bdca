"""L3 hits after a node split, end to end through the engine (issue 28 point 1).

A new engine restores a prompt from L3 (its pages attached as one tree leaf with the keys they
were read under); a later prompt splits that leaf; a third prompt then continues *from the
split's lower half* into pages only the storage holds. Its L3 hit must cover what a fresh
engine gets from the same storage: the expectation is measured independently, by a fresh
engine on a copy of the L3 directory taken before the split (it serves the same prompts, so it
writes what the engine under test writes), not by the code under test.

Every storage pool is keyed by its own chain of page digests; after a split each pool's chain
must be cut at the same page. With only the first pool cut (the bug: the trim re-read the
first pool's length inside its loop) the ``swa`` / ``draft`` pools chain from the wrong page and
find nothing: the tokens stay right (the prefix is recomputed) but the hit is lost. Seen
failing that way: (a) B gets 0 and C 50 instead of 115 and 95; (b) C gets 84 host + 0 storage.

Cases: (a) a hybrid model (layer pattern "SSF", window 37, page 5, prefill chunk 13: the
``swa`` pool); (b) speculative decoding (the ``draft`` pool, page 7); (c) the same prompts on a
plain target-only cache (one pool: the regression guard for the rule itself).
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from hicache_jax.engine import Engine, EngineCacheConfig, SpecConfig
from hicache_jax.reference_model import ModelConfig
from hicache_jax.storage.config import StorageConfig

NEW = 4
HYBRID = ModelConfig(
    vocab_size=128,
    num_layers=3,
    hidden=32,
    num_heads=2,
    num_kv_heads=1,
    head_dim=16,
    ffn=64,
    layer_types="SSF",
    sliding_window=37,
)
DENSE = ModelConfig(vocab_size=64, num_layers=2, hidden=32, num_heads=4, num_kv_heads=2, head_dim=8, ffn=64)


def _config(path, page: int, chunk: int) -> EngineCacheConfig:
    l3 = StorageConfig(backend="file", path=str(path), prefetch_policy="wait_complete", prefetch_threshold_tokens=page)
    return EngineCacheConfig(
        page_size=page, device_pages=120, max_batch=2, prefill_chunk=chunk, max_context=200, storage=l3
    )


def _serve(engine: Engine, prompt: list[int]):
    r = engine.generate([prompt], NEW)[0]
    engine.cache.sanity_check(0, {"swa": 0} if engine.swa is not None else None)
    return r


def _split_then_continue(tmp_path, model, page, chunk, spec, first, a, b, c):
    """Engine 1 serves ``first`` (the history: every prompt's pages go to L3). Engine 2 (new, same
    directory) restores ``a`` from L3, serves ``b`` (splits ``a``'s leaf), empties the device and
    serves ``c``. A fresh engine on a copy of the directory taken after ``a`` serves ``b`` and,
    with both its tiers emptied, ``c``. Returns (engine 2's results, the fresh engine's)."""
    cfg = _config(tmp_path / "l3", page, chunk)
    e1 = Engine(model, cfg, spec=spec)
    try:
        for p in first:
            _serve(e1, p)
        e1.flush()
    finally:
        e1.close()
    e2 = Engine(model, cfg, spec=spec)
    try:
        ra = _serve(e2, a)
        e2.flush()
        shutil.copytree(tmp_path / "l3", tmp_path / "snapshot")
        rb = _serve(e2, b)
        e2.evict_device_cache()
        rc = _serve(e2, c)
    finally:
        e2.close()
    fresh = Engine(model, _config(tmp_path / "snapshot", page, chunk), spec=spec)
    try:
        fb = _serve(fresh, b)
        fresh.evict_device_cache()
        fresh.evict_host_cache()
        fc = _serve(fresh, c)
    finally:
        fresh.close()
    assert fb.cached_tokens["storage"] == fb.cached_total and fc.cached_tokens["storage"] == fc.cached_total
    assert (rb.tokens, rc.tokens) == (fb.tokens, fc.tokens)  # a lost hit is recomputed: tokens never tell
    return (ra, rb, rc), (fb, fc)


def test_hybrid_swa_pool_hits_after_a_split(tmp_path):
    page = 5
    rng = np.random.default_rng(0)
    new = lambda n: rng.integers(0, HYBRID.vocab_size, n).tolist()  # noqa: E731
    system = new(30)
    turn = system + new(10)
    a = turn + new(13)  # 53 tokens: a follow-up of the first turn
    a2 = a[:50] + new(45)  # continues a at its restored end (past the window: 9 pages)
    x = system + new(85)  # shares only the system prompt with a
    b = x + new(9)  # 124 tokens: x's follow-up, shares 30 tokens with a
    c = a2 + new(2)  # 97 tokens: a2's follow-up, continues from a's split leaf
    (ra, rb, rc), (fb, fc) = _split_then_continue(tmp_path, HYBRID, page, 13, None, [turn, a, a2, x], a, b, c)
    assert ra.cached_tokens == {"device": 0, "host": 0, "storage": 50}
    # The expectation, from the fresh engine: x's stored pages (115 tokens) and a2's (95).
    assert (fb.cached_total, fc.cached_total) == (115, 95)
    assert rb.cached_total == fb.cached_total, rb.cached_tokens
    assert rc.cached_total == fc.cached_total, rc.cached_tokens
    assert rc.cached_tokens["host"] == 50  # a's restored leaf, the split's lower half included


@pytest.mark.parametrize("spec", [SpecConfig(num_draft_tokens=3), None], ids=["draft", "target_only"])
def test_storage_hits_after_a_split_with_and_without_a_draft_pool(spec, tmp_path):
    page = 7
    rng = np.random.default_rng(1)
    new = lambda n: rng.integers(0, DENSE.vocab_size, n).tolist()  # noqa: E731
    a = new(100)
    c = a[:90] + new(20)  # 110 tokens
    b = a[:40] + new(20)  # splits a's restored leaf at page 5 (35 tokens)
    (ra, rb, rc), (fb, fc) = _split_then_continue(tmp_path, DENSE, page, 32, spec, [a, c], a, b, c)
    assert ra.cached_tokens["storage"] == 98  # a: 99 matchable positions (the last token is computed)
    assert fc.cached_total == 105  # 108 or 109 matchable positions of c: 15 pages
    # a's restored leaf, split at page 5, holds c's first 12 pages on the host; the other 3
    # come from storage, continuing from the split's lower half.
    assert rc.cached_tokens == {"device": 0, "host": 84, "storage": 21}
    assert rb.cached_total == fb.cached_total, rb.cached_tokens
