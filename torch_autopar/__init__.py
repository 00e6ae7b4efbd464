"""torch_autopar: write a model for one device; ``autopar.compile(model)`` spreads it over many.

Public names follow ../shared/docs/ARCHITECTURE.md (a contract: extend, never rename).
"""

from torch_autopar.api import compile, plan
from torch_autopar.cost import HardwareProfile, profile
from torch_autopar.errors import AutoparError
from torch_autopar.launch import get_rank, get_world_size, init, notebook_launcher
from torch_autopar.runtime import ParallelModule, get_mode, mode, set_mode
from torch_autopar.runtime.grad_norm import clip_grad_norm_
from torch_autopar.runtime.precision import MixedPrecision
from torch_autopar.runtime.checkpoint import load_checkpoint, save_checkpoint
from torch_autopar.runtime.trainer import Model, StopTraining
from torch_autopar.search import Plan

__version__ = "0.1.0"

__all__ = ["AutoparError", "HardwareProfile", "MixedPrecision", "Model", "StopTraining",
           "clip_grad_norm_", "ParallelModule", "Plan", "compile", "get_mode",
           "get_rank", "get_world_size", "init", "load_checkpoint", "mode", "notebook_launcher", "plan", "profile",
           "save_checkpoint", "set_mode"]
