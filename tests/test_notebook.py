"""``examples/debugging.ipynb`` runs end to end in a real Jupyter kernel (nbclient), importing this checkout's
torch_autopar; and ``autopar.notebook_launcher`` relays every rank's output and re-raises a rank's exception.

The kernel is this interpreter (jupyter_client runs a "python" kernel spec with ``sys.executable``), started in
the repository root with the repository on PYTHONPATH.
"""

from __future__ import annotations

import os
import pathlib
import sys

import pytest
import torch

import torch_autopar as autopar
from torch_autopar.launch.notebook import RankError

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
KernelManager = pytest.importorskip("jupyter_client").KernelManager

REPO = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOK = REPO / "examples" / "debugging.ipynb"
PROBE = "import sys, torch_autopar; print('kernel:', sys.executable, torch_autopar.__file__)"


def _text(cell) -> str:
    parts = []
    for output in cell.get("outputs", []):
        if output["output_type"] == "stream":
            parts.append(output["text"])
        elif output["output_type"] in ("execute_result", "display_data"):
            parts.extend(str(value) for value in output["data"].values())
        elif output["output_type"] == "error":
            parts.append(f"{output['ename']}: {output['evalue']}\n" + "\n".join(output["traceback"]))
    return "".join(parts)


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    notebook.cells.append(nbformat.v4.new_code_cell(PROBE))  # which torch_autopar the kernel imported
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    sockets = tmp_path_factory.mktemp("kernel") / "ipc"  # local socket files, not TCP, and not in the checkout
    kernel = KernelManager(kernel_name="python3", transport="ipc", ip=str(sockets))
    client = nbclient.NotebookClient(notebook, km=kernel, timeout=240, resources={"metadata": {"path": str(REPO)}})
    client.execute(env=env)
    return notebook


def _cell(notebook, fragment: str):
    return next(cell for cell in notebook.cells if cell.cell_type == "code" and fragment in cell.source)


def test_notebook_imports_this_checkout(executed):
    kernel_python, module_file = _text(_cell(executed, PROBE)).split()[1:3]
    assert pathlib.Path(module_file).resolve().is_relative_to(REPO)
    assert pathlib.Path(kernel_python).resolve() == pathlib.Path(sys.executable).resolve()


def test_print_inside_forward_shows_in_eager_mode(executed):
    text = _text(_cell(executed, "eager loss in the notebook"))
    assert "[forward] rank 0: x (8, 16)" in text and "eager loss in the notebook:" in text


def test_progress_bar_in_the_notebook(executed):
    assert "one process: 100%" in _text(_cell(executed, 'desc="one process"'))


def test_plan_shows_as_an_html_table(executed):
    outputs = _cell(executed, "plan = autopar.plan(").outputs
    html = outputs[0]["data"]["text/html"]
    assert "<table>" in html and "<th>layer</th>" in html and "<td>hidden</td>" in html


def test_every_rank_output_is_shown_prefixed(executed):
    text = _text(_cell(executed, "eager_losses = autopar.notebook_launcher"))
    for rank in (0, 1):
        assert f"[rank {rank}] [forward] rank {rank}: x (4, 16)" in text, text
        assert f"[rank {rank}] eager losses: [" in text, text
    assert "[rank 0] eager training: 100%" in text, text
    assert "[rank 1] eager training" not in text


def test_graph_mode_gives_the_same_losses(executed):
    text = _text(_cell(executed, "graph_losses = autopar.notebook_launcher"))
    assert "same losses in eager and graph mode: True" in text, text


def test_an_exception_in_a_rank_is_raised_in_the_notebook(executed):
    (raising,) = [cell for cell in executed.cells if "raises-exception" in cell.metadata.get("tags", [])]
    text = _text(raising)
    assert "RankError: torch_autopar: rank 1 of 2 raised ValueError: rank 1 found a sample" in text, text
    assert "Traceback of rank 1" in text and "in broken" in text, text
    caught = _text(_cell(executed, "except autopar.AutoparError as error"))
    assert "RankError from rank 1: ValueError" in caught


# the launcher outside a notebook (fork from this process) ---------------------------------------------------------
def _sum_of_ranks(offset):
    value = torch.tensor([float(autopar.get_rank() + offset)])
    torch.distributed.all_reduce(value)
    print(f"sum {value.item()}")
    return value.item()


def _fails_on_rank_0():
    if autopar.get_rank() == 0:
        raise KeyError("missing")
    torch.distributed.barrier()


def test_launcher_returns_results_in_rank_order_and_relays_output(capsys):
    assert autopar.notebook_launcher(_sum_of_ranks, args=(1,), nprocs=2, timeout=30) == [3.0, 3.0]
    lines = capsys.readouterr().out.splitlines()
    assert sorted(lines) == ["[rank 0] sum 3.0", "[rank 1] sum 3.0"]


def test_launcher_raises_the_failing_rank_not_the_one_that_lost_its_peer():
    with pytest.raises(RankError, match=r"^torch_autopar: rank 0 of 2 raised KeyError: 'missing'") as info:
        autopar.notebook_launcher(_fails_on_rank_0, nprocs=2, timeout=30)
    assert info.value.rank == 0 and "in _fails_on_rank_0" in str(info.value.__cause__)


def test_launcher_refuses_bad_nprocs():
    with pytest.raises(autopar.AutoparError, match=r"^torch_autopar: notebook_launcher\(nprocs=0\)"):
        autopar.notebook_launcher(_sum_of_ranks, nprocs=0)


def test_launcher_in_the_main_module_is_importable():
    assert "notebook_launcher" in autopar.__all__ and sys.modules["torch_autopar.launch.notebook"]


def _listening_addresses():
    import subprocess

    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout
    mine = [line.split() for line in out.splitlines() if f"pid={os.getpid()}," in line]
    return [fields[3] for fields in mine], os.environ.get("GLOO_SOCKET_IFNAME")


@pytest.mark.skipif(not pathlib.Path("/usr/bin/ss").exists() and not pathlib.Path("/bin/ss").exists(),
                    reason="needs ss (Linux iproute2) to list listening sockets")
def test_launched_ranks_listen_on_loopback_only():
    for addresses, interface in autopar.notebook_launcher(_listening_addresses, nprocs=2, timeout=30):
        assert interface == "lo"
        assert all(address.startswith("127.0.0.1:") for address in addresses), addresses
