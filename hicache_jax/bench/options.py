"""Command-line options of every benchmark, without importing JAX (so ``--help`` is instant).

Each benchmark has ``<name>_arguments(parser)`` here and a ``run(args) -> dict`` function in the
module ``cli.py`` names (imported only when it runs). ``QUICK`` holds each benchmark's
``--quick`` sizes: they replace the defaults, never a value given on the command line.
"""

from __future__ import annotations

import argparse

from ..host_layout import HostLayout
from ..storage.config import BACKENDS, PREFETCH_POLICIES
from ..workers import DEFAULT_WORKER_NICE
from .report import results_path

# hicache_jax.bench.serving.MODEL_PRESETS (a test keeps them equal).
MODEL_PRESET_NAMES = ("tiny", "bench", "hybrid-tiny", "hybrid", "llama3-8b-shape", "llama3-8b-shape-tiny")
# ``--model``'s default: resolved when the benchmark runs (serving.resolve_model: the backend is
# known only once JAX is imported): GPU_MODEL on a GPU or TPU, CPU_MODEL on a CPU.
AUTO_MODEL, GPU_MODEL, CPU_MODEL = "auto", "llama3-8b-shape", "bench"
# ``--quick`` with a full-size preset given on the command line takes its tiny shape of the same kind.
QUICK_MODEL = {"bench": "tiny", "hybrid": "hybrid-tiny", "llama3-8b-shape": "llama3-8b-shape-tiny"}
# pallas_kernels.page_copy's implementations (its dispatcher's IMPLS; a test keeps them equal).
COPY_IMPLS = ("auto", "tpu", "mgpu", "gpu", "xla")
# ``multiturn --engines N --router``'s policies (hicache_jax.bench.routed.POLICIES; a test keeps them equal).
ROUTERS = ("round_robin", "prefix")

# Per benchmark: what --quick changes (applied to options left at their default).
QUICK: dict[str, dict[str, object]] = {
    "multiturn": dict(model="tiny", clients=4, rounds=3, first_len=96, turn_len=32, answer_len=4, page_size=8,
                      device_pages=48, host_ratio=1.0, max_batch=2),
    "two-run": dict(model="tiny", num_prompts=3, prompt_len=256, device_pages=128),
    "ttft": dict(model="tiny", prompt_len=256, reps=3, decode_steps=4, decode_reps=2, device_pages=128),
    "restart": dict(model="tiny", num_prompts=2, prompt_len=128, device_pages=64),
    "transfer": dict(layers=2, heads=2, head_dim=64, page_sizes=[1, 16], page_counts=[8, 64], reps=2),
    # The engine shapes of tests/jax_backend/test_spec_trained_pair.py (compiled programs shared).
    "spec": dict(prompt_len=192, reps=1, device_pages=64, max_context=256, prefill_chunk=256,
                 storage_backend="file"),
}


# ``bench multiturn --engine easydel``: the same trace through EasyDeL's eSurge (a random Llama on
# the CPU, hicache_jax.integrations.easydel.bench), alone and with the adapter. Options left at
# their default take these sizes (the reference engine's are for its own model), then
# ``--quick``'s; the options listed in ENGINE_UNSUPPORTED are refused with that engine.
ENGINES = ("reference", "easydel")
ENGINE_DEFAULTS: dict[str, dict[str, object]] = {
    "easydel": dict(model="bench", clients=6, rounds=4, first_len=160, turn_len=24, answer_len=1, device_pages=24,
                    host_ratio=4.0, max_batch=1, storage_backend="file"),
}
ENGINE_QUICK: dict[str, dict[str, object]] = {
    "easydel": dict(model="tiny", clients=4, rounds=3, first_len=96, turn_len=24, device_pages=16),
}
# option -> (the only value the engine takes, why)
ENGINE_UNSUPPORTED: dict[str, dict[str, tuple[object, str]]] = {
    "easydel": {
        "answer_len": (1, "TTFT is a 1-token request's time; --turn-len tokens stand in for answer + question"),
        "page_size": (16, "the random Llama's eSurge pages are 16 tokens"),
        "attention": ("mha", "the adapter supports full attention"),
        "write_policy": ("write_through", "the adapter backs pages up when eSurge frees them"),
        "request_rate": (0.0, "requests are sent one at a time"),
        "num_processes": (1, "the adapter supports one data-parallel replica"),
        "deterministic": (False, "eSurge schedules its own steps"),
        "mooncake_master": (None, "L3 is file, memory, orbax or none"),
        "engines": (1, "one eSurge engine; routing between several is the reference engine's (--engine reference)"),
    },
}


