"""What a transformers script meets past its metrics, run under both Trainers and compared: the default callback
list, call_event and on_push_begin, the checkpoints each save strategy leaves, resume's warnings, the loaders'
attributes, report_to='all', debug='underflow_overflow' and label smoothing with a multi-label model."""

from __future__ import annotations

import logging
import os
import shutil

import pytest
import torch
import transformers
from test_dropin_internals import _warnings_seen
from test_transformers_dropin import (
    FRAMEWORKS,
    CountingCallback,
    TupleClassifier,
    _accuracy,
    _samples,
    _trainer,
)

import vlmtrain

pytestmark = pytest.mark.usefixtures("one_thread")


def _names(trainer) -> list[str]:
    return [type(cb).__name__ for cb in trainer.callback_handler.callbacks]


@pytest.mark.parametrize("disable_tqdm,report_to", [(True, "none"), (False, "none"), (True, "tensorboard")])
def test_default_callback_list_as_transformers(tmp_path, disable_tqdm, report_to):
    """DefaultFlowCallback, report_to's integrations, the user's callbacks, then the progress bar or printer;
    vlmtrain's metrics.jsonl writer is not listed (it is called all the same)."""
    names = {}
    for framework in FRAMEWORKS:
        trainer = _trainer(framework, tmp_path, dict(disable_tqdm=disable_tqdm, report_to=report_to),
                           model=TupleClassifier(), callbacks=[CountingCallback()])
        names[framework] = _names(trainer)
    assert names["ours"] == names["hf"]
    assert names["hf"][-1] == ("PrinterCallback" if disable_tqdm else "ProgressCallback")


