"""Real model families run in JAX from their published weights (no torch, no transformers model code).

``gemma3``: Gemma 3 text models read from a llama.cpp GGUF file (``hicache_jax.models.gemma3``).
Subpackages import numpy and ``gguf`` at most until a model is built; JAX is imported by their
``model`` modules only.
"""