def apply_quick(parser: argparse.ArgumentParser, args: argparse.Namespace, name: str) -> None:
    """The defaults a run takes: options still at their parser default take ``--engine``'s sizes
    (``ENGINE_DEFAULTS``), then, with ``--quick``, the benchmark's quick values. An option the
    engine cannot honour is a usage error (``parser.error``) before anything is built."""
    engine = getattr(args, "engine", "reference")
    at_default = {k for k in vars(args) if getattr(args, k) == parser.get_default(k)}
    table = dict(ENGINE_DEFAULTS.get(engine, {}))
    if getattr(args, "quick", False):
        table.update(QUICK.get(name, {}) if engine == "reference" else ENGINE_QUICK.get(engine, {}))
    for k, v in table.items():
        if k in at_default:
            setattr(args, k, v)
    if engine != "reference":
        for k, (want, why) in ENGINE_UNSUPPORTED.get(engine, {}).items():
            if getattr(args, k) != want:
                parser.error(f"--{k.replace('_', '-')} {getattr(args, k)}: --engine {engine} takes only {want} ({why})")
        if args.model not in ("tiny", "bench"):
            parser.error(f"--model {args.model}: --engine {engine} takes tiny or bench (a random Llama)")
        if args.storage_backend == "mooncake":
            parser.error(f"--storage-backend mooncake: --engine {engine} takes file, memory, orbax or none")
        return
    if getattr(args, "quick", False) and getattr(args, "model", None) in QUICK_MODEL:
        args.model = QUICK_MODEL[args.model]


def _bounded(kind: type, lo: float, hi: float | None = None, lo_open: bool = False):
    """An argparse type: ``kind`` in [lo, hi] (or (lo, hi] with ``lo_open``), a usage error otherwise,
    so a bad size stops the benchmark before it builds an engine."""
    want = f"{'an int' if kind is int else 'a number'} {'>' if lo_open else '>='} {lo}" + \
        (f" and <= {hi}" if hi is not None else "")

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {want}, got {text!r}") from None
        if (value <= lo if lo_open else value < lo) or (hi is not None and value > hi):
            raise argparse.ArgumentTypeError(f"expected {want}, got {value}")
        return value

    parse.__name__ = f"{kind.__name__} {'>' if lo_open else '>='} {lo}"  # argparse names it in errors
    return parse


_positive_int = _bounded(int, 1)
_non_negative_int = _bounded(int, 0)
_positive_float = _bounded(float, 0, lo_open=True)
_non_negative_float = _bounded(float, 0)
_fraction = _bounded(float, 0, 1)


