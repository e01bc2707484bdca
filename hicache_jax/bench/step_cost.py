"""The cache's CPU cost per scheduler step at scale: ``hicache-jax bench step-cost``.

A simulated scheduler (no model, no JAX: the numpy backend, write-through backups issued as
requests insert, a ``KVEventSource`` subscribed so the page keys and event batches are paid
for; ``--events off`` attaches none) runs ``--in-flight`` requests in every decode step, as
an engine whose batch bound is that many. Each step mirrors the reference engine's
``_schedule`` (``hicache_jax.engine.engine``), call for call:

* admit ``--finishes-per-step`` new requests: ``peek_prefix`` (the engine's room check),
  ``begin_request`` (match, load back a host hit, lock), ``alloc_device`` for the prompt and
  the decode tokens, ``req.extend`` with the prompt's pages, then, the prefill done,
  ``cache_unfinished_req`` (the prompt's pages become shareable and are backed up);
* one decode token for every running request: ``req.append`` with that token (and a page of
  its reserve when the token starts a page; O(1): the key is joined when the request inserts);
* the ``--finishes-per-step`` oldest requests finish: ``cache_finished_req`` and the unused
  reserve back to the allocator;
* ``check_events`` once (backups acknowledged, the step's KV event batch delivered; the
  events themselves, with their page keys, are built as the tree stores and removes nodes,
  inside the calls above).

Prompts: a quarter of the new conversations start with one of 8 shared system prompts
(``--prompt-len`` / 4 tokens), the rest of the prompt is their own; half the admissions are
follow-up turns of a finished conversation (its prompt and answer plus ``--prompt-len`` / 4
new tokens, up to twice ``--prompt-len``), so requests hit cached prefixes on the device and
on the host. The pools hold about 1.25x what the running requests need (host: 2x the device),
so by the end of the warm-up the device and host tiers are full and every step evicts.

Measured: process CPU time (``time.process_time``: every thread of the process; the numpy
backend copies on the calling thread) and wall time of the cache calls, per step, over
``--steps`` steps after ``--warmup-steps``; the simulated engine's own work (random tokens,
its queues) is outside the timed blocks. Then ``--profile-steps`` more steps under cProfile
(enabled around the same cache calls only) give the top functions by own and cumulative time.
The goal (the issue's acceptance figure): <= 1 ms of CPU per scheduler step per 64 finishes at
512 requests in flight.
"""

from __future__ import annotations

import os
import platform
import time
from collections import deque
from typing import TYPE_CHECKING

from .options import (
    STEP_COST_GOAL_FINISHES as GOAL_FINISHES,
    STEP_COST_GOAL_IN_FLIGHT as GOAL_IN_FLIGHT,
    pages_for as _pages_for,
    step_cost_device_pages as _device_pages,
    step_cost_max_conversation as _max_conversation,
    step_cost_max_new as _max_new,
)
from .report import percentile

if TYPE_CHECKING:
    import cProfile

NAME = "step-cost"
GOAL_CPU_MS = 1.0  # the acceptance figure: CPU ms per scheduler step per GOAL_FINISHES at GOAL_IN_FLIGHT
SYSTEM_PROMPTS = 8  # shared system prompts (prompt_len // 4 tokens each)
SYSTEM_SHARE = 0.25  # fraction of new conversations that start with one
FOLLOW_UP = 0.5  # fraction of admissions that continue a finished conversation
HOST_RATIO = 2.0  # host pool / device pool
VOCAB = 32000
TOP = 15  # profile rows


# ------------------------------------------------------------------------------ the run
def run(args) -> dict:
    from .report import Progress

    with Progress(NAME) as progress:
        return _run(args, progress)


