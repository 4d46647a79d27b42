"""Scripts written for transformers' Trainer, run unchanged with vlmtrain's (only the import differs): the same
metrics (keys and values), the same log_history rows, the same errors. Each test runs one script under both."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import transformers
from tiny import tiny_llama, token_samples
from torch import nn

import vlmtrain
from vlmtrain.data.collate import DefaultCollator

FRAMEWORKS = {"hf": (transformers.Trainer, transformers.TrainingArguments),
              "ours": (vlmtrain.Trainer, vlmtrain.TrainingArguments)}
# What vlmtrain's evaluate() adds to transformers' keys: the number of samples evaluated.
OUR_EVAL_ADDITIONS = {"eval_samples"}
TIMINGS = ("_runtime", "_per_second", "_time")


class TupleClassifier(nn.Module):
    """A plain nn.Module returning transformers' tuple convention: (loss, logits) with labels, (logits,) without."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.net = nn.Linear(4, 3)

    def forward(self, x, labels=None):
        logits = self.net(x)
        return (logits,) if labels is None else (F.cross_entropy(logits, labels), logits)


def _samples(n: int = 8, seed: int = 0) -> list[dict]:
    """numpy features and a numpy integer `label` (transformers' default collator makes them `labels`); the
    label is a fixed linear function of x, so training improves accuracy."""
    g = np.random.default_rng(seed)
    w = np.random.default_rng(99).standard_normal((4, 3))
    xs = g.standard_normal((n, 4)).astype(np.float32)
    return [{"x": x, "label": np.int64(np.argmax(x @ w))} for x in xs]


def _accuracy(p) -> dict:
    return {"accuracy": float((np.asarray(p.predictions).argmax(-1) == p.label_ids).mean())}


def _args(framework: str, out, **kw):
    base = dict(output_dir=str(out / framework), report_to="none", disable_tqdm=True, learning_rate=0.3,
                per_device_train_batch_size=8, per_device_eval_batch_size=4, optim="adamw_torch", logging_steps=1,
                save_strategy="no")
    base.update(kw)
    extra = {"use_cpu": True} if framework == "hf" else {}
    return FRAMEWORKS[framework][1](**base, **extra)


def _trainer(framework: str, out, args_kw: dict | None = None, **kw):
    return FRAMEWORKS[framework][0](args=_args(framework, out, **(args_kw or {})), **kw)


def _untimed(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if not k.endswith(TIMINGS) and k not in OUR_EVAL_ADDITIONS}


def _same_rows(ours: list[dict], hf: list[dict], rel: float = 1e-5) -> None:
    """log_history: the same rows, keys and (timings aside) values; vlmtrain's eval rows add only eval_samples."""
    assert len(ours) == len(hf)
    for mine, theirs in zip(ours, hf):
        assert set(mine) - set(theirs) <= OUR_EVAL_ADDITIONS and set(theirs) <= set(mine)
        assert _untimed(mine) == pytest.approx(_untimed(theirs), rel=rel)


# -- models returning a tuple ------------------------------------------------------------------------------------
def _tuple_script(framework: str, out):
    data = _samples()
    trainer = _trainer(framework, out, dict(max_steps=4, eval_strategy="steps", eval_steps=1, save_strategy="steps",
                                            save_steps=1, metric_for_best_model="accuracy",
                                            load_best_model_at_end=True),
                       model=TupleClassifier(), train_dataset=data, eval_dataset=data, compute_metrics=_accuracy)
    train = trainer.train()
    return trainer, train.metrics, trainer.evaluate(), trainer.predict(data)


def test_tuple_model_evaluate_predict_best_model_as_transformers(tmp_path):
    hf, hf_train, hf_eval, hf_pred = _tuple_script("hf", tmp_path)
    ours, train, evaluation, pred = _tuple_script("ours", tmp_path)
    assert set(train) == set(hf_train) and _untimed(train) == pytest.approx(_untimed(hf_train), rel=1e-6)
    _same_rows(ours.state.log_history, hf.state.log_history)
    accuracies = [h["eval_accuracy"] for h in ours.state.log_history if "eval_accuracy" in h]
    assert len(set(accuracies)) > 1  # the best checkpoint is a real choice
    assert ours.state.best_metric == hf.state.best_metric and ours.state.best_global_step == hf.state.best_global_step
    assert os.path.basename(ours.state.best_model_checkpoint) == os.path.basename(hf.state.best_model_checkpoint)
    # After training the best model is loaded: evaluate() and predict() see it, with transformers' keys.
    assert set(evaluation) - set(hf_eval) == {"eval_samples"} and set(hf_eval) <= set(evaluation)
    assert evaluation["eval_loss"] == pytest.approx(hf_eval["eval_loss"], rel=1e-6)
    assert evaluation["eval_accuracy"] == hf_eval["eval_accuracy"] == ours.state.best_metric
    assert set(pred.metrics) == set(hf_pred.metrics)
    np.testing.assert_allclose(pred.predictions, hf_pred.predictions, rtol=1e-6)
    np.testing.assert_array_equal(pred.label_ids, hf_pred.label_ids)


