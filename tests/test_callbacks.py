"""Callbacks: the same events, in the same order, at the same steps as transformers' own Trainer; control
flags honoured; EarlyStoppingCallback (and its state across a resume); add/pop/remove; event kwargs."""

from __future__ import annotations

import json
import os

import pytest
import torch
import transformers
from tiny import tiny_llama, token_samples

from vlmtrain import EarlyStoppingCallback, PredictionOutput, Trainer, TrainerCallback, TrainingArguments
from vlmtrain.logging.console import PrinterCallback
from vlmtrain.trainer.callbacks import EVENTS

# Every event both frameworks have (on_predict is not fired by train()).
RECORDED = tuple(e for e in EVENTS if e != "on_predict")
HF_KEYS = {"model", "processing_class", "optimizer", "lr_scheduler", "train_dataloader", "eval_dataloader"}


class Recorder(transformers.TrainerCallback, TrainerCallback):
    """Records (event, global_step) and the kwargs' names for every event, in either framework. `steer` maps
    (event, global_step) to control flags to raise there, so both loops can be steered the same way."""

    def __init__(self, steer: dict | None = None) -> None:
        self.events: list[tuple[str, int]] = []
        self.kwarg_names: dict[str, set[str]] = {}
        self.steer = steer or {}


def _make_handler(event: str):
    def handler(self, args, state, control, **kwargs):
        self.events.append((event, state.global_step))
        self.kwarg_names.setdefault(event, set()).update(kwargs)
        for flag in self.steer.get((event, state.global_step), ()):
            setattr(control, flag, True)
        return control

    return handler


for _event in RECORDED:
    setattr(Recorder, _event, _make_handler(_event))


class Stream(torch.utils.data.IterableDataset):
    def __init__(self, samples):
        self.samples = samples

    def __iter__(self):
        return iter(self.samples)


def _data(n_train: int = 20):
    # Equal lengths, so transformers' default collator can stack them as well.
    return token_samples(n_train, min_len=8, max_len=8), token_samples(4, seed=1, min_len=8, max_len=8)


def _base(out, **kw) -> dict:
    base = dict(output_dir=str(out), report_to="none", disable_tqdm=True, per_device_train_batch_size=4,
                per_device_eval_batch_size=4, learning_rate=1e-3, optim="adamw_torch", logging_steps=100)
    base.update(kw)
    return base


def _run(framework: str, out, steer=None, iterable=False, **kw) -> Recorder:
    train, evals = _data()
    rec = Recorder(steer)
    if framework == "hf":
        args, cls = transformers.TrainingArguments(use_cpu=True, **_base(out, **kw)), transformers.Trainer
    else:
        args, cls = TrainingArguments(**_base(out, **kw)), Trainer
    trainer = cls(model=tiny_llama(), args=args, train_dataset=Stream(train) if iterable else train,
                  eval_dataset=evals, callbacks=[rec])
    trainer.train()
    return rec


