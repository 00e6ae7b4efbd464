"""Rewrite: turn a Plan into what each rank runs: collectives inserted into graphs, hooks on parameters.

Must never choose placements (the Plan does) nor keep state between steps (the runtime does).
"""

from torch_autopar.rewrite.grad_sync import GradSyncPass, GradSyncResult
from torch_autopar.rewrite.reducer import GradientReducer

__all__ = ["GradSyncPass", "GradSyncResult", "GradientReducer"]
