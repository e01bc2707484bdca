"""One jitted model step over the paged KV pool, for prefill chunks and batched decode alike.

``PagedRunner.step`` takes B sequences with up to T new tokens each, writes their KV into the
pool at ``(page_table[pos // page], pos % page)``, attends over every cached position below
``kv_len`` (causal), and returns the logits of each sequence's last new token plus the
updated pool arrays. ``PagedRunner.step_all`` is the same step returning the logits and the
final (normed) hidden states of every new position, which speculative decoding needs (the
verification of all draft tokens at once, and the draft head's input features).

Hybrid models (``ModelConfig.is_hybrid``) have a second pool, the SWA pool, for their
sliding-window layers, with its own page ids and per sequence its own page table, indexed by
logical page like the full one (entry j: the SWA page holding positions ``[j*page, (j+1)*page)``).
A sliding layer with window ``W`` lets position ``p`` attend to ``[p - W + 1, p]`` (``window``
states the convention); a step computing ``[s, e)`` therefore reads SWA positions
``[s - W + 1, e)``, i.e. the logical pages ``window.swa_pages_needed(s, e, W, page)``. Only
those entries of an SWA table must be valid SWA page ids; the entries below are never copied
to the device (a freed page's id, a sentinel such as -1, anything). The runner copies the
needed entries into a narrow device table of ``window.swa_table_width(W, T, page)`` columns
(a ring: column j holds the needed logical page ``L`` with ``L % width == j``), so the SWA
layers gather and attend over at most ``W - 1 + T`` positions (plus page rounding), never over
the whole context: SWA compute per step and SWA pool pages per request are bounded by the
window. That width is a function of the token bucket T, so each compiled (B, T) shape has
exactly one SWA width and a hybrid model compiles no more steps than a full one. (The
alternative, SWA tables as wide as the full ones with out-of-window entries masked, bounds pool
memory just as well but gathers and attends over the whole context in every SWA layer and puts
stale ids on the device.) The full pool and its
tables work exactly as for a non-hybrid model, whose compiled step is unchanged. The per-layer
dispatch to a pool is ``_attention``.

Donation: the pool arrays passed in (both pools) are donated (updated in place) and must be
replaced by the returned ones. Shapes are bucketed so steady-state serving reuses compiled steps:
B to powers of two; T to 1 for decode (one token per sequence), else to ``token_buckets`` (then
powers of two); the page-table width either fixed at ``max_pages_per_seq`` (one width: attention
over a few padded keys is cheap next to the matmuls, and ``warmup`` can then compile every shape
up front) or to powers of two.

Deterministic mode (``fixed_shape=(rows, tokens)``): one step shape for everything. Each
sequence's new tokens are cut into rows of at most ``tokens`` (a decode token is a row of one,
a prefill chunk is several rows of the same sequence), and rows run ``rows`` at a time, always
at shape ``(rows, tokens)`` with the one table width ``max_pages_per_seq``: a prefill of 500
tokens is a few such steps, a decode step of 3 sequences is one. A row's later tokens may read
KV its sequence's earlier rows write in the same step: every layer writes the whole step's KV
before it attends. With one compiled program, every matmul row and every query's reductions
(over the hidden size, over the keys at fixed slots: key slot = position for full attention,
the ring of ``_window_view`` for sliding layers) run the same kernel over the same shapes,
whatever else is in the step: the KV entry and the logits of a position depend only on the
tokens before it, not on how they were chunked, batched or cached. XLA's kernels pick
algorithms and reduction splits by shape (on GPUs above all), so the default bucketed shapes
give values that differ in the last bits between, say, a prompt prefilled in one chunk and
the same prompt whose prefix came from the cache. The cost is padding: a decode step
computes ``rows * tokens`` token slots.

Threading: call from the thread that owns the pool.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from .config import ModelConfig
from .model import Transformer
from .window import swa_pages_needed, swa_table_width
from .static_graph import StaticGraph, static_graph

Pools = dict[str, list[jax.Array]]


def _bucket(n: int, minimum: int = 1) -> int:
    return max(minimum, 1 << max(0, (n - 1).bit_length()))


class _PoolView(NamedTuple):
    """One pool as a step sees it: where the new tokens' KV goes and which slots each query reads."""

    tables: jax.Array  # (B, M) pool pages gathered per sequence
    slot_page: jax.Array  # (B, T) pool page of each new token (num_pages for padding: dropped)
    slot_off: jax.Array  # (B, T)
    kv_valid: jax.Array  # (B, S = M * page) gathered slots holding KV this step may read
    mask: jax.Array  # (B, T, S) slots each query attends to


