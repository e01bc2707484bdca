"""Reference model configuration (validated at construction).

Hybrid models: ``layer_types`` names each layer ``"full"`` (causal attention over the whole
prefix) or ``"sliding"`` (attention over the last ``sliding_window`` positions, the current one
included: see ``window``). The two kinds keep their KV in two pools: the full layers in the
pool of ``kv_geometry(page)``, the sliding layers in an SWA pool of ``swa_kv_geometry(page)``,
with its own page ids. ``swa_as_full=True`` keeps the same layers and weights but keeps every
layer's KV in the full pool: the "SWA as full" memory baseline. The reference family (random
weights: no trained model to stay faithful to) then runs its sliding layers as full attention; a
real model's family (``gemma3``) keeps each layer's window as trained, so only where its KV lives
changes and the tokens stay the same (``attention_window``).

``family``: which module family runs the config: ``"reference"`` (``reference_model.model``,
weights from the seed) or ``"gemma3"`` (``models.gemma3.paged``: Gemma 3's blocks, weights from
a checkpoint; ``rope_theta`` is then the full layers' RoPE base, ``rope_theta_local`` the sliding
layers', ``query_pre_attn_scalar`` the score scale's base, ``rms_norm_eps`` its norms' epsilon).
``max_positions``: the longest context the model was trained for (None: no limit; the engine
refuses a larger ``max_context``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from ..kv_geometry import KVGeometry

LayerType = Literal["full", "sliding"]
FAMILIES = ("reference", "gemma3")
_PATTERN_CHARS = {"F": "full", "S": "sliding"}


def _layer_types(value: object, num_layers: int) -> tuple[str, ...]:
    """Normalize ``layer_types`` (a tuple of per-layer kinds or an 'F'/'S' pattern) to a tuple."""
    if isinstance(value, str):
        if not value or set(value) - set(_PATTERN_CHARS):
            raise ValueError(
                f"layer_types: a pattern string must be made of 'F' (full) and 'S' (sliding), got {value!r}"
            )
        if len(value) > num_layers:
            raise ValueError(f"layer_types: pattern {value!r} is longer than num_layers {num_layers}")
        return tuple(_PATTERN_CHARS[value[i % len(value)]] for i in range(num_layers))
    if not isinstance(value, (tuple, list)):
        raise TypeError(
            f"layer_types: expected a tuple of 'full'/'sliding' or an 'F'/'S' pattern string, "
            f"got {type(value).__name__}"
        )
    if len(value) != num_layers:
        raise ValueError(f"layer_types: expected {num_layers} entries (num_layers), got {len(value)}")
    for i, kind in enumerate(value):
        if kind not in ("full", "sliding"):
            raise ValueError(f"layer_types[{i}]: expected 'full' or 'sliding', got {kind!r}")
    return tuple(value)


@dataclass(frozen=True)
class ModelConfig:
    """Shape of the reference transformer. ``attention='mla'`` stores one latent KV per token
    (width ``kv_lora_rank + qk_rope_head_dim``) instead of per-head K and V.

    ``layer_types``: per layer ``"full"`` or ``"sliding"``, as a tuple of ``num_layers`` entries
    or a pattern string of ``'F'``/``'S'`` repeated to ``num_layers`` (``"SF"``: alternating,
    sliding first, as gpt-oss; ``"SSSSSF"``: Gemma 3's five sliding to one full). Stored as
    the tuple. At least one layer must be full (the full pool keys the prefix cache).
    ``sliding_window``: the window ``W`` in tokens, required exactly when a layer slides.
    ``swa_as_full``: run the sliding layers as full attention (same weights, KV in the full pool).
    """

    vocab_size: int = 512
    num_layers: int = 2
    hidden: int = 128
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    ffn: int = 256
    attention: Literal["mha", "mla"] = "mha"
    kv_lora_rank: int = 64
    qk_rope_head_dim: int = 16
    qk_nope_head_dim: int = 32
    v_head_dim: int = 32
    rope_theta: float = 10000.0
    kv_dtype: str = "float32"
    seed: int = 0
    layer_types: tuple[LayerType, ...] | str = "F"
    sliding_window: int | None = None
    swa_as_full: bool = False
    family: Literal["reference", "gemma3"] = "reference"
    rope_theta_local: float | None = None
    query_pre_attn_scalar: float | None = None
    rms_norm_eps: float = 1e-6
    max_positions: int | None = None

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "num_layers",
            "hidden",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "ffn",
            "kv_lora_rank",
            "qk_rope_head_dim",
            "qk_nope_head_dim",
            "v_head_dim",
        ):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"{name}: expected an int, got {type(v).__name__}")
            if v < 1:
                raise ValueError(f"{name}: expected >= 1, got {v}")
        if self.attention not in ("mha", "mla"):
            raise ValueError(f"attention: expected 'mha' or 'mla', got {self.attention!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_kv_heads: {self.num_kv_heads} must divide num_heads {self.num_heads}")
        if self.head_dim % 2 or self.qk_rope_head_dim % 2:
            raise ValueError("head_dim and qk_rope_head_dim: expected even sizes (rotary embedding)")
        KVGeometry.mha(1, 1, 1, 1, self.kv_dtype)  # validates kv_dtype
        types = _layer_types(self.layer_types, self.num_layers)
        object.__setattr__(self, "layer_types", types)
        if "full" not in types:
            raise ValueError(
                f"layer_types: expected at least one 'full' layer (the full pool keys the prefix cache), got {types}"
            )
        sliding = "sliding" in types
        if self.sliding_window is None:
            if sliding:
                raise ValueError(
                    "sliding_window: required (the window in tokens) when layer_types has a 'sliding' layer"
                )
        elif isinstance(self.sliding_window, bool) or not isinstance(self.sliding_window, int):
            raise TypeError(f"sliding_window: expected an int or None, got {type(self.sliding_window).__name__}")
        elif not sliding:
            raise ValueError(f"sliding_window: {self.sliding_window} given but layer_types has no 'sliding' layer")
        elif self.sliding_window < 1:
            raise ValueError(f"sliding_window: expected >= 1, got {self.sliding_window}")
        if not isinstance(self.swa_as_full, bool):
            raise TypeError(f"swa_as_full: expected a bool, got {type(self.swa_as_full).__name__}")
        if self.max_positions is not None and (
            isinstance(self.max_positions, bool) or not isinstance(self.max_positions, int) or self.max_positions < 2
        ):
            raise ValueError(f"max_positions: expected None or an int >= 2, got {self.max_positions!r}")
        if self.family not in FAMILIES:
            raise ValueError(f"family: expected one of {list(FAMILIES)}, got {self.family!r}")
        if self.family != "reference" and self.attention != "mha":
            raise ValueError(f"attention: family {self.family!r} has per-head K/V ('mha'), got {self.attention!r}")
        for name in ("rope_theta", "rope_theta_local", "query_pre_attn_scalar", "rms_norm_eps"):
            v = getattr(self, name)
            if v is None and name in ("rope_theta_local", "query_pre_attn_scalar"):
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise TypeError(f"{name}: expected a number, got {type(v).__name__}")
            if not math.isfinite(v) or v <= 0:
                raise ValueError(f"{name}: expected a positive finite number, got {v!r}")

    # ---- which layer keeps its KV where ---------------------------------------------------
    @property
    def swa_layers(self) -> tuple[int, ...]:
        """Layers that attend over the sliding window and keep KV in the SWA pool (none when
        ``swa_as_full``)."""
        if self.swa_as_full:
            return ()
        return tuple(i for i, t in enumerate(self.layer_types) if t == "sliding")

    @property
    def full_layers(self) -> tuple[int, ...]:
        """Layers that attend over the whole prefix and keep KV in the full pool."""
        swa = set(self.swa_layers)
        return tuple(i for i in range(self.num_layers) if i not in swa)

    @property
    def is_hybrid(self) -> bool:
        """True when some layer uses the SWA pool (the step then needs SWA pools and tables)."""
        return bool(self.swa_layers)

    def attention_window(self, layer: int) -> int | None:
        """The window layer ``layer`` attends over (None: the whole prefix). A sliding layer
        keeps its window in the SWA pool, and in the full pool under ``swa_as_full`` except for
        the reference family (see the module docstring)."""
        if self.layer_types[layer] != "sliding" or (self.swa_as_full and self.family == "reference"):
            return None
        return self.sliding_window

    def pool_slot(self, layer: int) -> tuple[str, int]:
        """``("full" | "swa", index)``: the pool a layer's KV lives in and its layer index there."""
        swa = self.swa_layers
        if layer in swa:
            return "swa", swa.index(layer)
        return "full", self.full_layers.index(layer)

    # ---- geometries -------------------------------------------------------------------------
    def _geometry(self, num_layers: int, page_size: int) -> KVGeometry:
        if self.attention == "mha":
            return KVGeometry.mha(num_layers, page_size, self.num_kv_heads, self.head_dim, self.kv_dtype)
        return KVGeometry.mla(num_layers, page_size, self.kv_lora_rank, self.qk_rope_head_dim, self.kv_dtype)

    def kv_geometry(self, page_size: int) -> KVGeometry:
        """The paged-KV geometry of the full pool: the full-attention layers only (every layer
        for a non-hybrid model or with ``swa_as_full``)."""
        return self._geometry(len(self.full_layers), page_size)

    def swa_kv_geometry(self, page_size: int) -> KVGeometry | None:
        """The paged-KV geometry of the SWA pool (the sliding layers only); None when no layer
        uses it."""
        return self._geometry(len(self.swa_layers), page_size) if self.is_hybrid else None


# Hybrid presets (alternating sliding / full layers as gpt-oss, whose window is 128 tokens).
# HYBRID_TINY: tests and smoke runs. HYBRID_BENCH: the serving benchmark's "bench" shape (sized
# for a 2-core CPU) with half its layers sliding.
HYBRID_TINY = ModelConfig(
    vocab_size=512,
    num_layers=2,
    hidden=64,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    ffn=128,
    layer_types="SF",
    sliding_window=24,
)
HYBRID_BENCH = ModelConfig(
    vocab_size=2048,
    num_layers=10,
    hidden=512,
    num_heads=8,
    num_kv_heads=2,
    head_dim=64,
    ffn=2048,
    layer_types="SF",
    sliding_window=128,
)

# Llama-3-8B's layer shape (hidden 4096, 32 query / 8 KV heads x 128, SwiGLU FFN 14336) with a
# 32000-token vocabulary and bf16 KV, for the serving benchmarks on a GPU: per layer the work and
# the KV bytes (4 KiB per token) equal Llama-3-8B's, so hit / cold ratios are the full model's but
# for fixed per-request overheads. 8 layers by default (32 KiB of KV per token); the benchmarks'
# ``--layers`` changes the count. Random weights from the seed, like every preset (no downloads).
LLAMA3_8B_SHAPE = ModelConfig(
    vocab_size=32000,
    num_layers=8,
    hidden=4096,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    ffn=14336,
    kv_dtype="bfloat16",
)
# The same kind at tiny sizes (4:1 grouped-query attention, FFN 3.5x hidden, bf16 KV): what
# ``--quick`` runs instead, in seconds on a CPU.
LLAMA3_8B_SHAPE_TINY = ModelConfig(
    vocab_size=512, num_layers=2, hidden=128, num_heads=8, num_kv_heads=2, head_dim=16, ffn=448, kv_dtype="bfloat16"
)
