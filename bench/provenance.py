"""Which code a benchmark measured: the commit and the library files that differed from it at the start.

Others may edit the working tree while a benchmark runs, so results record both. Must never change the tree.
"""

from __future__ import annotations

import os
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10).stdout.rstrip()
    except (OSError, subprocess.SubprocessError):
        return ""


def code_state() -> dict:
    """{"head": commit, "uncommitted_library_files": porcelain lines for torch_autopar/ and bench/}."""
    return {"head": _git("rev-parse", "HEAD"),
            "uncommitted_files": _git("status", "--porcelain", "torch_autopar", "bench").splitlines()}


def write_report(report: dict, output: str, load_before) -> None:
    """Write a bench's JSON report and say where, how long it took and how loaded the machine was."""
    import json

    os.makedirs(os.path.dirname(output), exist_ok=True)
    with open(output, "w") as handle:
        json.dump(report, handle, indent=1)
    print(f"\nwrote {os.path.relpath(output)} in {report['wall_s']:.0f} s "
          f"(load average before {load_before[0]:.1f}, after {report['machine']['loadavg_after'][0]:.1f})")
