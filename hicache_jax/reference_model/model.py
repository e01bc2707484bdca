"""The reference transformer in Flax NNX: RMSNorm, rotary embeddings, GQA or MLA-style latent
attention, SwiGLU MLP. Weights come from ``nnx.Rngs(config.seed)``: the same config always
builds the same model.

Attention is split in two so KV can live in a paged pool: ``project_kv`` computes the KV
entries of new tokens (what gets written to the pool), ``attend`` computes attention of new
queries over KV read back from the pool. Prefill with or without a cached prefix therefore
sees the same KV bits.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from .config import ModelConfig


def rotary(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Rotate-half rotary embedding; x (..., T, H, D) with positions (..., T)."""
    d = x.shape[-1]
    freqs = 1.0 / (theta ** (jnp.arange(0, d // 2, dtype=jnp.float32) * 2 / d))
    ang = positions[..., None].astype(jnp.float32) * freqs  # (..., T, D/2)
    cos, sin = jnp.cos(ang)[..., None, :], jnp.sin(ang)[..., None, :]
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, rngs: nnx.Rngs) -> None:
        self.scale = nnx.Param(jnp.ones((dim,), jnp.float32))

    def __call__(self, x: jax.Array) -> jax.Array:
        return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * self.scale[...]


def _linear(i: int, o: int, rngs: nnx.Rngs) -> nnx.Linear:
    return nnx.Linear(i, o, use_bias=False, rngs=rngs, kernel_init=nnx.initializers.normal(stddev=1.0 / i**0.5))


def _softmax_attend(scores: jax.Array, kv_valid: jax.Array, mask: jax.Array, v: jax.Array) -> jax.Array:
    """scores (B, H, T, S), mask (B, T, S), kv_valid (B, S), v (B, S, H, Dv) -> (B, T, H, Dv)."""
    scores = jnp.where(mask[:, None], scores, -1e30)
    p = jax.nn.softmax(scores, axis=-1)
    v = jnp.where(kv_valid[:, :, None, None], v, 0.0)  # stale bits past the length never leak in
    return jnp.einsum("bhts,bshd->bthd", p, v)


class GQAAttention(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs) -> None:
        self.cfg = cfg
        h, kvh, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.wq, self.wk = _linear(cfg.hidden, h * d, rngs), _linear(cfg.hidden, kvh * d, rngs)
        self.wv, self.wo = _linear(cfg.hidden, kvh * d, rngs), _linear(h * d, cfg.hidden, rngs)

    def project_kv(self, x: jax.Array, positions: jax.Array) -> dict[str, jax.Array]:
        cfg = self.cfg
        shape = x.shape[:-1] + (cfg.num_kv_heads, cfg.head_dim)
        k = rotary(self.wk(x).reshape(shape), positions, cfg.rope_theta)
        return {"k": k, "v": self.wv(x).reshape(shape)}

    def attend(self, x, positions, kv: dict[str, jax.Array], kv_valid, mask) -> jax.Array:
        cfg = self.cfg
        b, t = x.shape[:2]
        q = rotary(self.wq(x).reshape(b, t, cfg.num_heads, cfg.head_dim), positions, cfg.rope_theta)
        group = cfg.num_heads // cfg.num_kv_heads
        k = jnp.repeat(kv["k"], group, axis=2)  # (B, S, H, D)
        v = jnp.repeat(kv["v"], group, axis=2)
        scores = jnp.einsum("bthd,bshd->bhts", q, k) / cfg.head_dim**0.5
        return self.wo(_softmax_attend(scores, kv_valid, mask, v).reshape(b, t, -1))


class LatentAttention(nnx.Module):
    """MLA-style: the cache holds one latent c (kv_lora_rank) plus a shared rotary key per token."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs) -> None:
        self.cfg = cfg
        h = cfg.num_heads
        self.wq = _linear(cfg.hidden, h * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim), rngs)
        self.w_dkv = _linear(cfg.hidden, cfg.kv_lora_rank, rngs)
        self.w_kr = _linear(cfg.hidden, cfg.qk_rope_head_dim, rngs)
        self.w_uk = _linear(cfg.kv_lora_rank, h * cfg.qk_nope_head_dim, rngs)
        self.w_uv = _linear(cfg.kv_lora_rank, h * cfg.v_head_dim, rngs)
        self.wo = _linear(h * cfg.v_head_dim, cfg.hidden, rngs)

    def project_kv(self, x: jax.Array, positions: jax.Array) -> dict[str, jax.Array]:
        cfg = self.cfg
        c = self.w_dkv(x)
        kr = rotary(self.w_kr(x)[..., None, :], positions, cfg.rope_theta)[..., 0, :]
        return {"kv": jnp.concatenate([c, kr], axis=-1)[..., None, :]}  # (..., T, 1, lora + rope)

    def attend(self, x, positions, kv: dict[str, jax.Array], kv_valid, mask) -> jax.Array:
        cfg = self.cfg
        b, t = x.shape[:2]
        s = kv["kv"].shape[1]
        lat = kv["kv"][:, :, 0]
        c, kr = lat[..., : cfg.kv_lora_rank], lat[..., cfg.kv_lora_rank :]
        q = self.wq(x).reshape(b, t, cfg.num_heads, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
        q_nope, q_rope = q[..., : cfg.qk_nope_head_dim], q[..., cfg.qk_nope_head_dim :]
        q_rope = rotary(q_rope, positions, cfg.rope_theta)
        k_nope = self.w_uk(c).reshape(b, s, cfg.num_heads, cfg.qk_nope_head_dim)
        v = self.w_uv(c).reshape(b, s, cfg.num_heads, cfg.v_head_dim)
        scores = jnp.einsum("bthd,bshd->bhts", q_nope, k_nope) + jnp.einsum("bthd,bsd->bhts", q_rope, kr)
        scores = scores / (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** 0.5
        return self.wo(_softmax_attend(scores, kv_valid, mask, v).reshape(b, t, -1))


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs) -> None:
        self.norm1, self.norm2 = RMSNorm(cfg.hidden, rngs), RMSNorm(cfg.hidden, rngs)
        self.attn = GQAAttention(cfg, rngs) if cfg.attention == "mha" else LatentAttention(cfg, rngs)
        self.w1, self.w3 = _linear(cfg.hidden, cfg.ffn, rngs), _linear(cfg.hidden, cfg.ffn, rngs)
        self.w2 = _linear(cfg.ffn, cfg.hidden, rngs)

    def mlp(self, x: jax.Array) -> jax.Array:
        return self.w2(jax.nn.silu(self.w1(x)) * self.w3(x))

    def finish(self, x: jax.Array, attn_out: jax.Array) -> jax.Array:
        """The block after attention: the residual add, then the MLP's (the paged step's hook:
        each model family keeps its own norms and residuals here)."""
        x = x + attn_out
        return x + self.mlp(self.norm2(x))


class Transformer(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs | None = None) -> None:
        rngs = rngs or nnx.Rngs(cfg.seed)
        self.cfg = cfg
        self.embed = nnx.Embed(cfg.vocab_size, cfg.hidden, rngs=rngs)
        self.blocks = nnx.List([Block(cfg, rngs) for _ in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden, rngs)
        self.lm_head = _linear(cfg.hidden, cfg.vocab_size, rngs)
