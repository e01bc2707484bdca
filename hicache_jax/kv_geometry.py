"""Shape and dtype of one paged KV cache, shared by every pool and backend.

Pure Python + numpy. A `KVGeometry` says what one page holds; pools, host layouts,
transfer engines and (later) storage keys all derive their shapes and byte counts
from it, so they cannot disagree.

Two attention kinds:

* ``mha``: per layer a K and a V buffer, each page ``(page_size, num_kv_heads, head_dim)``.
* ``mla``: per layer one latent buffer ``kv``, each page ``(page_size, 1, kv_lora_rank + qk_rope_head_dim)``.

KV bytes are moved as raw bits: every dtype maps to an unsigned "container" dtype of the
same width (bf16 -> uint16, fp8 -> uint8), so numpy and the copy kernels never need to
understand bfloat16 or float8.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from ._checks import check_int

# Logical dtype name -> (itemsize, container dtype for raw bits).
KV_DTYPES: dict[str, tuple[int, np.dtype]] = {
    "bfloat16": (2, np.dtype(np.uint16)),
    "float16": (2, np.dtype(np.uint16)),
    "float32": (4, np.dtype(np.uint32)),
    "float8_e4m3fn": (1, np.dtype(np.uint8)),
}
DTYPE_ALIASES = {
    "bf16": "bfloat16",
    "fp16": "float16",
    "fp32": "float32",
    "fp8": "float8_e4m3fn",
    "fp8_e4m3": "float8_e4m3fn",
    "float8_e4m3": "float8_e4m3fn",
}

AttentionKind = Literal["mha", "mla"]
MAX_DIM = (1 << 31) - 1  # every dimension of a page fits an int32 (kernels index with int32)


def canonical_dtype(dtype: object) -> str:
    """Return the canonical KV dtype name for ``dtype`` (a name, numpy or JAX dtype)."""
    name = getattr(dtype, "name", None) or getattr(getattr(dtype, "dtype", None), "name", None) or str(dtype)
    name = DTYPE_ALIASES.get(name, name)
    if name not in KV_DTYPES:
        raise ValueError(f"dtype: expected one of {sorted(KV_DTYPES)} (or {sorted(DTYPE_ALIASES)}), got {dtype!r}")
    return name


@dataclass(frozen=True)
class KVGeometry:
    """What one page of KV holds. Validated at construction."""

    kind: AttentionKind
    num_layers: int
    page_size: int
    dtype: str = "bfloat16"
    num_kv_heads: int = 1  # mha only
    head_dim: int = 128  # mha only
    kv_lora_rank: int = 0  # mla only
    qk_rope_head_dim: int = 0  # mla only

    def __post_init__(self) -> None:
        if self.kind not in ("mha", "mla"):
            raise ValueError(f"kind: expected 'mha' or 'mla', got {self.kind!r}")
        check_int("num_layers", self.num_layers, 1, MAX_DIM)
        check_int("page_size", self.page_size, 1, MAX_DIM)
        object.__setattr__(self, "dtype", canonical_dtype(self.dtype))
        if self.kind == "mha":
            check_int("num_kv_heads", self.num_kv_heads, 1, MAX_DIM)
            check_int("head_dim", self.head_dim, 1, MAX_DIM)
        else:
            check_int("kv_lora_rank", self.kv_lora_rank, 1, MAX_DIM)
            check_int("qk_rope_head_dim", self.qk_rope_head_dim, 0, MAX_DIM)

    @classmethod
    def mha(
        cls, num_layers: int, page_size: int, num_kv_heads: int, head_dim: int, dtype: str = "bfloat16"
    ) -> "KVGeometry":
        return cls("mha", num_layers, page_size, dtype, num_kv_heads=num_kv_heads, head_dim=head_dim)

    @classmethod
    def mla(
        cls, num_layers: int, page_size: int, kv_lora_rank: int, qk_rope_head_dim: int, dtype: str = "bfloat16"
    ) -> "KVGeometry":
        return cls(
            "mla",
            num_layers,
            page_size,
            dtype,
            num_kv_heads=1,
            head_dim=kv_lora_rank + qk_rope_head_dim,
            kv_lora_rank=kv_lora_rank,
            qk_rope_head_dim=qk_rope_head_dim,
        )

    # ---- derived -------------------------------------------------------------------------
    @property
    def components(self) -> tuple[str, ...]:
        """Buffers per layer: ('k', 'v') for MHA, ('kv',) for MLA."""
        return ("k", "v") if self.kind == "mha" else ("kv",)

    @property
    def heads(self) -> int:
        return self.num_kv_heads if self.kind == "mha" else 1

    @property
    def width(self) -> int:
        return self.head_dim if self.kind == "mha" else self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def page_shape(self) -> tuple[int, int, int]:
        """Shape of one page of one component in one layer: (page_size, heads, width)."""
        return (self.page_size, self.heads, self.width)

    @property
    def itemsize(self) -> int:
        return KV_DTYPES[self.dtype][0]

    @property
    def container_dtype(self) -> np.dtype:
        """Unsigned integer dtype of the same width, used to move raw KV bits."""
        return KV_DTYPES[self.dtype][1]

    @property
    def page_elems(self) -> int:
        """Elements of one page of one component in one layer."""
        return self.page_size * self.heads * self.width

    @property
    def bytes_per_token(self) -> int:
        """KV bytes of one token across all layers and components."""
        return self.num_layers * len(self.components) * self.heads * self.width * self.itemsize

    @property
    def bytes_per_page(self) -> int:
        return self.bytes_per_token * self.page_size

    def numpy_dtype(self) -> np.dtype:
        """The logical dtype as numpy sees it (needs ml_dtypes for bf16/fp8)."""
        if self.dtype in ("float16", "float32"):
            return np.dtype(self.dtype)
        try:
            import ml_dtypes
        except ImportError as e:  # pragma: no cover - ml_dtypes ships with jax
            raise ImportError(f"viewing {self.dtype} KV as numpy needs the ml_dtypes package") from e
        return np.dtype(getattr(ml_dtypes, self.dtype))
