"""TRL 1.16's GRPOConfig names and defaults for what vlmtrain's GRPO implements; TRL's other options are
accepted at their defaults and refused, naming them, when set to anything else."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigError
from ..models.objectives.grpo import IMPORTANCE_SAMPLING_LEVELS, LOSS_TYPES, SCALE_REWARDS
from .grpo_options import GRPOOptions

UNSUPPORTED = {  # TRL 1.16's GRPOConfig options vlmtrain does not implement yet, at TRL's defaults
    "use_vllm": False, "use_transformers_continuous_batching": False, "delta": None,
    "multi_objective_aggregation": "sum_then_normalize", "sync_ref_model": False, "top_entropy_quantile": 1.0,
    "entropy_coef": 0.0, "use_adaptive_entropy": False, "off_policy_mask_threshold": None,
"cast_lm_head_to_fp32": False, "num_generations_eval": None,
    "max_tool_calling_iterations": None, "log_completions_hub_repo": None, "chat_template_kwargs": None,
}


@dataclass
class GRPOConfig(GRPOOptions):
    """TrainingArguments with TRL 1.16's GRPOConfig options and defaults (TRL's defaults differ from transformers'
    for learning_rate 1e-6, logging_steps 10, gradient_checkpointing True, bf16: on unless fp16 is set, and
    remove_unused_columns False: the dataset's other columns reach the reward functions)."""

    learning_rate: float = 1e-6
    logging_steps: float = 10
    gradient_checkpointing: bool | None = True
    bf16: bool | None = None
    remove_unused_columns: bool | None = False
    model_init_kwargs: dict[str, Any] | None = None
    """Keyword arguments of ``from_pretrained`` when the model is given as a path."""
    disable_dropout: bool = False
    beta: float = 0.0
    """KL coefficient; 0 (TRL's default): no reference model is built or run."""
    loss_type: str = "dapo"
    pad_to_multiple_of: int | str | None = "auto"
    unsupported: dict[str, Any] = field(default_factory=dict, repr=False)
    """(internal) TRL options given that vlmtrain does not implement: refused in ``__post_init__``."""

    def __post_init__(self) -> None:
        refused = {k: v for k, v in self.unsupported.items() if v != UNSUPPORTED[k]}
        if refused:
            raise ConfigError(f"GRPOConfig: {', '.join(f'{k}={v!r}' for k, v in refused.items())} not supported by "
                              "vlmtrain's GRPO yet: leave them at TRL's defaults.")
        self.scale_rewards = {True: "group", False: "none"}.get(self.scale_rewards, self.scale_rewards)
        for name, value, allowed in (("loss_type", self.loss_type, LOSS_TYPES),
                                     ("scale_rewards", self.scale_rewards, SCALE_REWARDS),
                                     ("importance_sampling_level", self.importance_sampling_level,
                                      IMPORTANCE_SAMPLING_LEVELS),
                                     ("pad_to_multiple_of", self.pad_to_multiple_of, ("auto", None))):
            if value not in allowed:  # (pad_to_multiple_of: rows are padded to the batch's longest)
                raise ConfigError(f"{name}={value!r}: vlmtrain's GRPO has {allowed}.")
        self.bf16, self.pad_to_multiple_of = (not self.fp16 if self.bf16 is None else self.bf16), None
        super().__post_init__()
        self._resolve_generation_batch()

    def _resolve_generation_batch(self) -> None:
        """TRL's rule: generation_batch_size and steps_per_generation give each other (not both)."""
        per_step = self.per_device_train_batch_size * self.world_size
        if self.generation_batch_size is not None and self.steps_per_generation is not None:
            raise ConfigError("'generation_batch_size' and 'steps_per_generation' can not be both configured at "
                              "the same time")
        if self.generation_batch_size is not None:
            if self.generation_batch_size % per_step:
                raise ConfigError(f"generation_batch_size ({self.generation_batch_size}) must be divisible by the "
                                  f"global batch size ({per_step}).")
            self.steps_per_generation = self.generation_batch_size // per_step
        self.steps_per_generation = self.steps_per_generation or self.gradient_accumulation_steps
        self.generation_batch_size = per_step * self.steps_per_generation
        if self.num_generations < 2:
            raise ConfigError(f"num_generations={self.num_generations}: GRPO needs at least 2 completions per "
                              "prompt to compute advantages.")
        if self.generation_batch_size % self.num_generations:
            raise ConfigError(f"generation_batch_size ({self.generation_batch_size}: per_device_train_batch_size "
                              f"x processes x steps_per_generation) must be divisible by num_generations "
                              f"({self.num_generations}): each prompt's group must fit in one generation.")


_dataclass_init = GRPOConfig.__init__


def _init(self: GRPOConfig, *args: Any, **kwargs: Any) -> None:
    # TRL's unsupported options by name (a TRL script's GRPOConfig(use_vllm=True) is refused naming it, not a
    # TypeError): collected into ``unsupported``, which __post_init__ refuses unless at TRL's defaults
    unsupported = {**kwargs.pop("unsupported", {}), **{k: kwargs.pop(k) for k in list(kwargs) if k in UNSUPPORTED}}
    _dataclass_init(self, *args, **kwargs, unsupported=unsupported)


GRPOConfig.__init__ = _init  # type: ignore[method-assign]
