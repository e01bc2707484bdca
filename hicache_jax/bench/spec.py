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

Per case: accept length (mean per verify step, over the prompts), TPOT ((E2E - TTFT) / (new
tokens - 1)), end-to-end latency and TTFT, each the median over ``--reps`` prompts, the cached
tokens per tier, and whether the tokens equal the cold run's. Ratios: restored (case 3) / L1
accept length, and case 4 / L1. A table, JSON (``--out``) and a PNG beside it.

The restart is a new engine in the same process (new pools, tree and cache; only the L3
directory is shared), not a new process: the compiled programs are reused, so the cases time
serving, not compilation. ``hicache-jax bench restart`` covers the cross-process restart.

``--num-processes N``: the same four cases served by N tensor-parallel ranks on this machine
(``bench.ranks``: the target's and the draft's pools sharded on the KV heads, or the draft's
replicated where it has fewer heads than ranks; one L3 directory, created here and shared, on
the file backend). Every rank must serve rank 0's tokens in every case; rank 0 reports.
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
from typing import TYPE_CHECKING

from . import plots, ranks
from .report import Progress, machine_info, print_table

if TYPE_CHECKING:  # pragma: no cover
    from ..engine import Engine

CASES = ("cold", "L1", "L3 + draft", "L3, no draft")


def run(args) -> dict:
    tmp = None
    if not args.storage_dir:  # with --num-processes: made by the parent, shared by the ranks
        tmp = args.storage_dir = tempfile.mkdtemp(prefix="hicache-spec-l3-")
    try:
        if ranks.wants_ranks(args):
            return ranks.launch(args, "spec")
        ranks.rank_out(args)
        with Progress("spec") as progress:
            return _run(args, progress)
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
            args.storage_dir = None


