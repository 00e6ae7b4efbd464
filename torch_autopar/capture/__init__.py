"""Capture: an ``nn.Module`` and example inputs → one aten-level FX graph of forward + backward.

Shapes live on fake or meta tensors, so a model far larger than this machine can be captured. Must never
allocate real memory for parameters, run a real forward, or decide anything about placement.
"""

from torch_autopar.capture.program import CapturedProgram, TensorInfo, capture, fake_global_inputs

__all__ = ["CapturedProgram", "TensorInfo", "capture", "fake_global_inputs"]
