"""``bench multiturn --engines N``: after the warm-up, the engines' counters (the cache's and
its L3 store's, which ``stats()`` reports and the prefix router's measured weights read) start
from zero, so what the benchmark reports is the timed rounds' alone."""

import argparse
import pathlib

from hicache_jax.bench import options, routed


class _Quiet:
    def phase(self, *a, **k):
        pass

    def advance(self, *a, **k):
        pass


def test_warm_up_leaves_no_store_counts_behind():
    p = argparse.ArgumentParser()
    options.multiturn_arguments(p)
    args = p.parse_args(["--quick", "--engines", "2", "--clients", "2", "--rounds", "2", "--storage-backend", "file"])
    options.apply_quick(p, args, "multiturn")
    max_context = args.first_len + args.rounds * (args.turn_len + args.answer_len) + 16
    run = routed._PolicyRun("round_robin", args, max_context, _Quiet())
    try:
        run.warm_and_attach(routed.model_config(args).vocab_size)
        # The warm-up went through the engines' store (its page files are there) ...
        assert list(pathlib.Path(run.tmp).rglob("*.kv"))
        for name, engine in run.engines.items():
            # ... and none of it is left in the counters the benchmark reports.
            counts = engine.storage.storage.metrics.snapshot()
            assert not any(counts.values()), (name, {k: v for k, v in counts.items() if v})
            st = engine.cache.stats()
            for k in (
                "storage_read_hit_pages",
                "storage_read_miss_pages",
                "storage_read_seconds",
                "storage_written_pages",
                "storage_written_bytes",
                "prefetched_tokens",
            ):
                assert st[k] == 0, (name, k, st[k])
    finally:
        run.close()
