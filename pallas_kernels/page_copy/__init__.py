"""Page gather/scatter between a paged KV pool and contiguous transfer buffers.

Files: ``common`` (orders, buckets, page-id validation), ``reference`` (pure JAX; also io
backend ``direct``), ``tpu`` (scalar-prefetch DMA), ``gpu_mgpu`` (Mosaic GPU: TMA through shared
memory), ``gpu`` (Pallas Triton, deprecated by jax), ``dispatch`` (``PageCopier``: validation,
bucketing, precompilation, sharding, the ``auto`` choice), ``test_page_copy`` and
``test_page_copy_mgpu`` (tests), ``bench_page_copy`` (benchmark; ``python -m`` it to compare
implementations).
"""

from .common import ORDERS, buffer_shape, default_buckets
from .dispatch import PageCopier, PageCopyConfig

__all__ = ["ORDERS", "PageCopier", "PageCopyConfig", "buffer_shape", "default_buckets"]
