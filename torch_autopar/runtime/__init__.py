"""Runtime: run a planned module in eager (PyNative) or graph (torch.compile) mode; train it.

Must never plan: it executes the Plan it is given.
"""

from torch_autopar.runtime.backend import BACKEND_NAME, autopar_backend, register
from torch_autopar.runtime.modes import MODES, get_mode, mode, set_mode
from torch_autopar.runtime.parallel_module import ParallelModule

register()

__all__ = ["BACKEND_NAME", "MODES", "ParallelModule", "autopar_backend", "get_mode", "mode", "set_mode"]
