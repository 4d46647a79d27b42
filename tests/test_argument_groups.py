"""vlmtrain.TrainingArguments is the trainer core's arguments plus the group each higher layer declares
(vlmtrain/evaluation/arguments.py, vlmtrain/logging/arguments.py, compat's CompatArguments): the trainer core
reads no field of a group, each name is declared once, and a group's checks run in their place among the core's,
so a configuration with several mistakes always gets the same (first) error."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from vlmtrain import TrainingArguments
from vlmtrain.compat.arguments_fields import CompatArguments
from vlmtrain.errors import ConfigError
from vlmtrain.evaluation.arguments import EvaluationArguments
from vlmtrain.logging.arguments import LoggingArguments
from vlmtrain.trainer.args_fields import CoreArguments

TRAINER_DIR = Path(__file__).resolve().parents[1] / "src" / "vlmtrain" / "trainer"
GROUPS = (EvaluationArguments, LoggingArguments, CompatArguments)


def _attribute_reads(tree: ast.AST) -> list[tuple[str, int]]:
    """(name, line) of every `x.name` and every getattr/hasattr/setattr(x, "name") in ``tree``."""
    reads = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            reads.append((node.attr, node.lineno))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "hasattr", "setattr") and len(node.args) > 1
              and isinstance(node.args[1], ast.Constant)):
            reads.append((node.args[1].value, node.lineno))
    return reads


def test_the_trainer_core_reads_no_field_of_a_higher_layers_group_and_each_name_is_declared_once():
    owner = {f.name: group.__name__ for group in GROUPS for f in dataclasses.fields(group)}
    reads = [f"{path.name}:{line} reads {name} ({owner[name]})" for path in sorted(TRAINER_DIR.glob("*.py"))
             for name, line in _attribute_reads(ast.parse(path.read_text())) if name in owner]
    assert reads == []
    declared = [f.name for cls in (CoreArguments, *GROUPS) for f in dataclasses.fields(cls)]
    assert len(declared) == len(set(declared))
    fields = [f.name for f in dataclasses.fields(TrainingArguments)]
    assert fields[:len(declared)] == declared and fields[0] == "output_dir"  # then transformers' other names


@pytest.mark.parametrize("mistakes, first", [
    ({"fp16": True, "async_eval_launcher": "x"}, "fp16=True is not supported by vlmtrain"),  # compat's first
    ({"load_best_model_at_end": True, "lmms_eval_limit": 0}, "load_best_model_at_end=True needs eval_strategy"),
    ({"lmms_eval_limit": 0, "max_eval_batches": 0}, "lmms_eval_limit must be >= 1"),
    ({"max_eval_batches": 0, "async_eval_max_pending": 0}, "max_eval_batches must be >= 1"),
    ({"async_eval_max_pending": 0, "peak_tflops": 0}, "async_eval_max_pending must be >= 1"),
])
def test_a_groups_checks_run_in_their_place_among_the_cores(tmp_path, mistakes, first):
    with pytest.raises(ConfigError, match=first):
        TrainingArguments(output_dir=str(tmp_path), **mistakes)
    assert TrainingArguments(output_dir=str(tmp_path), disable_tqdm=None).disable_tqdm is False  # (logging's)
