"""Host (L2) pools backed by torch tensors, pinned when the device supports it.

The pool object is the shared numpy ``HostKVPool`` (or ``KVSplitHostPool`` for the Ascend MLA
layout) built over a numpy view of one torch allocation, so the manager and the tests see
the usual numpy pool while the engine copies through the torch tensor (``pool.torch_parts``),
which is what non-blocking H2D/D2H and the Ascend op need (they must see pinned memory, and a
tensor made with ``torch.from_numpy`` over the same bytes may not report itself pinned).

Pinning: requested with ``pin_memory=True`` iff ``device.type != "cpu"`` (a CPU-only torch
raises on it). On NPU, torch_npu serves it with ``aclrtMallocHost`` through a caching host
allocator that may **round the size up to a power of two** (as upstream sglang's NPU host pools assume; unverified on
hardware): a 100 GB pool can reserve 128 GB. ``pool.pinned_bytes_upper_bound`` states that
bound and a warning is logged when rounding could waste more than a quarter;
``PYTORCH_NPU_ALLOC_CONF=pinned_max_round_threshold_mb:<n>`` caps the rounding. Size the pool
(``HostPoolConfig.size_bytes``) with that in mind.
"""

from __future__ import annotations

import logging

from hicache_jax.host_layout import HostLayout, host_array_shape, page_major_shape
from hicache_jax.host_pool import HostKVPool
from hicache_jax.kv_geometry import KVGeometry

from . import _lazy
from .devices import bits_dtype, resolve_device, supports_pinned
from .kv_split_pool import KV_SPLIT_NAME, KVSplitHostPool, split_part_shapes
from .parts import Part

torch = _lazy.torch()
log = logging.getLogger(__name__)


def parse_layout(layout: "str | HostLayout") -> "HostLayout | str":
    """A HostLayout, or the string ``'page_first_kv_split'`` (not a HostLayout member)."""
    if str(getattr(layout, "value", layout)) == KV_SPLIT_NAME:
        return KV_SPLIT_NAME
    return HostLayout.parse(layout)


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _alloc(shape: tuple[int, ...], dtype, pin: bool):
    t = torch.empty(shape, dtype=dtype, pin_memory=pin)
    t.zero_()
    return t


def torch_host_pool(
    geom: KVGeometry, num_pages: int, layout: "str | HostLayout" = "page_first", device: "str | torch.device" = "cpu"
) -> HostKVPool:
    """A host pool for ``device``: pinned torch memory on accelerators, plain torch memory on CPU.

    Adds to the pool: ``torch_parts`` ({component: [Part]} page-major torch views sharing the
    pool's bytes), ``pinned`` (pinning requested), ``torch_device`` and
    ``pinned_bytes_upper_bound``.
    """
    device = resolve_device(device)
    pin = supports_pinned(device)
    layout = parse_layout(layout)
    bits = bits_dtype(geom)
    if layout == KV_SPLIT_NAME:
        shapes = split_part_shapes(geom, num_pages)
        tensors = {p: _alloc(s, bits, pin) for p, s in shapes.items()}
        pool = KVSplitHostPool(
            geom, num_pages, {p: t.numpy().view(geom.container_dtype) for p, t in tensors.items()}, buffer_owner=tensors
        )
        lora = geom.kv_lora_rank
        parts = {"kv": [Part("kv_lora", tensors["k"], 0, lora), Part("kv_rope", tensors["v"], lora, geom.width)]}
        sizes = [t.numel() * t.element_size() for t in tensors.values()]
    else:
        shape = host_array_shape(geom, layout, num_pages)
        t = _alloc(shape, bits, pin)
        pool = HostKVPool(geom, num_pages, layout, buffer=t.numpy().view(geom.container_dtype), buffer_owner=t)
        per_comp = t if geom.kind == "mha" else t[None]
        pm = page_major_shape(geom, layout, num_pages)
        parts = {c: [Part(c, per_comp[i].reshape(pm), 0, geom.width)] for i, c in enumerate(geom.components)}
        sizes = [t.numel() * t.element_size()]
    pool.torch_parts = parts
    pool.torch_device = device
    pool.pinned = pin
    bound = sum(_next_pow2(s) for s in sizes) if (pin and device.type == "npu") else sum(sizes)
    pool.pinned_bytes_upper_bound = bound
    if bound > 1.25 * sum(sizes):
        log.warning(
            "host pool: %d bytes pinned on NPU may reserve up to %d bytes (power-of-two rounding); "
            "see PYTORCH_NPU_ALLOC_CONF=pinned_max_round_threshold_mb",
            sum(sizes),
            bound,
        )
    return pool