class TupleLM(nn.Module):
    """A transformers model's outputs as return_dict=False gives them: (loss, logits, ...) or (logits, ...)."""

    def __init__(self) -> None:
        super().__init__()
        self.lm = tiny_llama()

    def forward(self, input_ids, attention_mask=None, labels=None):
        return self.lm(input_ids=input_ids, attention_mask=attention_mask, labels=labels, use_cache=False).to_tuple()


@pytest.mark.parametrize("labelled", [True, False])
def test_return_dict_false_evaluate_and_predict(tmp_path, labelled):
    data = token_samples(6, min_len=8, max_len=8)
    if not labelled:
        data = [{k: v for k, v in s.items() if k != "labels"} for s in data]
    results = {}
    for framework in FRAMEWORKS:
        trainer = _trainer(framework, tmp_path, model=TupleLM(), eval_dataset=data)
        results[framework] = trainer.evaluate(), trainer.predict(data)
    (hf_eval, hf_pred), (evaluation, pred) = results["hf"], results["ours"]
    assert set(evaluation) - set(hf_eval) == {"eval_samples"} and set(hf_eval) <= set(evaluation)
    assert ("eval_loss" in evaluation) == labelled
    assert _untimed(evaluation) == pytest.approx(_untimed(hf_eval), rel=1e-6)
    assert pred.predictions.shape == hf_pred.predictions.shape == (6, 8, 48)
    np.testing.assert_allclose(pred.predictions, hf_pred.predictions, rtol=1e-5, atol=1e-6)
    assert (pred.label_ids is None) == (hf_pred.label_ids is None) == (not labelled)


# -- the default collator --------------------------------------------------------------------------------------
COLLATOR_CASES = {
    "numpy_scalars": [{"a": np.float32(1.5), "b": np.int64(3), "label": 1}, {"a": np.float32(2.5), "b": np.int64(4),
                                                                            "label": 0}],
    "numpy_arrays_float_label": [{"x": np.ones(3, np.float32), "label": 0.5}, {"x": np.zeros(3, np.float32),
                                                                                 "label": 1.5}],
    "numpy_int_label": [{"x": [1, 2], "label": np.int64(2)}, {"x": [3, 4], "label": np.int64(0)}],
    "tensor_label": [{"x": torch.ones(2), "label": torch.tensor(1)}, {"x": torch.zeros(2), "label": torch.tensor(2)}],
    "label_ids_lists": [{"x": [1.0], "label_ids": [1, 0, 1]}, {"x": [2.0], "label_ids": [0, 0, 1]}],
    "label_ids_tensors": [{"x": [1.0], "label_ids": torch.tensor([0.5, 1.0])},
                          {"x": [2.0], "label_ids": torch.tensor([1.5, 2.0])}],
    "lists_of_numpy_floats": [{"x": [np.float32(1), np.float32(2)], "none": None},
                              {"x": [np.float32(3), np.float32(4)], "none": None}],
}


@pytest.mark.parametrize("case", list(COLLATOR_CASES))
def test_default_collator_as_transformers_default_data_collator(case):
    features = COLLATOR_CASES[case]
    ours, theirs = DefaultCollator()(features), transformers.default_data_collator(features)
    assert set(ours) == set(theirs)
    for key, value in theirs.items():
        assert isinstance(ours[key], torch.Tensor) and ours[key].dtype == value.dtype, key
        torch.testing.assert_close(ours[key], value, rtol=0, atol=0)


# -- model_init, compute_loss_func, optimizer_cls_and_kwargs -------------------------------------------------------
def test_model_init_fresh_model_per_train(tmp_path):
    data = _samples()
    runs = {}
    for framework in FRAMEWORKS:
        trainer = _trainer(framework, tmp_path, dict(max_steps=3), model_init=lambda: TupleClassifier(seed=5),
                           train_dataset=data)
        first, second = trainer.train(), trainer.train()  # each train() starts from model_init() again
        runs[framework] = first.training_loss, second.training_loss, trainer.model.net.weight.detach().clone()
    assert runs["ours"][0] == pytest.approx(runs["ours"][1], rel=1e-7)
    assert runs["ours"][:2] == pytest.approx(runs["hf"][:2], rel=1e-6)
    torch.testing.assert_close(runs["ours"][2], runs["hf"][2], rtol=1e-5, atol=1e-6)


