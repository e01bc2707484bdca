"""Device (L1) KV pool as torch tensors on ``npu`` / ``cuda`` / ``cpu``.

Per component one contiguous tensor ``(L, P, page, H, w)`` in the logical dtype, with
per-layer views ``layer(component, l)`` ``(P, page, H, w)``: the Ascend op needs all layers in
one contiguous 5-D tensor (upstream's NPU pools are laid out this way), while a forward pass
and the per-layer H2D load index one layer at a time. MLA under ``page_first_kv_split``
stores the latent as two tensors, lora and rope (``split_mla=True``); ``read``/``write`` still
speak the joined width.

Interface shared with ``NumpyDevicePool``: ``allocator``, ``num_pages``, ``geom``,
``read(component, ids)`` -> numpy ``(L, n, page, H, D)`` raw bits, ``write(component, ids, pages)``.
``write`` runs on the current stream (it stands in for the model writing KV).

Threading: the owner thread uses the pool; transfer engines touch only pages the manager has
reserved for a transfer.
"""

from __future__ import annotations

import numpy as np

from hicache_jax.allocator import PageAllocator, check_page_ids
from hicache_jax.kv_geometry import KVGeometry

from . import _lazy
from .devices import bits_dtype, logical_dtype, resolve_device
from .parts import Part

torch = _lazy.torch()


class TorchDevicePool:
    def __init__(
        self, geom: KVGeometry, num_pages: int, device: "str | torch.device" = "cpu", split_mla: bool = False
    ) -> None:
        if not isinstance(geom, KVGeometry):
            raise TypeError(f"geom: expected KVGeometry, got {type(geom).__name__}")
        if split_mla and geom.kind != "mla":
            raise ValueError("split_mla: only an MLA geometry has lora/rope parts")
        self.geom = geom
        self.device = resolve_device(device)
        self.allocator = PageAllocator(num_pages, name="device")
        self.num_pages = self.allocator.num_pages
        self.dtype = logical_dtype(geom)
        self.bits = bits_dtype(geom)
        self.split_mla = split_mla
        L, P, (page, H, W) = geom.num_layers, self.num_pages, geom.page_shape

        def alloc(width: int):
            return torch.zeros((L, P, page, H, width), dtype=self.dtype, device=self.device)

        if split_mla:
            lora = geom.kv_lora_rank
            self._parts = {"kv": [Part("kv_lora", alloc(lora), 0, lora), Part("kv_rope", alloc(W - lora), lora, W)]}
        else:
            self._parts = {c: [Part(c, alloc(W), 0, W)] for c in geom.components}
        self.buffers = {p.name: p.tensor for parts in self._parts.values() for p in parts}

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.buffers.values())

    def parts(self, component: str) -> list[Part]:
        try:
            return self._parts[component]
        except KeyError:
            raise ValueError(f"component: expected one of {self.geom.components}, got {component!r}") from None

    def layer(self, component: str, layer: int) -> list:
        """The tensors ``(P, page, H, w)`` of one layer of ``component`` (views; one per part)."""
        return [p.tensor[layer] for p in self.parts(component)]

    # ---- host-side access (tests, the oracle; what a model step would do) -------------------
    def write(self, component: str, device_ids: object, pages: np.ndarray) -> None:
        """Write ``pages`` ``(L, n, page, H, D)`` (any dtype of the KV width) into ``device_ids``."""
        ids = check_page_ids(device_ids, self.num_pages, "device_ids")
        parts = self.parts(component)
        g = self.geom
        pages = np.asarray(pages)
        expected = (g.num_layers, ids.size) + g.page_shape
        if pages.shape != expected:
            raise ValueError(f"pages: expected shape {expected}, got {pages.shape}")
        if pages.dtype.itemsize != g.itemsize:
            raise TypeError(f"pages: expected {g.itemsize}-byte elements ({g.dtype}), got {pages.dtype}")
        src = torch.from_numpy(np.ascontiguousarray(pages).view(g.container_dtype).view(f"i{g.itemsize}"))
        idx = torch.from_numpy(ids.astype(np.int64)).to(self.device)
        src = src.to(self.device)
        for p in parts:
            p.tensor.view(self.bits).index_copy_(1, idx, src[..., p.lo : p.hi])

    def read(self, component: str, device_ids: object) -> np.ndarray:
        """Pages ``(L, n, page, H, D)`` as raw bits (the geometry's container dtype); a copy."""
        ids = check_page_ids(device_ids, self.num_pages, "device_ids", unique=False)
        idx = torch.from_numpy(ids.astype(np.int64)).to(self.device)
        got = [p.tensor.view(self.bits).index_select(1, idx) for p in self.parts(component)]
        out = torch.cat(got, dim=-1) if len(got) > 1 else got[0]
        return out.cpu().numpy().view(self.geom.container_dtype)
