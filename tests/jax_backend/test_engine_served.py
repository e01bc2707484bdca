"""What the engine served, seen from outside the cache's own numbers.

Token equality alone is blind to two faults: a load-back that puts the right pages in the
wrong order (attention over a set of keys ignores their order) and a prefill that recomputes
the cached prefix (``RequestResult.prefill_tokens`` is derived from the cached counts). So:

* ``StepSpy`` wraps the engine's model runner and records what each model step computes: the
  prompt tokens of every prefill (counted from the tokens passed to the model, not from the
  cache) and, when a prompt's prefill ends, the bytes of the pages its page table names for
  the matchable prefix, per layer and component, in page-table order. The pages a request was
  served from after an L1, L2 or L3 hit must equal, byte for byte, those of the cold run.
* ``LayerByLayer`` wraps the transfer engine's loads: the real copy lands, then the loaded
  pages are overwritten with garbage on every layer and layer ``l``'s true bytes go back only
  when the handle is asked to wait for it, after layer ``l - 1``. A model step that reads a
  loaded page before its layer was released is recorded (and would read garbage).

Each probe is also shown catching the fault it is for (``test_probes_catch_*``).
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from hicache_jax.engine import Engine, EngineCacheConfig
from hicache_jax.reference_model import ModelConfig
from hicache_jax.storage.config import StorageConfig
from hicache_jax.transfer import LoadHandle

PAGE, PROMPT, NEW = 4, 42, 3
PREFIX_PAGES = (PROMPT - 1) // PAGE  # the match covers at most PROMPT - 1 tokens, whole pages
CACHED = PREFIX_PAGES * PAGE


def _prompts(seed: int, n: int = 3) -> list[list[int]]:
    # Distinct prompts: every run computes each prompt's KV from position 0 in the same chunks,
    # so the pages a hit serves were computed exactly as the cold run's (byte-identical).
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 512, PROMPT).tolist() for _ in range(n)]


def _engine(attention: str, tmp_path, layers: int = 2) -> Engine:
    model = ModelConfig(attention=attention, num_layers=layers, hidden=32, ffn=64)
    storage = StorageConfig(
        backend="file", path=str(tmp_path / "l3"), prefetch_policy="wait_complete", prefetch_threshold_tokens=8
    )
    return Engine(
        model,
        EngineCacheConfig(
            page_size=PAGE, device_pages=64, max_batch=2, prefill_chunk=16, max_context=64, storage=storage
        ),
    )


class StepSpy:
    """Stands in for ``engine.runner``; see the module docstring. All prompts of a run have
    ``PROMPT`` tokens, so a step entry at positions below ``PROMPT`` is a prefill chunk and one
    ending at ``PROMPT`` ends that prompt's prefill (prefills run one at a time, in order)."""

    def __init__(self, engine: Engine) -> None:
        self.engine, self.inner = engine, engine.runner
        engine.runner = self
        self.before_step = None  # called with the step's page tables before it runs
        self.take()

    def take(self) -> tuple[list[int], int, list[dict[str, np.ndarray]]]:
        """(prompt tokens computed per prefill, decode tokens computed, served prefix pages)
        since the last call."""
        out = getattr(self, "prefill", []), getattr(self, "decode", 0), getattr(self, "served", [])
        self.prefill, self.decode, self.served, self._open = [], 0, [], 0
        return out

    def warmup(self, *args, **kwargs):
        return self.inner.warmup(*args, **kwargs)

    def step(self, pools, tokens, starts, page_tables, min_t: int = 1):
        if self.before_step is not None:
            self.before_step(page_tables)
        logits, new = self.inner.step(pools, tokens, starts, page_tables, min_t)
        dtype = self.engine.geom.container_dtype
        for ts, start, table in zip(tokens, starts, page_tables):
            if start >= PROMPT:
                self.decode += len(ts)
                continue
            self._open += len(ts)
            if start + len(ts) == PROMPT:
                self.prefill.append(self._open)
                self._open = 0
                ids = np.asarray(table[:PREFIX_PAGES])
                self.served.append(
                    {c: np.stack([np.asarray(a[ids]) for a in layers]).view(dtype) for c, layers in new.items()}
                )
        return logits, new


def _check_served(served, cold) -> list[str]:
    """Mismatches between served and cold prefix pages, per request, component and layer."""
    bad = []
    assert len(served) == len(cold)
    for i, (got, want) in enumerate(zip(served, cold)):
        for c in want:
            for layer in range(want[c].shape[0]):
                if not np.array_equal(got[c][layer], want[c][layer]):
                    bad.append(f"request {i} {c} layer {layer}")
    return bad