def _doubled_cross_entropy(outputs, labels, num_items_in_batch=None):
    return 2 * F.cross_entropy(outputs[0], labels)


def test_compute_loss_func_in_training_and_evaluation(tmp_path):
    data = _samples()
    runs = {}
    for framework in FRAMEWORKS:
        trainer = _trainer(framework, tmp_path, dict(max_steps=2), model=TupleClassifier(), train_dataset=data,
                           eval_dataset=data, compute_loss_func=_doubled_cross_entropy)
        before = trainer.evaluate()["eval_loss"]
        runs[framework] = before, trainer.train().training_loss, trainer.evaluate()["eval_loss"]
    plain = _trainer("ours", tmp_path / "plain", model=TupleClassifier(), eval_dataset=data).evaluate()["eval_loss"]
    assert runs["ours"][0] == pytest.approx(2 * plain, rel=1e-6)  # the function's loss, not the model's
    assert runs["ours"] == pytest.approx(runs["hf"], rel=1e-6)


def test_optimizer_cls_and_kwargs(tmp_path):
    data = _samples()
    weights = {}
    for framework in FRAMEWORKS:
        trainer = _trainer(framework, tmp_path, dict(max_steps=2, max_grad_norm=0.0), model=TupleClassifier(),
                           train_dataset=data, optimizer_cls_and_kwargs=(torch.optim.SGD, {"lr": 0.5}))
        trainer.train()
        assert isinstance(getattr(trainer.optimizer, "optimizer", trainer.optimizer), torch.optim.SGD)  # (accelerate)
        weights[framework] = trainer.model.net.weight.detach().clone()
    torch.testing.assert_close(weights["ours"], weights["hf"], rtol=1e-6, atol=1e-7)
    assert not torch.equal(weights["ours"], TupleClassifier().net.weight)


def _sgd() -> torch.optim.Optimizer:
    return torch.optim.SGD(TupleClassifier().parameters(), lr=1.0)


@pytest.mark.parametrize("make_kwargs,error", [
    (lambda: {}, RuntimeError),  # neither a model nor a model_init
    (lambda: {"model": TupleClassifier(), "model_init": lambda: TupleClassifier()}, ValueError),  # both
    (lambda: {"model": TupleClassifier(), "optimizers": (_sgd(), None),
              "optimizer_cls_and_kwargs": (torch.optim.SGD, {})}, RuntimeError),
    (lambda: {"model_init": lambda: TupleClassifier(), "optimizers": (_sgd(), None)}, RuntimeError),
])
def test_constructor_errors_as_transformers(tmp_path, make_kwargs, error):
    for framework in FRAMEWORKS:
        with pytest.raises(error):
            _trainer(framework, tmp_path, **make_kwargs())


# -- log_history and the metrics of train / evaluate / predict -------------------------------------------------------
def _lm_script(framework: str, out, tokens_seen: str = "no"):
    data = token_samples(16, min_len=8, max_len=8, mask_prompt=False)
    trainer = _trainer(framework, out, dict(max_steps=4, per_device_train_batch_size=4, logging_steps=2,
                                            eval_strategy="steps", eval_steps=2, learning_rate=1e-3),
                       model=tiny_llama(), train_dataset=data, eval_dataset=data[:4])
    trainer.args.include_num_input_tokens_seen = tokens_seen  # (set after construction: see the args' own tests)
    train = trainer.train()
    return trainer, train.metrics


@pytest.mark.parametrize("tokens_seen", ["no", "all"])
def test_log_history_rows_and_metrics_keys(tmp_path, tokens_seen):
    hf, hf_train = _lm_script("hf", tmp_path, tokens_seen)
    ours, train = _lm_script("ours", tmp_path, tokens_seen)
    assert set(train) == set(hf_train)
    assert train["train_loss"] == pytest.approx(hf_train["train_loss"], rel=1e-5)
    assert len(ours.state.log_history) == len(hf.state.log_history) == 5
    for mine, theirs in zip(ours.state.log_history, hf.state.log_history):
        assert set(mine) - set(theirs) <= OUR_EVAL_ADDITIONS and set(theirs) <= set(mine)
        for key in ("step", "epoch", "num_input_tokens_seen", "total_flos"):
            assert mine.get(key) == theirs.get(key), key
    # vlmtrain's own per-step figures are in metrics.jsonl (and the console, trackers), not in log_history.
    rows = [json.loads(line) for line in open(tmp_path / "ours" / "metrics.jsonl")]
    assert all({"samples_per_second", "data_wait_fraction"} <= set(r) for r in rows if "loss" in r)
    assert not any("samples_per_second" in h for h in ours.state.log_history)


