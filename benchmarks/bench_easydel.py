"""Multi-turn trace through EasyDeL's eSurge, alone and with hicache_jax attached (host + L3).

    .venv-easydel/bin/python -m benchmarks.bench_easydel [--conversations 6] [--turns 4]
        [--pages 24] [--hidden 768 --layers 6] [--host-pages N] [--out hicache-results/easydel.json]

The same run as ``hicache-jax bench multiturn --engine easydel`` (the documented entry), with
the trace's own option names and ``--passes`` / ``--warmup``; the benchmark itself is
``hicache_jax.integrations.easydel.bench`` (what is measured and how: its docstring). Prints
the table and writes the JSON payload to ``--out``; exits 1 when a pass produced other greedy
tokens than the first.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def main(argv: list[str] | None = None) -> int:
    from hicache_jax.integrations.easydel import bench

    d = bench.TraceConfig()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--conversations", type=int, default=d.conversations)
    p.add_argument("--turns", type=int, default=d.turns)
    p.add_argument("--first", type=int, default=d.first, help="opening tokens per conversation")
    p.add_argument("--follow", type=int, default=d.follow, help="tokens added per turn (answer + question)")
    p.add_argument("--pages", type=int, default=d.pages, help="eSurge's KV pool (pages of 16 tokens)")
    p.add_argument("--hidden", type=int, default=d.hidden)
    p.add_argument("--layers", type=int, default=d.layers)
    p.add_argument(
        "--host-pages",
        type=int,
        default=None,
        help="the adapter's host pool (default: 4x eSurge's pool; smaller: more L3 reads)",
    )
    p.add_argument("--storage-backend", choices=bench.L3_BACKENDS, default=d.storage_backend)
    p.add_argument("--passes", type=int, default=d.passes, help="measured passes per mode (alternating)")
    p.add_argument(
        "--warmup",
        type=int,
        default=d.warmup,
        help="unmeasured passes per mode first (compiles the adapter's copy shapes, as eSurge "
        "compiles its own at start)",
    )
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--out", default="hicache-results/easydel.json")
    args = p.parse_args(argv)
    cfg = bench.TraceConfig(
        conversations=args.conversations,
        turns=args.turns,
        first=args.first,
        follow=args.follow,
        pages=args.pages,
        hidden=args.hidden,
        layers=args.layers,
        host_pages=args.host_pages or 4 * args.pages,
        storage_backend=args.storage_backend,
        passes=args.passes,
        warmup=args.warmup,
        seed=args.seed,
    )
    try:
        cfg.check()
    except ValueError as e:
        p.error(str(e))
    payload = bench.run(cfg)
    bench.print_report(payload)
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(payload, f, indent=2)
    return 0 if payload["same_tokens"] else 1


if __name__ == "__main__":
    sys.exit(main())
