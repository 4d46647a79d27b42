"""transformers' Seq2SeqTrainer and Seq2SeqTrainingArguments on vlmtrain's Trainer, for scripts such as
run_summarization / run_translation: with ``predict_with_generate`` evaluation and predict call the model's own
``generate`` (encoder-decoder models such as Bart and T5 too) with ``generation_max_length`` /
``generation_num_beams`` or the call's generation kwargs, and return the generated ids padded as transformers pads
them, for ``compute_metrics`` to decode. Without ``predict_with_generate`` it is vlmtrain's Trainer.

vlmtrain's plain Trainer has its own ``predict_with_generate`` (greedy generation from the batch's ``prompt_*``
inputs, for decoder-only models: vlmtrain/models/generation.py); Seq2SeqTrainer replaces that path with
transformers' (generate from the model inputs themselves), so that a script written for transformers observes the
same predictions."""

from __future__ import annotations

from copy import deepcopy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import GenerationConfig

from ..errors import ConfigError
from ..trainer.sharding import sharding_of
from .arguments import TrainingArguments
from .trainer import Trainer

# transformers' Seq2SeqTrainingArguments fields beyond TrainingArguments: name -> (same | different | no effect,
# how); the migration guide's rows (scripts/gen_migrating.py, checked against the installed transformers).
SEQ2SEQ_FIELDS: dict[str, tuple[str, str]] = {
    "sortish_sampler": ("no effect", "Any value is accepted: transformers 5.x has no sortish sampler either."),
    "predict_with_generate": ("same", "evaluate / predict call `model.generate` on the batch's model inputs"),
    "generation_max_length": ("different", "as transformers; a value below 1 is an error when the arguments are "
                                           "built (transformers: in the first evaluation)."),
    "generation_num_beams": ("different", "as transformers; a value below 1 is an error when the arguments are "
                                          "built (transformers: a ZeroDivisionError in the first evaluation)."),
    "generation_config": ("same", ""),
}
# transformers' Seq2SeqTrainer's own public methods: name -> (same | different, how).
SEQ2SEQ_METHODS: dict[str, tuple[str, str]] = {
    "evaluate": ("different", "as Trainer.evaluate (`eval_samples` added) with the generation kwargs; a dict of "
                              "eval sets keeps the call's kwargs for every set (transformers: the arguments')"),
    "predict": ("same", "with the generation kwargs"),
    "prediction_step": ("different", "returns `(loss, generated ids, labels, extras)` as Trainer.prediction_step; "
                                     "the loss comes from `compute_loss` (transformers: the model's own loss)"),
    "load_generation_config": ("same", ""),
}


