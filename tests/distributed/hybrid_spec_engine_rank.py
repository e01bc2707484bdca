"""One rank of the two-process test of speculative decoding of a hybrid (sliding-window) target
(``test_engine_ranks_hybrid_spec``), or the single-process run.

usage: hybrid_spec_engine_rank.py OUT_DIR AGREEMENT DIVERGE [CONTROLS]  (launched: HICACHE_RANK set)
       hybrid_spec_engine_rank.py OUT_DIR single -                       (one process, the reference)

CONTROLS (comma-separated DIVERGE values, e.g. ``swa,calm``): after the run, each rank also runs
the agreement-off control (below) for each, in the same process, writing
OUT_DIR/<control>/rank<r>.json: one launch serves the test and its controls (each launch of the
ranks costs their start-up and compiles).

AGREEMENT: ``kv`` (the coordination service's store) or ``none`` (the agreement-off control:
the same protocol with the exchange switched off, ``NoExchangeAgreement``; every rank acts on
its own values).

The model is the trained toy pair (``load_pair``) with its first layer made a sliding-window
layer (window 12; the full layer still sees the whole pattern of period 32 the pair was trained
on), so the draft's proposals are accepted (accept length ``k + 1``) and every verify step
moves the window by up to ``k + 1 = 5`` tokens, more than a page of 4; a 36-token answer (seven
verify steps) moves the window past the pages the decode itself wrote: the slack
``swa_pages_needed`` adds per decoding request with ranks is two pages, not one. The draft
keeps full attention (its KV is the ``draft`` sidecar on the full pool's ids). The SWA pool is
sized exactly (``Engine.swa_pages_needed`` with ``spec`` and ranks).

A multi-turn workload of repetitive prompts (each client a random 32-token pattern, every turn
continuing it) without L3: the second round's prefixes come from the device (L1); the device
tier is dropped before the last round, so its prefixes come back from the host (L2), windows
and draft pages included. With DIVERGE=swa, rank 1 alone (1) fails every other SWA host
allocation and (2) reports every window slide of a decode round one step late: its
``slide_window(req, written=)`` gets the length the request's previous call reported, as if
its forward pass finished a step after rank 0's (``LateSlides``). Both must leave the ranks'
trees equal: the SWA backups and the slides are agreed. Digests are recorded after every
agreement step (``AfterStepRecorder``) and compared at every exchange (``check_digest``). The
single process also serves every prompt with plain greedy decoding (same weights, no cache,
no speculation) for comparison. ``VerifyLag`` records the most SWA pages a decoding request
held at a verify step only because its slides lagged, beside the slack ``swa_pages_needed``
adds per decoding request with ranks.

With AGREEMENT=none only ``CONTROL_ROUNDS`` rounds run (no tier is read back: with trees that
differ the ranks would step different programs), DIVERGE=swa injects as above and
DIVERGE=calm nothing; then ``flush()`` settles each rank (every backup and load-back
acknowledged, every backup committed or rolled back, every noted slide applied) and a last
digest is recorded. Without the exchange the digests mid-run depend on timing (each rank
acknowledges its own copies as they finish, so the copies in flight and the locks they hold
differ step by step) but the settled state does not: what is compared is the digest after
the flush. Writes OUT_DIR/<rank or single>.json.
"""

from __future__ import annotations

import os
import sys
from dataclasses import replace

import numpy as np

from engine_rank import fail_every  # noqa: E402 - this script's directory is on sys.path
from hybrid_engine_rank import AfterStepRecorder  # noqa: E402
from hybrid_l3_engine_rank import open_ranks, without_exchange, write_with_controls  # noqa: E402
from hicache_jax.engine import Engine, EngineCacheConfig, SpecConfig
from hicache_jax.host_pool import HostPoolConfig
from hicache_jax.reference_model.weights import load_pair

WINDOW, PERIOD = 12, 32
PAGE, K = 4, 4  # a verify step writes k + 1 = 5 positions: more than a page
CLIENTS, ROUNDS, FIRSTS, TURN, ANSWER = 3, 3, (72, 40, 44), 8, 36
CONTROL_ROUNDS = 1  # the agreement-off control: enough for both injections to fire


def hybrid_pair():
    """The toy pair with layer 0 sliding (window ``WINDOW``); same weights."""
    pair = load_pair()
    cfg = replace(pair.config, layer_types="SF", sliding_window=WINDOW)
    return replace(pair, config=cfg)


class LateSlides:
    """Rank 1's injection: inside a decode round, each ``slide_window(req, written=n)`` reports
    the length the request's previous call reported (its forward pass "finished a step later"),
    so rank 1's window slides lag rank 0's by a step. Outside decode rounds (prefill chunks)
    the call goes through unchanged. ``fired["late_slide"]`` counts the calls that reported
    less than they were given."""

    def __init__(self, engine: Engine, fired: dict) -> None:
        self.fired = fired
        self.prev: dict[int, tuple[object, int]] = {}  # id(req) -> (req, length last reported)
        self.decoding = False
        self.slide_window = engine.cache.slide_window
        engine.cache.slide_window = self.slide
        decode_round = engine.spec.decode_round

        def decode(running) -> None:
            self.decoding = True
            try:
                decode_round(running)
            finally:
                self.decoding = False

        engine.spec.decode_round = decode

    def slide(self, req, written: int | None = None) -> None:
        n = len(req.key) if written is None else written
        last = self.prev.get(id(req))
        report = n
        if self.decoding and last is not None and last[0] is req and last[1] < n:
            report = last[1]
            self.fired["late_slide"] += 1
        self.prev[id(req)] = (req, n)
        self.slide_window(req, written=report)


