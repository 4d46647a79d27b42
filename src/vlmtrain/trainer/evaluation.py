"""evaluate() and predict(): the loss (and every loss_*) over a whole eval set, logits or generations,
and compute_metrics. A mixin of TrainerCore, kept apart so each file reads on its own."""

from __future__ import annotations

import itertools
import time
import warnings
from collections import Counter
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset

from .parts import Refused
from .predictions import Collected, combine_eval_metrics, plain_numbers, select_outputs
from .sharding import sharding_of
from .state import EvalLoopOutput, EvalPrediction, PredictionOutput, StepOutput
from .stats import LossAverager, extra_losses, is_empty_batch, item_counts, num_items_of, skipped_counts


class _EvalTally:
    """What evaluation collects over the batches: the losses' averages, predictions, labels, and the counts of
    samples evaluated and skipped (by reason)."""

    def __init__(self) -> None:
        self.losses, self.preds, self.labels = LossAverager(), Collected(), Collected()
        self.samples, self.skipped = 0, Counter()

    def add(self, batch: Mapping[str, Any], loss: Any, pred: Any, label: Any, extras: dict[str, Any]) -> None:
        """One evaluated batch: its loss weighted by num_items (else its sample count), each `loss_<name>` by
        its `num_items_<name>`."""
        size = next((v.shape[0] for v in batch.values() if isinstance(v, torch.Tensor) and v.ndim), 1)
        self.samples += size
        self.skipped.update(skipped_counts(batch))
        weight = extras.pop("num_items", None)
        counts = {f"loss_{k[len('num_items_'):]}": extras.pop(k) for k in list(extras) if k.startswith("num_items_")}
        if loss is not None:
            self.losses.add({"loss": loss, **extras}, weight if weight is not None else float(size), counts)
        self.preds.add(pred)
        self.labels.add(label)


_LARGE_VOCAB = 4096  # a last dim this long on 3-d predictions: LM logits over a vocabulary


