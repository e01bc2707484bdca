"""Benchmark plumbing lives in ``hicache_jax.bench.report`` (the console script needs it installed)."""

from hicache_jax.bench.report import gbps, machine_info, median_seconds, print_table, write_json

__all__ = ["gbps", "machine_info", "median_seconds", "print_table", "write_json"]
