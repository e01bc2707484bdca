"""KV-aware routing over several engines' KV events (issue 31 part 2): ``PrefixRouter``."""

from .router import PrefixRouter, RouteDecision, TierWeights

__all__ = ["PrefixRouter", "RouteDecision", "TierWeights"]