def _check_computed(spy: StepSpy, results, cached: int) -> None:
    """The model computed exactly the uncached prompt tokens (counted at the model), and the
    engine's own numbers agree."""
    prefill, decode, _ = spy.last
    assert prefill == [PROMPT - cached] * len(results)
    assert decode == sum(len(r.tokens) - 1 for r in results)
    for r in results:
        assert r.cached_total == cached and r.prefill_tokens == PROMPT - cached, r


def _run(engine: Engine, spy: StepSpy, prompts, **kwargs):
    spy.take()
    res = engine.generate(prompts, NEW, **kwargs)
    spy.last = spy.take()
    return res


@pytest.mark.parametrize("attention", ["mha", "mla"])
def test_served_pages_and_computed_tokens_per_tier(attention, tmp_path):
    engine = _engine(attention, tmp_path)
    spy = StepSpy(engine)
    prompts = _prompts(1)
    cold = _run(engine, spy, prompts, use_cache=False)
    _check_computed(spy, cold, 0)
    cold_pages = spy.last[2]
    warm = _run(engine, spy, prompts)  # distinct prompts: nothing cached yet
    _check_computed(spy, warm, 0)
    assert _check_served(spy.last[2], cold_pages) == []
    tiers = {}
    l1 = _run(engine, spy, prompts)
    _check_computed(spy, l1, CACHED)
    tiers["device"] = (l1, spy.last[2])
    engine.evict_device_cache()
    l2 = _run(engine, spy, prompts)
    _check_computed(spy, l2, CACHED)
    tiers["host"] = (l2, spy.last[2])
    engine.close()  # every L3 write done
    fresh = _engine(attention, tmp_path)  # L1 and L2 empty: the prefixes come from L3
    spy = StepSpy(fresh)
    l3 = _run(fresh, spy, prompts)
    _check_computed(spy, l3, CACHED)
    tiers["storage"] = (l3, spy.last[2])
    for tier, (res, served) in tiers.items():
        assert [r.tokens for r in res] == [r.tokens for r in cold], tier
        assert all(r.cached_tokens[tier] == CACHED for r in res), (tier, res)
        assert _check_served(served, cold_pages) == [], tier
    fresh.cache.flush()
    fresh.cache.sanity_check(0)
    fresh.close()


def test_probes_catch_a_permuted_load_back_and_a_recomputed_prefix(tmp_path):
    """The faults the token check cannot see, each seen by its probe."""
    engine = _engine("mha", tmp_path)
    spy = StepSpy(engine)
    prompts = _prompts(2, n=2)
    cold = _run(engine, spy, prompts, use_cache=False)
    cold_pages = spy.last[2]
    engine.generate(prompts, NEW)

    # A prefill that recomputes the cached prefix: the engine's numbers still claim the hit.
    prefill = engine._prefill

    def recompute(seq):
        cached, seq.cached = seq.cached, {k: 0 for k in seq.cached}
        prefill(seq)
        seq.cached, seq.computed = cached, len(seq.prompt) - sum(cached.values())

    engine._prefill = recompute
    res = _run(engine, spy, prompts)
    del engine._prefill
    assert [r.tokens for r in res] == [r.tokens for r in cold]
    assert all(r.prefill_tokens == r.prompt_len - r.cached_total for r in res)  # the old check: blind
    with pytest.raises(AssertionError):
        _check_computed(spy, res, CACHED)
    assert spy.last[0] == [PROMPT] * len(prompts)

    # A load-back that lands the right pages in reverse order.
    engine.evict_device_cache()
    load = engine.transfer.load_owned
    engine.transfer.load_owned = lambda h, d: load(h, d[::-1].copy())
    res = _run(engine, spy, prompts)
    del engine.transfer.load_owned
    # (The tokens are typically still the cold run's: attention ignores the keys' order.)
    assert all(r.cached_tokens["host"] == CACHED for r in res)
    _check_computed(spy, res, CACHED)  # nothing recomputed
    bad = _check_served(spy.last[2], cold_pages)
    assert len(bad) == 2 * 2 * len(prompts), bad  # every request, component and layer
    engine.close()


