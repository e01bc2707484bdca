"""Whole-sequence causal forwards of the target and the draft head, without a paged pool.

For training (``scripts/train_spec_pair.py``) and for tests that check the paged steps
against them. Same modules and weights as the paged programs; only where KV lives differs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .draft import DraftHead
from .model import Block, Transformer


def _dense_block(block: Block, x: jax.Array, window: int | None = None) -> jax.Array:
    """One block, causal; ``window``: a sliding layer's window (``window`` module's convention:
    position p sees [p - window + 1, p])."""
    b, t = x.shape[:2]
    positions = jnp.broadcast_to(jnp.arange(t), (b, t))
    causal = jnp.tril(jnp.ones((t, t), bool))
    if window is not None:
        causal = causal & ~jnp.tril(jnp.ones((t, t), bool), -window)
    mask = jnp.broadcast_to(causal, (b, t, t))
    kv_valid = jnp.ones((b, t), bool)
    h = block.norm1(x)
    kv = block.attn.project_kv(h, positions)
    x = x + block.attn.attend(h, positions, kv, kv_valid, mask)
    return x + block.mlp(block.norm2(x))


def target_forward(model: Transformer, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
    """tokens (B, T) -> (final normed hidden states f (B, T, H), logits (B, T, V))."""
    cfg = model.cfg
    x = model.embed(tokens)
    for layer, block in enumerate(model.blocks):
        sliding = cfg.pool_slot(layer)[0] == "swa"
        x = _dense_block(block, x, cfg.sliding_window if sliding else None)
    f = model.norm(x)
    return f, model.lm_head(f)


def draft_forward(
    draft: DraftHead, target: Transformer, next_tokens: jax.Array, features: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Draft entries at positions 0..T-1 from ``next_tokens[j] = t_{j+1}`` and ``features[j] =
    f_j`` -> (draft features g (B, T, H), logits (B, T, V): guesses at t_{j+2})."""
    x = _dense_block(draft.block, draft.inputs(target, next_tokens, features))
    g = draft.norm(x)
    return g, target.lm_head(g)