@dataclass
class Seq2SeqTrainingArguments(TrainingArguments):
    """TrainingArguments with transformers' Seq2SeqTrainingArguments fields (``predict_with_generate`` is already
    one of vlmtrain's). Values that generation cannot use are a ConfigError at construction (transformers fails
    at the first evaluation)."""

    sortish_sampler: bool = False
    """Accepted, no effect: transformers 5.x no longer has a sortish sampler either."""
    generation_max_length: int | None = None
    """The ``max_length`` passed to ``generate`` in evaluate / predict with predict_with_generate (None: the
    model's generation config decides)."""
    generation_num_beams: int | None = None
    """The ``num_beams`` passed to ``generate`` in evaluate / predict with predict_with_generate (None: the
    model's generation config decides)."""
    generation_config: str | Path | GenerationConfig | None = None
    """A GenerationConfig, or a folder / file / model id to load one from, that replaces the model's
    ``generation_config`` when the Seq2SeqTrainer is built."""

    def __post_init__(self) -> None:
        for name in ("generation_max_length", "generation_num_beams"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ConfigError(f"{name}={value!r}: expected a positive integer (or None to use the model's "
                                  "generation config).")
        if self.generation_config is not None and not isinstance(self.generation_config, (str, Path,
                                                                                          GenerationConfig)):
            raise ConfigError(f"generation_config={self.generation_config!r}: expected a GenerationConfig, or a "
                              "folder, file or model id to load one from.")
        super().__post_init__()

    def to_dict(self) -> dict[str, Any]:
        """As TrainingArguments.to_dict, with a GenerationConfig as its dict (for JSON), as transformers'."""
        d = super().to_dict()
        for k, v in d.items():
            if isinstance(v, GenerationConfig):
                d[k] = v.to_dict()
        return d


class Seq2SeqTrainer(Trainer):
    """vlmtrain's Trainer with transformers' Seq2SeqTrainer's generation: with ``args.predict_with_generate``,
    ``prediction_step`` calls ``model.generate`` with the generation kwargs of ``evaluate`` / ``predict`` (else
    ``generation_max_length`` / ``generation_num_beams``), and the loss comes from a forward with the labels."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # args.generation_config > the model's generation_config > transformers' defaults
        gen_config = getattr(self.args, "generation_config", None)
        if gen_config is not None:
            self.model.generation_config = self.load_generation_config(gen_config)

    @staticmethod
    def load_generation_config(gen_config_arg: str | Path | GenerationConfig) -> GenerationConfig:
        """A copy of a GenerationConfig, or one loaded from a folder, a file in it, or a model id; validated
        strictly (transformers' save_pretrained refuses a config with warnings, so fail now)."""
        if isinstance(gen_config_arg, GenerationConfig):
            gen_config = deepcopy(gen_config_arg)
        else:
            path, file_name = Path(gen_config_arg), None
            if path.is_file():
                path, file_name = path.parent, path.name
            source = path if path.is_dir() else gen_config_arg  # else a model id (or URL)
            gen_config = GenerationConfig.from_pretrained(source, file_name)
        try:
            gen_config.validate(strict=True)
        except ValueError as exc:
            raise ValueError(f"{exc}\n\nFix these issues to train your model.") from None
        return gen_config

    # -- evaluate / predict take generate's kwargs -----------------------------------------------------
    def _generation_kwargs(self, gen_kwargs: dict[str, Any]) -> dict[str, Any]:
        """The call's generation kwargs, with generation_max_length / generation_num_beams where the call sets
        no max_length / max_new_tokens / num_beams."""
        gen_kwargs = dict(gen_kwargs)
        max_length = getattr(self.args, "generation_max_length", None)
        num_beams = getattr(self.args, "generation_num_beams", None)
        if gen_kwargs.get("max_length") is None and gen_kwargs.get("max_new_tokens") is None and max_length is not None:
            gen_kwargs["max_length"] = max_length
        if gen_kwargs.get("num_beams") is None and num_beams is not None:
            gen_kwargs["num_beams"] = num_beams
        return gen_kwargs

    def evaluate(self, eval_dataset: Any = None, ignore_keys: list[str] | None = None,
                 metric_key_prefix: str = "eval", **gen_kwargs: Any) -> dict[str, float]:
        """Trainer.evaluate; with predict_with_generate, ``max_length``, ``num_beams`` and any other ``generate``
        kwargs apply to this call (a dict of eval sets: to each of them)."""
        if getattr(self, "_gen_kwargs_fixed", False):  # (one set of a dict of eval sets: keep the call's kwargs)
            return super().evaluate(eval_dataset, ignore_keys, metric_key_prefix)
        self._gen_kwargs, self._gen_kwargs_fixed = self._generation_kwargs(gen_kwargs), True
        try:
            return super().evaluate(eval_dataset, ignore_keys, metric_key_prefix)
        finally:
            self._gen_kwargs_fixed = False

    def predict(self, test_dataset: Any, ignore_keys: list[str] | None = None, metric_key_prefix: str = "test",
                **gen_kwargs: Any) -> Any:
        """Trainer.predict; with predict_with_generate the predictions are the generated ids (padded with the
        pad id to the generation config's max_length within a batch, with -100 across batches)."""
        self._gen_kwargs = self._generation_kwargs(gen_kwargs)
        return super().predict(test_dataset, ignore_keys, metric_key_prefix)

    # -- the generation step ---------------------------------------------------------------------------
    def prediction_step(self, model: nn.Module, inputs: dict[str, Any], prediction_loss_only: bool,
                        ignore_keys: list[str] | None = None, **gen_kwargs: Any) -> tuple:
        """Without predict_with_generate (or for the loss alone), Trainer.prediction_step. Else ``(loss,
        generated ids, labels, extras)``: ``model.generate`` on the batch's model inputs (the
        ``decoder_input_ids`` a collator made from the labels left out), the generated ids and the labels padded
        with the pad id to the generation config's ``max_length`` (or ``max_new_tokens + 1``), as transformers'."""
        if not self.args.predict_with_generate or prediction_loss_only:
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)
        has_labels = "labels" in inputs
        inputs = self._prepare_inputs(inputs)
        # the call's kwargs > evaluate()/predict()'s > the model's generation_config > transformers' defaults
        if not gen_kwargs:
            gen_kwargs = dict(getattr(self, "_gen_kwargs", None) or self._generation_kwargs({}))
        for name in ("num_beams", "max_length"):
            if name in gen_kwargs and gen_kwargs[name] is None:
                gen_kwargs.pop(name)
        # (FSDP: ranks forward in step)
        gen_kwargs.setdefault("synced_gpus", sharding_of(self.model, self.parts.sharding) is not None)
        generation_inputs = inputs
        labels, decoder_ids = inputs.get("labels"), inputs.get("decoder_input_ids")
        if isinstance(labels, torch.Tensor) and isinstance(decoder_ids, torch.Tensor) and labels.shape == decoder_ids.shape:
            generation_inputs = {k: v for k, v in inputs.items() if k not in ("decoder_input_ids", "decoder_attention_mask")}
        with torch.no_grad(), self.autocast():
            generated = self.model.generate(**generation_inputs, **gen_kwargs)
        gen_config = self.model.generation_config
        if gen_config._from_model_config:  # (as transformers: not re-derived from the model config every batch)
            gen_config._from_model_config = False
        gen_config.update(**gen_config._get_default_generation_params(), defaults_only=True)
        generated = self._pad_to_generation_length(generated, gen_config)
        loss, extras = None, {}
        if has_labels:
            loss, extras, _ = self._eval_forward(model, inputs, True)
            labels = self._pad_to_generation_length(inputs["labels"], gen_config)
        else:
            labels = None
        return loss, generated, labels, extras

    def _pad_to_generation_length(self, tensor: torch.Tensor, gen_config: GenerationConfig) -> torch.Tensor:
        """Right-pad rows shorter than the generation config's max_length (or max_new_tokens + 1)."""
        if tensor.shape[-1] < gen_config.max_length:
            return self._pad_tensors_to_max_len(tensor, gen_config.max_length)
        if gen_config.max_new_tokens is not None and tensor.shape[-1] < gen_config.max_new_tokens + 1:
            return self._pad_tensors_to_max_len(tensor, gen_config.max_new_tokens + 1)
        return tensor

    def _pad_tensors_to_max_len(self, tensor: torch.Tensor, max_length: int) -> torch.Tensor:
        """``tensor`` right-padded to ``max_length`` with the tokenizer's pad id (else its eos id), else the
        model config's pad id."""
        tok = self.processing_class
        if tok is not None and hasattr(tok, "pad_token_id"):
            pad_token_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        elif getattr(getattr(self.model, "config", None), "pad_token_id", None) is not None:
            pad_token_id = self.model.config.pad_token_id
        else:
            raise ValueError("Pad_token_id must be set in the configuration of the model, in order to pad tensors")
        padded = torch.full((tensor.shape[0], max_length), pad_token_id, dtype=tensor.dtype, device=tensor.device)
        padded[:, :tensor.shape[-1]] = tensor
        return padded
