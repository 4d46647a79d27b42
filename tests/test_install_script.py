"""scripts/install.sh (and demo.sh / test.sh through it) decides what to install: the torch build (kept, CUDA
where an NVIDIA driver answers, else the CPU index where reachable, else the plain pin), the extras, and what to
say on an externally managed Python. Run against a stub interpreter that records each pip call (no install,
no network) and a stub nvidia-smi."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CPU_INDEX = "https://download.pytorch.org/whl/cpu"

STUB = """#!{python}
import json, os, sys
args = sys.argv[1:]
code = args[1] if args[:1] == ["-c"] else ""
if "EXTERNALLY-MANAGED" in code:
    print(os.environ.get("STUB_MANAGED", "0"))
    sys.exit(0)
if "import torch" in code:
    if os.environ.get("STUB_TORCH"):
        print(os.environ["STUB_TORCH"])
        sys.exit(0)
    sys.exit(1)
if "urlopen" in code:
    sys.exit(0 if os.environ.get("STUB_REACHABLE") == "1" else 1)
with open(os.environ["STUB_LOG"], "a") as f:
    f.write(json.dumps(args) + "\\n")
if args[:3] == ["-m", "pip", "install"] and os.environ.get("STUB_PIP_MANAGED"):
    print("error: externally-managed-environment")
    sys.exit(1)
sys.exit(0)
"""


def _run(tmp_path: Path, script: str = "install.sh", torch: str = "", driver: bool = False,
         reachable: bool = False, managed: bool = False, pip_managed: bool = False,
         extras: str | None = None) -> tuple[subprocess.CompletedProcess, list[list[str]]]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    python = bin_dir / "python"
    python.write_text(STUB.format(python=sys.executable))
    smi = bin_dir / "nvidia-smi"
    smi.write_text(f"#!/bin/sh\nexit {0 if driver else 9}\n")
    for path in (python, smi):
        path.chmod(0o755)
    log = tmp_path / "calls.jsonl"
    log.unlink(missing_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in ("VLMTRAIN_EXTRAS", "PIP_BREAK_SYSTEM_PACKAGES")}
    env.update(PYTHON=str(python), PATH=f"{bin_dir}{os.pathsep}{env['PATH']}", STUB_LOG=str(log),
               STUB_TORCH=torch, STUB_REACHABLE="1" if reachable else "0", STUB_MANAGED="1" if managed else "0",
               STUB_PIP_MANAGED="1" if pip_managed else "")
    if extras is not None:
        env["VLMTRAIN_EXTRAS"] = extras
    proc = subprocess.run(["bash", str(ROOT / "scripts" / script)], env=env, capture_output=True, text=True,
                          timeout=60)
    calls = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    return proc, calls


def _pip(calls: list[list[str]]) -> list[list[str]]:
    return [c[4:] for c in calls if c[:4] == ["-m", "pip", "install", "--quiet"]]


@pytest.mark.parametrize("case, expected, said", [
    ({"torch": "2.11.0+cu128", "driver": True}, None, "torch 2.11.0+cu128 is installed: kept"),
    ({"driver": True, "reachable": True}, ["torch==2.13.0"], "an NVIDIA driver answers"),
    ({"reachable": True}, ["torch==2.13.0", "--index-url", CPU_INDEX], f"CPU build of torch==2.13.0 from {CPU_INDEX}"),
    ({}, ["torch==2.13.0"], f"{CPU_INDEX} is not reachable"),
])
def test_torch_is_kept_or_the_build_fits_the_machine(tmp_path, case, expected, said):
    proc, calls = _run(tmp_path, **case)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    torch_calls = [c for c in _pip(calls) if c[0].startswith("torch")]
    assert torch_calls == ([expected] if expected else [])
    assert said in proc.stdout
    assert _pip(calls)[-1] == ["-e", "."]  # the core: what the demo needs


def test_extras_and_lmms_eval(tmp_path):
    _, calls = _run(tmp_path, torch="2.13.0", extras="[dev]")
    assert _pip(calls) == [["-e", ".[dev]"], ["--no-deps", "lmms-eval==0.7.3"]]
    _, calls = _run(tmp_path, torch="2.13.0", extras="[lora,wandb]")
    assert _pip(calls) == [["-e", ".[lora,wandb]"]]


def test_demo_installs_the_core_and_tests_the_dev_extra(tmp_path):
    proc, calls = _run(tmp_path, "demo.sh", torch="2.13.0")
    assert proc.returncode == 0 and _pip(calls) == [["-e", "."]] and calls[-1] == ["-m", "vlmtrain", "demo"]
    proc, calls = _run(tmp_path, "test.sh", torch="2.13.0")
    assert proc.returncode == 0 and _pip(calls) == [["-e", ".[dev]"], ["--no-deps", "lmms-eval==0.7.3"]]
    assert calls[-1][:2] == ["-m", "pytest"]
    assert calls[-1][calls[-1].index("--dist") + 1] == "worksteal"  # (conftest.py's longest-first order holds)


def test_the_suite_starts_with_its_longest_tests_longest_first():
    """tests/conftest.py moves conftest.LONGEST_FIRST to the front in its order (the rest keep theirs), and each
    name there is a test of the suite (a renamed one would silently start late again)."""
    from types import SimpleNamespace

    from conftest import LONGEST_FIRST, pytest_collection_modifyitems

    names = ["test_a", *reversed(LONGEST_FIRST), "test_b", "test_c[x]"]
    items = [SimpleNamespace(name=n, get_closest_marker=lambda _: None) for n in names]
    pytest_collection_modifyitems(None, items)
    assert [i.name for i in items] == [*LONGEST_FIRST, "test_a", "test_b", "test_c[x]"]
    defined = "\n".join(p.read_text() for p in (ROOT / "tests").glob("test_*.py"))
    assert len(LONGEST_FIRST) >= 4 and all(f"def {n}(" in defined for n in LONGEST_FIRST)


def test_an_externally_managed_python_gets_told_to_use_a_venv(tmp_path):
    proc, calls = _run(tmp_path, managed=True)
    assert proc.returncode != 0 and calls == []  # nothing tried
    assert "managed by the operating system" in proc.stdout and "-m venv .venv" in proc.stdout
    proc, calls = _run(tmp_path, torch="2.13.0", pip_managed=True)  # pip's own refusal (no marker seen)
    assert proc.returncode != 0 and len(_pip(calls)) == 1
    assert "externally-managed-environment" in proc.stdout and "-m venv .venv" in proc.stdout
