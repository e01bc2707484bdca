"""Serving benchmarks on the reference engine: multi-turn, two-run, TTFT-by-tier.

Each benchmark prints a readable table, writes JSON and draws a PNG. Baselines are measured
in the same run (a no-cache pass, or a cold prefill), and results are reported as ratios.

* ``multiturn``: clients x rounds; each round appends the previous answer and a new question
  to every client's history; Poisson arrivals at ``--request-rate``. Run once with the cache
  and once without (the baseline); TTFT percentiles, throughput and hit rate per round.
* ``two-run``: upstream PR #12214's protocol: the same prompts (~3.5k tokens) twice; TTFT
  and input throughput of each run.
* ``ttft``: the issue's goals in one run: a cold 2k-token prefill vs the same prompt with
  >= 90% of its prefix cached on L1, on L2 (after forcing device eviction) and on L3 (after
  evicting L1 and L2), and the decode step time while write-through backups run vs without.
* ``restart``: one process writes prompts through L1/L2 to L3 and exits; a fresh process
  pointed at the same directory re-sends them and hits L3 (upstream's reproduction).

L3 lives in ``--storage-dir`` (default: a fresh temporary directory, removed afterwards) with
the ``--storage-backend`` (default orbax); ``--storage-backend none`` runs L1 + L2 only.

Compilation is excluded from every measurement: the engine is warmed up (``Engine.warmup``)
and one throwaway request of each kind runs before the clock starts.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import numpy as np

from ..engine import Engine, EngineCacheConfig, multiprocess
from ..host_pool import HostPoolConfig
from ..reference_model import ModelConfig
from ..storage.config import StorageConfig
from ..workers import DEFAULT_WORKER_NICE
from .report import machine_info, print_table, write_json

MODEL_PRESETS = {
    # Small enough for tests and smoke runs.
    "tiny": ModelConfig(vocab_size=512, num_layers=2, hidden=64, num_heads=4, num_kv_heads=2, head_dim=16, ffn=128),
    # Sized so a cold 2k-token prefill takes >= 1 s on the project's 2-core CPU VM even in its
    # fast state (8 layers took 0.96-2.1 s there).
    "bench": ModelConfig(vocab_size=2048, num_layers=10, hidden=512, num_heads=8, num_kv_heads=2, head_dim=64,
                         ffn=2048),
}
TIERS = ("cold", "device", "host", "storage")


def _progress(total: int, desc: str):
    try:
        from tqdm import tqdm
        return tqdm(total=total, desc=desc, unit="req", file=sys.stderr, leave=False)
    except ImportError:  # pragma: no cover
        return None


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def serving_tier(result) -> str:
    """The tier that served most of the request's prefix ('cold' when nothing was cached)."""
    c = result.cached_tokens
    if sum(c.values()) == 0:
        return "cold"
    return max(("device", "host", "storage"), key=lambda t: c[t])


def model_config(args) -> ModelConfig:
    cfg = MODEL_PRESETS[args.model]
    if args.attention != cfg.attention:
        from dataclasses import replace
        cfg = replace(cfg, attention=args.attention)
    return cfg


def storage_config(args) -> StorageConfig | None:
    if args.storage_backend == "none":
        return None
    return StorageConfig(backend=args.storage_backend, path=args.storage_dir, prefetch_policy=args.prefetch_policy,
                         prefetch_threshold_tokens=args.page_size, worker_nice=args.worker_nice)


def build_engine(args, max_context: int) -> Engine:
    cache = EngineCacheConfig(page_size=args.page_size, device_pages=args.device_pages,
                              host=HostPoolConfig(ratio=args.host_ratio), write_policy=args.write_policy,
                              max_batch=args.max_batch, prefill_chunk=args.prefill_chunk, max_context=max_context,
                              storage=storage_config(args), worker_nice=args.worker_nice)
    ranks = None
    if multiprocess.in_rank():  # one of --num-processes ranks (engine.multiprocess)
        ranks = multiprocess.rank_context(getattr(args, "agreement", "kv"))
    engine = Engine(model_config(args), cache, ranks=ranks)
    engine.warmup()
    return engine


