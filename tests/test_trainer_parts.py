"""The trainer's parts (trainer/parts.py): one frozen dataclass that the Trainer class holds. Every part is used
by the core and set by vlmtrain.Trainer; a subclass or a call swaps one for that Trainer alone; the class carries
its parts, so no import has to fill anything (a script importing vlmtrain.compat.trainer without the package's
__init__ gets the same Trainer); docs/trainer.md's table of parts is generated from the dataclass."""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import inspect
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tiny import tiny_llama, token_samples

import vlmtrain
from vlmtrain.errors import ConfigError
from vlmtrain.models.speed import flops
from vlmtrain.trainer import TrainerCore, TrainerParts, parts

ROOT = Path(__file__).resolve().parents[1]
TRAINER_DIR = ROOT / "src" / "vlmtrain" / "trainer"
FIELDS = [f.name for f in dataclasses.fields(TrainerParts)]

pytestmark = pytest.mark.usefixtures("one_thread")


def _args(out, **kw) -> vlmtrain.TrainingArguments:
    kw = {"max_steps": 3, "per_device_train_batch_size": 4, "logging_steps": 1, "save_strategy": "no",
          "disable_tqdm": True, "report_to": "none", **kw}
    return vlmtrain.TrainingArguments(output_dir=str(out), **kw)


def test_every_part_is_used_by_the_core_and_set_by_vlmtrain_trainer():
    core = "\n".join(p.read_text() for p in sorted(TRAINER_DIR.glob("*.py")) if p.name != "parts.py")
    unused = [name for name in FIELDS if not re.search(rf"\bparts\.{name}\b", core)]
    assert not unused, f"TrainerParts fields the trainer core never reads (parts.<field>): {unused}"
    default = TrainerParts()
    unset = [name for name in FIELDS if getattr(vlmtrain.Trainer.parts, name) is getattr(default, name)]
    assert not unset, f"parts vlmtrain.Trainer leaves at the core's default (vlmtrain/compat/trainer.py): {unset}"
    assert TrainerCore.parts == default and vlmtrain.Trainer.parts.flop_counter is flops.flop_counter


def test_every_part_has_a_docstring_and_the_parts_are_frozen():
    tree = ast.parse(inspect.getsource(parts))
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "TrainerParts")
    documented = {node.target.id for node, nxt in zip(cls.body, cls.body[1:])
                  if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr)
                  and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str)}
    assert documented == set(FIELDS), f"parts without a docstring under them: {set(FIELDS) - documented}"
    with pytest.raises(dataclasses.FrozenInstanceError):
        vlmtrain.Trainer.parts.flop_counter = None


def test_a_misspelt_part_is_an_error():
    with pytest.raises(TypeError, match="flops_counter"):
        dataclasses.replace(vlmtrain.Trainer.parts, flops_counter=None)


class CountingFlops:
    """A flop_counter part: every batch is 1e18 FLOPs; counts the batches it was asked about."""

    def __init__(self) -> None:
        self.batches = 0

    def __call__(self, model: torch.nn.Module):
        def count(batch) -> float:
            self.batches += 1
            return 1e18
        return count


