"""hicache_jax.integrations.easydel on a live eSurge engine (tiny random Llama, CPU, no downloads).

One engine per scheduling mode (overlap / async scheduling off and on), shared by the tests of
this module through ``EngineSlot`` (eSurge compiles every bucket at start; the compile caches
under .cache/ make later starts take seconds). The scenario (issue 27's acceptance): prompt A
cold; prompt B evicts A from eSurge's 9-page pool; A again is served 32 tokens from eSurge's L1
and 64 from the host tier with the same greedy tokens, eSurge scheduling 4 prefill tokens
instead of 100; a cached eSurge page the host tier lost is copied when eSurge evicts it (the
host page's bytes are the eSurge page's); the engine is terminated and a new one on the same
L3 directory serves A from storage; corrupted host pages change the tokens; another model /
revision / geometry never reads A's pages. Every engine is closed with its worker processes,
and the module checks that none survived.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import prometheus_client
import pytest

pytest.importorskip("easydel", reason="needs easydel==0.3.0 (./scripts/test builds .venv-easydel)")

from hicache_jax.integrations.easydel import testing as F  # noqa: E402

F.prepare_cpu(str(Path(__file__).resolve().parents[2] / ".cache"))  # before easydel is imported

from esurge_support import close_checked, last_admission as _last, reset_l1 as _reset_l1  # noqa: E402
from esurge_support import hicache_config as _config  # noqa: E402
from hicache_jax.cache import HiCacheConfig, HiRadixCache, RadixKey  # noqa: E402
from hicache_jax.integrations.easydel import (  # noqa: E402
    FusedKVTransfer,
    UnsupportedEngineError,
    attach,
    fused_geometry,
)

NUM_PAGES = 10  # eSurge's pool, page 0 its null page: 9 usable pages of 16 tokens
MODEL, REV = "tiny-llama-test", "r1"
A, B = F.prompt(1, 100), F.prompt(2, 100)


class EngineSlot:
    """The module's current eSurge engine for one scheduling mode; ``restart`` terminates it and
    starts a new one (same model object, same mode). ``close`` asserts its workers are gone."""

    def __init__(self, tokenizer_dir: str, async_scheduling: bool) -> None:
        self.tokenizer_dir, self.async_scheduling = tokenizer_dir, async_scheduling
        self.model = F.random_llama()
        self.engine = None
        self.start()

    def start(self) -> None:
        self.engine = F.start_engine(
            self.model, self.tokenizer_dir, num_pages=NUM_PAGES, async_scheduling=self.async_scheduling
        )

    def close(self) -> None:
        engine, self.engine = self.engine, None
        if engine is None:
            return
        close_checked(engine, workers=2)  # eSurge's tokenizer and detokenizer workers

    def restart(self) -> None:
        self.close()
        self.start()


@pytest.fixture(scope="module", params=[False, True], ids=["overlap-off", "overlap-on"])
def engine_slot(request, tokenizer_dir):
    slot = EngineSlot(tokenizer_dir, async_scheduling=request.param)
    try:
        yield slot
    finally:
        slot.close()


@pytest.fixture
def engine(engine_slot):
    return engine_slot.engine


def test_l1_l2_l3_hits_with_identical_tokens(engine, l3_dir):
    _reset_l1(engine)
    cold = F.greedy(engine, A)  # no adapter: eSurge alone
    _reset_l1(engine)
    h = attach(engine, _config(l3_dir), model=MODEL, weights_revision=REV)
    registry = prometheus_client.CollectorRegistry()
    h.register_prometheus(registry, {"engine": "test"})
    try:
        assert F.greedy(engine, A) == cold
        adm = _last(h)
        assert (adm.device, adm.host, adm.storage, adm.scheduled) == (0, 0, 0, 100)
        assert h.counters.backed_up_pages == 6  # 107 computed tokens: 6 full pages
        F.greedy(engine, B)  # B takes A's pages: the eviction hook sees them go
        assert h.counters.evictions_seen == 4  # A's cached pages 3..6 (A's pages 1, 2 stay in L1)
        assert h.counters.eviction_backups == 0  # all four were backed up when A finished
        assert F.greedy(engine, A) == cold
        adm = _last(h)
        assert (adm.device, adm.host, adm.storage) == (32, 64, 0)
        assert adm.scheduled == 4  # eSurge prefilled 4 tokens, not 100
        assert h.counters.loaded_pages == 4
        assert h.counters.blocked_seconds["load"] > 0 and h.counters.blocked_seconds["backup"] > 0
        got = {
            src: registry.get_sample_value(
                "hicache_esurge_cached_tokens_total", {"engine": "test", "cache_source": src}
            )
            for src in ("device", "host", "storage")
        }
        assert got == {"device": 32, "host": 64, "storage": 0}
    finally:
        h.detach()
    assert (
        registry.get_sample_value("hicache_esurge_cached_tokens_total", {"engine": "test", "cache_source": "host"})
        is None
    )  # detach unregistered
    # Detached: eSurge alone again (its methods are its own).
    assert "get_computed_pages" not in vars(engine.scheduler.kv_cache_manager)


def test_corrupted_host_page_changes_tokens(engine, l3_dir):
    _reset_l1(engine)
    cold = F.greedy(engine, A)
    _reset_l1(engine)
    h = attach(engine, _config(l3_dir), model=MODEL, weights_revision=REV + "-corrupt")
    try:
        F.greedy(engine, A)
        F.greedy(engine, B)
        # Every host page (A's pages 2..5 are loaded from the host): overwrite their bytes.
        tree_pages = [n.host_value for n in h.cache.all_nodes() if n.host_value is not None]
        assert tree_pages
        rng = np.random.default_rng(0)
        for hv in tree_pages:
            for pid in hv:
                arr = h.host_pool.component_view("kv")[pid]
                arr[...] = rng.integers(0x3000, 0x4000, arr.shape, dtype=np.uint16)  # bf16 values ~0.1..2
        got = F.greedy(engine, A)
        assert _last(h).host == 64
        assert got != cold, "the host pages loaded into eSurge are not the ones attention read"
    finally:
        h.detach()


def test_prompt_logprobs_pass_through(engine, l3_dir):
    _reset_l1(engine)
    h = attach(engine, _config(l3_dir), model=MODEL, weights_revision=REV + "-lp")
    try:
        F.greedy(engine, A, max_tokens=2, prompt_logprobs=1)
        assert h.counters.passthrough_requests == 1
        assert h.counters.cached_tokens == {"device": 0, "host": 0, "storage": 0}
        assert h.counters.loaded_pages == 0
    finally:
        h.detach()


def test_other_model_revision_or_geometry_never_reads_pages(engine, l3_dir):
    _reset_l1(engine)
    h = attach(engine, _config(l3_dir), model=MODEL, weights_revision=REV)
    try:
        F.greedy(engine, A)
    finally:
        h.detach()
    for model, rev in ((MODEL + "-other", REV), (MODEL, REV + "-other")):
        _reset_l1(engine)
        h = attach(engine, _config(l3_dir), model=model, weights_revision=rev)
        try:
            F.greedy(engine, A)
            assert (_last(h).storage, _last(h).host) == (0, 0), (model, rev)
        finally:
            h.detach()
    # Same model and revision, another page geometry (one more layer): no page is read.
    import jax.numpy as jnp

    arrays = [jnp.zeros((4, F.PAGE, 2, 2, 128), jnp.bfloat16) for _ in range(3)]
    from hicache_jax.host_pool import HostKVPool
    from hicache_jax.allocator import PageAllocator
    from hicache_jax.l3 import StorageController

    geom = fused_geometry(arrays)
    pool = HostKVPool(geom, 16)
    t = FusedKVTransfer(lambda: arrays, lambda a: None, pool, num_slots=4)
    cache = HiRadixCache(_config(l3_dir), t, PageAllocator(4, name="slots"))
    l3 = StorageController(cache, model=MODEL, weights_revision=REV)
    try:
        toks = np.asarray(F.tokenize(A)[:96], np.int64)
        op = l3.prefetch(RadixKey(toks))
        while not l3.prefetch_ready(op):
            cache.check_events()
        assert l3.finish_prefetch(op) == 0
    finally:
        l3.close()
        t.close()


def test_refuses_unsupported_setups(engine, l3_dir):
    with pytest.raises(ValueError, match="page_size"):
        attach(engine, HiCacheConfig(page_size=8), model=MODEL)
    with pytest.raises(ValueError, match="write_through"):
        attach(engine, HiCacheConfig(page_size=F.PAGE, write_policy="write_back"), model=MODEL)
    with pytest.raises(ValueError, match="model"):
        attach(engine, HiCacheConfig(page_size=F.PAGE), model="")
    sched = engine.scheduler
    old = sched.data_parallel_size
    sched.data_parallel_size = 2
    try:
        with pytest.raises(UnsupportedEngineError, match="data-parallel"):
            attach(engine, HiCacheConfig(page_size=F.PAGE), model=MODEL)
    finally:
        sched.data_parallel_size = old
    kvm = sched.kv_cache_manager
    kvm.enable_caching = False  # eSurge would never look up, so a host hit could never land
    try:
        with pytest.raises(UnsupportedEngineError, match="prefix caching is off"):
            attach(engine, HiCacheConfig(page_size=F.PAGE), model=MODEL)
    finally:
        kvm.enable_caching = True
    assert "get_computed_pages" not in vars(sched.kv_cache_manager)  # refused: nothing changed


def test_page_aligned_prompt_is_served_but_its_last_page(engine, l3_dir):
    """eSurge always computes a prompt's last token, so of a 96-token prompt (6 whole pages) the
    host tier serves 5 pages and eSurge prefills the 16 tokens of the last one."""
    c = F.prompt(7, 96)
    _reset_l1(engine)
    cold = F.greedy(engine, c)
    _reset_l1(engine)
    h = attach(engine, _config(l3_dir), model=MODEL, weights_revision=REV)
    try:
        assert F.greedy(engine, c) == cold
        assert _last(h).prompt_tokens == 96
        _reset_l1(engine)  # eSurge's pool forgets it: the host tier serves it
        assert F.greedy(engine, c) == cold
        adm = _last(h)
        assert (adm.device, adm.host, adm.storage, adm.scheduled) == (0, 80, 0, 16), adm
        assert h.counters.loaded_pages == 5
    finally:
        h.detach()


def test_pause_resume_never_serves_destroyed_pages(engine, l3_dir):
    """pause() destroys eSurge's KV arrays; resume() recreates them zeroed but eSurge keeps the
    prefix hashes: the adapter resets them, and the prefix comes back from the host tier."""
    _reset_l1(engine)
    cold = F.greedy(engine, A)
    _reset_l1(engine)
    h = attach(engine, _config(l3_dir), model=MODEL, weights_revision=REV + "-pause")
    try:
        F.greedy(engine, A)
        engine.pause()
        engine.resume()
        assert h.counters.resets == 1
        assert F.greedy(engine, A) == cold
        assert (_last(h).device, _last(h).host) == (0, 96)
    finally:
        h.detach()


def test_weight_update_drops_host_tier_and_changes_the_l3_key(engine, l3_dir):
    _reset_l1(engine)
    h = attach(engine, _config(l3_dir), model=MODEL, weights_revision=REV + "-w")
    try:
        F.greedy(engine, A)
        sched = engine.scheduler
        h.update_model_weights(F.random_llama(seed=0), weights_revision=REV + "-w2")
        assert engine.scheduler is not sched  # eSurge built a new scheduler: the hooks moved to it
        assert "get_computed_pages" in vars(engine.scheduler.kv_cache_manager)
        assert h.weights_revision == REV + "-w2"
        F.greedy(engine, A)
        assert (_last(h).device, _last(h).host, _last(h).storage) == (0, 0, 0)  # nothing of revision -w served
        F.greedy(engine, B)
        F.greedy(engine, A)
        assert _last(h).host == 64  # the new revision's pages are cached as before
    finally:
        h.detach()


def test_follow_up_turn_backs_up_only_its_new_pages(engine, l3_dir):
    """A's next turn (A + 20 tokens): at its finish only the page after A's 6 backed-up pages is
    copied; after B evicts it from eSurge, the whole 112-token prefix is served again."""
    a2 = A + " " + F.prompt(3, 20)
    _reset_l1(engine)
    cold = F.greedy(engine, a2)
    _reset_l1(engine)
    h = attach(engine, _config(l3_dir), model=MODEL, weights_revision=REV + "-turns")
    try:
        F.greedy(engine, A)
        assert h.counters.backed_up_pages == 6
        assert F.greedy(engine, a2) == cold
        assert h.counters.backed_up_pages == 7  # 127 computed tokens: 7 full pages, 6 already on the host
        F.greedy(engine, B)
        assert F.greedy(engine, a2) == cold
        adm = _last(h)
        assert adm.device + adm.host == 112 and adm.host >= 64, adm
        assert h.counters.hook_failures == 0
    finally:
        h.detach()


def _tokens(text: str, n: int) -> np.ndarray:
    return np.asarray(F.tokenize(text)[:n], np.int64)


def _cold_then_attached(engine, l3_dir, revision: str):
    """A's greedy tokens from eSurge alone, then the adapter attached (L3 keys under ``revision``)
    to an engine whose L1 holds nothing."""
    _reset_l1(engine)
    cold = F.greedy(engine, A)
    _reset_l1(engine)
    return cold, attach(engine, _config(l3_dir), model=MODEL, weights_revision=revision)


def test_eviction_backs_up_a_cached_page_the_host_tier_lost(engine, l3_dir):
    """The eviction hook's copy path: A's last page (tokens 80..96) is dropped from the host tier
    while eSurge still caches it; when B makes eSurge evict it, the hook copies it to the host
    first, and the host page holds exactly that eSurge page's bytes (captured before B)."""
    a_fork = " ".join(A.split()[:80] + F.prompt(4, 20).split())  # shares A's first 5 pages
    a96 = _tokens(A, 96)
    cold, h = _cold_then_attached(engine, l3_dir, REV + "-evict")
    try:
        F.greedy(engine, A)  # A's 6 full pages backed up: one 96-token host node
        F.greedy(engine, a_fork)  # its backup splits that node at 80 tokens
        assert len(h.host_pages(a96)) == 6 and len(h.host_pages(_tokens(a_fork, 96))) == 6
        with engine._scheduler_lock:  # as on the scheduler thread
            assert h.cache.evict_host(F.PAGE) == F.PAGE  # the host LRU leaf: A's page 6
        assert len(h.host_pages(a96)) == 5 and len(h.host_pages(_tokens(a_fork, 96))) == 6
        # The eSurge page that still caches A's tokens 80..96, and its bytes now.
        [page_id] = [pid for pid, key in h._page_keys.items() if np.array_equal(key, a96)]
        before = h.transfer.read_pages(np.array([page_id]))
        assert before.view(np.uint16).any()
        backups = h.counters.eviction_backups
        F.greedy(engine, B)  # B needs 7 of the 9 pages: eSurge evicts A's cached pages
        assert h.counters.eviction_backups == backups + 1
        ids = h.host_pages(a96)
        assert len(ids) == 6, "the evicted page was not backed up"
        after = h.host_pool.read_pages("kv", ids[5:])
        assert after.shape == before.shape
        assert np.array_equal(after.view(np.uint8), before.view(np.uint8)), (
            "the host page is not the bytes of the eSurge page that was evicted"
        )
        assert F.greedy(engine, A) == cold  # and it serves: pages 3..6 from the host
        assert (_last(h).device, _last(h).host) == (32, 64)
        assert h.counters.hook_failures == 0
    finally:
        h.detach()


