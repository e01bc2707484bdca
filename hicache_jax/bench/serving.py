"""Serving benchmarks on the reference engine: multi-turn, two-run, TTFT-by-tier, restart.

Each benchmark prints progress (``report.Progress``: at least every few seconds), a table,
and returns the JSON payload (the CLI writes it to ``--out``) with a PNG beside it
(``plots``). Baselines are measured in the same run, and results are reported as ratios.

* ``multiturn`` (the main job): clients x rounds; each round appends the previous answer and
  a new question to every client's history. Closed loop by default: a round's turns are sent
  when every answer of the previous round is back, and the engine serves at most
  ``--max-batch`` at once (upstream bench_multiturn's max-parallel bound), so the load is
  what the machine sustains; ``--request-rate`` > 0 spreads each round's arrivals (Poisson).
  Two engines, one with the cache (L1 smaller than the working set, L2 smaller still, L3
  taking every backup) and one without, run alternate rounds of the same trace, so machine
  noise hits both alike. TTFT is split into queueing (arrival -> admission) and service
  (admission -> first token: match, load-back, prefill). Each run reports the peak device
  pages per pool its running requests held (``Engine.metrics``). With a hybrid model
  (``--model hybrid``: sliding-window layers in their own SWA pool) a third engine serves the
  same trace with the cache and the sliding layers treated as full attention
  (``swa_as_full``: same weights, every layer's KV in the full pool): the memory the window
  saves is the difference of the peak KV bytes.
* ``two-run``: upstream PR #12214's protocol: the same prompts (~3.5k tokens) twice; TTFT
  and input throughput of each run.
* ``ttft``: a cold prefill of a 2k-token prompt vs the same prompt with 95% of its prefix
  cached on L1, on L2 (after forcing device eviction) and on L3 (after evicting L1 and L2);
  rounds measure every tier once each, in rotating order, and the medians over rounds are
  compared (the table says in how many rounds L1 < L2 < L3 < cold held). Then the decode
  step time while write-through backups run vs without.
* ``restart``: one process writes prompts through L1/L2 to L3 and exits; a fresh process
  pointed at the same directory re-sends them and hits L3 (upstream's reproduction).

L3 lives in ``--storage-dir`` (default: a fresh temporary directory, removed afterwards) with
the ``--storage-backend`` (default orbax); ``--storage-backend none`` runs L1 + L2 only.
``--storage-backend mooncake`` uses the Mooncake Store at ``--mooncake-master`` /
``--mooncake-metadata``, or by default starts a local one for the run (master, metadata
server and a store node holding the pages, ``hicache_jax.storage.mooncake.MooncakeMaster``;
engines lend it no memory) and stops it afterwards; ``restart``'s two processes share it.

Model: ``--model auto`` (the default) is ``llama3-8b-shape`` on a GPU or TPU (Llama-3-8B's layer
shape with bf16 KV, 8 layers, ``--layers N``; random weights) and the CPU-sized ``bench`` on a
CPU (``resolve_model``, where JAX is imported); ``--quick`` takes the tiny preset of the same kind.
``multiturn`` and ``ttft`` check issue 25's GPU goals (``goals``) and print every goal with its
value and threshold and a verdict; a run on the CPU, at ``--quick`` sizes or with another model
is "not comparable at these sizes" (fixed overheads dominate), said in the table title, the
JSON and on the PNG.

Compilation is excluded from every measurement: the engine is warmed up (``Engine.warmup``)
and one throwaway request of each kind runs before the clock starts. JAX and the engine are
imported when a benchmark runs, not when this module is (``hicache-jax --help`` stays fast).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np

from ..host_pool import HostPoolConfig
from ..reference_model import HYBRID_BENCH, HYBRID_TINY, ModelConfig
from ..reference_model.config import LLAMA3_8B_SHAPE, LLAMA3_8B_SHAPE_TINY
from ..storage.config import StorageConfig
from . import goals as bench_goals
from .text_conversations import arrival_times
from . import plots, ranks
from .options import AUTO_MODEL, CPU_MODEL, GPU_MODEL, REAL_MODELS
from .report import Progress, machine_info, percentile, print_table

if TYPE_CHECKING:  # pragma: no cover
    from ..engine import Engine

MODEL_PRESETS = {
    # Small enough for tests and smoke runs.
    "tiny": ModelConfig(vocab_size=512, num_layers=2, hidden=64, num_heads=4, num_kv_heads=2, head_dim=16, ffn=128),
    # Sized so a cold 2k-token prefill takes >= 1 s on the project's 2-core CPU VM even in its
    # fast state (8 layers took 0.96-2.1 s there).
    "bench": ModelConfig(
        vocab_size=2048, num_layers=10, hidden=512, num_heads=8, num_kv_heads=2, head_dim=64, ffn=2048
    ),
    # Hybrid (alternating sliding-window and full layers, gpt-oss's pattern): the tiny and
    # bench shapes with a window (24 and 128 tokens); ``--quick`` takes the tiny one.
    "hybrid-tiny": HYBRID_TINY,
    "hybrid": HYBRID_BENCH,
    # For a GPU (the default there): Llama-3-8B's layer shape, bf16 KV, 8 layers (--layers N);
    # --quick takes the tiny shape of the same kind.
    "llama3-8b-shape": LLAMA3_8B_SHAPE,
    "llama3-8b-shape-tiny": LLAMA3_8B_SHAPE_TINY,
}
TIERS = ("cold", "device", "host", "storage")


def serving_tier(result) -> str:
    """The tier that served most of the request's prefix ('cold' when nothing was cached)."""
    c = result.cached_tokens
    if sum(c.values()) == 0:
        return "cold"
    return max(("device", "host", "storage"), key=lambda t: c[t])


def _backend() -> str:
    import jax

    return jax.default_backend()


def resolve_model(args) -> str:
    """``--model auto`` (the default) becomes the preset for this backend: the GPU preset on a
    GPU or TPU (the CPU presets' model cost is too small there for a hit to matter), the CPU
    bench preset on a CPU. Imports JAX; call it in the process that runs the engines."""
    if args.model == AUTO_MODEL:
        args.model = CPU_MODEL if _backend() == "cpu" else GPU_MODEL
    return args.model


def with_layers(cfg: ModelConfig, layers: int) -> ModelConfig:
    """The preset with ``layers`` layers; a hybrid preset's full / sliding pattern repeats."""
    types = cfg.layer_types
    return replace(cfg, num_layers=layers, layer_types=tuple(types[i % len(types)] for i in range(layers)))


_REAL_WEIGHTS: dict = {}  # model name -> its loaded weights, shared by every engine of the process


def real_weights(name: str):
    """A real checkpoint's weights (``hicache_jax.models``), loaded once per process."""
    if name not in _REAL_WEIGHTS:
        from ..models.gemma3.paged import load_model

        _REAL_WEIGHTS[name] = load_model(name)
    return _REAL_WEIGHTS[name]


