"""Bad input to the engine raises ValueError/TypeError naming the argument before anything runs:
no match touches the tree, no prompt is served and lost; and ``evict_host_cache`` leaves
nothing on the host under write_back (issue 21, points 6, 8, 9, 10, 11)."""

from __future__ import annotations

import time

import numpy as np
import pytest

from hicache_jax.engine import Engine, EngineCacheConfig
from hicache_jax.engine.config import COPY_IMPLS
from hicache_jax.reference_model import ModelConfig
from hicache_jax.storage.config import StorageConfig

MODEL = ModelConfig(attention="mha", num_layers=1, hidden=32, ffn=64)


@pytest.fixture(scope="module")
def engine():
    eng = Engine(MODEL, EngineCacheConfig(page_size=4, device_pages=16, max_batch=2, prefill_chunk=16, max_context=128))
    yield eng
    eng.close()


def _untouched(engine):
    m = engine.cache.metrics
    return (m.match_calls, m.match_tokens, len(engine.cache.all_nodes()), engine.device_pool.allocator.available)


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        ({"arrivals": [float("inf")]}, ValueError, "arrivals"),
        ({"arrivals": [1e9]}, ValueError, "arrivals"),  # would sleep for decades
        ({"arrivals": [float("nan")]}, ValueError, "arrivals"),
        ({"arrivals": [-1.0]}, ValueError, "arrivals"),
        ({"arrivals": [True]}, TypeError, "arrivals"),
        ({"arrivals": ["0"]}, TypeError, "arrivals"),
        ({"arrivals": 0.5}, TypeError, "arrivals"),
        ({"arrivals": [0.0, 0.0]}, ValueError, "arrivals"),  # one per prompt
        ({"use_cache": 1}, TypeError, "use_cache"),
        ({"use_cache": "yes"}, TypeError, "use_cache"),
    ],
)
def test_generate_rejects_bad_options_before_running(engine, kwargs, exc, match):
    before = _untouched(engine)
    t0 = time.perf_counter()
    with pytest.raises(exc, match=match):
        engine.generate([[1, 2, 3, 4, 5]], 2, **kwargs)
    assert time.perf_counter() - t0 < 5  # never sleeps towards a far arrival
    assert _untouched(engine) == before


@pytest.mark.parametrize(
    "prompts, exc, match",
    [
        (None, TypeError, "prompts"),
        ("12345", TypeError, "prompts"),
        ([None], TypeError, r"prompts\[0\]"),
        ([[1, 2], "ab"], TypeError, r"prompts\[1\]"),
        ([[1, 2], []], ValueError, r"prompts\[1\]"),
        ([[1, 2], [1.5, 2.0]], ValueError, r"prompts\[1\]"),
        ([[1, 2], [-1, 2]], ValueError, r"prompts\[1\]"),
    ],
)
def test_generate_rejects_bad_prompts_before_running(engine, prompts, exc, match):
    before = _untouched(engine)
    with pytest.raises(exc, match=match):
        engine.generate(prompts, 2)
    assert _untouched(engine) == before


def test_a_prompt_that_cannot_fit_the_device_pool_fails_before_any_is_served(engine):
    """16 pages of 4 tokens: a 100-token prompt + 20 new needs 30 pages. It used to fail at its
    admission, after the match had run and after the earlier prompts were served (their
    results lost); now the call fails before anything runs."""
    before = _untouched(engine)
    with pytest.raises(ValueError, match=r"prompts\[1\].*device pages"):
        engine.generate([[1, 2, 3, 4, 5], list(range(100))], 20)
    assert _untouched(engine) == before


def test_copy_impl_is_checked_at_construction():
    with pytest.raises(ValueError, match="copy_impl"):
        EngineCacheConfig(copy_impl="cuda-fast")
    from pallas_kernels.page_copy import PageCopyConfig

    for impl in COPY_IMPLS:  # every name the config accepts is one the dispatcher accepts
        PageCopyConfig(impl=impl)


def test_evict_host_cache_under_write_back_leaves_nothing_on_the_host(tmp_path):
    """write_back backs the prefix up inside the device eviction; the L3 writes of those
    backups pin the host copies until stored, so the host eviction must come after them."""
    storage = StorageConfig(backend="memory", prefetch_policy="wait_complete", prefetch_threshold_tokens=4)
    eng = Engine(
        MODEL,
        EngineCacheConfig(
            page_size=4,
            device_pages=32,
            max_batch=2,
            prefill_chunk=16,
            max_context=128,
            write_policy="write_back",
            storage=storage,
        ),
    )
    prompt = np.random.default_rng(0).integers(0, 256, 40).tolist()
    eng.generate([prompt], 2)
    eng.evict_host_cache()
    assert eng.stats()["host_tree_tokens"] == 0
    r = eng.generate([prompt], 2)[0]
    assert r.cached_tokens["host"] == 0 and r.cached_tokens["storage"] > 0
    eng.close()


def test_ttft_splits_into_queueing_and_service(engine):
    """max_batch 2, three prompts at once: the third waits for a slot (the first two decode 6
    steps), so its queueing time is most of its TTFT; the first is admitted at once."""
    rng = np.random.default_rng(5)
    res = engine.generate([rng.integers(0, 500, 20).tolist() for _ in range(3)], 6, use_cache=False)
    for r in res:
        assert r.queue_s >= 0 and r.service_s > 0 and r.queue_s + r.service_s == pytest.approx(r.ttft_s)
    assert res[0].queue_s < 0.5 * res[0].ttft_s
    assert res[2].queue_s > res[0].queue_s and res[2].queue_s > res[2].service_s
