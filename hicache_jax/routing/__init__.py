"""KV-aware routing over several engines' KV events: ``PrefixRouter``."""

from .router import PrefixRouter, RouteDecision, TierWeights, tier_costs_from_stats

__all__ = ["PrefixRouter", "RouteDecision", "TierWeights", "tier_costs_from_stats"]