def real_tokenizer(name: str):
    """A real checkpoint's tokenizer (from its GGUF; the weights are not loaded)."""
    from ..models.gemma3 import Gemma3Tokenizer, model_file

    return Gemma3Tokenizer.from_gguf(model_file(name))


def model_config(args) -> ModelConfig:
    if args.model in REAL_MODELS:
        return real_weights(args.model).config
    cfg = MODEL_PRESETS[resolve_model(args)]
    if getattr(args, "layers", None) is not None:
        cfg = with_layers(cfg, args.layers)
    if args.attention != cfg.attention:
        cfg = replace(cfg, attention=args.attention)
    return cfg


def _not_comparable_because(args) -> list[str]:
    """Why this run cannot be judged against the goals (``goals.comparability``)."""
    return bench_goals.comparability(quick=bool(getattr(args, "quick", False)), backend=_backend(), model=args.model)


def _judge(
    args, goals: list, reasons: list[str] | None = None, note: str = bench_goals.OVERHEAD_NOTE
) -> tuple[list[dict], dict]:
    """The goals' records and the verdict, printed (by default comparable only on the GPU
    preset, on an accelerator, at full sizes; ``reasons``: other reasons a run is not)."""
    records, verdict = bench_goals.judge(goals, _not_comparable_because(args) if reasons is None else reasons, note)
    print("\n".join(bench_goals.lines(records, verdict)))
    return records, verdict


def storage_config(args) -> StorageConfig | None:
    if args.storage_backend == "none":
        return None
    common = dict(
        prefetch_policy=args.prefetch_policy, prefetch_threshold_tokens=args.page_size, worker_nice=args.worker_nice
    )
    if args.storage_backend == "mooncake":
        return StorageConfig(
            backend="mooncake",
            mooncake_master=args.mooncake_master,
            mooncake_metadata=args.mooncake_metadata,
            mooncake_global_segment_bytes=args.mooncake_segment_bytes,
            **common,
        )
    return StorageConfig(backend=args.storage_backend, path=args.storage_dir, **common)


def build_engine(
    args, max_context: int, storage: bool = True, host_ratio: float | None = None, model: ModelConfig | None = None
) -> "Engine":
    from ..engine import Engine, EngineCacheConfig

    cache = EngineCacheConfig(
        page_size=args.page_size,
        device_pages=args.device_pages,
        host=HostPoolConfig(
            ratio=args.host_ratio if host_ratio is None else host_ratio,
            layout=getattr(args, "host_layout", "page_first"),
        ),
        write_policy=args.write_policy,
        max_batch=args.max_batch,
        prefill_chunk=args.prefill_chunk,
        max_context=max_context,
        storage=storage_config(args) if storage else None,
        worker_nice=args.worker_nice,
        deterministic=getattr(args, "deterministic", False),
    )
    cfg = model_config(args) if model is None else model
    weights = real_weights(args.model).with_config(cfg) if args.model in REAL_MODELS else None
    engine = Engine(cfg, cache, weights=weights, ranks=ranks.rank_context(args))  # a rank of --num-processes
    engine.warmup()
    return engine


def describe(args, *extra: str) -> str:
    """The configuration line under every figure's title."""
    l3 = "no L3" if args.storage_backend == "none" else f"L3 {args.storage_backend}"
    layers = args.layers or (
        MODEL_PRESETS[args.model].num_layers
        if args.model in MODEL_PRESETS
        else _REAL_WEIGHTS[args.model].config.num_layers
        if args.model in _REAL_WEIGHTS
        else "?"
    )
    parts = [
        f"model {args.model} ({args.attention}, {layers} layers)",
        f"page {args.page_size}",
        f"L1 {args.device_pages} pages",
        f"L2 x{args.host_ratio:g}"
        + (f" {args.host_layout}" if getattr(args, "host_layout", "page_first") != "page_first" else ""),
        l3,
        args.write_policy,
        f"max batch {args.max_batch}",
        *(["deterministic"] if getattr(args, "deterministic", False) else []),
        *extra,
        f"{os.cpu_count()} CPUs",
    ]
    try:
        parts.append(f"load {os.getloadavg()[0]:.1f}")
    except OSError:  # pragma: no cover
        pass
    return ", ".join(parts)


def _png(args) -> str:
    return os.path.splitext(args.out)[0] + ".png"


class _StorageDir:
    """Where L3 lives for the run. Directory backends: ``--storage-dir`` if given (kept), else
    a temporary directory removed at the end. ``mooncake``: the store at ``--mooncake-master``
    if given, else a local one (master + store node) started here and stopped at the end."""

    def __init__(self, args) -> None:
        self.args, self.tmp, self.store = args, None, None

    def __enter__(self):
        a = self.args
        if a.storage_backend == "mooncake":
            if not a.mooncake_master:
                from ..storage.mooncake import MooncakeMaster

                self.store = MooncakeMaster(store_node_bytes=a.mooncake_node_bytes).start()
                print(
                    f"[L3] local Mooncake Store: master {self.store.rpc_address}, store node "
                    f"{a.mooncake_node_bytes / 2**30:.2f} GiB",
                    flush=True,
                )
                a.mooncake_master, a.mooncake_metadata = self.store.rpc_address, self.store.metadata_url
            return None
        if a.storage_backend != "none" and not a.storage_dir:
            self.tmp = tempfile.mkdtemp(prefix="hicache-l3-")
            a.storage_dir = self.tmp
        return a.storage_dir

    def __exit__(self, *exc) -> None:
        if self.tmp:
            shutil.rmtree(self.tmp, ignore_errors=True)
            self.args.storage_dir = None
        if self.store is not None:
            self.store.stop()
            self.args.mooncake_master = self.args.mooncake_metadata = None


# ---------------------------------------------------------------------------------------------
# exactness reports: tokens vs the no-cache run, served page bytes (Engine.enable_page_audit)
def token_divergence(served: list[list[int]], reference: list[list[int]]) -> dict:
    """Per request (same order in both), the first position where the served tokens differ
    from the reference's; how many requests diverged, and the earliest."""
    first = []
    for i, (a, b) in enumerate(zip(served, reference)):
        if a != b:
            pos = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            first.append((i, pos))
    return {
        "requests": len(reference),
        "diverged": len(first),
        "same": not first and len(served) == len(reference),
        "first_divergence": [list(x) for x in first[:50]],
        "earliest_position": min((p for _, p in first), default=None),
    }


def enable_audit(engine: "Engine"):
    """The engine's page audit (None with several ranks: it reads whole pages)."""
    return engine.enable_page_audit() if engine.ranks is None else None


