"""The README stays true: every config key is documented, and its commands exist."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from vlmtrain.config import DataConfig, ModelConfig
from vlmtrain.trainer.args import TrainingArguments

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


@pytest.mark.parametrize("cls", [ModelConfig, DataConfig, TrainingArguments])
def test_every_config_key_is_in_the_reference(cls):
    documented = set(re.findall(r"^\| `(\w+)` \|", README, flags=re.M))
    missing = [f.name for f in dataclasses.fields(cls) if f.name not in documented]
    assert not missing, f"README config reference lacks {cls.__name__} keys {missing}"


def test_the_two_commands_exist():
    for script in ("scripts/demo.sh", "scripts/test.sh"):
        assert f"bash {script}" in README
        assert (ROOT / script).is_file()
    assert "scripts/test.sh" in (ROOT / ".ci" / "run").read_text()


def test_shipped_configs_are_named_in_the_readme():
    for path in (ROOT / "configs").glob("*.yaml"):
        assert f"configs/{path.name}" in README, f"README does not mention configs/{path.name}"
