"""Gemma 3 text models from a llama.cpp GGUF file, run in pure JAX.

``gguf_loader``: ``load_gguf(path) -> (Gemma3Config, float32 weights)``, cached by the file's sha256
(numpy + ``gguf``). ``tokenizer``: ``Gemma3Tokenizer.from_gguf(path)`` (``tokenizers``).
``weights_package``: ``model_file(name)``, the GGUF a package on the index ships (the ``models``
extra). ``model``: the forward pass over a plain (non-paged) KV cache (JAX; imported on first use).
"""

from .gguf_loader import Gemma3Config, load_config, load_gguf
from .weights_package import MODEL_PACKAGES, model_file

__all__ = ["MODEL_PACKAGES", "Gemma3Config", "Gemma3Tokenizer", "load_config", "load_gguf", "model_file"]


def __getattr__(name: str):  # PEP 562: tokenizers is imported only when the tokenizer is needed
    if name == "Gemma3Tokenizer":
        from .tokenizer import Gemma3Tokenizer

        return Gemma3Tokenizer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