def test_new_engine_on_the_same_l3_directory_hits_storage(engine_slot, l3_dir):
    """A is written through to the L3 directory; the engine is terminated (its workers checked
    gone) and a new eSurge engine, with a new adapter on the same directory, serves A's 96
    cached tokens from storage with the same greedy tokens."""
    engine = engine_slot.engine
    _reset_l1(engine)
    cold = F.greedy(engine, A)  # eSurge alone
    _reset_l1(engine)
    h = attach(engine, _config(l3_dir), model=MODEL, weights_revision=REV + "-restart")
    try:
        assert F.greedy(engine, A) == cold
        assert h.counters.backed_up_pages == 6
    finally:
        h.detach()  # finishes the L3 writes
    engine_slot.restart()
    engine = engine_slot.engine
    assert engine is not None and "get_computed_pages" not in vars(engine.scheduler.kv_cache_manager)
    h2 = attach(engine, _config(l3_dir), model=MODEL, weights_revision=REV + "-restart")
    try:
        assert F.greedy(engine, A) == cold
        adm = _last(h2)
        assert (adm.device, adm.host, adm.storage, adm.scheduled) == (0, 0, 96, 4)
        assert h2.stats()["cached_tokens"] == {"device": 0, "host": 0, "storage": 96}
        assert h2.stats()["blocked_seconds"]["prefetch"] > 0  # the scheduler waited for the L3 read
    finally:
        h2.detach()


