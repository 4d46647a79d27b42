"""The extras check (optional_extras.py, registered by conftest.py): a test skipped for a missing package fails
the run where the extras are required (CI=true, VLMTRAIN_REQUIRE_EXTRAS=1) and is a skip with its reason
otherwise; a gpu test's skip stays a skip. Each case is a pytest subprocess on two small test files next to the
suite's own conftest.py and optional_extras.py."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from optional_extras import extras_required

HERE = Path(__file__).parent

MARKED = '''
import pytest
from optional_extras import requires


def test_runs():
    pass


@requires("no_such_package_xyz", "lora")
def test_needs_a_missing_extra():
    pass


@pytest.mark.gpu
def test_on_a_gpu():
    pass
'''

MODULE_LEVEL = '''
import pytest

pytest.importorskip("no_such_package_xyz")


def test_never_collected():
    pass
'''


def _pytest(tmp_path: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    for name in ("conftest.py", "optional_extras.py"):
        shutil.copy(HERE / name, tmp_path / name)
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    gpu: needs CUDA\n")
    (tmp_path / "test_marked.py").write_text(MARKED)
    (tmp_path / "test_module_level.py").write_text(MODULE_LEVEL)
    # (this run's own CI / VLMTRAIN_REQUIRE_EXTRAS and pytest-xdist worker variables stay out)
    base = {k: v for k, v in os.environ.items()
            if k not in ("CI", "VLMTRAIN_REQUIRE_EXTRAS") and not k.startswith("PYTEST_")}
    return subprocess.run([sys.executable, "-m", "pytest", "-rs", "-p", "no:cacheprovider", *args], cwd=tmp_path,
                          env={**base, **env}, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("env, args, fails", [
    ({}, (), False),
    ({"CI": "true"}, (), True),
    pytest.param({"CI": "true"}, ("-n", "2"), True, marks=pytest.mark.slow),  # xdist: the controller decides
    ({"CI": "true"}, ("test_marked.py", "-k", "not missing"), False),  # only the gpu test skips
], ids=["local", "ci", "ci-xdist", "ci-gpu-skip-only"])
def test_a_skip_for_a_missing_package_fails_where_extras_are_required(tmp_path, env, args, fails):
    out = _pytest(tmp_path, env, *args)
    text = out.stdout + out.stderr
    assert out.returncode == (1 if fails else 0), text
    assert "1 passed" in text  # the rest of the run still ran
    # -rs: every skip with its reason
    assert "gpu test: run the gpu tests with -m gpu" in text
    if "not missing" not in args:
        assert "no_such_package_xyz is not installed (pip install 'vlmtrain[lora]')" in text
        assert "could not import 'no_such_package_xyz'" in text
    header, _, rest = text.partition("skipped for a missing package: the dev extra installs it")
    assert bool(rest) == fails
    listed = sorted(rest.partition("The extras are required")[0].strip().splitlines()[1:])  # (after the ====)
    if fails:  # both missing-package skips listed, the gpu skip not
        assert len(listed) == 2, listed
        assert listed[0] == "test_marked.py::test_needs_a_missing_extra: no_such_package_xyz is not installed " \
                            "(pip install 'vlmtrain[lora]')"
        assert listed[1].startswith("test_module_level.py: could not import 'no_such_package_xyz'")


@pytest.mark.parametrize("env, required", [
    ({}, False), ({"CI": "true"}, True), ({"CI": "1"}, True), ({"CI": "false"}, False),
    ({"VLMTRAIN_REQUIRE_EXTRAS": "1"}, True), ({"CI": "true", "VLMTRAIN_REQUIRE_EXTRAS": "0"}, False)])
def test_when_extras_are_required(monkeypatch, env, required):
    """CI=true requires them; VLMTRAIN_REQUIRE_EXTRAS=1/0 decides over CI (0: a CI job on a minimal install)."""
    for name in ("CI", "VLMTRAIN_REQUIRE_EXTRAS"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert extras_required() is required
