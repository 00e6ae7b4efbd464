"""DTensor's sharding rules as propagation calls them (``_compat.propagate_sharding``): DTensor caches each op's
decision under its schema, and a schema without the op's runtime info leaves the non-tensor arguments out of the
key. Two views of one input spec to different shapes then shared one entry, and the second got the first's
output (a ``(B*T, C)`` view placed as ``(B, T, H, D)``: ``S(2)`` on a 2-D tensor, which crashed graph mode's
program). A fake 2x2 process group; nothing runs."""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard

from torch_autopar import _compat
from torch_autopar.strategies.placements import spec_for
from torch_autopar.testing import fake_process_group


def test_views_of_one_spec_to_different_shapes_get_their_own_layouts():
    with fake_process_group(4):
        mesh = init_device_mesh("cpu", (2, 2))
        value = torch.empty(6, 16, 64)  # shapes no other test views, so DTensor's cache holds neither yet
        spec = spec_for(mesh, value, (Shard(0), Shard(2)))
        heads = _compat.propagate_sharding(torch.ops.aten.view.default, (spec, [6, 16, 4, 16]), {})
        rows = _compat.propagate_sharding(torch.ops.aten.view.default, (spec, [96, 64]), {})
        assert tuple(heads.output_spec.tensor_meta.shape) == (6, 16, 4, 16)
        assert tuple(heads.output_spec.placements) == (Shard(0), Shard(2))
        assert tuple(rows.output_spec.tensor_meta.shape) == (96, 64)
        assert tuple(rows.output_spec.placements) == (Shard(0), Shard(1))
