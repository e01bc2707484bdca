"""The trained toy pair (``reference_model/spec_toy_pair.npz``): the accept length survives a
restart with an L3 hit when the draft KV is backed, and falls without draft backing.

Upstream's test (sglang ``hicache_spec_storage_common``) on the toy scale: a long repetitive
prompt, served from L1, then by a new engine on the same L3 directory (a restart: L1 and L2
empty) with draft backing (the draft KV comes back from L3 with the target's), and by one
without (the draft pool keeps what it held). Every engine first serves another repetitive
prompt and drops it, so the pages the request gets last held another prompt's KV in both
pools, as in a server that has been serving (upstream's failure: reused slots, old draft
content). The pair continues a pattern of 32 tokens: the draft finds its guesses one period
back in its own KV. With a 192-token prompt (the hit: 176 tokens, page 16) and 16 new
tokens, every position it looks at lies in the cached prefix, never in fresh entries.

Asserted: the same tokens in every case; after the L3 hit with draft backing, the same
proposals as on the L1 hit and an accept length >= 0.9x the L1 hit's (upstream's bound);
without draft backing, an accept length at most ``NO_BACKING_MAX_RATIO`` of the L1 hit's.

Also here (it needs proposals that get accepted, which random weights rarely make): what a
request caches is what a cold prefill of the same tokens computes, in both pools.

Every engine here has the same shapes as ``bench spec``'s smoke run, so they share compiled
programs.
"""

from __future__ import annotations

import numpy as np
import pytest

from hicache_jax.engine import Engine, EngineCacheConfig, SpecConfig
from hicache_jax.host_pool import HostPoolConfig
from hicache_jax.reference_model.weights import load_pair
from hicache_jax.storage.config import StorageConfig

PAGE, PROMPT_LEN, NEW, K, PROMPTS = 16, 192, 16, 4, 3
# Measured with the checked-in pair in this setup: the L1 hit and the restored L3 hit accept
# every chain (5.0 = k + 1, per prompt), without draft backing 1.00 / 1.07 / 1.07 per prompt
# (ratio ~0.21). Upstream's ratio was 3.07 / 6.94 = 0.44; the bound is 0.5.
NO_BACKING_MAX_RATIO = 0.5


def _prompt(rng: np.random.Generator, pair) -> list[int]:
    period = pair.meta["periods"][-1]
    return np.resize(rng.integers(0, pair.config.vocab_size, period), PROMPT_LEN).tolist()


@pytest.fixture(scope="module")
def pair():
    return load_pair()


def _engine(pair, tmp_path, backing: bool = True, warm: list[int] | None = None) -> Engine:
    storage = None
    if tmp_path is not None:
        storage = StorageConfig(
            backend="file", path=str(tmp_path / "l3"), prefetch_policy="wait_complete", prefetch_threshold_tokens=PAGE
        )
    cfg = EngineCacheConfig(
        page_size=PAGE,
        device_pages=64,
        host=HostPoolConfig(ratio=4.0),
        max_batch=1,
        prefill_chunk=256,
        max_context=256,
        storage=storage,
    )
    e = Engine(pair.config, cfg, spec=SpecConfig(num_draft_tokens=K, draft_backing=backing), weights=pair)
    if warm is not None:
        e.generate([warm], NEW)
        e.flush()
        e.cache.reset()  # the next request's pages last held the warm-up prompt's KV
    return e


def test_accept_length_survives_an_l3_restart_only_with_draft_backing(pair, tmp_path):
    rng = np.random.default_rng(2024)
    prompts = [_prompt(rng, pair) for _ in range(PROMPTS)]
    warm = _prompt(rng, pair)
    e = _engine(pair, tmp_path, True, warm)
    cold = [e.generate([p], NEW)[0] for p in prompts]
    l1 = [e.generate([p], NEW)[0] for p in prompts]
    assert all(r.cached_tokens["device"] == (PROMPT_LEN - 1) // PAGE * PAGE for r in l1)
    e.close()
    restored, stale = [], []
    for backing, out in ((True, restored), (False, stale)):
        e = _engine(pair, tmp_path, backing, warm)
        for p in prompts:
            r = e.generate([p], NEW)[0]
            assert r.cached_tokens["storage"] == (PROMPT_LEN - 1) // PAGE * PAGE, r.cached_tokens
            out.append(r)
            e.cache.reset()  # each prompt alone, on pages that held another prompt's KV
        e.close()
    for res in (l1, restored, stale):
        assert [r.tokens for r in res] == [r.tokens for r in cold]
    mean = {
        name: float(np.mean([r.accept_length for r in res]))
        for name, res in (("cold", cold), ("l1", l1), ("restored", restored), ("stale", stale))
    }
    assert mean["l1"] >= 4.0, mean  # the pair is trained: nearly every proposal is accepted
    assert [r.draft_proposals for r in restored] == [r.draft_proposals for r in l1]
    assert mean["restored"] >= 0.9 * mean["l1"], mean
    assert mean["stale"] <= NO_BACKING_MAX_RATIO * mean["l1"], mean


def _tree_pages(engine: Engine, prompt: list[int], n: int) -> dict[str, np.ndarray]:
    """Target and draft pool contents of the tree's device pages for the prompt's first n
    positions, as float32 (L, pages, page, H, D) per pool and component."""
    ids = engine.cache.match_prefix(engine.spec.key(np.asarray(prompt), n)).device_indices
    assert ids.size * engine.page_size == n
    out = {}
    for name, pool in (("target", engine.device_pool), ("draft", engine.spec.device_pool)):
        for c in pool.geom.components:
            out[f"{name}/{c}"] = pool.read_pages_host(c, ids).view(np.float32)
    return out


def test_cached_entries_are_those_of_a_cold_prefill(pair):
    """What a request inserts (prompt and generated tokens) is what a cold prefill of the same
    tokens computes, in both pools: no rejected proposal's target KV and no provisional draft
    entry of a chain step (computed from the draft's own feature) is ever cached."""
    rng = np.random.default_rng(5)
    # Shorter than a period: the first outputs are the target's own guesses (the draft's
    # chains get rejected), the later ones copy them one period back (chains get accepted).
    first = rng.integers(0, pair.config.vocab_size, 24).tolist()
    engine = _engine(pair, None)
    r = engine.generate([first], 40)[0]
    assert max(r.accept_lengths) > 1 and min(r.accept_lengths) < K + 1, r.accept_lengths
    # The engine's counters agree with the request's steps (with random weights nearly every
    # proposal is rejected, so only here do accepted tokens get counted at all).
    stats = engine.stats()
    assert stats["spec_verify_steps"] == len(r.accept_lengths)
    assert stats["spec_accepted_tokens"] == sum(r.accept_lengths) - len(r.accept_lengths) > 0
    assert stats["spec_emitted_tokens"] == sum(r.accept_lengths) >= len(r.tokens) - 1
    assert stats["spec_accept_length"] == pytest.approx(r.accept_length)
    follow = first + r.tokens + [5, 6, 7]  # the next turn re-sends the answer
    hit = engine.generate([follow], 2)[0].cached_tokens["device"]
    # Everything the first request committed (63 pairs: 3 whole pages).
    assert hit == (len(first) + len(r.tokens) - 1) // PAGE * PAGE == 48
    got = _tree_pages(engine, follow, hit)
    cold = _engine(pair, None)
    cold.generate([follow], 2)
    want = _tree_pages(cold, follow, hit)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-4, atol=1e-5, err_msg=name)
    for e in (engine, cold):
        e.close()
