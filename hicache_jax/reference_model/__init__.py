"""A small decoder-only transformer (Flax NNX) whose attention reads and writes KV through the
paged device pool by page table. Built in code from a fixed seed: no downloads. Needs JAX.

``config`` (validated ``ModelConfig``), ``model`` (the NNX modules), ``paged_forward``
(the jitted, pool-donating step used by the engine for prefill and decode).
"""

from .config import ModelConfig
from .model import Transformer
from .paged_forward import PagedRunner

__all__ = ["ModelConfig", "PagedRunner", "Transformer"]
