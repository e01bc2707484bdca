"""The hybrid (full + sliding-window) reference model over two paged pools.

The paged step is checked against a dense reference written here from the weights in plain
jnp (its own rotary, attention and banded causal mask), for chunked prefill and batched decode
with SWA pages freed, poisoned and reused as the window slides, as an engine would.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hicache_jax import HostKVPool
from hicache_jax.backends.jax import JaxDevicePool, JaxTransferEngine
from hicache_jax.reference_model import (
    HYBRID_BENCH,
    HYBRID_TINY,
    ModelConfig,
    PagedRunner,
    swa_first_needed_page,
    swa_pages_needed,
    swa_table_width,
)
from pallas_kernels.page_copy import PageCopyConfig

SMALL = dict(
    vocab_size=256,
    hidden=32,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    ffn=64,
    kv_lora_rank=16,
    qk_rope_head_dim=8,
    qk_nope_head_dim=8,
    v_head_dim=8,
)


def _zeros(geom, num_pages: int):
    return {
        c: [jnp.zeros((num_pages,) + geom.page_shape, jnp.dtype(geom.numpy_dtype())) for _ in range(geom.num_layers)]
        for c in geom.components
    }


def _poison(pools, pages, value=np.nan):
    pages = np.asarray(pages, np.int32)
    if not pages.size:
        return pools
    return {c: [a.at[pages].set(value) for a in layers] for c, layers in pools.items()}


# ---- the dense reference (independent of paged_forward and of model.attend) ----------------------
def _rope(x, pos, theta):
    """Rotate-half rotary embedding of x (T, H, D) at positions pos (T,)."""
    half = x.shape[-1] // 2
    inv = 1.0 / theta ** (jnp.arange(half, dtype=jnp.float32) * 2 / x.shape[-1])
    ang = pos[:, None].astype(jnp.float32) * inv[None, :]
    cos, sin = jnp.cos(ang)[:, None, :], jnp.sin(ang)[:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)


def _rms(x, scale):
    return x / jnp.sqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * scale


def _band(t: int, window: int | None):
    """allowed[q, k]: causal, and within the last ``window`` positions (q included) if set."""
    q, k = np.arange(t)[:, None], np.arange(t)[None, :]
    allowed = k <= q
    if window is not None:
        allowed &= k > q - window
    return jnp.asarray(allowed)


def _weights(model) -> dict:
    """The model's parameters as a plain dict of arrays (read off the modules, no model code run)."""
    blocks = []
    for block in model.blocks:
        a = block.attn
        names = (
            ("wq", "wk", "wv", "wo") if model.cfg.attention == "mha" else ("wq", "w_dkv", "w_kr", "w_uk", "w_uv", "wo")
        )
        w = {n: getattr(a, n).kernel[...] for n in names}
        w.update(
            norm1=block.norm1.scale[...],
            norm2=block.norm2.scale[...],
            w1=block.w1.kernel[...],
            w2=block.w2.kernel[...],
            w3=block.w3.kernel[...],
        )
        blocks.append(w)
    return dict(
        embed=model.embed.embedding[...], blocks=blocks, norm=model.norm.scale[...], lm_head=model.lm_head.kernel[...]
    )


