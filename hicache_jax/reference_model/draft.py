"""An EAGLE-1 style draft head for speculative decoding, with its own paged KV pool. Needs JAX.

Shape (one transformer block; the target's embedding and LM head are shared, not copied):

    x_j = fc([embed(t_{j+1}) ; f_j])          f_j: the target's final hidden state at j
    g_j = norm(block(x_j))                     block: attention over the draft's own KV
    logits_j = target.lm_head(g_j)             a guess at t_{j+2}

The draft's KV entry at position ``j`` is computed from ``t_{j+1}`` and ``f_j``: a prefix hit
never computes ``f_j``, so the draft KV of cached positions cannot be recomputed on a hit and
has to come back from the cache with the target's (the draft pool is the cache's ``draft``
sidecar, same page ids). It also means the entry at ``j`` is only valid for requests whose
token ``j + 1`` is the one it was computed with (the engine keys its tree by token pairs:
``hicache_jax.engine.speculative``).

``DraftRunner.step`` runs one jitted program per decode round: an *extend* pass over the
positions whose inputs are now known (the prompt after a prefill, or the tokens a
verification accepted), writing their draft KV, then ``num_proposals - 1`` chain steps that
each feed the previous guess and the draft's own feature ``g`` (EAGLE's stand-in for the
target's ``f``) one position further. The chain steps write draft KV too; those entries are
provisional and the next extend pass overwrites them with the real inputs.

Donation: the draft pool arrays passed in are donated and must be replaced by the returned
ones (``JaxDevicePool.set_layer``). Threading: the thread that owns the pools.
"""

from __future__ import annotations

from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ..kv_geometry import KVGeometry
from .config import ModelConfig
from .model import Block, RMSNorm, Transformer
from .static_graph import StaticGraph, static_graph

Pools = dict[str, list[jax.Array]]


def draft_block_config(cfg: ModelConfig) -> ModelConfig:
    """The draft block's shape: the target's, with one full-attention layer."""
    return replace(cfg, num_layers=1, layer_types=("full",), sliding_window=None, swa_as_full=False)


def draft_kv_geometry(cfg: ModelConfig, page_size: int) -> KVGeometry:
    """The paged KV geometry of the draft (one layer of the target's kind)."""
    return draft_block_config(cfg).kv_geometry(page_size)


def _fc(i: int, o: int, rngs: nnx.Rngs) -> nnx.Linear:
    return nnx.Linear(i, o, use_bias=False, rngs=rngs, kernel_init=nnx.initializers.normal(stddev=1.0 / i**0.5))


