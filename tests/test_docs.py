"""The documentation site stays true and builds: the configuration reference is generated from the config
dataclasses' field docstrings (one source), every key has a docstring, the home page is the README, and
`mkdocs build --strict` passes (a broken link, an anchor that does not exist, a page missing from the nav or a
mkdocstrings error fails it, naming the file)."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from optional_extras import requires

from vlmtrain.compat.arguments import TrainingArguments
from vlmtrain.config import DataConfig, ModelConfig

ROOT = Path(__file__).resolve().parents[1]


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the script runs
    spec.loader.exec_module(module)
    return module


gen_config = _script("gen_config_reference")
gen_index = _script("gen_docs_index")


def test_every_config_key_has_a_docstring():
    missing = gen_config.missing_docs()
    assert not missing, "config keys without a docstring (write one under the field):\n" + "\n".join(missing)


@dataclasses.dataclass
class _Section:
    documented: int = 1
    """A key with its docstring."""
    bare: int = 2


def test_a_key_without_a_docstring_is_named_with_its_file():
    assert gen_config.missing_docs({"model": _Section}) == ["tests/test_docs.py: model.bare"]


def test_the_configuration_page_is_generated_from_the_docstrings():
    page = ROOT / "docs" / "configuration.md"
    assert page.read_text() == gen_config.render(), (
        "docs/configuration.md differs from the config dataclasses' docstrings: run "
        "python scripts/gen_config_reference.py")


@pytest.mark.parametrize("cls", [ModelConfig, DataConfig, TrainingArguments])
def test_every_config_key_is_in_the_reference(cls):
    page = (ROOT / "docs" / "configuration.md").read_text()
    documented = set(re.findall(r"^\| `(\w+)` \|", page, flags=re.M))
    missing = [f.name for f in dataclasses.fields(cls) if f.name not in documented]
    assert not missing, f"docs/configuration.md lacks {cls.__name__} keys {missing}"


def test_the_home_page_is_the_readme():
    assert (ROOT / "docs" / "index.md").read_text() == gen_index.render((ROOT / "README.md").read_text()), (
        "docs/index.md differs from README.md: run python scripts/gen_docs_index.py")


def _build(root: Path, site: Path) -> subprocess.CompletedProcess:
    # Not -q: mkdocs counts warnings for --strict only when they are logged.
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f",
                           str(root / "mkdocs.yml"), "-d", str(site)],
                          cwd=root, env=env, capture_output=True, text=True, timeout=300)


@requires("mkdocs", "docs")
@requires("mkdocstrings", "docs")
def test_the_site_builds_strictly(tmp_path):
    done = _build(ROOT, tmp_path / "site")
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{done.stdout}\n{done.stderr}"
    api = (tmp_path / "site" / "api" / "index.html").read_text()
    for name in ("vlmtrain.Trainer.train", "vlmtrain.TrainingArguments", "vlmtrain.load_for_inference",
                 "vlmtrain.attach_heads", "vlmtrain.TrainerCallback"):
        assert f'id="{name}"' in api, f"API reference lacks {name}"


@requires("mkdocs", "docs")
@requires("mkdocstrings", "docs")
def test_a_broken_link_or_a_page_outside_the_nav_fails_the_build_naming_the_file(tmp_path):
    copy = tmp_path / "repo"
    shutil.copytree(ROOT / "docs", copy / "docs")
    shutil.copy(ROOT / "mkdocs.yml", copy)
    for name in ("src", "CHANGELOG.md"):
        (copy / name).symlink_to(ROOT / name)
    with open(copy / "docs" / "data.md", "a") as f:
        f.write("\nSee [the missing page](no-such-page.md).\n")
    (copy / "docs" / "orphan.md").write_text("# Not in the nav\n")
    done = _build(copy, tmp_path / "site")
    out = done.stdout + done.stderr
    assert done.returncode != 0
    assert "data.md" in out and "no-such-page.md" in out, out
    assert "orphan.md" in out, out


def _anchors(page: Path) -> set[str]:
    """The heading anchors of a Markdown page as the site builds them (the toc extension's slugs)."""
    headings = re.findall(r"^#+ (.+)$", page.read_text(), re.M)
    return {re.sub(r"[-\s]+", "-", re.sub(r"[^\w\s-]", "", h).strip().lower()) for h in headings}


def _named_pages(text: str) -> list[str]:
    return re.findall(r"docs/[\w/-]+\.md(?:#[\w-]+)?", text)


def test_vlmtrain_help_and_every_command_help_name_their_docs_page(capsys):
    """`vlmtrain --help` names each command's page, and `vlmtrain COMMAND --help` its own: every named page is
    a file in docs/ and every #anchor one of its headings."""
    from vlmtrain.cli import COMMANDS, DOCS, main

    assert main(["--help"]) == 0
    usage = capsys.readouterr().out
    assert set(DOCS) == set(COMMANDS)
    for command in COMMANDS:
        assert main([command, "--help"]) == 0
        own = capsys.readouterr().out
        first = DOCS[command].split()[0]
        assert f"Documentation: {first}" in own, (command, own)
        assert f"docs: {DOCS[command]}" in usage
        for named in _named_pages(own):
            path, _, anchor = named.partition("#")
            assert (ROOT / path).is_file(), f"vlmtrain {command} --help names {path}, which does not exist"
            assert not anchor or anchor in _anchors(ROOT / path), f"{path} has no heading #{anchor}"
    assert len(_named_pages(usage)) >= len(COMMANDS) + 1 and "docs/index.md" in usage
