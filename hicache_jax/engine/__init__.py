"""Reference serving engine over the reference model and the hierarchical cache (needs JAX).

``Engine(model_config, cache_config).generate(prompts, max_new_tokens)`` returns per-request
tokens, cached tokens per tier, TTFT and latency.
"""

from .config import EngineCacheConfig
from .engine import Engine, RequestResult

__all__ = ["Engine", "EngineCacheConfig", "RequestResult"]
