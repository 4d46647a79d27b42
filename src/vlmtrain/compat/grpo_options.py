"""TRL 1.16's GRPOConfig options that vlmtrain's GRPO implements, with TRL's names, defaults and meanings: the
fields vlmtrain.GRPOConfig (Python) and a run config's `train` section (`train.objective: grpo`) share."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from .arguments import TrainingArguments


@dataclass
class GRPOOptions(TrainingArguments):
    """TrainingArguments with TRL 1.16's GRPO options (the rollout, the loss, the logged completions)."""

    reward_weights: list[float] | None = None
    """(grpo) One weight per reward function (the reward is their weighted sum); null: 1 each."""
    num_generations: int = 8
    """(grpo) Completions sampled per prompt (a group); per_device_train_batch_size x steps_per_generation must
    hold whole groups."""
    max_completion_length: int = 512
    """(grpo) The most tokens a completion gets (one that reaches it is truncated)."""
    generation_batch_size: int | None = None
    """(grpo) Completions per generation (per process); null: per_device_train_batch_size x
    steps_per_generation."""
    steps_per_generation: int | None = None
    """(grpo) Micro-batches each generation feeds; null: gradient_accumulation_steps."""
    shuffle_dataset: bool = True
    """(grpo) Shuffle the prompts (a seeded permutation, TRL's order). From data.source stream: the shards
    reshuffled each epoch (data.seed), false: in order."""
    temperature: float = 1.0
    """(grpo) Sampling temperature of the rollouts (the training forward divides its logits by it too)."""
    top_p: float = 1.0
    """(grpo) Nucleus sampling of the rollouts."""
    top_k: int = 0
    """(grpo) Top-k sampling of the rollouts; 0: off."""
    min_p: float | None = None
    """(grpo) Min-p sampling of the rollouts; null: off."""
    repetition_penalty: float = 1.0
    """(grpo) Repetition penalty of the rollouts."""
    generation_kwargs: dict | None = None
    """(grpo) Extra keyword arguments of transformers' GenerationConfig (they override those above)."""
    num_iterations: int = 1
    """(grpo) Optimization passes over each generation batch (mu in the GRPO paper)."""
    epsilon: float = 0.2
    """(grpo) Lower clipping bound of the importance ratio (1 - epsilon)."""
    epsilon_high: float | None = None
    """(grpo) Upper clipping bound (1 + epsilon_high); null: epsilon (DAPO recommends 0.28)."""
    importance_sampling_level: Literal["token", "sequence"] = "token"
    """(grpo) One importance ratio per token, or per completion (sequence: GSPO)."""
    use_bias_correction_kl: bool = True
    """(grpo) Multiply the per-token KL by the importance ratio (TRL's default)."""
    scale_rewards: str | bool = "group"
    """(grpo) Divide each advantage by its group's reward standard deviation (group), the batch's (batch), or not
    (none: Dr. GRPO)."""
    mask_truncated_completions: bool = False
    """(grpo) Leave completions that reach max_completion_length out of the loss."""
    log_completions: bool = False
    """(grpo) Log at each logged step the last generation batch's prompts, completions, rewards (each function's
    too) and advantages, every process's rows (`completions` in metrics.jsonl, a table per step on the report
    page)."""
    num_completions_to_print: int | None = None
    """(grpo) log_completions keeps that many of the table's rows, drawn at random (TRL's printed sample); null:
    all."""
    log_unique_prompts: bool = False
    """(grpo) log_completions keeps each prompt's first row only."""
