"""hicache_jax: a hierarchical KV cache (device HBM -> host DRAM -> persistent storage) for JAX serving stacks.

This package imports with numpy alone. JAX lives in ``hicache_jax.backends.jax`` (and the
``pallas_kernels`` package); torch lives in ``npu_bridge``. Neither is imported here.
"""

from .allocator import PageAllocator, check_page_ids
from .host_layout import HostLayout
from .host_pool import HostKVPool, HostPoolConfig
from .kv_geometry import KVGeometry
from .stack import CacheStack, StackClosedError
from .transfer import CompletedHandle, KVTransferEngine, LoadHandle, TransferError, TransferHandle
from .version import __version__ as __version__  # re-exported (hicache_jax.__version__)

__all__ = [
    "CacheStack",
    "CompletedHandle",
    "HostKVPool",
    "HostLayout",
    "HostPoolConfig",
    "KVGeometry",
    "KVTransferEngine",
    "LoadHandle",
    "PageAllocator",
    "StackClosedError",
    "TransferError",
    "TransferHandle",
    "check_page_ids",
]
