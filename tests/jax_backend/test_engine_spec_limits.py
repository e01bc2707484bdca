"""Issue 28 point 3: a speculative engine whose verify positions cannot fit any request in
``max_context`` is refused at construction (it used to build, then refuse every request).

The shortest request (1 prompt token, 1 new token) writes ``2 * k - 1`` positions past its
end, so ``k`` needs ``max_context >= 2 + 2 * k - 1``."""

from __future__ import annotations

import pytest

from hicache_jax.engine import Engine, EngineCacheConfig, SpecConfig
from hicache_jax.reference_model import ModelConfig

MODEL = ModelConfig(vocab_size=64, num_layers=1, hidden=16, num_heads=2, num_kv_heads=1, head_dim=8, ffn=32)


@pytest.mark.parametrize("k", [200, 64])
def test_draft_tokens_that_cannot_fit_max_context_are_refused(k):
    cfg = EngineCacheConfig(page_size=16, device_pages=16, max_batch=1, prefill_chunk=16, max_context=128)
    with pytest.raises(ValueError, match=rf"spec: num_draft_tokens {k} needs max_context >= {2 * k + 1}"):
        Engine(MODEL, cfg, spec=SpecConfig(num_draft_tokens=k))


def test_the_largest_draft_that_fits_serves_a_request():
    cfg = EngineCacheConfig(page_size=16, device_pages=16, max_batch=1, prefill_chunk=16, max_context=16)
    e = Engine(MODEL, cfg, spec=SpecConfig(num_draft_tokens=7))  # 2 + 13 = 15 <= 16
    try:
        r = e.generate([[1]], 1)[0]
        assert len(r.tokens) == 1
    finally:
        e.close()