class _StorageDir:
    """``--storage-dir`` if given (kept), else a temporary directory removed at the end."""

    def __init__(self, args) -> None:
        self.args, self.tmp = args, None

    def __enter__(self):
        if self.args.storage_backend != "none" and not self.args.storage_dir:
            self.tmp = tempfile.mkdtemp(prefix="hicache-l3-")
            self.args.storage_dir = self.tmp
        return self.args.storage_dir

    def __exit__(self, *exc) -> None:
        if self.tmp:
            shutil.rmtree(self.tmp, ignore_errors=True)
            self.args.storage_dir = None


# ---------------------------------------------------------------------------------------------
# multiturn
@dataclass
class _Round:
    results: list
    seconds: float


def _run_multiturn(engine: Engine, args, use_cache: bool, label: str) -> list[_Round]:
    rng = np.random.default_rng(args.seed)
    vocab = engine.model_config.vocab_size
    histories = [rng.integers(0, vocab, args.first_len).tolist() for _ in range(args.clients)]
    rounds, bar = [], _progress(args.clients * args.rounds, label)
    for r in range(args.rounds):
        if r:
            for h in histories:
                h.extend(rng.integers(0, vocab, args.turn_len).tolist())
        gaps = rng.exponential(1.0 / args.request_rate, args.clients) if args.request_rate > 0 else np.zeros(
            args.clients)
        arrivals = np.cumsum(gaps) - gaps[0]
        t0 = time.perf_counter()
        results = engine.generate([list(h) for h in histories], args.answer_len, use_cache=use_cache,
                                  arrivals=arrivals.tolist())
        rounds.append(_Round(results, time.perf_counter() - t0))
        for h, res in zip(histories, results):
            h.extend(res.tokens)
        if bar is not None:
            bar.update(args.clients)
    if bar is not None:
        bar.close()
    return rounds


def _summarize(rounds: list[_Round]) -> dict:
    res = [x for r in rounds for x in r.results]
    ttft = [x.ttft_s for x in res]
    prompt = sum(x.prompt_len for x in res)
    out = {
        "requests": len(res),
        "ttft_mean_s": statistics.fmean(ttft), "ttft_p50_s": _pct(ttft, 50), "ttft_p90_s": _pct(ttft, 90),
        "ttft_p99_s": _pct(ttft, 99), "ttft_max_s": max(ttft),
        "latency_mean_s": statistics.fmean(x.latency_s for x in res),
        "duration_s": sum(r.seconds for r in rounds),
        "input_tok_per_s": prompt / sum(r.seconds for r in rounds),
        "cache_hit_rate": sum(x.cached_total for x in res) / prompt,
        "hit_rate_by_tier": {t: sum(x.cached_tokens[t] for x in res) / prompt for t in ("device", "host", "storage")},
        "hit_rate_per_round": [sum(x.cached_total for x in r.results) / sum(x.prompt_len for x in r.results)
                               for r in rounds],
        "ttft_by_tier": {t: [x.ttft_s for x in res if serving_tier(x) == t] for t in TIERS},
        "per_request": [{"round": i, "prompt_len": x.prompt_len, "cached": x.cached_tokens, "ttft_s": x.ttft_s,
                         "prefill_tokens": x.prefill_tokens} for i, r in enumerate(rounds) for x in r.results],
    }
    return out


def _plot(path: str, title: str, by_tier: dict, per_round: list[float] | None) -> str | None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    ncols = 2 if per_round is not None else 1
    fig, axes = plt.subplots(1, ncols, figsize=(6 * ncols, 4))
    axes = np.atleast_1d(axes)
    data = [(t, [v * 1e3 for v in by_tier.get(t, [])]) for t in TIERS if by_tier.get(t)]
    if data:
        axes[0].boxplot([d for _, d in data], tick_labels=[f"{t}\n(n={len(d)})" for t, d in data])
    axes[0].set_ylabel("TTFT (ms)")
    axes[0].set_title("TTFT by the tier that served the prefix")
    if per_round is not None:
        axes[1].plot(range(len(per_round)), per_round, marker="o")
        axes[1].set_xlabel("round")
        axes[1].set_xticks(range(len(per_round)))
        axes[1].set_ylabel("cache hit rate")
        axes[1].set_ylim(0, 1)
        axes[1].set_title("hit rate per round")
    fig.suptitle(title)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)  # results/ is not in the repo
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def multiturn(args) -> dict:
    if getattr(args, "num_processes", 1) > 1 and not multiprocess.in_rank():
        return multiprocess.launch_bench(args, "multiturn")
    multiprocess.rank_out(args)
    with _StorageDir(args):
        return _multiturn(args)


