"""TRL 1.16's DPOConfig and DPOTrainer on vlmtrain's Trainer, for causal language models and VLMs: a TRL DPO script
runs with only its import changed. The pairs are tokenized as TRL tokenizes them and collated chosen-then-rejected
(data/preference.py; pairs with images: data/preference_vision.py, each pair's images once); the objective (models/objectives/dpo.py) wraps the policy and its reference and returns the
loss with TRL's metrics, which the trainer logs as it logs any model's (``eval_`` prefixed in evaluation)."""

from __future__ import annotations

import copy
import functools
import warnings
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from ..data.hub_pairs import FittingPairCollator
from ..data.preference import (
    PAIR_COLUMNS,
    REF_LOGPS_COLUMNS,
    TRUNCATION_MODES,
    PreferenceCollator,
    pair_row,
    tokenize_pair,
)
from ..data.preference_vision import (
    ANSWER_IMAGES,
    VisionPreferenceCollator,
    answer_has_images,
    is_vision_pairs,
)
from ..errors import ConfigError
from ..models.objectives import disable_dropout
from ..models.objectives.dpo import LOSS_TYPES, DPOObjective
from .arguments import TrainingArguments
from .dpo_reference import PolicyTrainer, has_ref_logps, refuse_unindexable


@dataclass
class DPOConfig(TrainingArguments):
    """TrainingArguments with TRL 1.16's DPOConfig options and defaults (TRL's defaults differ from transformers'
    for learning_rate 1e-6, logging_steps 10, gradient_checkpointing True, and bf16: on unless fp16 is set)."""

    learning_rate: float = 1e-6
    logging_steps: float = 10
    gradient_checkpointing: bool | None = True
    bf16: bool | None = None
    model_init_kwargs: dict[str, Any] | None = None
    """Keyword arguments of ``AutoModelForCausalLM.from_pretrained`` when the model is given as a path."""
    disable_dropout: bool = True
    """Set every dropout of the policy and the reference to 0."""
    max_length: int | None = 1024
    """The most tokens of prompt + answer; longer sequences are cut as ``truncation_mode`` says (None: never)."""
    truncation_mode: str = "keep_start"
    """``keep_start`` keeps the first ``max_length`` tokens (a pair whose prompt alone fills them is dropped, as
    TRL drops it); ``keep_end`` the last ones."""
    padding_free: bool = False
    """Pack each batch's 2B sequences into one row without padding, each with its own positions and attention
    kept within it (TRL 1.16 warns and pads instead); the log-probs equal the padded batch's."""
    pad_to_multiple_of: int | str | None = "auto"
    """``auto`` / None: no padding beyond the longest row of the batch (other values are refused)."""
    precompute_ref_log_probs: bool = False
    """Compute the reference's log-probs of every train and eval pair in one pass before training (kept in the
    checkpoints); the reference then does not run while training, and a full fine-tune without ``ref_model``
    keeps no copy of the model for it."""
    precompute_ref_batch_size: int | None = None
    """Pairs per batch of that pass (None: ``per_device_train_batch_size``, for eval pairs
    ``per_device_eval_batch_size``)."""
    loss_type: list[str] | str = field(default_factory=lambda: ["sigmoid"])
    """One or several of ``sigmoid``, ``ipo``, ``hinge``, ``sft`` (the chosen answers' NLL per token; several: summed with ``loss_weights``)."""
    loss_weights: list[float] | None = None
    label_smoothing: float = 0.0
    """As TRL 1.16: used by none of the loss types implemented here (only by robust, exo_pair and aot)."""
    beta: float = 0.1
    """The temperature of the DPO loss (IPO: the regularization parameter tau)."""

    def __post_init__(self) -> None:
        if isinstance(self.loss_type, str):
            self.loss_type = [self.loss_type]
        unknown = [t for t in self.loss_type if t not in LOSS_TYPES]
        if unknown:
            raise ConfigError(f"loss_type={unknown}: vlmtrain's DPO has {list(LOSS_TYPES)} (TRL's other loss "
                              "types are not implemented yet).")
        if self.loss_weights is not None and len(self.loss_weights) != len(self.loss_type):
            raise ValueError("`loss_weights` must have the same length as `loss_type` when combining multiple "
                             f"losses. Got {len(self.loss_weights)} weights for {len(self.loss_type)} loss types.")
        if self.truncation_mode not in TRUNCATION_MODES:
            raise ConfigError(f"truncation_mode={self.truncation_mode!r}: expected one of {TRUNCATION_MODES}.")
        if self.pad_to_multiple_of not in ("auto", None):
            raise ConfigError(f"pad_to_multiple_of={self.pad_to_multiple_of!r}: vlmtrain's DPO pads to the longest "
                              "row of each batch; set pad_to_multiple_of=None.")
        self.pad_to_multiple_of = None
        self.bf16 = not self.fp16 if self.bf16 is None else self.bf16
        super().__post_init__()