class _Clock:
    """Process CPU and wall time of the cache calls, per phase, for the current step."""

    PHASES = ("admit", "decode", "finish", "events")

    def __init__(self) -> None:
        self.cpu = dict.fromkeys(self.PHASES, 0)
        self.wall = dict.fromkeys(self.PHASES, 0)
        self.profile: cProfile.Profile | None = None
        self._phase = ""
        self._c0 = self._w0 = 0
        # Wall time per cache call kind (``lap``: perf_counter, cheap enough to take per call;
        # process_time is a system call, taken at the phase boundaries only).
        self.calls: dict[str, list[int]] = {}  # name -> [ns, calls]
        self._mark = 0

    def mark(self) -> None:
        self._mark = time.perf_counter_ns()

    def lap(self, name: str, calls: int = 1) -> None:
        """Wall time since the last ``mark`` / ``lap`` goes to ``name`` (``calls`` calls of it)."""
        now = time.perf_counter_ns()
        c = self.calls.get(name)
        if c is None:
            c = self.calls[name] = [0, 0]
        c[0] += now - self._mark
        c[1] += calls
        self._mark = now

    def start(self, phase: str) -> None:
        self._phase = phase
        if self.profile is not None:
            self.profile.enable()
        self._w0 = time.perf_counter_ns()
        self._c0 = time.process_time_ns()

    def stop(self) -> None:
        c1 = time.process_time_ns()
        w1 = time.perf_counter_ns()
        if self.profile is not None:
            self.profile.disable()
        self.cpu[self._phase] += c1 - self._c0
        self.wall[self._phase] += w1 - self._w0

    def take(self) -> tuple[dict, dict]:
        out = dict(self.cpu), dict(self.wall)
        self.cpu = dict.fromkeys(self.PHASES, 0)
        self.wall = dict.fromkeys(self.PHASES, 0)
        return out


class _Seq:
    __slots__ = ("tokens", "prompt_len", "n", "req", "reserve")

    def __init__(self, tokens, prompt_len: int) -> None:
        self.tokens = tokens  # prompt + every token it may generate (drawn up front, untimed)
        self.prompt_len = prompt_len
        self.n = prompt_len + 1  # tokens so far: the prompt and the prefill's first output
        self.req = None
        self.reserve = None


