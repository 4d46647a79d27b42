"""What a newcomer copies from the README and docs/*.md works as written: every `pip install` of vlmtrain is the
clone's editable install (vlmtrain is not on PyPI) with extras that pyproject.toml defines, and torchvision is
installed as the build of the installed torch."""

from __future__ import annotations

import re
from pathlib import Path

import tomllib
import torch

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
EXTRAS = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
# A `pip install ...` command, up to the end of its code span, line or shell comment (`\[` is the reference's
# escaped bracket).
PIP = re.compile(r"pip install\s+([^`\n#|]*)")
TARGET = re.compile(r"""(?P<name>vlmtrain|\.)\\?\[(?P<extras>[^\]\\]*)\\?\]""")


def _commands() -> list[tuple[str, str]]:
    return [(page.relative_to(ROOT).as_posix(), m.group(1).strip()) for page in PAGES if page.name != "changelog.md"
            for m in PIP.finditer(page.read_text())]


def test_every_pip_install_of_vlmtrain_is_the_clones_with_extras_pyproject_defines():
    found, wrong = 0, []
    for page, command in _commands():
        for m in TARGET.finditer(command):
            found += 1
            extras = {e.strip() for e in m.group("extras").split(",")}
            if m.group("name") == "vlmtrain" or "-e" not in command.split() or not extras <= EXTRAS:
                wrong.append(f"{page}: pip install {command}")
    assert found > 10, found  # (the pattern still finds the install lines)
    assert not wrong, "vlmtrain is installed from a clone: pip install -e \".[EXTRA]\" with an extra of " \
                      "pyproject.toml:\n" + "\n".join(wrong)


def test_torchvision_is_installed_as_the_installed_torchs_build():
    """A bare `pip install torchvision` replaces a CPU torch with the newest CUDA one (and ~17 nvidia packages):
    the docs pin torchvision 0.(N+15) for torch 2.N from PyTorch's CPU index."""
    major, minor = (int(p) for p in torch.__version__.split(".")[:2])
    assert major == 2
    commands = [(page, c) for page, c in _commands() if re.search(r"\btorchvision\b", c)]
    assert commands
    for page, command in commands:
        assert f"torchvision==0.{minor + 15}." in command, (page, command)
        assert "--index-url https://download.pytorch.org/whl/cpu" in command, (page, command)