class DraftHead(nnx.Module):
    """fc over [embedding ; target feature], one block, a final norm (module docstring)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs | None = None) -> None:
        rngs = rngs or nnx.Rngs(cfg.seed + 1)
        self.cfg = cfg
        self.fc = _fc(2 * cfg.hidden, cfg.hidden, rngs)
        self.block = Block(cfg, rngs)
        self.norm = RMSNorm(cfg.hidden, rngs)

    def inputs(self, target: Transformer, next_tokens: jax.Array, features: jax.Array) -> jax.Array:
        return self.fc(jnp.concatenate([target.embed(next_tokens), features.astype(jnp.float32)], axis=-1))


def _paged_block(block: Block, x, positions, valid, page_tables, kv_lens, pools: dict[str, jax.Array]):
    """One block over a paged pool (the same slot rule as ``paged_forward``: new entries at
    ``(page_table[pos // page], pos % page)``, padding dropped, causal over ``kv_len``)."""
    b, _ = positions.shape
    any_pool = next(iter(pools.values()))
    num_pages, page = any_pool.shape[:2]
    slot_page = jnp.take_along_axis(page_tables, positions // page, axis=1)
    slot_page = jnp.where(valid, slot_page, num_pages)
    slot_off = positions % page
    s = page_tables.shape[1] * page
    kpos = jnp.arange(s)
    kv_valid = kpos[None, :] < kv_lens[:, None]
    mask = (kpos[None, None, :] <= positions[:, :, None]) & kv_valid[:, None, :]
    h = block.norm1(x)
    new_pools, kv_all = {}, {}
    for c, entries in block.attn.project_kv(h, positions).items():
        pool = pools[c].at[slot_page, slot_off].set(entries.astype(any_pool.dtype), mode="drop")
        new_pools[c] = pool
        gathered = pool[page_tables]
        kv_all[c] = gathered.reshape((b, s) + gathered.shape[3:]).astype(jnp.float32)
    x = x + block.attn.attend(h, positions, kv_all, kv_valid, mask)
    return x + block.mlp(block.norm2(x)), new_pools


def _draft_round(
    target_graph: StaticGraph,
    target_state,
    draft_graph: StaticGraph,
    draft_state,
    pools: Pools,
    tokens,
    features,
    positions,
    valid,
    page_tables,
    kv_lens,
    num_proposals: int,
):
    target = nnx.merge(target_graph.graphdef, target_state)
    draft = nnx.merge(draft_graph.graphdef, draft_state)
    layer = {c: arrs[0] for c, arrs in pools.items()}
    x, layer = _paged_block(
        draft.block, draft.inputs(target, tokens, features), positions, valid, page_tables, kv_lens, layer
    )
    last = jnp.maximum(jnp.sum(valid, axis=1) - 1, 0)
    g = draft.norm(jnp.take_along_axis(x, last[:, None, None], axis=1))  # (B, 1, H)
    pos = jnp.take_along_axis(positions, last[:, None], axis=1)  # (B, 1)
    seq_valid = jnp.any(valid, axis=1, keepdims=True)
    proposals = []
    for i in range(num_proposals):
        guess = jnp.argmax(target.lm_head(g), axis=-1).astype(jnp.int32)  # (B, 1)
        proposals.append(guess[:, 0])
        if i == num_proposals - 1:
            break
        pos = pos + 1
        x, layer = _paged_block(
            draft.block, draft.inputs(target, guess, g), pos, seq_valid, page_tables, pos[:, 0] + 1, layer
        )
        g = draft.norm(x)
    out = jnp.stack(proposals, axis=1) if proposals else jnp.zeros((positions.shape[0], 0), jnp.int32)
    return out, {c: [a] for c, a in layer.items()}


# One jitted round for every runner (static graphdefs and proposal count; pools donated).
_ROUND = jax.jit(_draft_round, static_argnums=(0, 2, 11), donate_argnums=(4,))


class DraftRunner:
    """The draft head's weights and its jitted, pool-donating round (module docstring).

    ``target`` is the target's ``PagedRunner`` (its embedding and LM head are read from its
    weights at every call, so they stay shared). ``token_buckets`` and the page-table width
    follow the target runner's, so the same shapes recur."""

    def __init__(self, target, head: DraftHead | None = None) -> None:
        self.target = target
        self.config = target.config
        self.page_size = target.page_size
        self.head = head if head is not None else DraftHead(target.config)
        self.graphdef, self.state = nnx.split(self.head)
        self.static_graph = static_graph(self.graphdef)  # what the jitted round takes (hashed once)

    def step(
        self,
        pools: Pools,
        next_tokens: list[list[int]],
        features: list[np.ndarray],
        starts: list[int],
        page_tables: list[np.ndarray],
        num_proposals: int,
    ) -> tuple[np.ndarray, Pools]:
        """Sequence ``i`` extends the draft KV at positions ``starts[i] ...`` with inputs
        ``(next_tokens[i][j], features[i][j])`` (token ``j + 1`` and the target's feature at
        ``j``), then proposes ``num_proposals`` tokens (0: extend only). Returns the proposals
        ``(B, num_proposals)`` as numpy and the new pools."""
        t = self.target
        b = len(next_tokens)
        if not (b == len(features) == len(starts) == len(page_tables)) or b == 0:
            raise ValueError("next_tokens, features, starts, page_tables: expected equal, non-zero lengths")
        if isinstance(num_proposals, bool) or not isinstance(num_proposals, int) or num_proposals < 0:
            raise ValueError(f"num_proposals: expected an int >= 0, got {num_proposals!r}")
        bb = t.batch_bucket(b)
        tb = t.token_bucket(max(len(x) for x in next_tokens))
        mb = t.table_width(page_tables)
        hidden = self.config.hidden
        tok = np.zeros((bb, tb), np.int32)
        feat = np.zeros((bb, tb, hidden), np.float32)
        pos = np.zeros((bb, tb), np.int32)
        val = np.zeros((bb, tb), bool)
        pt = np.zeros((bb, mb), np.int32)
        kv_lens = np.zeros(bb, np.int32)
        for i, (ts, fs, st, table) in enumerate(zip(next_tokens, features, starts, page_tables)):
            n = len(ts)
            if n == 0 or np.shape(fs) != (n, hidden):
                raise ValueError(f"features[{i}]: expected shape ({n}, {hidden}) for {n} tokens, got {np.shape(fs)}")
            # The chain steps write up to num_proposals - 1 positions past the extend.
            last = st + n + max(num_proposals - 1, 0)
            if (last + self.page_size - 1) // self.page_size > len(table):
                raise ValueError(f"page_tables[{i}]: {len(table)} pages do not cover {last} tokens")
            tok[i, :n], feat[i, :n], pos[i, :n], val[i, :n] = ts, fs, np.arange(st, st + n), True
            pos[i, n:] = st + n - 1
            pt[i, : len(table)] = table
            kv_lens[i] = st + n
        out, new = _ROUND(
            t.static_graph,
            t.state,
            self.static_graph,
            self.state,
            pools,
            tok,
            feat,
            pos,
            val,
            pt,
            kv_lens,
            num_proposals,
        )
        return np.asarray(out[:b]), new

    def warmup(self, pools: Pools, shapes: list[tuple[int, int, int]]) -> Pools:
        """Compile the round for every ``(batch bucket, token bucket, num_proposals)``: all
        padding, so no KV is written (the pools come back as new arrays with the same bytes).
        Needs the target runner's fixed ``max_pages_per_seq``."""
        t = self.target
        if t.max_pages_per_seq is None:
            raise ValueError("warmup: needs the target runner's fixed max_pages_per_seq")
        for bb, tb, num_proposals in shapes:
            zeros = np.zeros((bb, tb), np.int32)
            _, pools = _ROUND(
                t.static_graph,
                t.state,
                self.static_graph,
                self.state,
                pools,
                zeros,
                np.zeros((bb, tb, self.config.hidden), np.float32),
                zeros,
                np.zeros((bb, tb), bool),
                np.zeros((bb, t.max_pages_per_seq), np.int32),
                np.ones(bb, np.int32),
                num_proposals,
            )
        return pools