PAIR_KEYS = ("prompt", "chosen", "rejected")


def _tokenize(sample: dict, index: int, tokenizer: Any) -> dict[str, list[int]]:
    missing = [k for k in PAIR_KEYS if sample.get(k) is None]
    if missing:
        which = f"pair {index}" + (f" (id {sample['id']!r})" if sample.get("id") is not None else "")
        keys = sorted(k for k, v in sample.items() if v is not None)
        raise ConfigError(f"preference {which} has no {' and no '.join(map(repr, missing))} (its keys: {keys}): "
                          "each pair needs 'prompt', 'chosen' and 'rejected'; fix or remove it.")
    return tokenize_pair(sample, tokenizer)


def _drop_reason(prompt: list[int], chosen: list[int], rejected: list[int], args: DPOConfig) -> str | None:
    """Why a tokenized pair cannot train (None: it can). The same tokens on both sides carry no preference: every
    loss type then gives a constant and a zero gradient, which only dilutes the batch's mean loss and accuracy."""
    if args.max_length is not None and args.truncation_mode == "keep_start" and len(prompt) >= args.max_length:
        return (f"whose prompt fills max_length={args.max_length} before any answer token (truncation_mode="
                "'keep_start' would leave no answer; TRL drops them too)")
    if (pair_row(prompt, chosen, args.max_length, args.truncation_mode)
            == pair_row(prompt, rejected, args.max_length, args.truncation_mode)):
        return "whose chosen and rejected are the same tokens (within max_length): no preference to learn"
    return None


def _prepare(dataset: Any, tokenizer: Any, args: DPOConfig, name: str = "train") -> Any:
    """The pairs tokenized as TRL tokenizes them, without those that cannot train (:func:`_drop_reason`),
    counted and warned once per dataset. A pair without chosen or rejected is an error naming it."""
    if dataset is None:
        return None
    if isinstance(dataset, dict):
        return {key: _prepare(d, tokenizer, args, f"{name} {key!r}") for key, d in dataset.items()}
    first = next(iter(dataset))
    if is_vision_pairs(first):
        return dataset  # (pairs with images are processed per batch by their collator)
    if all(k in first for k in PAIR_COLUMNS):
        return dataset  # (already tokenized)
    if hasattr(dataset, "map"):  # a datasets.Dataset / IterableDataset
        tokenized = dataset.map(_tokenize, with_indices=True, fn_kwargs={"tokenizer": tokenizer})
    else:
        tokenized = [{**s, **_tokenize(s, i, tokenizer)} for i, s in enumerate(dataset)]
    if not hasattr(tokenized, "__len__"):  # a stream: each reason warned at its first pair (no count up front)
        return tokenized.filter(_StreamDrops(args, name))
    columns = [tokenized[c] for c in PAIR_COLUMNS] if hasattr(tokenized, "column_names") else (
        [[s[c] for s in tokenized] for c in PAIR_COLUMNS])
    reasons = [_drop_reason(p, c, r, args) for p, c, r in zip(*columns, strict=True)]
    dropped = Counter(r for r in reasons if r is not None)
    if not dropped:
        return tokenized
    warnings.warn(f"DPO: {sum(dropped.values())} of {len(reasons)} {name} pairs skipped: " +
                  "; ".join(f"{n} {reason}" for reason, n in dropped.items()) + ".", stacklevel=3)
    kept = [i for i, r in enumerate(reasons) if r is None]
    return tokenized.select(kept) if hasattr(tokenized, "select") else [tokenized[i] for i in kept]


class _StreamDrops:
    """The filter of a streamed dataset's pairs: False for a pair that cannot train, warned once per reason."""

    def __init__(self, args: DPOConfig, name: str) -> None:
        self.args, self.name, self.seen = args, name, set()

    def __call__(self, s: dict) -> bool:
        reason = _drop_reason(s["prompt_ids"], s["chosen_ids"], s["rejected_ids"], self.args)
        if reason is not None and reason not in self.seen:
            self.seen.add(reason)
            warnings.warn(f"DPO: skipping the {self.name} pairs {reason} (a stream: not warned again).",
                          stacklevel=2)
        return reason is None


