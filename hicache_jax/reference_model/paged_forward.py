"""One jitted model step over the paged KV pool, for prefill chunks and batched decode alike.

``PagedRunner.step`` takes B sequences with up to T new tokens each, writes their KV into the
pool at ``(page_table[pos // page], pos % page)``, attends over every cached position below
``kv_len`` (causal), and returns the logits of each sequence's last new token plus the
updated pool arrays. ``PagedRunner.step_all`` is the same step returning the logits and the
final (normed) hidden states of every new position, which speculative decoding needs (the
verification of all draft tokens at once, and the draft head's input features).

Donation: the pool arrays passed in are donated (updated in place) and must be replaced by
the returned ones. Shapes are bucketed so steady-state serving reuses compiled steps: B to
powers of two, T to ``token_buckets`` (then powers of two), and the page-table width either
fixed at ``max_pages_per_seq`` (one width: attention over a few padded keys is cheap next to
the matmuls, and ``warmup`` can then compile every shape up front) or to powers of two.
Threading: call from the thread that owns the pool.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from .config import ModelConfig
from .model import Transformer

Pools = dict[str, list[jax.Array]]


def _bucket(n: int, minimum: int = 1) -> int:
    return max(minimum, 1 << max(0, (n - 1).bit_length()))


def _forward(graphdef, state, pools: Pools, tokens, positions, valid, page_tables, kv_lens,
             all_positions: bool = False):
    model = nnx.merge(graphdef, state)
    b, t = tokens.shape
    any_pool = next(iter(pools.values()))[0]
    num_pages, page = any_pool.shape[:2]
    x = model.embed(tokens)
    # New tokens' slots; padding tokens go to an out-of-range page and are dropped.
    slot_page = jnp.take_along_axis(page_tables, positions // page, axis=1)
    slot_page = jnp.where(valid, slot_page, num_pages)
    slot_off = positions % page
    s = page_tables.shape[1] * page
    kpos = jnp.arange(s)
    kv_valid = kpos[None, :] < kv_lens[:, None]  # (B, S)
    mask = (kpos[None, None, :] <= positions[:, :, None]) & kv_valid[:, None, :]
    new_pools: Pools = {c: [] for c in pools}
    for layer, block in enumerate(model.blocks):
        h = block.norm1(x)
        new_kv = block.attn.project_kv(h, positions)
        kv_all = {}
        for c, entries in new_kv.items():
            pool = pools[c][layer].at[slot_page, slot_off].set(entries.astype(any_pool.dtype), mode="drop")
            new_pools[c].append(pool)
            gathered = pool[page_tables]  # (B, M, page, H, W)
            kv_all[c] = gathered.reshape((b, s) + gathered.shape[3:]).astype(jnp.float32)
        x = x + block.attn.attend(h, positions, kv_all, kv_valid, mask)
        x = x + block.mlp(block.norm2(x))
    if all_positions:  # logits and final hidden states of every position
        hidden = model.norm(x)
        return (model.lm_head(hidden), hidden), new_pools
    last = jnp.maximum(jnp.sum(valid, axis=1) - 1, 0)
    x_last = jnp.take_along_axis(x, last[:, None, None], axis=1)[:, 0]
    logits = model.lm_head(model.norm(x_last))
    return logits, new_pools


# One jitted step for every runner: equal configs give equal graphdefs (a static argument),
# so engines built for the same model reuse each other's compiled steps.
_STEP = jax.jit(_forward, static_argnums=(0, 8), donate_argnums=(2,))


class PagedRunner:
    """Holds the model's weights and its jitted, pool-donating step."""

    def __init__(self, config: ModelConfig, page_size: int, max_pages_per_seq: int | None = None,
                 token_buckets: tuple[int, ...] = (16, 32, 64, 128, 256, 512, 1024),
                 model: Transformer | None = None) -> None:
        """``model``: the weights to run (default: built from ``config.seed``)."""
        self.config = config
        self.page_size = page_size
        self.max_pages_per_seq = max_pages_per_seq
        self.token_buckets = tuple(sorted(token_buckets))
        if model is not None and model.cfg != config:
            raise ValueError(f"model: built for {model.cfg}, not for config {config}")
        self.model = model if model is not None else Transformer(config)
        self.graphdef, self.state = nnx.split(self.model)
        self._step = _STEP

    def step(self, pools: Pools, tokens: list[list[int]], starts: list[int], page_tables: list[np.ndarray],
             min_t: int = 1) -> tuple[np.ndarray, Pools]:
        """Run B sequences: sequence i adds ``tokens[i]`` at positions ``starts[i]...``.

        ``page_tables[i]`` lists the pool pages of sequence i, covering every position up to
        ``starts[i] + len(tokens[i])``. Returns (logits (B, vocab) as numpy, new pools).
        """
        logits, new_pools = self._run(pools, tokens, starts, page_tables, min_t, False)
        return np.asarray(logits[:len(tokens)]), new_pools

    def step_all(self, pools: Pools, tokens: list[list[int]], starts: list[int], page_tables: list[np.ndarray],
                 min_t: int = 1) -> tuple[np.ndarray, np.ndarray, Pools]:
        """``step``, returning every new position's logits ``(B, T, vocab)`` and final (normed)
        hidden state ``(B, T, hidden)`` as numpy (T: the bucketed token count; rows past a
        sequence's own tokens are padding), and the new pools."""
        (logits, hidden), new_pools = self._run(pools, tokens, starts, page_tables, min_t, True)
        b = len(tokens)
        return np.asarray(logits[:b]), np.asarray(hidden[:b]), new_pools

    def batch_bucket(self, b: int) -> int:
        return _bucket(b)

    def token_bucket(self, n: int, minimum: int = 1) -> int:
        return self._token_bucket(n, minimum)

    def table_width(self, page_tables: list[np.ndarray]) -> int:
        """The page-table width a step over ``page_tables`` uses (validated)."""
        widest = max(len(p) for p in page_tables)
        if self.max_pages_per_seq is not None and widest > self.max_pages_per_seq:
            raise ValueError(f"page_tables: {widest} pages exceed max_pages_per_seq {self.max_pages_per_seq}")
        return self.max_pages_per_seq or _bucket(widest)

    def _run(self, pools, tokens, starts, page_tables, min_t, all_positions):
        b = len(tokens)
        if not (b == len(starts) == len(page_tables)) or b == 0:
            raise ValueError("tokens, starts, page_tables: expected equal, non-zero lengths")
        bb = _bucket(b)
        tb = self._token_bucket(max(len(x) for x in tokens), min_t)
        mb = self.table_width(page_tables)
        tok = np.zeros((bb, tb), np.int32)
        pos = np.zeros((bb, tb), np.int32)
        val = np.zeros((bb, tb), bool)
        pt = np.zeros((bb, mb), np.int32)
        kv_lens = np.zeros(bb, np.int32)
        for i, (ts, st, table) in enumerate(zip(tokens, starts, page_tables)):
            n = len(ts)
            if n == 0:
                raise ValueError(f"tokens[{i}]: expected at least one token")
            if (st + n + self.page_size - 1) // self.page_size > len(table):
                raise ValueError(f"page_tables[{i}]: {len(table)} pages do not cover {st + n} tokens")
            tok[i, :n], pos[i, :n], val[i, :n] = ts, np.arange(st, st + n), True
            pos[i, n:] = st + n - 1
            pt[i, :len(table)] = table
            kv_lens[i] = st + n
        return self._step(self.graphdef, self.state, pools, tok, pos, val, pt, kv_lens, all_positions)

    def _token_bucket(self, n: int, minimum: int = 1) -> int:
        for t in self.token_buckets:
            if t >= max(n, minimum):
                return t
        return _bucket(max(n, minimum))

    def warmup(self, pools: Pools, max_batch: int, max_new_tokens_per_step: int, all_positions: bool = False,
               decode_tokens: int = 1) -> Pools:
        """Compile every (B, T) shape serving will use (needs ``max_pages_per_seq``); returns the pools.

        ``all_positions``: compile ``step_all``'s program instead of ``step``'s; ``decode_tokens``:
        new tokens per sequence in a batched decode step (speculative verification: k + 1).
        Runs steps whose tokens are all padding, so no KV is written: the pools come back with
        the same content (as new arrays: they were donated).
        """
        if self.max_pages_per_seq is None:
            raise ValueError("warmup: needs a fixed max_pages_per_seq")
        shapes = {(1, self._token_bucket(t)) for t in self.token_buckets if t <= max_new_tokens_per_step}
        shapes.add((1, self._token_bucket(max_new_tokens_per_step)))
        # Decode steps are bucketed like any step (``_token_bucket``), not run at T = 1.
        shapes |= {(_bucket(b), self._token_bucket(decode_tokens)) for b in range(1, max_batch + 1)}
        for bb, tb in sorted(shapes):
            zeros = np.zeros((bb, tb), np.int32)
            _, pools = self._step(self.graphdef, self.state, pools, zeros, zeros, np.zeros((bb, tb), bool),
                                  np.zeros((bb, self.max_pages_per_seq), np.int32), np.ones(bb, np.int32),
                                  all_positions)
        return pools