@partial(jax.jit, static_argnums=(2, 3))
def _dense(w, tokens, cfg: ModelConfig, windows: tuple):
    t = tokens.shape[0]
    pos = jnp.arange(t)
    x = w["embed"][tokens]
    for a, window in zip(w["blocks"], windows):
        h = _rms(x, a["norm1"])
        if cfg.attention == "mha":
            q = _rope((h @ a["wq"]).reshape(t, cfg.num_heads, cfg.head_dim), pos, cfg.rope_theta)
            k = _rope((h @ a["wk"]).reshape(t, cfg.num_kv_heads, cfg.head_dim), pos, cfg.rope_theta)
            v = (h @ a["wv"]).reshape(t, cfg.num_kv_heads, cfg.head_dim)
            rep = cfg.num_heads // cfg.num_kv_heads
            k, v = jnp.repeat(k, rep, axis=1), jnp.repeat(v, rep, axis=1)
            scores = jnp.einsum("qhd,khd->hqk", q, k) / np.sqrt(cfg.head_dim)
        else:
            nope, rope = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
            q = (h @ a["wq"]).reshape(t, cfg.num_heads, nope + rope)
            c = h @ a["w_dkv"]
            kr = _rope((h @ a["w_kr"])[:, None, :], pos, cfg.rope_theta)[:, 0]
            k_nope = (c @ a["w_uk"]).reshape(t, cfg.num_heads, nope)
            v = (c @ a["w_uv"]).reshape(t, cfg.num_heads, cfg.v_head_dim)
            scores = (
                jnp.einsum("qhd,khd->hqk", q[..., :nope], k_nope)
                + jnp.einsum("qhd,kd->hqk", _rope(q[..., nope:], pos, cfg.rope_theta), kr)
            ) / np.sqrt(nope + rope)
        scores = jnp.where(_band(t, window)[None], scores, -jnp.inf)
        out = jnp.einsum("hqk,khd->qhd", jax.nn.softmax(scores, axis=-1), v).reshape(t, -1)
        x = x + out @ a["wo"]
        h2 = _rms(x, a["norm2"])
        x = x + (jax.nn.silu(h2 @ a["w1"]) * (h2 @ a["w3"])) @ a["w2"]
    return _rms(x, w["norm"]) @ w["lm_head"]


def _dense_logits(model, tokens, windows: list[int | None], pad_to: int = 64):
    """Logits (T, vocab) at every position of one sequence; ``windows[l]``: layer l's window or
    None. Causal, so padding the sequence to ``pad_to`` (one compile per model) changes nothing
    before its end."""
    assert len(tokens) <= pad_to
    padded = np.zeros(pad_to, np.int32)
    padded[: len(tokens)] = tokens
    return np.asarray(_dense(_weights(model), padded, model.cfg, tuple(windows)))[: len(tokens)]


def _windows(cfg: ModelConfig) -> list[int | None]:
    """Per layer window as the config's raw fields say (not through its derived pool mapping)."""
    return [cfg.sliding_window if kind == "sliding" and not cfg.swa_as_full else None for kind in cfg.layer_types]