# 20 samples / batch 4 = 5 micro-batches per epoch.
CASES = {
    # accumulation 2 over 5 micro-batches: each epoch ends with a one-batch window.
    "accum_partial_window": dict(num_train_epochs=2, gradient_accumulation_steps=2, logging_steps=2,
                                 eval_strategy="steps", eval_steps=3, save_steps=4),
    "max_steps_epoch_eval_save": dict(max_steps=7, eval_strategy="epoch", save_strategy="epoch", logging_steps=3),
    "first_step_no_save": dict(num_train_epochs=2, logging_first_step=True, save_strategy="no",
                               eval_strategy="epoch", logging_steps=4),
    "best_model_limit": dict(num_train_epochs=2, eval_strategy="steps", eval_steps=2, save_steps=4, logging_steps=2,
                             load_best_model_at_end=True, save_total_limit=1),
    "save_best_accum3": dict(max_steps=5, gradient_accumulation_steps=3, eval_strategy="steps", eval_steps=2,
                             save_strategy="best", metric_for_best_model="loss", logging_strategy="epoch"),
    "fractional_epochs": dict(num_train_epochs=1.5, gradient_accumulation_steps=3, eval_strategy="epoch",
                              save_strategy="epoch", logging_strategy="epoch"),
    "stream_max_steps": dict(max_steps=7, logging_steps=2, save_steps=3, iterable=True),
    # Steered by a callback: the same flags raised at the same event in both loops.
    "callback_stops_training": dict(num_train_epochs=2, save_strategy="no", eval_strategy="epoch",
                                    steer={("on_step_end", 3): ["should_training_stop"]}),
    "callback_stops_epochs": dict(num_train_epochs=2, save_strategy="no", steer={
        ("on_step_end", 2): ["should_epoch_stop"], ("on_step_end", 4): ["should_epoch_stop"]}),
    "callback_stops_epoch_mid_window": dict(num_train_epochs=2, gradient_accumulation_steps=2, save_strategy="no",
                                            steer={("on_substep_end", 1): ["should_epoch_stop"]}),
    "callback_log_eval_save": dict(max_steps=4, save_strategy="no", steer={
        ("on_step_end", 2): ["should_save", "should_evaluate", "should_log"]}),
    "callback_save_on_evaluate": dict(max_steps=4, eval_strategy="steps", eval_steps=2, save_strategy="no",
                                      logging_steps=1, steer={("on_evaluate", 2): ["should_save"]}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_same_events_as_transformers(case, tmp_path):
    kw = dict(CASES[case])
    hf = _run("hf", tmp_path / "hf", **kw)
    ours = _run("ours", tmp_path / "ours", **kw)
    assert ours.events == hf.events
    assert ours.kwarg_names == hf.kwarg_names
    assert HF_KEYS <= hf.kwarg_names["on_train_begin"]


# -- control flags -------------------------------------------------------------------------------------
def _trainer(tmp_path, callbacks=(), train=None, **kw) -> Trainer:
    train_data, evals = _data()
    args = TrainingArguments(**_base(tmp_path, save_strategy=kw.pop("save_strategy", "no"), **kw))
    return Trainer(model=tiny_llama(), args=args, train_dataset=train if train is not None else train_data,
                   eval_dataset=evals, callbacks=list(callbacks))


def test_should_training_stop(tmp_path):
    rec = Recorder({("on_step_end", 3): ["should_training_stop"]})
    out = _trainer(tmp_path, [rec], num_train_epochs=3).train()
    assert out.global_step == 3
    assert [s for e, s in rec.events if e == "on_step_end"] == [1, 2, 3]
    assert [e for e, _ in rec.events[-3:]] == ["on_epoch_end", "on_log", "on_train_end"]


def test_should_epoch_stop_moves_to_next_epoch(tmp_path):
    rec = Recorder({("on_step_end", 2): ["should_epoch_stop"]})
    trainer = _trainer(tmp_path, [rec], num_train_epochs=2)
    assert trainer.train().global_step == 2 + 5
    assert [s for e, s in rec.events if e == "on_epoch_begin"] == [0, 2]
    assert [s for e, s in rec.events if e == "on_epoch_end"] == [2, 7]
    assert trainer.state.epoch == pytest.approx(2.0)


def test_should_epoch_stop_mid_window_drops_the_window(tmp_path):
    # Deliberate difference from transformers, which leaves the cut window's gradients in .grad to be added
    # into the next epoch's first step: we drop them, so every step averages exactly its own window.
    grads_at_epoch_end = []

    class CutFirstEpoch(TrainerCallback):
        def on_substep_end(self, args, state, control, **kw):
            control.should_epoch_stop = not grads_at_epoch_end  # only in the first epoch

        def on_epoch_end(self, args, state, control, model=None, **kw):
            grads_at_epoch_end.append(any(p.grad is not None for p in model.parameters()))

    trainer = _trainer(tmp_path, [CutFirstEpoch()], num_train_epochs=2, gradient_accumulation_steps=2)
    assert trainer.train().global_step == 3  # epoch 0 cut before its first step, epoch 1: 2 + 2 + 1 batches
    assert grads_at_epoch_end == [False, False]



def test_resume_from_checkpoint_saved_at_an_epoch_cut(tmp_path):
    # The checkpoint saved at the end of a cut epoch must resume into a fresh next epoch, not the cut one's rest.
    def run(out, resume=None):
        rec = Recorder({("on_step_end", 2): ["should_epoch_stop"]})
        trainer = _trainer(out, [rec], num_train_epochs=3, save_strategy="epoch")
        trainer.train(resume_from_checkpoint=resume)
        return trainer

    full = run(tmp_path / "full")
    resumed = run(tmp_path / "resumed", resume=str(tmp_path / "full" / "checkpoint-2"))
    assert full.state.global_step == resumed.state.global_step == 2 + 5 + 5
    for p, q in zip(full.model.parameters(), resumed.model.parameters()):
        assert torch.equal(p, q)

def test_should_log_evaluate_save_from_callback(tmp_path):
    rec = Recorder({("on_step_end", 2): ["should_save", "should_evaluate", "should_log"]})
    trainer = _trainer(tmp_path, [rec], max_steps=4)
    trainer.train()
    assert sorted(d for d in os.listdir(tmp_path) if d.startswith("checkpoint-")) == ["checkpoint-2"]
    at_2 = [h for h in trainer.state.log_history if h["step"] == 2]
    assert any("loss" in h for h in at_2) and any("eval_loss" in h for h in at_2)
    assert [e for e, s in rec.events if s == 2 and e in ("on_log", "on_evaluate", "on_save")] == [
        "on_log", "on_log", "on_evaluate", "on_save"]  # train log, eval log, evaluate, save
    assert not any("loss" in h for h in trainer.state.log_history if h["step"] in (1, 3))


# -- EarlyStoppingCallback -----------------------------------------------------------------------------
def _fake_eval(trainer, losses: dict[int, float]) -> None:
    """evaluation_loop returns eval_loss = losses[global_step], without running the model."""

    def evaluation_loop(dataloader, description="", prediction_loss_only=None, ignore_keys=None,
                        metric_key_prefix="eval"):  # (transformers' signature; a result without num_samples)
        return PredictionOutput(None, None, {f"{metric_key_prefix}_loss": losses[trainer.state.global_step]})

    trainer.evaluation_loop = evaluation_loop


def _hf_fake_eval(trainer, losses: dict[int, float]) -> None:
    from transformers.trainer_utils import EvalLoopOutput

    def evaluation_loop(dataloader, description="", prediction_loss_only=None, ignore_keys=None,
                        metric_key_prefix="eval"):
        return EvalLoopOutput(None, None, {f"{metric_key_prefix}_loss": losses[trainer.state.global_step]}, 4)

    trainer.evaluation_loop = evaluation_loop


@pytest.mark.parametrize("patience,threshold", [(1, 0.0), (2, 0.0), (2, 0.05)])
def test_early_stopping_matches_transformers(tmp_path, patience, threshold):
    # Improves at 2 and 3 (by 0.02 at 3, below the 0.05 threshold), then gets worse.
    losses = {1: 1.0, 2: 0.9, 3: 0.88, 4: 0.95, 5: 0.97, 6: 0.99, 7: 1.0, 8: 1.1, 9: 1.2, 10: 1.3}
    kw = dict(max_steps=10, eval_strategy="steps", eval_steps=1, save_strategy="no", metric_for_best_model="loss")
    train, evals = _data()
    hf = transformers.Trainer(model=tiny_llama(), args=transformers.TrainingArguments(use_cpu=True, **_base(
        tmp_path / "hf", **kw)), train_dataset=train, eval_dataset=evals,
        callbacks=[transformers.EarlyStoppingCallback(patience, threshold)])
    _hf_fake_eval(hf, losses)
    ours = _trainer(tmp_path / "ours", [EarlyStoppingCallback(patience, threshold)], **kw)
    _fake_eval(ours, losses)
    hf_steps, our_steps = hf.train().global_step, ours.train().global_step
    assert our_steps == hf_steps
    assert our_steps == {(1, 0.0): 4, (2, 0.0): 5, (2, 0.05): 4}[(patience, threshold)]


def test_early_stopping_state_saved_and_restored(tmp_path):
    losses = {1: 1.0, 2: 1.1, 3: 1.2, 4: 1.3, 5: 1.4, 6: 1.5, 7: 1.6, 8: 1.7}  # never improves after step 1
    kw = dict(max_steps=8, eval_strategy="steps", eval_steps=1, save_strategy="steps", save_steps=1,
              metric_for_best_model="loss")
    first = _trainer(tmp_path / "a", [EarlyStoppingCallback(3)], **kw)
    _fake_eval(first, losses)
    assert first.train().global_step == 4  # patience counter 0, 1, 2, 3 after steps 1..4
    for step, counter in [(1, 0), (2, 1), (3, 2), (4, 3)]:
        with open(tmp_path / "a" / f"checkpoint-{step}" / "trainer_state.json") as f:
            saved = json.load(f)
        assert saved["stateful_callbacks"]["EarlyStoppingCallback"]["attributes"][
            "early_stopping_patience_counter"] == counter

    # Resumed at step 2 (counter 1) with a fresh callback: the counter is restored, so training stops at 4
    # again (a counter starting from 0 would stop at 5).
    callback = EarlyStoppingCallback(3)
    second = _trainer(tmp_path / "b", [callback], **kw)
    _fake_eval(second, losses)
    assert second.train(resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-2")).global_step == 4
    assert callback.early_stopping_patience_counter == 3
    assert second.state.best_metric == 1.0


def test_early_stopping_counter_of_an_earlier_vlmtrain_checkpoint_is_restored():
    # An earlier vlmtrain saved the callback's counter alone (no args / attributes) in trainer_state.json.
    from vlmtrain import TrainerControl
    from vlmtrain.compat.callback_states import restore_callback_states

    callback = EarlyStoppingCallback(3)
    restore_callback_states([callback], TrainerControl(), {"EarlyStoppingCallback": {
        "early_stopping_patience_counter": 2}})
    assert callback.early_stopping_patience_counter == 2


def test_stateful_callbacks_are_vlmtrain_trainers_convention(tmp_path):
    """transformers' stateful-callback convention (ExportableState, trainer_state.json's stateful_callbacks) is
    vlmtrain.Trainer's (compat/callback_states.py); the bare trainer core saves and restores no callback state."""
    from vlmtrain.compat.callback_states import ExportableState
    from vlmtrain.data.collate import DefaultCollator
    from vlmtrain.trainer import TrainerCore

    class Counter(TrainerCallback, ExportableState):
        def __init__(self, start: int = 0) -> None:
            self.count = start

        def state(self) -> dict:
            return {"args": {"start": 0}, "attributes": {"count": self.count}}

    assert issubclass(EarlyStoppingCallback, ExportableState)
    kw = dict(max_steps=2, save_strategy="steps", save_steps=2, report_to="none", disable_tqdm=True)
    saved = {}
    for name, cls in (("core", TrainerCore), ("vlmtrain", Trainer)):
        cls(tiny_llama(), TrainingArguments(output_dir=str(tmp_path / name), **kw), train_dataset=token_samples(4),
            data_collator=DefaultCollator(0), callbacks=[Counter()]).train()
        with open(tmp_path / name / "checkpoint-2" / "trainer_state.json") as f:
            saved[name] = sorted(json.load(f)["stateful_callbacks"])
    assert saved == {"core": [], "vlmtrain": ["Counter", "JsonlLoggerCallback", "TrainerControl"]}


# -- add / pop / remove --------------------------------------------------------------------------------
def test_add_pop_remove_callback(tmp_path):
    trainer = _trainer(tmp_path, max_steps=2)
    callbacks = trainer.callback_handler.callbacks

    trainer.add_callback(Recorder)  # a class is instantiated
    by_class = [cb for cb in callbacks if isinstance(cb, Recorder)]
    assert len(by_class) == 1
    instance = Recorder()
    trainer.add_callback(instance)
    assert callbacks[-1] is instance

    assert trainer.pop_callback(Recorder) is by_class[0]  # by class: the first instance
    assert trainer.pop_callback(instance) is instance
    assert not any(isinstance(cb, Recorder) for cb in callbacks)
    assert trainer.pop_callback(Recorder) is None

    printer = trainer.pop_callback(PrinterCallback)
    assert isinstance(printer, PrinterCallback) and printer not in callbacks

    trainer.add_callback(instance)
    trainer.remove_callback(instance)
    assert instance not in callbacks
    trainer.add_callback(Recorder)
    trainer.remove_callback(Recorder)
    assert not any(isinstance(cb, Recorder) for cb in callbacks)

    added = Recorder()  # a callback added after construction gets the events
    trainer.add_callback(added)
    trainer.train()
    assert [s for e, s in added.events if e == "on_step_end"] == [1, 2]
    assert not instance.events


# -- event kwargs --------------------------------------------------------------------------------------
def test_event_kwargs(tmp_path):
    seen: dict[str, list] = {"step_end": [], "log": [], "evaluate": []}

    class Capture(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, optimizer=None, lr_scheduler=None,
                        train_dataloader=None, **kwargs):
            seen["step_end"].append((model, optimizer, lr_scheduler, train_dataloader))

        def on_log(self, args, state, control, logs=None, **kwargs):
            seen["log"].append(dict(logs))

        def on_evaluate(self, args, state, control, metrics=None, eval_dataloader=None, **kwargs):
            seen["evaluate"].append((dict(metrics), eval_dataloader))

    trainer = _trainer(tmp_path, [Capture()], max_steps=2, logging_steps=1, eval_strategy="steps", eval_steps=2)
    trainer.train()
    assert len(seen["step_end"]) == 2
    for model, optimizer, lr_scheduler, train_dataloader in seen["step_end"]:
        assert model is trainer.model and isinstance(model, torch.nn.Module)
        assert optimizer is trainer.optimizer and isinstance(optimizer, torch.optim.Optimizer)
        assert lr_scheduler is trainer.lr_scheduler and lr_scheduler is not None
        assert train_dataloader is trainer.train_dataloader and train_dataloader is not None
    train_logs = [logs for logs in seen["log"] if "loss" in logs]
    assert len(train_logs) == 2 and all("learning_rate" in logs and "epoch" in logs for logs in train_logs)
    assert any("eval_loss" in logs for logs in seen["log"])
    assert any("train_loss" in logs for logs in seen["log"])
    [(metrics, eval_dataloader)] = seen["evaluate"]
    assert "eval_loss" in metrics and eval_dataloader is not None
    logged = next(h for h in trainer.state.log_history if "eval_loss" in h)
    assert logged["eval_loss"] == metrics["eval_loss"] and logged["step"] == 2
