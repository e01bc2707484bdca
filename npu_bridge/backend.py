"""``make_torch_backend``: (device pool, host pool, engine), mirroring ``make_numpy_backend``."""

from __future__ import annotations

from hicache_jax.host_layout import HostLayout
from hicache_jax.kv_geometry import KVGeometry

from .device_pool import TorchDevicePool
from .host_memory import parse_layout, torch_host_pool
from .kv_split_pool import KV_SPLIT_NAME
from .transfer import TorchTransferEngine


def make_torch_backend(
    geom: KVGeometry,
    device_pages: int,
    host_pages: int,
    layout: "HostLayout | str" = HostLayout.PAGE_FIRST,
    device="cpu",
    deferred: bool = False,
    impl: str = "auto",
    op=None,
):
    """Convenience: (TorchDevicePool, host pool, TorchTransferEngine) on ``device``.

    ``layout`` is a HostLayout or ``'page_first_kv_split'`` (MLA; the device pool then keeps the
    lora and rope parts apart, as the Ascend op expects).
    """
    split = parse_layout(layout) == KV_SPLIT_NAME
    dev = TorchDevicePool(geom, device_pages, device, split_mla=split)
    host = torch_host_pool(geom, host_pages, layout, dev.device)
    return dev, host, TorchTransferEngine(dev, host, impl=impl, deferred=deferred, op=op)
