"""The `train` section of a run config: vlmtrain.TrainingArguments plus the training objective
(`train.objective`) and its options under TRL 1.16's DPOConfig names. vlmtrain.TrainingArguments itself (what a
transformers script builds) stays free of them; this subclass is what the YAML config and the CLI parse."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Literal

from vlmtrain.compat.arguments import TrainingArguments
from vlmtrain.errors import ConfigError

TRUNCATION_MODES = ("keep_start", "keep_end")


@dataclass
class TrainConfig(TrainingArguments):
    """TrainingArguments (transformers' names) with `objective` and its options (TRL 1.16's names).

    For `objective: dpo`, TRL 1.16's DPO options and defaults (docs/preference.md). The first line is the group's
    heading in --help."""

    objective: Literal["sft", "dpo", "reward"] = "sft"
    """sft: the language-model loss on the answers. dpo: Direct Preference Optimization on preference pairs
    (docs/data.md#preference-pairs) against a reference model: with model.lora the model with its adapters
    switched off, else a frozen copy of the model as training starts. The checkpoints hold the trained model
    alone (loadable as an SFT run's). reward (model.kind hub_vlm): the model's `reward` score heads
    (model.heads) learn from preference pairs, Bradley-Terry on each pair's chosen and rejected sample, without
    the language-model loss."""
    beta: float = 0.1
    """(dpo) Temperature of the DPO loss (ipo: its regularization parameter tau)."""
    loss_type: list[str] | str = field(default_factory=lambda: ["sigmoid"])
    """(dpo) One or several of sigmoid, ipo, hinge, sft (sft: the chosen answers' NLL per token, beside a DPO loss; several: summed, weighted by loss_weights)."""
    loss_weights: list[float] | None = None
    """(dpo) One weight per loss_type; null: 1 each."""
    label_smoothing: float = 0.0
    """(dpo) As TRL 1.16: used by none of the loss types above (only by TRL's robust, exo_pair and aot)."""
    truncation_mode: Literal["keep_start", "keep_end"] = "keep_start"
    """(dpo) A pair's prompt + answer longer than data.max_length tokens is cut: keep_start keeps its first
    tokens (a pair whose prompt alone fills them is skipped and counted, as TRL drops it), keep_end its last."""
    precompute_ref_log_probs: bool = False
    """(dpo) Run the reference once, when training starts, over every train and eval pair (jsonl pairs), and keep
    its log-probs (in the checkpoints too: a resumed run reads them): no reference forward in each step."""
    precompute_ref_batch_size: int | None = None
    """(dpo) The batch size of that pass; null: per_device_train_batch_size (train pairs), per_device_eval_batch_size
    (eval pairs)."""
    disable_dropout: bool = True
    """(dpo) Set every dropout of the model and its reference to 0."""

    def __post_init__(self) -> None:
        if isinstance(self.loss_type, str):
            self.loss_type = [self.loss_type]
        if self.objective != "dpo":
            given = [f.name for f in fields(TrainConfig) if f.name in DPO_OPTIONS
                     and getattr(self, f.name) != _default(f)]
            if given:
                raise ConfigError(f"train.{given[0]} is an option of train.objective: dpo, but train.objective is "
                                  f"{self.objective!r}: remove train.{given[0]}, or set train.objective: dpo.")
        # (imported here: --help and a mistyped key need no torch)
        from vlmtrain.models.objectives.dpo import LOSS_TYPES

        unknown = [t for t in self.loss_type if t not in LOSS_TYPES]
        if unknown:
            raise ConfigError(f"train.loss_type={unknown}: vlmtrain's DPO has {list(LOSS_TYPES)} (TRL's other loss "
                              "types are not implemented yet).")
        if self.loss_weights is not None and len(self.loss_weights) != len(self.loss_type):
            raise ConfigError(f"train.loss_weights has {len(self.loss_weights)} weights for "
                              f"{len(self.loss_type)} train.loss_type entries: give one weight per loss type.")
        super().__post_init__()


DPO_OPTIONS = ("beta", "loss_type", "loss_weights", "label_smoothing", "truncation_mode", "precompute_ref_log_probs",
               "precompute_ref_batch_size", "disable_dropout")


def _default(f: Any) -> Any:
    return f.default_factory() if callable(f.default_factory) else f.default


def check_objective(cfg: Any) -> None:
    """Cross-section checks of train.objective (before any model or data is built): the model kind must have pair
    processing, the data source must give raw samples, and what DPO does not do yet is refused."""
    if cfg.train.objective == "sft":
        return
    from vlmtrain.data.registry import get_source
    from vlmtrain.models.kinds import get_kind

    objective = f"train.objective={cfg.train.objective}"
    if cfg.train.objective == "reward":
        _check_reward(cfg)
    elif get_kind(cfg.model.kind).pairs is None:
        raise ConfigError(f"{objective} is not supported for model.kind={cfg.model.kind} yet (in Python: "
                          f"vlmtrain.DPOTrainer).")
    if cfg.train.objective == "dpo":
        _check_dpo_heads(cfg)
    if not get_source(cfg.data.source).pairs:
        raise ConfigError(f"{objective} trains on preference pairs: data.source={cfg.data.source!r} has none; use "
                          "data.source jsonl or stream (docs/data.md#preference-pairs).")
    vision = cfg.model.kind == "hub_vlm"
    # (dpo: data.packing packs each batch's pairs into one row, DPOConfig's padding_free: no token budget)
    packing_keys = {f"data.{key}": (getattr(cfg.data, key) is not None, f"remove data.{key} (data.packing: true "
                                    "packs each batch's pairs into one row, without a token budget)")
                    for key in ("pack_length", "pack_window", "max_images_per_pack", "max_patches_per_pack")}
    refused = {"data.packing": (cfg.data.packing and cfg.train.objective == "reward", "set data.packing: false "
                                "(a reward head reads each sequence's last token: pairs are padded)"),
               **packing_keys,
               "train.predict_with_generate": (cfg.train.predict_with_generate, "set it to false (a DPO evaluation "
                                               "reports TRL's rewards/* and logps/*)"),
               "train.precompute_ref_log_probs": (cfg.train.precompute_ref_log_probs and cfg.data.source != "jsonl",
                                                  f"the pairs of data.source={cfg.data.source!r} are streamed, with "
                                                  "no place to keep a value per pair: use data.source jsonl, or set "
                                                  "it to false"),
               # (pairs with images, as TRL and vlmtrain.DPOTrainer: image tokens are never cut off the front)
               "train.truncation_mode=keep_end": (vision and cfg.train.truncation_mode == "keep_end",
                                                  "set train.truncation_mode: keep_start with model.kind hub_vlm")}
    for key, (value, instead) in refused.items():
        if value:
            raise ConfigError(f"{key} is not available with {objective} yet: {instead}.")


def _check_reward(cfg: Any) -> None:
    from vlmtrain.models.kinds import get_kind
    from vlmtrain.models.objectives.head_config import parse_heads

    if get_kind(cfg.model.kind).reward_pairs is None:
        raise ConfigError(f"train.objective=reward is not supported for model.kind={cfg.model.kind} (model.kind "
                          "hub_vlm with a reward head; in Python: vlmtrain.RewardTrainer).")
    if not any(c.type == "reward" for c in parse_heads(cfg.model.heads).values()):
        raise ConfigError("train.objective=reward trains the model's reward score heads, but model.heads has none: "
                          "add one, e.g. model.heads: {reward: {type: reward}}.")


def _check_dpo_heads(cfg: Any) -> None:
    """Score heads train beside DPO on each pair's chosen sequence; a reward head's label is a pair's margin,
    which DPO's own loss already uses: refused (train.objective reward trains it)."""
    from vlmtrain.models.objectives.head_config import parse_heads

    for name, c in parse_heads(cfg.model.heads).items():
        if c.type == "reward":
            raise ConfigError(f"model.heads.{name} is a reward head, which train.objective: dpo does not train: "
                              "train it with train.objective: reward, or give DPO regression / classification heads.")
    if cfg.model.heads and cfg.data.packing:  # (a head reads each chosen row's last token: a packed batch has one row)
        raise ConfigError("model.heads with data.packing: true under train.objective: dpo: score heads read each "
                          "chosen sequence's last token of a padded pair batch; set data.packing: false.")
