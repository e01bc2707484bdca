"""Gemma 3 text forward in pure JAX (jax.numpy) over a plain, non-paged KV cache.

Matches HF transformers' ``Gemma3ForCausalLM`` (checked in float32 against it on the GGUF
weights, see the scratch notes):

* embeddings ``embed[ids] * sqrt(hidden)``, the scale cast to the model dtype first (as HF does);
* per layer: ``h += post_attn_norm(attn(input_norm(h)))``, ``h += post_ffw_norm(mlp(pre_ffw_norm(h)))``;
* RMSNorm ``x * rsqrt(mean(x^2) + eps) * (1 + w)`` computed in float32 and cast back, with ``w``
  in HF's convention (``params_from_gguf`` subtracts 1 from GGUF's stored ``1 + w``);
* attention: Q/K/V projections, RMSNorm of each q and k head (QK-norm), RoPE (rotate-half layout:
  GGUF's Gemma Q/K are not permuted) with base ``rope_theta_local`` on sliding layers and
  ``rope_theta_global`` (positions divided by ``rope_scale_global``) on full ones, scores scaled by
  ``query_pre_attn_scalar ** -0.5``, GQA, softmax in float32;
* sliding-window layers: the query at position ``p`` sees keys ``[p - W + 1, p]`` (``W`` positions,
  itself included), HF's ``kv_idx > q_idx - W``; full layers see ``[0, p]``;
* MLP GeGLU with the tanh GELU; final RMSNorm; logits against the tied embedding; optional
  attention / final logit soft-capping (``None`` for Gemma 3).

The KV cache holds every position for every layer (sliding layers included); ``forward`` writes
the new tokens' K/V at ``start[b] + t`` and attends over the whole cache under the mask.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any, Mapping, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .gguf_loader import Gemma3Config, hf_norm_weight

Params = dict[str, Any]


class KVCache(NamedTuple):
    k: tuple[jax.Array, ...]  # per layer [B, S, KVH, D]
    v: tuple[jax.Array, ...]


def init_cache(cfg: Gemma3Config, batch: int, max_len: int, dtype=jnp.float32) -> KVCache:
    shape = (batch, max_len, cfg.num_kv_heads, cfg.head_dim)
    return KVCache(
        tuple(jnp.zeros(shape, dtype) for _ in range(cfg.num_layers)),
        tuple(jnp.zeros(shape, dtype) for _ in range(cfg.num_layers)),
    )


# A block's parameters: our name -> the GGUF tensor's (blk.{i}.<name>.weight). Norms end in "norm".
_LAYER_TENSORS = {
    "input_norm": "attn_norm",
    "wq": "attn_q",
    "wk": "attn_k",
    "wv": "attn_v",
    "q_norm": "attn_q_norm",
    "k_norm": "attn_k_norm",
    "wo": "attn_output",
    "post_attn_norm": "post_attention_norm",
    "pre_ffw_norm": "ffn_norm",
    "w_gate": "ffn_gate",
    "w_up": "ffn_up",
    "w_down": "ffn_down",
    "post_ffw_norm": "post_ffw_norm",
}


def params_from_gguf(cfg: Gemma3Config, weights: Mapping[str, np.ndarray], dtype=jnp.float32) -> Params:
    """JAX params from ``load_gguf``'s weights: matrices transposed to ``[in, out]``, norms as HF ``w``."""

    def mat(name):
        return jnp.asarray(np.ascontiguousarray(weights[name].T), dtype)

    def norm(name):
        return jnp.asarray(hf_norm_weight(weights[name]), dtype)

    layers = [
        {key: (norm if key.endswith("norm") else mat)(f"blk.{i}.{name}.weight") for key, name in _LAYER_TENSORS.items()}
        for i in range(cfg.num_layers)
    ]
    return {
        "embed": jnp.asarray(weights["token_embd.weight"], dtype),
        "final_norm": norm("output_norm.weight"),
        "layers": layers,
    }


def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (y * (1.0 + w.astype(jnp.float32))).astype(x.dtype)


def rope_inv_freq(head_dim: int, base: float) -> np.ndarray:
    exps = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    return (1.0 / (np.float32(base) ** exps)).astype(np.float32)


def apply_rope(x: jax.Array, pos: jax.Array, inv_freq: np.ndarray, scale: float) -> jax.Array:
    """x [B, T, N, D]; pos [B, T] int. Rotate-half layout: pairs (i, i + D/2)."""
    p = pos.astype(jnp.float32)
    if scale != 1.0:
        p = p / jnp.float32(scale)
    ang = p[..., None] * jnp.asarray(inv_freq)[None, None, :]  # [B, T, D/2]
    ang = jnp.concatenate([ang, ang], axis=-1)[:, :, None, :]
    cos, sin = jnp.cos(ang).astype(x.dtype), jnp.sin(ang).astype(x.dtype)
    half = x.shape[-1] // 2
    rot = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rot * sin


def _write(cache: jax.Array, new: jax.Array, start: jax.Array) -> jax.Array:
    """cache [B, S, N, D] <- new [B, T, N, D] at rows start[b]..start[b] + T - 1."""
    return jax.vmap(lambda c, n, s: jax.lax.dynamic_update_slice(c, n, (s, 0, 0)))(cache, new, start)


