"""Graph mode with Inductor as the code generator on CPU (``AUTOPAR_GRAPH_COMPILER=inductor``): one case per
strategy family equals a one-process run (losses 1e-5 relative, full parameters after 3 AdamW steps) and runs
the plan's collectives: data parallelism (the gradient all-reduce pass in Inductor's backward), fully sharded
and tensor parallel (a hand column/row Plan) on 2 gloo ranks, dp x tp on a 2 x 2 mesh.

Behind ``-m slow``: Inductor compiles C++ for every graph on every rank (minutes on two cores)."""

from __future__ import annotations

import pytest

from torch_autopar.testing import run_on_ranks
from tests import support
from tests.runtime import test_sharded as sharded

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

CASES = {
    (2, (2,)): [("mlp", "data_parallel", "graph", "adamw"), ("mlp", "fully_shard", "graph", "adamw"),
                ("gpt", "megatron", "graph", "adamw")],
    (4, (2, 2)): [("mlp", "fsdp_tp", "graph", "adamw")],
}


def _job(rank, world, mesh):
    return {case: support.outcome(sharded._run_case, rank, world, mesh, *case) for case in CASES[(world, mesh)]}


@pytest.mark.parametrize("layout", list(CASES), ids=lambda layout: "x".join(map(str, layout[1])))
def test_inductor_graph_mode_equals_one_process(layout):
    world, mesh = layout
    results = run_on_ranks(_job, world, mesh, timeout_s=1700, env={"AUTOPAR_GRAPH_COMPILER": "inductor"})
    for case in CASES[layout]:
        model_name, strategy, _, optimizer_name = case
        losses, params, _ = sharded._reference(model_name, optimizer_name)
        run = support.assert_ranks_equal_one_process([r[case] for r in results], (losses, params),
                                                     f"{case} with Inductor on mesh {mesh}")
        if run["sharded"]:
            assert run["counted"][-1] == run["planned"], f"{case}: collectives run vs planned"
