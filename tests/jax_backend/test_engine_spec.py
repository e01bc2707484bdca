"""Speculative decoding in the reference engine, with random weights.

* The tokens are those of plain greedy decoding, cold and with the prefix served from L1, L2
  and L3 (a new engine on the same storage), for page sizes 1 (MLA) and 16 (MHA), with
  prompts that end mid-page and share prefixes.
* The draft's proposals after evict -> L2 -> reload and after restart -> L3 -> reload equal,
  token for token, those of an L1 hit, and the draft pool's bytes for the prefix are the L1
  hit's, even with every free draft page poisoned first; with draft backing off the poison is
  what the draft reads, and its proposals differ (the tokens still do not).
* The pair-key rule, for page sizes 1 and 16 and prompts ending mid-page: a prompt that
  leaves another at a page boundary shares one page less than without speculation (page 1:
  one position less), one that leaves it inside a page shares as much; every draft and target
  entry a hit reads is the one a cold run of the same prompt computes.
* Accept lengths are consistent with the tokens and the verify steps counted at the model,
  and reach the engine stats and Prometheus.
"""

from __future__ import annotations

import numpy as np
import pytest

from hicache_jax.engine import Engine, EngineCacheConfig, SpecConfig
from hicache_jax.reference_model import ModelConfig
from hicache_jax.storage.config import StorageConfig

MODEL = ModelConfig(vocab_size=64, num_layers=2, hidden=32, num_heads=4, num_kv_heads=2, head_dim=8, ffn=64)
K, NEW, MAX_CONTEXT = 3, 10, 128


