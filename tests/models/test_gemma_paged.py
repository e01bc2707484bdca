"""The paged Gemma 3 family (``models.gemma3.paged``) against the plain forward (``model.py``,
itself checked against transformers), on a small random checkpoint of Gemma 3's structure:
every position's logits, prefilled in chunks over the hybrid pools (sliding layers' KV in the
SWA pool, read through the window ring) and over the full pool only (``swa_as_full``, windows
kept); the engine's greedy tokens equal to the plain model's with and without cache hits.

Fast (random weights, tiny shapes); the real checkpoint is served in ``test_gemma_served.py``.
"""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

from hicache_jax.models.gemma3 import Gemma3Config  # noqa: E402
from hicache_jax.models.gemma3 import model as gm  # noqa: E402
from hicache_jax.models.gemma3.paged import Gemma3Transformer, model_config, random_weights  # noqa: E402
from hicache_jax.reference_model import PagedRunner  # noqa: E402

PAGE, WINDOW = 4, 8
SMALL = Gemma3Config(
    vocab_size=300,
    hidden_size=64,
    intermediate_size=128,
    num_layers=4,
    num_heads=4,
    num_kv_heads=1,
    head_dim=32,
    max_position_embeddings=4096,
    rms_norm_eps=1e-6,
    sliding_window=WINDOW,
    layer_types=("sliding", "sliding", "full", "sliding"),
    rope_theta_global=1_000_000.0,
    rope_theta_local=10_000.0,
    query_pre_attn_scalar=32.0,
)


def _plain_logits(w, tokens: list[int]) -> np.ndarray:
    cache = gm.init_cache(w.gemma, 1, len(tokens))
    h, _ = gm.forward(w.params, jnp.asarray([tokens], jnp.int32), jnp.zeros((1,), jnp.int32), cache, cfg=w.gemma)
    return np.asarray(gm.lm_head(w.params, h[0], w.gemma))


def _zeros(geom, pages: int):
    return {
        c: [jnp.zeros((pages,) + geom.page_shape, jnp.dtype(geom.numpy_dtype())) for _ in range(geom.num_layers)]
        for c in geom.components
    }


