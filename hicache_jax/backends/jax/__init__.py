"""JAX backend: device (L1) pools as JAX arrays, transfers through ``pallas_kernels.page_copy``.

Importing this module imports JAX; ``hicache_jax`` itself never does.
"""

from .device_pool import JaxDevicePool, StaleDevicePoolError
from .memory import host_memory_kind
from .transfer_engine import JaxTransferEngine

__all__ = ["JaxDevicePool", "JaxTransferEngine", "StaleDevicePoolError", "host_memory_kind"]
