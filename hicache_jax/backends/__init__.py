"""KV backends. ``numpy_backend`` is pure numpy; ``jax`` needs JAX (import it explicitly)."""