class _Sim:
    """The simulated engine: the reference engine's call sequence on a numpy-backed cache."""

    def __init__(self, args, clock: _Clock) -> None:
        import numpy as np

        from ..backends.numpy_backend import make_numpy_backend
        from ..cache import HiCacheConfig, HiRadixCache, RadixKey
        from ..cache.event_source import KVEventSource
        from ..kv_geometry import KVGeometry

        self.np, self.RadixKey = np, RadixKey
        self.args, self.clock = args, clock
        self.page = args.page_size
        self.max_new = _max_new(args)
        self.rng = np.random.default_rng(args.seed)
        # The smallest KV the pools take: the copies the numpy backend makes when a backup or a
        # load-back is issued stay negligible next to the bookkeeping measured here.
        self.geom = KVGeometry.mha(1, args.page_size, 1, 1, "float16")
        self.device_pages = _device_pages(args)
        self.host_pages = int(HOST_RATIO * self.device_pages)
        device, host, engine = make_numpy_backend(self.geom, self.device_pages, self.host_pages)
        self.allocator = device.allocator
        self.no_pages = np.zeros(0, np.int32)
        self.cache = HiRadixCache(
            HiCacheConfig(page_size=args.page_size, write_policy="write_through"), engine, device.allocator
        )
        self.event_counts: dict[str, int] = {}
        self.batches = 0
        self.events = None
        if args.events == "on":
            self.events = KVEventSource(self.cache, model="bench-step-cost", engine="engine-0")
            self.events.subscribe(self._sink)
        sys_len = args.prompt_len // 4
        self.systems = [self._tokens(sys_len) for _ in range(SYSTEM_PROMPTS)]
        self.running: deque[_Seq] = deque()
        self.follow_ups: deque = deque()  # finished conversations' tokens, a follow-up may continue
        self.admitted = self.finished = self.follow_ups_sent = 0
        self.flushes = 0  # admissions short of room that waited for the copies (the engine's flush)

    def _sink(self, batch) -> None:
        """The subscriber: counts the events (a router would index them; that is its cost)."""
        self.batches += 1
        for e in batch.events:
            self.event_counts[e.kind] = self.event_counts.get(e.kind, 0) + 1

    def _tokens(self, n: int):
        return self.rng.integers(0, VOCAB, n, dtype=self.np.int64)

    def _prompt(self):
        """The next prompt: a follow-up turn of a finished conversation, or a new one."""
        np, args = self.np, self.args
        turn = args.prompt_len // 4
        while self.follow_ups and self.rng.random() < FOLLOW_UP:
            prev = self.follow_ups.popleft()
            if prev.shape[0] + turn <= _max_conversation(args):
                self.follow_ups_sent += 1
                return np.concatenate([prev, self._tokens(turn)])
        if self.rng.random() < SYSTEM_SHARE:
            system = self.systems[int(self.rng.integers(SYSTEM_PROMPTS))]
            return np.concatenate([system, self._tokens(args.prompt_len - system.shape[0])])
        return self._tokens(args.prompt_len)

    # -------------------------------------------------------------- one scheduler step
    def step(self, admit: int, finish: int) -> None:
        np, cache, RadixKey, page, clock = self.np, self.cache, self.RadixKey, self.page, self.clock
        # The engine's side: the new requests' tokens (prompt and what they will generate).
        new = []
        for _ in range(admit):
            prompt = self._prompt()
            new.append(_Seq(np.concatenate([prompt, self._tokens(self.max_new)]), prompt.shape[0]))
        # Admissions (engine._admit / _match, the prefill, cache_unfinished_req).
        clock.start("admit")
        lap = clock.lap
        for seq in new:
            clock.mark()
            n = seq.prompt_len
            tokens = seq.tokens
            prompt = tokens[:n]
            key = RadixKey(prompt[: n - 1])  # the last prompt token is always computed
            total = _pages_for(n + self.max_new - 1, page)
            on_device, _ = cache.peek_prefix(key)
            if total - on_device // page > self.allocator.available + cache.evictable_tokens // page:
                cache.flush()  # the engine's wait for copies before a match short of room
                self.flushes += 1
            lap("RadixKey + peek_prefix")
            req, load = cache.begin_request(key)
            if load is not None:
                for layer in range(self.geom.num_layers):
                    load.wait_layer(layer)  # the prefill would wait for the loaded layers
            hit = req.device_pages.shape[0] * page
            req.key = RadixKey(prompt[:hit])
            lap("begin_request (match, load back, lock)")
            pages = cache.alloc_device(total - req.device_pages.shape[0])
            lap("alloc_device")
            if pages is None:
                raise RuntimeError(
                    f"bench step-cost: the device pool ({self.device_pages} pages) could not give "
                    f"{total - req.device_pages.shape[0]} pages; the pool sizing is wrong"
                )
            prompt_pages = _pages_for(n, page) - req.device_pages.shape[0]
            req.extend(RadixKey(prompt), pages[:prompt_pages])
            seq.reserve = pages[prompt_pages:]
            seq.req = req
            lap("RadixKey + req.extend (prompt)")
            cache.cache_unfinished_req(req)  # the prompt's pages are shareable (and backed up) now
            lap("cache_unfinished_req (insert, backup issue, events)")
        clock.stop()
        self.running.extend(new)
        self.admitted += len(new)
        # One decode step (engine._decode_step): every running request's newest token enters the KV.
        clock.start("decode")
        clock.mark()
        none = self.no_pages
        for seq in self.running:
            req = seq.req
            n = seq.n
            need = _pages_for(n, page) - req.device_pages.shape[0]
            grow = none
            if need:
                grow, seq.reserve = seq.reserve[:need], seq.reserve[need:]
            req.append([int(seq.tokens[n - 1])], grow)
        lap("req.append (decode token)", len(self.running))
        clock.stop()
        for seq in self.running:
            seq.n += 1  # the step's output token
        # The oldest requests finish (engine._finish).
        done = [self.running.popleft() for _ in range(min(finish, len(self.running)))]
        clock.start("finish")
        clock.mark()
        for seq in done:
            cache.cache_finished_req(seq.req)
            lap("cache_finished_req (insert, backup issue, events, unlock)")
            if seq.reserve.size:
                self.allocator.free(seq.reserve)
            lap("allocator.free (unused reserve)")
        clock.stop()
        self.finished += len(done)
        for seq in done:
            self.follow_ups.append(seq.tokens[: seq.n])  # the conversation so far: prompt and answer
        while len(self.follow_ups) > 4 * self.args.in_flight:
            self.follow_ups.popleft()
        clock.start("events")
        clock.mark()
        cache.check_events()
        lap("check_events (acks, event batch delivered)")
        clock.stop()


