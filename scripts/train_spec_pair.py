"""Train the toy target + EAGLE-style draft pair on the CPU and write it as a small .npz.

    PYTHONPATH=. .venv/bin/python scripts/train_spec_pair.py            # writes the package's toy pair
    PYTHONPATH=. .venv/bin/python scripts/train_spec_pair.py --out /tmp/pair.npz --target-steps 50

The task: sequences that repeat a random pattern of ``--min-period`` .. ``--max-period`` tokens
(default: always 32 tokens, drawn with repeats from a 64-token vocabulary). The target (the
reference transformer: 2 blocks, d=64) learns to continue the pattern (attend one period
back), so after the first period its next token is certain. The draft head (one block over
[embedding of t_{j+1} ; the target's final hidden state f_j]) learns to guess t_{j+2} with
cross-entropy, plus EAGLE's feature regression (its output feature g_j towards f_{j+1}, which
the chain steps of speculative decoding feed back in place of the target's feature), plus one
unrolled chain step (a second pass reading its own shifted features). t_{j+2} is one period
back in the draft's *own* KV; nothing in f_j carries it, so the draft's proposals depend on
its KV over the prompt: what the cache must bring back with the target's.

Each model trains on 128-token sequences first (it learns fastest there), then on 512-token
ones (the copy then holds over long prompts). Fixed seeds throughout (data, initialisation):
the same command writes the same weights on the same JAX version and CPU (re-run on JAX 0.12:
every parameter bit-identical to the checked-in file). Cost: about 290 s of CPU time (206 s
user + 80 s system for the default command, evaluation included); wall time depends on the
load: 20 min on the shared 2-vCPU project VM at 23% of its CPU (``meta.train_seconds`` in the
file: training only, on an earlier, busier run). At the end
the script measures, through the paged reference engine with speculative decoding
(``hicache_jax.engine``), the mean accept length on held-out 512-token prompts with the draft
KV computed fresh, and stores the weights (float16, ~240 KB), the training settings and that
evaluation in the file.

Options for tuning (not needed to reproduce the file): ``--target-from PAIR`` trains only the
draft over another file's target; ``--distinct`` draws patterns without repeated tokens.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hicache_jax.reference_model import ModelConfig, Transformer  # noqa: E402
from hicache_jax.reference_model.dense import draft_forward, target_forward  # noqa: E402
from hicache_jax.reference_model.draft import DraftHead  # noqa: E402
from hicache_jax.reference_model.weights import TOY_PAIR_PATH, load_pair, save_pair  # noqa: E402

TOY_CONFIG = ModelConfig(
    vocab_size=64, num_layers=2, hidden=64, num_heads=4, num_kv_heads=2, head_dim=16, ffn=128, seed=0
)
TOY_PERIOD = 32  # the pattern length the toy pair is trained on (``bench spec`` and the tests use it)


def periodic_batch(
    rng: np.random.Generator,
    batch: int,
    length: int,
    vocab: int,
    min_period: int,
    max_period: int,
    distinct: bool = False,
) -> tuple[np.ndarray, np.ndarray]:
    """(tokens (B, T), period (B,)): each row a random pattern, repeated (``distinct``: no
    token twice in a pattern)."""
    toks = np.empty((batch, length), np.int32)
    periods = rng.integers(min_period, max_period + 1, batch)
    for i, p in enumerate(periods):
        pattern = rng.permutation(vocab)[:p] if distinct else rng.integers(0, vocab, p)
        toks[i] = np.resize(pattern, length)
    return toks, periods


def batch_shape(args, step: int, steps: int) -> tuple[int, int]:
    """(batch, length) of training step ``step``: ``--length`` first, then the last
    ``--long-fraction`` of the steps at ``--long-length`` (same tokens per step), so the
    copy holds over long prompts (it is learnt fastest on short ones)."""
    if args.long_length and step >= steps * (1 - args.long_fraction):
        return max(1, args.batch * args.length // args.long_length), args.long_length
    return args.batch, args.length


def _masked_ce(logits, targets, mask):
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    return jnp.sum(ce * mask) / jnp.maximum(jnp.sum(mask), 1)


def train_target(cfg: ModelConfig, args, rng: np.random.Generator) -> tuple[Transformer, float]:
    model = Transformer(cfg)
    graphdef, params = nnx.split(model)
    sched = optax.warmup_cosine_decay_schedule(
        0.0, args.lr, min(50, args.target_steps // 2), args.target_steps, args.lr * args.min_lr_ratio
    )
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(sched, weight_decay=0.0))
    opt_state = opt.init(params)

    def loss_fn(params, toks, mask):
        _, logits = target_forward(nnx.merge(graphdef, params), toks[:, :-1])
        return _masked_ce(logits, toks[:, 1:], mask)

    @jax.jit
    def step(params, opt_state, toks, mask):
        loss, grads = jax.value_and_grad(loss_fn)(params, toks, mask)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    loss = float("nan")
    t0 = time.perf_counter()
    for i in range(args.target_steps):
        batch, length = batch_shape(args, i, args.target_steps)
        toks, periods = periodic_batch(
            rng, batch, length, cfg.vocab_size, args.min_period, args.max_period, args.distinct
        )
        # Position j predicts t_{j+1}: determined once j + 1 >= period.
        mask = (np.arange(1, length)[None, :] >= periods[:, None]).astype(np.float32)
        params, opt_state, loss = step(params, opt_state, toks, mask)
        if i % 50 == 0 or i == args.target_steps - 1:
            print(f"[target] step {i:4d}  loss {float(loss):.4f}  ({time.perf_counter() - t0:.0f} s)", flush=True)
    return nnx.merge(graphdef, params), float(loss)


def train_draft(cfg: ModelConfig, target: Transformer, args, rng: np.random.Generator) -> tuple[DraftHead, float]:
    head = DraftHead(cfg)
    graphdef, params = nnx.split(head)
    sched = optax.warmup_cosine_decay_schedule(
        0.0, args.lr, min(50, args.draft_steps // 2), args.draft_steps, args.lr * args.min_lr_ratio
    )
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(sched, weight_decay=0.0))
    opt_state = opt.init(params)

    @jax.jit
    def features(toks):
        f, _ = target_forward(target, toks)
        return f

    def loss_fn(params, toks, f, mask):
        draft = nnx.merge(graphdef, params)
        nxt = toks[:, 1:-1]  # t_{j+1} for j = 0 .. T-3
        g, logits = draft_forward(draft, target, nxt, f[:, :-2])
        ce = _masked_ce(logits, toks[:, 2:], mask)
        reg = jnp.mean(jnp.sum((g[:, :-1] - f[:, 1:-2]) ** 2, axis=-1) * mask[:, :-1]) / cfg.hidden
        # One chain step unrolled: position j reads the draft's own feature g_{j-1} (its guess
        # at f_j), as the second proposal of a round does.
        g_prev = jnp.concatenate([f[:, :1], jax.lax.stop_gradient(g[:, :-1])], axis=1)
        _, logits2 = draft_forward(draft, target, nxt, g_prev)
        ce2 = _masked_ce(logits2, toks[:, 2:], mask)
        return ce + args.reg_weight * reg + ce2, ce

    @jax.jit
    def step(params, opt_state, toks, f, mask):
        (_, ce), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, toks, f, mask)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, ce

    ce = float("nan")
    t0 = time.perf_counter()
    for i in range(args.draft_steps):
        batch, length = batch_shape(args, i, args.draft_steps)
        toks, periods = periodic_batch(
            rng, batch, length, cfg.vocab_size, args.min_period, args.max_period, args.distinct
        )
        f = features(toks)
        # Position j guesses t_{j+2}: determined once j + 2 >= period.
        mask = (np.arange(2, length)[None, :] >= periods[:, None]).astype(np.float32)
        params, opt_state, ce = step(params, opt_state, toks, f, mask)
        if i % 50 == 0 or i == args.draft_steps - 1:
            print(f"[draft]  step {i:4d}  ce {float(ce):.4f}  ({time.perf_counter() - t0:.0f} s)", flush=True)
    return nnx.merge(graphdef, params), float(ce)


def evaluate(path: str, args) -> dict:
    """Mean accept length on held-out periodic prompts, through the engine (fresh draft KV)."""
    from hicache_jax.engine import Engine, EngineCacheConfig, SpecConfig

    pair = load_pair(path)
    rng = np.random.default_rng(12345)  # another stream than the training data's
    periods = rng.integers(args.min_period, args.max_period + 1, args.eval_prompts)
    patterns = [rng.integers(0, pair.config.vocab_size, p) for p in periods]
    prompts = [np.resize(pat, args.eval_prompt_len).tolist() for pat in patterns]
    engine = Engine(
        pair.config,
        EngineCacheConfig(page_size=16, device_pages=256, max_batch=4, prefill_chunk=256, max_context=1024),
        spec=SpecConfig(num_draft_tokens=args.k),
        weights=pair,
    )
    res = engine.generate(prompts, args.eval_new_tokens, use_cache=False)
    engine.close()
    correct = 0
    for r, pat in zip(res, patterns):
        expect = np.resize(pat, args.eval_prompt_len + len(r.tokens))[args.eval_prompt_len :]
        correct += int(np.sum(np.asarray(r.tokens) == expect))
    total = sum(len(r.tokens) for r in res)
    accept = float(np.mean([r.accept_length for r in res]))
    return {
        "accept_length_mean": accept,
        "copy_accuracy": correct / total,
        "k": args.k,
        "eval_prompts": args.eval_prompts,
        "eval_prompt_len": args.eval_prompt_len,
        "eval_new_tokens": args.eval_new_tokens,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(TOY_PAIR_PATH))
    p.add_argument("--target-steps", type=int, default=500)
    p.add_argument("--draft-steps", type=int, default=500)
    p.add_argument("--vocab", type=int, default=TOY_CONFIG.vocab_size)
    p.add_argument("--kv-heads", type=int, default=TOY_CONFIG.num_kv_heads)
    p.add_argument("--rope-theta", type=float, default=TOY_CONFIG.rope_theta)
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--length", type=int, default=128)
    p.add_argument("--long-length", type=int, default=512, help="0: train at --length only")
    p.add_argument("--long-fraction", type=float, default=0.5)
    p.add_argument("--min-period", type=int, default=TOY_PERIOD)
    p.add_argument("--max-period", type=int, default=TOY_PERIOD)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--reg-weight", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--k", type=int, default=4, help="draft tokens per round in the evaluation")
    p.add_argument("--eval-prompts", type=int, default=4)
    p.add_argument("--eval-prompt-len", type=int, default=512)
    p.add_argument("--eval-new-tokens", type=int, default=16)
    p.add_argument("--distinct", action="store_true", help="patterns of distinct tokens")
    p.add_argument("--no-eval", action="store_true")
    p.add_argument(
        "--target-from",
        default=None,
        help="take the target from this pair file and train only the draft (for tuning the draft)",
    )
    args = p.parse_args(argv)
    cfg = replace(TOY_CONFIG, vocab_size=args.vocab, num_kv_heads=args.kv_heads, rope_theta=args.rope_theta)
    rng = np.random.default_rng(args.seed)
    t0 = time.perf_counter()
    if args.target_from:
        base = load_pair(args.target_from)
        cfg, target, target_loss = base.config, base.target(), float(base.meta.get("target_loss", float("nan")))
    else:
        target, target_loss = train_target(cfg, args, rng)
    draft, draft_ce = train_draft(cfg, target, args, rng)
    seconds = time.perf_counter() - t0
    meta = {
        "target_steps": args.target_steps,
        "draft_steps": args.draft_steps,
        "batch": args.batch,
        "length": args.length,
        "periods": [args.min_period, args.max_period],
        "lr": args.lr,
        "seed": args.seed,
        "target_loss": target_loss,
        "draft_ce": draft_ce,
        "train_seconds": round(seconds, 1),
        "jax": jax.__version__,
        "script": "scripts/train_spec_pair.py",
    }
    size = save_pair(args.out, target, draft, meta)
    print(
        f"trained in {seconds:.0f} s: target loss {target_loss:.4f}, draft ce {draft_ce:.4f}; "
        f"wrote {args.out} ({size / 1024:.0f} KiB)"
    )
    if not args.no_eval:
        ev = evaluate(args.out, args)
        meta["eval"] = ev
        size = save_pair(args.out, target, draft, meta)
        print(
            f"eval (k={args.k}, fresh draft KV): mean accept length {ev['accept_length_mean']:.2f}, "
            f"target copy accuracy {ev['copy_accuracy']:.3f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