# ---- an engine in miniature: two pools, SWA pages freed and poisoned as the window slides -------
class _Serving:
    def __init__(
        self, runner: PagedRunner, num_seqs: int, full_pages: int = 96, swa_pages: int = 24, poison=np.nan
    ) -> None:
        cfg, page = runner.config, runner.page_size
        self.runner, self.page, self.window, self.poison = runner, page, cfg.sliding_window, poison
        self.pools = _zeros(cfg.kv_geometry(page), full_pages)
        self.swa = _zeros(cfg.swa_kv_geometry(page), swa_pages)
        rng = np.random.default_rng(7)
        order = rng.permutation(full_pages)  # scattered pages: a wrong table entry reads someone else's KV
        per = full_pages // num_seqs
        self.tables = [order[i * per : (i + 1) * per] for i in range(num_seqs)]
        self.swa_free = list(rng.permutation(swa_pages))
        self.swa_tables: list[list[int]] = [[] for _ in range(num_seqs)]
        self.peak_swa_held = 0

    def _held(self, i: int) -> int:
        return sum(p >= 0 for p in self.swa_tables[i])

    def _prepare(self, i: int, start: int, end: int) -> None:
        need = swa_pages_needed(start, end, self.window, self.page)
        table = self.swa_tables[i]
        while len(table) < need.stop:
            table.append(int(self.swa_free.pop(0)))
        assert all(table[j] >= 0 for j in need)
        self.peak_swa_held = max(self.peak_swa_held, self._held(i))

    def _release(self, i: int, next_start: int) -> None:
        """Free (and poison) the SWA pages below what the next step reads."""
        table = self.swa_tables[i]
        freed = [table[j] for j in range(swa_first_needed_page(next_start, self.window, self.page)) if table[j] >= 0]
        for j in range(swa_first_needed_page(next_start, self.window, self.page)):
            table[j] = -1  # the sentinel: never read
        self.swa_free.extend(freed)
        self.swa = _poison(self.swa, freed, self.poison)

    def step(self, seqs: list[int], tokens: list[list[int]], starts: list[int]) -> np.ndarray:
        for i, ts, st in zip(seqs, tokens, starts):
            self._prepare(i, st, st + len(ts))
        logits, self.pools, self.swa = self.runner.step(
            self.pools,
            tokens,
            starts,
            [self.tables[i][: -(-(st + len(ts)) // self.page)] for i, ts, st in zip(seqs, tokens, starts)],
            swa_pools=self.swa,
            swa_page_tables=[list(self.swa_tables[i]) for i in seqs],
        )
        for i, ts, st in zip(seqs, tokens, starts):
            self._release(i, st + len(ts))
        return logits


def _serve(runner: PagedRunner, prompts, chunks, decode_steps: int, **kw):
    """Chunked prefill of each prompt, then batched greedy decode. Returns (tokens per sequence,
    [(seq, position, logits)], the serving state)."""
    srv = _Serving(runner, len(prompts), **kw)
    seqs = [list(p) for p in prompts]
    seen = []
    last = []
    for i, p in enumerate(prompts):
        s = 0
        for n in chunks[i]:
            lg = srv.step([i], [p[s : s + n]], [s])
            s += n
            seen.append((i, s - 1, lg[0]))
        assert s == len(p)
        last.append(lg[0])
    for _ in range(decode_steps):
        nxt = [int(np.argmax(lg)) for lg in last]
        starts = [len(s) for s in seqs]
        for s, t in zip(seqs, nxt):
            s.append(t)
        lgs = srv.step(list(range(len(seqs))), [[t] for t in nxt], starts)
        seen.extend((i, starts[i], lgs[i]) for i in range(len(seqs)))
        last = list(lgs)
    return seqs, seen, srv


CASES = [  # (attention, page, window, layer pattern, num_layers, prompt lengths, chunks)
    ("mha", 1, 5, "SF", 3, (29, 13), ((9, 16, 4), (13,))),
    ("mha", 16, 5, "SF", 3, (37, 21), ((7, 16, 14), (16, 5))),  # window inside one page
    ("mha", 16, 20, "FS", 2, (45, 19), ((16, 13, 16), (19,))),  # window ends inside the second page
    ("mla", 16, 20, "SF", 2, (40, 23), ((11, 16, 13), (7, 16))),
    ("mha", 4, 9, "SSF", 3, (30, 26), ((16, 14), (5, 5, 16))),
]


@pytest.mark.parametrize("attention, page, window, pattern, layers, lens, chunks", CASES)
def test_paged_hybrid_step_equals_dense_banded_reference(attention, page, window, pattern, layers, lens, chunks):
    cfg = ModelConfig(attention=attention, num_layers=layers, layer_types=pattern, sliding_window=window, **SMALL)
    runner = PagedRunner(cfg, page, max_pages_per_seq=-(-64 // page))
    rng = np.random.default_rng(page * 100 + window)
    prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in lens]
    seqs, seen, srv = _serve(runner, prompts, chunks, decode_steps=6)
    dense = {i: _dense_logits(runner.model, s, _windows(cfg)) for i, s in enumerate(seqs)}
    for i, p, lg in seen:
        assert np.isfinite(lg).all()
        np.testing.assert_allclose(lg, dense[i][p], rtol=2e-4, atol=2e-4, err_msg=f"seq {i} position {p}")
    # The window matters at these lengths: a full-attention reference disagrees, so the
    # comparison above can see a window that is too wide or ignored.
    full = _dense_logits(runner.model, seqs[0], [None] * layers)
    assert not np.allclose(full[window:], dense[0][window:], atol=1e-3)
    # SWA memory per request stayed within the window: at most one step's window of pages.
    assert srv.peak_swa_held <= swa_table_width(window, max(max(c) for c in chunks), page)


def test_swa_layers_never_read_pages_or_slots_below_the_window():
    """Pages wholly below the window may hold anything or be any id; slots below the window in
    its first page may hold anything: the logits are bit-identical."""
    page, window, n = 4, 7, 41
    cfg = ModelConfig(num_layers=2, layer_types="SF", sliding_window=window, **SMALL)
    runner = PagedRunner(cfg, page)
    rng = np.random.default_rng(3)
    toks = rng.integers(0, cfg.vocab_size, n + 1).tolist()
    full_table, swa_table = np.arange(20), np.arange(20)[::-1].copy()
    pools = _zeros(cfg.kv_geometry(page), 20)
    swa = _zeros(cfg.swa_kv_geometry(page), 20)
    _, pools, swa = runner.step(pools, [toks[:n]], [0], [full_table], swa_pools=swa, swa_page_tables=[swa_table])
    need = swa_pages_needed(n, n + 1, window, page)  # decode at position 41 reads [35, 41]
    assert need.start == (n - window + 1) // page == 8 and (n - window + 1) % page  # the window starts mid-page
    below = swa_table[: need.start]

    def decode(swa_pools, table):
        p = {c: [a.copy() for a in layers] for c, layers in pools.items()}
        s = {c: [a.copy() for a in layers] for c, layers in swa_pools.items()}
        return runner.step(p, [[toks[n]]], [n], [full_table], swa_pools=s, swa_page_tables=[table])[0]

    want = decode(swa, swa_table)
    assert np.isfinite(want).all()
    for value in (np.nan, 1e30, -1e30):
        np.testing.assert_array_equal(decode(_poison(swa, below, value), swa_table), want)
    for sentinel in (-1, 10**9):
        table = swa_table.copy()
        table[: need.start] = sentinel
        np.testing.assert_array_equal(decode(swa, table), want)
    as_list = [None] * need.start + swa_table[need.start :].tolist()  # a list with holes works too
    np.testing.assert_array_equal(decode(swa, as_list), want)
    # The slots of the window's first page that lie below the window (positions 32..34), poisoned.
    first_page = int(swa_table[need.start])
    below_slots = np.arange((n - window + 1) % page)
    head = {c: [a.at[first_page, below_slots].set(np.nan) for a in layers] for c, layers in swa.items()}
    np.testing.assert_array_equal(decode(head, swa_table), want)
    # ...while poisoning a page inside the window does change the output (the check can see a read).
    assert not np.isfinite(decode(_poison(swa, [swa_table[need.start + 1]]), swa_table)).all()


@pytest.mark.parametrize("attention", ["mha", "mla"])
def test_swa_as_full_equals_the_full_model_with_the_same_weights(attention):
    kw = dict(SMALL, attention=attention, num_layers=2)
    as_full = ModelConfig(layer_types="SF", sliding_window=6, swa_as_full=True, **kw)
    plain = ModelConfig(**kw)
    hybrid = ModelConfig(layer_types="SF", sliding_window=6, **kw)
    assert as_full.swa_kv_geometry(4) is None and as_full.kv_geometry(4) == plain.kv_geometry(4)
    assert hybrid.kv_geometry(4).num_layers == 1 and hybrid.swa_kv_geometry(4).num_layers == 1
    runners = {name: PagedRunner(c, 4) for name, c in (("as_full", as_full), ("plain", plain), ("hybrid", hybrid))}
    leaves = {name: jax.tree.leaves(r.state) for name, r in runners.items()}
    for a, b, c in zip(leaves["as_full"], leaves["plain"], leaves["hybrid"]):
        np.testing.assert_array_equal(a, b)  # same weights: the layer kinds do not change init
        np.testing.assert_array_equal(a, c)
    rng = np.random.default_rng(5)
    toks = rng.integers(0, 256, 30).tolist()
    out = {}
    for name, r in runners.items():
        pools = _zeros(r.config.kv_geometry(4), 16)
        extra = {}
        if r.config.is_hybrid:
            extra = dict(swa_pools=_zeros(r.config.swa_kv_geometry(4), 16), swa_page_tables=[np.arange(8)])
        out[name] = r.step(pools, [toks], [0], [np.arange(8)], **extra)[0]
    np.testing.assert_array_equal(out["as_full"], out["plain"])
    assert not np.allclose(out["hybrid"], out["plain"], atol=1e-3)  # 30 tokens > window 6: the window bites


def test_device_pool_and_transfer_engine_carry_the_swa_pool():
    """JaxDevicePool / JaxTransferEngine over the SWA geometry: the model steps on the pool's
    buffers, a backup and a load back to other pages round-trip the bytes, and decode continues
    from the loaded pages with identical logits."""
    page, window = 4, 7
    cfg = ModelConfig(num_layers=3, layer_types="SF", sliding_window=window, **SMALL)
    runner = PagedRunner(cfg, page)
    full_dev = JaxDevicePool(cfg.kv_geometry(page), 16)
    swa_geom = cfg.swa_kv_geometry(page)
    assert swa_geom.num_layers == 2 and full_dev.geom.num_layers == 1
    swa_dev = JaxDevicePool(swa_geom, 12)
    host = HostKVPool(swa_geom, 8)
    eng = JaxTransferEngine(swa_dev, host, copy_config=PageCopyConfig(max_pages=12))
    rng = np.random.default_rng(9)
    toks = rng.integers(0, 256, 23).tolist()
    full_table, swa_table = np.arange(8), np.array([11, 3, 5, 0, 9, 2, 7])

    def run(tokens, start, table):
        logits, new, new_swa = runner.step(
            full_dev.buffers, [tokens], [start], [full_table], swa_pools=swa_dev.buffers, swa_page_tables=[table]
        )
        for pool, arrays in ((full_dev, new), (swa_dev, new_swa)):
            for c, layers in arrays.items():
                for l, a in enumerate(layers):
                    pool.set_layer(c, l, a)
        return logits[0]

    run(toks[:22], 0, swa_table)
    need = swa_pages_needed(22, 23, window, page)
    src = swa_table[need.start : need.stop]
    dst = np.array([1, 4, 6][: len(src)])
    before = {c: swa_dev.read_pages_host(c, src) for c in swa_geom.components}
    eng.backup(src, np.arange(len(src))).wait()
    handle = eng.load(np.arange(len(src)), dst)
    for layer in range(swa_geom.num_layers):
        handle.wait_layer(layer)
    for c in swa_geom.components:
        np.testing.assert_array_equal(swa_dev.read_pages_host(c, dst), before[c])
    moved = swa_table.copy()
    moved[need.start : need.stop] = dst
    moved[: need.start] = -1
    snapshot = {c: [np.asarray(a) for a in layers] for c, layers in swa_dev.buffers.items()}
    a = run(toks[22:], 22, swa_table)
    # Rewind: the same decode over the loaded copies (the originals poisoned) gives the same logits.
    for c, layers in snapshot.items():
        for l, arr in enumerate(layers):
            arr = arr.copy()
            arr[src] = np.nan
            swa_dev.set_layer(c, l, jnp.asarray(arr))
    b = run(toks[22:], 22, moved)
    np.testing.assert_array_equal(a, b)
    np.testing.assert_allclose(a, _dense_logits(runner.model, toks, _windows(cfg))[22], rtol=2e-4, atol=2e-4)
    eng.close()


@pytest.mark.parametrize("pattern", ["F", "SF"])
def test_warmup_compiles_every_serving_shape(pattern):
    """After warmup, prefill chunks and batched decode steps compile nothing (decode runs at
    T = 1, the shape warmup compiles; a hybrid step's SWA table width follows T)."""
    cfg = ModelConfig(num_layers=2, layer_types=pattern, sliding_window=5 if "S" in pattern else None, **SMALL)
    page = 4
    runner = PagedRunner(cfg, page, max_pages_per_seq=16, token_buckets=(8, 16))
    pools = _zeros(cfg.kv_geometry(page), 40)
    swa = _zeros(cfg.swa_kv_geometry(page), 40) if cfg.is_hybrid else None
    compiles = []

    def listener(event, duration, fun_name="", **kw):
        if event == "/jax/core/compile/backend_compile_duration" and "_forward" in fun_name:
            compiles.append(fun_name)

    def step(tokens, starts, tables):
        nonlocal pools, swa
        if swa is None:
            _, pools = runner.step(pools, tokens, starts, tables)
        else:
            _, pools, swa = runner.step(pools, tokens, starts, tables, swa_pools=swa, swa_page_tables=tables)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        if swa is None:
            pools = runner.warmup(pools, max_batch=2, max_new_tokens_per_step=16)
        else:
            pools, swa = runner.warmup(pools, max_batch=2, max_new_tokens_per_step=16, swa_pools=swa)
        assert len(compiles) == 4  # (1, 8), (1, 16), (1, 1), (2, 1): the warm-up compiled each shape once
        compiles.clear()
        rng = np.random.default_rng(1)
        tables = [np.arange(0, 16), np.arange(16, 32)]
        for n, st in ((5, 0), (16, 5), (11, 21)):
            step([rng.integers(0, 256, n).tolist()], [st], tables[:1])
        for k in range(3):
            step([[1], [2]], [32 + k, k], tables)
            step([[3]], [35 + k], tables[:1])
        assert compiles == []  # serving after warm-up compiles nothing
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


# ---- the window arithmetic --------------------------------------------------------------------
def test_swa_pages_needed_by_hand():
    assert swa_pages_needed(0, 1, 4, 16) == range(0, 1)
    assert swa_pages_needed(40, 41, 6, 4) == range(8, 11)  # positions 35..40
    assert swa_pages_needed(40, 41, 5, 4) == range(9, 11)  # positions 36..40: page 8 is free
    assert swa_pages_needed(100, 164, 20, 16) == range(5, 11)  # chunk [100, 164) reads 81..163
    assert swa_pages_needed(7, 8, 1, 1) == range(7, 8)  # W = 1: only the current position
    assert swa_first_needed_page(3, 10, 4) == 0


def test_swa_pages_needed_matches_enumerated_positions_and_the_width_bound():
    rng = np.random.default_rng(0)
    for _ in range(2000):
        page, window = int(rng.integers(1, 20)), int(rng.integers(1, 70))
        start, n = int(rng.integers(0, 200)), int(rng.integers(1, 40))
        got = swa_pages_needed(start, start + n, window, page)
        # every position some query of the step attends to, enumerated one by one
        read = {k for q in range(start, start + n) for k in range(max(0, q - window + 1), q + 1)}
        assert set(got) == {k // page for k in read}
        assert len(got) <= swa_table_width(window, n, page)
    for page, window, n in ((16, 20, 1), (16, 5, 16), (1, 5, 3), (4, 9, 16)):  # the bound is reached
        assert max(
            len(swa_pages_needed(s, s + n, window, page)) for s in range(window, window + page + 1)
        ) == swa_table_width(window, n, page)


@pytest.mark.parametrize(
    "args, exc, match",
    [
        ((-1, 1, 4, 4), ValueError, "start"),
        ((5, 5, 4, 4), ValueError, "end"),
        ((0, 1, 0, 4), ValueError, "window"),
        ((0, 1, 4, 0), ValueError, "page_size"),
        ((0.0, 1, 4, 4), TypeError, "start"),
    ],
)
def test_swa_pages_needed_rejects_bad_arguments(args, exc, match):
    with pytest.raises(exc, match=match):
        swa_pages_needed(*args)


# ---- configuration --------------------------------------------------------------------------------
def test_layer_patterns_normalize_to_per_layer_tuples():
    assert ModelConfig(num_layers=4, layer_types="SF", sliding_window=8).layer_types == (
        "sliding",
        "full",
        "sliding",
        "full",
    )
    assert ModelConfig(num_layers=7, layer_types="SSF", sliding_window=8).layer_types == (
        "sliding",
        "sliding",
        "full",
    ) * 2 + ("sliding",)
    cfg = ModelConfig(num_layers=3, layer_types=("full", "sliding", "sliding"), sliding_window=8)
    assert cfg.swa_layers == (1, 2) and cfg.full_layers == (0,) and cfg.is_hybrid
    assert [cfg.pool_slot(i) for i in range(3)] == [("full", 0), ("swa", 0), ("swa", 1)]
    assert ModelConfig() == ModelConfig(layer_types=("full", "full")) == ModelConfig(layer_types="F")
    assert not ModelConfig().is_hybrid and ModelConfig().swa_kv_geometry(16) is None
    as_full = ModelConfig(num_layers=3, layer_types="SF", sliding_window=8, swa_as_full=True)
    assert as_full.swa_layers == () and as_full.full_layers == (0, 1, 2)
    for preset in (HYBRID_TINY, HYBRID_BENCH):
        assert preset.is_hybrid and preset.layer_types[0] == "sliding" and preset.sliding_window > 0
        assert preset.kv_geometry(16).num_layers + preset.swa_kv_geometry(16).num_layers == preset.num_layers


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        (dict(layer_types="SX", sliding_window=4), ValueError, "layer_types: a pattern"),
        (dict(layer_types="", sliding_window=4), ValueError, "layer_types: a pattern"),
        (dict(layer_types="SFS", sliding_window=4), ValueError, "longer than num_layers"),
        (dict(layer_types=("full",)), ValueError, r"expected 2 entries"),
        (dict(layer_types=("full", "swa"), sliding_window=4), ValueError, r"layer_types\[1\]"),
        (dict(layer_types=3), TypeError, "layer_types"),
        (dict(layer_types="S", sliding_window=4), ValueError, "at least one 'full'"),
        (dict(layer_types="SF"), ValueError, "sliding_window: required"),
        (dict(sliding_window=8), ValueError, "no 'sliding' layer"),
        (dict(layer_types="SF", sliding_window=0), ValueError, "sliding_window: expected >= 1"),
        (dict(layer_types="SF", sliding_window=2.5), TypeError, "sliding_window"),
        (dict(layer_types="SF", sliding_window=True), TypeError, "sliding_window"),
        (dict(layer_types="SF", sliding_window=4, swa_as_full=1), TypeError, "swa_as_full"),
    ],
)
def test_bad_hybrid_configs_raise_clear_errors(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        ModelConfig(**kwargs)


def test_step_rejects_missing_or_wrong_swa_arguments():
    page = 4
    hyb = ModelConfig(num_layers=3, layer_types="SF", sliding_window=6, **SMALL)
    runner = PagedRunner(hyb, page)
    pools, swa = _zeros(hyb.kv_geometry(page), 8), _zeros(hyb.swa_kv_geometry(page), 8)
    tok, table = [[1] * 9], [np.arange(3)]
    with pytest.raises(ValueError, match="swa_pools, swa_page_tables: required"):
        runner.step(pools, tok, [0], table)
    with pytest.raises(ValueError, match=r"swa_page_tables\[0\]: 2 entries do not reach logical page 2"):
        runner.step(pools, tok, [0], table, swa_pools=swa, swa_page_tables=[np.arange(2)])
    with pytest.raises(ValueError, match=r"swa_page_tables\[0\]: logical pages 0\.\.2 .* in \[0, 8\)"):
        runner.step(pools, tok, [0], table, swa_pools=swa, swa_page_tables=[np.array([0, -1, 2])])
    with pytest.raises(ValueError, match=r"swa_page_tables\[0\]"):
        runner.step(pools, tok, [0], table, swa_pools=swa, swa_page_tables=[np.array([0, 1, 8])])
    with pytest.raises(ValueError, match="swa_page_tables: expected 1 tables"):
        runner.step(pools, tok, [0], table, swa_pools=swa, swa_page_tables=[np.arange(3)] * 2)
    with pytest.raises(ValueError, match="swa_pools: expected"):  # the full pool's layer count, not the SWA one's
        runner.step(pools, tok, [0], table, swa_pools=pools, swa_page_tables=[np.arange(3)])
    with pytest.raises(ValueError, match="pools: expected"):
        runner.step(swa, tok, [0], table, swa_pools=swa, swa_page_tables=[np.arange(3)])
    with pytest.raises(ValueError, match="swa_pools: required exactly"):
        PagedRunner(hyb, page, max_pages_per_seq=4).warmup(pools, 1, 8)
    plain = PagedRunner(ModelConfig(num_layers=1, **SMALL), page)
    with pytest.raises(ValueError, match="expected None"):
        plain.step(
            _zeros(plain.config.kv_geometry(page), 8), tok, [0], table, swa_pools=swa, swa_page_tables=[np.arange(3)]
        )
