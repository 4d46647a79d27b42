"""The `train` section of a run config: vlmtrain.TrainingArguments plus the training objective
(`train.objective`) and its options under TRL 1.16's DPOConfig names. vlmtrain.TrainingArguments itself (what a
transformers script builds) stays free of them; this subclass is what the YAML config and the CLI parse."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Literal

from vlmtrain.compat.grpo_options import GRPOOptions
from vlmtrain.config_grpo import GRPO_OPTIONS, check_grpo, resolve_shared
from vlmtrain.errors import ConfigError

TRUNCATION_MODES = ("keep_start", "keep_end")


@dataclass
class TrainConfig(GRPOOptions):
    """TrainingArguments (transformers' names) with `objective` and its options (TRL 1.16's names).

    For `objective: dpo`, TRL 1.16's DPO options and defaults (docs/preference.md); for `objective: grpo`, its
    GRPO options and defaults (docs/grpo.md). The first line is the group's heading in --help."""

    objective: Literal["sft", "dpo", "reward", "grpo"] = "sft"
    """sft: the language-model loss on the answers. dpo: Direct Preference Optimization on preference pairs
    (docs/data.md#preference-pairs) against a reference model: with model.lora the model with its adapters
    switched off, else a frozen copy of the model as training starts. The checkpoints hold the trained model
    alone (loadable as an SFT run's). reward (model.kind hub_vlm): the model's `reward` score heads
    (model.heads) learn from preference pairs, Bradley-Terry on each pair's chosen and rejected sample, without
    the language-model loss. grpo (model.kind causal_lm or hub_vlm): Group Relative Policy Optimization on prompts
    (docs/data.md#grpo-prompts), completions sampled by the model and scored by train.reward_funcs
    (docs/grpo.md)."""
    reward_funcs: list[str] | None = None
    """(grpo) The reward functions, as `module:function` strings imported when the config is read (TRL's
    signature: `prompts`, `completions`, `completion_ids` and the prompt's other columns as keyword arguments ->
    one float per completion, None: not scored), or reward model directories (a `train.objective: reward` run's,
    or a sequence-classification model with one label: docs/grpo.md#reward-models). At least one."""
    beta: float | None = None
    """(dpo, grpo) dpo: temperature of the DPO loss (ipo: its regularization parameter tau); null: 0.1. grpo: the
    KL coefficient to the reference; null: 0.0 (no reference model is built or run)."""
    loss_type: list[str] | str | None = None
    """(dpo, grpo) dpo: one or several of sigmoid, ipo, hinge, sft (sft: the chosen answers' NLL per token, beside a DPO loss; several: summed, weighted by loss_weights); null: sigmoid. grpo: one of dapo, grpo, dr_grpo, bnpo; null: dapo."""
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
    disable_dropout: bool | None = None
    """(dpo, grpo) Set every dropout of the model and its reference to 0; null: true with dpo, false with grpo."""

    def __post_init__(self) -> None:
        for objective, options in (("dpo", DPO_OPTIONS), ("grpo", GRPO_OPTIONS)):
            if self.objective == objective:
                continue
            shared = SHARED if self.objective in ("dpo", "grpo") else ()  # (each resolves them to its defaults)
            given = [f.name for f in fields(TrainConfig) if f.name in options and f.name not in shared
                     and getattr(self, f.name) not in (_default(f), DPO_DEFAULTS.get(f.name))]
            if given:
                raise ConfigError(f"train.{given[0]} is an option of train.objective: {objective}, but "
                                  f"train.objective is {self.objective!r}: remove train.{given[0]}, or set "
                                  f"train.objective: {objective}.")
        if self.objective == "grpo":
            resolve_shared(self)
            super().__post_init__()
            return
        for key, value in DPO_DEFAULTS.items():  # (sft and reward too: the values DPO's options always had)
            if getattr(self, key) is None:
                setattr(self, key, list(value) if isinstance(value, list) else value)
        if isinstance(self.loss_type, str):
            self.loss_type = [self.loss_type]
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


SHARED = ("beta", "loss_type", "disable_dropout")  # (dpo and grpo options: each objective's TRL default)
DPO_DEFAULTS: dict[str, Any] = {"beta": 0.1, "loss_type": ["sigmoid"], "disable_dropout": True}
DPO_OPTIONS = ("beta", "loss_type", "loss_weights", "label_smoothing", "truncation_mode", "precompute_ref_log_probs",
               "precompute_ref_batch_size", "disable_dropout")


TRAINERS = {"grpo": "vlmtrain.config_grpo:build_trainer"}
"""train.objective -> builder(cfg, parts) of its own Trainer (one with a rollout); the others take compose's."""


def objective_trainer(objective: str) -> Any:
    """The Trainer builder of ``objective`` (see TRAINERS), or None."""
    import importlib

    if objective not in TRAINERS:
        return None
    module, name = TRAINERS[objective].split(":")
    return getattr(importlib.import_module(module), name)


def _default(f: Any) -> Any:
    return f.default_factory() if callable(f.default_factory) else f.default


def check_objective(cfg: Any) -> None:
    """Cross-section checks of train.objective (before any model or data is built): the model kind must have pair
    processing, the data source must give raw samples, and what DPO does not do yet is refused."""
    if cfg.train.objective == "sft":
        return
    if cfg.train.objective == "grpo":
        check_grpo(cfg)
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
