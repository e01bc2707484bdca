"""Command-line options of every benchmark, without importing JAX (so ``--help`` is instant).

Each benchmark has ``<name>_arguments(parser)`` here and a ``run(args) -> dict`` function in the
module ``cli.py`` names (imported only when it runs). ``QUICK`` holds each benchmark's
``--quick`` sizes: they replace the defaults, never a value given on the command line.
"""

from __future__ import annotations

import argparse
import math
import os
import tempfile

from ..host_layout import HostLayout
from ..kv_geometry import DTYPE_ALIASES, KV_DTYPES, KVGeometry
from ..storage.config import BACKENDS, PREFETCH_POLICIES, StorageConfig
from ..workers import DEFAULT_WORKER_NICE, MAX_NICE
from .report import results_path

# hicache_jax.bench.serving.MODEL_PRESETS (a test keeps them equal).
MODEL_PRESET_NAMES = ("tiny", "bench", "hybrid-tiny", "hybrid", "llama3-8b-shape", "llama3-8b-shape-tiny")
# ``--model``'s default: resolved when the benchmark runs (serving.resolve_model: the backend is
# known only once JAX is imported): GPU_MODEL on a GPU or TPU, CPU_MODEL on a CPU.
AUTO_MODEL, GPU_MODEL, CPU_MODEL = "auto", "llama3-8b-shape", "bench"
# Real checkpoints (``hicache_jax.models``: weights from a package on the index, the ``models``
# extra), served as they are: ``multiturn`` only, in real text (``bench.text_conversations``).
REAL_MODELS = ("gemma3-270m",)
# Their multiturn sizes (options left at their default), and what --quick changes on top. L1 holds
# about half of the working set (two shared documents of ~1,000 and ~2,300 tokens plus each
# conversation's turns) and L2 twice L1 (upstream's default ratio), so prefixes come back from L1
# and L2. With L2 = L1 the host pool fills with the device's own backed-up pages, later pages are
# never backed up (L3 is written from L2, so it never gets them either) and some turns are
# served nothing (measured: hit rate 0.60 instead of 0.79).
REAL_MODEL_DEFAULTS = dict(
    clients=4, rounds=4, answer_len=32, page_size=16, device_pages=224, host_ratio=2.0, max_batch=4, prefill_chunk=512
)
REAL_MODEL_QUICK = dict(clients=2, rounds=2, answer_len=8)
# option -> (the only value a real model takes, why)
REAL_MODEL_UNSUPPORTED = {
    "layers": (None, "the checkpoint has its own layers"),
    "attention": ("mha", "the checkpoint has per-head K/V"),
    "num_processes": (1, "one process (the ranks run the reference model)"),
    "engines": (1, "one engine"),
    "deterministic": (False, "the default numerics (tokens are checked against no cache)"),
}
# ``--quick`` with a full-size preset given on the command line takes its tiny shape of the same kind.
QUICK_MODEL = {"bench": "tiny", "hybrid": "hybrid-tiny", "llama3-8b-shape": "llama3-8b-shape-tiny"}
# pallas_kernels.page_copy's implementations (its dispatcher's IMPLS; a test keeps them equal).
COPY_IMPLS = ("auto", "tpu", "mgpu", "gpu", "xla")
# ``multiturn --engines N --router``'s policies (hicache_jax.bench.routed.POLICIES; a test keeps them equal).
ROUTERS = ("round_robin", "prefix")

# Per benchmark: what --quick changes (applied to options left at their default).
QUICK: dict[str, dict[str, object]] = {
    "step-cost": dict(steps=16, warmup_steps=12, prompt_len=256, profile_steps=4),
    "multiturn": dict(
        model="tiny",
        clients=4,
        rounds=3,
        first_len=96,
        turn_len=32,
        answer_len=4,
        page_size=8,
        device_pages=48,
        host_ratio=1.0,
        max_batch=2,
    ),
    "two-run": dict(model="tiny", num_prompts=3, prompt_len=256, device_pages=128),
    "ttft": dict(model="tiny", prompt_len=256, reps=3, decode_steps=4, decode_reps=2, device_pages=128),
    "restart": dict(model="tiny", num_prompts=2, prompt_len=128, device_pages=64),
    "transfer": dict(layers=2, heads=2, head_dim=64, page_sizes=[1, 16], page_counts=[8, 64], reps=2),
    # The engine shapes of tests/jax_backend/test_spec_trained_pair.py (compiled programs shared).
    "spec": dict(prompt_len=192, reps=1, device_pages=64, max_context=256, prefill_chunk=256, storage_backend="file"),
}