def _common(p: argparse.ArgumentParser, name: str, *, device_pages: int = 1024, host_ratio: float = 4.0,
            max_batch: int = 8) -> None:
    """Options every serving benchmark shares (the reference model and engine, the cache, L3)."""
    p.add_argument("--quick", action="store_true", help="small sizes (seconds to a minute), for a first look or CI")
    p.add_argument("--out", default=results_path(name),
                   help="JSON result (the PNG goes beside it); relative paths are under the current directory")
    p.add_argument("--model", choices=(AUTO_MODEL, *MODEL_PRESET_NAMES), default=AUTO_MODEL,
                   help=f"reference model preset ({AUTO_MODEL}: {GPU_MODEL} on a GPU or TPU, {CPU_MODEL} on a CPU; "
                        f"{GPU_MODEL}: Llama-3-8B's layer shape with bf16 KV; hybrid: sliding-window layers in an "
                        f"SWA pool; --quick takes the tiny preset of the same kind: "
                        + ", ".join(f"{k} -> {v}" for k, v in QUICK_MODEL.items()) + f", {AUTO_MODEL} -> tiny)")
    p.add_argument("--layers", type=_positive_int, default=None,
                   help=f"layers of the model preset (default: the preset's; {GPU_MODEL}: 8)")
    p.add_argument("--attention", choices=["mha", "mla"], default="mha", help="per-head K/V or an MLA-style latent")
    p.add_argument("--page-size", type=_positive_int, default=16, help="tokens per KV page")
    p.add_argument("--device-pages", type=_positive_int, default=device_pages, help="L1 (device) pool size in pages")
    p.add_argument("--host-ratio", type=_positive_float, default=host_ratio, help="L2 (host) pool size / L1 pool size")
    p.add_argument("--host-layout", choices=[l.value for l in HostLayout], default=HostLayout.PAGE_FIRST.value,
                   help="L2 (host) pool layout (page_first_direct: each page's layers one contiguous run)")
    p.add_argument("--write-policy", default="write_through",
                   choices=["write_through", "write_through_selective", "write_back"], help="when L1 pages are backed up to L2")
    p.add_argument("--max-batch", type=_positive_int, default=max_batch,
                   help="requests the engine serves at once (the max-parallel bound)")
    p.add_argument("--prefill-chunk", type=_positive_int, default=512, help="tokens per prefill step")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    p.add_argument("--storage-backend", choices=[*BACKENDS, "none"], default="orbax",
                   help="L3 backend (none: L1 + L2 only)")
    p.add_argument("--storage-dir", default=None,
                   help="L3 directory (default %(default)s: a fresh temporary one, removed after)")
    p.add_argument("--mooncake-master", default=None,
                   help="mooncake: the master's host:port (default: start a local store for the run)")
    p.add_argument("--mooncake-metadata", default=None, help="mooncake: the metadata URL (with --mooncake-master)")
    p.add_argument("--mooncake-segment-bytes", type=_non_negative_int, default=0,
                   help="mooncake: memory each engine lends the store (0: none, the store node holds the pages)")
    p.add_argument("--mooncake-node-bytes", type=_non_negative_int, default=2 << 30,
                   help="mooncake: memory of the local store's store node")
    p.add_argument("--prefetch-policy", choices=list(PREFETCH_POLICIES), default="wait_complete",
                   help="how long admission waits for an L3 prefetch")
    p.add_argument("--worker-nice", type=int, default=DEFAULT_WORKER_NICE,
                   help="OS priority offset of the cache's worker threads (0: same as the scheduler)")


def _deterministic(p: argparse.ArgumentParser) -> None:
    p.add_argument("--deterministic", action="store_true",
                   help="deterministic mode: every model step in one fixed shape, so tokens with and without the "
                        "cache are identical on any platform (slower; EngineCacheConfig.deterministic)")


def multiturn_arguments(p: argparse.ArgumentParser) -> None:
    # L1 holds about two thirds of the clients' histories and L2 a bit less than all of them, so
    # prefixes come back from L1, L2 and L3 (orbax in a temporary directory takes every backup).
    _common(p, "multiturn", device_pages=320, host_ratio=1.0, max_batch=4)
    _deterministic(p)
    p.add_argument("--engine", choices=ENGINES, default="reference",
                   help="reference: hicache_jax's engine with vs without the cache; easydel: EasyDeL's eSurge "
                        "(a random Llama, .venv-easydel) alone vs with hicache_jax attached; options left at "
                        "their default take eSurge's sizes: " + ", ".join(
                            f"--{k.replace('_', '-')} {v}" for k, v in ENGINE_DEFAULTS["easydel"].items()))
    p.add_argument("--clients", type=_positive_int, default=8, help="conversations")
    p.add_argument("--rounds", type=_positive_int, default=4, help="turns per conversation")
    p.add_argument("--first-len", type=_positive_int, default=512, help="tokens of each conversation's first prompt")
    p.add_argument("--turn-len", type=_non_negative_int, default=96, help="tokens each later turn appends (after the answer)")
    p.add_argument("--answer-len", type=_positive_int, default=16, help="tokens generated per turn")
    p.add_argument("--request-rate", type=_non_negative_float, default=0.0,
                   help="0: closed loop (a client sends its next turn when its answer is back; at most "
                        "--max-batch served at once); > 0: Poisson arrivals per round at this many req/s")
    rank_arguments(p)
    p.add_argument("--engines", type=_positive_int, default=1,
                   help="N > 1: N reference engines in one process sharing one L3 (orbax is replaced by file; "
                        "one store per policy), requests routed by each --router policy in alternate rounds of "
                        "the same trace (hit rate per tier and measured TTFT per policy; no no-cache run)")
    p.add_argument("--router", nargs="+", choices=ROUTERS, default=list(ROUTERS),
                   help="with --engines > 1: the routing policies compared (round_robin; prefix: "
                        "hicache_jax.routing.PrefixRouter on the engines' KV events)")


