"""Cost: how long a node computes, how long a collective takes on a mesh axis, how much memory a plan needs.

Hardware profiles hold datasheet or measured figures; ``CostModel`` turns them into seconds and bytes for a
given mesh. Must never choose a plan or touch the graph's structure.
"""

from torch_autopar.cost.hardware import PROFILES, HardwareProfile, Link, get_profile
from torch_autopar.cost.model import CostModel, collectives_for, is_sharded
from torch_autopar.cost.profile import profile

__all__ = ["PROFILES", "CostModel", "HardwareProfile", "Link", "collectives_for", "get_profile", "is_sharded", "profile"]
