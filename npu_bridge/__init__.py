"""npu_bridge: drives the pure-Python hicache_jax manager on Ascend NPUs (and CUDA, CPU) through torch.

Importing this package imports neither torch nor torch_npu: the names below load their
modules on first access (``_lazy`` raises a clear error naming what is missing). Modules:

* ``devices``: device resolution via ``torch.get_device_module``; dtype views.
* ``device_pool``: ``TorchDevicePool`` (L1, per layer per component tensors).
* ``host_memory``: ``torch_host_pool`` (L2, pinned where the device supports it).
* ``kv_split_pool``: ``KVSplitHostPool``, the Ascend MLA layout ``page_first_kv_split`` (numpy only).
* ``ascend_op``: the sgl-kernel-npu transfer op: signature binding and a CPU reference.
* ``transfer``: ``TorchTransferEngine`` (side streams, events, per-layer readiness, deferred mode).
* ``backend``: ``make_torch_backend`` (mirrors ``make_numpy_backend``).
* ``bench_transfer_torch``: D2H / H2D throughput (``python -m npu_bridge.bench_transfer_torch``).
"""

from __future__ import annotations

import importlib

_LAZY = {
    "make_torch_backend": "backend",
    "TorchDevicePool": "device_pool",
    "TorchTransferEngine": "transfer",
    "TorchLoadHandle": "transfer",
    "torch_host_pool": "host_memory",
    "KVSplitHostPool": "kv_split_pool",
    "transfer_kv_dim_exchange_reference": "ascend_op",
    "MissingDependencyError": "_lazy",
}

__all__ = sorted(_LAZY)  # noqa: PLE0605 (a list: the lazy table's names)


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