def rank_arguments(p: argparse.ArgumentParser) -> None:
    """``--num-processes`` and its options (``hicache_jax.bench.ranks``)."""
    p.add_argument("--num-processes", type=_positive_int, default=1,
                   help="run as N tensor-parallel ranks on this machine (jax.distributed on the CPU, each rank "
                        "holding its share of the KV heads; every rank's tokens are checked against rank 0's; "
                        "L3 orbax is replaced by file)")
    p.add_argument("--agreement", choices=["kv", "device"], default="kv",
                   help="with --num-processes > 1: how the ranks agree once per scheduler step (kv: the "
                        "coordination service's key-value store; device: process_allgather)")
    p.add_argument("--rank-timeout", type=_positive_float, default=3600.0,
                   help="with --num-processes > 1: seconds before every rank still running is killed")


def check_multiturn(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Combinations of options no single type checks: a usage error before anything runs."""
    routers = args.router
    if len(set(routers)) != len(routers):
        parser.error(f"argument --router: each policy at most once, got {routers}")
    if args.engines == 1:
        if routers != parser.get_default("router"):
            parser.error("argument --router: needs --engines > 1 (one engine has nothing to route between)")
        return
    if args.num_processes > 1:
        parser.error("argument --engines: several engines run in one process; not with --num-processes > 1")
    if args.model in ("hybrid", "hybrid-tiny"):
        parser.error("argument --engines: several engines run full-attention models only, not a hybrid preset")
    if args.storage_backend == "mooncake" and args.mooncake_master and len(routers) > 1:
        parser.error("argument --mooncake-master: with --engines > 1 each policy needs a store of its own; "
                     "leave it out (a local store per policy) or give one --router")


# Per benchmark: checks of option combinations (after parsing, before ``--quick``).
CHECKS = {"multiturn": check_multiturn}


def check(parser: argparse.ArgumentParser, args: argparse.Namespace, name: str) -> None:
    """Run ``name``'s combination checks (``parser.error``: exit 2 with the usage line)."""
    fn = CHECKS.get(name)
    if fn is not None:
        fn(parser, args)


def two_run_arguments(p: argparse.ArgumentParser) -> None:
    _common(p, "two_run")
    p.add_argument("--num-prompts", type=_positive_int, default=8, help="prompts per run")
    p.add_argument("--prompt-len", type=_positive_int, default=3584, help="tokens per prompt")
    p.add_argument("--answer-len", type=_positive_int, default=1, help="tokens generated per prompt")


def ttft_arguments(p: argparse.ArgumentParser) -> None:
    _common(p, "ttft")
    _deterministic(p)
    p.add_argument("--prompt-len", type=_positive_int, default=2048, help="tokens per prompt")
    p.add_argument("--reuse", type=_fraction, default=0.95, help="fraction of the prompt that is a cached prefix")
    p.add_argument("--reps", type=_positive_int, default=9,
                   help="rounds; each measures every tier once, in rotating order (medians over rounds)")
    p.add_argument("--answer-len", type=_positive_int, default=1, help="tokens generated per prompt")
    p.add_argument("--decode-steps", type=_positive_int, default=16, help="decode steps per round of the decode test")
    p.add_argument("--decode-reps", type=_positive_int, default=10, help="interleaved with/without rounds of the decode test")


def restart_arguments(p: argparse.ArgumentParser) -> None:
    _common(p, "restart")
    p.add_argument("--num-prompts", type=_positive_int, default=4, help="prompts written, then re-sent after the restart")
    p.add_argument("--prompt-len", type=_positive_int, default=1024, help="tokens per prompt")
    p.add_argument("--answer-len", type=_positive_int, default=4, help="tokens generated per prompt")
    p.add_argument("--phase", choices=["both", "write", "read"], default="both", help=argparse.SUPPRESS)


def transfer_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="a small sweep (seconds), e.g. for smoke tests")
    p.add_argument("--out", default=results_path("transfer"), help="JSON result")
    p.add_argument("--impl", default="auto", choices=list(COPY_IMPLS),
                   help="page-copy implementation (auto: the dispatcher's choice per platform; mgpu = Mosaic GPU, "
                        "gpu = Pallas Triton; a kernel on CPU runs interpreted)")
    p.add_argument("--compare-impls", action=argparse.BooleanOptionalAction, default=None,
                   help="also measure xla / mgpu / gpu gather and scatter side by side (default: on a GPU)")
    p.add_argument("--layers", type=_positive_int, default=8, help="KV layers")
    p.add_argument("--heads", type=_positive_int, default=8, help="KV heads")
    p.add_argument("--head-dim", type=_positive_int, default=128, help="head dimension")
    p.add_argument("--dtype", default="bfloat16", help="KV dtype")
    p.add_argument("--page-sizes", type=_positive_int, nargs="+", default=[1, 16, 64], help="tokens per page")
    p.add_argument("--page-counts", type=_positive_int, nargs="+", default=None,
                   help="pages per transfer (default: per page size, the smallest power of two moving >= 64 MiB)")
    p.add_argument("--layouts", nargs="+", default=[l.value for l in HostLayout], help="host pool layouts")
    p.add_argument("--host-copy", default="auto", choices=["auto", "xla_stream", "numpy"],
                   help="how pages cross host<->device (auto: xla_stream where the host pool is pinned)")
    p.add_argument("--stream-loop", default=None, choices=["dynamic", "static"],
                   help="xla_stream page loops: over the live count, or over the whole bucket (known trip count); "
                        "default: the platform's (static on a GPU, dynamic elsewhere)")
    p.add_argument("--stream-unroll", type=_positive_int, default=None,
                   help="unroll factor of static page loops (default: the platform's, 8 on a GPU)")
    p.add_argument("--reps", type=_positive_int, default=5, help="timed repetitions per op (median)")


