"""The multi-turn trace through EasyDeL's eSurge, alone and with hicache_jax attached.

``hicache-jax bench multiturn --engine easydel`` (``multiturn(args)``) and
``benchmarks/bench_easydel.py`` (``run(TraceConfig(...))``) run this. One eSurge engine (a random
Llama from ``testing`` on the CPU) serves the same trace in alternating passes, so the
machine's speed swings hit both alike: ``esurge`` (eSurge alone: its prefix cache is its only
tier) and ``hicache`` (the adapter attached: host pool + L3). Between passes eSurge's prefix
cache is reset and the adapter detached (each hicache pass gets a fresh L3 directory), so every
pass starts cold. Unmeasured warm-up passes first compile the adapter's copy shapes, as eSurge
compiles its own at start.

The trace: ``conversations`` conversations, each a ``first``-token opening; every turn re-sends
the whole conversation plus ``follow`` new tokens (a fixed stand-in for the previous answer and
the next question, so the trace never depends on the pass), one request at a time, round
robin, so the working set (every conversation's prefix) exceeds eSurge's ``pages``-page pool
and eSurge alone loses each prefix before it comes back.

Per pass: TTFT (a ``max_tokens=1`` request's wall time: prefill + first token), input
throughput (prompt tokens / summed request time), cached prompt tokens by tier (device =
eSurge's own hits) and the greedy token of every request, which must be the same in every
pass of both modes. The table has the median over passes and the ratio hicache / esurge.

Threading: one thread drives eSurge (``generate`` blocks); the adapter's hooks run on eSurge's
scheduler thread.
"""

from __future__ import annotations

import importlib.util
import os
import random
import shutil
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass

from . import testing

MODES = ("esurge", "hicache")
# ``--model`` presets of ``bench multiturn`` -> (hidden, layers) of the random Llama.
MODEL_SHAPES = {"tiny": (64, 2), "bench": (768, 6)}
L3_BACKENDS = ("file", "memory", "orbax", "none")


