"""Test helpers shipped with torch_autopar: run a function on N gloo ranks, plan on fake process groups,
small reference models. Must never be imported by the library itself."""

from torch_autopar.testing.dist import fake_process_group, run_on_ranks

__all__ = ["fake_process_group", "run_on_ranks"]
