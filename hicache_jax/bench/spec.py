"""``hicache-jax bench spec``: speculative decoding with the draft KV served from each tier.

Upstream's experiment (sglang PR #21125) on the trained toy pair
(``reference_model/spec_toy_pair.npz``, ``scripts/train_spec_pair.py``): a long repetitive
prompt (a random pattern of ``--period`` tokens, by default the period the pair was trained
on, repeated to ``--prompt-len``) is served with greedy speculative decoding (``--k`` draft
tokens) in four cases:

1. ``cold``: nothing cached;
2. ``L1``: again, from the device tier;
3. ``L3 + draft``: after a restart (a new engine on the same L3 directory: L1 and L2 empty)
   with draft backing, so the draft KV comes back from L3 with the target's;
4. ``L3, no draft``: after a restart without draft backing: the target's KV comes back from
   L3, the draft pool keeps what it held.

Every engine first serves another long repetitive prompt (a warm-up that also compiles) and
then drops its L1/L2 contents, so in every case the pages a request gets last held another
prompt's KV, in both pools: the state of a server that has been serving (upstream's failure:
reused slots, old draft content). Only the draft backing differs between cases 3 and 4.

Per case: accept length (mean per verify step), TPOT ((E2E - TTFT) / (new tokens - 1)),
end-to-end latency and TTFT, each the median over ``--reps`` prompts (accept length: the
mean), the cached tokens per tier, and whether the tokens equal the cold run's. Ratios:
restored (case 3) / L1 accept length, and case 4 / L1. A table, JSON (``--out``) and a PNG.
The restart is a new engine in the same process (its pools and tree are new; only L3 is
shared), not a new process: the compiled programs are reused, so the cases time only serving.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np

from ..engine import Engine, EngineCacheConfig, SpecConfig
from ..host_pool import HostPoolConfig
from ..reference_model.weights import TOY_PAIR_PATH, load_pair
from ..storage.config import StorageConfig
from ..workers import DEFAULT_WORKER_NICE
from .report import machine_info, print_table

CASES = ("cold", "L1", "L3 + draft", "L3, no draft")


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--weights", default=str(TOY_PAIR_PATH), help="target + draft pair (.npz)")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--period", type=int, default=None,
                   help="pattern length of the repetitive prompt (default: the one the pair was trained on)")
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--k", type=int, default=4, help="draft tokens per verify step")
    p.add_argument("--reps", type=int, default=3, help="prompts (patterns) per case")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--device-pages", type=int, default=None, help="L1 pages (default: 3 requests' worth)")
    p.add_argument("--max-context", type=int, default=None, help="default: prompt + new tokens + 2k + a page")
    p.add_argument("--prefill-chunk", type=int, default=512)
    p.add_argument("--storage-backend", choices=["orbax", "file"], default="orbax")
    p.add_argument("--storage-dir", default=None, help="L3 directory (default: a fresh temporary one)")
    p.add_argument("--worker-nice", type=int, default=DEFAULT_WORKER_NICE,
                   help="OS priority offset of the cache's D2H and L3 threads (0: the scheduler's; on a busy "
                        "machine +19 starves the L3 reads and TTFT measures the queue)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="benchmarks/results/spec.json")


def _pattern_prompt(rng: np.random.Generator, vocab: int, period: int, length: int) -> list[int]:
    return np.resize(rng.integers(0, vocab, period), length).tolist()


def _say(msg: str) -> None:
    print(f"[spec] {msg}", file=sys.stderr, flush=True)


def run(args) -> dict:
    tmp = None
    if not args.storage_dir:
        tmp = args.storage_dir = tempfile.mkdtemp(prefix="hicache-spec-l3-")
    try:
        return _run(args)
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
            args.storage_dir = None


def _run(args) -> dict:
    pair = load_pair(args.weights)
    cfg = pair.config
    if args.period is None:
        args.period = int(pair.meta.get("periods", [32, 32])[-1])
    if args.period < 1:
        raise SystemExit(f"--period: expected >= 1, got {args.period}")
    page = args.page_size
    max_context = args.max_context or args.prompt_len + args.new_tokens + 2 * args.k + page
    device_pages = args.device_pages or 3 * -(-max_context // page)
    cache = EngineCacheConfig(page_size=page, device_pages=device_pages, host=HostPoolConfig(ratio=4.0),
                              max_batch=1, prefill_chunk=args.prefill_chunk, max_context=max_context,
                              worker_nice=args.worker_nice,
                              storage=StorageConfig(backend=args.storage_backend, path=args.storage_dir,
                                                    prefetch_policy="wait_complete", prefetch_threshold_tokens=page,
                                                    worker_nice=args.worker_nice))
    rng = np.random.default_rng(args.seed)
    prompts = [_pattern_prompt(rng, cfg.vocab_size, args.period, args.prompt_len) for _ in range(args.reps)]
    warm = [_pattern_prompt(rng, cfg.vocab_size, args.period, args.prompt_len) for _ in range(args.reps)]

    def engine(backing: bool, warm_prompt: list[int]) -> Engine:
        e = Engine(cfg, cache, spec=SpecConfig(num_draft_tokens=args.k, draft_backing=backing), weights=pair)
        e.warmup()
        e.generate([warm_prompt], args.new_tokens)  # compiles the transfer paths; fills both pools
        e.flush()
        e.cache.reset()  # L1 and L2 dropped: the next request's pages held the warm-up prompt's KV
        return e

    results: dict[str, list] = {c: [] for c in CASES}
    t0 = time.perf_counter()
    for r, prompt in enumerate(prompts):
        _say(f"prompt {r + 1}/{args.reps}: cold and L1 (engine with draft backing) ...")
        e = engine(True, warm[r])
        results["cold"].append(e.generate([prompt], args.new_tokens)[0])
        results["L1"].append(e.generate([prompt], args.new_tokens)[0])
        e.close()  # every L3 write is on disk
        for case, backing in (("L3 + draft", True), ("L3, no draft", False)):
            _say(f"prompt {r + 1}/{args.reps}: restart, {case} ...")
            e = engine(backing, warm[r])
            results[case].append(e.generate([prompt], args.new_tokens)[0])
            e.close()
    _say(f"done in {time.perf_counter() - t0:.0f} s")

    summary = {}
    for case, res in results.items():
        tpot = [(x.latency_s - x.ttft_s) / max(1, len(x.tokens) - 1) for x in res]
        summary[case] = {
            "accept_length": float(np.mean([x.accept_length for x in res])),
            "accept_length_per_prompt": [x.accept_length for x in res],
            "tpot_s": statistics.median(tpot), "e2e_s": statistics.median(x.latency_s for x in res),
            "ttft_s": statistics.median(x.ttft_s for x in res),
            "cached_tokens": {t: int(statistics.median(x.cached_tokens[t] for x in res))
                              for t in ("device", "host", "storage")},
            "same_tokens_as_cold": [x.tokens for x in res] == [x.tokens for x in results["cold"]],
            "per_prompt": [{"accept_lengths": x.accept_lengths, "ttft_s": x.ttft_s, "latency_s": x.latency_s,
                            "cached_tokens": x.cached_tokens} for x in res]}
    l1 = summary["L1"]["accept_length"]
    ratios = {"restored_over_l1": summary["L3 + draft"]["accept_length"] / l1,
              "no_draft_over_l1": summary["L3, no draft"]["accept_length"] / l1,
              "tpot_no_draft_over_restored": summary["L3, no draft"]["tpot_s"] / summary["L3 + draft"]["tpot_s"]}
    rows = [[c, s["cached_tokens"]["device"], s["cached_tokens"]["storage"], s["accept_length"], s["tpot_s"] * 1e3,
             s["e2e_s"] * 1e3, s["ttft_s"] * 1e3, s["same_tokens_as_cold"]] for c, s in summary.items()]
    print_table(f"speculative decoding, k={args.k}: {args.prompt_len}-token repetitive prompt (period {args.period}), "
                f"{args.new_tokens} new tokens, page {page}, L3 {args.storage_backend}, median of {args.reps}",
                ["case", "L1 tokens", "L3 tokens", "accept length", "TPOT ms", "E2E ms", "TTFT ms", "same tokens"],
                rows)
    print(f"accept length restored (L3 + draft) / L1 hit: {ratios['restored_over_l1']:.3f}; "
          f"without draft backing / L1 hit: {ratios['no_draft_over_l1']:.3f}; "
          f"TPOT without / with draft backing: x{ratios['tpot_no_draft_over_restored']:.2f}")
    png = _plot(args.out.rsplit(".", 1)[0] + ".png", summary, args)
    return {"benchmark": "spec", "machine": machine_info(), "config": vars(args), "weights_meta": pair.meta,
            "cases": summary, "ratios": ratios, "plot": png}


def _plot(path: str, summary: dict, args) -> str | None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    import os

    cases = list(summary)
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    colors = ["#888888", "#4C72B0", "#55A868", "#C44E52"]
    for ax, key, label, scale in ((axes[0], "accept_length", "accept length (tokens / verify step)", 1),
                                  (axes[1], "tpot_s", "TPOT (ms)", 1e3), (axes[2], "ttft_s", "TTFT (ms)", 1e3)):
        vals = [summary[c][key] * scale for c in cases]
        ax.bar(range(len(cases)), vals, color=colors)
        ax.set_xticks(range(len(cases)))
        ax.set_xticklabels(cases, rotation=15)
        ax.set_ylabel(label)
        for i, v in enumerate(vals):
            ax.text(i, v, f"{v:.2f}" if scale == 1 else f"{v:.0f}", ha="center", va="bottom")
    axes[0].axhline(args.k + 1, ls=":", c="k", lw=0.8)
    fig.suptitle(f"speculative decoding, k={args.k}, {args.prompt_len}-token repetitive prompt: draft KV per tier")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
