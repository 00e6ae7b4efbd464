"""Sharding rules DTensor lacks, one module per op family, registered in DTensor's own registry on import.

The planner enumerates candidates from that registry and DTensor runs them at run time, so a rule added here
serves both. Each module registers through ``torch_autopar._compat`` only. Must never register a rule for an op
DTensor already covers (DTensor's own rule wins; see ``_compat.has_sharding_rule``).
"""

from torch_autopar.strategies.rules import attention

__all__ = ["attention"]
