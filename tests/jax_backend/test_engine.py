"""End-to-end exactness of the reference engine: the same greedy tokens with no cache, with an
L1 (device) hit, with an L2 (host) hit and with an L3 (storage) hit from a new engine whose
L1 and L2 are empty, and cached-token counts per tier that match where the prefix came from."""

from __future__ import annotations

import time

import numpy as np
import pytest

from hicache_jax.cache import RadixKey
from hicache_jax.engine import Engine, EngineCacheConfig
from hicache_jax.host_pool import HostPoolConfig
from hicache_jax.reference_model import ModelConfig
from hicache_jax.storage.config import StorageConfig
from hicache_jax.transfer import TransferHandle

POLICIES = ["write_through", "write_through_selective", "write_back"]
SYSTEM, USER, NEW = 48, 20, 4  # shared prefix, user turn (> the 10-token load-back minimum), generated


def _prompts(seed: int, n: int = 3) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    system = rng.integers(0, 512, SYSTEM).tolist()
    return [system + rng.integers(0, 512, USER).tolist() for _ in range(n)]


def _aligned(n: int, page: int) -> int:
    return n - n % page


def _check_computed(results) -> None:
    """The engine's own numbers agree (prefill_tokens is derived from the cached counts, so
    this cannot see a prefill that recomputes the prefix: test_engine_served.py counts the
    tokens at the model and compares the served pages byte for byte)."""
    for r in results:
        assert r.prefill_tokens == r.prompt_len - r.cached_total, r


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("page", [1, 16])
@pytest.mark.parametrize("attention", ["mha", "mla"])
def test_tokens_identical_across_tiers(attention, page, policy, tmp_path):
    model = ModelConfig(attention=attention, num_layers=2, hidden=64, ffn=128)
    storage = StorageConfig(
        backend="file", path=str(tmp_path / "l3"), prefetch_policy="wait_complete", prefetch_threshold_tokens=16
    )
    config = EngineCacheConfig(
        page_size=page,
        device_pages=max(24, 512 // page),
        write_policy=policy,
        max_batch=4,
        prefill_chunk=32,
        storage=storage,
    )
    engine = Engine(model, config)
    prompts = _prompts(seed=page)
    cold = engine.generate(prompts, NEW, use_cache=False)
    assert all(r.cached_total == 0 for r in cold)
    warm = engine.generate(prompts, NEW)  # fills the cache (later prompts already hit the prefix)
    l1 = engine.generate(prompts, NEW)
    for r, c in zip(warm + l1, cold + cold):
        assert r.tokens == c.tokens
    _check_computed(cold + warm + l1)
    # Second pass: each whole prompt (up to len - 1, page aligned) is on the device.
    for r in l1:
        assert r.cached_tokens == {"device": _aligned(r.prompt_len - 1, page), "host": 0, "storage": 0}
    engine.evict_device_cache()
    assert engine.stats()["device_tree_tokens"] == 0
    l2 = engine.generate(prompts, NEW)
    for r, c in zip(l2, cold):
        assert r.tokens == c.tokens
    _check_computed(l2)
    # The first request after eviction finds everything on the host only.
    first = l2[0].cached_tokens
    assert first["device"] == 0 and first["host"] == _aligned(l2[0].prompt_len - 1, page)
    for r in l2[1:]:  # later ones hit the shared prefix on the device again, the rest on the host
        assert r.cached_tokens["device"] + r.cached_tokens["host"] == _aligned(r.prompt_len - 1, page)
    engine.cache.flush()
    engine.cache.sanity_check(0)
    engine.close()  # flushes every L3 write
    # A new engine on the same storage directory: L1 and L2 empty, the prefixes come from L3.
    fresh = Engine(model, config)
    l3 = fresh.generate(prompts, NEW)
    for r, c in zip(l3, cold):
        assert r.tokens == c.tokens
    _check_computed(l3)
    first = l3[0].cached_tokens
    assert first == {"device": 0, "host": 0, "storage": _aligned(l3[0].prompt_len - 1, page)}
    for r in l3[1:]:  # the shared prefix is on the device by now; each user turn comes from L3
        assert r.cached_tokens["storage"] > 0
        assert r.cached_total == _aligned(r.prompt_len - 1, page)
    fresh.cache.flush()
    fresh.cache.sanity_check(0)
    fresh.close()


def test_orbax_storage_hit_after_host_eviction(tmp_path):
    """The default (orbax segment log) backend: evict L1 and L2, the prompt comes back from L3."""
    model = ModelConfig(num_layers=2, hidden=64, ffn=128)
    engine = Engine(
        model,
        EngineCacheConfig(
            page_size=16,
            device_pages=48,
            storage=StorageConfig(
                backend="orbax",
                path=str(tmp_path / "l3"),
                prefetch_policy="wait_complete",
                prefetch_threshold_tokens=16,
            ),
        ),
    )
    prompts = _prompts(seed=3, n=2)
    cold = engine.generate(prompts, NEW, use_cache=False)
    engine.generate(prompts, NEW)
    assert engine.evict_host_cache() > 0
    assert engine.stats()["host_tree_tokens"] == 0
    again = engine.generate(prompts, NEW)
    assert [r.tokens for r in again] == [r.tokens for r in cold]
    assert again[0].cached_tokens["storage"] == _aligned(again[0].prompt_len - 1, 16)
    engine.close()


def test_eviction_under_memory_pressure_keeps_tokens_exact():
    model = ModelConfig(num_layers=2, hidden=64, ffn=128)
    # 12 pages of 4 tokens: every prompt evicts the previous ones.
    engine = Engine(model, EngineCacheConfig(page_size=4, device_pages=20, max_batch=1, host=HostPoolConfig(ratio=2.0)))
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, 512, 30).tolist() for _ in range(4)]
    cold = engine.generate(prompts, 3, use_cache=False)
    first = engine.generate(prompts, 3)
    again = engine.generate(prompts, 3)
    assert [r.tokens for r in first] == [r.tokens for r in cold] == [r.tokens for r in again]
    assert engine.cache.metrics.evicted_device_tokens > 0
    assert sum(r.cached_tokens["host"] for r in again) > 0
    engine.cache.flush()
    engine.cache.sanity_check(0)


