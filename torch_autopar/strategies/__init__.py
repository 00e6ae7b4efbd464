"""Strategies: placements (Shard / Replicate / Partial per mesh axis) for every node of a captured graph.

Per-op knowledge comes from DTensor's registered sharding rules through ``torch_autopar._compat``; ops
without a rule are replicated and reported. Must never estimate cost or pick between plans.
"""

from torch_autopar.strategies import rules  # noqa: F401  (registers the rules DTensor lacks)
from torch_autopar.strategies.placements import format_placements, parse_placements
from torch_autopar.strategies.propagate import Redistribution, Sharding, propagate
from torch_autopar.strategies.seeds import STRATEGY_SEEDS, seed_placements

__all__ = ["Redistribution", "Sharding", "STRATEGY_SEEDS", "format_placements", "parse_placements",
           "propagate", "seed_placements"]