def _multiturn(args) -> dict:
    max_context = args.first_len + args.rounds * (args.turn_len + args.answer_len) + 16
    engine = build_engine(args, max_context)
    # Throwaway pass with other tokens: compiles the transfer paths and warms the pinned buffers.
    warm = argparse.Namespace(**{**vars(args), "clients": min(2, args.clients), "rounds": min(2, args.rounds),
                                 "seed": args.seed + 1000, "request_rate": 0})
    _run_multiturn(engine, warm, True, "warm-up")
    engine.flush()
    engine.cache.reset()  # L1 and L2 only: the warm-up's L3 pages use other tokens and never hit
    base_rounds = _run_multiturn(engine, args, False, "no cache")
    base = _summarize(base_rounds)
    cached_rounds = _run_multiturn(engine, args, True, "hicache")
    cached = _summarize(cached_rounds)
    stats = engine.stats()
    engine.close()
    tokens = [x.tokens for r in cached_rounds for x in r.results]
    same_as_no_cache = tokens == [x.tokens for r in base_rounds for x in r.results]
    rows = []
    for name, s in (("no cache", base), ("hicache", cached)):
        rows.append([name, s["requests"], s["ttft_mean_s"] * 1e3, s["ttft_p50_s"] * 1e3, s["ttft_p90_s"] * 1e3,
                     s["ttft_p99_s"] * 1e3, s["input_tok_per_s"], s["cache_hit_rate"],
                     s["hit_rate_by_tier"]["device"], s["hit_rate_by_tier"]["host"],
                     s["hit_rate_by_tier"]["storage"]])
    print_table(f"multi-turn: {args.clients} clients x {args.rounds} rounds, model {args.model}, "
                f"page {args.page_size}, {args.write_policy}, {args.request_rate} req/s, "
                f"L1 {args.device_pages} pages, L2 x{args.host_ratio}, L3 {args.storage_backend}",
                ["run", "reqs", "TTFT mean ms", "p50", "p90", "p99", "input tok/s", "hit rate", "L1", "L2", "L3"],
                rows)
    ratios = {"ttft_mean": cached["ttft_mean_s"] / base["ttft_mean_s"],
              "ttft_p50": cached["ttft_p50_s"] / base["ttft_p50_s"],
              "input_throughput": cached["input_tok_per_s"] / base["input_tok_per_s"]}
    print(f"hicache / no-cache: TTFT mean x{ratios['ttft_mean']:.3f}, p50 x{ratios['ttft_p50']:.3f}, "
          f"input throughput x{ratios['input_throughput']:.2f}")
    print(f"tokens with the cache equal the no-cache run's: {same_as_no_cache}")
    png = _plot(args.out.rsplit(".", 1)[0] + ".png", "multi-turn (hicache)", cached["ttft_by_tier"],
                cached["hit_rate_per_round"])
    payload = {"benchmark": "multiturn", "machine": machine_info(), "config": vars(args), "no_cache": base,
               "hicache": cached, "ratios_vs_no_cache": ratios, "cache_stats": stats,
               "same_tokens_as_no_cache": same_as_no_cache, "plot": png}
    multiprocess.report_rank(engine, payload, tokens)
    return payload


# ---------------------------------------------------------------------------------------------
# two-run
def two_run(args) -> dict:
    with _StorageDir(args):
        return _two_run(args)


