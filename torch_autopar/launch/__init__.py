"""Launching: join the job torchrun started, pick the backend, rank helpers.

Imports no other stage, so every stage may use it. Must never start a collective other than
the process-group rendezvous.
"""

from torch_autopar.launch.init import detect_backend, get_rank, get_world_size, init, is_initialized

__all__ = ["detect_backend", "get_rank", "get_world_size", "init", "is_initialized"]

from torch_autopar.launch.mesh import (  # noqa: E402
    check_mesh_shape, default_axis_names, device_type, offline_mesh, resolve_mesh)

__all__ += ["check_mesh_shape", "default_axis_names", "device_type", "offline_mesh", "resolve_mesh"]

from torch_autopar.launch.notebook import notebook_launcher  # noqa: E402

__all__ += ["notebook_launcher"]