def _config(page: int, tmp_path=None, **kw) -> EngineCacheConfig:
    storage = None
    if tmp_path is not None:
        storage = StorageConfig(
            backend="file", path=str(tmp_path / "l3"), prefetch_policy="wait_complete", prefetch_threshold_tokens=page
        )
    return EngineCacheConfig(
        **{
            "page_size": page,
            "device_pages": max(48, 768 // page),
            "max_batch": 4,
            "prefill_chunk": 32,
            "max_context": MAX_CONTEXT,
            "storage": storage,
            **kw,
        }
    )


def _prompts(seed: int, lengths=(50, 61, 45)) -> list[list[int]]:
    """Distinct prompts behind a shared 24-token prefix (lengths end mid-page for page 4 and 16)."""
    rng = np.random.default_rng(seed)
    system = rng.integers(0, MODEL.vocab_size, 24).tolist()
    return [system + rng.integers(0, MODEL.vocab_size, n - 24).tolist() for n in lengths]


def _aligned(n: int, page: int) -> int:
    return n - n % page


def _poison_free_draft_pages(engine: Engine, value: int = 0x3F800000) -> int:
    """Write 1.0 (float32 bits) into every free page of the draft pool; returns how many."""
    pool = engine.spec.device_pool
    free = np.flatnonzero(~engine.device_pool.allocator.is_allocated(np.arange(pool.num_pages)))
    for c in pool.geom.components:
        pool.write_pages_host(
            c, free, np.full((pool.geom.num_layers, free.size) + pool.geom.page_shape, value, pool.geom.container_dtype)
        )
    return free.size


def _draft_prefix_bytes(engine: Engine, prompt: list[int]) -> dict[str, np.ndarray]:
    """The draft pool's bytes of the tree's device pages for the prompt's matchable prefix."""
    arr = np.asarray(prompt)
    m = engine.cache.match_prefix(engine.spec.key(arr, arr.size - 1))
    pool = engine.spec.device_pool
    return {c: pool.read_pages_host(c, m.device_indices) for c in pool.geom.components}


@pytest.mark.parametrize("page,attention", [(1, "mla"), (16, "mha")])
def test_tokens_equal_plain_greedy_on_every_tier(page, attention, tmp_path):
    model = ModelConfig(**{**MODEL.__dict__, "attention": attention})
    prompts = _prompts(seed=page)
    plain = Engine(model, _config(page))
    cold = [r.tokens for r in plain.generate(prompts, NEW, use_cache=False)]
    plain.close()
    spec = Engine(model, _config(page, tmp_path), spec=SpecConfig(num_draft_tokens=K))
    runs = {
        "no cache": spec.generate(prompts, NEW, use_cache=False),
        "first": spec.generate(prompts, NEW),
        "L1": spec.generate(prompts, NEW),
    }
    for r in runs["L1"]:
        assert r.cached_tokens == {"device": _aligned(r.prompt_len - 1, page), "host": 0, "storage": 0}
    spec.evict_device_cache()
    runs["L2"] = spec.generate(prompts, NEW)
    assert runs["L2"][0].cached_tokens["host"] == _aligned(prompts[0].__len__() - 1, page)
    spec.flush()
    spec.cache.sanity_check(0)
    spec.close()
    fresh = Engine(model, _config(page, tmp_path), spec=SpecConfig(num_draft_tokens=K))
    runs["L3"] = fresh.generate(prompts, NEW)
    assert runs["L3"][0].cached_tokens["storage"] == _aligned(len(prompts[0]) - 1, page)
    fresh.close()
    for name, res in runs.items():
        assert [r.tokens for r in res] == cold, name
        for r in res:
            assert len(r.tokens) == NEW and r.accept_lengths and r.prefill_tokens == r.prompt_len - r.cached_total


@pytest.mark.parametrize("backing", [True, False])
def test_draft_proposals_survive_l2_and_l3_round_trips(backing, tmp_path):
    page = 16
    prompts = _prompts(seed=7)
    spec = SpecConfig(num_draft_tokens=K, draft_backing=backing)
    engine = Engine(MODEL, _config(page, tmp_path), spec=spec)
    engine.generate(prompts, NEW)
    l1 = engine.generate(prompts, NEW)
    assert all(r.cached_tokens["device"] == _aligned(r.prompt_len - 1, page) for r in l1)
    l1_bytes = [_draft_prefix_bytes(engine, p) for p in prompts]
    engine.evict_device_cache()
    assert _poison_free_draft_pages(engine) == engine.spec.device_pool.num_pages  # nothing is on the device
    l2 = [engine.generate([p], NEW)[0] for p in prompts]  # one at a time: each prompt's own pages reload
    # The first reloads the shared prefix too; the others find it on the device.
    assert all(r.cached_total == _aligned(r.prompt_len - 1, page) and r.cached_tokens["host"] for r in l2)
    l2_bytes = [_draft_prefix_bytes(engine, p) for p in prompts]
    engine.close()
    fresh = Engine(MODEL, _config(page, tmp_path), spec=spec)
    _poison_free_draft_pages(fresh)
    l3 = [fresh.generate([p], NEW)[0] for p in prompts]
    assert all(r.cached_total == _aligned(r.prompt_len - 1, page) and r.cached_tokens["storage"] for r in l3)
    l3_bytes = [_draft_prefix_bytes(fresh, p) for p in prompts]
    fresh.close()
    for res in (l2, l3):
        assert [r.tokens for r in res] == [r.tokens for r in l1]  # greedy verification: always exact
    same = lambda a, b: all(np.array_equal(a[c], b[c]) for c in a)  # noqa: E731
    if backing:
        for res, got in ((l2, l2_bytes), (l3, l3_bytes)):
            assert [r.draft_proposals for r in res] == [r.draft_proposals for r in l1]
            assert all(same(g, w) for g, w in zip(got, l1_bytes))
    else:
        for res, got in ((l2, l2_bytes), (l3, l3_bytes)):
            assert [r.draft_proposals for r in res] != [r.draft_proposals for r in l1]
            assert not any(same(g, w) for g, w in zip(got, l1_bytes))
            # The first reload landed on poisoned pages (later ones may land on pages an
            # earlier request just freed: another prompt's draft KV, stale all the same).
            assert all((got[0][c] == np.uint32(0x3F800000)).all() for c in got[0])


@pytest.mark.parametrize("page,attention,split", [(16, "mha", 32), (16, "mha", 40), (1, "mla", 29)])
def test_a_hit_reads_only_draft_entries_computed_with_its_own_successors(page, attention, split):
    """The pair-key rule for page sizes 1 and 16, prompts ending mid-page, and a second prompt
    that leaves the first at a page boundary (16, 32), inside a page (16, 40) or anywhere
    (page 1). The second prompt hits every position whose successor it shares and no other:
    ``split - 1`` positions, page-aligned (a plain tree hits ``split``, page-aligned); and every
    draft (and target) entry it reads is the one a cold run of the same prompt computes. (Each
    page size runs the first test's model: compiled programs are shared.)"""
    model = ModelConfig(**{**MODEL.__dict__, "attention": attention})
    rng = np.random.default_rng(3)
    base = rng.integers(0, MODEL.vocab_size, split).tolist()
    a = base + [1] + rng.integers(0, MODEL.vocab_size, 13).tolist()  # 14 past the split: ends mid-page
    b = base + [2] + rng.integers(0, MODEL.vocab_size, 10).tolist()
    plain = Engine(model, _config(page))
    plain.generate([a], 2)
    assert plain.generate([b], 2)[0].cached_tokens["device"] == _aligned(split, page)
    plain.close()
    engine = Engine(model, _config(page), spec=SpecConfig(num_draft_tokens=K))
    engine.generate([a], 2)
    hit = engine.generate([b], 2)[0].cached_tokens["device"]
    assert hit == _aligned(split - 1, page)
    got = _pool_entries(engine, b, hit)
    cold = Engine(model, _config(page), spec=SpecConfig(num_draft_tokens=K))
    cold.generate([b], 2)
    want = _pool_entries(cold, b, hit)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-4, atol=1e-5, err_msg=name)
    # What a tree keyed by single tokens would have handed b at the boundary: a's last shared
    # draft entry (computed with a's successor 1, not b's 2) - visibly another entry.
    if split % page == 0:
        theirs, own = _pool_entries(engine, a, split), _pool_entries(cold, b, split)
        for c in engine.spec.device_pool.geom.components:
            assert not np.allclose(theirs[f"draft/{c}"][split - 1], own[f"draft/{c}"][split - 1], rtol=1e-2, atol=1e-3)
    for e in (engine, cold):
        e.close()