class EvaluationMixin:
    """evaluate / predict / evaluation_loop / prediction_step for TrainerCore."""

    def evaluate(self, eval_dataset: Dataset | dict[str, Dataset] | None = None, ignore_keys: list[str] | None = None,
                 metric_key_prefix: str = "eval") -> dict[str, float]:
        """Mean loss (weighted by num_items), every `loss_*`, and compute_metrics, keyed `<prefix>_<name>`.
        A dict of datasets is evaluated one by one with prefixes `eval_<name>_`, then combined: `eval_<metric>`
        is the sample-weighted mean over the sets of each metric they all report (logged as one more line)."""
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        if isinstance(dataset, Mapping):
            metrics: dict[str, float] = {}
            for name, ds in dataset.items():
                metrics.update(self.evaluate(ds, ignore_keys, f"{metric_key_prefix}_{name}"))
            overall = combine_eval_metrics(metrics, [f"{metric_key_prefix}_{name}" for name in dataset],
                                           metric_key_prefix)
            if overall:
                self.log(overall)
                metrics.update(overall)
            return metrics
        dataloader = self.get_eval_dataloader(dataset)
        head_metrics = callable(getattr(self.model, "head_metrics", None))  # score heads: metrics with no code
        start = time.time()
        output = self.evaluation_loop(dataloader, description="Evaluation",
                                      prediction_loss_only=self.compute_metrics is None and not head_metrics,
                                      ignore_keys=ignore_keys, metric_key_prefix=metric_key_prefix)
        output.metrics.update(self._evaluate_metrics(output, metric_key_prefix, start))
        if self.parts.eval_samples is not None:  # per-sample results for the run report (logging/eval_samples.py)
            self.parts.eval_samples(self, dataset, output, metric_key_prefix)
        self.log(output.metrics)
        self.control = self._event("on_evaluate", metrics=output.metrics)
        return output.metrics

    def predict(self, test_dataset: Dataset, ignore_keys: list[str] | None = None,
                metric_key_prefix: str = "test") -> PredictionOutput:
        """Predictions (logits, or generated token ids with predict_with_generate; then also `texts`), labels
        and metrics for a dataset. For a model with score heads (`logits_<name>` outputs), `heads` holds their
        outputs per head name, one row per sample; predictions are those too, or the generated ids with
        predict_with_generate."""
        dataloader, start = self.get_test_dataloader(test_dataset), time.time()
        output = self.evaluation_loop(dataloader, description="Prediction", prediction_loss_only=False,
                                      ignore_keys=ignore_keys, metric_key_prefix=metric_key_prefix)
        output.metrics.update(self._evaluate_metrics(output, metric_key_prefix, start))
        output.metrics.pop(f"{metric_key_prefix}_samples", None)  # (transformers' keys: the count is len(predictions))
        self.control = self._event("on_predict", metrics=output.metrics)
        return PredictionOutput(output.predictions, output.label_ids, output.metrics, getattr(output, "texts", None),
                                getattr(output, "heads", None))

    def _evaluate_metrics(self, output: Any, metric_key_prefix: str, start: float) -> dict[str, float]:
        """What evaluate() and predict() add to evaluation_loop's metrics: `<prefix>_samples`, the samples evaluated
        (vlmtrain.Trainer adds transformers' runtime and rates from ``start``: vlmtrain/compat/evaluation.py)."""
        samples = getattr(output, "num_samples", None)  # (an override's result may not have it)
        return {} if samples is None else {f"{metric_key_prefix}_samples": samples}

    def get_test_dataloader(self, test_dataset: Any) -> Any:
        """Batches of a test set for predict(): as the eval loader (per_device_eval_batch_size, never packed)."""
        return self._eval_loader(test_dataset, "test")

    def get_eval_dataloader(self, eval_dataset: Dataset | str | None = None) -> DataLoader:
        """Batches of the eval set, never packed. With several ranks (DDP or FSDP) each rank reads its share
        (every world_size-th sample) and evaluation_loop gathers the results."""
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        if isinstance(eval_dataset, str):  # the name of one of several eval sets, as in transformers
            dataset = self.eval_dataset[eval_dataset]
        if dataset is None:
            raise ValueError("Evaluation needs an eval_dataset: pass Trainer(eval_dataset=...) or evaluate(dataset).")
        if not self.args.dataloader_persistent_workers:
            return self._eval_loader(dataset, "Evaluation")
        # persistent workers: one loader (and its workers) per eval set for every evaluation, as transformers keeps
        kept = self.__dict__.setdefault("_kept_eval_loaders", {})
        if kept.get(id(dataset), (None,))[0] is not dataset:
            kept[id(dataset)] = dataset, self._eval_loader(dataset, "Evaluation")
        return kept[id(dataset)][1]

    def _eval_loader(self, dataset: Any, description: str) -> DataLoader:
        """The loader of get_eval_dataloader / get_test_dataloader over ``dataset``."""
        unpacked = getattr(self.data_collator, "without_packing", None)  # predictions line up with samples
        dataset, collator = self._loader_data(dataset, unpacked() if unpacked else self.data_collator, description)
        sampler = None
        if self._eval_sharding(dataset) == "strided":
            sampler = range(self.rank, len(dataset), self.world_size)
        return DataLoader(dataset, batch_size=self.args.per_device_eval_batch_size, sampler=sampler,
                          collate_fn=collator, **self._loader_options())

    def _eval_sharding(self, dataset: Any) -> str | None:
        """'strided' (we split a map-style set), 'stream' (the dataset splits itself per rank) or None (every
        rank evaluates the whole set: one process, no eval_gather part to put the shares together, a stream that
        does not split, or an FSDP model whose generate cannot keep the ranks in step)."""
        if self.world_size <= 1:
            return None
        if self.parts.eval_gather is None:  # (the core alone: every rank evaluates the whole set)
            if getattr(dataset, "splits_by_rank", False):
                Refused("eval_gather", f"evaluating {type(dataset).__name__}, which splits across ranks,")()
            return None
        sharded = sharding_of(self.model, self.parts.sharding) is not None
        generation = self.parts.generation if sharded and self.args.predict_with_generate else None
        if generation is not None and not generation.generates_in_step(self.model):
            if getattr(dataset, "splits_by_rank", False):
                raise ValueError(f"Under train.fsdp with predict_with_generate, {type(self.model).__name__}.generate "
                                 "takes no `synced_gpus`, so every rank must generate for the same eval batches: "
                                 "give evaluation a map-style dataset (e.g. JSONL), not a stream that splits "
                                 "across ranks.")
            return None
        if getattr(dataset, "splits_by_rank", False):
            return "stream"
        if isinstance(dataset, IterableDataset):
            return None
        return "strided"

    def evaluation_loop(self, dataloader: DataLoader, description: str = "", prediction_loss_only: bool | None = None,
                        ignore_keys: list[str] | None = None, metric_key_prefix: str = "eval") -> EvalLoopOutput:
        """Loss, predictions, metrics and the number of samples evaluated over a loader, as transformers'
        (``description`` names the run; ``prediction_loss_only=None``: ``args.prediction_loss_only``)."""
        if prediction_loss_only is None:
            prediction_loss_only = getattr(self.args, "prediction_loss_only", False)
        self.callback_handler.refs["eval_dataloader"] = dataloader
        sharding = self._eval_sharding(getattr(dataloader, "dataset", None))
        model = self.model
        model.eval()
        # FSDP with each rank on its share: ranks run forward in step (see _eval_batches)
        self._eval_lockstep = sharding is not None and sharding_of(model, self.parts.sharding) is not None
        tally = _EvalTally()
        for batch in self._eval_batches(dataloader, tally.skipped, prediction_loss_only, ignore_keys):
            step = self.prediction_step(model, batch, bool(prediction_loss_only), ignore_keys)
            loss, pred, label, *rest = step  # (an override's own 3-tuple has no extras; an older 4-tuple has)
            extras = dict(rest[0] if rest else getattr(step, "extras", {}))
            tally.add(batch, loss, self._reduce_for_metrics(pred, label), label, extras)
            self.control = self._event("on_prediction_step")
        if sharding:  # each rank saw its share: the eval_gather part puts the whole set together on every rank
            tally.losses, tally.samples, tally.skipped = self.parts.eval_gather(
                tally.losses, tally.preds, tally.labels, tally.samples, tally.skipped, interleave=sharding == "strided")
        if (plan := sharding_of(model, self.parts.sharding)) is not None:  # (FSDP keeps its root gathered)
            plan.reshard(model)
        self._eval_lockstep = False
        return self._eval_output(tally, sharding, dataloader, metric_key_prefix)

    def _eval_batches(self, dataloader: DataLoader, skipped: Counter, prediction_loss_only: bool | None,
                      ignore_keys: list[str] | None) -> Iterator[Any]:
        """The loader's batches to evaluate, at most max_eval_batches; a batch whose samples were all bad is
        counted in ``skipped`` and left out. In lockstep (FSDP, each rank on its share) the sharding plan keeps the
        ranks' forwards in step: a rank whose share is done runs stand-in batches, their results dropped."""
        batches = itertools.islice(dataloader, self.args.max_eval_batches)
        if self._eval_lockstep:
            yield from self.parts.sharding.eval_in_step(batches, skipped, lambda batch: self.prediction_step(
                self.model, batch, prediction_loss_only, ignore_keys))
            return
        for batch in batches:
            if is_empty_batch(batch):  # every sample of this batch was bad
                skipped.update(skipped_counts(batch))
            else:
                yield batch

    def _eval_output(self, tally: _EvalTally, sharding: str | None, dataloader: DataLoader,
                     metric_key_prefix: str) -> EvalLoopOutput:
        """Predictions, labels and metrics (`<prefix>_<name>`: losses, score heads', compute_metrics', sample and
        skipped counts) of an evaluation; generations decoded to texts."""
        preds, labels = tally.preds, tally.labels
        predictions, label_ids = preds.result(), labels.result()
        if preds.kind == "dict" and "generated" in preds.chunks:  # generations and score heads' outputs
            predictions, label_ids = preds.arrays()["generated"], labels.arrays().get("labels")
        metrics = dict(tally.losses.compute(across_ranks=not sharding))
        head_outputs = preds.named("logits_") or None
        if head_outputs and callable(getattr(self.model, "head_metrics", None)):
            metrics.update(self.model.head_metrics(head_outputs, labels.named("labels_")))
        if self.compute_metrics is not None and predictions is not None:
            metrics.update(self._user_metrics(predictions, label_ids, dataloader, sharding))
        metrics.update(self._eval_counts(tally))
        metrics = {k if k.startswith(f"{metric_key_prefix}_") else f"{metric_key_prefix}_{k}": v
                   for k, v in metrics.items()}
        texts = None  # (the generation part: models/generation.py)
        if self.args.predict_with_generate and predictions is not None:
            texts = self.parts.generation.texts(self.processing_class, predictions)
        return EvalLoopOutput(predictions, label_ids, metrics, tally.samples, texts, head_outputs)

    def _user_metrics(self, predictions: Any, label_ids: Any, dataloader: DataLoader,
                      sharding: str | None) -> dict[str, Any]:
        """compute_metrics' result on the whole set, or batch by batch with batch_eval_metrics (a batch: every
        rank's rows of it when the ranks shared the set)."""
        if self.args.batch_eval_metrics:
            rows = (dataloader.batch_size or self.args.per_device_eval_batch_size) * (self.world_size if sharding else 1)
            batch_metrics = self.parts.batch_eval_metrics.compute
            return plain_numbers(batch_metrics(self.compute_metrics, predictions, label_ids, rows, EvalPrediction)
                                 or {})
        return plain_numbers(self.compute_metrics(EvalPrediction(predictions, label_ids)))

    def _eval_counts(self, tally: _EvalTally) -> dict[str, Any]:
        """An evaluation's skipped samples by reason (vlmtrain.Trainer adds transformers' model_preparation_time:
        vlmtrain/compat/evaluation.py); the samples evaluated are its num_samples."""
        return {f"skipped_{reason}": n for reason, n in sorted(tally.skipped.items())}

    def _reduce_for_metrics(self, pred: Any, label: Any) -> Any:
        """What evaluation keeps of one batch's predictions: ``preprocess_logits_for_metrics(pred, labels)``
        when the Trainer has one (e.g. argmax ids: B x L instead of B x L x vocab), else ``pred`` itself, as
        transformers does. Kept whole, LM logits of a large vocabulary grow with the eval set: warned once."""
        if pred is None:
            return None
        if self.preprocess_logits_for_metrics is not None:
            return self.preprocess_logits_for_metrics(pred, label)
        tensors = pred.values() if isinstance(pred, Mapping) else pred if isinstance(pred, (tuple, list)) else [pred]
        vocab = max((t.shape[-1] for t in tensors if isinstance(t, torch.Tensor) and t.ndim == 3), default=0)
        if vocab >= _LARGE_VOCAB and not getattr(self, "_warned_full_logits", False):
            self._warned_full_logits = True
            warnings.warn(f"evaluation keeps the full logits (batch x length x {vocab}) of every eval batch (for "
                          "compute_metrics or predict); pass Trainer(preprocess_logits_for_metrics=...) to keep "
                          "less, e.g. `lambda logits, labels: logits.argmax(-1)`.", stacklevel=3)
        return pred

    def prediction_step(self, model: nn.Module, inputs: Mapping[str, Any], prediction_loss_only: bool,
                        ignore_keys: list[str] | None = None) -> StepOutput:
        """Returns transformers' (loss, predictions, labels), with `.extras` holding `loss_*`, `num_items` and each
        `num_items_<name>` (the item count of `loss_<name>`): a StepOutput. Predictions are logits, generated ids when
        predict_with_generate is on, or several named outputs (see trainer/predictions.py: head outputs; in
        vlmtrain.Trainer also transformers' convention when `args.label_names` is set)."""
        prompt = {k[len("prompt_"):]: v.to(self.device) for k, v in inputs.items()
                  if k.startswith("prompt_") and isinstance(v, torch.Tensor)}
        inputs = self._prepare_inputs(inputs)
        labels = inputs.get("labels")
        generating = self.args.predict_with_generate
        # Forward for the loss, for score heads' outputs, and under FSDP in step (every rank runs the same calls)
        forward = (labels is not None or not generating or getattr(self, "_eval_lockstep", False)
                   or callable(getattr(self.model, "head_metrics", None)))
        if getattr(self, "_forward_takes_loss_only", False) and (prediction_loss_only or generating):
            inputs = {**inputs, "loss_only": True}  # (no logits kept: the LM head only at the targets)
        loss, extras, outputs = self._eval_forward(model, inputs, forward)
        if isinstance(outputs, (tuple, list)):  # (loss, logits, ...) as transformers returns them
            return self._tuple_predictions(loss, outputs, inputs, prediction_loss_only)
        if prediction_loss_only:
            return StepOutput(loss, None, None, extras)
        if generating:
            if not prompt:
                raise ValueError("predict_with_generate needs `prompt_input_ids` (and prompt_attention_mask) in "
                                 "each batch: have the data collator add the left-padded prompts.")
            generated = self.generate(prompt)
            heads, head_labels = select_outputs(outputs, inputs, ignore_keys)
            if not isinstance(heads, Mapping):  # no score heads: the generated ids alone
                return StepOutput(loss, generated, labels, extras)
            # score heads too: kept beside the generations (evaluation_loop splits them again)
            return StepOutput(loss, {"generated": generated, **heads}, {"labels": labels, **(head_labels or {})}, extras)
        predictions, labels = self._predictions_and_labels(outputs, inputs, ignore_keys)
        return StepOutput(loss, predictions, labels, extras)

    def _predictions_and_labels(self, outputs: Any, inputs: dict[str, Any],
                                ignore_keys: list[str] | None) -> tuple[Any, Any]:
        """What evaluation keeps of a batch's outputs and labels: trainer/predictions.py's select_outputs
        (vlmtrain.Trainer follows `args.label_names` when set: vlmtrain/compat/evaluation.py)."""
        return select_outputs(outputs, inputs, ignore_keys)

    def _eval_forward(self, model: nn.Module, inputs: dict[str, Any], forward: bool) -> tuple[Any, dict, Any]:
        """prediction_step's forward, without gradients: (loss, extras, outputs). The loss is compute_loss's
        when the batch holds its labels (as training computes it, compute_loss_func too), else the model's
        own; extras as prediction_step returns them. Without ``forward`` (generation alone) nothing runs."""
        loss, extras, outputs = None, {}, None
        with torch.no_grad(), self.autocast():
            if forward and self._has_labels(inputs):
                loss, outputs = self.compute_loss(model, inputs, return_outputs=True)
                loss = loss.detach().float().mean()
            elif forward:
                outputs = model(**inputs)
            if isinstance(outputs, Mapping):
                if loss is None and outputs.get("loss") is not None:
                    loss = outputs["loss"].detach().float()
                if loss is not None:
                    extras = extra_losses(outputs)
                    n = num_items_of(outputs, self.model, inputs, self.parts.loss_targets)
                    if n is not None:
                        extras["num_items"] = n
                    extras.update({f"num_items_{k[len('loss_'):]}": v for k, v in item_counts(outputs).items()})
        return loss, extras, outputs

    def _tuple_predictions(self, loss: Any, outputs: tuple | list, inputs: dict[str, Any],
                           prediction_loss_only: bool) -> StepOutput:
        """prediction_step's result for a model returning a tuple: its loss alone (vlmtrain.Trainer reads
        transformers' `(loss, logits, ...)` convention: vlmtrain/compat/evaluation.py)."""
        return StepOutput(loss, None, None)

    def _has_labels(self, inputs: Mapping[str, Any]) -> bool:
        """Whether the batch holds its `labels` (vlmtrain.Trainer: every one of `args.label_names`): then
        evaluation takes the loss from compute_loss, as transformers' prediction_step does."""
        return inputs.get("labels") is not None

    def generate(self, prompt: dict[str, torch.Tensor]) -> torch.Tensor:
        """Greedy generation from the batch's `prompt_*` inputs; returns only the new tokens (the ``generation``
        part: models/generation.py). FSDP with ranks on different batches: forward until all are done."""
        with torch.no_grad(), self.autocast():
            return self.parts.generation.generate(self.model, prompt, self.processing_class,
                                                  self.args.generation_max_new_tokens,
                                                  synced_gpus=getattr(self, "_eval_lockstep", False))

    def _update_best(self, metrics: dict[str, float]) -> bool:
        name = self.args.metric_for_best_model
        if name is None:
            return False
        key = name if name.startswith("eval_") else f"eval_{name}"
        if key not in metrics:
            raise KeyError(f"The `metric_for_best_model` training argument is set to '{key}', which is not found in "
                           f"the evaluation metrics. The available evaluation metrics are: {list(metrics)}. Consider "
                           "changing the `metric_for_best_model` via the TrainingArguments.")  # (transformers' text)
        value, best = metrics[key], self.state.best_metric
        if best is None or (value > best if self.args.greater_is_better else value < best):
            self.state.best_metric, self.state.best_global_step = value, self.state.global_step
            return True
        return False
