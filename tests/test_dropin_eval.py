"""Evaluation idioms of transformers scripts, run unchanged with vlmtrain's Trainer (only the import differs):
`preds, labels = eval_preds` in compute_metrics, `predictions, labels, metrics = trainer.predict(ds)`, and a
question-answering Trainer subclass whose evaluate() calls `self.evaluation_loop(...)` and post-processes its
`EvalLoopOutput`. Each script runs under both Trainers; the test compares what the script observes."""

from __future__ import annotations

import math
import time

import numpy as np
import pytest
import torch
import transformers
from tiny import VOCAB, tiny_llama, token_samples
from transformers.trainer_utils import speed_metrics

import vlmtrain

FRAMEWORKS = {"hf": (transformers.Trainer, transformers.TrainingArguments),
              "ours": (vlmtrain.Trainer, vlmtrain.TrainingArguments)}
OUR_EVAL_ADDITIONS = {"eval_samples"}  # vlmtrain's evaluate() also reports how many samples it evaluated
TIMINGS = ("_runtime", "_per_second", "_time")


def _args(framework: str, out, **kw):
    """Each training step sees the whole (tiny) training set: the two Trainers shuffle differently."""
    base = dict(output_dir=str(out / framework), report_to="none", disable_tqdm=True, per_device_train_batch_size=16,
                per_device_eval_batch_size=3, optim="adamw_torch", logging_steps=1, save_strategy="no",
                learning_rate=1e-3)
    base.update(kw)
    return FRAMEWORKS[framework][1](**base, **({"use_cpu": True} if framework == "hf" else {}))


def _untimed(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if not k.endswith(TIMINGS) and k not in OUR_EVAL_ADDITIONS}


def _same_keys(ours: dict, hf: dict) -> None:
    assert set(ours) - set(hf) <= OUR_EVAL_ADDITIONS and set(hf) <= set(ours), (sorted(ours), sorted(hf))


# -- (a) a causal LM: compute_metrics unpacks eval_preds, perplexity from eval_loss ---------------------------------
def _next_token_accuracy(eval_preds) -> dict:
    preds, labels = eval_preds  # argmax ids (preprocess_logits_for_metrics), labels with -100 on padding
    preds, labels = preds[:, :-1], labels[:, 1:]  # the prediction at t is for the token at t + 1
    keep = labels != -100
    return {"accuracy": float((preds[keep] == labels[keep]).mean())}


def _argmax_ids(logits, labels):
    if isinstance(logits, tuple):  # some models return more than the logits
        logits = logits[0]
    return logits.argmax(dim=-1)


def _causal_lm_script(framework: str, out):
    train, held_out = token_samples(16, seed=1, min_len=10, max_len=10), token_samples(7, seed=2, min_len=10,
                                                                                        max_len=10)
    trainer = FRAMEWORKS[framework][0](
        model=tiny_llama(), args=_args(framework, out, max_steps=4, eval_strategy="steps", eval_steps=2),
        train_dataset=train, eval_dataset=held_out, compute_metrics=_next_token_accuracy,
        preprocess_logits_for_metrics=_argmax_ids)
    trainer.train()
    metrics = trainer.evaluate()
    try:
        metrics["perplexity"] = math.exp(metrics["eval_loss"])
    except OverflowError:
        metrics["perplexity"] = float("inf")
    return trainer, metrics


def test_causal_lm_compute_metrics_unpacks_eval_preds(tmp_path):
    hf, hf_metrics = _causal_lm_script("hf", tmp_path)
    ours, metrics = _causal_lm_script("ours", tmp_path)
    _same_keys(metrics, hf_metrics)
    assert _untimed(metrics) == pytest.approx(_untimed(hf_metrics), rel=1e-5)
    assert 0 < metrics["eval_accuracy"] < 1 and metrics["perplexity"] > 1
    assert len(ours.state.log_history) == len(hf.state.log_history)
    for mine, theirs in zip(ours.state.log_history, hf.state.log_history):
        _same_keys(mine, theirs)
        assert _untimed(mine) == pytest.approx(_untimed(theirs), rel=1e-5)
    assert sum("eval_accuracy" in h for h in ours.state.log_history) == 3  # steps 2 and 4, and the last evaluate