class DPOTrainer(PolicyTrainer):
    """TRL's DPOTrainer for a causal language model or a VLM with its processor (an object or a path), on
    vlmtrain's Trainer: the reference
    is ``ref_model``, else the policy with its adapters off (a peft model, or ``peft_config``), else a frozen
    copy of the policy as it is when the trainer is built (with ``precompute_ref_log_probs``, that policy
    before it trains, run once). ``self.model`` is the :class:`DPOObjective`; ``self.policy`` the model trained,
    and the model files of its checkpoints."""

    def __init__(self, model: str | nn.Module, ref_model: nn.Module | None = None, args: DPOConfig | None = None,
                 data_collator: Any = None, train_dataset: Any = None, eval_dataset: Any = None,
                 processing_class: Any = None, compute_metrics: Any = None, callbacks: list | None = None,
                 optimizers: tuple = (None, None), peft_config: Any = None) -> None:
        from transformers import set_seed

        if args is None:
            name = model if isinstance(model, str) else model.config._name_or_path
            args = DPOConfig(f"{str(name).split('/')[-1]}-DPO")
        if train_dataset is None:
            raise ValueError("`train_dataset` is required")
        vision = is_vision_pairs(next(iter(train_dataset)))
        if vision:  # (before the model loads)
            _check_vision_args(args)
            _refuse_answer_images(train_dataset, "train_dataset")
            _refuse_answer_images(eval_dataset, "eval_dataset")
        if args.precompute_ref_log_probs:  # (before the model loads)
            refuse_unindexable(train_dataset, "train_dataset")
            refuse_unindexable(eval_dataset, "eval_dataset")
        set_seed(args.seed)  # (as TRL: before a peft_config's adapter is initialized)
        if args.padding_free:  # (before the model loads where it is a path)
            _check_padding_free(model)
        if isinstance(model, str):
            model = _load_model(model, args.model_init_kwargs or {})
        if ref_model is model:
            raise ValueError("`model` and `ref_model` cannot be the same object. In most cases you should omit "
                             "`ref_model` and we'll initialize it to a copy of `model` for you.")
        if processing_class is None:
            processing_class = _load_processing_class(model)
        vlm = getattr(processing_class, "image_processor", None) is not None
        tokenizer = processing_class.tokenizer if vlm else processing_class
        if vision and not vlm:
            raise ConfigError("the dataset's pairs have images ('images' or 'image' column) but processing_class is "
                              "a tokenizer: pass the vision-language model's processor as processing_class.")
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        model.config.get_text_config().pad_token_id = tokenizer.pad_token_id  # (as TRL: model agrees with tokenizer)
        if vlm:
            for m in (model, ref_model):
                _enable_dummy_vision(m)  # (before the reference is copied from the policy)
        if peft_config is not None:
            from peft import get_peft_model

            model = get_peft_model(model, peft_config)
        if ref_model is None and not hasattr(model, "disable_adapter") and not args.precompute_ref_log_probs:
            ref_model = copy.deepcopy(model)  # (precomputed: the policy is the reference before it trains)
        if args.disable_dropout:
            disable_dropout(model, ref_model)
        objective = DPOObjective(model, ref_model, beta=args.beta, loss_type=args.loss_type,
                                 loss_weights=args.loss_weights, precomputed=args.precompute_ref_log_probs)
        self._vision_pairs = vision
        if data_collator is None and vision:
            # (a pair whose prompt fills max_length is skipped and counted, as TRL drops such text pairs)
            data_collator = FittingPairCollator(VisionPreferenceCollator(
                processing_class, args.max_length, getattr(model.config, "image_token_id", None), False,
                _rope_positions(model), _video_support(model, processing_class, args)), args.padding_free)
        elif data_collator is None:
            data_collator = PreferenceCollator(tokenizer.pad_token_id, args.max_length, args.truncation_mode,
                                               args.padding_free)
        super().__init__(model=objective, args=args, data_collator=data_collator,
                         train_dataset=_prepare(train_dataset, processing_class, args),
                         eval_dataset=_prepare(eval_dataset, processing_class, args, "eval"),
                         processing_class=processing_class, compute_metrics=compute_metrics, callbacks=callbacks,
                         optimizers=optimizers)

    def evaluate(self, eval_dataset: Any = None, ignore_keys: list[str] | None = None,
                 metric_key_prefix: str = "eval") -> dict[str, float]:
        """Trainer.evaluate; with precompute_ref_log_probs a dataset without the reference's log-probs gets them
        first (TRL's rule: not after training has started when the policy itself was the reference)."""
        if (self.args.precompute_ref_log_probs and eval_dataset is not None
                and not isinstance(eval_dataset, Mapping | str)
                and not has_ref_logps(eval_dataset := _prepare(eval_dataset, self.processing_class, self.args,
                                                               "eval"))):
            eval_dataset = self._with_ref_logps(eval_dataset, metric_key_prefix, store=False)
        return super().evaluate(eval_dataset, ignore_keys, metric_key_prefix)

    def _set_signature_columns_if_needed(self) -> None:
        # the collator reads the tokenized pair, not the objective's forward arguments
        if self._signature_columns is None:
            self._signature_columns = [*(VISION_COLUMNS if self._vision_pairs else PAIR_COLUMNS), *REF_LOGPS_COLUMNS]


