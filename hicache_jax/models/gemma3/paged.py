"""Gemma 3 as a model family of the paged step (``reference_model.paged_forward``): the engine
serves it through every cache tier as a hybrid model, its full layers' KV in the full pool and
its sliding layers' in the SWA pool.

The paged step drives any family through one interface (the reference ``Transformer`` has the
same): ``model.cfg`` (a ``ModelConfig``), ``model.embed(tokens)``, per block ``block.norm1(x)``,
``block.attn.project_kv(h, positions) -> {"k", "v"}`` (the new tokens' KV, written to the pool),
``block.attn.attend(h, positions, kv, kv_valid, mask)`` (attention over KV read back from the
pool) and ``block.finish(x, attn_out)`` (residuals, norms and MLP after attention), then
``model.norm(x)`` and ``model.lm_head(hidden)``.

The arithmetic is ``model.py``'s (the plain forward checked against transformers), op for op:
the same RMSNorm, RoPE tables, GQA einsums and GeGLU, so the paged model and the plain one agree
to float32 rounding (tests/models compares them on the real weights and on small random ones).

Weights: ``Gemma3Weights`` holds the checkpoint once (JAX arrays) and builds modules that share
those arrays (``target()``: no copy per engine); ``digest`` (the GGUF's SHA-256) seeds the L3
keys, so pages of another checkpoint never hit. ``load_model(name)`` loads a named model from
its package; ``random_weights(cfg)`` makes a small random checkpoint for tests.

Threading: modules are built and run from the engine's thread; the arrays are immutable and
shared freely.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ...reference_model.config import ModelConfig
from .gguf_loader import Gemma3Config, load_gguf
from .model import Params, apply_rope, params_from_gguf, rms_norm, rope_inv_freq


def model_config(cfg: Gemma3Config, *, kv_dtype: str = "float32", swa_as_full: bool = False) -> ModelConfig:
    """The engine's ``ModelConfig`` of a Gemma 3 checkpoint (family ``gemma3``).

    ``kv_dtype``: the pools' dtype (float32 keeps the KV exactly as computed: the tokens then
    match the plain forward's and the oracle's). ``swa_as_full``: keep every layer's KV in the
    full pool (windows still applied): the memory baseline."""
    if cfg.attn_logit_softcapping is not None or cfg.final_logit_softcapping is not None:
        raise ValueError("cfg: logit soft-capping (Gemma 2) is not supported by the paged Gemma 3 family")
    if cfg.rope_scale_global != 1.0:
        raise ValueError(
            f"cfg: rope_scale_global {cfg.rope_scale_global} (scaled RoPE of the larger Gemma 3 "
            "sizes) is not supported by the paged family yet"
        )
    return ModelConfig(
        vocab_size=cfg.vocab_size,
        num_layers=cfg.num_layers,
        hidden=cfg.hidden_size,
        num_heads=cfg.num_heads,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        ffn=cfg.intermediate_size,
        rope_theta=float(cfg.rope_theta_global),
        kv_dtype=kv_dtype,
        layer_types=cfg.layer_types,
        sliding_window=cfg.sliding_window,
        swa_as_full=swa_as_full,
        family="gemma3",
        rope_theta_local=float(cfg.rope_theta_local),
        query_pre_attn_scalar=float(cfg.query_pre_attn_scalar),
        rms_norm_eps=float(cfg.rms_norm_eps),
        max_positions=cfg.max_position_embeddings,
    )


class Norm(nnx.Module):
    """Gemma's RMSNorm: float32 ``x * rsqrt(mean(x^2) + eps) * (1 + w)`` (``w`` as HF keeps it)."""

    def __init__(self, weight: jax.Array, eps: float) -> None:
        self.weight = nnx.Param(weight)
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm(x, self.weight[...], self.eps)


class Embed(nnx.Module):
    """Token embeddings scaled by sqrt(hidden) (the scale cast to the table's dtype, as HF)."""

    def __init__(self, table: jax.Array) -> None:
        self.table = nnx.Param(table)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        t = self.table[...]
        return jnp.take(t, tokens, axis=0) * jnp.asarray(math.sqrt(t.shape[1]), t.dtype)