# ``bench multiturn --engine easydel``: the same trace through EasyDeL's eSurge (a random Llama on
# the CPU, hicache_jax.integrations.easydel.bench), alone and with the adapter. Options left at
# their default take these sizes (the reference engine's are for its own model), then
# ``--quick``'s; the options listed in ENGINE_UNSUPPORTED are refused with that engine.
ENGINES = ("reference", "easydel")
ENGINE_DEFAULTS: dict[str, dict[str, object]] = {
    "easydel": dict(
        model="bench",
        clients=6,
        rounds=4,
        first_len=160,
        turn_len=24,
        answer_len=1,
        device_pages=24,
        host_ratio=4.0,
        max_batch=1,
        storage_backend="file",
    ),
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
    real = getattr(args, "model", None) in REAL_MODELS
    if real:
        if name != "multiturn" or engine != "reference":
            parser.error(
                f"--model {args.model}: a real checkpoint runs in bench multiturn on the reference engine only"
            )
        for k, (want, why) in REAL_MODEL_UNSUPPORTED.items():
            if getattr(args, k, want) != want:
                parser.error(
                    f"--{k.replace('_', '-')} {getattr(args, k)}: --model {args.model} takes only {want} ({why})"
                )
        table.update(REAL_MODEL_DEFAULTS)
        if getattr(args, "quick", False):
            table.update(REAL_MODEL_QUICK)
    elif getattr(args, "quick", False):
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


def bounded(kind: type, lo: float, hi: float, lo_open: bool = False):
    """An argparse type: ``kind`` in [lo, hi] (or (lo, hi] with ``lo_open``; floats finite), a
    usage error otherwise, so a bad size stops the benchmark before it builds an engine. Every
    size has an upper bound: a value no machine could hold is refused at once instead of
    allocating for minutes and dying out of memory."""
    fmt = (lambda x: str(int(x))) if kind is int else (lambda x: f"{x:g}")
    want = f"{'an int' if kind is int else 'a finite number'} {'>' if lo_open else '>='} {fmt(lo)} and <= {fmt(hi)}"

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {want}, got {text!r}") from None
        if (kind is float and not math.isfinite(value)) or (value <= lo if lo_open else value < lo) or value > hi:
            raise argparse.ArgumentTypeError(f"expected {want}, got {text!r}")
        return value

    parse.__name__ = f"{kind.__name__} in {'(' if lo_open else '['}{fmt(lo)}, {fmt(hi)}]"  # argparse names it in errors
    parse.bounds = (kind, lo, hi, lo_open)  # (tests derive the values to refuse from them)
    return parse


# Upper bounds of the sizes (far above any run the benchmarks make; see ``bounded``).
MAX_TOKENS = 1 << 20  # tokens of one prompt / turn / answer / chunk / context
MAX_PAGE_SIZE = 4096
MAX_PAGES = 1 << 24  # pages of one pool or one transfer
MAX_LAYERS = 1024
MAX_HEADS = 1024
MAX_HEAD_DIM = 8192
MAX_COUNT = 1 << 16  # clients, rounds, prompts, batch slots, repetitions, steps
MAX_PROCESSES = 64
MAX_ENGINES = 256
MAX_BYTES = 1 << 50
MAX_SEED = (1 << 32) - 1
MAX_SECONDS = 7 * 24 * 3600.0

_positive_int = bounded(int, 1, MAX_COUNT)
_non_negative_int = bounded(int, 0, MAX_COUNT)
_tokens = bounded(int, 1, MAX_TOKENS)
_non_negative_tokens = bounded(int, 0, MAX_TOKENS)
_page_size = bounded(int, 1, MAX_PAGE_SIZE)
_pages = bounded(int, 1, MAX_PAGES)
_non_negative_pages = bounded(int, 0, MAX_PAGES)
_layers = bounded(int, 1, MAX_LAYERS)
_bytes = bounded(int, 0, MAX_BYTES)
_seed = bounded(int, 0, MAX_SEED)
_nice = bounded(int, 0, MAX_NICE)
_positive_float = bounded(float, 0, 1024.0, lo_open=True)  # a ratio
_rate = bounded(float, 0, 1e6)  # requests per second
_seconds = bounded(float, 0, MAX_SECONDS, lo_open=True)
_fraction = bounded(float, 0, 1)


def _kv_dtype(text: str) -> str:
    """An argparse type: a KV dtype name (``kv_geometry.KV_DTYPES`` or an alias), canonical."""
    names = sorted(KV_DTYPES) + sorted(DTYPE_ALIASES)
    if text not in names:
        raise argparse.ArgumentTypeError(f"expected one of {', '.join(names)}, got {text!r}")
    return DTYPE_ALIASES.get(text, text)


_kv_dtype.__name__ = "KV dtype"


def _host_port(text: str) -> str:
    """An argparse type: ``host:port`` with a port in [1, 65535]."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise argparse.ArgumentTypeError(f"expected host:port with a port in [1, 65535], got {text!r}")
    return text


_host_port.__name__ = "host:port"


def _store_node_bytes(text: str) -> int:
    """An argparse type: 0 (no store node) or at least 1 MiB (``MooncakeMaster``'s rule)."""
    value = _bytes(text)
    if 0 < value < (1 << 20):
        raise argparse.ArgumentTypeError(f"expected 0 (no store node) or at least 1 MiB ({1 << 20}), got {text!r}")
    return value


_store_node_bytes.__name__ = "bytes"


def _common(
    p: argparse.ArgumentParser, name: str, *, device_pages: int = 1024, host_ratio: float = 4.0, max_batch: int = 8
) -> None:
    """Options every serving benchmark shares (the reference model and engine, the cache, L3)."""
    p.add_argument("--quick", action="store_true", help="small sizes (seconds to a minute), for a first look or CI")
    p.add_argument(
        "--out",
        default=results_path(name),
        help="JSON result (the PNG goes beside it); relative paths are under the current directory",
    )
    p.add_argument(
        "--model",
        choices=(AUTO_MODEL, *MODEL_PRESET_NAMES, *REAL_MODELS),
        default=AUTO_MODEL,
        help=f"reference model preset or real checkpoint ({', '.join(REAL_MODELS)}: multiturn only, real "
        f"text, weights from the models extra; {AUTO_MODEL}: {GPU_MODEL} on a GPU or TPU, "
        f"{CPU_MODEL} on a CPU; "
        f"{GPU_MODEL}: Llama-3-8B's layer shape with bf16 KV; hybrid: sliding-window layers in an "
        f"SWA pool; --quick takes the tiny preset of the same kind: "
        + ", ".join(f"{k} -> {v}" for k, v in QUICK_MODEL.items())
        + f", {AUTO_MODEL} -> tiny)",
    )
    p.add_argument(
        "--layers",
        type=_layers,
        default=None,
        help=f"layers of the model preset (default: the preset's; {GPU_MODEL}: 8)",
    )
    p.add_argument("--attention", choices=["mha", "mla"], default="mha", help="per-head K/V or an MLA-style latent")
    p.add_argument("--page-size", type=_page_size, default=16, help="tokens per KV page")
    p.add_argument("--device-pages", type=_pages, default=device_pages, help="L1 (device) pool size in pages")
    p.add_argument("--host-ratio", type=_positive_float, default=host_ratio, help="L2 (host) pool size / L1 pool size")
    p.add_argument(
        "--host-layout",
        choices=[l.value for l in HostLayout],
        default=HostLayout.PAGE_FIRST.value,
        help="L2 (host) pool layout (page_first_direct: each page's layers one contiguous run)",
    )
    p.add_argument(
        "--write-policy",
        default="write_through",
        choices=["write_through", "write_through_selective", "write_back"],
        help="when L1 pages are backed up to L2",
    )
    p.add_argument(
        "--max-batch",
        type=_positive_int,
        default=max_batch,
        help="requests the engine serves at once (the max-parallel bound)",
    )
    p.add_argument("--prefill-chunk", type=_tokens, default=512, help="tokens per prefill step")
    p.add_argument("--seed", type=_seed, default=0, help="seed of the random prompts")
    p.add_argument(
        "--storage-backend", choices=[*BACKENDS, "none"], default="orbax", help="L3 backend (none: L1 + L2 only)"
    )
    p.add_argument(
        "--storage-dir", default=None, help="L3 directory (default %(default)s: a fresh temporary one, removed after)"
    )
    p.add_argument(
        "--mooncake-master",
        type=_host_port,
        default=None,
        help="mooncake: the master's host:port (default: start a local store for the run)",
    )
    p.add_argument("--mooncake-metadata", default=None, help="mooncake: the metadata URL (with --mooncake-master)")
    p.add_argument(
        "--mooncake-segment-bytes",
        type=_bytes,
        default=0,
        help="mooncake: memory each engine lends the store (0: none, the store node holds the pages)",
    )
    p.add_argument(
        "--mooncake-node-bytes",
        type=_store_node_bytes,
        default=2 << 30,
        help="mooncake: memory of the local store's store node",
    )
    p.add_argument(
        "--prefetch-policy",
        choices=list(PREFETCH_POLICIES),
        default="wait_complete",
        help="how long admission waits for an L3 prefetch",
    )
    p.add_argument(
        "--worker-nice",
        type=_nice,
        default=DEFAULT_WORKER_NICE,
        help="OS priority offset of the cache's worker threads (0: same as the scheduler)",
    )


def _deterministic(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--deterministic",
        action="store_true",
        help="deterministic mode: every model step in one fixed shape, so tokens with and without the "
        "cache are identical on any platform (slower; EngineCacheConfig.deterministic)",
    )


def multiturn_arguments(p: argparse.ArgumentParser) -> None:
    # L1 holds about two thirds of the clients' histories and L2 a bit less than all of them, so
    # prefixes come back from L1, L2 and L3 (orbax in a temporary directory takes every backup).
    _common(p, "multiturn", device_pages=320, host_ratio=1.0, max_batch=4)
    _deterministic(p)
    p.add_argument(
        "--engine",
        choices=ENGINES,
        default="reference",
        help="reference: hicache_jax's engine with vs without the cache; easydel: EasyDeL's eSurge "
        "(a random Llama, .venv-easydel) alone vs with hicache_jax attached; options left at "
        "their default take eSurge's sizes: "
        + ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in ENGINE_DEFAULTS["easydel"].items()),
    )
    p.add_argument("--clients", type=_positive_int, default=8, help="conversations")
    p.add_argument("--rounds", type=_positive_int, default=4, help="turns per conversation")
    p.add_argument("--first-len", type=_tokens, default=512, help="tokens of each conversation's first prompt")
    p.add_argument(
        "--turn-len", type=_non_negative_tokens, default=96, help="tokens each later turn appends (after the answer)"
    )
    p.add_argument("--answer-len", type=_tokens, default=16, help="tokens generated per turn")
    p.add_argument(
        "--request-rate",
        type=_rate,
        default=0.0,
        help="0: closed loop (a client sends its next turn when its answer is back; at most "
        "--max-batch served at once); > 0: Poisson arrivals per round at this many req/s",
    )
    p.add_argument(
        "--no-reuse",
        action="store_true",
        help="what the cache costs when nothing hits: every request a new random prompt (the "
        "lengths a conversation's turns would have), nothing shared; cache on vs off, judged "
        "against input throughput >= 0.97x and TTFT mean <= 1.03x (on any backend)",
    )
    rank_arguments(p)
    p.add_argument(
        "--engines",
        type=bounded(int, 1, MAX_ENGINES),
        default=1,
        help="N > 1: N reference engines in one process sharing one L3 (orbax is replaced by file; "
        "one store per policy), requests routed by each --router policy in alternate rounds of "
        "the same trace (hit rate per tier and measured TTFT per policy; no no-cache run)",
    )
    p.add_argument(
        "--router",
        nargs="+",
        choices=ROUTERS,
        default=list(ROUTERS),
        help="with --engines > 1: the routing policies compared (round_robin; prefix: "
        "hicache_jax.routing.PrefixRouter on the engines' KV events)",
    )


def rank_arguments(p: argparse.ArgumentParser) -> None:
    """``--num-processes`` and its options (``hicache_jax.bench.ranks``)."""
    p.add_argument(
        "--num-processes",
        type=bounded(int, 1, MAX_PROCESSES),
        default=1,
        help="run as N tensor-parallel ranks on this machine (jax.distributed on the CPU, each rank "
        "holding its share of the KV heads; every rank's tokens are checked against rank 0's; "
        "L3 orbax is replaced by file)",
    )
    p.add_argument(
        "--agreement",
        choices=["kv", "device"],
        default="kv",
        help="with --num-processes > 1: how the ranks agree once per scheduler step (kv: the "
        "coordination service's key-value store; device: process_allgather)",
    )
    p.add_argument(
        "--rank-timeout",
        type=_seconds,
        default=3600.0,
        help="with --num-processes > 1: seconds before every rank still running is killed",
    )


def check_multiturn(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Combinations of options no single type checks: a usage error before anything runs."""
    routers = args.router
    if getattr(args, "no_reuse", False):
        if args.model in REAL_MODELS:
            parser.error("argument --no-reuse: a preset model only (random prompts), not " + args.model)
        if args.engines > 1 or args.num_processes > 1 or getattr(args, "engine", "reference") != "reference":
            parser.error(
                "argument --no-reuse: one reference engine in one process (no --engines, "
                "--num-processes or --engine easydel)"
            )
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
        parser.error(
            "argument --mooncake-master: with --engines > 1 each policy needs a store of its own; "
            "leave it out (a local store per policy) or give one --router"
        )


def path_problem(path: str, directory: bool = False) -> str | None:
    """Why ``path`` cannot be written (a file; with ``directory``, a directory used or made
    there), or None: its nearest existing ancestor must be a writable directory, and the path
    itself, when it exists, a writable file (a directory). Leaves nothing behind (a probe file
    is made in that ancestor and removed)."""
    if not isinstance(path, str) or not path:
        return "expected a non-empty path"
    full = os.path.abspath(path)
    if os.path.exists(full):
        if directory != os.path.isdir(full):
            return f"{full} is {'not ' if directory else ''}a directory"
        if not os.access(full, os.W_OK | (os.X_OK if directory else 0)):
            return f"{full} is not writable"
        return None
    parent = os.path.dirname(full)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        return f"{parent} is not a directory"
    try:  # a real write (os.access says yes to root, also in /proc or on a read-only mount)
        fd, probe = tempfile.mkstemp(prefix=".hicache-write-probe-", dir=parent)
    except OSError as e:
        return f"cannot create it in {parent}: {e.strerror or e}"
    os.close(fd)
    os.unlink(probe)
    return None


def available_memory_bytes() -> int | None:
    """Memory the machine can still give (``MemAvailable``; the physical memory where there is
    no /proc/meminfo), or None when unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        return None


def default_page_count(bytes_per_page: int, min_bytes: int = 64 << 20) -> int:
    """``bench transfer``'s pages per transfer by default: the smallest power-of-two page count
    moving >= ``min_bytes`` (at least 16 pages)."""
    n = max(16, -(-min_bytes // bytes_per_page))
    return 1 << (n - 1).bit_length()


def transfer_case_bytes(args: argparse.Namespace, page: int) -> int:
    """Memory one page size's largest case of ``bench transfer`` holds at once, about: the
    device pool of max(2n, 64) pages and its random source, the host pool and the transfer
    buffer of n pages."""
    bpp = KVGeometry.mha(args.layers, page, args.heads, args.head_dim, args.dtype).bytes_per_page
    counts = args.page_counts or [default_page_count(bpp)]
    return max((2 * max(2 * n, 64) + 2 * n) * bpp for n in counts)


def check_transfer(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse a sweep whose largest case cannot fit in memory (before JAX starts)."""
    need = max(transfer_case_bytes(args, page) for page in args.page_sizes)
    have = available_memory_bytes()
    if have is not None and need > have:
        parser.error(
            f"argument --heads/--head-dim/--layers/--page-sizes/--page-counts: expected sizes whose largest "
            f"case fits the {have / 2**30:.1f} GiB this machine has available, got about "
            f"{need / 2**30:.1f} GiB"
        )


def check_serving(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The serving benchmarks' L3 options, checked as ``StorageConfig`` will check them, and a
    lower bound of the pools' memory (one byte per token: any model needs more)."""
    if args.mooncake_metadata is not None and args.mooncake_master is None:
        parser.error(
            "argument --mooncake-metadata: expected only with --mooncake-master (the metadata URL of that store)"
        )
    if args.storage_backend == "mooncake" and args.mooncake_master is not None:
        try:
            StorageConfig(
                backend="mooncake",
                mooncake_master=args.mooncake_master,
                mooncake_metadata=args.mooncake_metadata,
                mooncake_global_segment_bytes=args.mooncake_segment_bytes,
            )
        except (ValueError, TypeError) as e:
            field = str(e).split(":", 1)[0]
            option = {
                "mooncake_master": "--mooncake-master",
                "mooncake_metadata": "--mooncake-metadata",
                "mooncake_global_segment_bytes": "--mooncake-segment-bytes",
            }.get(field, "--mooncake-master")
            parser.error(f"argument {option}: {e}")
    tokens = args.device_pages * args.page_size * (1 + args.host_ratio) * getattr(args, "engines", 1)
    have = available_memory_bytes()
    if have is not None and tokens > have:
        parser.error(
            f"argument --device-pages/--page-size/--host-ratio: expected pools this machine's "
            f"{have / 2**30:.1f} GiB could hold, got {tokens:.3g} tokens (over a byte each)"
        )


def check_outputs(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Paths the run writes, checked before it starts (a run is not lost to a bad ``--out``)."""
    why = path_problem(args.out)
    if why is not None:
        parser.error(f"argument --out: expected a file path the results can be written to, got {args.out!r} ({why})")
    storage_dir = getattr(args, "storage_dir", None)
    if storage_dir is not None:
        why = path_problem(storage_dir, directory=True)
        if why is not None:
            parser.error(
                f"argument --storage-dir: expected a directory the L3 can use or create, got {storage_dir!r} ({why})"
            )
    weights = getattr(args, "weights", None)
    if weights is not None and weights != "toy" and not os.path.isfile(weights):
        parser.error(f"argument --weights: expected 'toy' or an existing .npz file, got {weights!r}")


# ---------------------------------------------------------------------------------- step-cost
STEP_COST_GOAL_IN_FLIGHT, STEP_COST_GOAL_FINISHES = 512, 64  # the goal's sizes (hicache_jax.bench.step_cost)
STEP_COST_DEVICE_HEADROOM = 1.25  # device pool / pages the running requests can need


def pages_for(tokens: int, page: int) -> int:
    return -(-tokens // page)


def step_cost_max_new(args: argparse.Namespace) -> int:
    """Tokens a request can generate: the prefill's first one, then one per step it runs (a
    request lives about in_flight / finishes steps; FIFO finishing bounds it by the ceiling + 1)."""
    return -(-args.in_flight // args.finishes_per_step) + 2


def step_cost_max_conversation(args: argparse.Namespace) -> int:
    """The longest prompt: a follow-up is only sent while its conversation is within this."""
    return 2 * args.prompt_len


def step_cost_device_pages(args: argparse.Namespace) -> int:
    per_request = pages_for(step_cost_max_conversation(args) + step_cost_max_new(args), args.page_size)
    return max(64, math.ceil(STEP_COST_DEVICE_HEADROOM * args.in_flight * per_request))


def step_cost_arguments(p: argparse.ArgumentParser) -> None:
    """``bench step-cost``'s options (the benchmark needs no JAX)."""
    p.add_argument(
        "--quick",
        action="store_true",
        help="short run (a few seconds): " + ", ".join(f"{k}={v}" for k, v in QUICK["step-cost"].items()),
    )
    p.add_argument(
        "--out", default=results_path("step_cost"), help="JSON result; relative paths are under the current directory"
    )
    p.add_argument(
        "--in-flight",
        type=bounded(int, 1, MAX_COUNT),
        default=STEP_COST_GOAL_IN_FLIGHT,
        help="requests running at every decode step",
    )
    p.add_argument(
        "--finishes-per-step",
        type=_positive_int,
        default=STEP_COST_GOAL_FINISHES,
        help="requests finishing (and new ones admitted) per scheduler step; <= --in-flight",
    )
    p.add_argument("--steps", type=_positive_int, default=200, help="measured scheduler steps (after the warm-up)")
    p.add_argument(
        "--warmup-steps",
        type=bounded(int, 0, MAX_COUNT),
        default=48,
        help="steps before measuring (the pools fill and eviction starts within them)",
    )
    p.add_argument(
        "--profile-steps",
        type=bounded(int, 0, MAX_COUNT),
        default=20,
        help="steps run under cProfile after the measured ones (0: no profile)",
    )
    p.add_argument("--page-size", type=_page_size, default=16, help="tokens per KV page")
    p.add_argument(
        "--prompt-len",
        type=bounded(int, 8, MAX_TOKENS // 4),
        default=1024,
        help="tokens of a new conversation's prompt (a follow-up turn adds a quarter of it; "
        "conversations grow to twice it)",
    )
    p.add_argument(
        "--events",
        choices=["on", "off"],
        default="on",
        help="a KVEventSource subscribed (off: none attached, to see what the events cost)",
    )
    p.add_argument("--seed", type=_seed, default=0, help="seed of the random prompts")


def check_step_cost(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Combinations no single option's type checks (a usage error before anything runs)."""
    if args.finishes_per_step > args.in_flight:
        parser.error(
            f"argument --finishes-per-step: expected at most --in-flight ({args.in_flight}), got "
            f"{args.finishes_per_step}"
        )
    pages = step_cost_device_pages(args)
    if pages > MAX_PAGES:
        parser.error(
            f"argument --in-flight/--prompt-len/--page-size: expected sizes whose device pool is at most "
            f"{MAX_PAGES} pages, got {pages}"
        )


# Per benchmark: checks of option combinations (after parsing, before ``--quick``).
CHECKS = {
    "multiturn": [check_multiturn, check_serving],
    "two-run": [check_serving],
    "ttft": [check_serving],
    "restart": [check_serving],
    "transfer": [check_transfer],
    "step-cost": [check_step_cost],
}


def check(parser: argparse.ArgumentParser, args: argparse.Namespace, name: str) -> None:
    """Run ``name``'s checks (``parser.error``: exit 2 with the usage line): the output paths
    first, then the combinations no single option's type checks (before ``--quick``, JAX or
    any engine)."""
    check_outputs(parser, args)
    for fn in CHECKS.get(name, ()):
        fn(parser, args)


def two_run_arguments(p: argparse.ArgumentParser) -> None:
    _common(p, "two_run")
    p.add_argument("--num-prompts", type=_positive_int, default=8, help="prompts per run")
    p.add_argument("--prompt-len", type=_tokens, default=3584, help="tokens per prompt")
    p.add_argument("--answer-len", type=_tokens, default=1, help="tokens generated per prompt")


def ttft_arguments(p: argparse.ArgumentParser) -> None:
    _common(p, "ttft")
    _deterministic(p)
    p.add_argument("--prompt-len", type=_tokens, default=2048, help="tokens per prompt")
    p.add_argument("--reuse", type=_fraction, default=0.95, help="fraction of the prompt that is a cached prefix")
    p.add_argument(
        "--reps",
        type=_positive_int,
        default=9,
        help="rounds; each measures every tier once, in rotating order (medians over rounds)",
    )
    p.add_argument("--answer-len", type=_tokens, default=1, help="tokens generated per prompt")
    p.add_argument("--decode-steps", type=_positive_int, default=16, help="decode steps per round of the decode test")
    p.add_argument(
        "--decode-reps", type=_positive_int, default=10, help="interleaved with/without rounds of the decode test"
    )


def restart_arguments(p: argparse.ArgumentParser) -> None:
    _common(p, "restart")
    p.add_argument(
        "--num-prompts", type=_positive_int, default=4, help="prompts written, then re-sent after the restart"
    )
    p.add_argument("--prompt-len", type=_tokens, default=1024, help="tokens per prompt")
    p.add_argument("--answer-len", type=_tokens, default=4, help="tokens generated per prompt")
    p.add_argument("--phase", choices=["both", "write", "read"], default="both", help=argparse.SUPPRESS)


def transfer_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="a small sweep (seconds), e.g. for smoke tests")
    p.add_argument("--out", default=results_path("transfer"), help="JSON result")
    p.add_argument(
        "--impl",
        default="auto",
        choices=list(COPY_IMPLS),
        help="page-copy implementation (auto: the dispatcher's choice per platform; mgpu = Mosaic GPU, "
        "gpu = Pallas Triton; a kernel on CPU runs interpreted)",
    )
    p.add_argument(
        "--compare-impls",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also measure xla / mgpu / gpu gather and scatter side by side (default: on a GPU)",
    )
    p.add_argument("--layers", type=_layers, default=8, help="KV layers")
    p.add_argument("--heads", type=bounded(int, 1, MAX_HEADS), default=8, help="KV heads")
    p.add_argument("--head-dim", type=bounded(int, 1, MAX_HEAD_DIM), default=128, help="head dimension")
    p.add_argument("--dtype", type=_kv_dtype, default="bfloat16", help="KV dtype")
    p.add_argument("--page-sizes", type=_page_size, nargs="+", default=[1, 16, 64], help="tokens per page")
    p.add_argument(
        "--page-counts",
        type=_pages,
        nargs="+",
        default=None,
        help="pages per transfer (default: per page size, the smallest power of two moving >= 64 MiB)",
    )
    p.add_argument(
        "--layouts",
        nargs="+",
        choices=[l.value for l in HostLayout],
        default=[l.value for l in HostLayout],
        help="host pool layouts",
    )
    p.add_argument(
        "--host-copy",
        default="auto",
        choices=["auto", "xla_stream", "numpy"],
        help="how pages cross host<->device (auto: xla_stream where the host pool is pinned)",
    )
    p.add_argument(
        "--stream-loop",
        default=None,
        choices=["dynamic", "static"],
        help="xla_stream page loops: over the live count, or over the whole bucket (known trip count); "
        "default: the platform's (static on a GPU, dynamic elsewhere)",
    )
    p.add_argument(
        "--stream-unroll",
        type=bounded(int, 1, 1024),
        default=None,
        help="unroll factor of static page loops (default: the platform's, 8 on a GPU)",
    )
    p.add_argument("--reps", type=_positive_int, default=5, help="timed repetitions per op (median)")


def spec_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="one prompt of 192 tokens, file L3 (about a minute), for CI")
    p.add_argument(
        "--out",
        default=results_path("spec"),
        help="JSON result (the PNG goes beside it); relative paths are under the current directory",
    )
    p.add_argument(
        "--weights",
        default="toy",
        help="target + draft pair (.npz written by scripts/train_spec_pair.py); toy: the package's trained toy pair",
    )
    p.add_argument("--prompt-len", type=_tokens, default=512, help="tokens per repetitive prompt")
    p.add_argument(
        "--period",
        type=_non_negative_tokens,
        default=0,
        help="pattern length of the repetitive prompt (0: the period the pair was trained on)",
    )
    p.add_argument("--new-tokens", type=_tokens, default=32, help="tokens generated per prompt")
    p.add_argument("--k", type=bounded(int, 1, 1024), default=4, help="draft tokens per verify step (chain drafting)")
    p.add_argument(
        "--reps", type=_positive_int, default=5, help="prompts (patterns) per case; times are medians over them"
    )
    p.add_argument("--page-size", type=_page_size, default=16, help="tokens per KV page")
    p.add_argument(
        "--device-pages", type=_non_negative_pages, default=0, help="L1 pool size in pages (0: three requests' worth)"
    )
    p.add_argument(
        "--max-context",
        type=_non_negative_tokens,
        default=0,
        help="tokens per request (0: prompt + new tokens + 2k + a page)",
    )
    p.add_argument("--prefill-chunk", type=_tokens, default=512, help="tokens per prefill step")
    p.add_argument(
        "--storage-backend",
        choices=["orbax", "file"],
        default="orbax",
        help="L3 backend (a directory: the restarted engine reads what the first one wrote)",
    )
    p.add_argument(
        "--storage-dir", default=None, help="L3 directory (default %(default)s: a fresh temporary one, removed after)"
    )
    p.add_argument(
        "--worker-nice",
        type=_nice,
        default=DEFAULT_WORKER_NICE,
        help="OS priority offset of the cache's D2H and L3 threads (0: the scheduler's; on a busy "
        "machine +19 starves the L3 reads and TTFT measures the queue)",
    )
    p.add_argument("--seed", type=_seed, default=0, help="seed of the random patterns")
    rank_arguments(p)
