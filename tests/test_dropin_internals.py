"""What a transformers script or Trainer subclass observes besides metrics, run under both Trainers and compared:
the callback handler's warnings, the internal names subclasses read or override (_train_batch_size,
_evaluate, _get_output_dir, _load_callback_state) and the error for `accelerator`."""

from __future__ import annotations

import contextlib
import logging
import warnings

import pytest
import transformers
from test_transformers_dropin import FRAMEWORKS, CountingCallback, TupleClassifier, _args, _samples, _trainer

pytestmark = pytest.mark.usefixtures("one_thread")


@contextlib.contextmanager
def _warnings_seen():
    """The warnings either Trainer gives: transformers' logger warnings, vlmtrain's UserWarnings."""
    seen: list[str] = []

    class Handler(logging.Handler):
        def emit(self, record):
            if record.levelno >= logging.WARNING:
                seen.append(record.getMessage())

    handler, logger = Handler(), logging.getLogger("transformers")
    logger.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield seen
        seen.extend(str(w.message) for w in caught if issubclass(w.category, UserWarning))
    finally:
        logger.removeHandler(handler)


def _mentions(seen: list[str], *parts: str) -> bool:
    return any(all(p in s for p in parts) for s in seen)


def test_a_callback_class_added_twice_warns_as_transformers(tmp_path):
    for framework in FRAMEWORKS:
        with _warnings_seen() as seen:  # once in the constructor's list, once by add_callback
            trainer = _trainer(framework, tmp_path, model=TupleClassifier(),
                               callbacks=[CountingCallback(), CountingCallback])
            trainer.add_callback(CountingCallback(2))
        assert sum("there is already one" in s and "CountingCallback" in s for s in seen) == 2, (framework, seen)
        assert [type(cb).__name__ for cb in trainer.callback_handler.callbacks].count("CountingCallback") == 3
        with _warnings_seen() as seen:  # a new class: no warning
            trainer.add_callback(transformers.TrainerCallback())
        assert not _mentions(seen, "there is already one"), framework


def test_no_default_flow_callback(tmp_path):
    """transformers' Trainer always puts DefaultFlowCallback first: removing it later is silent; a handler built
    without one warns (vlmtrain's with transformers' positional signature)."""
    for framework in FRAMEWORKS:
        trainer = _trainer(framework, tmp_path, model=TupleClassifier())
        flow = type(trainer.callback_handler.callbacks[0])
        assert flow.__name__ == "DefaultFlowCallback"
        with _warnings_seen() as seen:
            trainer.remove_callback(flow)
        assert not _mentions(seen, "DefaultFlowCallback"), framework
        with _warnings_seen() as seen:
            handler = type(trainer.callback_handler)([CountingCallback()], trainer.model, None, None, None)
        assert _mentions(seen, "will not work properly", "DefaultFlowCallback"), (framework, seen)
        assert handler.model is trainer.model and handler.train_dataloader is None


def _stateful_run(framework, out, callbacks, resume=None):
    trainer = _trainer(framework, out, dict(max_steps=4, per_device_train_batch_size=4, save_strategy="steps",
                                            save_steps=2, restore_callback_states_from_checkpoint=True),
                       model=TupleClassifier(), train_dataset=_samples(16), callbacks=callbacks)
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def test_checkpoint_callbacks_the_trainer_lacks_warn_as_transformers(tmp_path):
    for framework in FRAMEWORKS:
        _stateful_run(framework, tmp_path, [CountingCallback(3)])
        with _warnings_seen() as seen:  # resumed without the CountingCallback: its saved state is ignored
            trainer = _stateful_run(framework, tmp_path / "resumed", [],
                                    resume=str(tmp_path / framework / "checkpoint-2"))
        assert _mentions(seen, "Checkpoint included callbacks not included", "CountingCallback"), (framework, seen)
        assert not _mentions(seen, "TrainerControl")
        assert trainer.state.global_step == 4
        with _warnings_seen() as seen:  # resumed with it: no warning
            _stateful_run(framework, tmp_path / "again", [CountingCallback(3)],
                          resume=str(tmp_path / framework / "checkpoint-2"))
        assert not _mentions(seen, "Checkpoint included callbacks"), (framework, seen)