def _run(args, progress: Progress) -> dict:
    progress.phase("loading the toy pair (imports JAX)")
    import numpy as np

    from ..engine import Engine, EngineCacheConfig, SpecConfig
    from ..host_pool import HostPoolConfig
    from ..reference_model.weights import TOY_PAIR_PATH, load_pair
    from ..storage.config import StorageConfig

    rank = ranks.rank_context(args)  # a rank of --num-processes (joins before any JAX computation), or None
    pair = load_pair(TOY_PAIR_PATH if args.weights == "toy" else args.weights)
    cfg = pair.config
    period = args.period or int(pair.meta.get("periods", [32, 32])[-1])
    for name, v, low in (
        ("--period", period, 1),
        ("--prompt-len", args.prompt_len, 2),
        ("--k", args.k, 1),
        ("--new-tokens", args.new_tokens, 2),
        ("--reps", args.reps, 1),
    ):
        if v < low:
            raise SystemExit(f"{name}: expected >= {low}, got {v}")
    page = args.page_size
    max_context = args.max_context or args.prompt_len + args.new_tokens + 2 * args.k + page
    device_pages = args.device_pages or 3 * -(-max_context // page)
    cache = EngineCacheConfig(
        page_size=page,
        device_pages=device_pages,
        host=HostPoolConfig(ratio=4.0),
        max_batch=1,
        prefill_chunk=args.prefill_chunk,
        max_context=max_context,
        worker_nice=args.worker_nice,
        storage=StorageConfig(
            backend=args.storage_backend,
            path=args.storage_dir,
            prefetch_policy="wait_complete",
            prefetch_threshold_tokens=page,
            worker_nice=args.worker_nice,
        ),
    )
    rng = np.random.default_rng(args.seed)

    def pattern_prompt() -> list[int]:
        return np.resize(rng.integers(0, cfg.vocab_size, period), args.prompt_len).tolist()

    prompts = [pattern_prompt() for _ in range(args.reps)]
    warm = [pattern_prompt() for _ in range(args.reps)]

    def engine(backing: bool, warm_prompt: list[int]) -> "Engine":
        e = Engine(
            cfg, cache, spec=SpecConfig(num_draft_tokens=args.k, draft_backing=backing), weights=pair, ranks=rank
        )
        caches.append(e.cache)
        e.warmup()
        e.generate([warm_prompt], args.new_tokens)  # compiles the transfer paths; fills both pools
        e.flush()
        e.cache.reset()  # L1 and L2 dropped: the next request's pages held the warm-up prompt's KV
        return e

    results: dict[str, list] = {c: [] for c in CASES}
    caches = []  # every engine's cache, for the agreement counts of a rank
    progress.phase("the first engine: compiling every step shape (the later engines reuse the programs)")
    first = engine(True, warm[0])
    progress.phase(
        "serving: per prompt an engine for cold + L1, then two restarted ones (L3 with and without "
        "draft backing), each warmed up on another prompt first",
        4 * args.reps,
    )
    for r, prompt in enumerate(prompts):
        e = first if r == 0 else engine(True, warm[r])
        results["cold"].append(e.generate([prompt], args.new_tokens)[0])
        progress.advance(1, f"prompt {r + 1}: cold, accept length {results['cold'][-1].accept_length:.2f}")
        results["L1"].append(e.generate([prompt], args.new_tokens)[0])
        progress.advance(1, f"prompt {r + 1}: L1, accept length {results['L1'][-1].accept_length:.2f}")
        e.close()  # every L3 write is on disk
        for case, backing in (("L3 + draft", True), ("L3, no draft", False)):
            e = engine(backing, warm[r])  # the restart: new pools, tree and cache on the same L3
            results[case].append(e.generate([prompt], args.new_tokens)[0])
            e.close()
            progress.advance(1, f"prompt {r + 1}: restart, {case}, accept length {results[case][-1].accept_length:.2f}")

    summary = {}
    for case, res in results.items():
        tpot = [(x.latency_s - x.ttft_s) / max(1, len(x.tokens) - 1) for x in res]
        summary[case] = {
            "accept_length": float(np.mean([x.accept_length for x in res])),
            "accept_length_per_prompt": [x.accept_length for x in res],
            "tpot_s": statistics.median(tpot),
            "e2e_s": statistics.median(x.latency_s for x in res),
            "ttft_s": statistics.median(x.ttft_s for x in res),
            "tpot_all_s": tpot,
            "e2e_all_s": [x.latency_s for x in res],
            "ttft_all_s": [x.ttft_s for x in res],
            "cached_tokens": {
                t: int(statistics.median(x.cached_tokens[t] for x in res)) for t in ("device", "host", "storage")
            },
            "same_tokens_as_cold": [x.tokens for x in res] == [x.tokens for x in results["cold"]],
            "per_prompt": [
                {
                    "accept_lengths": x.accept_lengths,
                    "ttft_s": x.ttft_s,
                    "latency_s": x.latency_s,
                    "cached_tokens": x.cached_tokens,
                }
                for x in res
            ],
        }
    l1 = summary["L1"]["accept_length"]
    ratios = {
        "restored_over_l1": summary["L3 + draft"]["accept_length"] / l1,
        "no_draft_over_l1": summary["L3, no draft"]["accept_length"] / l1,
        "tpot_no_draft_over_restored": summary["L3, no draft"]["tpot_s"] / summary["L3 + draft"]["tpot_s"],
    }
    config = (
        f"toy pair ({cfg.num_layers}-layer target, 1-block draft, vocab {cfg.vocab_size}), k={args.k}, "
        f"{args.prompt_len}-token prompt of period {period}, {args.new_tokens} new tokens, page {page}, "
        f"L3 {args.storage_backend}, median of {args.reps} prompt(s)"
    )
    rows = [
        [
            c,
            s["cached_tokens"]["device"],
            s["cached_tokens"]["storage"],
            s["accept_length"],
            s["tpot_s"] * 1e3,
            s["e2e_s"] * 1e3,
            s["ttft_s"] * 1e3,
            s["same_tokens_as_cold"],
        ]
        for c, s in summary.items()
    ]
    print_table(
        f"speculative decoding: {config}",
        ["case", "L1 tokens", "L3 tokens", "accept length", "TPOT ms", "E2E ms", "TTFT ms", "same tokens"],
        rows,
    )
    print(
        f"accept length restored (L3 + draft) / L1 hit: {ratios['restored_over_l1']:.3f}; "
        f"without draft backing / L1 hit: {ratios['no_draft_over_l1']:.3f}; "
        f"TPOT without / with draft backing: x{ratios['tpot_no_draft_over_restored']:.2f}"
    )
    png = plots.spec_plot(
        args.out.rsplit(".", 1)[0] + ".png",
        "Speculative decoding: accept length and latency with the draft KV from each tier",
        config,
        summary,
        args.k,
    )
    out = {
        "benchmark": "spec",
        "machine": machine_info(),
        "config": vars(args),
        "weights_meta": pair.meta,
        "cases": summary,
        "ratios": ratios,
        "plot": png,
    }
    # With --num-processes: every case's tokens, and the agreement counts summed over every
    # engine this rank ran (cold + L1 and each restart), go to the parent.
    ranks.report_rank(caches, out, {c: [x.tokens for x in res] for c, res in results.items()})
    return out