def spec_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="one prompt of 192 tokens, file L3 (about a minute), for CI")
    p.add_argument("--out", default=results_path("spec"),
                   help="JSON result (the PNG goes beside it); relative paths are under the current directory")
    p.add_argument("--weights", default="toy",
                   help="target + draft pair (.npz written by scripts/train_spec_pair.py); toy: the package's "
                        "trained toy pair")
    p.add_argument("--prompt-len", type=_positive_int, default=512, help="tokens per repetitive prompt")
    p.add_argument("--period", type=_non_negative_int, default=0,
                   help="pattern length of the repetitive prompt (0: the period the pair was trained on)")
    p.add_argument("--new-tokens", type=_positive_int, default=32, help="tokens generated per prompt")
    p.add_argument("--k", type=_positive_int, default=4, help="draft tokens per verify step (chain drafting)")
    p.add_argument("--reps", type=_positive_int, default=5, help="prompts (patterns) per case; times are medians over them")
    p.add_argument("--page-size", type=_positive_int, default=16, help="tokens per KV page")
    p.add_argument("--device-pages", type=_non_negative_int, default=0, help="L1 pool size in pages (0: three requests' worth)")
    p.add_argument("--max-context", type=_non_negative_int, default=0,
                   help="tokens per request (0: prompt + new tokens + 2k + a page)")
    p.add_argument("--prefill-chunk", type=_positive_int, default=512, help="tokens per prefill step")
    p.add_argument("--storage-backend", choices=["orbax", "file"], default="orbax",
                   help="L3 backend (a directory: the restarted engine reads what the first one wrote)")
    p.add_argument("--storage-dir", default=None,
                   help="L3 directory (default %(default)s: a fresh temporary one, removed after)")
    p.add_argument("--worker-nice", type=int, default=DEFAULT_WORKER_NICE,
                   help="OS priority offset of the cache's D2H and L3 threads (0: the scheduler's; on a busy "
                        "machine +19 starves the L3 reads and TTFT measures the queue)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random patterns")
    rank_arguments(p)
