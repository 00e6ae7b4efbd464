"""Meshes: the throw-away fake process group ``offline_mesh`` plans on, and checks of mesh shapes."""

from __future__ import annotations

import pytest
import torch.distributed as dist

import torch_autopar as autopar
from torch_autopar.launch import default_axis_names, offline_mesh
from torch_autopar.testing import fake_process_group


def test_offline_mesh_lives_only_for_its_block():
    with offline_mesh((4, 16)) as mesh:
        assert dist.is_initialized() and dist.get_world_size() == 64
        assert tuple(mesh.shape) == (4, 16) and mesh.mesh_dim_names == ("dp", "tp")
    assert not dist.is_initialized()


def test_offline_mesh_tears_down_after_an_error():
    with pytest.raises(ValueError):
        with offline_mesh((8,)):
            raise ValueError("planning failed")
    assert not dist.is_initialized()


def test_offline_mesh_inside_a_group_of_the_same_size_reuses_it():
    with fake_process_group(8):
        with offline_mesh((2, 4), ("dp", "tp")) as mesh:
            assert tuple(mesh.shape) == (2, 4)
        assert dist.is_initialized()  # the caller's group survives
        with pytest.raises(autopar.AutoparError, match=r"^torch_autopar: cannot plan for 16 devices inside a running "
                                                       r"job of 8 ranks"):
            with offline_mesh((16,)):
                pass
    assert not dist.is_initialized()


def test_fake_process_group_refuses_nesting():
    with fake_process_group(2):
        with pytest.raises(AssertionError):
            with fake_process_group(2):
                pass


@pytest.mark.parametrize(("shape", "pattern"), [((0, 4), "positive sizes"), ((), "positive sizes"),
                                                ((-2,), "positive sizes")])
def test_bad_mesh_shapes(shape, pattern):
    with pytest.raises(autopar.AutoparError, match=r"^torch_autopar: mesh_shape: .*" + pattern):
        with offline_mesh(shape):
            pass
    assert not dist.is_initialized()


def test_default_axis_names():
    assert default_axis_names(1) == ("dp",)
    assert default_axis_names(2) == ("dp", "tp")
    assert default_axis_names(3) == ("dp", "cp", "tp")
    assert default_axis_names(4) == ("axis0", "axis1", "axis2", "axis3")