def test_predict_and_evaluate_on_a_stream_without_length(tmp_path):
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(token_samples(5, min_len=8, max_len=8))

    results = {}
    for framework in FRAMEWORKS:  # with the progress bar (it has no total)
        trainer = _trainer(framework, tmp_path, dict(disable_tqdm=False), model=tiny_llama(), eval_dataset=Stream())
        results[framework] = trainer.evaluate(), trainer.predict(Stream())
    (hf_eval, hf_pred), (evaluation, pred) = results["hf"], results["ours"]
    assert set(evaluation) - set(hf_eval) == {"eval_samples"} and evaluation["eval_samples"] == 5
    assert evaluation["eval_loss"] == pytest.approx(hf_eval["eval_loss"], rel=1e-6)
    assert set(pred.metrics) == set(hf_pred.metrics)
    np.testing.assert_allclose(pred.predictions, hf_pred.predictions, rtol=1e-5, atol=1e-6)


# -- stateful callbacks -----------------------------------------------------------------------------------------
class CountingCallback(transformers.TrainerCallback, transformers.trainer_callback.ExportableState):
    """A user callback with transformers' ExportableState: its state rides in trainer_state.json."""

    def __init__(self, every: int = 1) -> None:
        self.every, self.steps_seen = every, 0

    def on_step_end(self, args, state, control, **kwargs):
        self.steps_seen += 1

    def state(self) -> dict:
        return {"args": {"every": self.every}, "attributes": {"steps_seen": self.steps_seen}}


def _stateful_script(framework: str, out, resume: str | None = None):
    data = _samples(16)
    early = (transformers.EarlyStoppingCallback if framework == "hf" else vlmtrain.EarlyStoppingCallback)(5, 0.0)
    counter = CountingCallback(every=3)
    trainer = _trainer(framework, out, dict(max_steps=4, per_device_train_batch_size=4, eval_strategy="steps",
                                            eval_steps=1, save_strategy="steps", save_steps=2,
                                            metric_for_best_model="loss",
                                            restore_callback_states_from_checkpoint=True),
                       model=TupleClassifier(), train_dataset=data, eval_dataset=data[:4],
                       callbacks=[early, counter])
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def test_stateful_callbacks_saved_and_restored_as_transformers(tmp_path):
    saved = {}
    for framework in FRAMEWORKS:
        _stateful_script(framework, tmp_path)
        with open(tmp_path / framework / "checkpoint-2" / "trainer_state.json") as f:
            saved[framework] = json.load(f)["stateful_callbacks"]
    # vlmtrain's metrics.jsonl writer keeps its row count there too (for an exact resume of the log)
    assert saved["ours"].pop("JsonlLoggerCallback")["rows"] == 4
    assert saved["ours"] == saved["hf"]
    assert saved["ours"]["CountingCallback"] == {"args": {"every": 3}, "attributes": {"steps_seen": 2}}
    assert set(saved["ours"]) == {"CountingCallback", "EarlyStoppingCallback", "TrainerControl"}
    resumed = {}
    for framework in FRAMEWORKS:  # resumed at step 2 with fresh callbacks: their saved state comes back
        trainer = _stateful_script(framework, tmp_path / "resumed",
                                   resume=str(tmp_path / framework / "checkpoint-2"))
        found = {type(cb).__name__: cb for cb in trainer.callback_handler.callbacks}
        resumed[framework] = (found["CountingCallback"].steps_seen, found["CountingCallback"].every,
                              found["EarlyStoppingCallback"].early_stopping_patience_counter)
    assert resumed["ours"] == resumed["hf"] == (4, 3, resumed["hf"][2])


def test_early_stopping_check_metric_value_as_transformers():
    args = vlmtrain.TrainingArguments(output_dir="unused", metric_for_best_model="accuracy", eval_strategy="steps")
    state = vlmtrain.TrainerState(best_metric=0.5)
    ours, hf = vlmtrain.EarlyStoppingCallback(3, 0.1), transformers.EarlyStoppingCallback(3, 0.1)
    for value in (0.55, 0.7, float("nan"), 0.4):  # below the threshold, better, NaN, worse
        for cb in (ours, hf):
            cb.check_metric_value(args, state, None, value)
        assert ours.early_stopping_patience_counter == hf.early_stopping_patience_counter
        assert ours.state() == hf.state()
    assert ours.early_stopping_patience_counter == 2