class EventLog(transformers.TrainerCallback, vlmtrain.TrainerCallback):
    """Records each on_push_begin / on_log call: the kwargs' names and the logs."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def on_push_begin(self, args, state, control, **kwargs):
        self.calls.append(("on_push_begin", sorted(kwargs)))

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.calls.append(("on_log", sorted(kwargs), logs))


def test_call_event_and_on_push_begin_as_transformers(tmp_path):
    seen = {}
    for framework in FRAMEWORKS:
        log = EventLog()
        plain = (transformers.TrainerCallback if framework == "hf" else vlmtrain.TrainerCallback)()
        trainer = _trainer(framework, tmp_path, model=TupleClassifier(), callbacks=[log, plain])
        handler, args, state = trainer.callback_handler, trainer.args, trainer.state
        returned = [handler.call_event("on_push_begin", args, state, trainer.control, extra=1),
                    handler.on_push_begin(args, state, trainer.control),
                    handler.call_event("on_log", args, state, trainer.control, logs={"a": 1.0}),
                    handler.on_log(args, state, trainer.control, {"b": 2.0})]
        seen[framework] = log.calls, [type(r).__name__ for r in returned]
    assert seen["ours"] == seen["hf"]
    assert [c[0] for c in seen["hf"][0]] == ["on_push_begin", "on_push_begin", "on_log", "on_log"]


# -- checkpoints -------------------------------------------------------------------------------------------------
SAVE_CASES = {
    "steps": dict(save_strategy="steps", save_steps=2),
    "epoch": dict(save_strategy="epoch"),
    "best": dict(save_strategy="best", eval_strategy="steps", eval_steps=1),
    "no": dict(save_strategy="no"),
    "limit1_load_best": dict(save_steps=1, eval_strategy="steps", eval_steps=1, save_total_limit=1,
                             load_best_model_at_end=True),
    "limit2_load_best": dict(save_steps=1, eval_strategy="steps", eval_steps=1, save_total_limit=2,
                             load_best_model_at_end=True),
    "limit1_best_metric": dict(save_steps=1, eval_strategy="steps", eval_steps=1, save_total_limit=1),
}


@pytest.mark.parametrize("case", list(SAVE_CASES))
def test_checkpoints_each_save_strategy_leaves_as_transformers(tmp_path, case):
    """The folders left after training (rotation keeps the best one) and the best checkpoint; accuracy peaks at
    step 1 of 6, so the best one is not the last."""
    left, best = {}, {}
    for framework in FRAMEWORKS:
        kw = {**dict(max_steps=6, num_train_epochs=3, per_device_train_batch_size=4, save_strategy="steps",
                     metric_for_best_model="accuracy"), **SAVE_CASES[case]}
        trainer = _trainer(framework, tmp_path, kw, model=TupleClassifier(), train_dataset=_samples(8),
                           eval_dataset=_samples(8, seed=1), compute_metrics=_accuracy)
        trainer.train()
        left[framework] = sorted(p for p in os.listdir(tmp_path / framework) if p.startswith("checkpoint-"))
        best[framework] = trainer.state.best_model_checkpoint and os.path.basename(trainer.state.best_model_checkpoint)
    assert left["ours"] == left["hf"]
    assert best["ours"] == best["hf"]
    if case != "no":
        assert left["hf"]


def test_a_best_metric_evaluation_lacks_is_transformers_error(tmp_path):
    errors = {}
    for framework in FRAMEWORKS:
        kw = dict(max_steps=2, eval_strategy="steps", eval_steps=1, metric_for_best_model="accuracy")
        trainer = _trainer(framework, tmp_path, kw, model=TupleClassifier(), train_dataset=_samples(8),
                           eval_dataset=_samples(4))  # (no compute_metrics: no eval_accuracy)
        with pytest.raises(KeyError) as caught:
            trainer.train()
        errors[framework] = caught.value.args[0].replace("'eval_samples', ", "")  # (vlmtrain's one addition)
    assert errors["ours"].split(" are: ")[0] == errors["hf"].split(" are: ")[0]
    assert errors["hf"].startswith("The `metric_for_best_model` training argument is set to 'eval_accuracy'")


# -- resume ------------------------------------------------------------------------------------------------------
def test_resume_warns_of_arguments_that_differ_from_the_checkpoint_as_transformers(tmp_path):
    """transformers' warnings: the checkpoint's save/eval/logging steps and batch differ from the arguments; the
    best checkpoint its state names is gone."""
    messages = {}
    for framework in FRAMEWORKS:
        kw = dict(max_steps=4, per_device_train_batch_size=4, save_strategy="steps", save_steps=2, logging_steps=1,
                  eval_strategy="steps", eval_steps=2, metric_for_best_model="loss")
        first = _trainer(framework, tmp_path / "first", kw, model=TupleClassifier(), train_dataset=_samples(16),
                         eval_dataset=_samples(4))
        first.train()
        run = tmp_path / "first" / framework
        assert os.path.basename(first.state.best_model_checkpoint) == "checkpoint-4"
        shutil.copytree(run / "checkpoint-4", run / "moved")  # (its state names checkpoint-4 as the best one)
        shutil.rmtree(run / "checkpoint-4")
        kw.update(save_steps=3, logging_steps=2, eval_steps=1, per_device_train_batch_size=2, max_steps=5)
        logging.Logger.warning_once.cache_clear()  # (transformers gives its warning once per process)
        with _warnings_seen() as seen:
            second = _trainer(framework, tmp_path / "second", kw, model=TupleClassifier(),
                              train_dataset=_samples(16), eval_dataset=_samples(4))
            second.train(resume_from_checkpoint=str(run / "moved"))
        messages[framework] = sorted(s.replace(str(run), "RUN") for s in seen if "checkpoint" in s and (
            "do not match" in s or "does not exist anymore" in s))
    assert messages["ours"] == messages["hf"]
    assert len(messages["hf"]) == 2 and "\tsave_steps: 3 (from args) != 2 (from trainer_state.json)" in \
        messages["hf"][1]


# -- data loaders ------------------------------------------------------------------------------------------------
LOADER_ATTRIBUTES = ("total_batch_size", "total_dataset_length", "persistent_workers", "num_workers",
                     "prefetch_factor")


@pytest.mark.parametrize("persistent", [False, True])
def test_loader_attributes_integrations_read_as_transformers(tmp_path, persistent):
    seen = {}
    for framework in FRAMEWORKS:
        trainer = _trainer(framework, tmp_path, dict(per_device_train_batch_size=4, per_device_eval_batch_size=3,
                                                     dataloader_num_workers=1,
                                                     dataloader_persistent_workers=persistent),
                           model=TupleClassifier(), train_dataset=_samples(8), eval_dataset=_samples(6))
        loaders = {"train": trainer.get_train_dataloader(), "eval": trainer.get_eval_dataloader()}
        seen[framework] = {name: {a: getattr(loader, a) for a in LOADER_ATTRIBUTES}
                           for name, loader in loaders.items()}
        # with persistent workers the eval loader (and its workers) is built once, as transformers keeps it
        seen[framework]["eval_kept"] = trainer.get_eval_dataloader() is loaders["eval"]
    assert seen["ours"] == seen["hf"]
    assert seen["hf"]["eval"]["persistent_workers"] == seen["hf"]["eval_kept"] == persistent


# -- TrainingArguments -------------------------------------------------------------------------------------------
def test_report_to_all_lists_the_installed_integrations_as_transformers(tmp_path):
    from test_transformers_dropin import _args

    listed = {framework: _args(framework, tmp_path, report_to="all").report_to for framework in FRAMEWORKS}
    assert listed["ours"] == listed["hf"]
    assert "tensorboard" in listed["hf"]  # (the dev extra installs it)


class Overflowing(TupleClassifier):
    """Its logits overflow to inf in float32."""

    def __init__(self) -> None:
        super().__init__()
        with torch.no_grad():
            self.net.weight.fill_(3e38)


def test_debug_none_is_no_option_as_transformers(tmp_path):
    """debug=None (what an argument parser can hand over) is an empty list, as transformers makes it: train()
    reads it (it raised TypeError: argument of type 'NoneType' is not iterable)."""
    from test_transformers_dropin import _args

    debug = {framework: _args(framework, tmp_path, debug=None).debug for framework in FRAMEWORKS}
    assert debug["ours"] == debug["hf"] == []
    trainer = _trainer("ours", tmp_path, dict(debug=None, max_steps=1), model=TupleClassifier(),
                       train_dataset=_samples(8))
    assert trainer.train().global_step == 1


def test_debug_underflow_overflow_stops_at_the_first_inf_as_transformers(tmp_path, capsys):
    errors = {}
    for framework in FRAMEWORKS:
        trainer = _trainer(framework, tmp_path, dict(debug="underflow_overflow", max_steps=2),
                           model=Overflowing(), train_dataset=_samples(8))
        assert trainer.args.debug == ["underflow_overflow"]
        with pytest.raises(ValueError) as caught:
            trainer.train()
        errors[framework] = str(caught.value), "abs min  abs max  metadata" in capsys.readouterr().out
    assert errors["ours"] == errors["hf"]
    assert errors["hf"] == ("DebugUnderflowOverflow: inf/nan detected, aborting as there is no point running "
                            "further. Please scroll up above this traceback to see the activation values prior to "
                            "this event.", True)


class MultiLabel(TupleClassifier):
    """A model configured for multi-label classification, as transformers' *ForSequenceClassification are."""

    def __init__(self) -> None:
        super().__init__()
        self.config = transformers.PretrainedConfig(problem_type="multi_label_classification")


