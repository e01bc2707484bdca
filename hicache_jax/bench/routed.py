"""``hicache-jax bench multiturn --engines N --router ...``: N reference engines in one process
sharing one L3, requests routed round robin or by the engines' KV events.

Per routing policy (``--router``, both by default) N engines are built (the real model: prefill
and decode run) over one L3 store of their own (``file`` in a fresh directory, the default:
``orbax`` is replaced by ``file``, one writer per directory; ``mooncake``: a local Mooncake
Store per policy, every engine a client of it). Each engine's ``KVEventSource`` (keyed like
its L3 controller) feeds one ``PrefixRouter`` per policy; its L3 writes are storage events.

The trace is ``multiturn``'s (clients x rounds, closed loop or ``--request-rate``), the
clients of a round arriving in a seeded random order (the same for every policy). Rounds
alternate between the policies, so machine noise hits them alike, and every policy is sent
the same prompts: each round's answers extend the histories from the first policy's results
(the other policies' answers are compared with them: ``same_tokens``). In a round:

* ``round_robin``: the k-th request of the run goes to engine ``k mod N``;
* ``prefix``: ``PrefixRouter.route`` on the request's page keys, the round's requests so far
  per engine as the loads (the router's balance fallback); after each round the router's tier
  weights are set from the measured costs (``PrefixRouter.set_measured_weights``: the
  engines' load-back and prefetch durations per token against the service time per token of
  the requests no tier served).

The engines then serve their share one after the other (one process; each engine's TTFT is
measured by the engine itself from the moment it is handed its requests, as if the engines ran
side by side), routing time added to each request's TTFT. At the round's end every engine
flushes its backups to L3 and steps, so the next round's routing sees the L3 writes.

Reported per policy: hit rate and its split per tier, TTFT (mean, p50, p90; measured, not
modeled), queueing and service means, requests per engine, the router's decisions; the ratios
prefix / round robin. Compilation is excluded (each engine is warmed up on other tokens
first). Threading: the benchmark's own thread drives every engine.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from dataclasses import asdict, replace

import numpy as np

from ..cache import RadixKey
from ..cache.event_source import KVEventSource
from ..routing import PrefixRouter
from .report import Progress, machine_info, print_table
from .serving import Conversations, summarize_rounds, Round, build_engine, describe, model_config, resolve_model

POLICIES = ("round_robin", "prefix")


class _PolicyRun:
    """One policy's engines, their L3 store and router (see the module docstring)."""

    def __init__(self, policy: str, args, max_context: int, progress: Progress) -> None:
        self.policy = policy
        self.tmp = self.master = None
        a = argparse.Namespace(**vars(args))
        if a.storage_backend == "mooncake":
            from ..storage.mooncake import MooncakeMaster

            self.master = MooncakeMaster(store_node_bytes=a.mooncake_node_bytes).start()  # a fresh store per policy
            a.mooncake_master, a.mooncake_metadata = self.master.rpc_address, self.master.metadata_url
        elif a.storage_backend != "none":
            a.storage_backend = "file" if a.storage_backend == "orbax" else a.storage_backend
            self.tmp = tempfile.mkdtemp(prefix=f"hicache-routed-{policy}-")
            a.storage_dir = self.tmp
        self.args = a
        self.names = [f"engine-{i}" for i in range(args.engines)]
        self.router = PrefixRouter(self.names)
        self.engines = {}
        self.sources = {}
        self.requests: dict[str, int] = {}  # requests served per engine
        self.route_s: list[float] = []  # routing time per request
        self._rr = 0  # round robin's counter (runs on across rounds, as a router's would)
        self._cold = [0.0, 0]  # service seconds and prompt tokens of the requests no tier served
        try:
            for n in self.names:
                self.engines[n] = build_engine(a, max_context)
                progress.advance(1, f"{policy}: {n} ready")
        except BaseException:
            self.close()  # the engines built so far and the store
            raise

    def warm_and_attach(self, vocab: int) -> None:
        """Throwaway conversations (other tokens) on every engine, a reset of L1 and L2 and of
        the cache's and the store's counters (what ``stats()`` reports, and the router's
        measured weights read, is the timed rounds' alone), then the event sources (their
        first batch: the empty tiers)."""
        warm = argparse.Namespace(
            **{
                **vars(self.args),
                "clients": min(2, self.args.clients),
                "rounds": min(2, self.args.rounds),
                "request_rate": 0,
            }
        )
        for i, (n, engine) in enumerate(self.engines.items()):
            conv = Conversations(warm, vocab, self.args.seed + 1000 + i)
            for _ in range(warm.rounds):
                prompts, _arr = conv.prompts()
                conv.answered(engine.generate(prompts, warm.answer_len))
            engine.flush()
            engine.cache.reset()  # the warm-up's L3 pages use other tokens and never hit
            engine.cache.metrics.reset()
            if engine.storage is not None:  # the store's counters too: the rounds' reads and writes only
                engine.storage.storage.metrics.reset()
            engine.metrics.peak_device_pages = engine.metrics.peak_swa_device_pages = 0
            # With L3 the source takes the model identity from the engine's controller (its keys
            # are the L3's); without, the same identity the controller would have been given.
            ident = (
                {}
                if engine.storage is not None
                else {"model": engine.storage_model_id, "weights_revision": engine.storage_weights_revision}
            )
            src = KVEventSource(engine.cache, engine=n, **ident)
            if engine.storage is not None:
                src.observe_storage(engine.storage.storage)
            src.subscribe(self.router.apply)
            self.sources[n] = src
            engine.cache.check_events()

    def serve_round(self, order: list, prompts: list, arrivals: list, answer_len: int) -> tuple[list, float]:
        """Route the round's prompts in arrival ``order``, serve each engine's share (in that
        order); results in prompt order."""
        names = self.names
        keyer = self.sources[names[0]]
        loads = {n: 0 for n in names}
        assigned = {n: [] for n in names}
        route_s = [0.0] * len(prompts)
        for i in order:
            t0 = time.perf_counter()
            if self.policy == "round_robin":
                name = names[self._rr % len(names)]
                self._rr += 1
            else:
                name = self.router.route(
                    keyer.request_keys(RadixKey(np.asarray(prompts[i][:-1], np.int64))), loads
                ).engine
            route_s[i] = time.perf_counter() - t0
            loads[name] += 1
            assigned[name].append(i)
        results = [None] * len(prompts)
        seconds = 0.0
        for n in names:
            idx = assigned[n]
            if not idx:
                continue
            t0 = time.perf_counter()
            out = self.engines[n].generate([prompts[i] for i in idx], answer_len, arrivals=[arrivals[i] for i in idx])
            seconds += time.perf_counter() - t0
            for i, r in zip(idx, out):
                results[i] = replace(r, ttft_s=r.ttft_s + route_s[i])
                self.requests[n] = self.requests.get(n, 0) + 1
        self.settle()
        self.route_s.extend(route_s)
        if self.policy == "prefix":
            self._measure_weights(results)
        return results, seconds

    def _measure_weights(self, results: list) -> None:
        """The router's tier weights from this run's measured costs: the engines' load-back
        durations and their stores' read time per prefetched token (their ``stats()``, counted
        from the end of the warm-up) against the prefill cost per token of
        the requests no tier served (their service time per prompt token, summed over every
        round so far); the defaults until a cold request and a load were measured."""
        for x in results:
            if x.cached_total == 0:
                self._cold[0] += x.service_s
                self._cold[1] += x.prompt_len
        if self._cold[1]:
            self.router.set_measured_weights(
                [e.cache.stats() for e in self.engines.values()], self._cold[0] / self._cold[1]
            )

    def settle(self) -> None:
        """Every engine's backups reach L3 and its events the router (a round boundary)."""
        for e in self.engines.values():
            e.flush()
        for e in self.engines.values():
            e.cache.check_events()

    def close(self) -> None:
        for src in self.sources.values():
            src.close()
        for e in self.engines.values():
            e.close()
        if self.master is not None:
            self.master.stop()
        if self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)


