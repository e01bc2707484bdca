"""The Ascend MLA host layout ``page_first_kv_split`` as a host pool (numpy only, no torch).

Upstream's NPU MLA host pool keeps the latent's two parts in separate arrays (upstream sglang's
2.4 / 7.1): ``k`` ``(page_num, L, page, 1, kv_lora_rank)`` and ``v`` ``(page_num, L, page, 1,
rope)``, so the Ascend op can move both with one call, one 2-D copy per page per tensor.
(Upstream also has index_k / scale arrays for NSA indexers; this geometry has none.)

``KVSplitHostPool`` exposes the same interface as ``HostKVPool`` for the geometry's single
component ``'kv'``: ``write_pages`` / ``read_pages`` / ``read_layer`` take and return the
*joined* width ``lora + rope`` in transfer order ``nlp`` ``(n, L, page, 1, d)``, splitting and
joining on the last axis. There is no single page-major view (the parts live in two arrays),
so ``component_view`` raises; ``part_views`` gives the two arrays.

It is not a ``HostLayout`` member on purpose: the shared tests iterate ``list(HostLayout)``
with MHA geometries and JAX engines, neither of which has this layout.

Threading: as HostKVPool (disjoint page ids may be written concurrently by transfer workers).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hicache_jax.allocator import PageAllocator
from hicache_jax.host_pool import HostKVPool
from hicache_jax.kv_geometry import KVGeometry


@dataclass(frozen=True)
class SplitLayout:
    """Stands in for a HostLayout: ``value`` and ``transfer_order`` are what callers read."""

    value: str = "page_first_kv_split"
    transfer_order: str = "nlp"

    def __str__(self) -> str:
        return self.value


KV_SPLIT = SplitLayout()
KV_SPLIT_NAME = KV_SPLIT.value


def split_part_shapes(geom: KVGeometry, num_pages: int) -> dict[str, tuple[int, ...]]:
    """Shapes of the two host arrays: ``{'k': (..., lora), 'v': (..., rope)}``."""
    if geom.kind != "mla":
        raise ValueError(
            f"layout {KV_SPLIT_NAME!r} is for MLA only (upstream raises for other combinations); "
            f"got a {geom.kind} geometry"
        )
    base = (num_pages, geom.num_layers, geom.page_size, 1)
    return {"k": base + (geom.kv_lora_rank,), "v": base + (geom.qk_rope_head_dim,)}


class KVSplitHostPool(HostKVPool):
    """MLA host pool with separate lora (``k``) and rope (``v``) arrays."""

    def __init__(
        self,
        geom: KVGeometry,
        num_pages: int,
        buffers: dict[str, np.ndarray] | None = None,
        buffer_owner: object = None,
    ) -> None:  # noqa: D107 - HostKVPool.__init__ is not reused
        if not isinstance(geom, KVGeometry):
            raise TypeError(f"geom: expected KVGeometry, got {type(geom).__name__}")
        shapes = split_part_shapes(geom, num_pages)
        self.geom = geom
        self.layout = KV_SPLIT
        self.allocator = PageAllocator(num_pages, name="host")
        self.num_pages = self.allocator.num_pages
        if buffers is None:
            buffers = {p: np.zeros(s, geom.container_dtype) for p, s in shapes.items()}
        for p, s in shapes.items():
            b = buffers.get(p)
            if (
                not isinstance(b, np.ndarray)
                or b.shape != s
                or b.dtype != geom.container_dtype
                or not b.flags.c_contiguous
                or not b.flags.writeable
            ):
                got = f"{b.dtype} {b.shape}" if isinstance(b, np.ndarray) else type(b).__name__
                raise ValueError(
                    f"buffers[{p!r}]: expected a writable C-contiguous {geom.container_dtype} array "
                    f"of shape {s}, got {got}"
                )
        self.arrays = {p: buffers[p] for p in shapes}
        self.array = None  # no single array in this layout; see ``arrays``
        self._buffer_owner = buffer_owner
        self._lora = geom.kv_lora_rank

    @classmethod
    def from_config(cls, geom: KVGeometry, config, device_pages: int) -> "KVSplitHostPool":
        return cls(geom, config.num_pages(geom, device_pages))  # the config's layout is implied

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays.values())

    def part_views(self, component: str) -> dict[str, np.ndarray]:
        self._check_component(component)
        return self.arrays

    def component_view(self, component: str) -> np.ndarray:
        raise NotImplementedError(
            f"{KV_SPLIT_NAME}: the lora and rope parts live in separate arrays; use part_views() or read_pages()"
        )

    def _check_component(self, component: str) -> None:
        if component not in self.geom.components:
            raise ValueError(f"component: expected one of {self.geom.components}, got {component!r}")

    def write_pages(self, component: str, host_ids: object, buf: np.ndarray) -> None:
        self.write_pages_unchecked(component, self._check_ids(host_ids, unique=True), buf)

    def write_pages_unchecked(self, component: str, ids: np.ndarray, buf: np.ndarray) -> None:
        """``write_pages`` for ids an engine already validated."""
        self._check_component(component)
        g = self.geom
        expected = (ids.size, g.num_layers, g.page_size, 1, g.width)
        buf = np.asarray(buf)
        if buf.shape != expected:
            raise ValueError(
                f"buf: expected shape {expected} for {ids.size} pages in {KV_SPLIT_NAME} order, got {buf.shape}"
            )
        if buf.dtype.itemsize != g.itemsize:
            raise TypeError(f"buf: expected {g.itemsize}-byte elements ({g.dtype}), got {buf.dtype}")
        buf = buf.view(g.container_dtype)
        self.arrays["k"][ids] = buf[..., : self._lora]
        self.arrays["v"][ids] = buf[..., self._lora :]

    def read_pages(self, component: str, host_ids: object, out: np.ndarray | None = None) -> np.ndarray:
        self._check_component(component)
        ids = self._check_ids(host_ids, unique=False)
        parts = (self.arrays["k"][ids], self.arrays["v"][ids])
        return np.concatenate(parts, axis=-1, out=out)

    def read_layer(self, component: str, host_ids: object, layer: int) -> np.ndarray:
        return self.read_layer_unchecked(component, self._check_ids(host_ids, unique=False), layer)

    def read_layer_unchecked(self, component: str, ids: np.ndarray, layer: int) -> np.ndarray:
        """``read_layer`` for ids an engine already validated."""
        self._check_component(component)
        if not 0 <= layer < self.geom.num_layers:
            raise ValueError(f"layer: expected 0 <= layer < {self.geom.num_layers}, got {layer}")
        return np.concatenate((self.arrays["k"][ids, layer], self.arrays["v"][ids, layer]), axis=-1)