def print_exactness(div: dict, audit, deterministic: bool, where: str = "") -> None:
    """Whether tokens matched the no-cache run's (and where they diverged), and whether the
    served pages were byte-identical to the bytes stored: a rounding difference (default mode,
    pages identical) is told apart from a wrong page."""
    mode = "deterministic" if deterministic else "default mode"
    if div["same"]:
        print(f"tokens vs no cache{where} ({mode}): identical in all {div['requests']} requests")
    else:
        shown = ", ".join(f"#{i}@{p}" for i, p in div["first_divergence"][:8])
        print(
            f"tokens vs no cache{where} ({mode}): {div['diverged']} of {div['requests']} requests diverged, "
            f"earliest at token {div['earliest_position']} (request#index@token: {shown})"
        )
    if audit is None:
        print("served pages: not audited (several ranks)")
        return
    st = audit.stats()
    checked = st["pages_checked"]
    per_tier = ", ".join(f"L{n} {checked[t]}" for n, t in ((1, "device"), (2, "host"), (3, "storage")))
    verdict = {True: "byte-identical to the pages stored", False: "NOT byte-identical", None: "none served"}
    print(
        f"served pages: {verdict[st['byte_identical']]} ({per_tier} pages checked; "
        f"{sum(st['pages_mismatched'].values())} mismatched, {sum(st['pages_unknown'].values())} never seen "
        f"computed; audit {st['seconds']:.2f} s, left out of the TTFTs)"
    )
    if not div["same"] and st["byte_identical"] and not deterministic:
        print(
            "  -> the cache served exactly what was stored: the divergence is rounding (other step shapes), "
            "not a wrong page; --deterministic makes the tokens identical"
        )


# ---------------------------------------------------------------------------------------------
# multiturn
@dataclass
class Round:
    results: list
    seconds: float


class Conversations:
    """The clients' histories: every round appends the previous answer and a new question."""

    def __init__(self, args, vocab: int, seed: int) -> None:
        self.args = args
        self.rng = np.random.default_rng(seed)
        self.vocab = vocab
        self.histories = [self.rng.integers(0, vocab, args.first_len).tolist() for _ in range(args.clients)]
        self.round = 0

    def prompts(self) -> tuple[list[list[int]], list[float]]:
        a = self.args
        if self.round:
            for h in self.histories:
                h.extend(self.rng.integers(0, self.vocab, a.turn_len).tolist())
        self.round += 1
        return [list(h) for h in self.histories], arrival_times(self.rng, a.request_rate, a.clients)

    def answered(self, results: list) -> None:
        for h, res in zip(self.histories, results):
            h.extend(res.tokens)


def _serve_round(engine: "Engine", conv: Conversations, use_cache: bool) -> Round:
    prompts, arrivals = conv.prompts()
    t0 = time.perf_counter()
    results = engine.generate(
        prompts,
        conv.args.answer_len,
        use_cache=use_cache,
        arrivals=arrivals,
        stop_tokens=getattr(conv, "stop_tokens", ()),
    )
    r = Round(results, time.perf_counter() - t0)
    conv.answered(results)
    return r


def summarize_rounds(rounds: list[Round]) -> dict:
    res = [x for r in rounds for x in r.results]
    ttft = [x.ttft_s for x in res]
    prompt = sum(x.prompt_len for x in res)
    return {
        "requests": len(res),
        "ttft_mean_s": statistics.fmean(ttft),
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p90_s": percentile(ttft, 90),
        "ttft_p99_s": percentile(ttft, 99),
        "ttft_max_s": max(ttft),
        "queue_mean_s": statistics.fmean(x.queue_s for x in res),
        "queue_p50_s": percentile([x.queue_s for x in res], 50),
        "service_mean_s": statistics.fmean(x.service_s for x in res),
        "service_p50_s": percentile([x.service_s for x in res], 50),
        "latency_mean_s": statistics.fmean(x.latency_s for x in res),
        "duration_s": sum(r.seconds for r in rounds),
        "input_tok_per_s": prompt / sum(r.seconds for r in rounds),
        "prompt_tokens": prompt,
        "prefill_tokens": sum(x.prefill_tokens for x in res),
        "cache_hit_rate": sum(x.cached_total for x in res) / prompt,
        "hit_rate_by_tier": {t: sum(x.cached_tokens[t] for x in res) / prompt for t in ("device", "host", "storage")},
        "hit_rate_per_round": [
            sum(x.cached_total for x in r.results) / sum(x.prompt_len for x in r.results) for r in rounds
        ],
        "ttft_all_s": ttft,
        "ttft_by_round_s": [[x.ttft_s for x in r.results] for r in rounds],
        "ttft_by_tier": {t: [x.ttft_s for x in res if serving_tier(x) == t] for t in TIERS},
        "service_all_s": [x.service_s for x in res],
        "service_by_tier": {t: [x.service_s for x in res if serving_tier(x) == t] for t in TIERS},
        "per_request": [
            {
                "round": i,
                "prompt_len": x.prompt_len,
                "cached": x.cached_tokens,
                "ttft_s": x.ttft_s,
                "queue_s": x.queue_s,
                "service_s": x.service_s,
                "prefill_tokens": x.prefill_tokens,
            }
            for i, r in enumerate(rounds)
            for x in r.results
        ],
    }


def multiturn(args) -> dict:
    """``bench multiturn`` on one reference engine (or ``--num-processes`` ranks of one); the
    command itself (``bench.multiturn``) hands eSurge and routed runs elsewhere."""
    if ranks.wants_ranks(args):  # --num-processes N: N ranks serve it (bench.ranks)
        with _StorageDir(args):
            return ranks.launch(args, "multiturn")
    ranks.rank_out(args)
    with Progress("multiturn") as progress, _StorageDir(args):
        return _multiturn(args, progress)


class _NewPrompts:
    """``--no-reuse``: every request a new random prompt, as long as that turn's prompt would be
    in a conversation (first prompt + a turn and an answer per round), so nothing can hit."""

    def __init__(self, args, vocab: int, seed: int) -> None:
        self.args = args
        self.rng = np.random.default_rng(seed)
        self.vocab = vocab
        self.round = 0

    def prompts(self) -> tuple[list[list[int]], list[float]]:
        a = self.args
        n = a.first_len + self.round * (a.turn_len + a.answer_len)
        self.round += 1
        return (
            [self.rng.integers(0, self.vocab, n).tolist() for _ in range(a.clients)],
            arrival_times(self.rng, a.request_rate, a.clients),
        )

    def answered(self, results: list) -> None:
        pass


def _new_conversations(args, vocab: int, seed: int, warm: bool = False):
    """The clients' conversations: random token ids for a preset, real text for a checkpoint
    (``text_conversations``; the warm-up's start with other words, so they share no prefix);
    with ``--no-reuse`` a new random prompt per request."""
    if getattr(args, "no_reuse", False):
        return _NewPrompts(args, vocab, seed)
    if args.model in REAL_MODELS:
        from .text_conversations import TextConversations

        return TextConversations(args, real_tokenizer(args.model), seed, salt="Warm-up copy. " if warm else "")
    return Conversations(args, vocab, seed)