def _subclass_script(framework: str, out) -> tuple:
    """A subclass overriding transformers' internal names; trains with an evaluation at start and every 2 steps,
    then resumes from checkpoint-2."""
    calls: list = []

    class Sub(FRAMEWORKS[framework][0]):
        def _evaluate(self, trial, ignore_keys_for_eval, skip_scheduler=False):
            calls.append(("evaluate", self.state.global_step, ignore_keys_for_eval, skip_scheduler))
            return super()._evaluate(trial, ignore_keys_for_eval, skip_scheduler)

        def _get_output_dir(self, trial):
            calls.append(("output_dir", trial))
            return str(out / framework / "elsewhere")

        def _load_callback_state(self):
            # (vlmtrain's metrics.jsonl writer keeps its row count there too)
            calls.append(("callback_state", sorted(set(self.state.stateful_callbacks) - {"JsonlLoggerCallback"})))
            return super()._load_callback_state()

    data = _samples(16)
    kw = dict(max_steps=4, per_device_train_batch_size=3, eval_strategy="steps", eval_steps=2, save_strategy="steps",
              save_steps=2, eval_on_start=True, restore_callback_states_from_checkpoint=True)
    trainer = Sub(model=TupleClassifier(), train_dataset=data, eval_dataset=data[:4],
                  args=_args(framework, out, **kw), callbacks=[CountingCallback()])
    trainer.train(ignore_keys_for_eval=["x"])
    checkpoints = sorted(p.name for p in (out / framework / "elsewhere").iterdir())
    resumed = Sub(model=TupleClassifier(), train_dataset=data, eval_dataset=data[:4], args=trainer.args,
                  callbacks=[CountingCallback()])
    resumed.train(resume_from_checkpoint=str(out / framework / "elsewhere" / "checkpoint-2"))
    return (trainer._train_batch_size, checkpoints, [c for c in calls if c[0] != "output_dir"],
            ("output_dir", None) in calls)


def test_internal_names_subclasses_read_and_override(tmp_path):
    seen = {framework: _subclass_script(framework, tmp_path) for framework in FRAMEWORKS}
    assert seen["ours"] == seen["hf"]
    assert seen["ours"][0] == 3 and seen["ours"][1] == ["checkpoint-2", "checkpoint-4"] and seen["ours"][3]
    assert ("evaluate", 0, ["x"], True) in seen["ours"][2] and ("evaluate", 4, ["x"], False) in seen["ours"][2]


def test_accelerator_is_an_error_naming_what_to_use(tmp_path):
    ours = _trainer("ours", tmp_path, model=TupleClassifier())
    assert _trainer("hf", tmp_path, model=TupleClassifier()).accelerator is not None
    assert not hasattr(ours, "accelerator")  # (TRL-style `if hasattr(self, "accelerator")` takes the other path)
    with pytest.raises(AttributeError, match="does not use accelerate.*trainer.args.device.*unwrap_model"):
        ours.accelerator.unwrap_model(ours.model)


@pytest.mark.parametrize("kwargs", [{"torch_compile_mode": "reduce-overhead"}, {"torch_compile_backend": "eager"},
                                    {"torch_compile": True}, {}])
def test_torch_compile_switched_on_and_its_backend_as_transformers(kwargs):
    ours = FRAMEWORKS["ours"][1](**kwargs, use_cpu=True)
    hf = FRAMEWORKS["hf"][1](**kwargs, use_cpu=True)
    names = ("torch_compile", "torch_compile_backend", "torch_compile_mode")
    assert {n: getattr(ours, n) for n in names} == {n: getattr(hf, n) for n in names}
    assert ours.to_dict()["torch_compile_backend"] == hf.to_dict()["torch_compile_backend"]
