"""examples/run_classification.py, a run_*.py-style script written for transformers' Trainer (HfArgumentParser,
train / evaluate / predict, log_metrics / save_metrics / save_state), run with vlmtrain's
Trainer and, the import line swapped, with transformers': the same files, metrics and printed tables."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import numpy as np
import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "run_classification.py"
OUR_IMPORT = "from vlmtrain import Trainer, TrainingArguments"
# One batch per epoch: the two Trainers shuffle differently, the whole set per step makes their steps equal.
ARGV = ["--do_train", "--do_eval", "--do_predict", "--eval_strategy", "epoch", "--save_strategy", "epoch",
        "--num_train_epochs", "5", "--learning_rate", "0.5", "--per_device_train_batch_size", "64",
        "--logging_steps", "1", "--report_to", "none", "--optim", "adamw_torch", "--disable_tqdm", "true"]
TIMINGS = ("_runtime", "_per_second")


def _script(framework: str, monkeypatch) -> types.ModuleType:
    source = SCRIPT.read_text()
    assert source.count(OUR_IMPORT) == 1
    if framework == "hf":
        source = source.replace(OUR_IMPORT, "from transformers import Trainer, TrainingArguments")
    module = types.ModuleType(f"run_classification_{framework}")
    monkeypatch.setitem(sys.modules, module.__name__, module)  # (dataclasses look their module up)
    exec(compile(source, str(SCRIPT), "exec"), module.__dict__)
    return module


def _run(framework: str, out: Path, capsys, monkeypatch) -> str:
    script = _script(framework, monkeypatch)
    argv = ["--output_dir", str(out), *ARGV]
    data_args, training_args = script.parse_args(argv)  # HfArgumentParser, with either TrainingArguments
    capsys.readouterr()
    script.main(data_args, training_args)
    return capsys.readouterr().out


def _table(printed: str) -> dict[str, list[str]]:
    """The keys log_metrics printed, per `***** <split> metrics *****` block."""
    tables: dict[str, list[str]] = {}
    current = None
    for line in printed.splitlines():
        if line.startswith("***** "):
            current = tables.setdefault(line.split()[1], [])
        elif current is not None and line.startswith("  ") and " = " in line:
            current.append(line.split(" = ")[0].strip())
    return tables


def _untimed(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if not k.endswith(TIMINGS)}


def test_run_script_same_results_with_both_trainers(tmp_path, capsys, monkeypatch):
    printed = {fw: _run(fw, tmp_path / fw, capsys, monkeypatch) for fw in ("hf", "ours")}
    hf, ours = tmp_path / "hf", tmp_path / "ours"
    assert _table(printed["ours"]) == _table(printed["hf"])
    assert set(_table(printed["ours"])) == {"train", "eval", "predict"}
    for name in ("train_results.json", "eval_results.json", "predict_results.json", "all_results.json"):
        mine, theirs = json.loads((ours / name).read_text()), json.loads((hf / name).read_text())
        assert set(mine) == set(theirs), name
        assert _untimed(mine) == pytest.approx(_untimed(theirs), rel=1e-5), name
    results = json.loads((ours / "all_results.json").read_text())
    assert results["eval_accuracy"] > 0.5 and results["eval_samples"] == 16 and results["train_samples"] == 64
    mine, theirs = (json.loads((d / "trainer_state.json").read_text()) for d in (ours, hf))
    # (vlmtrain's evaluation rows add eval_samples, the sample count; nothing else differs)
    assert [set(r) - {"eval_samples"} for r in mine["log_history"]] == [set(r) for r in theirs["log_history"]]
    assert [r["step"] for r in mine["log_history"]] == [r["step"] for r in theirs["log_history"]]
    assert mine["global_step"] == theirs["global_step"] == 5
    np.testing.assert_array_equal(np.load(ours / "predictions.npy"), np.load(hf / "predictions.npy"))
