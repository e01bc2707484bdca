"""Multi-turn trace through EasyDeL's eSurge, alone and with hicache_jax attached (host + L3).

    .venv-easydel/bin/python -m benchmarks.bench_easydel [--conversations 6] [--turns 4]
        [--pages 24] [--hidden 768 --layers 6] [--host-pages N] [--out hicache-results/easydel.json]

One engine (a random Llama on the CPU, sized by --hidden / --layers; the test fixture's
shims and tokenizer) serves the same trace twice, in alternating passes so the machine's
speed swings hit both alike: ``esurge`` (eSurge alone: its prefix cache is its only tier)
and ``hicache`` (the adapter attached: host pool + a file L3). Between passes eSurge's prefix
cache is reset and the adapter detached, so every pass starts cold.

The trace: ``--conversations`` conversations, each a ``--first``-token opening; every turn
re-sends the whole conversation plus the previous answer and a ``--follow``-token question
(one request at a time, round robin), so the working set (every conversation's prefix)
exceeds eSurge's ``--pages``-page pool and eSurge alone loses each prefix before it returns.

Per pass: TTFT (a ``max_tokens=1`` request's wall time: prefill + first token), input
throughput (prompt tokens / summed request time), cached tokens by tier (device = eSurge's
own hits; the adapter's host pool is 4x eSurge's pool unless --host-pages) and whether every request produced the same greedy tokens in both passes. The
table reports the median over passes and the ratio hicache / esurge (measured in the same
run). Load matters on a shared machine: the JSON records ``os.getloadavg()``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "integrations"))

import esurge_fixture as F  # noqa: E402 - installs the CPU shims before easydel is imported


def _trace(args) -> list[list[str]]:
    """Per turn, the prompts of every conversation (word strings)."""
    import random

    r = random.Random(args.seed)
    convs = [[F.word(r.randrange(F.VOCAB - 2)) for _ in range(args.first)] for _ in range(args.conversations)]
    turns = []
    for _ in range(args.turns):
        turns.append([" ".join(c) for c in convs])
        for c in convs:  # the answer (a fixed stand-in: the trace must not depend on the pass) + next question
            c.extend(F.word(r.randrange(F.VOCAB - 2)) for _ in range(args.follow))
    return turns


def _model(args):
    F.install_import_shims()
    import easydel as ed
    import jax.numpy as jnp
    from flax import nnx

    cfg = ed.LlamaConfig(vocab_size=F.VOCAB, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                         num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=args.hidden // 4, max_position_embeddings=1024)
    cfg.attn_mechanism = "ragged_page_attention_v3"
    return ed.LlamaForCausalLM(config=cfg, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))


def _pass(engine, turns, handle) -> dict:
    from easydel.inference.sampling_params import SamplingParams

    ttft, tokens, prompt_tokens, outputs = [], 0, 0, []
    for prompts in turns:
        for text in prompts:
            t0 = time.perf_counter()
            out = engine.generate(text, SamplingParams(max_tokens=1, temperature=0.0))
            ttft.append(time.perf_counter() - t0)
            outputs.append(list(out[0].outputs[0].token_ids))
            prompt_tokens += len(text.split())
    total = sum(ttft)
    cached = dict(handle.counters.cached_tokens) if handle is not None else None
    return {"ttft_mean_s": total / len(ttft), "input_tok_per_s": prompt_tokens / total, "prompt_tokens": prompt_tokens,
            "requests": len(ttft), "cached_tokens": cached, "outputs": outputs}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--conversations", type=int, default=6)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--first", type=int, default=160, help="opening tokens per conversation")
    p.add_argument("--follow", type=int, default=24, help="tokens added per turn (answer + question)")
    p.add_argument("--pages", type=int, default=24, help="eSurge's KV pool (pages of 16 tokens)")
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--host-pages", type=int, default=None,
                   help="the adapter's host pool (default: 4x eSurge's pool; smaller: more L3 reads)")
    p.add_argument("--passes", type=int, default=2, help="measured passes per mode (alternating)")
    p.add_argument("--warmup", type=int, default=1,
                   help="unmeasured passes per mode first (compiles the adapter's copy shapes, as eSurge "
                        "compiles its own at start)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="hicache-results/easydel.json")
    args = p.parse_args(argv)
    from hicache_jax.cache import HiCacheConfig
    from hicache_jax.integrations.easydel import attach
    from hicache_jax.storage import StorageConfig

    turns = _trace(args)
    longest = max(len(t.split()) for t in turns[-1])
    if longest + 8 > 1024:
        raise ValueError(f"--first/--follow/--turns: the longest prompt ({longest} tokens) exceeds max_model_len 1024")
    tok_dir, l3_root = tempfile.mkdtemp(prefix="bench-tok-"), tempfile.mkdtemp(prefix="bench-l3-")
    F.build_tokenizer(tok_dir)
    import easydel.caching.ragged_page.cache as rp
    from easydel.inference.esurge import eSurge
    from transformers import PreTrainedTokenizerFast

    model = _model(args)
    c = model.config  # the KV budget eSurge divides into pages (the CPU fallback is 4 GiB)
    budget = args.pages * 2 * c.num_hidden_layers * F.PAGE * c.num_key_value_heads * c.head_dim * 2
    rp.per_device_hbm_budget_bytes = lambda *a, **k: budget  # noqa: ARG005
    engine = eSurge(model=model, processor=PreTrainedTokenizerFast.from_pretrained(tok_dir),
                    max_model_len=1024, max_num_seqs=1, page_size=F.PAGE, max_num_batched_tokens=512,
                    enable_prefix_caching=True, silent_mode=True)
    results: dict[str, list] = {"esurge": [], "hicache": []}
    try:
        pool = engine.scheduler.kv_cache_manager.page_pool.num_pages
        for i in range(args.warmup + args.passes):
            for mode in ("esurge", "hicache"):
                assert engine.scheduler.kv_cache_manager.reset_prefix_cache()
                handle = None
                if mode == "hicache":
                    l3 = os.path.join(l3_root, f"pass{i}")
                    cfg = HiCacheConfig(page_size=F.PAGE, load_back_threshold=F.PAGE,
                                        storage=StorageConfig(backend="file", path=l3,
                                                              prefetch_threshold_tokens=F.PAGE))
                    handle = attach(engine, cfg, model="bench-llama", weights_revision="r0",
                                    host_pages=args.host_pages or 4 * pool)
                try:
                    r = _pass(engine, turns, handle)
                finally:
                    if handle is not None:
                        handle.detach()
                warm = i < args.warmup
                if not warm:
                    results[mode].append(r)
                print(f"{'warmup' if warm else 'pass'} {i} {mode:8s}: TTFT mean {r['ttft_mean_s'] * 1e3:7.1f} ms, "
                      f"input {r['input_tok_per_s']:8.0f} tok/s, cached {r['cached_tokens']}", flush=True)
    finally:
        F.close_engine(engine)
        shutil.rmtree(tok_dir, ignore_errors=True)
        shutil.rmtree(l3_root, ignore_errors=True)
    med = {m: {k: statistics.median(r[k] for r in rs) for k in ("ttft_mean_s", "input_tok_per_s")}
           for m, rs in results.items()}
    same = all(r["outputs"] == results["esurge"][0]["outputs"] for rs in results.values() for r in rs)
    ratio = {"ttft_mean": med["hicache"]["ttft_mean_s"] / med["esurge"]["ttft_mean_s"],
             "input_throughput": med["hicache"]["input_tok_per_s"] / med["esurge"]["input_tok_per_s"]}
    print(f"\neSurge pool {pool} pages; trace {args.conversations} conversations x {args.turns} turns, "
          f"{results['esurge'][0]['prompt_tokens']} prompt tokens per pass; load {os.getloadavg()}")
    print(f"{'mode':10s} {'TTFT mean ms':>13s} {'input tok/s':>12s}  cached tokens (last pass)")
    for m in ("esurge", "hicache"):
        print(f"{m:10s} {med[m]['ttft_mean_s'] * 1e3:13.1f} {med[m]['input_tok_per_s']:12.0f}  "
              f"{results[m][-1]['cached_tokens']}")
    print(f"hicache / esurge: TTFT mean x{ratio['ttft_mean']:.2f}, input throughput x{ratio['input_throughput']:.2f}; "
          f"same tokens in every pass: {same}")
    payload = {"args": vars(args), "pool_pages": pool, "loadavg": os.getloadavg(), "median": med, "ratio": ratio,
               "same_tokens": same,
               "passes": {m: [{k: v for k, v in r.items() if k != "outputs"} for r in rs] for m, rs in results.items()}}
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(payload, f, indent=2)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