@dataclass(frozen=True)
class TraceConfig:
    conversations: int = 6
    turns: int = 4
    first: int = 160  # opening tokens per conversation
    follow: int = 24  # tokens each later turn adds
    pages: int = 24  # eSurge's KV pool, in pages
    page_size: int = 16
    hidden: int = 768
    layers: int = 6
    host_pages: int = 96  # the adapter's host pool
    storage_backend: str = "file"  # or "none": host tier only
    storage_dir: str | None = None  # None: a temporary directory per pass
    max_num_seqs: int = 1
    max_num_batched_tokens: int = 512
    passes: int = 2  # measured passes per mode
    warmup: int = 1  # unmeasured passes per mode first
    seed: int = 0

    def check(self) -> None:
        positive = (
            "conversations",
            "turns",
            "first",
            "pages",
            "page_size",
            "hidden",
            "layers",
            "host_pages",
            "max_num_seqs",
            "max_num_batched_tokens",
            "passes",
        )
        for name in positive:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}: expected an int >= 1, got {v!r}")
        for name in ("follow", "warmup"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{name}: expected an int >= 0, got {v!r}")
        if self.storage_backend not in L3_BACKENDS:
            raise ValueError(f"storage_backend: expected one of {L3_BACKENDS}, got {self.storage_backend!r}")
        if self.hidden % 4:
            raise ValueError(f"hidden: expected a multiple of 4 (4 heads), got {self.hidden}")

    @property
    def max_model_len(self) -> int:
        longest = self.first + (self.turns - 1) * self.follow
        return -(-(longest + 8) // self.page_size) * self.page_size


def trace(cfg: TraceConfig) -> list[list[str]]:
    """Per turn, the prompt of every conversation (word strings)."""
    r = random.Random(cfg.seed)
    convs = [[testing.word(r.randrange(testing.VOCAB - 2)) for _ in range(cfg.first)] for _ in range(cfg.conversations)]
    turns = []
    for _ in range(cfg.turns):
        turns.append([" ".join(c) for c in convs])
        for c in convs:
            c.extend(testing.word(r.randrange(testing.VOCAB - 2)) for _ in range(cfg.follow))
    return turns


def _serve(engine, turns, handle) -> dict:
    from easydel.inference.sampling_params import SamplingParams

    ttft, prompt_tokens, outputs = [], 0, []
    for prompts in turns:
        for text in prompts:
            t0 = time.perf_counter()
            out = engine.generate(text, SamplingParams(max_tokens=1, temperature=0.0))
            ttft.append(time.perf_counter() - t0)
            outputs.append(list(out[0].outputs[0].token_ids))
            prompt_tokens += len(text.split())
    total = sum(ttft)
    cached = blocked = None  # eSurge alone reports no per-request hits: counted only with the adapter
    if handle is not None:
        stats = handle.stats()
        cached, blocked = dict(stats["cached_tokens"]), dict(stats["blocked_seconds"])
    return {
        "ttft_mean_s": total / len(ttft),
        "input_tok_per_s": prompt_tokens / total,
        "seconds": total,
        "prompt_tokens": prompt_tokens,
        "requests": len(ttft),
        "cached_tokens": cached,
        "scheduler_blocked_s": blocked,
        "outputs": outputs,
    }


def run(cfg: TraceConfig, progress=None) -> dict:
    """Serve the trace in alternating passes; returns the JSON payload (``progress``: a
    ``bench.report.Progress`` or None for plain prints)."""
    cfg.check()
    testing.prepare_cpu()  # before easydel is imported
    from ...bench.report import machine_info
    from ...cache import HiCacheConfig
    from ...storage import StorageConfig
    from . import attach

    def say(text: str, total: int | None = None) -> None:  # a phase line (the heartbeat repeats it)
        if progress is None:
            print(text, flush=True)
        elif total is None:
            progress.note(text)
        else:
            progress.phase(text, total)

    turns = trace(cfg)
    tok_dir, l3_root = tempfile.mkdtemp(prefix="esurge-bench-tok-"), tempfile.mkdtemp(prefix="esurge-bench-l3-")
    results: dict[str, list] = {m: [] for m in MODES}
    engine = None
    try:
        testing.build_tokenizer(tok_dir)
        say(f"building eSurge (random Llama hidden {cfg.hidden}, {cfg.layers} layers; compiles every bucket)", 1)
        model = testing.random_llama(hidden=cfg.hidden, layers=cfg.layers, max_positions=cfg.max_model_len)
        engine = testing.start_engine(
            model,
            tok_dir,
            num_pages=cfg.pages,
            page_size=cfg.page_size,
            max_model_len=cfg.max_model_len,
            max_num_seqs=cfg.max_num_seqs,
            # eSurge refuses a step budget above max_model_len
            max_num_batched_tokens=min(cfg.max_num_batched_tokens, cfg.max_model_len),
        )
        say(
            f"passes (eSurge alone / with the adapter, alternating; {cfg.warmup} warm-up each)",
            2 * (cfg.warmup + cfg.passes),
        )
        for i in range(cfg.warmup + cfg.passes):
            for mode in MODES:
                assert engine.scheduler.kv_cache_manager.reset_prefix_cache(), "eSurge still holds pages"
                handle = None
                if mode == "hicache":
                    storage = None
                    if cfg.storage_backend != "none":
                        path = os.path.join(cfg.storage_dir or l3_root, f"pass{i}")
                        storage = StorageConfig(
                            backend=cfg.storage_backend, path=path, prefetch_threshold_tokens=cfg.page_size
                        )
                    hc = HiCacheConfig(page_size=cfg.page_size, load_back_threshold=cfg.page_size, storage=storage)
                    handle = attach(engine, hc, model="bench-llama", weights_revision="r0", host_pages=cfg.host_pages)
                try:
                    r = _serve(engine, turns, handle)
                finally:
                    if handle is not None:
                        handle.detach()
                warm = i < cfg.warmup
                if not warm:
                    results[mode].append(r)
                line = (
                    f"{'warm-up' if warm else 'pass'} {i} {mode:8s}: TTFT mean {r['ttft_mean_s'] * 1e3:7.1f} ms, "
                    f"input {r['input_tok_per_s']:8.0f} tok/s, cached {r['cached_tokens']}"
                )
                if progress is None:
                    print(line, flush=True)
                else:
                    progress.advance(1, line)
        pool = engine.scheduler.kv_cache_manager.page_pool.num_pages
    finally:
        if engine is not None:
            testing.close_engine(engine)
        shutil.rmtree(tok_dir, ignore_errors=True)
        shutil.rmtree(l3_root, ignore_errors=True)
    return _summary(cfg, pool, results, machine_info())


def _summary(cfg: TraceConfig, pool: int, results: dict, machine: dict) -> dict:
    med = {
        m: {k: statistics.median(r[k] for r in rs) for k in ("ttft_mean_s", "input_tok_per_s")}
        for m, rs in results.items()
    }
    reference = results["esurge"][0]["outputs"]
    same = all(r["outputs"] == reference for rs in results.values() for r in rs)
    last = results["hicache"][-1]
    prompt_tokens = last["prompt_tokens"]
    hit_rate = {tier: n / prompt_tokens for tier, n in last["cached_tokens"].items()}
    ratio = {
        "ttft_mean": med["hicache"]["ttft_mean_s"] / med["esurge"]["ttft_mean_s"],
        "input_throughput": med["hicache"]["input_tok_per_s"] / med["esurge"]["input_tok_per_s"],
    }
    return {
        "benchmark": "multiturn",
        "engine": "easydel",
        "config": asdict(cfg),
        "pool_pages": pool,
        "working_set_pages": cfg.conversations * -(-(cfg.first + (cfg.turns - 1) * cfg.follow) // cfg.page_size),
        "loadavg": list(os.getloadavg()),
        "machine": machine,
        "median": med,
        "ratio": ratio,
        "hit_rate_by_tier": hit_rate,
        "same_tokens": same,
        "passes": {m: [{k: v for k, v in r.items() if k != "outputs"} for r in rs] for m, rs in results.items()},
    }


def print_report(payload: dict) -> None:
    from ...bench.report import print_table

    cfg, med, ratio = payload["config"], payload["median"], payload["ratio"]
    last = payload["passes"]["hicache"][-1]
    rows = []
    for m in MODES:
        cached = payload["passes"][m][-1]["cached_tokens"]
        rows.append(
            [
                m,
                f"{med[m]['ttft_mean_s'] * 1e3:.1f}",
                f"{med[m]['input_tok_per_s']:.0f}",
                "-" if cached is None else " / ".join(str(cached[t]) for t in ("device", "host", "storage")),
            ]
        )
    rows.append(["hicache / esurge", f"x{ratio['ttft_mean']:.2f}", f"x{ratio['input_throughput']:.2f}", ""])
    print_table(
        f"eSurge multi-turn: {cfg['conversations']} conversations x {cfg['turns']} turns, "
        f"{last['prompt_tokens']} prompt tokens per pass, eSurge pool {payload['pool_pages']} pages, "
        f"host {cfg['host_pages']} pages, L3 {cfg['storage_backend']}; medians of {cfg['passes']} passes",
        ["mode", "TTFT mean ms", "input tok/s", "cached device / host / storage (last pass)"],
        rows,
    )
    rate = ", ".join(f"{t} {v:.0%}" for t, v in payload["hit_rate_by_tier"].items())
    blocked = last["scheduler_blocked_s"]
    print(
        f"hit rate by tier (hicache): {rate}; same greedy tokens in every pass: {payload['same_tokens']}; "
        f"load {tuple(round(x, 2) for x in payload['loadavg'])}"
    )
    print(
        f"eSurge's scheduler thread blocked in the adapter's copies (last hicache pass, "
        f"{last['seconds']:.1f} s of requests): " + ", ".join(f"{k} {v:.3f} s" for k, v in blocked.items())
    )


def from_multiturn_args(args) -> TraceConfig:
    """``bench multiturn``'s options (after ``--engine easydel``'s defaults) as a TraceConfig."""
    model = args.model if args.model in MODEL_SHAPES else "bench"
    hidden, layers = MODEL_SHAPES[model]
    return TraceConfig(
        conversations=args.clients,
        turns=args.rounds,
        first=args.first_len,
        follow=args.turn_len,
        pages=args.device_pages,
        page_size=args.page_size,
        hidden=hidden,
        layers=args.layers or layers,
        host_pages=max(1, round(args.host_ratio * args.device_pages)),
        storage_backend=args.storage_backend,
        storage_dir=args.storage_dir,
        max_num_seqs=args.max_batch,
        max_num_batched_tokens=args.prefill_chunk,
        seed=args.seed,
    )


def multiturn(args) -> dict:
    """``hicache-jax bench multiturn --engine easydel``: run, print the table, return the payload."""
    from ...bench.report import Progress

    if importlib.util.find_spec("easydel") is None:
        raise RuntimeError(
            "--engine easydel: easydel is not installed in this environment; easydel 0.3.0 pins "
            "jax 0.9.2, so it lives in its own venv (./scripts/test builds .venv-easydel: run "
            ".venv-easydel/bin/hicache-jax there; docs/easydel.md)"
        )
    cfg = from_multiturn_args(args)
    with Progress("multiturn --engine easydel") as progress:
        payload = run(cfg, progress)
    print_report(payload)
    return payload
