"""``python -m torch_autopar plan MODULE:FACTORY ...``: the factories below are what the command imports.

The command runs as a subprocess from the repository root (so ``tests.test_cli`` imports); argument mistakes
are also checked in process through ``cli.main`` (faster, same code)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch
import torch.nn as nn

import torch_autopar as autopar
from torch_autopar import cli
from torch_autopar.testing.models import GPT, GPTConfig, MLP

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HERE = "tests.test_cli"


# factories (called by the command under torch.device("meta")) ------------------------------------------------
def mlp_with_inputs():
    return MLP(), torch.empty(16, 32)


def tiny_gpt():
    return GPT(GPTConfig(n_layer=2))


class TwoInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 4), nn.Linear(6, 4)

    def forward(self, x, y):
        return self.a(x) + self.b(y)


def two_inputs():
    return TwoInputs()


SEEN_DEVICES = []


def records_its_device():
    SEEN_DEVICES.append(torch.empty(1).device.type)
    return MLP(), torch.empty(8, 32)


def not_a_module():
    return 42


# subprocess --------------------------------------------------------------------------------------------------
def _run(*args) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "torch_autopar", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=240)


def test_plan_command_prints_the_explanation_and_saves_the_plan(tmp_path):
    path = tmp_path / "plan.json"
    done = _run("plan", f"{HERE}:mlp_with_inputs", "--mesh", "2", "--hardware", "cpu-gloo", "--memory", "1GiB",
                "--strategy", "data_parallel", "--json", str(path))
    assert done.returncode == 0, done.stderr
    with torch.device("meta"):
        model = MLP()
    expected = autopar.plan(model, torch.empty(16, 32, device="meta"), mesh_shape=(2,), hardware="cpu-gloo",
                            strategy="data_parallel", memory_budget=1 << 30)
    assert done.stdout == expected.explain() + f"\nplan saved to {path}\n"
    saved = autopar.Plan.load(path)
    assert saved.fingerprint == expected.fingerprint and saved.mesh_shape == (2,)
    assert saved.param_placements == expected.param_placements
    assert set(saved.param_placements.values()) == {("R",)}
    assert saved.collectives == expected.collectives and saved.global_batch == 16


# in process --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("text", "expected"), [
    ("80GB", 80 * 10**9), ("24GiB", 24 << 30), ("512MB", 512 * 10**6), ("512mib", 512 << 20), ("1.5TB", 15 * 10**11),
    ("4096", 4096), ("64 KiB", 64 << 10), ("2tib", 2 << 40), ("100B", 100),
])
def test_parse_memory(text, expected):
    assert cli.parse_memory(text) == expected


@pytest.mark.parametrize("text", ["", "GB", "80 GBs", "-1GB", "eighty", "80XB", "1e9"])
def test_parse_memory_rejects(text):
    with pytest.raises(autopar.AutoparError, match=r"^torch_autopar: --memory .*expected a size such as 80GB"):
        cli.parse_memory(text)


def test_parse_shape():
    assert cli.parse_shape("8x8", "--mesh") == (8, 8)
    assert cli.parse_shape("64", "--mesh") == (64,)
    assert cli.parse_shape("4X8x2", "--mesh") == (4, 8, 2)
    for bad in ["", "8x", "8x0", "x8", "8,8", "a"]:
        with pytest.raises(autopar.AutoparError, match=r"^torch_autopar: --mesh .*positive sizes joined by 'x'"):
            cli.parse_shape(bad, "--mesh")


def _main(capsys, *args) -> tuple[int, str, str]:
    status = cli.main(list(args))
    captured = capsys.readouterr()
    return status, captured.out, captured.err


@pytest.mark.parametrize(("args", "message"), [
    ([f"{HERE}:tiny_gpt", "--mesh", "2"],
     r"tests.test_cli:tiny_gpt returned a module without example inputs; pass --batch"),
    (["nothing_here"], r"'nothing_here': expected MODULE:FACTORY"),
    (["no_such_module_xyz:f"], r"could not import module 'no_such_module_xyz'"),
    ([f"{HERE}:missing"], r"module 'tests.test_cli' has no attribute 'missing'"),
    ([f"{HERE}:ROOT"], r"'ROOT' is a str, expected a function or class"),
    ([f"{HERE}:not_a_module"], r"returned int; expected an nn.Module or a \(module, example_inputs\) tuple"),
    ([f"{HERE}:mlp_with_inputs", "--memory", "lots"], r"--memory 'lots'"),
    ([f"{HERE}:mlp_with_inputs", "--mesh", "2x"], r"--mesh '2x'"),
    ([f"{HERE}:tiny_gpt", "--batch", "4x16", "--dtype", "complex"], r"--dtype 'complex': expected one of"),
    ([f"{HERE}:mlp_with_inputs", "--strategy", "pipeline"], r"strategy='pipeline' is not a known strategy"),
    ([f"{HERE}:mlp_with_inputs", "--hardware", "tpu-v9"], r"hardware='tpu-v9'"),
    ([f"{HERE}:mlp_with_inputs", "--mesh", "2", "--memory", "1KB"], r"no .*fits the memory budget"),
])
def test_mistakes_are_torch_autopar_errors(capsys, args, message):
    status, out, err = _main(capsys, "plan", *args)
    assert status == 1 and out == ""
    assert err.startswith("torch_autopar: ") and "Traceback" not in err
    assert re.search(message, err), err


def test_batch_shape_on_a_2d_mesh(capsys):
    status, out, err = _main(capsys, "plan", f"{HERE}:tiny_gpt", "--mesh", "2x2", "--batch", "4x16", "--dtype",
                             "long", "--strategy", "data_parallel", "--hardware", "h100", "--axis-names", "dp,tp")
    assert status == 0, err
    first = out.splitlines()[0]
    assert first == "torch_autopar plan: strategy=data_parallel  mesh: dp=2 x tp=2  hardware=h100  global batch=4"
    assert "all_reduce     grad_sync dp" in out and "all_reduce     grad_sync tp" in out


def test_factory_runs_on_the_meta_device(capsys):
    SEEN_DEVICES.clear()
    status, out, _ = _main(capsys, "plan", f"{HERE}:records_its_device", "--strategy", "data_parallel")
    assert status == 0 and SEEN_DEVICES == ["meta"]
    assert out.startswith("torch_autopar plan: strategy=data_parallel  mesh: dp=1")


def test_input_shapes_give_several_inputs_and_replace_the_factory_ones(capsys, tmp_path):
    path = tmp_path / "two.json"
    status, _, err = _main(capsys, "plan", f"{HERE}:two_inputs", "--mesh", "2", "--strategy", "data_parallel",
                           "--input-shape", "12x8", "--input-shape", "12x6:float32", "--json", str(path))
    assert status == 0, err
    plan = autopar.Plan.load(path)
    assert plan.global_batch == 12 and sorted(plan.input_placements) == [0, 1]
    status, _, err = _main(capsys, "plan", f"{HERE}:mlp_with_inputs", "--batch", "6x32", "--json", str(path))
    assert status == 0, err
    assert autopar.Plan.load(path).global_batch == 6


def test_a_factory_in_a_file_path(capsys, tmp_path):
    source = tmp_path / "my_models.py"
    source.write_text("import torch\nfrom torch_autopar.testing.models import MLP\n\n"
                      "def build():\n    return MLP(), torch.empty(4, 32)\n")
    status, out, err = _main(capsys, "plan", f"{source}:build", "--strategy", "data_parallel")
    assert status == 0, err
    assert "global batch=4" in out.splitlines()[0]