def _multiturn(args, progress: Progress) -> dict:
    max_context = args.first_len + args.rounds * (args.turn_len + args.answer_len) + 16
    if args.model in REAL_MODELS:
        progress.phase(f"loading {args.model} (the first run assembles and dequantizes it)")
        max_context = _new_conversations(args, 0, args.seed).max_context(args.rounds, args.answer_len)
    resolve_model(args)
    progress.phase(f"building and compiling two engines (model {args.model}; the first build imports JAX)", 2)
    cached_engine = build_engine(args, max_context)
    progress.advance(1, "hicache engine ready")
    base_engine = build_engine(args, max_context, storage=False, host_ratio=4 / args.device_pages)  # unused: tiny host
    progress.advance(1, "no-cache engine ready")
    # (name, engine, use_cache); a hybrid model also runs with its sliding layers as full ones.
    runs = [("no cache", base_engine, False), ("hicache", cached_engine, True)]
    model = cached_engine.model_config
    if model.is_hybrid:
        full_args = args
        if args.storage_backend not in ("none", "mooncake"):  # its own L3 directory (its keys differ anyway)
            full_args = argparse.Namespace(
                **{**vars(args), "storage_dir": os.path.join(args.storage_dir, "swa-as-full")}
            )
        runs.append(
            ("hicache, SWA as full", build_engine(full_args, max_context, model=replace(model, swa_as_full=True)), True)
        )
        progress.advance(0, "SWA-as-full engine ready")
    vocab = model.vocab_size
    # Throwaway conversations with other tokens: compile the transfer paths, warm the buffers.
    warm = argparse.Namespace(
        **{**vars(args), "clients": min(2, args.clients), "rounds": min(2, args.rounds), "request_rate": 0}
    )
    progress.phase("warm-up (untimed, other tokens)", len(runs) * warm.rounds)
    for _name, engine, use in runs:
        conv = _new_conversations(warm, vocab, args.seed + 1000, warm=True)
        for _ in range(warm.rounds):
            _serve_round(engine, conv, use)
            progress.advance(1)
        engine.metrics.peak_device_pages = engine.metrics.peak_swa_device_pages = 0
        if use:
            engine.flush()
            engine.cache.reset()  # L1 and L2 only: the warm-up's L3 pages use other tokens and never hit
            engine.cache.metrics.reset()
    audit = enable_audit(cached_engine)  # after the warm-up's reset: the measured rounds only
    # The same trace through every engine, alternate rounds: the no-cache round first.
    convs = {name: _new_conversations(args, vocab, args.seed) for name, _e, _u in runs}
    rounds: dict[str, list[Round]] = {name: [] for name, _e, _u in runs}
    progress.phase(
        f"{args.clients} clients x {args.rounds} rounds, {' / '.join(rounds)} alternating", len(runs) * args.rounds
    )
    for r in range(args.rounds):
        for name, engine, use in runs:
            for _n, other, other_use in runs:
                if other_use and other is not engine:
                    other.flush()  # another engine's background copies never overlap this round
            rnd = _serve_round(engine, convs[name], use)
            rounds[name].append(rnd)
            if use and audit is not None and engine is cached_engine:
                audit.settle()  # the page audit's hashing and comparing, between the timed rounds
            med = statistics.median(x.ttft_s for x in rnd.results)
            hit = sum(x.cached_total for x in rnd.results) / sum(x.prompt_len for x in rnd.results)
            progress.advance(1, f"round {r} {name}: TTFT p50 {med * 1e3:,.0f} ms, hit {hit:.0%}")
    tokens = {name: [x.tokens for rr in rs for x in rr.results] for name, rs in rounds.items()}
    served = tokens["hicache"]
    same = served == tokens["no cache"]
    divergence = token_divergence(served, tokens["no cache"])
    stats = cached_engine.stats()
    summaries = {}
    for name, engine, _use in runs:
        s = summaries[name] = summarize_rounds(rounds[name])
        s["peak_device_pages"] = {"full": engine.metrics.peak_device_pages, "swa": engine.metrics.peak_swa_device_pages}
        s["peak_kv_bytes"] = (
            engine.metrics.peak_device_pages * engine.geom.bytes_per_page
            + engine.metrics.peak_swa_device_pages * (engine.swa_pool.geom.bytes_per_page if engine.hybrid else 0)
        )
        s["device_pool_pages"] = {
            "full": engine.device_pool.allocator.num_pages,
            "swa": engine.swa_pool.allocator.num_pages if engine.hybrid else 0,
        }
        engine.close()
    base, cached = summaries["no cache"], summaries["hicache"]
    rows = []
    for name, s in summaries.items():
        rows.append(
            [
                name,
                s["requests"],
                s["ttft_p50_s"] * 1e3,
                s["ttft_p90_s"] * 1e3,
                s["ttft_p99_s"] * 1e3,
                s["ttft_mean_s"] * 1e3,
                s["queue_mean_s"] * 1e3,
                s["service_mean_s"] * 1e3,
                s["input_tok_per_s"],
                s["cache_hit_rate"],
                s["hit_rate_by_tier"]["device"],
                s["hit_rate_by_tier"]["host"],
                s["hit_rate_by_tier"]["storage"],
                s["peak_device_pages"]["full"],
                s["peak_device_pages"]["swa"],
                s["peak_kv_bytes"] / 2**20,
            ]
        )
    load = "closed loop" if args.request_rate <= 0 else f"{args.request_rate:g} req/s per round"
    no_reuse = bool(getattr(args, "no_reuse", False))
    trace = "no reuse (a new prompt per request)" if no_reuse else "multi-turn"
    print_table(
        f"{trace}: {args.clients} clients x {args.rounds} rounds, {load}, {describe(args)}"
        f"{bench_goals.size_label(_not_comparable_because(args))}",
        [
            "run",
            "reqs",
            "TTFT p50 ms",
            "p90",
            "p99",
            "mean",
            "queue mean",
            "service mean",
            "input tok/s",
            "hit rate",
            "L1",
            "L2",
            "L3",
            "peak full pages",
            "peak SWA pages",
            "peak KV MiB",
        ],
        rows,
    )
    ratios = {
        "ttft_mean": cached["ttft_mean_s"] / base["ttft_mean_s"],
        "ttft_p50": cached["ttft_p50_s"] / base["ttft_p50_s"],
        "service_mean": cached["service_mean_s"] / base["service_mean_s"],
        "input_throughput": cached["input_tok_per_s"] / base["input_tok_per_s"],
        "prefill_tokens": cached["prefill_tokens"] / base["prefill_tokens"],
    }
    print(
        f"hicache / no cache (same trace, alternate rounds): TTFT mean x{ratios['ttft_mean']:.3f}, "
        f"p50 x{ratios['ttft_p50']:.3f}, service mean x{ratios['service_mean']:.3f}, "
        f"input throughput x{ratios['input_throughput']:.2f}; same tokens: {same}"
    )
    # Work, not time: the same at any size and on any machine (the time ratios are not at --quick sizes).
    print(
        f"prefill work: hicache computed {cached['prefill_tokens']:,} of {cached['prompt_tokens']:,} prompt "
        f"tokens, x{ratios['prefill_tokens']:.3f} of no cache's {base['prefill_tokens']:,} (comparable at any size)"
    )
    print_exactness(divergence, audit, cached_engine.cache_config.deterministic)
    moved, moved_text = bytes_moved(stats)
    print("bytes moved per tier: " + moved_text)
    transcript = None
    if args.model in REAL_MODELS:
        transcript = _side_by_side(convs["no cache"], convs["hicache"], rounds["hicache"])
    swa_vs_full = None
    if "hicache, SWA as full" in summaries:
        as_full = summaries["hicache, SWA as full"]
        swa_vs_full = {
            "peak_kv_bytes": cached["peak_kv_bytes"] / as_full["peak_kv_bytes"],
            "ttft_mean": cached["ttft_mean_s"] / as_full["ttft_mean_s"],
            "input_throughput": cached["input_tok_per_s"] / as_full["input_tok_per_s"],
        }
        print(
            f"hybrid / SWA as full (both with hicache): peak KV bytes of the running requests "
            f"x{swa_vs_full['peak_kv_bytes']:.3f} ({cached['peak_kv_bytes'] / 2**20:.2f} vs "
            f"{as_full['peak_kv_bytes'] / 2**20:.2f} MiB), TTFT mean x{swa_vs_full['ttft_mean']:.3f}, input "
            f"throughput x{swa_vs_full['input_throughput']:.2f}"
        )
    if cached["hit_rate_by_tier"]["storage"] == 0 and args.storage_backend != "none" and not no_reuse:
        print("note: no prefix came back from L3 (the host pool held them all): lower --host-ratio to see L3 hits")
    if no_reuse:  # the cache's overhead: judged wherever it runs at full size
        goals, verdict = _judge(
            args,
            bench_goals.no_reuse_goals(ratios["input_throughput"], ratios["ttft_mean"]),
            ["--quick sizes"] if getattr(args, "quick", False) else [],
            note="on a model this small a request's fixed costs weigh more than at full size",
        )
    else:
        goals, verdict = _judge(args, bench_goals.multiturn_goals(ratios["input_throughput"], ratios["ttft_mean"]))
    sub = describe(
        args,
        f"{args.clients} clients x {args.rounds} rounds",
        load,
        f"first {args.first_len} + {args.turn_len}/turn tokens, answers {args.answer_len}",
    )
    title = (
        "No reuse (what the cache costs): TTFT with hicache vs without"
        if no_reuse
        else "Multi-turn serving: TTFT with hicache vs without"
    )
    png = plots.multiturn_plot(_png(args), title, sub, base, cached, note=bench_goals.plot_note(verdict))
    out = {
        "benchmark": "multiturn",
        "machine": machine_info(),
        "config": vars(args),
        "no_cache": base,
        "bytes_moved": moved,
        "hicache": cached,
        "ratios_vs_no_cache": ratios,
        "same_tokens": same,
        "deterministic": cached_engine.cache_config.deterministic,
        "token_divergence": divergence,
        "page_audit": audit.stats() if audit is not None else None,
        "tokens_sha256": hashlib.sha256(json.dumps(served).encode()).hexdigest(),
        "cache_stats": stats,
        "plot": png,
    }
    out["goals"], out["verdict"] = goals, verdict
    if transcript is not None:
        out["transcript"] = transcript
    if swa_vs_full is not None:
        out["swa_as_full"] = summaries["hicache, SWA as full"]
        out["hybrid_vs_swa_as_full"] = swa_vs_full
    ranks.report_rank(cached_engine.cache, out, served)
    return out


