"""Page gather/scatter between a paged KV pool and contiguous transfer buffers.

Files: ``common`` (orders, buckets), ``reference`` (pure JAX; also io backend ``direct``),
``tpu`` (scalar-prefetch DMA), ``gpu`` (Triton), ``dispatch`` (``PageCopier``: validation,
bucketing, precompilation, sharding), ``test_page_copy`` (tests), ``bench_page_copy``
(benchmark).
"""

from .common import ORDERS, buffer_shape, default_buckets
from .dispatch import PageCopier, PageCopyConfig

__all__ = ["ORDERS", "PageCopier", "PageCopyConfig", "buffer_shape", "default_buckets"]
