"""The plan's per-layer table (``Plan.layers``, shown by ``explain()``): each module's parameters, placements,
memory, the compute and communication of the nodes it owns, and the layouts of their outputs. Nodes are owned
by the module of the first parameter they use, else by that of their first owned input. Must never choose or
price anything: it only attributes what the estimate already holds.
"""

from __future__ import annotations

from torch_autopar.capture import CapturedProgram
from torch_autopar.cost import CostModel
from torch_autopar.search import estimate as est
from torch_autopar.search.plan import LayerRow
from torch_autopar.strategies import format_placements


def _owner(name: str) -> str:
    return name.rsplit(".", 1)[0] if "." in name else "(root)"


def _node_rows(program: CapturedProgram) -> dict:
    """Attribute each node to the module of the first parameter it uses (directly or through views of the
    parameter such as a transpose), else to the module of its first attributed input."""
    owned = {node: _owner(name) for name, node in program.param_nodes.items()}  # parameters and their views
    rows = dict(owned)
    for node in program.graph.graph.nodes:
        if node.op != "call_function":
            continue
        inputs = node.all_input_nodes
        if inputs and all(a in owned for a in inputs):
            owned[node] = owned[inputs[0]]
        used = [owned[a] for a in inputs if a in owned]
        inherited = [rows[a] for a in inputs if a in rows]
        if used or inherited:
            rows[node] = (used or inherited)[0]
    return rows


def _per_row_time(program: CapturedProgram, estimate, buckets, infos, fold) -> tuple[dict, dict]:
    """Compute and communication seconds per captured module row (one instance of the module)."""
    rows = _node_rows(program)
    by_name = {node.name: node for node in program.graph.graph.nodes}
    compute: dict[str, float] = {}
    comm: dict[str, float] = {}
    for node, seconds in estimate.node_seconds.items():
        row = rows.get(node, "(other)")
        compute[row] = compute.get(row, 0.0) + seconds
    bucket_bytes = [sum(infos[n].nbytes for n in bucket) for bucket in buckets]
    for c in estimate.collectives:
        if c.phase == "grad_sync":
            bucket = buckets[int(c.where.removeprefix("bucket"))]
            for name in bucket:
                row = _owner(fold.captured_name(name))
                share = c.seconds * infos[name].nbytes / bucket_bytes[int(c.where.removeprefix("bucket"))]
                comm[row] = comm.get(row, 0.0) + share / max(len(fold.real_names(fold.captured_name(name))), 1)
        else:
            row = rows.get(by_name.get(c.where), "(other)")
            comm[row] = comm.get(row, 0.0) + c.seconds
    return compute, comm


def _activation_layouts(program: CapturedProgram, sharding) -> dict[str, str]:
    """Per captured module row, how many of its ops' outputs lie in each layout ("S(0) x12, P(sum) x2")."""
    counts: dict[str, dict[str, int]] = {}
    for node, row in _node_rows(program).items():
        spec = sharding.specs.get(node)
        if node.op == "call_function" and hasattr(spec, "placements"):
            layout = ",".join(format_placements(spec.placements))
            counts.setdefault(row, {})[layout] = counts.setdefault(row, {}).get(layout, 0) + 1
    return {row: ", ".join(f"{layout} x{n}" for layout, n in sorted(c.items(), key=lambda item: -item[1]))
            for row, c in counts.items()}


def layer_rows(program: CapturedProgram, infos: dict, placements: dict, buckets, cost: CostModel, estimate,
                fold, sharding) -> list[LayerRow]:
    activations = _activation_layouts(program, sharding)
    synced = {c.where for c in estimate.collectives if c.phase == "grad_sync"}
    in_synced_bucket = {name for index, bucket in enumerate(buckets) if f"bucket{index}" in synced for name in bucket}
    compute, comm = _per_row_time(program, estimate, buckets, infos, fold)
    rows: dict[str, dict] = {}
    for name, info in infos.items():
        layer = _owner(name)
        captured = _owner(fold.captured_name(name))
        row = rows.setdefault(layer, {"numel": 0, "placements": set(), "sync": 0, "memory": 0,
                                      "compute": compute.get(captured, 0.0), "comm": comm.get(captured, 0.0),
                                      "activations": activations.get(captured, "")})
        local = info.nbytes // cost.shard_factor(placements[name])
        row["numel"] += info.numel
        row["placements"].add(",".join(format_placements(placements[name])))
        row["sync"] += info.nbytes if name in in_synced_bucket else 0
        row["memory"] += local * (2 + est.ADAM_STATE_PER_PARAM)
    return [LayerRow(name=layer, num_params=r["numel"], placements="/".join(sorted(r["placements"])),
                     grad_sync_bytes=r["sync"], memory_bytes=r["memory"], compute_s=r["compute"], comm_s=r["comm"],
                     activations=r["activations"])
            for layer, r in rows.items()]