# ---------------------------------------------------------------------------------- per layer
class _Layered(LoadHandle):
    """Layer ``l`` is done only once released, and only after layer ``l - 1``. ``honest=False``:
    a handle that is not per-layer - it tracks layer 0 only and reports every layer done then."""

    def __init__(self, owner: "LayerByLayer", device_ids: np.ndarray, truth: dict, honest: bool) -> None:
        self.owner, self.ids, self.truth, self.honest = owner, device_ids, truth, honest
        self.num_layers = next(iter(truth.values())).shape[0]
        self.released = [False] * self.num_layers

    def _release(self, layer: int) -> None:
        assert layer == 0 or self.released[layer - 1], "layers land in order"
        pool = self.owner.engine.device_pool
        for c, pages in self.truth.items():
            arr = pool.layers(c)[layer]
            pool.set_layer(c, layer, arr.at[self.ids].set(jax.device_put(pages[layer].view(pool.dtype))))
        self.released[layer] = True
        self.owner.log.append(("release", layer))

    def layer_done(self, layer: int) -> bool:
        return self.released[layer if self.honest else 0]

    def wait_layer(self, layer: int, timeout: float | None = None) -> None:
        self.owner.log.append(("wait", layer))
        for l in range(layer + 1 if self.honest else 1):
            if not self.released[l]:
                self._release(l)


class LayerByLayer:
    """Wraps ``engine.transfer.load_owned`` (see the module docstring) and records every model
    step that reads a loaded page of a layer not released yet."""

    def __init__(self, engine: Engine, spy: StepSpy, honest: bool = True) -> None:
        self.engine, self.honest = engine, honest
        self.inner = engine.transfer.load_owned
        engine.transfer.load_owned = self.load_owned
        spy.before_step = self.before_step
        self.handles: list[_Layered] = []
        self.log: list[tuple[str, int]] = []
        self.early_reads: list[tuple[int, int]] = []  # (handle, layer)
        self.rng = np.random.default_rng(0)

    def load_owned(self, host_ids, device_ids) -> LoadHandle:
        self.inner(host_ids, device_ids).wait()
        pool = self.engine.device_pool
        truth = {c: pool.read_pages_host(c, device_ids) for c in pool.geom.components}
        for c, pages in truth.items():  # garbage until each layer is released
            pool.write_pages_host(c, device_ids, self.rng.integers(0, 2**16, pages.shape).astype(pages.dtype))
        self.log.append(("load", len(self.handles)))
        h = _Layered(self, np.asarray(device_ids), truth, self.honest)
        self.handles.append(h)
        return h

    def before_step(self, page_tables) -> None:
        read = np.concatenate([np.asarray(t) for t in page_tables])
        for i, h in enumerate(self.handles):
            if np.isin(h.ids, read).any():
                self.early_reads += [(i, l) for l in range(h.num_layers) if not h.released[l]]
        self.log.append(("step", -1))

    def remove(self) -> None:
        del self.engine.transfer.load_owned
        self.engine.runner.before_step = None


def _loaded_run(engine, spy, prompts, honest):
    engine.evict_device_cache()
    probe = LayerByLayer(engine, spy, honest)
    res = _run(engine, spy, prompts)
    engine.cache.flush()
    probe.remove()
    return probe, res


def test_load_back_is_read_layer_by_layer_only_after_each_layer_landed(tmp_path):
    layers = 3
    engine = _engine("mha", tmp_path, layers=layers)
    spy = StepSpy(engine)
    prompts = _prompts(3, n=2)
    cold = _run(engine, spy, prompts, use_cache=False)
    cold_pages = spy.last[2]
    engine.generate(prompts, NEW)

    probe, res = _loaded_run(engine, spy, prompts, honest=True)
    assert len(probe.handles) == len(prompts)
    assert probe.early_reads == []
    # Each load: waited on layer 0, 1, 2 in turn, each released before the next wait, all
    # before the first step that reads its pages.
    per_layer = [e for l in range(layers) for e in (("wait", l), ("release", l))]
    i = 0
    for h in range(len(prompts)):
        i = probe.log.index(("load", h), i)
        assert probe.log[i + 1 : i + 2 + 2 * layers] == per_layer + [("step", -1)], probe.log
    assert [r.tokens for r in res] == [r.tokens for r in cold]
    assert all(r.cached_tokens["host"] == CACHED for r in res)
    assert _check_served(spy.last[2], cold_pages) == []

    # The probe itself: a handle that is not per-layer (reports every layer done once layer 0
    # is) lets the prefill read layers that have not landed, and serves garbage.
    probe, res = _loaded_run(engine, spy, prompts, honest=False)
    assert probe.early_reads and {l for _, l in probe.early_reads} == set(range(1, layers))
    assert _check_served(spy.last[2], cold_pages) != []
    engine.close()