def test_eval_prediction_behaves_as_transformers():
    preds, labels, inputs, losses = np.zeros((2, 3)), np.ones(2), np.arange(2), np.full(2, 0.5)
    for kwargs in ({}, {"inputs": inputs}, {"losses": losses}, {"inputs": inputs, "losses": losses}):
        ours, theirs = vlmtrain.EvalPrediction(preds, labels, **kwargs), transformers.EvalPrediction(preds, labels,
                                                                                                     **kwargs)
        assert [id(x) for x in ours] == [id(x) for x in theirs]
        assert [id(ours[i]) for i in range(len(theirs.elements))] == [id(x) for x in theirs.elements]
        for name in ("predictions", "label_ids", "inputs", "losses"):
            assert getattr(ours, name) is getattr(theirs, name)
        for bad in (-1, len(theirs.elements)):  # transformers refuses negative and past-the-end indexes alike
            with pytest.raises(IndexError):
                ours[bad]
            with pytest.raises(IndexError):
                theirs[bad]
    for p in (vlmtrain.EvalPrediction(preds, labels), transformers.EvalPrediction(preds, labels)):
        with pytest.raises(TypeError):  # no len(), as transformers'
            len(p)
        predictions, label_ids = p
        assert predictions is preds and label_ids is labels


# -- (b) a question-answering Trainer subclass over evaluation_loop ------------------------------------------------
def _qa_features(n: int, seed: int, length: int = 8) -> list[dict]:
    """Token rows where the answer starts at the marker token 1 and ends two tokens later."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, VOCAB, (n, length), generator=g)
    ids[torch.arange(n), _answer_starts(n, seed)] = 1
    return [{"input_ids": row.tolist(), "attention_mask": [1] * length} for row in ids]


def _answer_starts(n: int, seed: int) -> list[int]:
    return [(i * 3 + seed) % 6 for i in range(n)]


def _qa_train(n: int, seed: int) -> list[dict]:
    rows = _qa_features(n, seed)
    for row, start in zip(rows, _answer_starts(n, seed)):
        row["start_positions"], row["end_positions"] = start, start + 2
    return rows


def _best_spans(features: list[dict], predictions) -> list[tuple[int, int]]:
    """The post-processing: for each feature, the (start, end) pair with end >= start of highest summed score."""
    start_logits, end_logits = predictions
    spans = []
    for i, _ in enumerate(features):
        scores = start_logits[i][:, None] + end_logits[i][None, :]
        scores = np.where(np.triu(np.ones_like(scores)) > 0, scores, -np.inf)
        spans.append(tuple(int(v) for v in np.unravel_index(np.argmax(scores), scores.shape)))
    return spans


def _exact_match(pairs) -> dict:
    predicted, gold = pairs
    return {"exact_match": 100.0 * float(np.mean([p == g for p, g in zip(predicted, gold)]))}


def _qa_trainer_class(base):
    class SpanTrainer(base):
        """Extracts spans itself: evaluation_loop gives the raw logits, post_process turns them into answers."""

        def __init__(self, *args, answers=None, post_process=None, **kwargs):
            super().__init__(*args, **kwargs)
            self.answers, self.post_process = answers, post_process

        def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix="eval"):
            dataset = self.eval_dataset if eval_dataset is None else eval_dataset
            loader = self.get_eval_dataloader(dataset)
            metric_fn, self.compute_metrics = self.compute_metrics, None  # no metrics on raw logits
            started = time.time()
            try:
                output = self.evaluation_loop(loader, description="Evaluation",
                                              prediction_loss_only=True if metric_fn is None else None,
                                              ignore_keys=ignore_keys, metric_key_prefix=metric_key_prefix)
            finally:
                self.compute_metrics = metric_fn
            steps = math.ceil(output.num_samples / (self.args.eval_batch_size * self.args.world_size))
            output.metrics.update(speed_metrics(metric_key_prefix, started, num_samples=output.num_samples,
                                                num_steps=steps))
            metrics = dict(output.metrics)
            if self.post_process is not None and metric_fn is not None:
                spans = self.post_process(dataset, output.predictions)
                extra = metric_fn((spans, self.answers))
                metrics.update({k if k.startswith(f"{metric_key_prefix}_") else f"{metric_key_prefix}_{k}": v
                                for k, v in extra.items()})
            if self.args.should_log:
                self.log(metrics)
            self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
            self.seen = output
            return metrics

    return SpanTrainer


def _qa_script(framework: str, out):
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.LlamaForQuestionAnswering(config)
    held_out = _qa_features(5, seed=3)
    answers = [(start, start + 2) for start in _answer_starts(5, seed=3)]
    trainer = _qa_trainer_class(FRAMEWORKS[framework][0])(
        # (SGD: the span heads' biases get no gradient, a softmax over positions ignores them, and Adam would move
        # them by the sign of rounding noise)
        model=model, args=_args(framework, out, max_steps=3, eval_strategy="steps", eval_steps=3, optim="sgd",
                                learning_rate=0.5),
        train_dataset=_qa_train(16, seed=4), eval_dataset=held_out, compute_metrics=_exact_match,
        answers=answers, post_process=_best_spans)
    trainer.train()
    return trainer, trainer.evaluate()


def test_question_answering_subclass_over_evaluation_loop(tmp_path):
    hf, hf_metrics = _qa_script("hf", tmp_path)
    ours, metrics = _qa_script("ours", tmp_path)
    assert set(metrics) == set(hf_metrics) and "eval_exact_match" in metrics
    assert _untimed(metrics) == pytest.approx(_untimed(hf_metrics), rel=1e-6)
    out, hf_out = ours.seen, hf.seen
    assert type(out).__name__ == "EvalLoopOutput" and out._fields == hf_out._fields and len(out) == len(hf_out) == 4
    assert out.num_samples == hf_out.num_samples == 5
    assert isinstance(out.predictions, tuple) and len(out.predictions) == len(hf_out.predictions) == 2
    for mine, theirs in zip(out.predictions, hf_out.predictions):
        np.testing.assert_allclose(mine, theirs, rtol=1e-5, atol=1e-6)
    assert out.label_ids is None and hf_out.label_ids is None
    assert len(ours.state.log_history) == len(hf.state.log_history)
    for mine, theirs in zip(ours.state.log_history, hf.state.log_history):
        assert set(mine) == set(theirs)
        assert _untimed(mine) == pytest.approx(_untimed(theirs), rel=1e-5)
    # predict() on labelled features: the loss, and label_ids as the tuple (start_positions, end_positions)
    labelled = _qa_train(5, seed=7)
    ours.compute_metrics = hf.compute_metrics = None  # (the span metric is the subclass's evaluate's)
    pred, hf_pred = ours.predict(labelled), hf.predict(labelled)
    assert set(pred.metrics) == set(hf_pred.metrics) and "test_loss" in pred.metrics
    assert _untimed(pred.metrics) == pytest.approx(_untimed(hf_pred.metrics), rel=1e-5)
    for mine, theirs in zip(pred.predictions + pred.label_ids, hf_pred.predictions + hf_pred.label_ids, strict=True):
        np.testing.assert_allclose(mine, theirs, rtol=1e-5, atol=1e-6)


def test_prediction_step_returns_transformers_triple(tmp_path):
    data = token_samples(3, min_len=6, max_len=6)
    for framework in FRAMEWORKS:
        trainer = FRAMEWORKS[framework][0](model=tiny_llama(), args=_args(framework, tmp_path))
        batch = trainer.data_collator(data)
        loss, logits, labels = trainer.prediction_step(trainer.model, batch, prediction_loss_only=False)
        assert logits.shape == (3, 6, VOCAB) and torch.equal(labels, batch["labels"]) and loss.ndim == 0
        assert len(trainer.prediction_step(trainer.model, batch, True)) == 3


def test_prediction_step_override_over_super_in_evaluate(tmp_path):
    data = token_samples(7, min_len=6, max_len=6)
    results = {}
    for framework in FRAMEWORKS:
        class Doubling(FRAMEWORKS[framework][0]):
            def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
                loss, logits, labels = super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)
                return loss * 2, logits, labels

        trainer = Doubling(model=tiny_llama(), args=_args(framework, tmp_path), eval_dataset=data,
                           compute_metrics=_next_token_accuracy, preprocess_logits_for_metrics=_argmax_ids)
        results[framework] = trainer.evaluate()
    _same_keys(results["ours"], results["hf"])
    assert _untimed(results["ours"]) == pytest.approx(_untimed(results["hf"]), rel=1e-6)


# -- (c) predict on token classification: predictions, labels, metrics = ... ----------------------------------------
def _tagging_rows(n: int, seed: int, length: int = 7) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (n, length), generator=g)
    return [{"input_ids": row.tolist(), "attention_mask": [1] * length,
             "labels": [-100] + [int(t) % 3 for t in row[1:]]} for row in ids]  # the first token is not tagged


def _tag_accuracy(eval_preds) -> dict:
    predictions, labels = eval_preds
    predicted = np.argmax(predictions, axis=-1)
    keep = labels != -100
    return {"tag_accuracy": float((predicted[keep] == labels[keep]).mean())}


def _tagging_script(framework: str, out):
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      pad_token_id=0, num_labels=3, classifier_dropout=0.0)  # (no random draws)
    torch.manual_seed(0)
    trainer = FRAMEWORKS[framework][0](
        model=transformers.LlamaForTokenClassification(config), args=_args(framework, out, max_steps=3),
        train_dataset=_tagging_rows(16, seed=5), compute_metrics=_tag_accuracy)
    trainer.train()
    result = trainer.predict(_tagging_rows(5, seed=6))
    predictions, labels, metrics = result
    return result, predictions, labels, metrics


def test_token_classification_predict_unpacks_into_three(tmp_path):
    hf_result, hf_predictions, hf_labels, hf_metrics = _tagging_script("hf", tmp_path)
    result, predictions, labels, metrics = _tagging_script("ours", tmp_path)
    assert len(result) == len(hf_result) == 3 and result._fields == hf_result._fields
    assert list(result._asdict()) == list(hf_result._asdict()) and result[2] is metrics
    assert predictions.shape == hf_predictions.shape == (5, 7, 3)
    np.testing.assert_allclose(predictions, hf_predictions, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(labels, hf_labels)
    assert set(metrics) == set(hf_metrics) and "test_tag_accuracy" in metrics
    assert _untimed(metrics) == pytest.approx(_untimed(hf_metrics), rel=1e-5)
    assert result.texts is None and result.heads is None  # vlmtrain's extras stay reachable as attributes
    assert repr(result).startswith("PredictionOutput(predictions=") and "texts" not in repr(result)


def test_prediction_output_keeps_extras_through_copies():
    import copy
    import pickle

    out = vlmtrain.PredictionOutput(np.zeros(2), None, {"test_loss": 1.0}, texts=["a", "b"],
                                    heads={"score": np.ones(2)})
    assert len(out) == 3 and out._fields == ("predictions", "label_ids", "metrics")
    assert out.texts == ["a", "b"] and set(out.heads) == {"score"}
    for again in (copy.copy(out), copy.deepcopy(out), pickle.loads(pickle.dumps(out)), out._replace(metrics={})):
        assert again.texts == ["a", "b"] and set(again.heads) == {"score"} and len(again) == 3
    bare = vlmtrain.PredictionOutput._make([None, None, {}])
    assert bare.texts is None and bare.heads is None