def bytes_moved(stats: dict) -> tuple[dict, str]:
    """KV bytes each tier moved in a run, from the cache's counters (``stats()``), and the L3
    backend's own GB/s where it times its reads and writes (the device <-> host copies are timed
    from issue to completion, queueing included, so no rate is given for them); and the line
    that says so."""
    mib = 2**20
    out = {
        "d2h_backup_bytes": int(stats.get("backup_bytes", 0)),
        "h2d_load_bytes": int(stats.get("load_back_bytes", 0)),
        "l3_written_bytes": int(stats.get("storage_written_bytes", 0)),
        "l3_read_bytes": int(stats.get("storage_read_bytes", 0)),
    }
    parts = [
        f"D2H backups {out['d2h_backup_bytes'] / mib:,.1f} MiB",
        f"H2D loads {out['h2d_load_bytes'] / mib:,.1f} MiB",
    ]
    for op, sec in (("written", "storage_write_seconds"), ("read", "storage_read_seconds")):
        n, t = out[f"l3_{op}_bytes"], float(stats.get(sec, 0.0))
        out[f"l3_{op}_gbps"] = n / t / 1e9 if n and t > 0 else None
        rate = f" at {out[f'l3_{op}_gbps']:.3g} GB/s" if out[f"l3_{op}_gbps"] is not None else ""
        parts.append(f"L3 {op} {n / mib:,.1f} MiB{rate}")
    return out, ", ".join(parts)


def _side_by_side(base, cached, cached_rounds: list[Round], client: int = 1, width: int = 60) -> list[dict]:
    """Print one conversation's answers without and with the cache, side by side, with what the
    cache served of each turn's prompt; returns them for the JSON."""
    import textwrap

    out = []
    print(f"\nconversation {client} (document {base.doc_of[client]}), answers generated without | with the cache:")
    for r, ((q, a0), (_q, a1)) in enumerate(zip(base.transcript(client), cached.transcript(client))):
        res = cached_rounds[r].results[client]
        served = ", ".join(f"{t} {n}" for t, n in res.cached_tokens.items() if n) or "nothing"
        print(
            f"turn {r + 1}: Q: {q}   [prompt {res.prompt_len} tokens; cache served {served}; "
            f"{'same text' if a0 == a1 else 'TEXT DIFFERS'}]"
        )
        left, right = textwrap.wrap(a0, width) or [""], textwrap.wrap(a1, width) or [""]
        for i in range(max(len(left), len(right))):
            print(f"  {left[i] if i < len(left) else '':{width}s} | {right[i] if i < len(right) else ''}")
        out.append(
            {
                "question": q,
                "no_cache": a0,
                "hicache": a1,
                "prompt_tokens": res.prompt_len,
                "cached_tokens": dict(res.cached_tokens),
            }
        )
    return out


# ---------------------------------------------------------------------------------------------
# two-run
def two_run(args) -> dict:
    with Progress("two-run") as progress, _StorageDir(args):
        return _two_run(args, progress)


