"""The serving benchmarks' GPU preset (Llama-3-8B's layer shape, bf16 KV): its shape and KV bytes,
``--model auto`` per backend, ``--layers``, and the reference engine building it on the CPU and
serving a tiny prompt with the same tokens cold, from L1 and from L2 (one layer: a smoke test,
not an 8B-shape benchmark on the CPU)."""

from __future__ import annotations

import argparse

import pytest

from hicache_jax.bench import serving
from hicache_jax.reference_model.config import LLAMA3_8B_SHAPE, LLAMA3_8B_SHAPE_TINY


def _args(model: str = "auto", layers: int | None = None) -> argparse.Namespace:
    return argparse.Namespace(model=model, layers=layers, attention="mha")


def test_llama3_shape_preset_has_the_layer_shape_and_kv_bytes():
    cfg = serving.MODEL_PRESETS["llama3-8b-shape"]
    assert cfg is LLAMA3_8B_SHAPE
    assert (cfg.vocab_size, cfg.hidden, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.ffn) == (
        32000,
        4096,
        32,
        8,
        128,
        14336,
    )
    assert cfg.kv_dtype == "bfloat16" and cfg.num_layers == 8 and not cfg.is_hybrid
    # Llama-3-8B keeps 4 KiB of KV per token per layer (K and V, 8 heads x 128, bf16): 32 KiB for 8.
    assert cfg.kv_geometry(16).bytes_per_token == 32 * 1024
    tiny = serving.MODEL_PRESETS["llama3-8b-shape-tiny"]
    assert tiny is LLAMA3_8B_SHAPE_TINY
    # the same kind: 4:1 grouped-query attention, FFN 3.5x hidden, bf16 KV
    assert tiny.kv_dtype == "bfloat16" and tiny.num_heads == 4 * tiny.num_kv_heads and tiny.ffn * 2 == 7 * tiny.hidden


def test_auto_model_is_the_gpu_preset_on_an_accelerator_and_bench_on_the_cpu(monkeypatch):
    args = _args()
    assert serving.model_config(args) is serving.MODEL_PRESETS["bench"]  # this test runs on the CPU
    assert args.model == "bench"
    for backend in ("gpu", "tpu"):
        monkeypatch.setattr(serving, "_backend", lambda b=backend: b)
        args = _args()
        assert serving.model_config(args) is LLAMA3_8B_SHAPE and args.model == "llama3-8b-shape"
    args = _args("tiny")  # a preset given by name is kept on every backend
    assert serving.model_config(args) is serving.MODEL_PRESETS["tiny"] and args.model == "tiny"


def test_layers_option_changes_the_layer_count_only():
    cfg = serving.model_config(_args("llama3-8b-shape", layers=3))
    assert cfg.num_layers == 3 and cfg.kv_geometry(16).bytes_per_token == 3 * 4096
    assert cfg == LLAMA3_8B_SHAPE.__class__(**{**vars(LLAMA3_8B_SHAPE), "num_layers": 3, "layer_types": "F"})
    hybrid = serving.model_config(_args("hybrid", layers=4))  # the sliding / full pattern repeats
    assert hybrid.layer_types == ("sliding", "full", "sliding", "full")
    with pytest.raises(ValueError, match="at least one 'full' layer"):
        serving.model_config(_args("hybrid", layers=1))


def test_reference_engine_builds_the_gpu_preset_on_the_cpu():
    """One layer of the 8B shape (about 0.5 G fp32 weights), a 40-token prompt: the same greedy
    tokens cold, from an L1 hit and from an L2 hit, with the KV kept in bf16."""
    import numpy as np

    from hicache_jax.engine import Engine, EngineCacheConfig
    from hicache_jax.host_pool import HostPoolConfig

    cfg = serving.model_config(_args("llama3-8b-shape", layers=1))
    engine = Engine(
        cfg,
        EngineCacheConfig(
            page_size=16, device_pages=16, host=HostPoolConfig(ratio=2.0), max_batch=1, prefill_chunk=64, max_context=64
        ),
    )
    try:
        assert engine.geom.dtype == "bfloat16" and engine.geom.num_kv_heads == 8 and engine.geom.head_dim == 128
        prompt = np.random.default_rng(0).integers(0, cfg.vocab_size, 40).tolist()
        cold = engine.generate([prompt], 3, use_cache=False)[0]
        assert all(0 <= t < cfg.vocab_size for t in cold.tokens) and len(cold.tokens) == 3
        engine.generate([prompt], 3)  # fills the cache
        l1 = engine.generate([prompt], 3)[0]
        assert l1.cached_tokens["device"] == 32 and l1.tokens == cold.tokens
        engine.evict_device_cache()
        l2 = engine.generate([prompt], 3)[0]
        assert l2.cached_tokens["host"] == 32 and l2.tokens == cold.tokens
    finally:
        engine.close()