def _two_run(args) -> dict:
    rng = np.random.default_rng(args.seed)
    engine = build_engine(args, args.prompt_len + args.answer_len + 16)
    vocab = engine.model_config.vocab_size
    warm = [rng.integers(0, vocab, args.prompt_len).tolist() for _ in range(2)]
    engine.generate(warm, args.answer_len)
    engine.generate(warm, args.answer_len)
    engine.flush()
    engine.cache.reset()
    prompts = [rng.integers(0, vocab, args.prompt_len).tolist() for _ in range(args.num_prompts)]
    runs = []
    for i in range(2):
        bar = _progress(len(prompts), f"run {i + 1}")
        t0 = time.perf_counter()
        res = engine.generate(prompts, args.answer_len)
        runs.append((res, time.perf_counter() - t0))
        if bar is not None:
            bar.update(len(prompts))
            bar.close()
    engine.close()
    rows, out = [], []
    for i, (res, secs) in enumerate(runs):
        ttft = [r.ttft_s for r in res]
        tier = {t: sum(serving_tier(r) == t for r in res) for t in TIERS}
        d = {"run": i + 1, "ttft_mean_s": statistics.fmean(ttft), "duration_s": secs,
             "input_tok_per_s": sum(r.prompt_len for r in res) / secs, "requests_by_tier": tier,
             "same_tokens_as_run1": [r.tokens for r in res] == [r.tokens for r in runs[0][0]]}
        out.append(d)
        rows.append([i + 1, d["ttft_mean_s"] * 1e3, secs, d["input_tok_per_s"], tier["cold"], tier["device"],
                     tier["host"], tier["storage"], d["same_tokens_as_run1"]])
    print_table(f"two-run: {args.num_prompts} prompts x {args.prompt_len} tokens, model {args.model}",
                ["run", "TTFT mean ms", "duration s", "input tok/s", "cold", "L1", "L2", "L3", "same tokens"], rows)
    delta = out[1]["ttft_mean_s"] / out[0]["ttft_mean_s"] - 1
    print(f"TTFT run2 vs run1: {delta * 100:+.1f}%")
    png = _plot(args.out.rsplit(".", 1)[0] + ".png", "two-run",
                {t: [r.ttft_s for r in runs[0][0] + runs[1][0] if serving_tier(r) == t] for t in TIERS}, None)
    return {"benchmark": "two-run", "machine": machine_info(), "config": vars(args), "runs": out,
            "ttft_change": delta, "plot": png}


# ---------------------------------------------------------------------------------------------
# ttft goals
def ttft(args) -> dict:
    with _StorageDir(args):
        return _ttft(args)