def _two_run(args, progress: Progress) -> dict:
    rng = np.random.default_rng(args.seed)
    resolve_model(args)
    progress.phase(f"building and compiling the engine (model {args.model}; imports JAX)")
    engine = build_engine(args, args.prompt_len + args.answer_len + 16)
    vocab = engine.model_config.vocab_size
    progress.phase("warm-up (untimed, other tokens)")
    warm = [rng.integers(0, vocab, args.prompt_len).tolist() for _ in range(2)]
    engine.generate(warm, args.answer_len)
    engine.generate(warm, args.answer_len)
    engine.flush()
    engine.cache.reset()
    prompts = [rng.integers(0, vocab, args.prompt_len).tolist() for _ in range(args.num_prompts)]
    runs = []
    progress.phase(f"{args.num_prompts} prompts x {args.prompt_len} tokens, twice", 2 * len(prompts))
    for i in range(2):
        t0 = time.perf_counter()
        res = []
        for prompt in prompts:  # one at a time: progress per request, TTFT without queueing
            res += engine.generate([prompt], args.answer_len)
            progress.advance(1, f"run {i + 1}: TTFT {res[-1].ttft_s * 1e3:,.0f} ms ({serving_tier(res[-1])})")
        runs.append((res, time.perf_counter() - t0))
    engine.close()
    rows, out = [], []
    for i, (res, secs) in enumerate(runs):
        ttft = [r.ttft_s for r in res]
        tier = {t: sum(serving_tier(r) == t for r in res) for t in TIERS}
        d = {
            "run": i + 1,
            "ttft_mean_s": statistics.fmean(ttft),
            "ttft_p50_s": percentile(ttft, 50),
            "duration_s": secs,
            "input_tok_per_s": sum(r.prompt_len for r in res) / secs,
            "requests_by_tier": tier,
            "same_tokens_as_run1": [r.tokens for r in res] == [r.tokens for r in runs[0][0]],
        }
        out.append(d)
        rows.append(
            [
                i + 1,
                d["ttft_p50_s"] * 1e3,
                d["ttft_mean_s"] * 1e3,
                secs,
                d["input_tok_per_s"],
                tier["cold"],
                tier["device"],
                tier["host"],
                tier["storage"],
                d["same_tokens_as_run1"],
            ]
        )
    print_table(
        f"two-run: {args.num_prompts} prompts x {args.prompt_len} tokens, {describe(args)}",
        ["run", "TTFT p50 ms", "mean", "duration s", "input tok/s", "cold", "L1", "L2", "L3", "same tokens"],
        rows,
    )
    delta = out[1]["ttft_mean_s"] / out[0]["ttft_mean_s"] - 1
    print(f"TTFT run 2 vs run 1 (no cache hit): {delta * 100:+.1f}%")
    png = plots.tiers_plot(
        _png(args),
        "Two runs of the same prompts: TTFT of run 2 vs run 1",
        describe(args, f"{args.num_prompts} prompts x {args.prompt_len} tokens"),
        [
            ("run 1: cold (no cache hit)", [r.ttft_s for r in runs[0][0]]),
            ("run 2: served by the cache", [r.ttft_s for r in runs[1][0]]),
        ],
    )
    return {
        "benchmark": "two-run",
        "machine": machine_info(),
        "config": vars(args),
        "runs": out,
        "ttft_change": delta,
        "plot": png,
    }


# ---------------------------------------------------------------------------------------------
# ttft by tier
def ttft(args) -> dict:
    with Progress("ttft") as progress, _StorageDir(args):
        return _ttft(args, progress)


def _ttft(args, progress: Progress) -> dict:
    rng = np.random.default_rng(args.seed)
    resolve_model(args)
    progress.phase(f"building and compiling the engine (model {args.model}; imports JAX)")
    engine = build_engine(args, args.prompt_len + args.answer_len + 16)
    vocab = engine.model_config.vocab_size
    keep = int(args.prompt_len * args.reuse)
    audit = enable_audit(engine)
    checked: list[tuple[list[int], list[int]]] = []  # (served, no-cache) tokens of every cached request

    def variant(base: list[int]) -> list[int]:  # same prefix, fresh suffix: ~reuse of it cached
        return base[:keep] + rng.integers(0, vocab, args.prompt_len - keep).tolist()

    def one(prompt, **kw):
        return engine.generate([prompt], args.answer_len, **kw)[0]

    def measure(kind: str):
        base = rng.integers(0, vocab, args.prompt_len).tolist()
        if kind == "cold":
            return one(base, use_cache=False)
        one(base)  # populate the cache (not timed)
        engine.flush()
        if kind == "host":
            engine.evict_device_cache()
        elif kind == "storage":
            engine.evict_host_cache()
        prompt = variant(base)
        res = one(prompt)
        checked.append((res.tokens, one(prompt, use_cache=False).tokens))  # the reference (not timed)
        return res

    kinds = ("cold", "device", "host") + (("storage",) if engine.storage is not None else ())
    progress.phase("warm-up: every tier once (untimed)", len(kinds))
    for kind in kinds:  # compile and fault in every path once
        measure(kind)
        progress.advance(1, kind)
    # Rounds: every tier once per round, in rotating order, so load swings hit all tiers alike.
    results: dict[str, list] = {k: [] for k in kinds}
    progress.phase(f"{args.reps} rounds x {len(kinds)} tiers", args.reps * len(kinds))
    for r in range(args.reps):
        for kind in kinds[r % len(kinds) :] + kinds[: r % len(kinds)]:
            res = measure(kind)
            results[kind].append(res)
            progress.advance(1, f"round {r}: {kind} {res.ttft_s * 1e3:,.0f} ms")
    divergence = token_divergence([a for a, _ in checked], [b for _, b in checked])
    audit_stats = audit.stats() if audit is not None else None
    engine.audit = None  # the decode test's requests are not audited
    engine.cache.reset()
    progress.phase("decode step with vs without write-through backups", 2 * args.decode_reps + 2)
    decode = _decode_overhead(engine, args, rng, progress)
    engine.close()
    med = {k: statistics.median(r.ttft_s for r in v) for k, v in results.items()}
    order = [k for k in ("device", "host", "storage", "cold") if k in kinds]
    held = sum(
        all(results[a][i].ttft_s < results[b][i].ttft_s for a, b in zip(order, order[1:])) for i in range(args.reps)
    )
    rows = [
        [
            k,
            statistics.median(r.cached_total for r in v),
            statistics.median(r.cached_tokens[k] for r in v) if k != "cold" else 0,
            med[k] * 1e3,
            percentile([r.ttft_s for r in v], 25) * 1e3,
            percentile([r.ttft_s for r in v], 75) * 1e3,
            min(r.ttft_s for r in v) * 1e3,
            med[k] / med["cold"],
        ]
        for k, v in results.items()
    ]
    print_table(
        f"TTFT by tier: {args.prompt_len}-token prompts, {args.reuse:.0%} prefix reuse, {args.reps} rounds, "
        f"{describe(args)}{bench_goals.size_label(_not_comparable_because(args))}",
        ["served by", "cached tokens", "from that tier", "TTFT p50 ms", "p25", "p75", "min", "x cold"],
        rows,
    )
    ordered = all(med[a] < med[b] for a, b in zip(order, order[1:]))
    print(
        f"ordering {' < '.join(order)}: medians {'in' if ordered else 'NOT in'} that order; "
        f"held within {held}/{args.reps} rounds"
    )
    if decode["ratio"] is None:
        print(
            "decode: no decode step overlapped a backup (they all finished before the decode); "
            "raise --prompt-len or --decode-steps"
        )
    else:
        print(
            f"decode step while write-through backups run (L3 {args.storage_backend}): "
            f"{decode['with_backups_s'] * 1e3:.1f} ms vs {decode['without_backups_s'] * 1e3:.1f} ms with none: "
            f"x{decode['ratio']:.3f} ({decode['overlapping_steps']} overlapping steps in {args.decode_reps} "
            f"interleaved rounds; all {decode['steps_per_round']} steps: x{decode['all_steps_ratio']:.3f})"
        )
    r = decode["with_rounds"]
    print(
        f"  backups: {statistics.median(x['host_tokens_acked_by_decode_end'] for x in r):.0f} tokens on the host "
        f"and {statistics.median(x['l3_pages_committed_by_decode_end'] for x in r):.0f} of "
        f"{statistics.median(x['l3_pages_committed_total'] for x in r):.0f} L3 pages committed by the decode's end, "
        f"drained {statistics.median(x['drain_after_decode_s'] for x in r) * 1e3:.0f} ms after it "
        f"(workers at nice +{decode['worker_nice']})"
    )
    print_exactness(divergence, audit, engine.cache_config.deterministic, " (each cached prompt re-run cold)")
    goals, verdict = _judge(args, bench_goals.ttft_goals(med, held, args.reps, order, decode["ratio"]))
    sub = describe(
        args,
        f"{args.prompt_len}-token prompts, {args.reuse:.0%} of the prefix cached",
        f"{args.reps} rounds (tiers in rotating order)",
    )
    png = plots.tiers_plot(
        _png(args),
        f"TTFT of a {args.reuse:.0%}-cached prompt by the tier that served it, vs a cold prefill",
        sub,
        [(plots.TIER_NAMES[k], [x.ttft_s for x in results[k]]) for k in ("cold", *order[:-1])],
        note=bench_goals.plot_note(verdict),
    )
    return {
        "benchmark": "ttft",
        "machine": machine_info(),
        "config": vars(args),
        "median_ttft_s": med,
        "ttft_s": {k: [x.ttft_s for x in v] for k, v in results.items()},
        "ratios_vs_cold": {k: v / med["cold"] for k, v in med.items()},
        "ordering": {"tiers": order, "held_rounds": held, "rounds": args.reps, "medians_ordered": ordered},
        "decode": decode,
        "goals": goals,
        "verdict": verdict,
        "plot": png,
        "deterministic": engine.cache_config.deterministic,
        "token_divergence": divergence,
        "page_audit": audit_stats,
    }


