"""Reference model configuration (validated at construction)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ..kv_geometry import KVGeometry


@dataclass(frozen=True)
class ModelConfig:
    """Shape of the reference transformer. ``attention='mla'`` stores one latent KV per token
    (width ``kv_lora_rank + qk_rope_head_dim``) instead of per-head K and V."""

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

    def __post_init__(self) -> None:
        for name in ("vocab_size", "num_layers", "hidden", "num_heads", "num_kv_heads", "head_dim", "ffn",
                     "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"):
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

    def kv_geometry(self, page_size: int) -> KVGeometry:
        """The paged-KV geometry this model writes."""
        if self.attention == "mha":
            return KVGeometry.mha(self.num_layers, page_size, self.num_kv_heads, self.head_dim, self.kv_dtype)
        return KVGeometry.mla(self.num_layers, page_size, self.kv_lora_rank, self.qk_rope_head_dim, self.kv_dtype)