def multiturn_routed(args) -> dict:
    with Progress("multiturn --engines") as progress:
        return _run(args, progress)


def _run(args, progress: Progress) -> dict:
    policies = list(dict.fromkeys(args.router))
    resolve_model(args)
    model = model_config(args)
    if model.is_hybrid:
        raise ValueError("--model: several engines (--engines > 1) run full-attention models only")
    max_context = args.first_len + args.rounds * (args.turn_len + args.answer_len) + 16
    progress.phase(
        f"building and compiling {args.engines} engines per policy (model {args.model})", args.engines * len(policies)
    )
    runs = []
    try:
        for p in policies:
            runs.append(_PolicyRun(p, args, max_context, progress))
        progress.phase("warm-up (untimed, other tokens)", len(runs))
        for run in runs:
            run.warm_and_attach(model.vocab_size)
            progress.advance(1)
        conv = Conversations(args, model.vocab_size, args.seed)
        rounds = {p: [] for p in policies}
        tokens = {p: [] for p in policies}
        progress.phase(
            f"{args.clients} clients x {args.rounds} rounds over {args.engines} engines, "
            f"{' / '.join(policies)} alternating",
            len(runs) * args.rounds,
        )
        arrival_rng = np.random.default_rng(args.seed + 7)
        for r in range(args.rounds):
            prompts, arrivals = conv.prompts()
            # The round's arrival order (the same for every policy): clients do not come back in
            # a fixed order, so round robin does not keep a client on one engine by accident.
            order = arrival_rng.permutation(len(prompts)).tolist()
            by_client = [0.0] * len(prompts)
            for k, i in enumerate(order):  # the k-th arrival time goes to the k-th client to arrive
                by_client[i] = arrivals[k]
            arrivals = by_client
            first = None
            for run in runs:
                for other in runs:
                    if other is not run:
                        other.settle()  # no other policy's background copies overlap this round
                results, seconds = run.serve_round(order, prompts, arrivals, args.answer_len)
                rounds[run.policy].append(Round(results, seconds))
                tokens[run.policy].extend(x.tokens for x in results)
                first = results if first is None else first
                hit = sum(x.cached_total for x in results) / sum(x.prompt_len for x in results)
                progress.advance(
                    1,
                    f"round {r} {run.policy}: hit {hit:.0%}, TTFT mean "
                    f"{statistics.fmean(x.ttft_s for x in results) * 1e3:,.0f} ms",
                )
            conv.answered(first)  # every policy is sent the same prompts
        summaries = {}
        for run in runs:
            s = summarize_rounds(rounds[run.policy])
            for k in ("ttft_all_s", "ttft_by_round_s", "ttft_by_tier", "service_all_s", "service_by_tier"):
                s.pop(k)
            s["requests_per_engine"] = {n: run.requests.get(n, 0) for n in run.names}
            s["router_decisions"] = dict(run.router.decisions) if run.policy == "prefix" else None
            s["router_weights"] = asdict(run.router.weights) if run.policy == "prefix" else None
            s["route_mean_s"] = statistics.fmean(run.route_s)
            s["storage_events_pages"] = sum(len(v.tiers["storage"]) for v in run.router.views.values())
            summaries[run.policy] = s
    finally:
        for run in runs:
            run.close()
    ref = tokens[policies[0]]
    same = all(tokens[p] == ref for p in policies)
    rows = []
    for p, s in summaries.items():
        per = s["requests_per_engine"].values()
        rows.append(
            [
                p,
                s["requests"],
                s["cache_hit_rate"],
                s["hit_rate_by_tier"]["device"],
                s["hit_rate_by_tier"]["host"],
                s["hit_rate_by_tier"]["storage"],
                s["ttft_mean_s"] * 1e3,
                s["ttft_p50_s"] * 1e3,
                s["ttft_p90_s"] * 1e3,
                s["queue_mean_s"] * 1e3,
                s["service_mean_s"] * 1e3,
                f"{min(per)}-{max(per)}",
                s["route_mean_s"] * 1e6,
            ]
        )
    l3 = (
        "no L3"
        if args.storage_backend == "none"
        else f"one {'file' if args.storage_backend == 'orbax' else args.storage_backend} L3 per policy"
    )
    print_table(
        f"multi-turn over {args.engines} engines ({l3}): {args.clients} clients x {args.rounds} rounds, "
        f"{describe(args)}",
        [
            "router",
            "reqs",
            "hit rate",
            "L1",
            "L2",
            "L3",
            "TTFT mean ms",
            "p50",
            "p90",
            "queue mean",
            "service mean",
            "reqs/engine",
            "route us",
        ],
        rows,
    )
    ratios = None
    if "prefix" in summaries and "round_robin" in summaries:
        px, rr = summaries["prefix"], summaries["round_robin"]
        ratios = {
            "hit_rate": px["cache_hit_rate"] / rr["cache_hit_rate"] if rr["cache_hit_rate"] else None,
            "ttft_mean": px["ttft_mean_s"] / rr["ttft_mean_s"],
            "ttft_p50": px["ttft_p50_s"] / rr["ttft_p50_s"],
        }
        hr = "n/a" if ratios["hit_rate"] is None else f"x{ratios['hit_rate']:.3f}"
        print(
            f"prefix / round_robin (same prompts, alternate rounds): hit rate {hr}, TTFT mean "
            f"x{ratios['ttft_mean']:.3f}, p50 x{ratios['ttft_p50']:.3f}; same tokens: {same}"
        )
    return {
        "benchmark": "multiturn_routed",
        "machine": machine_info(),
        "config": vars(args),
        "policies": summaries,
        "prefix_over_round_robin": ratios,
        "same_tokens": same,
        "loadavg": os.getloadavg(),
        "plot": None,
    }
