"""Speculative decoding in the reference engine: an EAGLE-style draft head proposes ``k``
tokens in a chain, the target verifies all of them in one step, greedily. Needs JAX.

Output: exactly the tokens of non-speculative greedy decoding (a proposal is kept only where
it equals the target's argmax at that position; the first mismatch is replaced by the
target's own token, the "bonus"). Accept length of a verify step = accepted proposals + 1.

Draft KV and the cache
    The draft head (``reference_model.draft``) keeps its own paged KV, one layer, in a
    device pool with the target's page ids. With ``SpecConfig.draft_backing`` (the default)
    that pool is the cache's ``draft`` sidecar: every backup, load-back and L3 write/read of
    a target page moves the draft page with the same id in the same operation, and an L3
    hit is published only with its draft pages (``hicache_jax.l3.controller``). With it off
    the draft pool stays on the device, outside the cache: a page that comes back from L2 or
    L3 brings the target's KV and leaves whatever the draft pool held at that page id (the
    failure upstream fixed in sglang #21125; kept as the ablation).

The last cached position (the rule)
    The draft entry at position ``j`` is computed from ``t_{j+1}`` and the target's hidden
    state at ``j``. A cached page's last entry therefore depends on the token *after* the
    page, which a later request need not share. The engine keys the tree by token pairs when
    speculative decoding is on: position ``j``'s key is ``t_j * vocab + t_{j+1}`` (sglang's
    bigram keys for EAGLE). A hit on position ``j`` then implies the same successor, so the
    draft never reads an entry computed with a successor it has not seen, on any tier. What
    follows from the rule:

    * A request caches the positions whose target *and* draft KV are final: ``n - 1`` pairs
      for ``n`` committed tokens, and never past the draft's extend (``SpecState.draft_done``).
      Rejected proposals sit past the committed tokens, so they are never inserted.
    * A prompt of ``L`` tokens matches at most ``L - 1`` pairs, the same as the ``L - 1``
      tokens a plain engine matches (its last token is computed to produce the first output):
      page 1 hits ``L - 1`` positions; page 16 hits ``16 * floor((L - 1) / 16)``; a prompt
      ending mid-page recomputes its tail exactly as without speculation.
    * Two prompts that diverge exactly at a page boundary share one page less than without
      speculation: the boundary page's last draft entry saw the other successor.
    * A spec engine and a plain engine never share tree nodes or L3 pages (the L3 model id
      says so).

Per round (``decode_round``), for a sequence with ``n`` committed tokens whose draft KV is
final below ``n - 1`` and whose proposals ``d_1..d_k`` came out of the previous extend:
verify ``[t_{n-1}, d_1..d_k]`` at positions ``n-1..n-1+k`` (``PagedRunner.step_all``), accept
``a`` proposals, then extend the draft over positions ``n-1..n-1+a`` with the accepted tokens
and the bonus as ``t_{j+1}`` and the verify's hidden states as features; the same program
chains the next ``k`` proposals. After a prefill the extend runs over the uncached prompt
positions (the first output token is the last one's successor).

Pages: besides the ``prompt + max_new - 1`` positions a plain decode writes, a request
writes up to ``2k - 1`` more (the verify's rejected positions and the draft's provisional
chain entries), so admission allocates them and ``max_context`` must hold them.

Hybrid (sliding-window) targets
    The draft keeps full attention: its KV is the ``draft`` sidecar on the *full* pool's page
    ids, so every prefix the tree can serve has its draft KV, on every tier, and the pair-key
    rule is unchanged. (A draft window would need a second pool with its own page ids and the
    SWA component's tombstone / window rules for it, for a one-layer head whose KV is small.)
    The target's steps (prefill chunks and verifies) pass the SWA pools and tables as the
    plain hybrid engine's do. The request's SWA pages (``req.component_pages["swa"]``) cover
    its key; a step writes SWA KV past the key (the verify's ``k`` proposals, a prefill chunk
    whose draft KV is not final yet), so the pages for those positions are allocated ahead
    (``SpecState.swa_ahead``, by logical page after the key's) and handed to the request in
    the ``req.extend(..., {"swa": ...})`` of ``sync_key`` when the key reaches them; rejected
    positions' SWA entries stay in those pages and the next verify overwrites them. After
    every prefill chunk and every round the key is synced and the window slid
    (``HiRadixCache.slide_window``), so a request holds a window's worth of SWA pages plus
    its look-ahead, however long it runs; ``release`` frees the look-ahead at the end.
    Over several ranks the slide is agreed and lags up to a step: a round grows the key by up
    to ``k + 1`` positions, so a decoding request may hold ``ceil((k + 1) / page)`` pages more
    until the next agreement step (``Engine.swa_pages_needed`` with ``ranks`` counts them).

Sharding: the draft pool is built on the target pool's mesh, sharded on the KV-head axis,
and replicated where the draft has fewer KV heads than the mesh has devices
(``JaxDevicePool(replicate_fewer_heads=True)``).

Threading: the engine's scheduler thread (it owns both pools).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .._checks import check_int
from ..allocator import ID_DTYPE
from ..backends.jax import JaxDevicePool, JaxTransferEngine
from ..backends.jax.memory import pinned_host_pool
from ..cache import RadixKey
from ..reference_model import PagedRunner
from ..reference_model.draft import DraftHead, DraftRunner, draft_kv_geometry
from .config import EngineCacheConfig
from .spec_metrics import SpecMetrics

DRAFT_COMPONENT = "draft"
# Pair keys are t_j * vocab + t_{j+1}: they must stay below the tree's token limit (2**32).
MAX_SPEC_VOCAB = 1 << 16


@dataclass(frozen=True)
class SpecConfig:
    """Speculative decoding options (``Engine(..., spec=SpecConfig(...))``).

    * ``num_draft_tokens``: ``k``, proposals per round (chain drafting, one verify step).
    * ``draft_backing``: the draft KV pool is the cache's sidecar and moves with the target
      on every tier (default). False: it stays on the device only (the ablation).
    """

    num_draft_tokens: int = 4
    draft_backing: bool = True

    def __post_init__(self) -> None:
        check_int("num_draft_tokens", self.num_draft_tokens, 1)
        if not isinstance(self.draft_backing, bool):
            raise TypeError(f"draft_backing: expected a bool, got {type(self.draft_backing).__name__}")

    @property
    def extra_positions(self) -> int:
        """Positions a request writes past ``prompt + max_new - 1`` (module docstring)."""
        return 2 * self.num_draft_tokens - 1


@dataclass
class SpecState:
    """One request's speculative decoding state."""

    draft_done: int = 0  # positions [0, draft_done) hold final draft KV
    proposals: np.ndarray | None = None  # d_1..d_k for the next verify
    accept_lengths: list[int] = field(default_factory=list)  # per verify step, bonus included
    proposal_log: list[list[int]] = field(default_factory=list)  # every verified proposal chain
    # Hybrid targets: SWA pages for the logical pages after the request's own (allocated for
    # positions a step writes past the key; ``sync_key`` moves them into the request).
    swa_ahead: np.ndarray = field(default_factory=lambda: np.zeros(0, ID_DTYPE))

    @property
    def accept_length(self) -> float | None:
        return float(np.mean(self.accept_lengths)) if self.accept_lengths else None