def test_label_smoothing_with_a_multi_label_model_warns_and_is_off_as_transformers(tmp_path):
    seen, losses = {}, {}
    for framework in FRAMEWORKS:
        with _warnings_seen() as warned:
            trainer = _trainer(framework, tmp_path, dict(label_smoothing_factor=0.1, max_steps=2, weight_decay=0.1),
                               model=MultiLabel(), train_dataset=_samples(8))
        seen[framework] = [s for s in warned if "Label smoothing" in s]
        trainer.train()
        losses[framework] = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert seen["ours"] == seen["hf"] == ["Label smoothing is not compatible with multi-label classification. "
                                          "Disabling label smoothing for this training run."]
    assert losses["ours"] == pytest.approx(losses["hf"], rel=1e-6)  # the model's own loss, unsmoothed


def test_callback_warnings_are_transformers_text(tmp_path):
    """A callback class added twice, a handler without DefaultFlowCallback, a checkpoint's stateful callback the
    resumed Trainer lacks (transformers looks with restore_callback_states_from_checkpoint only): the same text in
    both (transformers logs it, vlmtrain warns)."""
    texts = {}
    for framework in FRAMEWORKS:
        kw = dict(max_steps=2, per_device_train_batch_size=4, save_strategy="steps", save_steps=2)
        with _warnings_seen() as seen:
            trainer = _trainer(framework, tmp_path, kw, model=TupleClassifier(), train_dataset=_samples(8),
                               callbacks=[CountingCallback()])
            trainer.add_callback(CountingCallback)
            type(trainer.callback_handler)([CountingCallback()], trainer.model, None, None, None)
            trainer.train()
            resumed = _trainer(framework, tmp_path, dict(kw, max_steps=3, restore_callback_states_from_checkpoint=True),
                               model=TupleClassifier(), train_dataset=_samples(8))
            resumed.train(resume_from_checkpoint=str(tmp_path / framework / "checkpoint-2"))
        texts[framework] = [s for s in seen if "callbacks" in s]
    assert texts["ours"] == texts["hf"]
    assert len(texts["hf"]) == 3
