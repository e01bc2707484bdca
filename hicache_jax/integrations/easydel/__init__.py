"""hicache_jax for EasyDeL's eSurge: ``attach(engine, HiCacheConfig(...), model=..., weights_revision=...)``.

eSurge's page pool stays L1; hicache_jax adds the host tier (L2) and any L3 backend. See
``adapter`` for what is hooked where and ``fused_transfer`` for how eSurge's fused K/V pages
move. Importing this package does not import easydel (the adapter reads the engine's objects);
the ``fused_transfer`` module needs JAX. Not imported here: ``testing`` (a random Llama served
by eSurge on a CPU without downloads, shared by the tests, the example and the benchmark) and
``bench`` (``hicache-jax bench multiturn --engine easydel``).
"""

from .adapter import Admission, EsurgeHiCache, UnsupportedEngineError, attach
from .fused_transfer import FusedKVTransfer, fused_geometry

__all__ = ["Admission", "EsurgeHiCache", "FusedKVTransfer", "UnsupportedEngineError", "attach", "fused_geometry"]