def _paged_logits(w, cfg, tokens: list[int], chunk: int) -> np.ndarray:
    runner = PagedRunner(cfg, PAGE, model=Gemma3Transformer(cfg, w.params))
    pages = -(-len(tokens) // PAGE)
    pools = _zeros(cfg.kv_geometry(PAGE), pages + 1)
    swa = _zeros(cfg.swa_kv_geometry(PAGE), pages + 1) if cfg.is_hybrid else None
    table = np.arange(pages)
    out = []
    for s in range(0, len(tokens), chunk):
        kw = dict(swa_pools=swa, swa_page_tables=[table]) if swa is not None else {}
        logits, _hidden, *new = runner.step_all(pools, [tokens[s : s + chunk]], [s], [table], **kw)
        pools, swa = new[0], (new[1] if swa is not None else None)
        out.append(logits[0, : len(tokens[s : s + chunk])])
    return np.concatenate(out)


@pytest.mark.parametrize("swa_as_full", [False, True])
def test_gemma_paged_step_matches_the_plain_forward(swa_as_full):
    w = random_weights(SMALL, seed=1)
    cfg = model_config(SMALL, swa_as_full=swa_as_full)
    assert cfg.is_hybrid != swa_as_full
    tokens = np.random.default_rng(2).integers(0, SMALL.vocab_size, 37).tolist()  # > 4 windows
    want = _plain_logits(w, tokens)
    for chunk in (37, 5):  # one step, and chunks that start mid-page and mid-window
        got = _paged_logits(w, cfg, tokens, chunk)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    # The window bites: the same weights with a window wider than the prompt differ past it.
    wide = model_config(SMALL.__class__(**{**SMALL.__dict__, "sliding_window": 64}))
    other = _paged_logits(w, wide, tokens, 37)
    assert np.allclose(other[:WINDOW], want[:WINDOW], atol=1e-4)
    assert not np.allclose(other[WINDOW:], want[WINDOW:], atol=1e-2)


def test_gemma_config_maps_the_checkpoint_and_refuses_what_it_cannot_run():
    cfg = model_config(SMALL)
    assert cfg.family == "gemma3" and cfg.swa_layers == (0, 1, 3) and cfg.full_layers == (2,)
    assert cfg.rope_theta == 1_000_000.0 and cfg.rope_theta_local == 10_000.0
    assert cfg.attention_window(0) == WINDOW and cfg.attention_window(2) is None
    assert model_config(SMALL, swa_as_full=True).attention_window(0) == WINDOW  # a real model keeps its window
    with pytest.raises(ValueError, match="soft-capping"):
        model_config(SMALL.__class__(**{**SMALL.__dict__, "final_logit_softcapping": 30.0}))
    with pytest.raises(ValueError, match="model: required for family 'gemma3'"):
        PagedRunner(cfg, PAGE)


def test_gemma_engine_tokens_equal_the_plain_greedy_with_every_tier(tmp_path):
    """Conversations: each round re-sends the history (prompt + answer) and a new turn, served
    from device, then host (device evicted), then storage (both evicted): with a sliding
    window the cache keeps each conversation's last window, which is what the next turn needs."""
    from hicache_jax.engine import Engine, EngineCacheConfig
    from hicache_jax.host_pool import HostPoolConfig
    from hicache_jax.storage.config import StorageConfig

    w = random_weights(SMALL, seed=3)
    rng = np.random.default_rng(4)
    shared = rng.integers(0, SMALL.vocab_size, 22).tolist()
    histories = [shared + rng.integers(0, SMALL.vocab_size, n).tolist() for n in (3, 9, 14)]
    cache = EngineCacheConfig(
        page_size=PAGE,
        device_pages=96,
        host=HostPoolConfig(ratio=4.0),
        max_batch=2,
        prefill_chunk=8,
        max_context=128,
        storage=StorageConfig(
            backend="file", path=str(tmp_path / "l3"), prefetch_policy="wait_complete", prefetch_threshold_tokens=PAGE
        ),
    )
    engine = Engine(w.config, cache, weights=w)
    try:
        want = gm.greedy_generate_many(w.params, w.gemma, histories, 6, bucket=1)
        assert [r.tokens for r in engine.generate(histories, 6, use_cache=False)] == want
        for tier in ("first", "device", "host", "storage"):
            if tier != "first":  # the next turn of every conversation
                histories = [h + out + rng.integers(0, SMALL.vocab_size, 5).tolist() for h, out in zip(histories, want)]
                want = gm.greedy_generate_many(w.params, w.gemma, histories, 6, bucket=1)
            if tier in ("host", "storage"):
                engine.flush()
                engine.evict_device_cache()
            if tier == "storage":
                engine.evict_host_cache()
            got = engine.generate(histories, 6)
            assert [r.tokens for r in got] == want, tier
            if tier != "first":
                for r, h in zip(got, histories):  # the previous turn came from the cache, this tier among others
                    assert r.cached_tokens[tier] > 0 and r.cached_total >= len(h) - 5 - PAGE, (tier, r.cached_tokens)
        # Stop tokens: each request ends at the first one it emits, which it returns.
        stop = {want[0][2]}
        got = engine.generate(histories, 6, stop_tokens=sorted(stop))
        for r, full in zip(got, want):
            cut = next((i + 1 for i, t in enumerate(full) if t in stop), len(full))
            assert r.tokens == full[:cut]
        with pytest.raises(ValueError, match="stop_tokens"):
            engine.generate(histories, 6, stop_tokens=[SMALL.vocab_size])
    finally:
        engine.close()
    with pytest.raises(ValueError, match="weights: required for model family 'gemma3'"):
        Engine(w.config, cache)
    with pytest.raises(ValueError, match="max_context 4097 exceeds the model's context of 4096 positions"):
        Engine(w.config, EngineCacheConfig(page_size=PAGE, max_context=4097), weights=w)


def test_gemma_greedy_continue_many_from_caller_prefills_equals_greedy_generate_many():
    """The oracle test decodes from the caches its teacher-forced prefills left: that must give
    the tokens a whole-sequence forward per token gives (and ``greedy_generate_many`` the same);
    bad ``started`` entries are refused."""
    w = random_weights(SMALL, seed=5)
    rng = np.random.default_rng(6)
    prompts = [rng.integers(0, SMALL.vocab_size, n).tolist() for n in (3, 11, 17)]
    want = []  # independently: a whole-sequence forward per token, no decode step, no cache reuse
    for p in prompts:
        seq = list(p)
        for _ in range(7):
            h, _ = gm.prefill_padded(w.params, w.gemma, seq, gm.init_cache(w.gemma, 1, 32), 8)
            logits = np.array(gm.lm_head_jit(w.params, h[-1:], cfg=w.gemma))[0]
            logits[1] = -np.inf
            seq.append(int(logits.argmax()))
        want.append(seq[len(p) :])
    assert gm.greedy_generate_many(w.params, w.gemma, prompts, 7, suppress_ids=(1,), cache_len=32, bucket=8) == want

    def started(cache_len=32):
        out = []
        for p in prompts:
            h, cache = gm.prefill_padded(w.params, w.gemma, p, gm.init_cache(w.gemma, 1, cache_len), 8)
            out.append((h[len(p) - 1], cache, len(p)))
        return out

    assert gm.greedy_continue_many(w.params, w.gemma, started(), 7, suppress_ids=(1,)) == want
    assert all(1 not in row for row in want)
    with pytest.raises(ValueError, match="started: expected at least one"):
        gm.greedy_continue_many(w.params, w.gemma, [], 7)
    with pytest.raises(ValueError, match="max_new_tokens: expected >= 1"):
        gm.greedy_continue_many(w.params, w.gemma, started(), 0)
    with pytest.raises(ValueError, match=r"started\[2\]: 17 tokens \+ 16 new do not fit 32"):
        gm.greedy_continue_many(w.params, w.gemma, started(), 16)
    mixed = started()[:2] + started(cache_len=40)[2:]
    with pytest.raises(ValueError, match=r"started\[2\]: expected a one-row cache of 32 positions"):
        gm.greedy_continue_many(w.params, w.gemma, mixed, 7)
