"""The reference model over a paged pool: a cached prefix gives the same tokens as a cold run."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from hicache_jax.reference_model import ModelConfig, PagedRunner

POOL_PAGES = 200


def _pools(cfg: ModelConfig, page: int):
    g = cfg.kv_geometry(page)
    return {
        c: [jnp.zeros((POOL_PAGES,) + g.page_shape, jnp.dtype(g.numpy_dtype())) for _ in range(g.num_layers)]
        for c in g.components
    }


def _greedy(runner: PagedRunner, prompts, splits, new_tokens=6, page_tables=None):
    """Greedy-decode all prompts as one batch; each prompt's prefill is split at ``splits[i]``."""
    pools = _pools(runner.config, runner.page_size)
    per = POOL_PAGES // len(prompts)
    tables = page_tables or [np.arange(i * per, (i + 1) * per) for i in range(len(prompts))]
    logits = []
    for p, s, tab in zip(prompts, splits, tables):
        if s:
            _, pools = runner.step(pools, [p[:s]], [0], [tab])
        lg, pools = runner.step(pools, [p[s:]], [s], [tab])
        logits.append(lg[0])
    cur = [len(p) for p in prompts]
    outs = [[] for _ in prompts]
    for _ in range(new_tokens):
        nxt = [int(np.argmax(lg)) for lg in logits]
        for o, t in zip(outs, nxt):
            o.append(t)
        lgs, pools = runner.step(pools, [[t] for t in nxt], cur, tables)
        logits = list(lgs)
        cur = [c + 1 for c in cur]
    return outs


@pytest.mark.parametrize("attention", ["mha", "mla"])
@pytest.mark.parametrize("page", [1, 16])
def test_prefix_split_and_batching_give_identical_tokens(attention, page):
    cfg = ModelConfig(attention=attention, num_layers=2)
    runner = PagedRunner(cfg, page)
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(0, cfg.vocab_size, n)) for n in (37, 20, 50)]
    cold = _greedy(runner, prompts, [0, 0, 0])
    cached = _greedy(runner, prompts, [32, 16, 48])  # prefix "cached" by an earlier step
    assert cold == cached
    solo = [_greedy(runner, [p], [0])[0] for p in prompts]
    assert solo == cold
    assert len({tuple(o) for o in cold}) > 1  # the model is not degenerate


def test_page_size_does_not_change_tokens():
    cfg = ModelConfig()
    rng = np.random.default_rng(1)
    prompts = [list(rng.integers(0, cfg.vocab_size, 45))]
    assert _greedy(PagedRunner(cfg, 1), prompts, [0]) == _greedy(PagedRunner(cfg, 16), prompts, [0])


def test_same_seed_same_model_other_seed_other_tokens():
    rng = np.random.default_rng(2)
    prompts = [list(rng.integers(0, 512, 30))]
    a = _greedy(PagedRunner(ModelConfig(seed=0), 4), prompts, [0])
    b = _greedy(PagedRunner(ModelConfig(seed=0), 4), prompts, [0])
    c = _greedy(PagedRunner(ModelConfig(seed=1), 4), prompts, [0])
    assert a == b and a != c


def test_pool_pages_outside_the_table_are_untouched():
    cfg = ModelConfig()
    runner = PagedRunner(cfg, 4)
    pools = _pools(cfg, 4)
    poison = {c: [jnp.full_like(a, 7.0) for a in layers] for c, layers in pools.items()}
    _, new = runner.step(poison, [[1, 2, 3, 4, 5]], [0], [np.array([10, 11])])
    for _c, layers in new.items():
        for a in layers:
            a = np.asarray(a)
            assert (a[np.r_[0:10, 12:POOL_PAGES]] == 7.0).all()
            assert not (a[10] == 7.0).all()


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        (dict(attention="gqa"), ValueError, "attention"),
        (dict(num_heads=3, num_kv_heads=2), ValueError, "num_kv_heads"),
        (dict(hidden=0), ValueError, "hidden"),
        (dict(kv_dtype="int4"), ValueError, "dtype"),
        (dict(num_layers=2.0), TypeError, "num_layers"),
    ],
)
def test_config_validation(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        ModelConfig(**kwargs)


def test_step_rejects_short_page_table():
    runner = PagedRunner(ModelConfig(), 4)
    with pytest.raises(ValueError, match="page_tables"):
        runner.step(_pools(runner.config, 4), [[1] * 9], [0], [np.array([0, 1])])


def test_steps_never_hash_the_model_graph_and_equal_models_share_one_static_graph(monkeypatch):
    """jit hashes its static arguments on every call; an nnx GraphDef's hash walks the whole
    module tree (milliseconds per step). The runner passes a ``StaticGraph`` hashed once, and
    equal models intern to the same object (jit's cache lookup compares by identity)."""
    cfg = ModelConfig(num_layers=2)
    runner = PagedRunner(cfg, 4)
    assert PagedRunner(cfg, 4).static_graph is runner.static_graph
    assert PagedRunner(ModelConfig(num_layers=3), 4).static_graph != runner.static_graph
    pools = _pools(cfg, 4)
    _, pools = runner.step(pools, [[1, 2, 3]], [0], [np.arange(4)])  # compiled (hashes while tracing)
    calls = []
    graph_type = type(runner.graphdef)
    real_hash = graph_type.__hash__
    monkeypatch.setattr(graph_type, "__hash__", lambda self: calls.append(1) or real_hash(self))
    for start in (3, 4, 5):
        _, pools = runner.step(pools, [[7]], [start], [np.arange(4)])
    assert calls == []