def _pool_entries(engine: Engine, prompt: list[int], n: int) -> dict[str, np.ndarray]:
    """The KV entries of positions [0, n) of ``prompt`` in both pools (the tree's pages for the
    prompt's pair keys), as float32 (n, L, ...) per pool and component."""
    table = engine.cache.match_prefix(engine.spec.key(np.asarray(prompt), n)).device_indices
    assert table.size * engine.page_size >= n, f"the tree holds {table.size} pages, {n} positions asked"
    pos = np.arange(n)
    out = {}
    for name, pool in (("target", engine.device_pool), ("draft", engine.spec.device_pool)):
        for c in pool.geom.components:
            pages = pool.read_pages_host(c, table)  # (L, pages, page, ...)
            entries = pages[:, pos // engine.page_size, pos % engine.page_size]
            out[f"{name}/{c}"] = np.moveaxis(entries, 1, 0).view(np.float32)
    return out


class _VerifyCounter:
    """Counts the target's verify steps at the model (``step_all`` calls past the prompt)."""

    def __init__(self, engine: Engine) -> None:
        self.inner, self.steps = engine.spec.runner, []
        engine.spec.runner = self

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def step_all(self, pools, tokens, starts, tables, min_t=1):
        self.steps.append((len(tokens), [len(t) for t in tokens]))
        return self.inner.step_all(pools, tokens, starts, tables, min_t)


def test_accept_lengths_are_consistent_and_exported():
    prometheus_client = pytest.importorskip("prometheus_client")
    from hicache_jax.engine.spec_metrics import SPEC_FAMILY_NAMES, register_prometheus

    engine = Engine(MODEL, _config(16), spec=SpecConfig(num_draft_tokens=K))
    counter = _VerifyCounter(engine)
    rng = np.random.default_rng(11)
    # Random weights: (nearly) every proposal is rejected here, so the accepted-token counts are
    # checked on the trained pair (test_spec_trained_pair.py); this test checks the step counts,
    # the per-request means and the export.
    prompts = [np.resize(rng.integers(0, 64, 5), 40).tolist(), rng.integers(0, 64, 33).tolist()]
    res = engine.generate(prompts, 12)
    prefill_steps = [s for s in counter.steps if s[1] != [K + 1] * s[0]]
    verify_steps = sum(s[0] for s in counter.steps) - sum(s[0] for s in prefill_steps)
    assert verify_steps == sum(len(r.accept_lengths) for r in res)
    for r in res:
        # The first token comes from the prefill, the rest from verify steps (the last may
        # emit more than was left: truncated).
        emitted = sum(r.accept_lengths)
        assert emitted >= len(r.tokens) - 1 > emitted - r.accept_lengths[-1]
        assert all(1 <= a <= K + 1 for a in r.accept_lengths)
        assert r.accept_length == pytest.approx(np.mean(r.accept_lengths))
        assert len(r.draft_proposals) == len(r.accept_lengths) and all(len(p) == K for p in r.draft_proposals)
    stats = engine.stats()
    steps = [a for r in res for a in r.accept_lengths]
    assert stats["spec_verify_steps"] == len(steps)
    assert stats["spec_draft_tokens"] == K * len(steps)
    assert stats["spec_accept_length"] == pytest.approx(np.mean(steps))
    assert stats["spec_accepted_tokens"] == sum(steps) - len(steps)
    hist = stats["spec_request_accept_length"]
    assert hist["count"] == len(res) and hist["sum"] == pytest.approx(sum(r.accept_length for r in res))
    assert hist["buckets"]["+Inf"] == len(res)
    assert hist["buckets"]["1.0"] == sum(r.accept_length <= 1.0 for r in res)
    registry = prometheus_client.CollectorRegistry()
    export = register_prometheus(engine.spec.metrics, registry, labels={"model": "toy"})
    lab = {"model": "toy"}
    assert registry.get_sample_value("hicache_spec_accept_length", lab) == pytest.approx(np.mean(steps))
    assert registry.get_sample_value("hicache_spec_verify_steps_total", lab) == len(steps)
    assert registry.get_sample_value("hicache_spec_accepted_tokens_total", lab) == sum(steps) - len(steps)
    assert registry.get_sample_value("hicache_spec_request_accept_length_count", lab) == len(res)
    assert registry.get_sample_value("hicache_spec_request_accept_length_sum", lab) == pytest.approx(
        sum(r.accept_length for r in res)
    )
    # Every family is exported under the name stats() uses.
    exported = {m.name.removeprefix("hicache_") for m in registry.collect()}
    assert exported == set(SPEC_FAMILY_NAMES) and set(SPEC_FAMILY_NAMES) <= set(stats)
    export.unregister()
    assert registry.get_sample_value("hicache_spec_accept_length", lab) is None
    engine.close()
    plain = Engine(MODEL, _config(16))
    r = plain.generate(prompts[:1], 3)[0]
    assert r.accept_length is None and r.accept_lengths == [] and not set(SPEC_FAMILY_NAMES) & set(plain.stats())
    plain.close()


def test_bad_spec_input_is_refused():
    with pytest.raises(ValueError, match="num_draft_tokens"):
        SpecConfig(num_draft_tokens=0)
    with pytest.raises(TypeError, match="draft_backing"):
        SpecConfig(draft_backing="yes")
    with pytest.raises(TypeError, match="spec"):
        Engine(MODEL, _config(16), spec={"num_draft_tokens": 2})
    with pytest.raises(ValueError, match="vocab_size"):
        Engine(
            ModelConfig(vocab_size=70_000, num_layers=1, hidden=16, head_dim=4, ffn=16), _config(16), spec=SpecConfig()
        )
    engine = Engine(MODEL, _config(16), spec=SpecConfig(num_draft_tokens=K))
    # 2k - 1 positions are written ahead of the output: they must fit max_context.
    with pytest.raises(ValueError, match="speculative"):
        engine.generate([[1] * (MAX_CONTEXT - NEW - 2 * K + 2)], NEW)
    assert engine.generate([[1] * (MAX_CONTEXT - NEW - 2 * K + 1)], NEW)[0].tokens
    engine.close()