class VerifyLag:
    """The most SWA pages of its own a decoding request still held at a verify step that a
    slide to its whole key frees (pages wholly before the window of its key's whole pages):
    what its slides, agreed and lagging, had not freed yet. Counted before every target step
    of a decode round (the engine's ``before_target_step`` hook, which still runs); 0 in one
    process, where every slide applies at once."""

    def __init__(self, engine: Engine) -> None:
        self.max_pages = 0
        self.inner = engine.spec.before_target_step
        engine.spec.before_target_step = self.before

    def before(self, seqs) -> None:
        for seq in seqs:
            if seq.spec is None or seq.spec.proposals is None:  # prefilling: not a verify step
                continue
            req = seq.req
            n = len(req.key)
            kept = max(0, n // PAGE * PAGE - (WINDOW - 1)) // PAGE  # the first page such a slide keeps
            behind = req.component_pages["swa"][req.cached_pages : kept]
            self.max_pages = max(self.max_pages, int((behind >= 0).sum()))
        if self.inner is not None:
            self.inner(seqs)


def lag_granted_per_decoding_request(model, cfg: EngineCacheConfig, spec: SpecConfig) -> int:
    """SWA pages ``swa_pages_needed`` adds with ranks for each decoding request (the slide
    lag): its growth per extra running request with ranks, less that without."""
    more = replace(cfg, max_batch=cfg.max_batch + 1)

    def per_request(ranks: bool) -> int:
        return Engine.swa_pages_needed(model, more, spec, ranks=ranks) - Engine.swa_pages_needed(
            model, cfg, spec, ranks=ranks
        )

    return per_request(True) - per_request(False)


def workload(engine: Engine, rounds: int) -> tuple[list, list, list, list]:
    """Returns (prompts, tokens, cached tokens by tier, accept lengths) per request."""
    vocab = engine.model_config.vocab_size
    rng = np.random.default_rng(3)
    patterns = [rng.integers(0, vocab, PERIOD) for _ in range(CLIENTS)]
    hist = [np.resize(p, n).tolist() for p, n in zip(patterns, FIRSTS)]
    prompts, tokens, tiers, accepts = [], [], [], []
    for r in range(rounds):
        if r:  # the next turn continues the client's pattern
            for h, p in zip(hist, patterns):
                h.extend(p[(len(h) + i) % PERIOD] for i in range(TURN))
        if r == ROUNDS - 1:
            engine.evict_device_cache()
        batch = [[int(t) for t in h] for h in hist]
        res = engine.generate(batch, ANSWER)
        for h, prompt, x in zip(hist, batch, res):
            h.extend(x.tokens)
            prompts.append(prompt)
            tokens.append(x.tokens)
            tiers.append(x.cached_tokens)
            accepts.append(x.accept_lengths)
    return prompts, tokens, tiers, accepts


def serve(ranks, agreement: str, div: str) -> dict:
    """One run of the workload (the engine built, served, closed): what ``main`` writes."""
    pair = hybrid_pair()
    spec = SpecConfig(num_draft_tokens=K)
    cfg = EngineCacheConfig(
        page_size=PAGE,
        device_pages=256,
        host=HostPoolConfig(ratio=2.0),
        max_batch=CLIENTS,
        prefill_chunk=16,
        max_context=240,
    )
    cfg = replace(cfg, swa_device_pages=Engine.swa_pages_needed(pair.config, cfg, spec, ranks=ranks is not None))
    engine = Engine(pair.config, cfg, spec=spec, weights=pair, ranks=ranks)
    rec = AfterStepRecorder(engine.cache)
    lag = VerifyLag(engine)
    fired = {"swa_host_alloc_fail": 0, "late_slide": 0}
    if ranks is not None:
        engine.cache.step_agreement.add(rec)
        engine.cache.step_agreement.check_digest = agreement != "none"
        if div == "swa" and ranks.rank == 1:
            fail_every(engine.swa.host_allocator, 2, fired, "swa_host_alloc_fail")
            LateSlides(engine, fired)
    control = agreement == "none"
    prompts, tokens, tiers, accepts = workload(engine, CONTROL_ROUNDS if control else ROUNDS)
    settled_swa = None
    if control:
        engine.flush()  # each rank's own copies acknowledged, backups and slides settled
        rec.prepare()
        rec.apply(None)  # the last digest: the settled state
        settled_swa = engine.swa.digest_state()
    out = {
        "tokens": tokens,
        "tiers": tiers,
        "accept_lengths": accepts,
        "digests": rec.digests,
        "fired": fired,
        "slides": engine.cache.stats().get("agreement", {}).get("agreed_slides", 0),
        "swa_allocs_after_agreed_slides": engine.metrics.swa_allocs_after_agreed_slides,
        "verify_lag_pages": lag.max_pages,
        "lag_granted_per_decoding_request": lag_granted_per_decoding_request(pair.config, cfg, spec),
        "settled_swa": settled_swa,
    }
    engine.close()
    if ranks is None:  # plain greedy decoding of the same prompts: what speculation must reproduce
        plain = Engine(pair.config, replace(cfg, swa_device_pages=None), weights=pair)
        out["plain_tokens"] = [r.tokens for r in plain.generate(prompts, ANSWER, use_cache=False)]
        plain.close()
    return out


def main() -> None:
    out_dir, agreement, div = sys.argv[1:4]
    controls = sys.argv[4].split(",") if len(sys.argv) > 4 else []
    ranks, name = open_ranks(agreement)
    write_with_controls(
        out_dir,
        name,
        serve(ranks, agreement, div),
        controls,
        lambda _, control: serve(without_exchange(ranks), "none", control),
    )


if __name__ == "__main__":
    if "HICACHE_RANK" in os.environ:
        from hicache_jax.distributed import run_rank

        run_rank(main)
    else:
        main()