class Capture(transformers.TrainerCallback):
    def __init__(self) -> None:
        self.seen: list = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.seen.append(dict(logs))

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        self.seen.append({"metrics": dict(metrics), "model": kwargs["model"] is not None})


def test_callback_handler_events_called_as_trainer_subclasses_do(tmp_path):
    seen = {}
    for framework in FRAMEWORKS:  # a Trainer subclass (TRL-style) calling the handler itself
        capture = Capture()
        trainer = _trainer(framework, tmp_path, model=TupleClassifier(), callbacks=[capture])
        handler = trainer.callback_handler
        trainer.control = handler.on_log(trainer.args, trainer.state, trainer.control, {"reward": 1.0})
        handler.on_evaluate(trainer.args, trainer.state, trainer.control, {"eval_x": 2.0})
        handler.call_event("on_log", trainer.args, trainer.state, trainer.control, logs={"kl": 0.5})
        seen[framework] = capture.seen
    assert seen["ours"] == seen["hf"] == [{"reward": 1.0}, {"metrics": {"eval_x": 2.0}, "model": True}, {"kl": 0.5}]


# -- an overridden get_train_dataloader -------------------------------------------------------------------------------
def test_overridden_train_dataloader_may_be_any_iterable(tmp_path):
    data = _samples(16)
    batches = [DefaultCollator()(data[i:i + 4]) for i in range(0, 16, 4)]
    losses = {}
    for framework in FRAMEWORKS:
        class ListTrainer(FRAMEWORKS[framework][0]):
            def get_train_dataloader(self):
                return list(batches)  # no .dataset, no .sampler, no state_dict

        trainer = ListTrainer(model=TupleClassifier(), train_dataset=data,
                              args=_args(framework, tmp_path, num_train_epochs=2))
        with pytest.warns(UserWarning, match="no state_dict") if framework == "ours" else _nothing():
            out = trainer.train()
        losses[framework] = (out.global_step, [h["loss"] for h in trainer.state.log_history if "loss" in h])
    assert losses["ours"][0] == losses["hf"][0] == 8
    assert losses["ours"][1] == pytest.approx(losses["hf"][1], rel=1e-6)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


# -- a micro-batch without targets under gradient accumulation ---------------------------------------------------------
class _InOrder(torch.utils.data.IterableDataset):
    """Samples in a fixed order (no shuffle in either Trainer): micro-batches are the same in both."""

    def __init__(self, samples: list[dict]) -> None:
        self.samples = samples

    def __iter__(self):
        return iter(self.samples)


def _no_target_script(framework: str, out):
    """4 steps of 2 micro-batches of 2; the first micro-batch of steps 1 and 3 has no target at all."""
    data = token_samples(16, min_len=6, max_len=10)
    for i in (0, 1, 8, 9):
        data[i]["labels"] = [-100] * len(data[i]["labels"])
    trainer = _trainer(framework, out, dict(max_steps=4, per_device_train_batch_size=2, gradient_accumulation_steps=2,
                                            logging_steps=1, learning_rate=1e-2, optim="sgd"),
                       model=tiny_llama(), train_dataset=_InOrder(data),
                       data_collator=transformers.DataCollatorForSeq2Seq(_PadOnly(), padding=True))
    return trainer, trainer.train()


class _PadOnly:
    """What DataCollatorForSeq2Seq needs of a tokenizer: padding with id 0 on the right."""

    pad_token_id, padding_side, model_input_names = 0, "right", ["input_ids", "attention_mask"]

    def pad(self, features, padding=True, max_length=None, pad_to_multiple_of=None, return_tensors="pt"):
        longest = max(len(f["input_ids"]) for f in features)
        return {k: torch.tensor([list(f[k]) + [0] * (longest - len(f[k])) for f in features])
                for k in features[0]}


def test_a_micro_batch_without_targets_logs_the_loss_transformers_logs(tmp_path):
    """No NaN: the logged loss of each step and train_loss are transformers' (its loss per micro-batch is summed
    over the window's targets, a micro-batch without any adds 0), and so are the weights after 4 steps."""
    hf, hf_out = _no_target_script("hf", tmp_path)
    ours, out = _no_target_script("ours", tmp_path)
    losses = [[h["loss"] for h in t.state.log_history if "loss" in h] for t in (ours, hf)]
    assert len(losses[0]) == 4 and not any(np.isnan(losses[0]))
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)
    assert out.training_loss == pytest.approx(hf_out.training_loss, rel=1e-5)
    for (name, a), b in zip(ours.model.state_dict().items(), hf.model.state_dict().values()):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-7), name