def _full_view(
    page_tables, positions, valid, kv_lens, num_pages: int, page: int, window: int | None = None
) -> _PoolView:
    """Full pool: table column j is logical page j; causal over ``[0, kv_len)``, and over the
    last ``window`` positions only for a sliding layer kept in the full pool
    (``ModelConfig.attention_window``)."""
    # New tokens' slots; padding tokens go to an out-of-range page and are dropped.
    slot_page = jnp.take_along_axis(page_tables, positions // page, axis=1)
    slot_page = jnp.where(valid, slot_page, num_pages)
    slot_off = positions % page
    s = page_tables.shape[1] * page
    kpos = jnp.arange(s)
    kv_valid = kpos[None, :] < kv_lens[:, None]  # (B, S)
    mask = (kpos[None, None, :] <= positions[:, :, None]) & kv_valid[:, None, :]
    if window is not None:
        mask &= kpos[None, None, :] > positions[:, :, None] - window
    return _PoolView(page_tables, slot_page, slot_off, kv_valid, mask)


def _window_view(tables, first_page, positions, valid, kv_lens, num_pages: int, page: int, window: int) -> _PoolView:
    """Sliding window over a ring of ``M`` table columns: column j holds the needed logical
    page ``L`` with ``L % M == j`` (``first_page`` is the lowest needed one; ``_swa_tables``).
    So the slot of a key depends only on its position (and M), never on where the step starts:
    every query reduces over its window's keys in the same slot order whichever step computes
    it, which deterministic mode needs (see ``PagedRunner``). Query p sees
    ``[p - window + 1, p]``. Slots below the first query's window (the head of the first page)
    are invalid like those at or past ``kv_len``, so their values never reach the output."""
    m = tables.shape[1]
    slot_page = jnp.take_along_axis(tables, (positions // page) % m, axis=1)
    slot_page = jnp.where(valid, slot_page, num_pages)
    slot_off = positions % page
    col = jnp.arange(m)[None, :]
    logical = first_page[:, None] + (col - first_page[:, None]) % m  # (B, M): the page in each column
    kpos = (logical[:, :, None] * page + jnp.arange(page)[None, None, :]).reshape(tables.shape[0], m * page)
    kv_valid = (kpos < kv_lens[:, None]) & (kpos > positions[:, :1] - window)
    q = positions[:, :, None]
    mask = (kpos[:, None, :] <= q) & (kpos[:, None, :] > q - window) & kv_valid[:, None, :]
    return _PoolView(tables, slot_page, slot_off, kv_valid, mask)


def _attention(block, h, positions, pools: Pools, layer: int, view: _PoolView) -> jax.Array:
    """One layer's attention over one pool: write the new tokens' KV at their slots (replacing
    ``pools[c][layer]``), gather the view's pages, attend."""
    b = h.shape[0]
    s = view.kv_valid.shape[1]
    kv_all = {}
    for c, entries in block.attn.project_kv(h, positions).items():
        old = pools[c][layer]
        pool = old.at[view.slot_page, view.slot_off].set(entries.astype(old.dtype), mode="drop")
        pools[c][layer] = pool
        gathered = pool[view.tables]  # (B, M, page, H, W)
        kv_all[c] = gathered.reshape((b, s) + gathered.shape[3:]).astype(jnp.float32)
    return block.attn.attend(h, positions, kv_all, view.kv_valid, view.mask)


def _forward(
    graph: StaticGraph,
    state,
    pools: Pools,
    tokens,
    positions,
    valid,
    page_tables,
    kv_lens,
    swa_pools: Pools | None = None,
    swa_tables=None,
    swa_first=None,
    all_positions: bool = False,
):
    model = nnx.merge(graph.graphdef, state)
    cfg = model.cfg
    any_pool = next(iter(pools.values()))[0]
    num_pages, page = any_pool.shape[:2]
    x = model.embed(tokens)
    views = {"full": _full_view(page_tables, positions, valid, kv_lens, num_pages, page)}
    new = {"full": {c: list(layers) for c, layers in pools.items()}}
    if swa_pools is not None:
        swa_pages = next(iter(swa_pools.values()))[0].shape[0]
        views["swa"] = _window_view(
            swa_tables, swa_first, positions, valid, kv_lens, swa_pages, page, cfg.sliding_window
        )
        new["swa"] = {c: list(layers) for c, layers in swa_pools.items()}
    for layer, block in enumerate(model.blocks):
        h = block.norm1(x)
        kind, index = cfg.pool_slot(layer)
        view = views[kind]
        if kind == "full" and cfg.attention_window(layer) is not None:  # a window kept in the full pool
            if "full_windowed" not in views:
                views["full_windowed"] = _full_view(
                    page_tables, positions, valid, kv_lens, num_pages, page, cfg.sliding_window
                )
            view = views["full_windowed"]
        x = block.finish(x, _attention(block, h, positions, new[kind], index, view))
    if all_positions:  # logits and final hidden states of every position
        hidden = model.norm(x)
        out = (model.lm_head(hidden), hidden)
    else:
        last = jnp.maximum(jnp.sum(valid, axis=1) - 1, 0)
        x_last = jnp.take_along_axis(x, last[:, None, None], axis=1)[:, 0]
        out = model.lm_head(model.norm(x_last))
    if swa_pools is None:
        return out, new["full"]
    return out, new["full"], new["swa"]


# One jitted step for every runner: equal configs give equal graphdefs (a static argument,
# interned and hashed once: ``static_graph``), so engines built for the same model reuse each
# other's compiled steps. Both pools are donated.
_STEP = jax.jit(_forward, static_argnums=(0,), static_argnames=("all_positions",), donate_argnums=(2, 8))


def _check_pools(name: str, pools: object, components: tuple[str, ...], num_layers: int) -> int:
    """Number of pages of a pool dict ``{component: [array per layer]}``; ValueError if its
    components or layer count are not the geometry's."""
    if (
        not isinstance(pools, dict)
        or set(pools) != set(components)
        or any(len(layers) != num_layers for layers in pools.values())
    ):
        got = {c: len(v) for c, v in pools.items()} if isinstance(pools, dict) else type(pools).__name__
        raise ValueError(
            f"{name}: expected {{component: list of {num_layers} layer arrays}} for components {components}, got {got}"
        )
    return int(next(iter(pools.values()))[0].shape[0])


class PagedRunner:
    """Holds the model's weights and its jitted, pool-donating step."""

    def __init__(
        self,
        config: ModelConfig,
        page_size: int,
        max_pages_per_seq: int | None = None,
        token_buckets: tuple[int, ...] = (16, 32, 64, 128, 256, 512, 1024),
        model: Transformer | None = None,
        fixed_shape: tuple[int, int] | None = None,
    ) -> None:
        """``model``: the weights to run (default: built from ``config.seed``). ``fixed_shape``:
        ``(rows, tokens)`` for deterministic mode (the module docstring); needs
        ``max_pages_per_seq``."""
        if fixed_shape is not None:
            if not (
                isinstance(fixed_shape, tuple)
                and len(fixed_shape) == 2
                and all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in fixed_shape)
            ):
                raise ValueError(f"fixed_shape: expected (rows, tokens), two ints >= 1, got {fixed_shape!r}")
            if max_pages_per_seq is None:
                raise ValueError(
                    "fixed_shape: deterministic mode needs a fixed max_pages_per_seq (one attention width)"
                )
        self.fixed_shape = fixed_shape
        self.config = config
        self.page_size = page_size
        self.max_pages_per_seq = max_pages_per_seq
        self.token_buckets = tuple(sorted(token_buckets))
        if model is not None and model.cfg != config:
            raise ValueError(f"model: built for {model.cfg}, not for config {config}")
        if model is None and config.family != "reference":
            raise ValueError(
                f"model: required for family {config.family!r} (its weights come from a checkpoint, "
                "e.g. hicache_jax.models.gemma3.load_model)"
            )
        self.model = model if model is not None else Transformer(config)
        self.graphdef, self.state = nnx.split(self.model)
        self.static_graph = static_graph(self.graphdef)  # what the jitted step takes (hashed once)
        self._step = _STEP

    def swa_table_width(self, t_bucket: int) -> int:
        """Columns of the device SWA table for a step of token bucket ``t_bucket``."""
        return swa_table_width(self.config.sliding_window, t_bucket, self.page_size)

    def step(
        self,
        pools: Pools,
        tokens: list[list[int]],
        starts: list[int],
        page_tables: list[np.ndarray],
        min_t: int = 1,
        *,
        swa_pools: Pools | None = None,
        swa_page_tables: list | None = None,
    ):
        """Run B sequences: sequence i adds ``tokens[i]`` at positions ``starts[i]...``.

        ``page_tables[i]`` lists the (full) pool pages of sequence i, covering every position up
        to ``starts[i] + len(tokens[i])``. Returns (logits (B, vocab) as numpy, new pools).

        Hybrid models also take ``swa_pools`` (the SWA pool's arrays, donated) and
        ``swa_page_tables[i]``: sequence i's SWA pages by logical page, at least
        ``ceil(end / page)`` entries long, where only the entries of
        ``swa_pages_needed(starts[i], end, W, page)`` are read (they must be SWA pool page ids);
        and return (logits, new pools, new SWA pools).
        """
        out, *new = self._run(pools, tokens, starts, page_tables, min_t, swa_pools, swa_page_tables, False)
        return (np.asarray(out[: len(tokens)]), *new)

    def step_all(
        self,
        pools: Pools,
        tokens: list[list[int]],
        starts: list[int],
        page_tables: list[np.ndarray],
        min_t: int = 1,
        *,
        swa_pools: Pools | None = None,
        swa_page_tables: list | None = None,
    ):
        """``step``, returning every new position's logits ``(B, T, vocab)`` and final (normed)
        hidden state ``(B, T, hidden)`` as numpy (T: the bucketed token count; rows past a
        sequence's own tokens are padding), then the new pools (and SWA pools)."""
        (logits, hidden), *new = self._run(pools, tokens, starts, page_tables, min_t, swa_pools, swa_page_tables, True)
        b = len(tokens)
        return (np.asarray(logits[:b]), np.asarray(hidden[:b]), *new)

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

    def _run(self, pools, tokens, starts, page_tables, min_t, swa_pools, swa_page_tables, all_positions):
        """``step``'s work: the jitted step's raw outputs (device arrays)."""
        b = len(tokens)
        if not (b == len(starts) == len(page_tables)) or b == 0:
            raise ValueError("tokens, starts, page_tables: expected equal, non-zero lengths")
        hybrid = self.config.is_hybrid
        if hybrid and (swa_pools is None or swa_page_tables is None):
            raise ValueError(
                f"swa_pools, swa_page_tables: required, the model has sliding-window layers {self.config.swa_layers}"
            )
        if not hybrid and (swa_pools is not None or swa_page_tables is not None):
            raise ValueError(
                "swa_pools, swa_page_tables: expected None, the model has no sliding-window layer in the SWA pool"
            )
        if self.fixed_shape is not None:
            return self._run_fixed(pools, tokens, starts, page_tables, swa_pools, swa_page_tables, all_positions)
        return self._launch(
            pools,
            tokens,
            starts,
            page_tables,
            swa_pools,
            swa_page_tables,
            all_positions,
            _bucket(b),
            self._token_bucket(max(len(x) for x in tokens), min_t),
        )

    def _run_fixed(self, pools, tokens, starts, page_tables, swa_pools, swa_page_tables, all_positions):
        """Deterministic mode: cut every sequence into rows of at most ``tokens`` new tokens,
        run them ``rows`` at a time in the one fixed shape (later rows of a sequence read the
        KV its earlier rows wrote, in the same step or an earlier one), and put each
        sequence's outputs back together: ``step``'s logits come from the row holding its last
        token, ``step_all``'s rows are concatenated (padded to the longest sequence)."""
        rows_per_step, t = self.fixed_shape
        if swa_page_tables is not None and len(swa_page_tables) != len(tokens):
            raise ValueError(
                f"swa_page_tables: expected {len(tokens)} tables (one per sequence), got {len(swa_page_tables)}"
            )
        rows = []  # (sequence, offset of the row in it, tokens, start, full table, swa table)
        for i, (ts, st, table) in enumerate(zip(tokens, starts, page_tables)):
            n = self._check_sequence(i, ts, st, table)
            swa = None if swa_page_tables is None else swa_page_tables[i]
            rows += [(i, j, list(ts[j : j + t]), st + j, table, swa) for j in range(0, n, t)]
        if swa_pools is not None:  # every row's window is checked before the first step consumes the pools
            self._swa_tables(swa_pools, [r[5] for r in rows], [r[2] for r in rows], [r[3] for r in rows], len(rows), t)
        out_rows = []
        for g in range(0, len(rows), rows_per_step):
            group = rows[g : g + rows_per_step]
            out, *new = self._launch(
                pools,
                [r[2] for r in group],
                [r[3] for r in group],
                [r[4] for r in group],
                swa_pools,
                None if swa_pools is None else [r[5] for r in group],
                all_positions,
                rows_per_step,
                t,
            )
            pools = new[0]
            if swa_pools is not None:
                swa_pools = new[1]
            out = jax.tree.map(np.asarray, out)
            out_rows += [jax.tree.map(lambda a, k=k: a[k], out) for k in range(len(group))]
        b = len(tokens)
        if all_positions:  # (b, longest, ...): each sequence's rows end to end
            longest = max(len(ts) for ts in tokens)
            logits, hidden = out_rows[0]
            res = [np.zeros((b, longest) + a.shape[1:], a.dtype) for a in (logits, hidden)]
            for (i, j, ts, *_), (lg, hd) in zip(rows, out_rows):
                res[0][i, j : j + len(ts)], res[1][i, j : j + len(ts)] = lg[: len(ts)], hd[: len(ts)]
            out = tuple(res)
        else:  # the row of each sequence's last token is its last row
            last = {i: k for k, (i, *_rest) in enumerate(rows)}
            out = np.stack([out_rows[last[i]] for i in range(b)])
        return (out, pools) if swa_pools is None else (out, pools, swa_pools)

    def _check_sequence(self, i: int, tokens, start: int, table) -> int:
        """Sequence ``i``'s token count, after checking it has tokens and its page table covers them."""
        n = len(tokens)
        if n == 0:
            raise ValueError(f"tokens[{i}]: expected at least one token")
        if (start + n + self.page_size - 1) // self.page_size > len(table):
            raise ValueError(f"page_tables[{i}]: {len(table)} pages do not cover {start + n} tokens")
        return n

    def _launch(self, pools, tokens, starts, page_tables, swa_pools, swa_page_tables, all_positions, bb: int, tb: int):
        """One jitted step of shape ``(bb, tb)`` over ``len(tokens) <= bb`` sequences."""
        hybrid = self.config.is_hybrid
        mb = self.table_width(page_tables)
        tok = np.zeros((bb, tb), np.int32)
        pos = np.zeros((bb, tb), np.int32)
        val = np.zeros((bb, tb), bool)
        pt = np.zeros((bb, mb), np.int32)
        kv_lens = np.zeros(bb, np.int32)
        for i, (ts, st, table) in enumerate(zip(tokens, starts, page_tables)):
            n = self._check_sequence(i, ts, st, table)
            tok[i, :n], pos[i, :n], val[i, :n] = ts, np.arange(st, st + n), True
            pos[i, n:] = st + n - 1
            pt[i, : len(table)] = table
            kv_lens[i] = st + n
        if not hybrid:
            return self._step(
                self.static_graph, self.state, pools, tok, pos, val, pt, kv_lens, all_positions=all_positions
            )
        swa_tables, swa_first = self._swa_tables(swa_pools, swa_page_tables, tokens, starts, bb, tb)
        self._check_full_pools(pools)
        return self._step(
            self.static_graph,
            self.state,
            pools,
            tok,
            pos,
            val,
            pt,
            kv_lens,
            swa_pools,
            swa_tables,
            swa_first,
            all_positions=all_positions,
        )

    def _check_full_pools(self, pools: Pools) -> None:
        g = self.config.kv_geometry(self.page_size)
        _check_pools("pools", pools, g.components, g.num_layers)

    def _swa_tables(self, swa_pools: Pools, swa_page_tables: list, tokens, starts, bb: int, tb: int):
        """The narrow device SWA tables (bb, swa_table_width(tb)) and each row's first logical page."""
        g = self.config.swa_kv_geometry(self.page_size)
        num_pages = _check_pools("swa_pools", swa_pools, g.components, g.num_layers)
        if len(swa_page_tables) != len(tokens):
            raise ValueError(
                f"swa_page_tables: expected {len(tokens)} tables (one per sequence), got {len(swa_page_tables)}"
            )
        window, page = self.config.sliding_window, self.page_size
        tables = np.zeros((bb, self.swa_table_width(tb)), np.int32)
        first = np.zeros(bb, np.int32)
        for i, (ts, st, table) in enumerate(zip(tokens, starts, swa_page_tables)):
            end = st + len(ts)
            need = swa_pages_needed(st, end, window, page)
            if len(table) < need.stop:
                raise ValueError(
                    f"swa_page_tables[{i}]: {len(table)} entries do not reach logical page "
                    f"{need.stop - 1} (positions up to {end - 1})"
                )
            ids = np.asarray(table[need.start : need.stop])
            if ids.dtype.kind not in "iu" or (ids.size and (ids.min() < 0 or ids.max() >= num_pages)):
                raise ValueError(
                    f"swa_page_tables[{i}]: logical pages {need.start}..{need.stop - 1} (positions "
                    f"[{max(0, st - window + 1)}, {end}) of the window) must be SWA pool page ids "
                    f"in [0, {num_pages}), got {ids.tolist()}"
                )
            tables[i, np.arange(need.start, need.stop) % tables.shape[1]] = ids  # the ring (``_window_view``)
            first[i] = need.start
        return tables, first

    def _token_bucket(self, n: int, minimum: int = 1) -> int:
        n = max(n, minimum)
        if n == 1:  # decode: one token per sequence, no padded tokens (the shape warmup compiles)
            return 1
        for t in self.token_buckets:
            if t >= n:
                return t
        return _bucket(n)

    def warmup(
        self,
        pools: Pools,
        max_batch: int,
        max_new_tokens_per_step: int,
        *,
        swa_pools: Pools | None = None,
        all_positions: bool = False,
        decode_tokens: int = 1,
    ):
        """Compile every (B, T) shape serving will use (needs ``max_pages_per_seq``); returns the
        pools, or (pools, SWA pools) for a hybrid model (which must pass ``swa_pools``).

        ``all_positions``: compile ``step_all``'s program instead of ``step``'s; ``decode_tokens``:
        new tokens per sequence in a batched decode step (speculative verification: k + 1).

        Runs steps whose tokens are all padding, so no KV is written: the pools come back with
        the same content (as new arrays: they were donated).
        """
        if self.max_pages_per_seq is None:
            raise ValueError("warmup: needs a fixed max_pages_per_seq")
        hybrid = self.config.is_hybrid
        if hybrid != (swa_pools is not None):
            raise ValueError(
                "swa_pools: required exactly when the model has sliding-window layers "
                f"(it has {self.config.swa_layers or 'none'})"
            )
        if self.fixed_shape is not None:  # deterministic mode: the one shape
            shapes = {self.fixed_shape}
        else:
            shapes = {(1, self._token_bucket(t)) for t in self.token_buckets if t <= max_new_tokens_per_step}
            shapes.add((1, self._token_bucket(max_new_tokens_per_step)))
            shapes |= {(_bucket(b), self._token_bucket(decode_tokens)) for b in range(1, max_batch + 1)}
        for bb, tb in sorted(shapes):
            zeros = np.zeros((bb, tb), np.int32)
            args = (
                self.static_graph,
                self.state,
                pools,
                zeros,
                zeros,
                np.zeros((bb, tb), bool),
                np.zeros((bb, self.max_pages_per_seq), np.int32),
                np.ones(bb, np.int32),
            )
            if not hybrid:
                _, pools = self._step(*args, all_positions=all_positions)
                continue
            _, pools, swa_pools = self._step(
                *args,
                swa_pools,
                np.zeros((bb, self.swa_table_width(tb)), np.int32),
                np.zeros(bb, np.int32),
                all_positions=all_positions,
            )
        return (pools, swa_pools) if hybrid else pools