def _tflops(trainer) -> list[float]:
    """The tflops_per_second of the training rows of the Trainer's metrics.jsonl."""
    with open(os.path.join(trainer.args.output_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return [row["tflops_per_second"] for row in rows if "tflops_per_second" in row]


def test_swapping_a_part_on_a_subclass_or_a_call_changes_that_trainer_only(tmp_path):
    mine = CountingFlops()

    class MyTrainer(vlmtrain.Trainer):
        parts = dataclasses.replace(vlmtrain.Trainer.parts, flop_counter=mine)

    ours = MyTrainer(tiny_llama(), _args(tmp_path / "mine"), train_dataset=token_samples(12))
    ours.train()
    stock = vlmtrain.Trainer(tiny_llama(), _args(tmp_path / "stock"), train_dataset=token_samples(12))
    stock.train()
    assert mine.batches == 3  # one micro-batch per step, counted by this Trainer's part alone
    assert len(_tflops(ours)) == len(_tflops(stock)) == 3
    assert min(_tflops(ours)) > 1e3 > 1 > max(_tflops(stock))  # 1e18 FLOPs a batch vs a tiny Llama's count
    assert vlmtrain.Trainer.parts.flop_counter is flops.flop_counter and stock.parts is vlmtrain.Trainer.parts

    # Trainer(parts=...): that instance only; no flop counter at all, so no tflops_per_second
    bare = vlmtrain.Trainer(tiny_llama(), _args(tmp_path / "call"), train_dataset=token_samples(12),
                            parts=dataclasses.replace(vlmtrain.Trainer.parts, flop_counter=None))
    bare.train()
    assert _tflops(bare) == [] and bare.parts.flop_counter is None
    assert vlmtrain.Trainer(tiny_llama(), _args(tmp_path / "after")).parts.flop_counter is flops.flop_counter


def test_the_core_alone_refuses_what_needs_a_part_naming_it(tmp_path, monkeypatch):
    from vlmtrain.trainer import distributed

    with pytest.raises(ConfigError, match="label_smoothing_factor needs the trainer part 'label_smoothing'"):
        TrainerCore(tiny_llama(), _args(tmp_path, label_smoothing_factor=0.1))
    with pytest.raises(ConfigError, match="activation_checkpointing=True needs the trainer part "
                                          "'activation_checkpointing'"):
        TrainerCore(tiny_llama(), _args(tmp_path, activation_checkpointing=True))
    stats = TrainerParts().window_stats(None, None)  # the core's: skipped samples not counted, logged or saved
    stats.add_batch({"skipped": {"bad_image": 1}}, 0.0)
    assert stats.compute(stats.over_ranks()) == stats.run_totals(True) == stats.state_dict() == {}
    with pytest.raises(RuntimeError, match="model_init is vlmtrain.Trainer's"):  # (transformers': compat/)
        TrainerCore(model_init=tiny_llama, args=_args(tmp_path))
    core = TrainerCore(tiny_llama(), vlmtrain.TrainingArguments(output_dir=str(tmp_path), report_to="none"))
    assert [type(cb).__name__ for cb in core.callback_handler.callbacks] == ["DefaultFlowCallback"]
    assert core.data_collator is None  # (torch's default_collate)
    # a checkpoint that another number of processes wrote: the reposition part's (the core's own refuses it)
    saving = _args(tmp_path / "ranks", max_steps=2, save_strategy="steps", save_steps=2)
    vlmtrain.Trainer(tiny_llama(), saving, train_dataset=token_samples(8)).train()
    checkpoint = tmp_path / "ranks" / "checkpoint-2"
    shutil.copy(checkpoint / "loop_state_0.pt", checkpoint / "loop_state_1.pt")  # (as 2 processes write it)
    plain = dataclasses.replace(vlmtrain.Trainer.parts, reposition=TrainerParts().reposition)
    with pytest.raises(ConfigError, match="of dataloader_num_workers needs the trainer part 'reposition'"):
        vlmtrain.Trainer(tiny_llama(), saving, train_dataset=token_samples(8), parts=plain).train(str(checkpoint))
    # train.fsdp with several ranks and no sharding part: a ConfigError that names it
    monkeypatch.setattr(distributed, "world_size", lambda: 2)
    with pytest.raises(ConfigError, match="need the trainer part 'sharding'"):
        distributed.wrap_model(torch.nn.Linear(2, 2), torch.device("cpu"), fsdp=True)


def test_the_fsdp_plan_has_every_method_the_trainer_calls():
    from vlmtrain.parallel import fsdp
    from vlmtrain.trainer import sharding

    assert vlmtrain.Trainer.parts.sharding is fsdp.FSDP_PLAN
    methods = [name for name in vars(sharding.ShardingPlan) if not name.startswith("_")]
    assert len(methods) == 9 and all(callable(getattr(fsdp.FSDP_PLAN, name, None)) for name in methods)
    assert sharding.sharding_of(torch.nn.Linear(2, 2), fsdp.FSDP_PLAN) is None  # unsharded: the plain path


# A fresh interpreter trains a tiny model with vlmtrain.Trainer: "package" imports vlmtrain.trainer first (Python
# runs vlmtrain/__init__ first); "bare" skips vlmtrain/__init__ altogether (an empty package module stands in for
# it) and imports vlmtrain.compat.trainer alone, so nothing the package's __init__ imports can fill anything.
SCRIPT = r"""
import importlib.util, json, sys, types
mode, out = sys.argv[1], sys.argv[2]
if mode == "bare":
    package = types.ModuleType("vlmtrain")
    package.__path__ = list(importlib.util.find_spec("vlmtrain").submodule_search_locations)
    sys.modules["vlmtrain"] = package
    from vlmtrain.compat.trainer import Trainer
    from vlmtrain.compat.arguments import TrainingArguments
else:
    import vlmtrain.trainer
    from vlmtrain import Trainer, TrainingArguments
from vlmtrain.errors import ConfigError
from tiny import tiny_llama, token_samples
import torch
torch.set_num_threads(1)

errors = []
for bad in ({"report_to": "neptune"}, {"fp16": True}):
    try:
        TrainingArguments(output_dir=out, **bad)
    except ConfigError as e:
        errors.append(str(e))
evaluating = TrainingArguments(output_dir=out + "/eval", disable_tqdm=True, async_eval=True,
                               async_eval_command=["true", "{result_file}"])
evaluator = type(Trainer(model=torch.nn.Linear(2, 2), args=evaluating)._async_eval).__name__
args = TrainingArguments(output_dir=out, max_steps=2, per_device_train_batch_size=4, logging_steps=1,
                         save_strategy="no", disable_tqdm=True, report_to="none")
trainer = Trainer(model=tiny_llama(), args=args, train_dataset=token_samples(8))
trainer.train()
rows = [json.loads(line) for line in open(out + "/metrics.jsonl")]
print(json.dumps({"errors": errors, "modules": sorted(m for m in sys.modules if m == "vlmtrain.tasks"),
                  "callbacks": [type(cb).__name__ for cb in trainer.callback_handler.every_callback],
                  "collator": type(trainer.data_collator).__name__, "evaluator": evaluator,
                  "losses": [row["loss"] for row in rows if "loss" in row],
                  "keys": sorted(set().union(*rows))}))
"""


def _run(mode: str, out: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([p for p in sys.path if p]), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", SCRIPT, mode, str(out)], capture_output=True, text=True, env=env,
                          cwd=Path(__file__).parent)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_trainer_class_carries_its_parts_whatever_is_imported_first(tmp_path):
    package, bare = _run("package", tmp_path / "package"), _run("bare", tmp_path / "bare")
    assert package["modules"] == ["vlmtrain.tasks"] and bare["modules"] == []  # (the package's __init__ ran or not)
    for got in (package, bare):
        got.pop("modules")
    assert bare == package
    assert package["callbacks"] == ["JsonlLoggerCallback", "DefaultFlowCallback", "PrinterCallback"]
    assert (package["collator"], package["evaluator"]) == ("DefaultCollator", "AsyncEvaluator")
    assert len(package["errors"]) == 2 and len(package["losses"]) == 2
    assert {"tflops_per_second", "tokens_per_second", "grad_norm", "learning_rate"} <= set(package["keys"])


def test_the_table_of_parts_in_the_docs_is_generated_from_the_dataclass():
    spec = importlib.util.spec_from_file_location("gen_trainer_parts", ROOT / "scripts" / "gen_trainer_parts.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    page = (ROOT / "docs" / "trainer.md").read_text()
    assert gen.page_with_table(page) == page, "docs/trainer.md's parts table is stale: python scripts/gen_trainer_parts.py"
    assert all(f"| `{name}` |" in page for name in FIELDS)