def _attention(
    lp: Params,
    x: jax.Array,
    pos: jax.Array,
    start: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    cfg: Gemma3Config,
    layer: int,
):
    B, T, _ = x.shape
    N, K, D, G = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.q_per_kv
    sliding = cfg.layer_types[layer] == "sliding"
    q = (x @ lp["wq"]).reshape(B, T, N, D)
    k = (x @ lp["wk"]).reshape(B, T, K, D)
    v = (x @ lp["wv"]).reshape(B, T, K, D)
    q = rms_norm(q, lp["q_norm"], cfg.rms_norm_eps)
    k = rms_norm(k, lp["k_norm"], cfg.rms_norm_eps)
    if sliding:
        inv, scale = rope_inv_freq(D, cfg.rope_theta_local), 1.0
    else:
        inv, scale = rope_inv_freq(D, cfg.rope_theta_global), cfg.rope_scale_global
    q = apply_rope(q, pos, inv, scale)
    k = apply_rope(k, pos, inv, scale)
    k_cache = _write(k_cache, k.astype(k_cache.dtype), start)
    v_cache = _write(v_cache, v.astype(v_cache.dtype), start)
    S = k_cache.shape[1]
    qg = q.reshape(B, T, K, G, D)
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k_cache.astype(q.dtype)).astype(jnp.float32)
    scores = scores * jnp.float32(cfg.query_pre_attn_scalar**-0.5)
    if cfg.attn_logit_softcapping is not None:
        c = jnp.float32(cfg.attn_logit_softcapping)
        scores = jnp.tanh(scores / c) * c
    kv_pos = jnp.arange(S, dtype=pos.dtype)[None, None, :]
    allowed = kv_pos <= pos[:, :, None]  # [B, T, S]
    if sliding:
        allowed &= kv_pos > pos[:, :, None] - cfg.sliding_window
    scores = jnp.where(allowed[:, None, None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1).astype(v_cache.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v_cache).reshape(B, T, N * D).astype(x.dtype)
    return out @ lp["wo"], k_cache, v_cache


def _mlp(lp: Params, x: jax.Array) -> jax.Array:
    return (jax.nn.gelu(x @ lp["w_gate"], approximate=True) * (x @ lp["w_up"])) @ lp["w_down"]


def embed(params: Params, tokens: jax.Array, cfg: Gemma3Config) -> jax.Array:
    e = params["embed"]
    return jnp.take(e, tokens, axis=0) * jnp.asarray(math.sqrt(cfg.hidden_size), e.dtype)


def _forward(
    params: Params, tokens: jax.Array, start: jax.Array, cache: KVCache, *, cfg: Gemma3Config
) -> tuple[jax.Array, KVCache]:
    """tokens [B, T] at positions ``start[b] + t`` -> (final-normed hidden [B, T, H], updated cache).

    ``start`` [B] int32: the number of tokens already in each row's cache. The cache must have
    room: ``start[b] + T <= max_len`` (not checked under jit)."""
    start = jnp.asarray(start, jnp.int32)
    B, T = tokens.shape
    pos = start[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
    h = embed(params, tokens, cfg)
    ks, vs = list(cache.k), list(cache.v)
    eps = cfg.rms_norm_eps
    for i, lp in enumerate(params["layers"]):
        a, ks[i], vs[i] = _attention(lp, rms_norm(h, lp["input_norm"], eps), pos, start, ks[i], vs[i], cfg, i)
        h = h + rms_norm(a, lp["post_attn_norm"], eps)
        m = _mlp(lp, rms_norm(h, lp["pre_ffw_norm"], eps))
        h = h + rms_norm(m, lp["post_ffw_norm"], eps)
    return rms_norm(h, params["final_norm"], eps), KVCache(tuple(ks), tuple(vs))


forward = jax.jit(_forward, static_argnames=("cfg",), donate_argnames=("cache",))


def lm_head(params: Params, hidden: jax.Array, cfg: Gemma3Config) -> jax.Array:
    """hidden [..., H] -> logits [..., V] (tied embedding; float32 out)."""
    logits = (hidden @ params["embed"].T).astype(jnp.float32)
    if cfg.final_logit_softcapping is not None:
        c = jnp.float32(cfg.final_logit_softcapping)
        logits = jnp.tanh(logits / c) * c
    return logits


@partial(jax.jit, static_argnames=("cfg",), donate_argnames=("cache",))
def _greedy_step(params, token, start, cache, suppress, *, cfg):
    h, cache = _forward(params, token, start, cache, cfg=cfg)
    logits = lm_head(params, h[:, -1], cfg)
    logits = jnp.where(suppress[None, :], -jnp.inf, logits)
    return jnp.argmax(logits, axis=-1).astype(jnp.int32), cache


def prefill_padded(params: Params, cfg: Gemma3Config, ids: list[int], cache: KVCache, bucket: int = 256):
    """One prompt into a fresh one-row ``cache``, its length padded to a multiple of ``bucket``
    (so prompts of nearby lengths share one compiled step): the final hidden states of its
    ``len(ids)`` real positions and the cache. Padding sits after the prompt, so causal
    attention keeps it out of every real position; its KV rows are overwritten by the first
    decode steps before any query can see them."""
    n = len(ids)
    t = -(-n // bucket) * bucket
    if t > cache.k[0].shape[1]:
        raise ValueError(f"ids: {n} tokens (padded to {t}) do not fit a cache of {cache.k[0].shape[1]} positions")
    tokens = np.zeros((1, t), np.int32)
    tokens[0, :n] = ids
    h, cache = forward(params, jnp.asarray(tokens), jnp.zeros((1,), jnp.int32), cache, cfg=cfg)
    return h[0, :n], cache


lm_head_jit = jax.jit(lm_head, static_argnames=("cfg",))


def greedy_generate_many(
    params: Params,
    cfg: Gemma3Config,
    prompts: list[list[int]],
    max_new_tokens: int,
    *,
    suppress_ids: tuple[int, ...] = (),
    cache_len: int | None = None,
    bucket: int = 256,
) -> list[list[int]]:
    """Greedy continuations of several prompts (no early stop; ``suppress_ids`` are never
    chosen), decoded together (one batched step per token).

    Each prompt is prefilled alone (``prefill_padded``) into its row of one batched cache of
    ``cache_len`` positions (default: the longest prompt, padded, plus ``max_new_tokens``); the
    decode steps then run every row at its own position (``start`` per row), so each row's
    tokens are what it would get decoded alone: a row's cache beyond its position is never
    attended."""
    if not prompts or any(not p for p in prompts):
        raise ValueError("prompts: expected a non-empty list of non-empty token lists")
    dtype = params["embed"].dtype
    longest = max(len(p) for p in prompts)
    cache_len = cache_len or -(-longest // bucket) * bucket + max_new_tokens
    if longest + max_new_tokens > cache_len:
        raise ValueError(f"cache_len: {cache_len} positions cannot hold {longest} + {max_new_tokens} tokens")
    started = []
    for p in prompts:
        h, cache = prefill_padded(params, cfg, p, init_cache(cfg, 1, cache_len, dtype), bucket)
        started.append((h[-1], cache, len(p)))
    return greedy_continue_many(params, cfg, started, max_new_tokens, suppress_ids=suppress_ids)


def greedy_continue_many(
    params: Params,
    cfg: Gemma3Config,
    started: list[tuple[jax.Array, KVCache, int]],
    max_new_tokens: int,
    *,
    suppress_ids: tuple[int, ...] = (),
) -> list[list[int]]:
    """``greedy_generate_many`` after the prefill: ``started`` holds, per prompt, the final
    hidden state of its last position, the one-row cache its prefill left (``prefill_padded``;
    every row of the same length) and its length. A caller that already prefilled its prompts
    (e.g. to read their logits) decodes them without computing them again. The caches are
    consumed: the batched cache is built from them and donated to the decode steps."""
    if not started:
        raise ValueError("started: expected at least one prefilled prompt")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens: expected >= 1, got {max_new_tokens}")
    cache_len = started[0][1].k[0].shape[1]
    for i, (_, cache, n) in enumerate(started):
        if cache.k[0].shape[:2] != (1, cache_len):
            raise ValueError(f"started[{i}]: expected a one-row cache of {cache_len} positions")
        if not 0 < n or n + max_new_tokens > cache_len:
            raise ValueError(f"started[{i}]: {n} tokens + {max_new_tokens} new do not fit {cache_len} positions")
    suppress = np.zeros(cfg.vocab_size, bool)
    suppress[list(suppress_ids)] = True
    suppress = jnp.asarray(suppress)
    first = [
        jnp.argmax(jnp.where(suppress[None, :], -jnp.inf, lm_head_jit(params, h[None], cfg=cfg)), axis=-1).astype(
            jnp.int32
        )
        for h, _, _ in started
    ]
    cache = KVCache(
        tuple(jnp.concatenate([c.k[i] for _, c, _ in started]) for i in range(cfg.num_layers)),
        tuple(jnp.concatenate([c.v[i] for _, c, _ in started]) for i in range(cfg.num_layers)),
    )
    tok = jnp.concatenate(first)
    out = [[int(t)] for t in np.asarray(tok)]
    lengths = np.array([n for _, _, n in started], np.int32)
    for n in range(1, max_new_tokens):
        tok, cache = _greedy_step(params, tok[:, None], jnp.asarray(lengths + n - 1), cache, suppress, cfg=cfg)
        for row, t in zip(out, np.asarray(tok)):
            row.append(int(t))
    return out


def greedy_generate(
    params: Params, cfg: Gemma3Config, prompt: list[int], max_new_tokens: int, *, suppress_ids: tuple[int, ...] = ()
) -> list[int]:
    """Greedy continuation of one prompt (no early stop; ``suppress_ids`` are never chosen)."""
    return greedy_generate_many(params, cfg, [prompt], max_new_tokens, suppress_ids=suppress_ids, bucket=1)[0]