def _ttft(args) -> dict:
    rng = np.random.default_rng(args.seed)
    engine = build_engine(args, args.prompt_len + args.answer_len + 16)
    vocab = engine.model_config.vocab_size
    keep = int(args.prompt_len * args.reuse)

    def variant(base: list[int]) -> list[int]:  # same prefix, fresh suffix: ~reuse of it cached
        return base[:keep] + rng.integers(0, vocab, args.prompt_len - keep).tolist()

    def one(prompt, **kw):
        return engine.generate([prompt], 1, **kw)[0]

    def measure(kind: str) -> list:
        out = []
        for _ in range(args.reps):
            base = rng.integers(0, vocab, args.prompt_len).tolist()
            if kind == "cold":
                out.append(one(base, use_cache=False))
                continue
            one(base)  # populate the cache (not timed)
            engine.flush()
            if kind == "host":
                engine.evict_device_cache()
            elif kind == "storage":
                engine.evict_host_cache()
            out.append(one(variant(base)))
        return out

    kinds = ("cold", "device", "host") + (("storage",) if engine.storage is not None else ())
    for kind in kinds:  # warm-up: compile and fault in every path once
        measure(kind)
    results = {k: measure(k) for k in kinds}
    engine.cache.reset()
    # Decode step time with and without write-through backups in flight.
    decode = _decode_overhead(engine, args, rng)
    engine.close()
    med = {k: statistics.median(r.ttft_s for r in v) for k, v in results.items()}
    rows = [[k, statistics.median(r.cached_total for r in v), statistics.median(r.cached_tokens[k] for r in v)
             if k != "cold" else 0, med[k] * 1e3, med[k] / med["cold"]] for k, v in results.items()]
    print_table(f"TTFT by tier: {args.prompt_len}-token prompts, {args.reuse:.0%} prefix reuse, model {args.model} "
                f"(median of {args.reps})", ["served by", "cached tokens", "from that tier", "TTFT ms", "x cold"], rows)
    r = decode["with_rounds"]
    if decode["ratio"] is None:
        print("decode: no decode step overlapped a backup (they all finished before the decode); "
              "raise --prompt-len or --decode-steps")
    else:
        print(f"decode step while write-through backups run (L3 {args.storage_backend}): "
              f"{decode['with_backups_s'] * 1e3:.1f} ms vs {decode['without_backups_s'] * 1e3:.1f} ms with none: "
              f"x{decode['ratio']:.3f} ({decode['overlapping_steps']} overlapping steps in {args.decode_reps} "
              f"interleaved rounds; all {decode['steps_per_round']} steps: x{decode['all_steps_ratio']:.3f})")
    print(f"  backups: {statistics.median(x['host_tokens_acked_by_decode_end'] for x in r):.0f} tokens on the host "
          f"and {statistics.median(x['l3_pages_committed_by_decode_end'] for x in r):.0f} of "
          f"{statistics.median(x['l3_pages_committed_total'] for x in r):.0f} L3 pages committed by the decode's end, "
          f"drained {statistics.median(x['drain_after_decode_s'] for x in r) * 1e3:.0f} ms after it "
          f"(workers at nice +{decode['worker_nice']})")
    goals = {"l2_over_cold": med["host"] / med["cold"], "l2_goal": 0.10,
             "l3_over_cold": med["storage"] / med["cold"] if "storage" in med else None, "l3_goal": 0.15,
             "decode_ratio": decode["ratio"], "decode_goal": 1.05}
    print("goals: " + ", ".join(f"{k}={v:.3f}" for k, v in goals.items() if isinstance(v, float)))
    png = _plot(args.out.rsplit(".", 1)[0] + ".png", "TTFT by tier",
                {("cold" if k == "cold" else k): [r.ttft_s for r in v] for k, v in results.items()}, None)
    return {"benchmark": "ttft", "machine": machine_info(), "config": vars(args),
            "median_ttft_s": med, "ratios_vs_cold": {k: v / med["cold"] for k, v in med.items()},
            "decode": decode, "goals": goals, "plot": png}


def _decode_overhead(engine: Engine, args, rng) -> dict:
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

    def l3_pages(e: Engine) -> int:
        return e.storage.storage.metrics.snapshot()["pages_written"] if e.storage is not None else 0

    def busy(e: Engine) -> bool:
        if e.cache.in_flight[0]:
            return True
        ctl = e.storage
        return ctl is not None and (ctl.stats()["backups_in_flight"] > 0 or ctl.storage.writes_pending())

    def run(e: Engine, backups: bool) -> dict:
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
        return {"step_s": [b - a for a, b, _ in log], "overlapping": [o for _, _, o in log],
                "host_tokens_acked_by_decode_end": acked, "l3_pages_committed_by_decode_end": written,
                "l3_pages_committed_total": l3_pages(e) - w0, "drain_after_decode_s": time.perf_counter() - t1}

    run(engine, True), run(engine, False)  # warm-up
    with_r, without_r = [], []
    for _ in range(args.decode_reps):
        with_r.append(run(engine, True))
        without_r.append(run(engine, False))
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
    return {"with_backups_s": mean(over_with) if over_with else None,
            "without_backups_s": mean(over_without) if over_without else None, "ratio": ratio,
            "overlapping_steps": len(over_with), "steps_per_round": steps,
            "all_steps_with_s": mean(all_with), "all_steps_without_s": mean(all_without),
            "all_steps_ratio": mean(all_with) / mean(all_without),
            "with_rounds": with_r, "without_rounds": without_r,
            "worker_nice": engine.cache_config.worker_nice,
            "without_backup_tokens": sum(r["host_tokens_acked_by_decode_end"] for r in without_r)}


