"""KV page-transfer benchmark; the code lives in ``hicache_jax.bench.transfer`` (so the
``hicache-jax bench transfer`` console script works from any directory).

Usage: python -m benchmarks.bench_transfer [--quick] [--out PATH] [--impl auto|xla|tpu|mgpu|gpu] [--compare-impls]
"""

from hicache_jax.bench.transfer import main

if __name__ == "__main__":
    raise SystemExit(main())
