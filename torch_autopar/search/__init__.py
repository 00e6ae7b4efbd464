"""Search: choose placements for a captured program under a cost model and a memory budget → ``Plan``.

Must never run collectives or change the user's model.
"""

from torch_autopar.search.buckets import DEFAULT_BUCKET_CAP_BYTES, assign_buckets
from torch_autopar.search.plan import LayerRow, Plan, PlannedCollective, StageRow
from torch_autopar.search.planner import STRATEGIES, Planner, build_plan, check_strategy

__all__ = ["DEFAULT_BUCKET_CAP_BYTES", "STRATEGIES", "Planner", "LayerRow", "Plan", "PlannedCollective", "StageRow",
           "assign_buckets",
           "build_plan", "check_strategy"]
