"""Checkpoints through ``torch.distributed.checkpoint`` (DCP): ``autopar.save_checkpoint`` / ``load_checkpoint``.

A checkpoint is a directory that every rank can see (one machine, or a shared file system, as DCP's file writer
requires)::

    state/        DCP files: the model's and optimizer's tensors under the user's parameter names. Each rank
                  writes only its own shards (the DTensor shards of a sharded plan; a pipelined model's ranks
                  their stages' tensors); tensors several ranks hold whole (data parallelism, a pipeline's
                  replicas, a tied parameter's copies) are written once (DCP de-duplicates them)
    plain.json    the optimizer's other values (hyper-parameters per group), which DCP would pickle
    plan.json     the Plan the model ran (Plan.save), for the record and for ``autopar.Plan.load``
    params.json   every parameter's name, full shape and dtype, in order: checked before anything is loaded
    rank<r>.pt    rank r's own state: RNG states (torch CPU, CUDA where present) and what the trainer adds
                  (data position); tensors and plain values only, read back with ``weights_only=True``
    meta.json     format version, world size and the caller's ``**extra`` (JSON); written last

A save is atomic: everything goes to ``<dir>.tmp`` first; then the previous checkpoint is renamed to ``<dir>.old``,
the new one to ``<dir>``, and ``<dir>.old`` is deleted. A crash at any point leaves a loadable checkpoint at
``<dir>`` or, between the two renames, at ``<dir>.old`` (``load_checkpoint`` looks there too).

Loading reads into the layout the model has now (DCP reshards), so a checkpoint saved under one plan, mesh or
world size loads under another. Must never unpickle anything but DCP's own metadata file, and that only through
an allow-list (``_compat.safe_checkpoint_reader``); everything else is JSON or read with ``weights_only=True``.
Must never change a model's plan or placements.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_model_state_dict, set_state_dict)

from torch_autopar import _compat
from torch_autopar.errors import AutoparError
from torch_autopar.runtime.parallel_module import ParallelModule
from torch_autopar.runtime.pipeline import PipelineModule
from torch_autopar.runtime.sharded import swap_sharded_parameters

FORMAT_VERSION = 1
_OPTIONS = StateDictOptions(full_state_dict=False)


def _world() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _module(pmodel: torch.nn.Module) -> torch.nn.Module:
    """What this rank saves and loads: a compiled model's module, a pipelined model's stages on this rank."""
    if _is_pipelined(pmodel):
        return pmodel.checkpoint_module()
    return pmodel.module if isinstance(pmodel, ParallelModule) else pmodel


def _whole_module(pmodel: torch.nn.Module) -> torch.nn.Module:
    """The module whose parameters a checkpoint lists (every stage's, for a pipelined model)."""
    return pmodel.whole_module if _is_pipelined(pmodel) else _module(pmodel)


def _is_pipelined(pmodel) -> bool:
    return isinstance(pmodel, PipelineModule)


def save_checkpoint(path, pmodel: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None, **extra) -> None:
    """Save ``pmodel`` (compiled or plain), ``optimizer`` and RNG states to directory ``path``, atomically;
    ``extra`` values must be JSON (numbers, strings, lists, dicts). Every rank must call it."""
    save(path, pmodel, optimizer, extra)


def load_checkpoint(path, pmodel: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict:
    """Load a checkpoint written by ``save_checkpoint`` into ``pmodel`` and ``optimizer`` (whatever their plan,
    mesh or world size now) and restore this rank's RNG states; returns the ``extra`` values. Every rank must
    call it."""
    extra, rank_state = load(path, pmodel, optimizer)
    restore_rng(rank_state.get("rng"))
    return extra


def save(path, pmodel, optimizer, extra: dict, rank_state: dict | None = None) -> None:
    """``save_checkpoint`` plus ``rank_state``: this rank's own tensors and plain values (the trainer's)."""
    path = _normalise(path)
    rank, world = _world()
    _check_json(extra)
    staging = path + ".tmp"
    if rank == 0:
        _remove(staging)
        os.makedirs(staging)
    _barrier()
    _write_state(staging, pmodel, optimizer)
    torch.save({"rng": rng_state(), **(rank_state or {})}, os.path.join(staging, f"rank{rank}.pt"))
    _barrier()
    if rank == 0:
        _write_metadata(staging, pmodel, extra, world)
        _commit(staging, path)
    _barrier()


@contextlib.contextmanager
def _dcp_quietly():
    """DCP warns that it assumes one process when there is no process group: that is what we mean."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _write_state(staging: str, pmodel, optimizer) -> None:
    """Tensors through DCP (each rank its shards); every other value (optimizer hyper-parameters, step counts
    kept as numbers) as JSON, because DCP would pickle it."""
    tensors, plain = split_tensors(_state(pmodel, optimizer))
    _check_json(plain, "the optimizer's non-tensor state")
    if optimizer is not None:
        plain = _with_every_ranks_parameters(plain, _held_groups(optimizer, _module(pmodel), _is_pipelined(pmodel)))
    try:
        with _dcp_quietly():
            dcp.save(tensors, storage_writer=dcp.FileSystemWriter(os.path.join(staging, "state")),
                     no_dist=not dist.is_initialized())
    except (Exception, dcp.CheckpointException) as error:  # DCP gathers every rank's failure: all ranks raise
        raise AutoparError(f"saving the checkpoint failed while writing {staging!r}: {type(error).__name__}: "
                           f"{_first_line(error)}. The previous checkpoint (if any) is untouched; free disk space "
                           "or fix the path and save again.") from error
    if _world()[0] == 0:
        _write_json(os.path.join(staging, "plain.json"), plain)


def _with_every_ranks_parameters(plain: dict, held: list[tuple[int, list]]) -> dict:
    """``plain`` (written by rank 0) with the optimizer's values of every rank's parameters: each parameter group
    (``held``: this rank's, by position in the optimizer) naming every rank's parameters (DCP's loader takes a
    group's hyper-parameters from the saved group naming the parameter) and every rank's non-tensor
    per-parameter state (a pipelined model's ranks each hold their stages')."""
    optimizer = plain.get("optimizer", {})
    if not dist.is_initialized() or dist.get_world_size() == 1 or "param_groups" not in optimizer:
        return plain
    everyone: list = [None] * dist.get_world_size()
    indices = [index for index, _ in held]
    dist.all_gather_object(everyone, (indices, optimizer["param_groups"], optimizer.get("state", {})))
    groups: dict[int, dict] = {}
    for rank_indices, rank_groups, _ in everyone:
        for index, group in zip(rank_indices, rank_groups):
            merged = groups.setdefault(index, dict(group, params=[]))
            merged["params"] = list(dict.fromkeys(merged["params"] + group["params"]))
    state = {name: value for _, _, states in everyone for name, value in states.items()}
    merged_optimizer = {**optimizer, "param_groups": [groups[index] for index in sorted(groups)]}
    return {**plain, "optimizer": {**merged_optimizer, **({"state": state} if state else {})}}


def split_tensors(tree: dict) -> tuple[dict, dict]:
    """(the tensors of a nested dict, the other values), each as a nested dict of the same keys."""
    tensors, plain = {}, {}
    for key, value in tree.items():
        if isinstance(value, dict):
            inner_tensors, inner_plain = split_tensors(value)
            if inner_tensors:
                tensors[key] = inner_tensors
            if inner_plain or not inner_tensors:
                plain[key] = inner_plain
        elif isinstance(value, torch.Tensor):
            tensors[key] = value
        else:
            plain[key] = value
    return tensors, plain


def join_plain(tensors: dict, plain: dict, template: dict) -> dict:
    """``tensors`` with the JSON values of ``plain`` put back, typed like ``template`` (tuples stay tuples)."""
    joined = dict(tensors)
    for key, value in plain.items():
        if isinstance(value, dict) and isinstance(joined.get(key), dict):
            joined[key] = join_plain(joined[key], value, template.get(key, {}))
        else:
            joined[key] = _typed_like(template.get(key), value)
    return joined


def _typed_like(template, value):
    if isinstance(value, dict):
        return {k: _typed_like(template.get(k) if isinstance(template, dict) else None, v) for k, v in value.items()}
    if isinstance(value, list):
        shaped = template if isinstance(template, (list, tuple)) else ()
        items = [_typed_like(shaped[i] if i < len(shaped) else None, v) for i, v in enumerate(value)]
        return tuple(items) if isinstance(template, tuple) else items
    return value


def _first_line(error: BaseException) -> str:
    """The first line of what went wrong (for DCP's CheckpointException: of the first failing rank's error)."""
    failures = getattr(error, "failures", None)
    if isinstance(failures, dict) and failures:
        rank, cause = min(failures.items(), key=lambda item: item[0])
        cause = cause[0] if isinstance(cause, tuple) else cause  # (exception, its stack) in torch 2.13
        return f"on rank {rank}: {type(cause).__name__}: {_first_line(cause)}"
    return str(error).splitlines()[0] if str(error) else ""


def _state(pmodel, optimizer) -> dict:
    """The DCP state dict: model (and optimizer) state under parameter names, in the model's current layout."""
    module = _module(pmodel)
    if optimizer is None:
        return {"model": get_model_state_dict(module, options=_OPTIONS)}
    swap_sharded_parameters(optimizer)
    with _optimizer_over(optimizer, module, _is_pipelined(pmodel)):
        model_state, optimizer_state = get_state_dict(module, optimizer, options=_OPTIONS)
    return {"model": model_state, "optimizer": optimizer_state}


def _held_groups(optimizer, module: torch.nn.Module, pipelined: bool) -> list[tuple[int, list]]:
    """(position, parameters) of each of ``optimizer``'s groups holding some of ``module``'s parameters, those
    only: an optimizer built from a pipelined model's ``parameters()`` before its first call holds every
    stage's and steps only this rank's (the others get no gradient here; their ranks save and load them), and
    a group may hold only other ranks' parameters. Every group as it is when not pipelined."""
    if not pipelined:
        return list(enumerate(group["params"] for group in optimizer.param_groups))
    held = {id(p) for p in module.parameters()}
    kept = [(index, [p for p in group["params"] if id(p) in held]) for index, group in enumerate(optimizer.param_groups)]
    kept = [(index, params) for index, params in kept if params]
    if held and not kept:
        raise AutoparError("the optimizer holds none of this rank's pipeline stage parameters (a fully-sharded "
                           "stage's are replaced by shards when the model is first called); expected an optimizer "
                           "built from pmodel.parameters() after that: compile with example inputs (or call the "
                           "model once) before building the optimizer.")
    return kept


@contextlib.contextmanager
def _optimizer_over(optimizer, module: torch.nn.Module, pipelined: bool):
    """``optimizer`` seen with only its groups and parameters of ``module`` (``_held_groups``); hyper-parameters
    a load brings are kept."""
    if not pipelined:
        yield
        return
    groups, kept = optimizer.param_groups, _held_groups(optimizer, module, pipelined)
    optimizer.param_groups = [dict(groups[index], params=params) for index, params in kept]
    try:
        yield
    finally:  # optimizer.load_state_dict makes new group dicts: their hyper-parameters go back by position
        for (index, _), seen in zip(kept, optimizer.param_groups):
            groups[index].update({key: value for key, value in seen.items() if key != "params"})
        optimizer.param_groups = groups


def _write_metadata(staging: str, pmodel, extra: dict, world: int) -> None:
    plan = getattr(pmodel, "plan", None)
    if plan is not None:
        plan.save(os.path.join(staging, "plan.json"))
    _write_json(os.path.join(staging, "params.json"), parameter_table(_whole_module(pmodel)))
    _write_json(os.path.join(staging, "meta.json"), {"version": FORMAT_VERSION, "world_size": world, "extra": extra})


def _commit(staging: str, path: str) -> None:
    """Make ``staging`` the checkpoint at ``path``; at every instant ``path`` or ``path.old`` is complete."""
    old = path + ".old"
    _remove(old)
    if os.path.exists(path):
        os.rename(path, old)
    os.rename(staging, path)
    _remove(old)


def load(path, pmodel, optimizer) -> tuple[dict, dict]:
    """``load_checkpoint`` without restoring RNG states: returns (extra, this rank's state)."""
    found = find_checkpoint(path)
    if found is None:
        raise AutoparError(f"no checkpoint at {_normalise(path)!r} (expected a directory written by "
                           "autopar.save_checkpoint, with meta.json); check the path.")
    meta = _read_json(os.path.join(found, "meta.json"))
    if meta.get("version") != FORMAT_VERSION:
        raise AutoparError(f"checkpoint format version {meta.get('version')!r} at {found!r} is not supported "
                           f"(expected {FORMAT_VERSION}); save it again with this version of torch_autopar.")
    check_parameters(_read_json(os.path.join(found, "params.json")), parameter_table(_whole_module(pmodel)), found)
    template = _state(pmodel, optimizer)
    tensors, _ = split_tensors(template)
    _read_tensors(found, tensors)
    _apply_state(pmodel, optimizer, join_plain(tensors, _read_json(os.path.join(found, "plain.json")), template))
    return meta["extra"], _read_rank_state(found, meta["world_size"])


def _read_tensors(found: str, tensors: dict) -> None:
    """Fill ``tensors`` (in this model's layout: DCP reshards) from the checkpoint's DCP files."""
    reader = _compat.safe_checkpoint_reader(os.path.join(found, "state"))
    try:
        reader.read_metadata()  # refused here, before DCP's fallbacks to other metadata files hide why
        with _dcp_quietly():
            dcp.load(tensors, storage_reader=reader, no_dist=not dist.is_initialized())
    except (Exception, dcp.CheckpointException) as error:
        raise AutoparError(f"could not load the checkpoint at {found!r}: {type(error).__name__}: {_first_line(error)}. "
                           "Expected the state of this model and an optimizer of the same kind as the one saved "
                           "(load without an optimizer to take the model alone).") from error


def _apply_state(pmodel, optimizer, state: dict) -> None:
    module = _module(pmodel)
    if optimizer is None:
        set_model_state_dict(module, state["model"], options=_OPTIONS)
        return
    with _optimizer_over(optimizer, module, _is_pipelined(pmodel)):
        set_state_dict(module, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                       options=_OPTIONS)


def _read_rank_state(found: str, saved_world: int) -> dict:
    """This rank's own state; {} when the checkpoint was saved by another number of ranks (RNG streams and
    per-rank data positions do not carry over; the caller falls back to the global position in ``extra``)."""
    rank, world = _world()
    file = os.path.join(found, f"rank{rank}.pt")
    if world != saved_world or not os.path.exists(file):
        return {}
    return torch.load(file, weights_only=True)


def find_checkpoint(path) -> str | None:
    """The complete checkpoint at ``path`` (or at ``path.old`` if a save was interrupted between renames)."""
    path = _normalise(path)
    for candidate in (path, path + ".old"):
        if os.path.exists(os.path.join(candidate, "meta.json")):
            return candidate
    return None


def parameter_table(module: torch.nn.Module) -> list[list]:
    """[name, full shape, dtype] of every parameter, in registration order (DTensors report their full shape)."""
    return [[name, list(p.shape), str(p.dtype).removeprefix("torch.")] for name, p in module.named_parameters()]


def check_parameters(saved: list, current: list, where: str) -> None:
    """Raise naming the first parameter whose name, full shape or dtype differs from the checkpoint's."""
    saved_by_name = {row[0]: row for row in saved}
    for row in current:
        other = saved_by_name.get(row[0])
        if other is None or other != row:
            found = "absent" if other is None else f"shape {tuple(other[1])}, {other[2]}"
            raise AutoparError(
                f"the checkpoint at {where!r} is of another model: parameter {row[0]!r} is expected with shape "
                f"{tuple(row[1])}, {row[2]}, found {found}. Load a checkpoint saved from this model.")
    extra = [row[0] for row in saved if row[0] not in {r[0] for r in current}]
    if extra:
        raise AutoparError(f"the checkpoint at {where!r} is of another model: it has parameter {extra[0]!r}, which "
                           "this model lacks. Load a checkpoint saved from this model.")


def rng_state() -> dict:
    """This rank's RNG states: torch's CPU generator and, where present, every CUDA device's."""
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict | None) -> None:
    if not state:
        return
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _check_json(values: dict, what: str = "save_checkpoint(**extra)") -> None:
    try:
        json.dumps(values)
    except (TypeError, ValueError) as error:
        raise AutoparError(f"{what} must be JSON values (numbers, strings, lists, dicts) to be saved without "
                           f"pickle; found {error}. Convert tensors with .tolist() or keep them in the model."
                           ) from error


def _normalise(path) -> str:
    return os.path.abspath(os.fspath(path)).rstrip(os.sep)


def _remove(path: str) -> None:
    if os.path.exists(path):
        shutil.rmtree(path)


def _write_json(file: str, value) -> None:
    with open(file, "w") as handle:
        json.dump(value, handle, indent=1)


def _read_json(file: str):
    try:
        with open(file) as handle:
            return json.load(handle)
    except (OSError, ValueError) as error:
        raise AutoparError(f"could not read {file!r}: {type(error).__name__}: {error}. Expected a checkpoint written "
                           "by autopar.save_checkpoint; save it again.") from error
