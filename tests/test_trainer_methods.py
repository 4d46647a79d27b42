"""transformers' public Trainer methods on vlmtrain's Trainer: the table in docs/migrating.md lists every one of
the installed transformers (same / different / refused); the helpers scripts call give what transformers' give;
the refused ones raise, naming what to do instead."""

from __future__ import annotations

import inspect
import json
import re
from pathlib import Path

import pytest
import torch
import transformers
from tiny import tiny_llama, token_samples

import vlmtrain

DOC = Path(__file__).resolve().parents[1] / "docs" / "migrating.md"
STATUSES = {"same", "different", "refused"}


def _transformers_methods() -> set[str]:
    return {name for name, value in inspect.getmembers(transformers.Trainer)
            if not name.startswith("_") and (callable(value) or isinstance(value, property))}


def _table() -> dict[str, tuple[str, str]]:
    text = DOC.read_text()
    section = text.split("## Trainer methods", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `(\w+)` \| (\w+) \|(.*)\|$", section, flags=re.M)
    return {name: (status, notes.strip()) for name, status, notes in rows}


def test_migrating_table_lists_every_transformers_trainer_method():
    table = _table()
    assert set(table) == _transformers_methods()
    assert {status for status, _ in table.values()} <= STATUSES
    for name, (status, notes) in table.items():
        assert hasattr(vlmtrain.Trainer, name), name
        assert status == "same" or notes, f"{name}: say how it differs or why it is refused"


@pytest.mark.parametrize("name", sorted(n for n, (status, _) in _table().items() if status == "refused"))
def test_refused_methods_raise_naming_the_alternative(tmp_path, name):
    trainer = vlmtrain.Trainer(model=tiny_llama(), args=_args("ours", tmp_path))
    with pytest.raises(NotImplementedError, match=rf"Trainer\.{name}\(\) is not supported by vlmtrain: .+ Instead: "):
        getattr(trainer, name)()


def test_documented_methods_do_not_refuse(tmp_path):
    """A method the table calls same/different is implemented, not one of the refusing stubs."""
    trainer = vlmtrain.Trainer(model=tiny_llama(), args=_args("ours", tmp_path))
    for name, (status, _) in _table().items():
        source = inspect.getsource(getattr(type(trainer), name)) if callable(getattr(type(trainer), name)) else ""
        assert ("_refuse(" in source) == (status == "refused"), name


def _args(framework: str, out, **kw):
    base = dict(output_dir=str(out / framework), report_to="none", disable_tqdm=True, optim="adamw_torch",
                per_device_train_batch_size=2, per_device_eval_batch_size=3, max_steps=4, learning_rate=1e-3)
    base.update(kw)
    if framework == "hf":
        return transformers.TrainingArguments(use_cpu=True, **base)
    return vlmtrain.TrainingArguments(**base)


def _pair(tmp_path, **kw):
    data = token_samples(7, min_len=6, max_len=6)
    return {fw: cls(model=tiny_llama(), args=_args(fw, tmp_path, **kw), train_dataset=data, eval_dataset=data)
            for fw, cls in (("hf", transformers.Trainer), ("ours", vlmtrain.Trainer))}


METRICS = {"train_runtime": 3725.25, "train_loss": 1.234567891, "total_flos": 3 * 2**30, "epoch": 2.0,
           "eval_accuracy": 0.875, "train_samples": 64}


def test_log_metrics_save_metrics_save_state_as_transformers(tmp_path, capsys):
    printed, files = {}, {}
    for fw, trainer in _pair(tmp_path).items():
        assert trainer.is_world_process_zero() and trainer.is_local_process_zero()
        capsys.readouterr()
        trainer.log_metrics("train", METRICS)
        printed[fw] = capsys.readouterr().out
        trainer.save_metrics("train", METRICS)
        trainer.save_metrics("eval", {"eval_loss": 0.5}, combined=True)
        trainer.save_metrics("test", {"test_loss": 0.25}, combined=False)
        trainer.save_state()
        out = tmp_path / fw
        files[fw] = {p.name: p.read_text() for p in out.glob("*_results.json")}
        files[fw]["state_keys"] = sorted(json.loads((out / "trainer_state.json").read_text()))
    assert printed["ours"] == printed["hf"]
    assert "= 1:02:05.25" in printed["ours"] and "=        3GF" in printed["ours"]
    assert files["ours"] == files["hf"]
    assert set(json.loads(files["ours"]["all_results.json"])) == set(METRICS) | {"eval_loss"}


def test_helpers_give_what_transformers_gives(tmp_path):
    results = {}
    for fw, trainer in _pair(tmp_path, gradient_accumulation_steps=3).items():
        trainer.create_optimizer_and_scheduler(num_training_steps=4)
        batch = next(iter(trainer.get_test_dataloader(token_samples(5, min_len=6, max_len=6))))
        batches, count = trainer.get_batch_samples(iter([batch, batch]), 2, torch.device("cpu"))
        weight = trainer.model.model.embed_tokens.weight
        results[fw] = {
            "optimizer": trainer.optimizer is not None and trainer.lr_scheduler is not None,
            "learning_rates": trainer.get_learning_rates(),
            "group_of_embedding": weight in trainer.get_optimizer_group(weight)["params"],
            "trainable": trainer.get_num_trainable_parameters(),
            "decay": sorted(trainer.get_decay_parameter_names(trainer.model)),
            "flos": trainer.floating_point_ops(batch),
            "batch": {k: v.tolist() for k, v in batch.items()},
            "batch_samples": (len(batches), int(count)),
            "total_batch": trainer.get_total_train_batch_size(trainer.args),
            "num_examples": trainer.num_examples(trainer.get_eval_dataloader()),
            "parallel": (trainer.get_tp_size(), trainer.get_cp_size(), trainer.get_sp_size()),
            "format": transformers.trainer_pt_utils.metrics_format(METRICS) if fw == "hf"
            else trainer.metrics_format(METRICS),
        }
    assert results["ours"] == results["hf"]
    assert results["ours"]["batch_samples"] == (2, 2 * 3 * 4)  # 3 rows x 4 targets (shifted, prompt masked), twice
    assert results["ours"]["decay"] and not any("norm" in n for n in results["ours"]["decay"])


def test_create_model_card_writes_a_readme(tmp_path):
    trainer = _pair(tmp_path)["ours"]
    trainer.train()
    trainer.evaluate()
    trainer.create_model_card(model_name="tiny", finetuned_from="base/model", language="en", tags=["a"])
    card = (tmp_path / "ours" / "README.md").read_text()
    assert "license" not in card  # (none given: not written)
    assert 'language: "en"' in card and 'base_model: "base/model"' in card and "# tiny" in card
    assert "- learning_rate: 0.001" in card and "- eval_loss: " in card


def test_the_public_trainer_is_the_core_with_transformers_methods(tmp_path, capsys):
    """vlmtrain.Trainer is a TrainerCore with transformers' extra methods, which a user subclass reaches through
    super(). The core's package names no Trainer (it never imports the compat layer): asking it for one says
    where it is."""
    import vlmtrain.trainer
    from vlmtrain.trainer import TrainerCore

    star: dict = {}
    exec("from vlmtrain.trainer import *", star)
    assert "Trainer" not in star and star["TrainerCore"] is TrainerCore
    with pytest.raises(AttributeError, match=r"vlmtrain.trainer has no Trainer: it is vlmtrain.Trainer"):
        vlmtrain.trainer.Trainer  # noqa: B018
    assert issubclass(vlmtrain.Trainer, TrainerCore) and not hasattr(TrainerCore, "log_metrics")

    class Mine(vlmtrain.Trainer):
        def log_metrics(self, split, metrics):
            print("mine")
            super().log_metrics(split, metrics)

    trainer = Mine(model=tiny_llama(), args=_args("ours", tmp_path))
    capsys.readouterr()
    trainer.log_metrics("train", {"train_loss": 0.5})
    assert capsys.readouterr().out == "mine\n***** train metrics *****\n  train_loss = 0.5\n"


def test_the_public_arguments_and_callbacks_are_the_compat_layers_and_a_trainer_without_args_gets_them(
        tmp_path, monkeypatch):
    """vlmtrain.TrainingArguments (the core's TrainingArgumentsCore with transformers' other names) and
    EarlyStoppingCallback are the compat layer's, which the core's package does not name; a Trainer built without
    args gets vlmtrain.TrainingArguments() (its arguments_class part), with transformers' names and derived
    values, as transformers' Trainer does."""
    import vlmtrain.trainer
    from vlmtrain.trainer import TrainingArgumentsCore

    star: dict = {}
    exec("from vlmtrain.trainer import *", star)
    assert not {"TrainingArguments", "EarlyStoppingCallback"} & set(star)
    for name in ("TrainingArguments", "EarlyStoppingCallback"):
        with pytest.raises(AttributeError, match=f"it is vlmtrain.{name}"):
            getattr(vlmtrain.trainer, name)
    assert vlmtrain.Trainer.parts.arguments_class is vlmtrain.TrainingArguments
    assert issubclass(vlmtrain.TrainingArguments, TrainingArgumentsCore) and not hasattr(TrainingArgumentsCore, "do_eval")
    monkeypatch.chdir(tmp_path)
    trainer = vlmtrain.Trainer(model=tiny_llama())
    assert type(trainer.args) is vlmtrain.TrainingArguments
    assert (trainer.args.output_dir, trainer.args.do_eval, trainer.args.world_size) == ("trainer_output", False, 1)


def test_sgd_is_built_as_transformers_builds_it(tmp_path):
    """optim='sgd' with adam_beta1 set: the same SGD hyperparameters as transformers' Trainer (which takes SGD's
    momentum from optim_args only, never from adam_beta1: momentum 0)."""
    groups = {}
    for fw, trainer in _pair(tmp_path, optim="sgd", adam_beta1=0.8, weight_decay=0.1).items():
        trainer.create_optimizer()
        assert type(trainer.optimizer) is torch.optim.SGD
        groups[fw] = sorted((g["weight_decay"], g["momentum"], g["dampening"], g["nesterov"], len(g["params"]))
                            for g in trainer.optimizer.param_groups)
    assert groups["ours"] == groups["hf"]
    assert {g[1] for g in groups["ours"]} == {0}
