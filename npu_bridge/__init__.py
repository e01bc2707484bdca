"""npu_bridge: drives the pure-Python hicache_jax manager on Ascend NPUs through torch / torch_npu.

Not built yet (issue 6). torch and torch_npu are never imported here at package import time;
the backend modules will import them lazily on first use.
"""