def test_prompt_that_cannot_fit_raises_clearly():
    engine = Engine(ModelConfig(num_layers=1, hidden=32, ffn=64), EngineCacheConfig(page_size=4, device_pages=4))
    with pytest.raises(ValueError, match="device pages"):  # refused up front, before any match
        engine.generate([list(range(40))], 2)


@pytest.mark.parametrize(
    "prompts, new, exc, match",
    [
        ([[]], 2, ValueError, "prompts\\[0\\]"),
        ([[1, 2, 600]], 2, ValueError, "token ids"),
        ([[1.5, 2]], 2, ValueError, "prompts\\[0\\]"),
        ([[1, 2]], 0, ValueError, "max_new_tokens"),
    ],
)
def test_bad_input_rejected(prompts, new, exc, match):
    engine = Engine(ModelConfig(num_layers=1, hidden=32, ffn=64), EngineCacheConfig(page_size=4, device_pages=16))
    with pytest.raises(exc, match=match):
        engine.generate(prompts, new)
    assert engine.device_pool.allocator.used == 0


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        (dict(page_size=0), ValueError, "page_size"),
        (dict(device_pages=1), ValueError, "device_pages"),
        (dict(write_policy="write_sometimes"), ValueError, "write_policy"),
        (dict(host=2.0), TypeError, "host"),
        (dict(max_batch=1.0), TypeError, "max_batch"),
    ],
)
def test_engine_config_validation(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        EngineCacheConfig(**kwargs)


def test_decode_step_hook_brackets_every_decode_step():
    model = ModelConfig(num_layers=2, hidden=64, ffn=128)
    engine = Engine(model, EngineCacheConfig(page_size=4, device_pages=32, max_batch=2))
    calls = []
    engine.on_decode_step = calls.append
    engine.generate(_prompts(3, 2), 5)  # the prefill emits token 1; 4 batched decode steps follow
    assert calls == ["start", "end"] * 4
    engine.on_decode_step = None
    engine.generate(_prompts(4, 2), 3)
    assert len(calls) == 8
    engine.close()


@pytest.mark.parametrize("max_batch", [1, 2])
def test_prefix_lost_from_host_while_waiting_comes_back_from_storage(max_batch, tmp_path):
    """B arrives while its prefix is on the host (its prefetch has nothing to do), then A's
    backups push that prefix out of the small host pool while B waits. B must re-prefetch it
    from L3 (not recompute it), and count it as a storage hit. With ``max_batch=2`` B waits
    for device room beside a running A: its prefetch must keep running until it is admitted."""
    model = ModelConfig(num_layers=2, hidden=64, ffn=128)
    storage = StorageConfig(
        backend="file", path=str(tmp_path / "l3"), prefetch_policy="wait_complete", prefetch_threshold_tokens=8
    )
    engine = Engine(
        model,
        EngineCacheConfig(
            page_size=4,
            device_pages=32,
            max_batch=max_batch,
            max_context=256,
            host=HostPoolConfig(ratio=1.0),
            storage=storage,
        ),
    )
    rng = np.random.default_rng(11)
    b = rng.integers(0, 512, 41).tolist()
    a = rng.integers(0, 512, 100).tolist()  # 25 pages: with B's 10 the 32-page host overflows
    b2 = b + rng.integers(0, 512, 6).tolist()
    cold = engine.generate([a, b2], 3, use_cache=False)
    engine.generate([b], 2)
    engine.flush()  # B's 10 pages are on the host and in L3
    engine.evict_device_cache()
    assert engine.cache.peek_prefix(RadixKey(np.asarray(b2[:-1]))) == (0, 40)
    # After each decode step every backup is finished, so A's host copies can make room for
    # B's pages whenever B's prefetch asks (not only when the L3 writes happen to be done).
    engine.on_decode_step = lambda phase: engine.flush() if phase == "end" else None
    res = engine.generate([a, b2], 3)
    assert [r.tokens for r in res] == [r.tokens for r in cold]
    assert engine.cache.metrics.evicted_host_tokens >= 40  # B's prefix did leave the host
    assert res[1].cached_tokens == {"device": 0, "host": 0, "storage": 40}
    _check_computed(res)
    engine.cache.flush()
    engine.cache.sanity_check(0)
    engine.close()


class _SlowHandle(TransferHandle):
    """A D2H copy that reports done only ``delay`` seconds after it was issued."""

    def __init__(self, inner: TransferHandle, delay: float) -> None:
        self.inner, self.ready_at = inner, time.perf_counter() + delay

    def done(self) -> bool:
        return time.perf_counter() >= self.ready_at and self.inner.done()

    def wait(self, timeout: float | None = None) -> None:
        time.sleep(max(0.0, self.ready_at - time.perf_counter()))
        self.inner.wait(timeout)


def test_host_hit_is_loaded_when_the_device_is_held_by_unacknowledged_backups():
    """At admission (nothing running) the device is full of nodes whose D2H backups are not
    acknowledged yet, so they cannot be evicted. The engine must wait for those copies and
    then load the host hit back, not evict them afterwards and recompute the prefix."""
    model = ModelConfig(num_layers=2, hidden=64, ffn=128)
    engine = Engine(model, EngineCacheConfig(page_size=4, device_pages=24, max_context=128))
    backup = engine.transfer.backup_owned
    engine.transfer.backup_owned = lambda d, h: _SlowHandle(backup(d, h), 0.5)
    rng = np.random.default_rng(12)
    x = rng.integers(0, 512, 41).tolist()
    y = rng.integers(0, 512, 81).tolist()  # 20 pages: with x's 10 the device overflows
    x2 = x + rng.integers(0, 512, 6).tolist()
    cold = engine.generate([x2], 2, use_cache=False)
    engine.generate([x], 2)
    engine.evict_device_cache()  # x: host only
    engine.generate([y], 2)  # y's 20 pages: locked by their backup for the next 0.5 s
    assert engine.cache.in_flight[0] > 0
    res = engine.generate([x2], 2)
    assert res[0].tokens == cold[0].tokens
    assert res[0].cached_tokens == {"device": 0, "host": 40, "storage": 0}
    _check_computed(res)
    engine.cache.flush()
    engine.cache.sanity_check(0)
    engine.close()
