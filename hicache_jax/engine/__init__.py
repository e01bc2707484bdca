"""Reference serving engine over the reference model and the hierarchical cache (needs JAX).

``Engine(model_config, cache_config).generate(prompts, max_new_tokens)`` returns per-request
tokens, cached tokens per tier, TTFT and latency; ``Engine(..., spec=SpecConfig(k))`` decodes
speculatively with an EAGLE-style draft whose KV the cache moves with the target's.
"""

from .config import EngineCacheConfig
from .engine import Engine, RequestResult
from .speculative import SpecConfig

__all__ = ["Engine", "EngineCacheConfig", "RequestResult", "SpecConfig"]