def _decode_overhead(engine: "Engine", args, rng, progress: Progress) -> dict:
    """Decode step time of a full batch while write-through backups run vs with none.

    "With": ``engine`` (write_through, L3 as configured): a long prompt is prefilled just
    before the batch, so its backup (device gather, D2H, L3 hashing and segment saves) and
    the batch's own prompts' backups run while the batch decodes. "Without": the same engine
    and the same requests with ``use_cache=False`` (nothing inserted, so nothing backed up):
    same pools, same compiled steps, so only the backups differ. Rounds are interleaved so
    machine noise hits both alike.

    Every decode step is timed (``Engine.on_decode_step``). A step of the "with" engine
    counts as overlapping when, at its start, a D2H backup, an L3 backup job or an
    uncommitted L3 page was in flight; the goal's ratio compares those steps with the steps
    of the same index in the "without" rounds (so backups that finish early cannot hide in
    a long average). The mean over every step is reported beside it, with how much backup
    work ran: tokens acknowledged on the host, L3 pages committed, and the drain after the
    decode (0 when the backups finished during it).
    """
    vocab = engine.model_config.vocab_size
    n, steps = engine.cache_config.max_batch, args.decode_steps

    def l3_pages(e: "Engine") -> int:
        return e.storage.storage.metrics.snapshot()["pages_written"] if e.storage is not None else 0

    def busy(e: "Engine") -> bool:
        if e.cache.in_flight[0]:
            return True
        ctl = e.storage
        return ctl is not None and (ctl.stats()["storage_backups_in_flight"] > 0 or ctl.storage.writes_pending())

    def run(e: "Engine", backups: bool) -> dict:
        prompts = [rng.integers(0, vocab, 64).tolist() for _ in range(n)]
        e.flush()
        b0, w0 = e.cache.metrics.backup_tokens, l3_pages(e)
        # The long prompt's backup overlaps the decode (with use_cache=False nothing is backed up).
        e.generate([rng.integers(0, vocab, args.prompt_len).tolist()], 1, use_cache=backups)
        log = []

        def hook(phase: str) -> None:
            if phase == "start":
                overlapping = busy(e)  # before the clock starts: not part of the step
                log.append([time.perf_counter(), None, overlapping])
            else:
                log[-1][1] = time.perf_counter()

        e.on_decode_step = hook
        try:
            e.generate(prompts, steps, use_cache=backups)
        finally:
            e.on_decode_step = None
        e.cache.check_events()
        acked, written = e.cache.metrics.backup_tokens - b0, l3_pages(e) - w0
        t1 = time.perf_counter()
        e.flush()
        return {
            "step_s": [b - a for a, b, _ in log],
            "overlapping": [o for _, _, o in log],
            "host_tokens_acked_by_decode_end": acked,
            "l3_pages_committed_by_decode_end": written,
            "l3_pages_committed_total": l3_pages(e) - w0,
            "drain_after_decode_s": time.perf_counter() - t1,
        }

    run(engine, True), run(engine, False)  # warm-up
    progress.advance(2, "warm-up")
    with_r, without_r = [], []
    for i in range(args.decode_reps):
        with_r.append(run(engine, True))
        without_r.append(run(engine, False))
        progress.advance(2, f"round {i}")
    over_with, over_without = [], []
    for w, q in zip(with_r, without_r):
        for i, o in enumerate(w["overlapping"]):
            if o and i < len(q["step_s"]):
                over_with.append(w["step_s"][i])
                over_without.append(q["step_s"][i])
    mean = statistics.fmean
    all_with = [t for r in with_r for t in r["step_s"]]
    all_without = [t for r in without_r for t in r["step_s"]]
    ratio = mean(over_with) / mean(over_without) if over_with else None
    return {
        "with_backups_s": mean(over_with) if over_with else None,
        "without_backups_s": mean(over_without) if over_without else None,
        "ratio": ratio,
        "overlapping_steps": len(over_with),
        "steps_per_round": steps,
        "all_steps_with_s": mean(all_with),
        "all_steps_without_s": mean(all_without),
        "all_steps_ratio": mean(all_with) / mean(all_without),
        "with_rounds": with_r,
        "without_rounds": without_r,
        "worker_nice": engine.cache_config.worker_nice,
        "without_backup_tokens": sum(r["host_tokens_acked_by_decode_end"] for r in without_r),
    }


