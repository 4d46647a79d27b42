"""The README stays true: short, its commands and configs exist, and it speaks to users."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
PAGES = sorted((ROOT / "docs").rglob("*.md"))


def test_the_readme_is_short():
    assert len(README.splitlines()) <= 250, "README.md is over 250 lines: move the depth into docs/"


def test_the_two_commands_exist():
    for script in ("scripts/demo.sh", "scripts/test.sh"):
        assert f"bash {script}" in README
        assert (ROOT / script).is_file()
    assert "scripts/test.sh" in (ROOT / ".ci" / "run").read_text()


def test_shipped_configs_are_named_in_the_readme():
    for path in (ROOT / "configs").glob("*.yaml"):
        assert f"configs/{path.name}" in README, f"README does not mention configs/{path.name}"


def test_the_readme_links_to_files_that_exist():
    for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", README):
        assert (ROOT / target).exists(), f"README links to {target}, which does not exist"


def test_no_page_speaks_in_internal_references():
    # A user cannot follow "issue 13", "the seed job" or "an earlier session".
    pattern = re.compile(r"\bissue \d+|\bissue's\b|\bseed 0\d\d\b|\bsession\b", re.I)
    for path in [ROOT / "README.md", ROOT / "CHANGELOG.md", *PAGES]:
        hits = [line for line in path.read_text().splitlines() if pattern.search(line)]
        assert not hits, f"{path.relative_to(ROOT)}: {hits[:3]}"


def test_the_stated_size_of_the_trainer_is_its_measured_size():
    """README and docs/trainer.md say how many lines the trainer package has: a stale number is a bug."""
    measured = sum(len(p.read_text().splitlines(keepends=True)) for p in (ROOT / "src/vlmtrain/trainer").glob("*.py"))
    for name, text in (("README.md", README), ("docs/trainer.md", (ROOT / "docs" / "trainer.md").read_text())):
        stated = re.search(r"`(?:src/)?vlmtrain/trainer/`\)? (?:package )?is ([\d,]+) lines", text)
        assert stated, f"{name} no longer states the trainer's size"
        assert int(stated.group(1).replace(",", "")) == measured, (
            f"{name} says the trainer is {stated.group(1)} lines; `cat src/vlmtrain/trainer/*.py | wc -l` gives "
            f"{measured}")