# ---------------------------------------------------------------------------------------------
# restart
def restart(args) -> dict:
    """Phase ``write`` and phase ``read`` run in separate processes over one storage directory."""
    if args.storage_backend == "none":
        raise SystemExit("restart: needs an L3 backend (--storage-backend orbax|file)")
    if args.phase != "both":
        return _restart_phase(args)
    with _StorageDir(args):
        phases = {}
        for phase in ("write", "read"):
            part = args.out.rsplit(".", 1)[0] + f".{phase}.json"
            cmd = [sys.executable, "-m", "hicache_jax.cli", "bench", "restart", "--phase", phase, "--out", part,
                   "--storage-dir", args.storage_dir]
            for k in ("model", "attention", "page_size", "device_pages", "host_ratio", "write_policy", "max_batch",
                      "prefill_chunk", "seed", "storage_backend", "prefetch_policy", "num_prompts", "prompt_len",
                      "answer_len", "worker_nice"):
                cmd += [f"--{k.replace('_', '-')}", str(getattr(args, k))]
            print(f"[restart] phase {phase}: a new process (pid will differ) ...", flush=True)
            subprocess.run(cmd, check=True)
            with open(part) as f:
                phases[phase] = json.load(f)
            os.remove(part)
    w, r = phases["write"], phases["read"]
    rows = [["write (process 1)", w["ttft_mean_s"] * 1e3, w["cached"]["storage"], w["pid"]],
            ["read (process 2)", r["ttft_mean_s"] * 1e3, r["cached"]["storage"], r["pid"]]]
    print_table(f"restart: {args.num_prompts} prompts x {args.prompt_len} tokens, L3 {args.storage_backend}",
                ["phase", "TTFT mean ms", "tokens from L3", "pid"], rows)
    same = w["tokens"] == r["tokens"]
    ratio = r["ttft_mean_s"] / w["ttft_mean_s"]
    print(f"same tokens: {same}; TTFT after restart x{ratio:.3f} of the cold run")
    png = _plot(args.out.rsplit(".", 1)[0] + ".png", "restart",
                {"cold": w["ttft_s"], "storage": r["ttft_s"]}, None)
    return {"benchmark": "restart", "machine": machine_info(), "config": vars(args), "write": w, "read": r,
            "same_tokens": same, "ttft_ratio": ratio, "plot": png}


def _restart_phase(args) -> dict:
    rng = np.random.default_rng(args.seed)
    engine = build_engine(args, args.prompt_len + args.answer_len + 16)
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
    res = engine.generate(prompts, args.answer_len)
    engine.close()  # the write phase's L3 pages are all on disk when the process exits
    return {"pid": os.getpid(), "phase": args.phase, "tokens": [r.tokens for r in res],
            "ttft_s": [r.ttft_s for r in res], "ttft_mean_s": statistics.fmean(r.ttft_s for r in res),
            "cached": {t: sum(r.cached_tokens[t] for r in res) for t in ("device", "host", "storage")}}


# ---------------------------------------------------------------------------------------------
def add_common(p: argparse.ArgumentParser, out: str, model: str = "bench") -> None:
    p.add_argument("--model", choices=sorted(MODEL_PRESETS), default=model)
    p.add_argument("--attention", choices=["mha", "mla"], default="mha")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--device-pages", type=int, default=1024)
    p.add_argument("--host-ratio", type=float, default=4.0)
    p.add_argument("--write-policy", default="write_through",
                   choices=["write_through", "write_through_selective", "write_back"])
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--prefill-chunk", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--storage-backend", choices=["orbax", "file", "memory", "none"], default="orbax",
                   help="L3 backend (none: L1 + L2 only)")
    p.add_argument("--storage-dir", default=None, help="L3 directory (default: a fresh temporary one)")
    p.add_argument("--prefetch-policy", choices=["best_effort", "wait_complete", "timeout"], default="wait_complete")
    p.add_argument("--worker-nice", type=int, default=DEFAULT_WORKER_NICE,
                   help="OS priority offset of the cache's worker threads (0: same as the scheduler)")
    p.add_argument("--out", default=out)


def run_and_save(fn, args) -> int:
    payload = fn(args)
    path = write_json(args.out, payload)
    if getattr(args, "phase", "both") != "both":
        return 0  # a restart phase: the parent process reports
    print(f"JSON written to {path}")
    if payload.get("plot"):
        print(f"plot written to {payload['plot']}")
    return 0
