"""A small decoder-only transformer (Flax NNX) whose attention reads and writes KV through the
paged device pool by page table. Built in code from a fixed seed: no downloads. Needs JAX.

``config`` (validated ``ModelConfig``; hybrid full / sliding-window layer patterns and presets),
``window`` (the sliding-window convention and which SWA pages a step needs; pure Python),
``model`` (the NNX modules), ``paged_forward`` (the jitted, pool-donating step used by the
engine for prefill and decode, over the full pool and, for hybrid models, the SWA pool).

``ModelConfig`` and ``window`` import without JAX or flax (benchmark option parsing uses
them); the model and runner are imported on first use.
"""

from .config import HYBRID_BENCH, HYBRID_TINY, ModelConfig
from .window import swa_first_needed_page, swa_pages_needed, swa_table_width

__all__ = [
    "HYBRID_BENCH",
    "HYBRID_TINY",
    "ModelConfig",
    "PagedRunner",
    "Transformer",
    "swa_first_needed_page",
    "swa_pages_needed",
    "swa_table_width",
]


def __getattr__(name: str):  # PEP 562: flax is imported only when the model is needed
    if name == "Transformer":
        from .model import Transformer

        return Transformer
    if name == "PagedRunner":
        from .paged_forward import PagedRunner

        return PagedRunner
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