def _summary(values: list[float]) -> dict:
    return {
        "median": percentile(values, 50),
        "p90": percentile(values, 90),
        "p99": percentile(values, 99),
        "mean": sum(values) / len(values) if values else float("nan"),
        "max": max(values, default=float("nan")),
    }


def _where(filename: str) -> str:
    """A profile row's file, relative to the package (or the standard library)."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # hicache_jax/
    full = os.path.abspath(filename) if not filename.startswith("<") else filename
    if full.startswith(here + os.sep):
        return "hicache_jax/" + os.path.relpath(full, here)
    return os.path.basename(filename) if filename and not filename.startswith("<") else filename


def _profile_rows(prof: cProfile.Profile, steps: int) -> dict[str, list[dict]]:
    """The top functions by own time and by cumulative time, per scheduler step."""
    import pstats

    stats = pstats.Stats(prof).stats  # (file, line, name) -> (primitive calls, calls, tottime, cumtime, callers)
    rows = []
    for (filename, line, name), (_cc, nc, tt, ct, _callers) in stats.items():
        where = f"{_where(filename)}:{line}({name})" if line else name
        rows.append(
            {
                "function": where,
                "calls_per_step": nc / steps,
                "own_ms_per_step": tt * 1e3 / steps,
                "cumulative_ms_per_step": ct * 1e3 / steps,
            }
        )
    by_own = sorted(rows, key=lambda r: -r["own_ms_per_step"])[:TOP]
    by_cum = sorted(rows, key=lambda r: -r["cumulative_ms_per_step"])[:TOP]
    return {"by_own_time": by_own, "by_cumulative_time": by_cum}


def _metric_deltas(before: dict, after: dict) -> dict:
    keys = (
        "match_calls",
        "device_hit_tokens",
        "host_match_tokens",
        "loaded_tokens",
        "backup_tokens",
        "evicted_device_tokens",
        "evicted_host_tokens",
        "reclaimed_host_tokens",
        "evict_calls",
        "evict_host_calls",
    )
    return {k: after[k] - before[k] for k in keys if k in before and k in after}


def _counters(cache) -> dict:
    return dict(vars(cache.metrics))


def _run(args, progress) -> dict:
    from .report import machine_info, print_table

    clock = _Clock()
    progress.phase("building the cache (numpy backend, write_through, KV events subscribed)")
    sim = _Sim(args, clock)
    f, n = args.finishes_per_step, args.in_flight
    progress.note(
        f"{n} in flight, {f} finishing per step, prompts of {args.prompt_len} tokens, page {args.page_size}; "
        f"device pool {sim.device_pages} pages, host {sim.host_pages}"
    )
    # Fill: admit finishes_per_step requests a step, finishing nothing, until in_flight -
    # finishes_per_step run; from then on every step admits finishes_per_step (in_flight run its
    # decode step, as the engine's max_batch bounds them) and finishes as many, the oldest.
    progress.phase("warm-up steps", None)
    warm = 0
    while len(sim.running) < n - f:  # a step starts with n - f running: it admits f, decodes n, finishes f
        sim.step(min(f, n - f - len(sim.running)), 0)
        clock.take()
        warm += 1
    for _ in range(args.warmup_steps):
        sim.step(f, f)
        clock.take()
        warm += 1
    progress.note(f"warm-up: {warm} steps ({sim.admitted} admitted, {sim.finished} finished)")
    before = _counters(sim.cache)
    events_before = dict(sim.event_counts)
    admitted0, finished0 = sim.admitted, sim.finished
    clock.calls = {}
    cpu_steps, wall_steps, phase_cpu = [], [], {p: [] for p in _Clock.PHASES}
    progress.phase("measured steps", args.steps)
    chunk, shown = max(1, args.steps // 10), 0
    for i in range(args.steps):
        sim.step(f, f)
        cpu, wall = clock.take()
        cpu_steps.append(sum(cpu.values()) / 1e6)
        wall_steps.append(sum(wall.values()) / 1e6)
        for p in _Clock.PHASES:
            phase_cpu[p].append(cpu[p] / 1e6)
        if (i + 1) % chunk == 0 or i + 1 == args.steps:
            progress.advance(i + 1 - shown, f"last step {cpu_steps[-1]:.2f} ms CPU")
            shown = i + 1
    measured = {"admitted": sim.admitted - admitted0, "finished": sim.finished - finished0}
    by_call = {
        name: {
            "calls_per_step": c / args.steps,
            "us_per_call": ns / 1e3 / c if c else 0.0,
            "ms_per_step": ns / 1e6 / args.steps,
        }
        for name, (ns, c) in clock.calls.items()
    }
    after = _counters(sim.cache)
    events = {k: sim.event_counts.get(k, 0) - events_before.get(k, 0) for k in sim.event_counts}
    profile = None
    if args.profile_steps:
        import cProfile

        progress.phase("profiled steps (cProfile around the cache calls)", args.profile_steps)
        clock.profile = cProfile.Profile()
        for _ in range(args.profile_steps):
            sim.step(f, f)
            clock.take()
            progress.advance()
        profile = _profile_rows(clock.profile, args.profile_steps)
        clock.profile = None
    # The running requests' own pages (after the tree's prefix, and their reserves): the tree,
    # the free list and these add up to the pool.
    sim.cache.sanity_check(
        external_device_pages=sum(
            int(s.req.device_pages.shape[0] - s.req.cached_pages) + int(s.reserve.size) for s in sim.running
        )
    )
    if sim.events is not None:
        sim.events.close()
    sim.cache.close()

    cpu = _summary(cpu_steps)
    wall = _summary(wall_steps)
    per_64 = {k: v * GOAL_FINISHES / f for k, v in cpu.items()}
    per_finish_us = {k: v * 1e3 / f for k, v in cpu.items()}
    at_goal_size = n >= GOAL_IN_FLIGHT and f >= GOAL_FINISHES and not args.quick
    met = per_64["median"] <= GOAL_CPU_MS
    goal = {
        "name": "step_cpu_ms_per_64_finishes",
        "threshold_ms": GOAL_CPU_MS,
        "text": f"scheduler step CPU <= {GOAL_CPU_MS:g} ms per {GOAL_FINISHES} finishes at {GOAL_IN_FLIGHT} in flight",
        "value_ms": per_64["median"],
        "ratio_to_goal": per_64["median"] / GOAL_CPU_MS,
        "status": ("met" if met else "missed") if at_goal_size else "not comparable",
        "would_meet": met,
    }
    if not at_goal_size:
        goal["not_comparable_because"] = (
            "--quick" if args.quick else f"fewer than {GOAL_IN_FLIGHT} in flight or {GOAL_FINISHES} finishes a step"
        )
    machine = machine_info()
    machine.update(platform=platform.platform(), processor=platform.processor() or platform.machine())
    try:
        machine["cpus_usable"] = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover
        pass

    rows = [
        ["CPU ms / step", *(cpu[k] for k in ("median", "p90", "p99", "mean"))],
        ["wall ms / step", *(wall[k] for k in ("median", "p90", "p99", "mean"))],
        [f"CPU ms / step per {GOAL_FINISHES} finishes", *(per_64[k] for k in ("median", "p90", "p99", "mean"))],
        ["CPU us / finish", *(per_finish_us[k] for k in ("median", "p90", "p99", "mean"))],
    ]
    for p in _Clock.PHASES:
        s = _summary(phase_cpu[p])
        rows.append([f"  {p}: CPU ms / step", s["median"], s["p90"], s["p99"], s["mean"]])
    load = ", ".join(f"{x:.2f}" for x in machine.get("load_average_1_5_15", []))
    print_table(
        f"bench step-cost: cache CPU per scheduler step, {n} in flight, {f} finishes + {f} admissions per "
        f"step, {args.steps} steps (numpy backend, write_through, KV events {args.events}; "
        f"{machine.get('cpus')} CPUs, load {load})",
        ["", "median", "p90", "p99", "mean"],
        rows,
    )
    act = _metric_deltas(before, after)
    per = {k: v / args.steps for k, v in act.items()}
    print(
        f"per measured step: {per.get('match_calls', 0):g} matches, {per.get('device_hit_tokens', 0):,.0f} "
        f"device-hit and {per.get('loaded_tokens', 0):,.0f} loaded-back tokens, {per.get('backup_tokens', 0):,.0f} "
        f"tokens backed up, {per.get('evicted_device_tokens', 0):,.0f} device / "
        f"{per.get('evicted_host_tokens', 0):,.0f} host tokens evicted, {sum(events.values()) / args.steps:,.0f} "
        f"KV events"
    )
    print(
        f"goal: {goal['text']}: median {per_64['median']:.3f} ms per {GOAL_FINISHES} finishes = "
        f"x{goal['ratio_to_goal']:.2f} the goal -> {goal['status']}"
        + (f" ({goal['not_comparable_because']}; would {'' if met else 'not '}meet it)" if not at_goal_size else "")
    )
    print_table(
        f"wall time by cache call (mean over the {args.steps} measured steps; the timed blocks also hold the "
        f"key building the engine does for each call)",
        ["call", "calls / step", "us / call", "ms / step"],
        [[name, r["calls_per_step"], r["us_per_call"], r["ms_per_step"]] for name, r in by_call.items()],
    )
    if profile is not None:
        for title, key, rows_ in (
            ("own time", "own_ms_per_step", profile["by_own_time"]),
            ("cumulative time", "cumulative_ms_per_step", profile["by_cumulative_time"]),
        ):
            print_table(
                f"profile: top {TOP} by {title} (cProfile, {args.profile_steps} steps; ms per step under the "
                f"profiler, which inflates them)",
                ["function", "calls / step", "ms / step"],
                [[r["function"], r["calls_per_step"], r[key]] for r in rows_],
            )
    return {
        "benchmark": NAME,
        "machine": machine,
        "config": {
            **vars(args),
            "device_pages": sim.device_pages,
            "host_pages": sim.host_pages,
            "max_new_tokens": sim.max_new,
            "system_prompts": SYSTEM_PROMPTS,
            "system_share": SYSTEM_SHARE,
            "follow_up": FOLLOW_UP,
            "write_policy": "write_through",
            "backend": "numpy",
            "kv_geometry": {"layers": 1, "kv_heads": 1, "head_dim": 1, "dtype": "float16"},
        },
        "warmup_steps_run": warm,
        # over the whole run (warm-up, measured and profiled steps): what the benchmark drove
        "totals": {
            "admitted": sim.admitted,
            "finished": sim.finished,
            "running_at_end": len(sim.running),
            "steps": warm + args.steps + args.profile_steps,
        },
        "measured": {
            **measured,
            "steps": args.steps,
            "in_flight": n,
            "follow_ups_sent_total": sim.follow_ups_sent,
            "flushes_short_of_room_total": sim.flushes,
        },
        "cpu_ms_per_step": cpu,
        "wall_ms_per_step": wall,
        "cpu_ms_per_step_per_64_finishes": per_64,
        "cpu_us_per_finish": per_finish_us,
        "cpu_ms_per_step_by_phase": {p: _summary(v) for p, v in phase_cpu.items()},
        "cpu_ms_per_step_samples": cpu_steps,
        "wall_by_call": by_call,
        "cache_during_measurement": act,
        "events_during_measurement": events,
        "event_batches_total": sim.batches,
        "goal": goal,
        "profile": profile,
    }
