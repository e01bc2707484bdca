"""A small decoder-only transformer (Flax NNX) whose attention reads and writes KV through the
paged device pool by page table. Built in code from a fixed seed: no downloads. Needs JAX.

``config`` (validated ``ModelConfig``), ``model`` (the NNX modules), ``paged_forward``
(the jitted, pool-donating step used by the engine for prefill and decode).

``ModelConfig`` imports without JAX or flax (benchmark option parsing uses it); the model
and runner are imported on first use.
"""

from .config import ModelConfig

__all__ = ["ModelConfig", "PagedRunner", "Transformer"]


def __getattr__(name: str):  # PEP 562: flax is imported only when the model is needed
    if name == "Transformer":
        from .model import Transformer
        return Transformer
    if name == "PagedRunner":
        from .paged_forward import PagedRunner
        return PagedRunner
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
