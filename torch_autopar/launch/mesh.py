"""Device meshes: the one a compiled model runs on, and throw-away fake ones for offline planning.

Must never leave a fake process group behind: ``offline_mesh`` tears down what it set up.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from torch_autopar import _compat
from torch_autopar.errors import AutoparError

_DEFAULT_AXIS_NAMES = {1: ("dp",), 2: ("dp", "tp"), 3: ("dp", "cp", "tp")}


def default_axis_names(ndim: int) -> tuple[str, ...]:
    return _DEFAULT_AXIS_NAMES.get(ndim, tuple(f"axis{i}" for i in range(ndim)))


def device_type() -> str:
    """Device type of the running backend's tensors: "npu" (hccl), "cuda" (nccl) or "cpu"."""
    backend = dist.get_backend() if dist.is_initialized() else "gloo"
    return {"nccl": "cuda", "hccl": "npu"}.get(backend, "cpu")


def parse_mesh_shape(shape, where: str = "mesh_shape") -> tuple[int, ...]:
    """A mesh shape from a tuple of ints, one int, or text such as "8x8"."""
    if isinstance(shape, str):
        try:
            shape = tuple(int(part) for part in shape.lower().split("x"))
        except ValueError:
            raise AutoparError(f"{where}: expected sizes such as '8x8', found {shape!r}.") from None
    elif isinstance(shape, int) and not isinstance(shape, bool):
        shape = (shape,)
    if not isinstance(shape, (tuple, list)) or not all(isinstance(s, int) and not isinstance(s, bool) for s in shape):
        raise AutoparError(f"{where}: expected a tuple of integer axis sizes such as (8,) or (2, 4), found {shape!r}.")
    return tuple(shape)


def check_mesh_shape(shape, world_size: int | None, where: str) -> tuple[int, ...]:
    """A valid mesh shape covering exactly ``world_size`` ranks (None: any size), else a clear error."""
    shape = parse_mesh_shape(shape, where)
    if not shape or any(s < 1 for s in shape):
        raise AutoparError(f"{where}: expected a mesh shape of positive sizes such as (8,) or (2, 4), found {shape}.")
    if world_size is not None and math.prod(shape) != world_size:
        raise AutoparError(
            f"mesh={shape} has {math.prod(shape)} devices but this job has {world_size} ranks ({where}); the product "
            "of the mesh sizes must equal the world size: launch with torchrun --nproc-per-node matching the mesh "
            "or use e.g. mesh=(2, world_size // 2)."
        )
    return shape


def resolve_mesh(mesh, world_size: int) -> DeviceMesh:
    """The mesh a compiled model runs on: None → all ranks in one axis; a shape tuple; or a DeviceMesh."""
    if isinstance(mesh, DeviceMesh):
        if mesh.size() != world_size:
            raise AutoparError(f"mesh has {mesh.size()} devices but the job has {world_size} ranks; pass a mesh over all ranks.")
        return mesh
    shape = check_mesh_shape((world_size,) if mesh is None else mesh, world_size, "compile(mesh=...)")
    return job_mesh(shape, default_axis_names(len(shape)))


@contextlib.contextmanager
def planning_mesh(mesh_shape, axis_names):
    """A mesh of ``mesh_shape`` to plan on, with no process group behind it: offline, ``offline_mesh``'s; inside
    a running job of any size (planning a part of the job's ranks, e.g. a pipeline stage's), a mesh of device
    indices whose axes have no groups. Plans only: DTensor cannot run a collective on it."""
    if not dist.is_initialized():
        with offline_mesh(mesh_shape, axis_names) as mesh:
            yield mesh
        return
    shape = check_mesh_shape(mesh_shape, None, "mesh_shape")
    if len(axis_names) != len(shape):
        raise AutoparError(f"axis_names {tuple(axis_names)} must name each of the {len(shape)} mesh axes of {shape}.")
    rank, world = dist.get_rank(), dist.get_world_size()
    if math.prod(shape) > world:
        raise AutoparError(f"cannot plan for {math.prod(shape)} devices inside a running job of {world} ranks; "
                           "plan with autopar.plan(...) from a process without a process group.")
    ranks = sorted((rank + i) % world for i in range(math.prod(shape)))  # DTensor plans only on meshes holding it
    yield _compat.unbacked_mesh(device_type(), torch.tensor(ranks).reshape(shape), axis_names)


_JOB_MESHES: dict = {}


def job_mesh(shape, axis_names) -> DeviceMesh:
    """The one DeviceMesh of this shape and these axis names over the job's ranks (created once per process
    group: DTensor caches layouts by mesh equality, which ignores process groups, so two equal meshes with
    different groups would mix them)."""
    world = dist.group.WORLD
    key = (id(world), tuple(shape), tuple(axis_names))
    if key not in _JOB_MESHES or _JOB_MESHES[key][0] is not world:
        _JOB_MESHES[key] = (world, init_device_mesh(device_type(), tuple(shape), mesh_dim_names=tuple(axis_names)))
    return _JOB_MESHES[key][1]


@contextlib.contextmanager
def offline_mesh(mesh_shape, axis_names=None):
    """A mesh of ``mesh_shape`` for planning without ranks: a fake process group lives for the block."""
    shape = check_mesh_shape(mesh_shape, None, "mesh_shape")
    names = tuple(axis_names) if axis_names else default_axis_names(len(shape))
    if len(names) != len(shape):
        raise AutoparError(f"axis_names {names} must name each of the {len(shape)} mesh axes of {shape}.")
    if dist.is_initialized():
        if dist.get_world_size() != math.prod(shape):
            raise AutoparError(
                f"cannot plan for {math.prod(shape)} devices inside a running job of {dist.get_world_size()} ranks; "
                "call autopar.plan(...) from a process without a process group (it uses a fake one)."
            )
        with planning_mesh(shape, names) as mesh:
            yield mesh
        return
    dist.init_process_group("fake", store=_compat.fake_store(), rank=0, world_size=math.prod(shape))
    try:
        with torch.device("cpu"):  # a meta default device (natural around meta models) must not reach the mesh
            mesh = _compat.unbacked_mesh("cpu", torch.arange(math.prod(shape)).reshape(shape), names)
        yield mesh
    finally:
        dist.destroy_process_group()
