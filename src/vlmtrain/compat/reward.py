"""TRL 1.16's RewardConfig and RewardTrainer on vlmtrain's Trainer, for sequence-classification models with one
output: a TRL reward-modelling script runs with only its import changed. The pairs are tokenized as TRL tokenizes
them and collated chosen-then-rejected (data/reward_pairs.py); the objective (models/objectives/reward.py) returns
the Bradley-Terry loss with TRL's metrics, which the trainer logs as it logs any model's (``eval_`` prefixed)."""

from __future__ import annotations

import dataclasses
import os
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..data.reward_pairs import REWARD_COLUMNS, RewardCollator, tokenize_reward_pair
from ..errors import ConfigError
from ..models.objectives import disable_dropout
from ..models.objectives.reward import RewardObjective
from ..trainer import checkpoint as ckpt
from ..trainer import distributed as dist
from ..trainer.resume import LOOP_STATE
from .arguments import TrainingArguments
from .dpo_reference import PolicyFiles
from .reward_vision import is_hub_vlm, vision_reward_setup
from .trainer import Trainer


@dataclass
class RewardConfig(TrainingArguments):
    """TrainingArguments with TRL 1.16's RewardConfig options and defaults (TRL's defaults differ from
    transformers' for learning_rate 1e-4, logging_steps 10, gradient_checkpointing True, and bf16: on unless fp16
    is set)."""

    learning_rate: float = 1e-4
    logging_steps: float = 10
    gradient_checkpointing: bool | None = True
    bf16: bool | None = None
    model_init_kwargs: dict[str, Any] | None = None
    """Keyword arguments of ``AutoModelForSequenceClassification.from_pretrained`` when the model is given as a
    path (``num_labels`` is set to 1; ``dtype`` defaults to float32, as TRL's)."""
    trust_remote_code: bool = False
    chat_template_path: str | None = None
    """A Jinja file (``.jinja`` / ``.j2``) that becomes the tokenizer's chat template (cloning another
    tokenizer's template is refused)."""
    disable_dropout: bool = True
    """Set every dropout of the model to 0."""
    dataset_num_proc: int | None = None
    eos_token: str | None = None
    """The token appended to each plain-text answer (None: the tokenizer's EOS token)."""
    max_length: int | None = 1024
    """Pairs whose chosen or rejected sequence is longer are dropped, as TRL drops them (None: never)."""
    pad_to_multiple_of: int | str | None = "auto"
    """``auto`` / None: no padding beyond the longest row of the batch (other values are refused)."""
    center_rewards_coefficient: float | None = None
    """Adds ``coefficient * mean((r_chosen + r_rejected)^2)`` to the loss, for rewards centred on 0 (0.01 is
    the value TRL recommends)."""
    activation_offloading: bool = False
    """Not available: True is refused."""
    pad_token: str | None = None
    """Deprecated in TRL: set ``tokenizer.pad_token`` instead."""

    def __post_init__(self) -> None:
        if self.pad_to_multiple_of not in ("auto", None):
            raise ConfigError(f"pad_to_multiple_of={self.pad_to_multiple_of!r}: vlmtrain's RewardTrainer pads to the "
                              "longest row of each batch; set pad_to_multiple_of=None.")
        self.pad_to_multiple_of = None
        if self.chat_template_path is not None and not self.chat_template_path.endswith((".jinja", ".j2")):
            raise ConfigError(f"chat_template_path={self.chat_template_path!r}: vlmtrain's RewardTrainer takes a "
                              "Jinja file (.jinja / .j2); set the tokenizer's chat_template yourself instead.")
        if self.activation_offloading:
            raise ConfigError("activation_offloading=True is not available in vlmtrain's RewardTrainer: set "
                              "activation_offloading=False (gradient_checkpointing saves memory instead).")
        if self.pad_token is not None:
            warnings.warn("`pad_token` is deprecated and will be removed in v2.0.0. Set `tokenizer.pad_token` "
                          "directly and pass it as `processing_class` to the trainer instead.", FutureWarning,
                          stacklevel=3)
        self.bf16 = not self.fp16 if self.bf16 is None else self.bf16
        super().__post_init__()