def test_eviction_backs_up_nothing_when_the_pages_prefix_left_the_host_tier(engine, l3_dir):
    """The eviction hook's other branch: A's whole backup is dropped from the host tier while
    eSurge still caches A's pages. When B makes eSurge evict them, no page can be backed up (a
    page is only worth its KV after its prefix's pages, which the host lost and the evicting
    page cannot supply): nothing is copied, the host tier stays empty for A, and A is then
    served eSurge's own tokens. And a prompt eSurge holds whole is not looked up in storage."""
    a96 = _tokens(A, 96)
    cold, h = _cold_then_attached(engine, l3_dir, REV + "-evict-gone")
    try:
        F.greedy(engine, A)  # A's 6 full pages backed up
        assert len(h.host_pages(a96)) == 6
        with engine._scheduler_lock:  # as on the scheduler thread
            assert h.l3.flush(timeout=30)  # the L3 backup lets go of its host pages
            h.cache.evict_host(h.cache.host_tokens)
        assert len(h.host_pages(a96)) == 0
        backups, seen = h.counters.eviction_backups, h.counters.evictions_seen
        F.greedy(engine, B)  # eSurge evicts A's cached pages 3..6
        assert h.counters.evictions_seen == seen + 4
        assert h.counters.eviction_backups == backups
        assert len(h.host_pages(a96)) == 0, "an evicted page was backed up behind a prefix the host lacks"
        assert F.greedy(engine, A) == cold
        # eSurge now caches all of A's prompt key again; with the host tier emptied once more, a
        # full device hit still asks storage nothing (no prefetch for what eSurge holds).
        with engine._scheduler_lock:
            assert h.l3.flush(timeout=30)
            h.cache.evict_host(h.cache.host_tokens)
        waited = h.counters.blocked_seconds["prefetch"]
        assert F.greedy(engine, A) == cold
        assert _last(h).device == 96
        assert h.counters.blocked_seconds["prefetch"] == waited
        assert h.counters.hook_failures == 0
    finally:
        h.detach()
