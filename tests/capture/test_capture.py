"""Capture: forward + backward of models ``torch.fx.symbolic_trace`` cannot handle (keyword inputs, dict and
dataclass outputs), on fake or meta tensors; and those models compiled and run in one process."""

from __future__ import annotations

import dataclasses
import logging
import warnings

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.utils._pytree as pytree

import torch_autopar as autopar
from torch_autopar._compat import FakeTensor
from torch_autopar.capture import CapturedProgram, capture, fake_global_inputs
from torch_autopar.testing.models import GPT, GPTConfig


class KeywordsToDict(nn.Module):
    """Keyword-only inputs (one optional tensor, one scalar tensor), control flow on a shape, a dict output."""

    def __init__(self):
        super().__init__()
        self.encoder = nn.Linear(8, 16)
        self.head = nn.Linear(16, 3)
        self.register_buffer("offset", torch.full((3,), 0.5))

    def forward(self, x, *, scale, mask=None):
        if x.dim() == 3:  # symbolic_trace cannot branch on a Proxy; capture sees concrete shapes
            x = x.flatten(0, 1)
        hidden = torch.tanh(self.encoder(x))
        if mask is not None:
            hidden = hidden * mask
        return {"logits": self.head(hidden) * scale + self.offset, "hidden": hidden}


@dataclasses.dataclass
class Output:
    logits: torch.Tensor
    aux_loss: torch.Tensor


pytree.register_dataclass(Output)


@dataclasses.dataclass
class UnregisteredOutput:
    logits: torch.Tensor
    aux_loss: torch.Tensor


class ToDataclass(nn.Module):
    def __init__(self, output_type=Output):
        super().__init__()
        self.output_type = output_type
        self.linear = nn.Linear(8, 3)

    def forward(self, x):
        logits = self.linear(x)
        return self.output_type(logits=logits, aux_loss=logits.square().mean())


def _inputs(batch=4):
    generator = torch.Generator().manual_seed(0)
    return torch.randn(batch, 8, generator=generator), torch.randint(0, 2, (batch, 16), generator=generator).float()


def test_symbolic_trace_cannot_handle_this_model():
    with pytest.raises(fx.proxy.TraceError):
        fx.symbolic_trace(KeywordsToDict())


def test_fake_global_inputs_scale_the_batch_without_data():
    x, mask = _inputs()
    args, kwargs = fake_global_inputs(KeywordsToDict(), (x,), {"mask": mask, "scale": torch.tensor(2.0), "n": 3}, 4)
    assert isinstance(args[0], FakeTensor) and args[0].shape == (16, 8)
    assert kwargs["mask"].shape == (16, 16) and kwargs["scale"].shape == ()
    assert kwargs["n"] == 3
    with torch.device("meta"):
        meta_model = KeywordsToDict()
    (meta_x,), _ = fake_global_inputs(meta_model, (x,), {}, 2)
    assert meta_x.device.type == "meta" and meta_x.shape == (8, 8)


def _check_program(program: CapturedProgram, module: nn.Module, num_inputs: int, num_outputs: int):
    names = [name for name, _ in module.named_parameters()]
    assert list(program.params) == names
    assert set(program.grad_nodes) == set(names)
    assert sorted(program.grad_ready_order()) == sorted(names)
    for name, p in module.named_parameters():
        assert program.params[name].shape == tuple(p.shape)
        assert program.grad_nodes[name].meta["val"].shape == p.shape
        assert program.param_nodes[name].op == "placeholder"
    assert sorted(program.input_nodes) == list(range(num_inputs))
    assert sorted(program.output_nodes) == list(range(num_outputs))
    assert sorted(program.tangent_nodes.values()) == list(range(num_outputs))
    assert all(program.is_backward(node) for node in program.grad_nodes.values())
    assert not any(program.is_backward(node) for node in program.output_nodes.values())


def test_capture_keyword_inputs_and_dict_output():
    module = KeywordsToDict()
    x, mask = _inputs()
    args, kwargs = fake_global_inputs(module, (x,), {"mask": mask, "scale": torch.tensor(2.0)}, 2)
    program = capture(module, args, kwargs)
    _check_program(program, module, num_inputs=3, num_outputs=2)
    assert list(program.buffers) == ["offset"]
    assert {n.meta["val"].shape for n in program.output_nodes.values()} == {torch.Size([8, 3]), torch.Size([8, 16])}