def _prepare(dataset: Any, tokenizer: Any, args: RewardConfig) -> Any:
    """The pairs tokenized as TRL tokenizes them (a dataset with chosen_ids / rejected_ids is kept as it is),
    without those whose chosen or rejected sequence is longer than max_length."""
    if dataset is None:
        return None
    if isinstance(dataset, dict):
        return {name: _prepare(d, tokenizer, args) for name, d in dataset.items()}

    def keep(s: dict) -> bool:
        return args.max_length is None or max(len(s["chosen_ids"]), len(s["rejected_ids"])) <= args.max_length

    first = next(iter(dataset))
    tokenized = "chosen_ids" in first and "rejected_ids" in first
    if hasattr(dataset, "map"):  # a datasets.Dataset or IterableDataset (whose map takes no num_proc)
        procs = {"num_proc": args.dataset_num_proc} if hasattr(dataset, "__len__") else {}
        if not tokenized:
            dataset = dataset.map(tokenize_reward_pair, fn_kwargs={"tokenizer": tokenizer}, **procs)
        return dataset.filter(keep, **procs)
    rows = list(dataset) if tokenized else [{**s, **tokenize_reward_pair(s, tokenizer)} for s in dataset]
    return [s for s in rows if keep(s)]


def _load(model: str, args: RewardConfig) -> nn.Module:
    from transformers import AutoModelForSequenceClassification

    kwargs = {"dtype": torch.float32, **(args.model_init_kwargs or {}), "num_labels": 1}
    kwargs.setdefault("trust_remote_code", args.trust_remote_code)
    if isinstance(kwargs["dtype"], str) and kwargs["dtype"] != "auto":
        kwargs["dtype"] = getattr(torch, kwargs["dtype"])
    return AutoModelForSequenceClassification.from_pretrained(model, **kwargs)


def _set_tokens(processing_class: Any, model: nn.Module, args: RewardConfig) -> None:
    """TRL's token setup: ``eos_token`` and ``pad_token`` (from the arguments, else the tokenizer's, else its
    EOS token) must be in the vocabulary; the model's config gets the pad id (a sequence-classification model
    reads its score at each row's last non-pad token)."""
    vocab = processing_class.get_vocab()
    if args.eos_token is not None:
        if args.eos_token not in vocab:
            raise ValueError(f"eos_token={args.eos_token!r} is not in the vocabulary of the processing_class.")
        processing_class.eos_token = args.eos_token
        model.config.get_text_config().eos_token_id = processing_class.eos_token_id
    if args.chat_template_path is not None:
        with open(args.chat_template_path, encoding="utf-8") as f:
            processing_class.chat_template = f.read()
    pad_token = args.pad_token or processing_class.pad_token or processing_class.eos_token
    if pad_token not in vocab:
        raise ValueError(f"pad_token={pad_token!r} is not in the vocabulary of the processing_class.")
    processing_class.pad_token = pad_token
    model.config.get_text_config().pad_token_id = processing_class.pad_token_id


