"""The trainer's slots (trainer/plugins.py) are filled by the layers above it as `vlmtrain` is imported, so a
script that imports only `vlmtrain.trainer` gets the same Trainer as `from vlmtrain import Trainer`: the same
loggers, the same transformers argument refusals, the same async evaluation and eval-sample files."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from vlmtrain.errors import ConfigError
from vlmtrain.trainer import plugins

# Run in a fresh interpreter that imports vlmtrain.trainer alone (never `vlmtrain` by name).
SCRIPT = r"""
import json, sys
from vlmtrain import Trainer, TrainingArguments
from vlmtrain.errors import ConfigError
import torch

errors = []
for bad in ({"report_to": "neptune"}, {"fp16": True}, {"fsdp": "offload"},
            {"async_eval": True, "save_strategy": "no"}):
    try:
        TrainingArguments(output_dir=sys.argv[1], **bad)
    except ConfigError as e:
        errors.append(str(e))
converted = TrainingArguments(output_dir=sys.argv[1], gradient_checkpointing=True, fsdp="full_shard auto_wrap",
                              lr_scheduler_kwargs='{"num_cycles": "2"}', report_to="none")
args = TrainingArguments(output_dir=sys.argv[1], disable_tqdm=True, async_eval=True,
                         async_eval_command=["true", "{result_file}"])
trainer = Trainer(model=torch.nn.Linear(2, 2), args=args)
print(json.dumps({"errors": errors, "callbacks": [type(cb).__name__ for cb in trainer.callback_handler.callbacks],
                  "args": [converted.activation_checkpointing, converted.fsdp, converted.lr_scheduler_kwargs,
                           converted.report_to],
                  "evaluator": type(trainer._async_eval).__name__}))
"""


def test_every_slot_is_filled_by_import_vlmtrain():
    import vlmtrain  # noqa: F401

    empty = [slot for slot in plugins.SLOTS if plugins.lookup(slot) is None]
    assert not empty, f"trainer slots nothing fills when vlmtrain is imported: {empty}"


def test_importing_only_vlmtrain_trainer_gets_the_loggers_checks_and_evaluator(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([p for p in sys.path if p])}
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], capture_output=True, text=True, env=env,
                         check=True).stdout
    got = json.loads(out.strip().splitlines()[-1])
    assert got["errors"] == [
        "report_to='neptune' is not implemented by vlmtrain; implemented: none, jsonl, tensorboard, wandb, mlflow, "
        "trackio, all (metrics.jsonl is always written).",
        "fp16=True is not supported by vlmtrain; use bf16=True (bfloat16 autocast, no loss scaling needed).",
        "fsdp='offload': 'offload' is not supported by vlmtrain; CPU offload is not supported; use more ranks or "
        "activation_checkpointing.",
        "async_eval evaluates saved checkpoints: set save_strategy to steps or epoch.",
    ]
    assert got["callbacks"] == ["DefaultFlowCallback", "PrinterCallback", "JsonlLoggerCallback"]
    assert got["args"] == [True, True, {"num_cycles": 2}, []]
    assert got["evaluator"] == "AsyncEvaluator"


def test_the_fsdp_plan_in_the_sharding_slot_has_every_method_the_trainer_calls(monkeypatch):
    import torch

    from vlmtrain.parallel import fsdp
    from vlmtrain.trainer import distributed, sharding

    assert plugins.lookup("sharding") is fsdp.FSDP_PLAN
    methods = [name for name in vars(sharding.ShardingPlan) if not name.startswith("_")]
    assert len(methods) == 8 and all(callable(getattr(fsdp.FSDP_PLAN, name, None)) for name in methods)
    model = torch.nn.Linear(2, 2)
    assert sharding.sharding_of(model) is None  # an unsharded model takes the plain path
    # train.fsdp with several ranks and no plan registered: a ConfigError that says what to import
    monkeypatch.setattr(distributed, "world_size", lambda: 2)
    monkeypatch.delitem(plugins._filled, "sharding")
    with pytest.raises(ConfigError, match="import vlmtrain before building the Trainer"):
        distributed.wrap_model(model, torch.device("cpu"), fsdp=True)