def test_capture_registered_dataclass_output():
    module = ToDataclass()
    args, kwargs = fake_global_inputs(module, (_inputs()[0],), {}, 1)
    program = capture(module, args, kwargs)
    _check_program(program, module, num_inputs=1, num_outputs=2)
    assert [tuple(program.output_nodes[i].meta["val"].shape) for i in range(2)] == [(4, 3), ()]


def test_capture_meta_device_gpt():
    with torch.device("meta"):
        module = GPT(GPTConfig(n_layer=3))
    program = capture(module, (torch.empty(2, 8, dtype=torch.long, device="meta"),), {})
    _check_program(program, module, num_inputs=1, num_outputs=1)
    assert program.output_nodes[0].meta["val"].shape == (2, 8, 96)
    # backward finishes the last block's gradients before the first block's
    order = program.grad_ready_order()
    assert order.index("blocks.2.fc.weight") < order.index("blocks.0.fc.weight")


@pytest.mark.parametrize("mode", ["eager", "graph"])
def test_compile_and_run_keyword_inputs_and_dict_output(mode):
    torch.manual_seed(0)
    module = KeywordsToDict()
    torch.manual_seed(0)
    plain = KeywordsToDict()
    x, mask = _inputs()
    scale = torch.tensor(2.0)
    pmodel = autopar.compile(module, mode=mode)
    output = pmodel(x, mask=mask, scale=scale)
    expected = plain(x, mask=mask, scale=scale)
    assert output.keys() == {"logits", "hidden"}
    for key in output:
        torch.testing.assert_close(output[key], expected[key], rtol=1e-6, atol=1e-6)
    (output["logits"].sum() + output["hidden"].square().sum()).backward()
    (expected["logits"].sum() + expected["hidden"].square().sum()).backward()
    for (name, p), q in zip(module.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


def test_plan_with_example_kwargs():
    x, mask = _inputs(8)
    plan = autopar.plan(KeywordsToDict(), (x,), example_kwargs={"mask": mask, "scale": torch.tensor(1.0)},
                        mesh_shape=(4,), strategy="data_parallel")
    assert plan.global_batch == 8
    assert sorted(plan.param_placements) == sorted(n for n, _ in KeywordsToDict().named_parameters())
    keywords_only = autopar.plan(KeywordsToDict(), example_kwargs={"x": x, "mask": mask, "scale": torch.tensor(1.0)},
                                 mesh_shape=(4,), strategy="data_parallel")  # as transformers models are called
    assert keywords_only.global_batch == 8
    assert keywords_only.param_placements == plan.param_placements


@pytest.mark.parametrize("mode", ["eager", "graph"])
def test_compile_and_run_dataclass_output(mode):
    torch.manual_seed(0)
    module = ToDataclass()
    torch.manual_seed(0)
    plain = ToDataclass()
    x = _inputs()[0]
    output = autopar.compile(module, mode=mode)(x)
    expected = plain(x)
    assert isinstance(output, Output)
    torch.testing.assert_close(output.logits, expected.logits, rtol=1e-6, atol=1e-6)
    (output.logits.sum() + output.aux_loss).backward()
    (expected.logits.sum() + expected.aux_loss).backward()
    torch.testing.assert_close(module.linear.weight.grad, plain.linear.weight.grad, rtol=1e-5, atol=1e-6)


def test_compile_and_run_unregistered_dataclass_output():
    torch.manual_seed(0)
    module = ToDataclass(UnregisteredOutput)
    torch.manual_seed(0)
    plain = ToDataclass(UnregisteredOutput)
    x = _inputs()[0]
    output = autopar.compile(module)(x)
    assert isinstance(output, UnregisteredOutput)
    torch.testing.assert_close(output.logits, plain(x).logits, rtol=1e-6, atol=1e-6)


_LOG = logging.getLogger("torch_autopar.test")


class _Chatty(nn.Module):
    """Library-style code: a warning, a logger call and a ``torch._check`` in forward."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        warnings.warn("torch_autopar test: a library warning")
        _LOG.warning("a library log line %d", 3)
        torch._check(x.shape[0] > 0)
        return self.fc(x)


def test_warnings_logging_and_checks_do_not_break_capture():
    program = capture(_Chatty(), (torch.randn(2, 4),), {})
    assert set(program.params) == {"fc.weight", "fc.bias"}


def test_warnings_and_logging_do_not_break_graph_mode():
    model = _Chatty()
    x = torch.randn(2, 4)
    compiled = autopar.compile(model, x, strategy="stand_alone", mode="graph")
    with pytest.warns(UserWarning, match="a library warning"):
        expected = model(x)  # eager still warns
    torch.testing.assert_close(compiled(x), expected, rtol=0, atol=0)