class RewardTrainer(Trainer):
    """TRL's RewardTrainer for a sequence-classification model with one output (an object, a peft model, or a
    path loaded with ``num_labels=1``), on vlmtrain's Trainer. ``self.model`` is the :class:`RewardObjective`;
    ``self.reward_model`` the model trained. Logs TRL's ``accuracy``, ``margin``, ``min_reward``,
    ``mean_reward``, ``max_reward`` and ``num_tokens`` in training and evaluation.

    A Hub VLM (a family vlmtrain knows; an object or a path) with its processor gets a ``reward`` score head
    instead, and pairs with images (compat/reward_vision.py): ``self.model`` is then the VLM with its head
    (``loss_reward``, ``eval_reward_accuracy``, ``eval_reward_margin``), saved as a checkpoint with heads.

    ``train(resume_from_checkpoint=...)`` resumes a run built as the first was: the reward model (its weights or
    adapter), optimizer, scheduler, RNG, data position and ``num_tokens`` come from the checkpoint."""

    # (checkpoints hold the reward model in its own layout, and resume loads it back there)
    parts = dataclasses.replace(Trainer.parts, model_files=PolicyFiles(Trainer.parts.model_files))

    def __init__(self, model: str | nn.Module, args: RewardConfig | None = None, data_collator: Any = None,
                 train_dataset: Any = None, eval_dataset: Any = None, processing_class: Any = None,
                 compute_metrics: Any = None, callbacks: list | None = None, optimizers: tuple = (None, None),
                 optimizer_cls_and_kwargs: Any = None, preprocess_logits_for_metrics: Any = None,
                 quantization_config: Any = None, peft_config: Any = None) -> None:
        from transformers import AutoTokenizer, set_seed

        if args is None:
            name = model if isinstance(model, str) else model.config._name_or_path
            args = RewardConfig(f"{str(name).split('/')[-1]}-Reward")
        if train_dataset is None:
            raise ValueError("`train_dataset` is required")
        if quantization_config is not None or optimizer_cls_and_kwargs is not None:
            raise ConfigError("quantization_config and optimizer_cls_and_kwargs are not available in vlmtrain's "
                              "RewardTrainer: pass a loaded model, and optimizers=(optimizer, scheduler).")
        set_seed(args.seed)  # (as TRL: before a score head or an adapter is initialized)
        self._vision = is_hub_vlm(model)
        if self._vision:  # a reward head on the VLM, pairs processed by its family (compat/reward_vision.py)
            model, processing_class, collator = vision_reward_setup(model, processing_class, args, peft_config)
            _set_tokens(processing_class.tokenizer, model.base, args)
            trained = model
        else:
            if isinstance(model, str):
                model = _load(model, args)
            elif getattr(model.config, "num_labels", None) != 1:
                raise ValueError(f"The model has `num_labels={model.config.num_labels}`, but reward models require "
                                 "`num_labels=1` to output a single scalar reward per sequence. Load it with "
                                 "num_labels=1, or pass its path.")
            if processing_class is None:
                processing_class = AutoTokenizer.from_pretrained(model.config._name_or_path,
                                                                 trust_remote_code=args.trust_remote_code)
            _set_tokens(processing_class, model, args)
            if peft_config is not None:
                from peft import get_peft_model

                model = get_peft_model(model, peft_config)
            collator = RewardCollator(processing_class.pad_token_id)
            trained = RewardObjective(model, args.center_rewards_coefficient)
        if args.disable_dropout:
            disable_dropout(model)
        self.reward_model = model
        self._total_train_tokens = 0
        super().__init__(model=trained, args=args, data_collator=data_collator or collator,
                         train_dataset=self._prepare(train_dataset, processing_class, args),
                         eval_dataset=self._prepare(eval_dataset, processing_class, args),
                         processing_class=processing_class, compute_metrics=compute_metrics, callbacks=callbacks,
                         optimizers=optimizers, preprocess_logits_for_metrics=preprocess_logits_for_metrics)

    def _prepare(self, dataset: Any, processing_class: Any, args: RewardConfig) -> Any:
        # (a VLM's pairs stay raw: its collator processes them, images included)
        return dataset if self._vision else _prepare(dataset, processing_class, args)

    def evaluate(self, eval_dataset: Any = None, ignore_keys: list[str] | None = None,
                 metric_key_prefix: str = "eval") -> dict[str, float]:
        """Trainer.evaluate; a dataset given here is tokenized as the trainer's own are."""
        if eval_dataset is not None and not isinstance(eval_dataset, str):
            eval_dataset = self._prepare(eval_dataset, self.processing_class, self.args)
        return super().evaluate(eval_dataset, ignore_keys, metric_key_prefix)

    def training_step(self, model: nn.Module, inputs: Any, num_items_in_batch: Any = None) -> torch.Tensor:
        """Trainer.training_step, counting the tokens trained on (over all ranks) for TRL's ``num_tokens``."""
        self._total_train_tokens += int(dist.reduce_cpu([float(inputs["attention_mask"].sum())])[0])
        return super().training_step(model, inputs, num_items_in_batch)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Trainer.log, with TRL's ``num_tokens`` (``eval_num_tokens`` in evaluation): the tokens trained on."""
        if "loss" in logs:
            logs["num_tokens"] = self._total_train_tokens
        elif any(k.startswith("eval_") and k.endswith("_loss") for k in logs):
            prefix = next(k for k in logs if k.startswith("eval_") and k.endswith("_loss"))[:-len("loss")]
            logs[f"{prefix}num_tokens"] = self._total_train_tokens
        super().log(logs, start_time)

    def _loop_state(self) -> dict:
        return {**super()._loop_state(), "num_tokens": self._total_train_tokens}  # (TRL's count restarts at 0)

    def _load_checkpoint(self, path: str) -> None:
        super()._load_checkpoint(path)
        self._total_train_tokens = ckpt.load_torch(os.path.join(path, f"{LOOP_STATE}_0.pt")).get("num_tokens", 0)

    def _set_signature_columns_if_needed(self) -> None:
        # the collator reads the tokenized pair, not the objective's forward arguments
        if self._signature_columns is None:
            self._signature_columns = list(REWARD_COLUMNS)
