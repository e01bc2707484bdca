"""Where the tree's choices differ from upstream sglang's ``HiRadixCache``, and which it makes.

Pure Python, resolved once when the cache is built (``resolve``); the hot paths read plain
attributes. Issue 21 point 17 replayed random traces through both trees
(``benchmarks/bench_tree_differential.py``; ``benchmarks/tree_divergence.py`` finds where they
first part) and decided each choice by the hit rate per tier (device L1, host L2). The reasons
and numbers are in docs/deviations-from-upstream.md; in short:

Always upstream's (ours measured no better on any tier, or worse):

* write_back counts no hits (``count_hits`` False), so LFU orders by access time there, as
  upstream's does. Counting them (a "real" LFU) kept hot prefixes on the device (L1 +0.04)
  but starved the host (L2 0.065 vs 0.308 at host ratio 4): a lower total.
* Reviving a host-only node (an insert re-supplying pages the host held but no load-back
  brought back) counts no hit: those tokens were recomputed, not served by the cache.

Chosen by ``HiCacheConfig.tree_decisions`` (``"auto"``, ``"upstream"`` or ``"own"``):

* ``stamp_split_remainder``: a match or insert that ends inside a node splits it; upstream
  stamps the node before splitting, so the unmatched remainder gets the access time too
  (it stays on the device longer); ours leaves it its old time.
* ``evict_whole``: a load-back short of device pages evicts the load's whole size, and a
  backup short of host pages evicts at least the backed-up node's size (upstream's batches);
  ours evicts only the shortfall. The batches leave free room behind: fewer device hits
  (the batch demoted KV that stays cached on the host instead) and, with LFU, a grace period
  for new backups (an exact shortfall always takes the newest, least-hit copies).
* ``host_eviction_order`` (with ``host_reclaim``; ``evictor.evict_host``): ``"host_only_first"``
  evicts host-only leaves before dropping the copies of on-device nodes (upstream never drops
  those: where no host-only leaf can go it fails the backup, ours drops a copy);
  ``"aging"`` drops copies first, in the reverse of device eviction's order, unless a
  host-only leaf aged out (issue 21 point 5: what makes a host smaller than ~3 device pools
  serve at all); ``"copies_first"`` always drops copies first (write_back: a dropped copy
  costs only a copy when its node leaves the device, never a hit). Aging compares a
  host-only leaf's access time with the device's next victim's, which is the device's
  eviction boundary only under LRU: under LFU (or MRU) the next victim is often fresh, most
  host-only leaves look aged, and aging ends up close to ``host_only_first`` (write_through,
  LFU, page 16, host ratio 1, seeds 2-7: L2 0.0138 aging, 0.0128 host-only first, 0.0308
  copies first). So aging is taken under LRU only.

``"upstream"``: upstream's three (``host_only_first``). ``"own"``: ours (``copies_first``
under write_back or any eviction policy but LRU, ``aging`` under LRU write_through).
``"auto"`` (the default), by what the benchmark showed per tier: write_back takes ``"own"``
(there every eviction is a blocking copy that takes host room, so evicting more than needed
costs copies and host KV: ours is higher on both tiers); write_through(_selective) takes
upstream's split stamp and batches, with ``own``'s host eviction order while the host pool
is smaller than ``HOST_ONLY_FIRST_RATIO`` device pools and ``host_only_first`` from there (a
host that big holds a copy of the whole device and still two pools of demoted KV: dropping
copies there lost host hits).
"""

from __future__ import annotations

from dataclasses import dataclass

from .config import EvictionPolicy, HiCacheConfig, TreeDecisions, WritePolicy

# ``tree_decisions="auto"`` under write_through(_selective): host eviction keeps upstream's
# order once the host pool holds at least this many device pools. Point 5's aging order made
# host ratios 0.5 / 1 / 2 serve (multiturn-64x10 trace, L2 0 / 0 / 0.184 -> 0.067 / 0.151 / 0.301);
# at ratio 4 it lost host hits to upstream's order on the differential benchmark (L2 -0.0004
# to -0.0007, LFU up to -0.008).
HOST_ONLY_FIRST_RATIO = 3

HOST_ONLY_FIRST, AGING, COPIES_FIRST = "host_only_first", "aging", "copies_first"


@dataclass(frozen=True)
class Decisions:
    """The resolved choices of one cache (see the module docstring)."""

    count_hits: bool
    stamp_split_remainder: bool
    evict_whole: bool
    host_eviction_order: str


def resolve(config: HiCacheConfig, device_pages: int, host_pages: int) -> Decisions:
    """The choices of a cache built with ``config`` over pools of these sizes (pages)."""
    write_back = config.write_policy == WritePolicy.WRITE_BACK
    # Aging compares access times with the device's next victim's: an LRU notion. Under the
    # other policies the device's next victim is not the least recently used node, so a
    # fresh host-only leaf often looks aged and aging acts as upstream's order.
    reclaim = AGING if config.eviction_policy == EvictionPolicy.LRU and not write_back else COPIES_FIRST
    mode = config.tree_decisions
    if mode == TreeDecisions.AUTO:
        if write_back:
            mode = TreeDecisions.OWN
        else:
            big = host_pages >= HOST_ONLY_FIRST_RATIO * device_pages
            return Decisions(True, True, True, HOST_ONLY_FIRST if big else reclaim)
    if mode == TreeDecisions.UPSTREAM:
        return Decisions(not write_back, True, True, HOST_ONLY_FIRST)
    return Decisions(not write_back, False, False, reclaim)
