"""The EAGLE-style draft head over its paged pool, against whole-sequence forwards.

* ``PagedRunner.step_all`` returns, for every new position, the logits and hidden states a
  dense causal forward computes (prefix cached by an earlier step or not).
* ``DraftRunner.step``: the extend pass writes the draft KV a dense draft forward implies,
  and its chain of proposals is the one a dense re-computation gives when each step feeds the
  previous guess and the draft's own feature.
* Saved weights load back bit for bit; a wrong file is refused with the parameter's name.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from hicache_jax.reference_model import ModelConfig, PagedRunner
from hicache_jax.reference_model.dense import draft_forward, target_forward
from hicache_jax.reference_model.draft import DraftHead, DraftRunner, draft_kv_geometry
from hicache_jax.reference_model.weights import TOY_PAIR_PATH, flat_params, load_pair, save_pair

PAGES = 64
CFG = ModelConfig(vocab_size=64, num_layers=2, hidden=32, num_heads=4, num_kv_heads=2, head_dim=8, ffn=64)


def _pools(geom):
    return {
        c: [jnp.zeros((PAGES,) + geom.page_shape, jnp.dtype(geom.numpy_dtype())) for _ in range(geom.num_layers)]
        for c in geom.components
    }


@pytest.mark.parametrize("attention", ["mha", "mla"])
def test_step_all_matches_the_dense_forward(attention):
    cfg = ModelConfig(**{**CFG.__dict__, "attention": attention})
    page = 4
    runner = PagedRunner(cfg, page)
    toks = np.random.default_rng(0).integers(0, cfg.vocab_size, 23)
    table = np.arange(3, 3 + PAGES // 2)[::-1].copy()  # pages out of order
    pools = _pools(cfg.kv_geometry(page))
    _, _, pools = runner.step_all(pools, [toks[:9].tolist()], [0], [table])  # a cached prefix
    logits, hidden, _ = runner.step_all(pools, [toks[9:].tolist()], [9], [table])
    f, lg = target_forward(runner.model, jnp.asarray(toks[None]))
    np.testing.assert_allclose(hidden[0, :14], np.asarray(f[0, 9:]), rtol=2e-4, atol=2e-5)
    np.testing.assert_allclose(logits[0, :14], np.asarray(lg[0, 9:]), rtol=2e-4, atol=2e-4)
    # ``step`` returns the last position's logits of the same program.
    last, _ = runner.step(_pools(cfg.kv_geometry(page)), [toks.tolist()], [0], [table])
    np.testing.assert_allclose(last[0], np.asarray(lg[0, -1]), rtol=2e-4, atol=2e-4)


def test_step_all_on_a_hybrid_model_matches_the_dense_forward():
    """Sliding-window layers: ``step_all`` over both pools, and the dense forward's banded mask."""
    cfg = ModelConfig(**{**CFG.__dict__, "layer_types": "SF", "sliding_window": 6})
    page = 4
    runner = PagedRunner(cfg, page)
    toks = np.random.default_rng(2).integers(0, cfg.vocab_size, 21)
    table = np.arange(PAGES // 2)
    swa_table = np.arange(PAGES // 2)[::-1].copy()
    pools, swa = _pools(cfg.kv_geometry(page)), _pools(cfg.swa_kv_geometry(page))
    _, _, pools, swa = runner.step_all(
        pools, [toks[:10].tolist()], [0], [table], swa_pools=swa, swa_page_tables=[swa_table]
    )
    logits, hidden, _, _ = runner.step_all(
        pools, [toks[10:].tolist()], [10], [table], swa_pools=swa, swa_page_tables=[swa_table]
    )
    f, lg = target_forward(runner.model, jnp.asarray(toks[None]))
    np.testing.assert_allclose(hidden[0, :11], np.asarray(f[0, 10:]), rtol=2e-4, atol=2e-5)
    np.testing.assert_allclose(logits[0, :11], np.asarray(lg[0, 10:]), rtol=2e-4, atol=2e-4)


@pytest.mark.parametrize("attention,page", [("mha", 1), ("mla", 4)])
def test_draft_extend_and_chain_match_the_dense_draft(attention, page):
    cfg = ModelConfig(**{**CFG.__dict__, "attention": attention})
    runner = PagedRunner(cfg, page)
    draft = DraftRunner(runner, DraftHead(cfg))
    rng = np.random.default_rng(1)
    toks = rng.integers(0, cfg.vocab_size, 30)
    f, _ = target_forward(runner.model, jnp.asarray(toks[None]))
    f = np.asarray(f[0])
    table = rng.permutation(PAGES)[: PAGES // 2]
    pools = _pools(draft_kv_geometry(cfg, page))
    k = 4
    # Extend over positions 0..28 in two passes (the first as a "cached" prefix), then chain.
    _, pools = draft.step(pools, [toks[1:12].tolist()], [f[:11]], [0], [table], 0)
    props, pools = draft.step(pools, [toks[12:30].tolist()], [f[11:29]], [11], [table], k)
    # Dense: the guess at position 28 is d_1; each chain step appends (d_i, g of the previous
    # position) one position further.
    nxt, feats = list(toks[1:30]), [x for x in f[:29]]
    want = []
    for _ in range(k):
        g, lg = draft_forward(draft.head, runner.model, jnp.asarray([nxt]), jnp.asarray(np.stack(feats)[None]))
        d = int(np.argmax(np.asarray(lg[0, -1])))
        want.append(d)
        nxt.append(d)
        feats.append(np.asarray(g[0, -1]))
    assert props[0].tolist() == want
    # The extend pass wrote exactly the KV of the dense draft at positions 0..28 (the chain's
    # provisional entries lie beyond).
    geom = draft_kv_geometry(cfg, page)
    h = draft.head.block.norm1(
        draft.head.inputs(runner.model, jnp.asarray(toks[None, 1:30]), jnp.asarray(f[None, :29]))
    )
    kv = draft.head.block.attn.project_kv(h, jnp.arange(29)[None])
    for c in geom.components:
        got = np.asarray(pools[c][0])[table[np.arange(29) // page], np.arange(29) % page]
        np.testing.assert_allclose(got, np.asarray(kv[c][0]), rtol=2e-4, atol=2e-5)


def test_draft_step_validates_its_inputs():
    runner = PagedRunner(CFG, 4)
    draft = DraftRunner(runner)
    pools = _pools(draft_kv_geometry(CFG, 4))
    feats = np.zeros((3, CFG.hidden), np.float32)
    with pytest.raises(ValueError, match="features\\[0\\]"):
        draft.step(pools, [[1, 2, 3]], [feats[:2]], [0], [np.arange(4)], 2)
    with pytest.raises(ValueError, match="do not cover"):  # 3 tokens + 3 chain positions > 1 page of 4
        draft.step(pools, [[1, 2, 3]], [feats], [0], [np.arange(1)], 4)
    with pytest.raises(ValueError, match="num_proposals"):
        draft.step(pools, [[1, 2, 3]], [feats], [0], [np.arange(4)], -1)


def test_saved_pair_loads_back_bit_for_bit(tmp_path):
    from hicache_jax.reference_model import Transformer

    target, head = Transformer(CFG), DraftHead(CFG)
    path = tmp_path / "pair.npz"
    size = save_pair(path, target, head, {"note": "test"})
    assert size < 200_000
    pair = load_pair(path)
    assert pair.config == CFG and pair.meta == {"note": "test"}
    for model, loaded in ((target, pair.target()), (head, pair.draft())):
        want, got = flat_params(model), flat_params(loaded)
        assert want.keys() == got.keys()
        for name in want:  # stored as float16: the loaded model holds exactly the rounded values
            np.testing.assert_array_equal(got[name], want[name].astype(np.float16).astype(np.float32))
    # Another config's file is refused, naming a parameter.
    other = ModelConfig(**{**CFG.__dict__, "ffn": 32})
    bad = tmp_path / "bad.npz"
    save_pair(bad, Transformer(other), DraftHead(other))
    raw = dict(np.load(bad))
    raw["config"] = np.array(np.load(path)["config"])
    np.savez(bad, **raw)
    with pytest.raises(ValueError, match="has shape"):
        load_pair(bad)


def test_the_checked_in_toy_pair_is_small_and_loads():
    assert TOY_PAIR_PATH.stat().st_size < 400_000
    pair = load_pair()
    assert pair.meta["script"] == "scripts/train_spec_pair.py"
    assert pair.config.vocab_size == 64
