"""The window rule on a repeated prompt (issue 28 point 1's question: a hybrid model, window 15,
page 7, a 70-token prompt served again right after itself hit 0 tokens: rule or bug?).

It is the rule. A hit ending at ``m`` is usable only with the SWA KV of the ``W - 1 = 14``
positions ``[m - 14, m)`` (``components/swa.py``: the step after the hit reads them), and ``m``
must leave at least one prompt token to compute, so for a prompt of ``L`` tokens
``m = floor((L - 1) / 7) * 7``. The first request frees the SWA pages its own later steps no
longer read as its window slides, and finishes with its next step at ``E = L + new - 1``
(the KV it inserts): the tree keeps SWA pages from page ``floor((E - 14) / 7)`` on (none
below: tombstones).

* ``L = 70`` (a page multiple), one new token: ``E = 70``, the tree keeps pages 8.. (from
  position 56); the repeat's hit would end at ``m = 63`` and needs pages 7..8 (positions
  ``[49, 63)``): page 7 is gone; every shorter end needs earlier pages, gone too: 0 tokens.
  More new tokens only move the kept window further.
* ``L = 71``: ``m = 70`` needs pages 8..9 (``[56, 70)``); ``E = 71`` keeps pages from 8 on (and
  ``E = 74`` too: ``floor(60 / 7) = 8``): the repeat hits 70 tokens.
* A follow-up that extends the first request (prompt + answer + more) hits the whole
  inserted KV: its window is the one the tree kept.

The tokens with the hit equal the tokens without it in every case.
"""

from __future__ import annotations

import numpy as np
import pytest

from hicache_jax.engine import Engine, EngineCacheConfig
from hicache_jax.reference_model import ModelConfig

MODEL = ModelConfig(
    vocab_size=128,
    num_layers=2,
    hidden=32,
    num_heads=2,
    num_kv_heads=1,
    head_dim=16,
    ffn=64,
    layer_types="SF",
    sliding_window=15,
)
PAGE = 7


@pytest.fixture(scope="module")
def engine():
    e = Engine(
        MODEL, EngineCacheConfig(page_size=PAGE, device_pages=120, max_batch=1, prefill_chunk=16, max_context=160)
    )
    yield e
    e.close()


@pytest.mark.parametrize("length,new,repeat_hit", [(70, 1, 0), (70, 4, 0), (71, 1, 70), (71, 4, 70)])
def test_a_repeated_prompt_hits_what_the_window_rule_allows(engine, length, new, repeat_hit):
    prompt = np.random.default_rng(length * 10 + new).integers(0, MODEL.vocab_size, length).tolist()
    first = engine.generate([prompt], new)[0]
    assert first.cached_total == 0
    again = engine.generate([prompt], new)[0]
    assert again.cached_tokens == {"device": repeat_hit, "host": 0, "storage": 0}
    assert again.tokens == first.tokens
    follow_up = prompt + first.tokens + [5, 6, 7]
    got = engine.generate([follow_up], 2)[0]
    # The inserted KV: prompt + answer but its last token, whole pages.
    assert got.cached_tokens["device"] == (length + new - 1) // PAGE * PAGE
    assert got.tokens == engine.generate([follow_up], 2, use_cache=False)[0].tokens
    engine.cache.sanity_check(0, {"swa": 0})