class Attention(nnx.Module):
    """One layer's attention: QK-norm, RoPE of its layer kind, GQA, scores x scalar^-0.5."""

    def __init__(self, cfg: ModelConfig, layer: int, p: Params) -> None:
        self.cfg = cfg
        sliding = cfg.layer_types[layer] == "sliding"  # the RoPE base follows the layer kind, always
        self.theta = cfg.rope_theta_local if sliding else cfg.rope_theta
        self.wq, self.wk, self.wv, self.wo = (nnx.Param(p[k]) for k in ("wq", "wk", "wv", "wo"))
        self.q_norm, self.k_norm = Norm(p["q_norm"], cfg.rms_norm_eps), Norm(p["k_norm"], cfg.rms_norm_eps)

    def _rope(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        return apply_rope(x, positions, rope_inv_freq(self.cfg.head_dim, self.theta), 1.0)

    def project_kv(self, x: jax.Array, positions: jax.Array) -> dict[str, jax.Array]:
        cfg = self.cfg
        shape = x.shape[:-1] + (cfg.num_kv_heads, cfg.head_dim)
        k = self._rope(self.k_norm((x @ self.wk[...]).reshape(shape)), positions)
        return {"k": k, "v": (x @ self.wv[...]).reshape(shape)}

    def attend(self, x, positions, kv: dict[str, jax.Array], kv_valid, mask) -> jax.Array:
        cfg = self.cfg
        b, t = x.shape[:2]
        kvh, d = cfg.num_kv_heads, cfg.head_dim
        q = self._rope(self.q_norm((x @ self.wq[...]).reshape(b, t, cfg.num_heads, d)), positions)
        qg = q.reshape(b, t, kvh, cfg.num_heads // kvh, d)
        scores = jnp.einsum("btkgd,bskd->bkgts", qg, kv["k"].astype(q.dtype)).astype(jnp.float32)
        scores = scores * jnp.float32(cfg.query_pre_attn_scalar**-0.5)
        scores = jnp.where(mask[:, None, None], scores, -jnp.inf)
        v = jnp.where(kv_valid[:, :, None, None], kv["v"], 0.0)  # stale bits past the length never leak in
        probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
        out = jnp.einsum("bkgts,bskd->btkgd", probs, v).reshape(b, t, cfg.num_heads * d).astype(x.dtype)
        return out @ self.wo[...]


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, layer: int, p: Params) -> None:
        eps = cfg.rms_norm_eps
        self.norm1 = Norm(p["input_norm"], eps)
        self.attn = Attention(cfg, layer, p)
        self.post_attn_norm, self.pre_ffw_norm = Norm(p["post_attn_norm"], eps), Norm(p["pre_ffw_norm"], eps)
        self.post_ffw_norm = Norm(p["post_ffw_norm"], eps)
        self.w_gate, self.w_up, self.w_down = (nnx.Param(p[k]) for k in ("w_gate", "w_up", "w_down"))

    def mlp(self, x: jax.Array) -> jax.Array:
        return (jax.nn.gelu(x @ self.w_gate[...], approximate=True) * (x @ self.w_up[...])) @ self.w_down[...]

    def finish(self, x: jax.Array, attn_out: jax.Array) -> jax.Array:
        x = x + self.post_attn_norm(attn_out)
        return x + self.post_ffw_norm(self.mlp(self.pre_ffw_norm(x)))


class Gemma3Transformer(nnx.Module):
    """Gemma 3 (text) for the paged step, built from ``params_from_gguf``-shaped params."""

    def __init__(self, cfg: ModelConfig, params: Params) -> None:
        if cfg.family != "gemma3":
            raise ValueError(f"cfg: expected family 'gemma3', got {cfg.family!r}")
        if len(params["layers"]) != cfg.num_layers:
            raise ValueError(f"params: {len(params['layers'])} layers, the config has {cfg.num_layers}")
        self.cfg = cfg
        self.embed = Embed(params["embed"])
        self.blocks = nnx.List([Block(cfg, i, lp) for i, lp in enumerate(params["layers"])])
        self.norm = Norm(params["final_norm"], cfg.rms_norm_eps)

    def lm_head(self, hidden: jax.Array) -> jax.Array:
        """Logits against the tied embedding, float32."""
        return (hidden @ self.embed.table[...].T).astype(jnp.float32)


@dataclass(frozen=True, eq=False)
class Gemma3Weights:
    """A loaded Gemma 3 checkpoint, for ``Engine(config, weights=...)``.

    ``config``: the engine's ``ModelConfig``; ``gemma``: the checkpoint's own config (token ids,
    tokenizer facts); ``params``: the JAX arrays, shared by every module ``target()`` builds;
    ``digest``: identifies the weights (the GGUF's SHA-256) in L3 keys. No draft head:
    ``draft()`` returns None (speculative decoding needs a trained draft)."""

    config: ModelConfig
    gemma: Gemma3Config
    params: Params
    digest: str
    path: Path | None = None

    def target(self) -> Gemma3Transformer:
        return Gemma3Transformer(self.config, self.params)

    def draft(self) -> None:
        return None

    def with_config(self, config: ModelConfig) -> "Gemma3Weights":
        """The same arrays under another placement of the same model (e.g. ``swa_as_full``)."""
        if (
            config.family != "gemma3"
            or model_config(self.gemma, kv_dtype=config.kv_dtype, swa_as_full=config.swa_as_full) != config
        ):
            raise ValueError(f"config: not a placement of this checkpoint's model ({self.config})")
        return Gemma3Weights(config, self.gemma, self.params, self.digest, self.path)


def load_weights(
    path: str | Path, *, kv_dtype: str = "float32", dtype=jnp.float32, cache_dir: str | Path | None = None
) -> Gemma3Weights:
    """A Gemma 3 GGUF as ``Gemma3Weights`` (dequantized once and cached: ``load_gguf``)."""
    from .gguf_loader import file_sha256

    path = Path(path)
    cfg, weights = load_gguf(path, cache_dir=cache_dir)
    return Gemma3Weights(
        model_config(cfg, kv_dtype=kv_dtype), cfg, params_from_gguf(cfg, weights, dtype), file_sha256(path), path
    )


def load_model(name: str = "gemma3-270m", **kwargs) -> Gemma3Weights:
    """Model ``name``'s weights from the package that ships its GGUF (the ``models`` extra)."""
    from .weights_package import model_file

    return load_weights(model_file(name), **kwargs)


def random_weights(cfg: Gemma3Config, seed: int = 0, *, kv_dtype: str = "float32") -> Gemma3Weights:
    """A random checkpoint of shape ``cfg`` (float32; norms near Gemma's scale), for tests."""
    rng = np.random.default_rng(seed)

    def mat(i, o):
        return jnp.asarray(rng.normal(0, i**-0.5, (i, o)).astype(np.float32))

    def norm(n):
        return jnp.asarray(rng.normal(0, 0.1, n).astype(np.float32))

    h, d, f = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    layers = [
        {
            "input_norm": norm(h),
            "wq": mat(h, cfg.num_heads * d),
            "wk": mat(h, cfg.num_kv_heads * d),
            "wv": mat(h, cfg.num_kv_heads * d),
            "q_norm": norm(d),
            "k_norm": norm(d),
            "wo": mat(cfg.num_heads * d, h),
            "post_attn_norm": norm(h),
            "pre_ffw_norm": norm(h),
            "w_gate": mat(h, f),
            "w_up": mat(h, f),
            "w_down": mat(f, h),
            "post_ffw_norm": norm(h),
        }
        for _ in range(cfg.num_layers)
    ]
    params = {
        "embed": jnp.asarray(rng.normal(0, 1.0, (cfg.vocab_size, h)).astype(np.float32)),
        "final_norm": norm(h),
        "layers": layers,
    }
    return Gemma3Weights(model_config(cfg, kv_dtype=kv_dtype), cfg, params, f"random-{seed}")