VISION_COLUMNS = ("prompt", "chosen", "rejected", "image", "images", "video", "videos")
"""The columns a pair with images or videos is read from (its collator processes them per batch)."""


def _load_model(path: str, init_kwargs: dict[str, Any]) -> nn.Module:
    """The model of a path in the architecture its config names (a VLM's conditional-generation class, a causal
    LM's), as TRL loads it; a causal LM where the config names none transformers has."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(path)
    names = getattr(config, "architectures", None) or []
    architecture = getattr(transformers, names[0], None) if names else None
    return (architecture or transformers.AutoModelForCausalLM).from_pretrained(path, **init_kwargs)


def _load_processing_class(model: nn.Module) -> Any:
    """The processor of a Hub VLM family's model (vlmtrain's image-only one), else the model's tokenizer."""
    from transformers import AutoTokenizer

    from ..models.families import REGISTRY, get_family

    path = model.config._name_or_path
    if model.config.model_type in REGISTRY:
        return get_family(model.config.model_type).load_processor(path)
    return AutoTokenizer.from_pretrained(path)


def _check_vision_args(args: DPOConfig) -> None:
    """The settings TRL 1.16 refuses for pairs with images, refused the same way, before the model loads (but
    precompute_ref_log_probs, which TRL 1.16 refuses too: here the log-probs travel with their pairs)."""
    if args.max_length is not None and args.truncation_mode == "keep_end":
        raise ConfigError("truncation_mode='keep_end' with pairs with images would cut their image tokens off: "
                          "use truncation_mode='keep_start' (the default) or max_length=None.")


def _refuse_answer_images(dataset: Any, name: str) -> None:
    """An error naming the first pair with an image in an answer (an indexable dataset's answer columns are read
    once; a stream's pairs are refused by the collator as they come)."""
    if dataset is None or isinstance(dataset, Mapping) or not hasattr(dataset, "__len__"):
        return
    answers = dataset.select_columns(["chosen", "rejected"]) if hasattr(dataset, "select_columns") else dataset
    for i, pair in enumerate(answers):
        if answer_has_images(pair):
            raise ConfigError(f"{name} pair {i}: {ANSWER_IMAGES}.")


def _family(model: str | nn.Module) -> Any:
    """The Hub VLM family of a model (an object, or a path whose config is read), None for another model."""
    from ..models.families import REGISTRY, get_family

    if isinstance(model, str):
        import transformers

        model_type = getattr(transformers.AutoConfig.from_pretrained(model), "model_type", None)
    else:
        model_type = getattr(model.config, "model_type", None)
    return get_family(model_type) if model_type in REGISTRY else None


def _check_padding_free(model: str | nn.Module) -> None:
    family = _family(model)
    if family is not None and family.packing_unsupported:
        raise ConfigError(f"padding_free=True: the {family.name} family cannot pack sequences: "
                          f"{family.packing_unsupported} Set padding_free=False.")


def _rope_positions(model: nn.Module) -> Any:
    """One sequence -> its multimodal rotary positions, for a family that has them (Qwen-VL), else None."""
    family = _family(model)
    if family is None or family.rope_positions is None:
        return None
    return functools.partial(family.rope_positions, model.config)


def _video_support(model: nn.Module, processor: Any, args: DPOConfig) -> Any:
    """A Hub VLM family's video support for pairs with videos (their clips' tokens within ``max_length``), None
    for a family without it (a pair with videos is then an error naming it)."""
    from ..data.video import VideoSettings

    family = _family(model)
    hook = getattr(family, "video", None)
    return None if hook is None else hook(processor, VideoSettings(max_tokens=args.max_length))


def _enable_dummy_vision(model: nn.Module | None) -> None:
    """Under several processes, a Hub VLM family's model runs its vision tower on a dummy image in a forward
    without images (models/vision/dummy_vision.py), as when vlmtrain loads it; a model that has it keeps it."""
    from ..models.families import REGISTRY, get_family
    from ..models.hub.hub_loading import enable_family_dummy_vision

    if model is not None and getattr(model.config, "model_type", None) in REGISTRY:
        enable_family_dummy_vision(model, get_family(model.config.model_type))