# ---------------------------------------------------------------------------------------------
# restart
def restart(args) -> dict:
    """Phase ``write`` and phase ``read`` run in separate processes over one storage directory."""
    if args.storage_backend in ("none", "memory"):
        raise SystemExit("restart: needs an L3 that outlives a process (--storage-backend orbax|file|mooncake)")
    if args.phase != "both":
        return _restart_phase(args)
    with _StorageDir(args):
        phases = {}
        for phase in ("write", "read"):
            part = args.out.rsplit(".", 1)[0] + f".{phase}.json"
            cmd = [sys.executable, "-m", "hicache_jax.cli", "bench", "restart", "--phase", phase, "--out", part]
            for k in (
                "model",
                "layers",
                "attention",
                "page_size",
                "device_pages",
                "host_ratio",
                "write_policy",
                "max_batch",
                "prefill_chunk",
                "seed",
                "storage_backend",
                "storage_dir",
                "prefetch_policy",
                "num_prompts",
                "prompt_len",
                "answer_len",
                "worker_nice",
                "mooncake_master",
                "mooncake_metadata",
                "mooncake_segment_bytes",
            ):
                if getattr(args, k) is not None:
                    cmd += [f"--{k.replace('_', '-')}", str(getattr(args, k))]
            print(f"[restart] phase {phase}: a new process (pid will differ) ...", file=sys.stderr, flush=True)
            spawned = time.time()  # the children stamp time.time() too: one clock on one machine
            subprocess.run(cmd, check=True)
            with open(part) as f:
                phases[phase] = json.load(f)
            phases[phase]["spawned"] = spawned
            os.remove(part)
    w, r = phases["write"], phases["read"]
    ready = {name: time_to_first_token(phases[name]) for name in ("write", "read")}
    args.model = w["model"]  # --model auto: the preset the children resolved (JAX never ran here)
    rows = [
        ["write (process 1)", w["ttft_mean_s"] * 1e3, w["cached"]["storage"], w["pid"]],
        ["read (process 2)", r["ttft_mean_s"] * 1e3, r["cached"]["storage"], r["pid"]],
    ]
    print_table(
        f"restart: {args.num_prompts} prompts x {args.prompt_len} tokens, L3 {args.storage_backend}",
        ["phase", "TTFT mean ms", "tokens from L3", "pid"],
        rows,
    )
    print_table(
        "time to the first token from process start (s): the restarted process's first request is an L3 hit",
        ["phase", *READY_STEPS.values(), "total"],
        [
            [f"{name} (process {i + 1})", *(ready[name][k] for k in READY_STEPS), ready[name]["total"]]
            for i, name in enumerate(("write", "read"))
        ],
    )
    if r.get("l3_index_seconds"):  # (backends that keep no index of their own count none)
        print(f"the restarted process rebuilt its L3 index in {r['l3_index_seconds']:.3f} s, part of its engine step")
    same = w["tokens"] == r["tokens"]
    ratio = r["ttft_mean_s"] / w["ttft_mean_s"]
    ready_ratio = ready["read"]["total"] / ready["write"]["total"]
    print(
        f"same tokens: {same}; TTFT after restart x{ratio:.3f} of the cold run; time to the first token from "
        f"process start x{ready_ratio:.3f} of the cold process's"
    )
    png = plots.tiers_plot(
        _png(args),
        "After a restart: TTFT of prompts served from L3 vs their cold first run",
        describe(args, f"{args.num_prompts} prompts x {args.prompt_len} tokens", "two processes, one L3 directory"),
        [("cold: process 1 (no cache hit)", w["ttft_s"]), ("storage: process 2 (L3 hits)", r["ttft_s"])],
    )
    return {
        "benchmark": "restart",
        "machine": machine_info(),
        "config": vars(args),
        "write": w,
        "read": r,
        "same_tokens": same,
        "ttft_ratio": ratio,
        "time_to_first_token": ready,
        "time_to_first_token_ratio": ready_ratio,
        "plot": png,
    }


# Steps of a process's start, in order, as (stamp, label): each step's time runs from the
# stamp before it (the first from the parent's spawn) to its own.
READY_STEPS = {
    "entered": "python + imports",
    "engine_built": "engine: JAX, model, L3 opened",
    "warm": "warm-up (compiles)",
    "first_token": "first request to its first token",
}


def time_to_first_token(phase: dict) -> dict:
    """Seconds per start-up step of one restart phase (``READY_STEPS``) and their total, from the
    parent's spawn time and the child's stamps (``time.time()`` on both sides)."""
    out, last = {}, phase["spawned"]
    for k in READY_STEPS:
        out[k] = phase["stamps"][k] - last
        last = phase["stamps"][k]
    out["total"] = last - phase["spawned"]
    return out


def _restart_phase(args) -> dict:
    with Progress(f"restart/{args.phase}") as progress:
        return _restart_phase_run(args, progress)


def _restart_phase_run(args, progress: Progress) -> dict:
    stamps = {"entered": time.time()}
    rng = np.random.default_rng(args.seed)
    resolve_model(args)
    progress.phase(f"building and compiling the engine (model {args.model}; imports JAX)")
    engine = build_engine(args, args.prompt_len + args.answer_len + 16)
    stamps["engine_built"] = time.time()
    index_s = (
        engine.storage.storage.metrics.snapshot().get("index_rebuild_seconds")  # the store's own counter
        if engine.storage is not None
        else None
    )
    progress.phase("warm-up (untimed, other tokens)")
    vocab = engine.model_config.vocab_size
    prompts = [rng.integers(0, vocab, args.prompt_len).tolist() for _ in range(args.num_prompts)]
    if args.phase == "write":  # compile the cold path with other tokens, then the measured cold run
        engine.generate([rng.integers(0, vocab, args.prompt_len).tolist()], args.answer_len, use_cache=False)
    else:  # compile the L3 path with other tokens written and read in this process
        other = [rng.integers(0, vocab, args.prompt_len).tolist()]
        engine.generate(other, args.answer_len)
        engine.evict_host_cache()
        engine.generate(other, args.answer_len)
        engine.flush()
        engine.cache.reset()
    stamps["warm"] = time.time()
    progress.phase(f"{args.num_prompts} prompts x {args.prompt_len} tokens", args.num_prompts)
    res = []
    for prompt in prompts:  # one at a time: progress per request, TTFT without queueing
        t0 = time.time()
        res += engine.generate([prompt], args.answer_len)
        stamps.setdefault("first_token", t0 + res[-1].ttft_s)
        progress.advance(1, f"TTFT {res[-1].ttft_s * 1e3:,.0f} ms ({serving_tier(res[-1])})")
    progress.phase("flushing L3 and closing" if args.phase == "write" else "closing")
    engine.close()  # the write phase's L3 pages are all on disk when the process exits
    return {
        "pid": os.getpid(),
        "phase": args.phase,
        "model": args.model,
        "tokens": [r.tokens for r in res],
        "ttft_s": [r.ttft_s for r in res],
        "ttft_mean_s": statistics.fmean(r.ttft_s for r in res),
        "cached": {t: sum(r.cached_tokens[t] for r in res) for t in ("device", "host", "storage")},
        "stamps": stamps,
        "l3_index_seconds": index_s,
    }