def pair_key(tokens: np.ndarray, n: int, vocab: int) -> RadixKey:
    """The tree key of positions ``[0, n)``: ``t_j * vocab + t_{j+1}`` (needs ``n + 1`` tokens)."""
    t = np.asarray(tokens[: n + 1], np.int64)
    if t.shape[0] < n + 1:
        raise ValueError(f"tokens: {n} pair keys need {n + 1} tokens, got {t.shape[0]}")
    return RadixKey(t[:-1] * vocab + t[1:])


class SpecDecoder:
    """The draft pool and head, and the speculative prefill / decode round of the engine."""

    def __init__(
        self,
        config: SpecConfig,
        runner: PagedRunner,
        device_pool: JaxDevicePool,
        cache_config: EngineCacheConfig,
        host_pages: int,
        copy_config,
        head: DraftHead | None = None,
    ) -> None:
        if not isinstance(config, SpecConfig):
            raise TypeError(f"spec: expected a SpecConfig, got {type(config).__name__}")
        model_config = runner.config
        if model_config.vocab_size > MAX_SPEC_VOCAB:
            raise ValueError(
                f"spec: speculative decoding keys the tree by token pairs, which needs vocab_size "
                f"<= {MAX_SPEC_VOCAB}, got {model_config.vocab_size}"
            )
        self.config = config
        self.k = config.num_draft_tokens
        self.vocab = model_config.vocab_size
        self.runner = runner
        self.target_pool = device_pool
        self.page_size = runner.page_size
        geom = draft_kv_geometry(model_config, self.page_size)
        # Same page count as the target's pool, and no allocator of its own: page i of the
        # draft pool belongs to whoever holds page i of the target's. Same mesh (module docstring).
        self.device_pool = JaxDevicePool(
            geom,
            device_pool.num_pages,
            mesh=device_pool.mesh,
            kv_axis=device_pool.kv_axis or "tp",
            replicate_fewer_heads=True,
        )
        self.transfer = None
        if config.draft_backing:
            host = pinned_host_pool(
                self.device_pool.local_geom, host_pages, cache_config.host.layout, device=self.device_pool.local_device
            )
            self.transfer = JaxTransferEngine(
                self.device_pool, host, copy_config=copy_config, worker_nice=cache_config.worker_nice
            )
            self.transfer.precompile()
        self.draft = DraftRunner(runner, head)
        self.metrics = SpecMetrics(max_accept_length=self.k + 1)
        # Hybrid targets (``attach_swa``): the SWA pool, the engine's SWA allocation and slide.
        self.swa_pool: JaxDevicePool | None = None
        self._alloc_swa = self._slide = None
        # Called with the stepping requests before every target step, their pages allocated
        # (the engine samples its peak page counts there); None: nothing.
        self.before_target_step = None

    def attach_swa(self, swa_pool: JaxDevicePool, alloc, slide) -> None:
        """Hybrid targets: the SWA device pool, ``alloc(n) -> ids`` (the engine's SWA page
        allocation: evicts, or raises when there is no room) and ``slide(reqs)`` (the cache's
        window slide for each request)."""
        if not self.runner.config.is_hybrid:
            raise ValueError("swa_pool: the target has no sliding-window layer")
        self.swa_pool, self._alloc_swa, self._slide = swa_pool, alloc, slide

    def release(self, seq) -> None:
        """Free the request's look-ahead SWA pages (finished, abandoned or failed requests)."""
        state = seq.spec
        if state is not None and state.swa_ahead.size:
            self.swa_pool.allocator.free(state.swa_ahead)
            state.swa_ahead = np.zeros(0, ID_DTYPE)

    @property
    def sidecars(self) -> dict | None:
        """The cache's sidecar engines: the draft pool's with draft backing, else none."""
        return {DRAFT_COMPONENT: self.transfer} if self.transfer is not None else None

    def wait_load(self, load) -> None:
        """Wait for the draft pages of a load-back (``LoadBackResult``) before the draft reads
        them (the engine waits for the target's layers; a JAX load is also ordered by data)."""
        handles = getattr(load.handle, "handles", None)
        if handles is not None and DRAFT_COMPONENT in handles:
            handles[DRAFT_COMPONENT].wait_layer(0)

    # ---- keys and pages -------------------------------------------------------------------
    def key(self, tokens: np.ndarray, n: int) -> RadixKey:
        return pair_key(tokens, n, self.vocab)

    @staticmethod
    def table(seq) -> np.ndarray:
        """The request's page table: its pages so far, then its reserve (position order)."""
        return np.concatenate([seq.req.device_pages, seq.reserve])

    def sync_key(self, seq) -> None:
        """Grow the request's key to the positions whose target and draft KV are final."""
        tokens = seq.all_tokens
        n = min(seq.spec.draft_done, tokens.shape[0] - 1)
        req = seq.req
        if n <= len(req.key):
            return
        need = -(-n // self.page_size) - req.device_pages.shape[0]
        pages, seq.reserve = seq.reserve[:need], seq.reserve[need:]
        if self.swa_pool is None:
            req.extend(self.key(tokens, n), pages)
            return
        # Every position of the new key was written by a target step, into look-ahead pages.
        ahead = seq.spec.swa_ahead
        if ahead.shape[0] < need:
            raise RuntimeError(
                f"speculative decoding: {need} SWA pages wanted for the key, {ahead.shape[0]} allocated ahead"
            )
        seq.spec.swa_ahead = ahead[need:]
        req.extend(self.key(tokens, n), pages, {"swa": ahead[:need]})

    def _swa_table(self, seq, end: int) -> np.ndarray:
        """Hybrid targets: the request's SWA page table for a step writing positions up to
        ``end``: its own entries (the key's pages), then its look-ahead pages, allocated here
        for the logical pages up to ``end`` that neither covers yet."""
        req, state = seq.req, seq.spec
        have = req.device_pages.shape[0]
        own = req.component_pages.get("swa") if req.component_pages else None
        if own is None:
            own = np.full(have, -1, ID_DTYPE)
        short = -(-end // self.page_size) - have - state.swa_ahead.shape[0]
        if short > 0:
            state.swa_ahead = np.concatenate([state.swa_ahead, self._alloc_swa(short)]).astype(ID_DTYPE)
        return np.concatenate([own, state.swa_ahead])

    # ---- model steps ----------------------------------------------------------------------
    # Both steps donate their pool's arrays; ``apply`` installs the ones they return.
    def _target(self, seqs, tokens, starts, tables, swa_tables=None):
        if self.before_target_step is not None:
            self.before_target_step(seqs)
        if self.swa_pool is None:

            def step(pools):
                logits, hidden, new = self.runner.step_all(pools, tokens, starts, tables)
                return (logits, hidden), new

            return self.target_pool.apply(step)

        def both(pools):  # hybrid: both pools donated, both installed
            def swa(swa_pools):
                logits, hidden, new, new_swa = self.runner.step_all(
                    pools, tokens, starts, tables, swa_pools=swa_pools, swa_page_tables=swa_tables
                )
                return ((logits, hidden), new), new_swa

            return self.swa_pool.apply(swa)

        return self.target_pool.apply(both)

    def _draft(self, next_tokens, features, starts, tables, num_proposals: int) -> np.ndarray:
        return self.device_pool.apply(self.draft.step, next_tokens, features, starts, tables, num_proposals)

    def prefill(self, seq, start: int, chunk: int) -> int:
        """Prefill ``seq.prompt[start:]`` (target, then draft per chunk); returns the first
        output token. The draft's KV below ``start`` is the cache's (the pair-key rule)."""
        prompt = seq.prompt
        n = prompt.shape[0]
        table = self.table(seq)
        seq.spec = state = SpecState(draft_done=start)
        first = None
        hybrid = self.swa_pool is not None
        while start < n:
            end = min(n, start + chunk)
            swa = [self._swa_table(seq, end)] if hybrid else None
            logits, hidden = self._target([seq], [prompt[start:end].tolist()], [start], [table], swa)
            if end == n:
                first = int(np.argmax(logits[0, end - start - 1]))
            nxt = prompt[start + 1 : end].tolist() + [int(prompt[end]) if end < n else first]
            props = self._draft([nxt], [hidden[0, : end - start]], [start], [table], self.k if end == n else 0)
            state.draft_done = end
            if hybrid:  # the window moves with every chunk: SWA pages behind it go back now
                self.sync_key(seq)
                self._slide([seq.req])
            start = end
        state.proposals = props[0]
        return first

    def decode_round(self, running: list) -> None:
        """One verify step for every running sequence, then the draft's extend + next proposals."""
        k = self.k
        tables = [self.table(s) for s in running]
        starts = [s.prompt.shape[0] + len(s.out) - 1 for s in running]
        tokens = [[s.out[-1]] + s.spec.proposals.tolist() for s in running]
        swa = None
        if self.swa_pool is not None:  # the verify writes k + 1 positions from the start
            swa = [self._swa_table(s, st + k + 1) for s, st in zip(running, starts)]
        logits, hidden = self._target(running, tokens, starts, tables, swa)
        greedy = np.argmax(logits[:, : k + 1], axis=-1)
        ext_tokens, ext_features = [], []
        for i, s in enumerate(running):
            d, g = s.spec.proposals, greedy[i]
            a = int(np.argmax(np.append(d != g[:k], True)))  # leading matches: the first mismatch
            emitted = d[:a].tolist() + [int(g[a])]
            s.spec.accept_lengths.append(a + 1)
            s.spec.proposal_log.append(d.tolist())
            self.metrics.observe_step(k, a)
            s.out.extend(emitted[: s.max_new - len(s.out)])
            ext_tokens.append(emitted)
            ext_features.append(hidden[i, : a + 1])
        props = self._draft(ext_tokens, ext_features, starts, tables, k)
        for i, s in enumerate(running):
            s.spec.draft_done = starts[i] + len(ext_tokens[i])
            s.spec.proposals = props[i]
            self.sync_key(s)
        if self.swa_pool is not None:
            self._slide([s.req for s in running])

    def finish(self, seq) -> dict:
        """The request's speculative results (``RequestResult`` fields); counts it. Frees its
        look-ahead SWA pages."""
        self.release(seq)
        state = seq.spec
        mean = state.accept_length if state is not None else None
        if mean is not None:
            self.metrics.observe_request(mean)
        return {
            "accept_lengths": list(state.accept_lengths) if state else [],
            "accept_length": mean,
            "draft_proposals": [list(p) for p in state.proposal_log] if state else [],
        }

    def warmup(self, max_batch: int, chunk: int) -> None:
        """Compile the verify / prefill programs with every position's outputs, and the
        draft's extend + chain programs, for every shape serving uses."""
        # Verify steps (k + 1 tokens), and one-token steps (a prompt's last chunk of one token).
        for tokens in (self.k + 1, 1):
            if self.swa_pool is None:
                self.target_pool.apply(
                    lambda pools: (
                        None,
                        self.runner.warmup(pools, max_batch, chunk, all_positions=True, decode_tokens=tokens),
                    )
                )
                continue

            def both(pools, tokens=tokens):  # hybrid: the SWA pool is compiled in too
                def swa(swa_pools):
                    return self.runner.warmup(
                        pools, max_batch, chunk, swa_pools=swa_pools, all_positions=True, decode_tokens=tokens
                    )

                return None, self.swa_pool.apply(swa)

            self.target_pool.apply(both)
        # Draft: prefill chunks (extend only, or extend + proposals for the last one) and decode
        # rounds (an extend of 1 .. k + 1 tokens, then the chain).
        bucket = self.runner.token_bucket
        shapes = {(1, bucket(t), p) for t in (*self.runner.token_buckets, 1) if t <= chunk for p in (0, self.k)}
        shapes |= {(1, bucket(chunk), p) for p in (0, self.k)}
        shapes |= {
            (self.runner.batch_bucket(b), bucket(t), self.k) for b in range(1, max_batch + 1) for t in (1, self.k + 1)
        }
        self.device_pool.apply(lambda pools: (None, self.draft.warmup(pools, sorted(shapes))))

    def close(self) -> None:
        if self.transfer is not None:
            self.transfer.close()
