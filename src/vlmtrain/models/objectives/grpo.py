"""Group Relative Policy Optimization for causal language models, with TRL 1.16's GRPOTrainer's math and metrics.

:func:`group_advantages` turns each completion's reward into its advantage within its prompt's group of
``num_generations``. :class:`GRPOObjective` wraps the policy and its reference (None with ``beta`` 0, as TRL: no
reference at all); its forward takes a micro-batch of rolled-out completions (left-padded prompts, right-padded
completions, their advantages, the log-probs of the policy that sampled them where it has moved since) and returns
``loss``, ``num_items`` (how the trainer weights micro-batches: sequences, or completion tokens for ``dapo``) and
``metrics`` under TRL's names (``kl``, ``entropy``, ``clip_ratio/...``). Logits are computed only at the
completion positions (``logits_to_keep``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ...data.preference_vision import VISION_PREFIX
from ...errors import ConfigError
from .vision_pairs import with_pair_images

LOSS_TYPES = ("grpo", "dapo", "dr_grpo", "bnpo")
VISION_KEYS = ("vision_pixel_values", "vision_image_grid_thw", "image_token_index", "image_grid_thw",
               "mm_token_type_ids", "token_type_ids", "videos_pixel_values_videos", "videos_video_grid_thw",
               "video_token_index", "video_grid_thw", "second_per_grid_ts")
"""A batch's vision inputs (compat/grpo_vision.py): each group's images once, encoded once per forward; with every
other ``vision_*`` key, the family's image inputs (:func:`vision_inputs`)."""
SCALE_REWARDS = ("group", "batch", "none")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")


def vision_inputs(batch: Mapping[str, Any]) -> dict[str, Any]:
    """The vision inputs of a batch: its :data:`VISION_KEYS` and the family's image inputs (``vision_*``)."""
    return {k: v for k, v in batch.items() if k in VISION_KEYS or k.startswith(VISION_PREFIX)}


def nanstd(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """The standard deviation ignoring NaNs, with Bessel's correction (TRL's ``nanstd``; NaN for one value)."""
    mean = torch.nanmean(x, dim=dim, keepdim=True)
    count = (~torch.isnan(x)).sum(dim=dim, keepdim=True)
    variance = torch.nanmean((x - mean) ** 2, dim=dim, keepdim=True)
    correction = torch.where(count > 1, count / (count - 1), torch.full_like(variance, float("nan")))
    std = torch.sqrt(variance * correction)
    return std.squeeze() if dim is None else std.squeeze(dim)


def group_advantages(rewards: torch.Tensor, num_generations: int, scale_rewards: str
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each completion's advantage: its reward minus its group's mean, over the group's (``group``) or the
    batch's (``batch``) standard deviation + 1e-4, or unscaled (``none``: Dr. GRPO); and whether its group's
    (or the batch's) rewards were all equal. ``rewards`` [N] in groups of ``num_generations`` consecutive rows;
    a NaN reward (no function scored it) gets advantage 0 and stays out of its group's mean."""
    grouped = rewards.view(-1, num_generations)
    mean = torch.nanmean(grouped, dim=1).repeat_interleave(num_generations)
    if scale_rewards == "batch":
        std = nanstd(rewards).expand_as(rewards)
    else:
        std = nanstd(grouped, dim=1).repeat_interleave(num_generations)
    advantages = rewards - mean
    if scale_rewards != "none":
        advantages = advantages / (std + 1e-4)
    return torch.nan_to_num(advantages, nan=0.0), torch.isclose(std, torch.zeros_like(std))


def completion_logps(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                     completion_ids: torch.Tensor, temperature: float, entropy: bool = False,
                     **vision: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-probs [B, C] of the completion tokens (the last C of ``input_ids``) under ``model`` with its
    logits divided by ``temperature`` (as TRL scores them), and optionally their entropies; the logits of the
    completion positions only (``logits_to_keep``). ``vision``: the rows' :data:`VISION_KEYS` (each group's
    images encoded once: vision_pairs.py)."""
    keep = completion_ids.shape[1]
    inputs = with_pair_images(model, {"input_ids": input_ids, "attention_mask": attention_mask, **vision})
    logits = model(**inputs, logits_to_keep=keep + 1, use_cache=False).logits[:, :-1].float() / temperature
    logp = torch.log_softmax(logits, dim=-1)
    token_logp = logp.gather(-1, completion_ids.unsqueeze(-1)).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1) if entropy else None
    return token_logp, ent


class GRPOObjective(nn.Module):
    """The policy (``self.policy``, trained) and its reference (``self.ref_model``: a frozen model, or None: the
    policy with its adapters off where it has them, no reference with ``beta`` 0); forward returns TRL 1.16's
    clipped GRPO loss of a micro-batch of completions for one ``loss_type``."""

    def __init__(self, policy: nn.Module, ref_model: nn.Module | None, *, beta: float, epsilon: float,
                 epsilon_high: float | None, loss_type: str, importance_sampling_level: str,
                 max_completion_length: int, temperature: float, use_bias_correction_kl: bool = True) -> None:
        super().__init__()
        if loss_type not in LOSS_TYPES:
            raise ConfigError(f"loss_type={loss_type!r}: vlmtrain's GRPO has {LOSS_TYPES} (TRL's other loss types "
                              "are not implemented yet).")
        if importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
            raise ConfigError(f"importance_sampling_level={importance_sampling_level!r}: expected one of "
                              f"{IMPORTANCE_SAMPLING_LEVELS}.")
        self.policy, self.ref_model = policy, ref_model
        if ref_model is not None:
            ref_model.requires_grad_(False)
            ref_model.eval()
        self.beta, self.loss_type, self.level = beta, loss_type, importance_sampling_level
        self.epsilon_low, self.epsilon_high = epsilon, epsilon if epsilon_high is None else epsilon_high
        self.max_completion_length, self.temperature = max_completion_length, temperature
        self.use_bias_correction_kl = use_bias_correction_kl

    def train(self, mode: bool = True) -> GRPOObjective:
        super().train(mode)
        if self.ref_model is not None:
            self.ref_model.eval()  # (a reference never has dropout)
        return self

    @torch.no_grad()
    def policy_logps(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                     completion_ids: torch.Tensor, **vision: torch.Tensor) -> torch.Tensor:
        """The current policy's completion log-probs, without gradients (the ``old`` ones of a buffered batch)."""
        return completion_logps(self.policy, input_ids, attention_mask, completion_ids, self.temperature,
                                **vision)[0]

    @torch.no_grad()
    def reference_logps(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                        completion_ids: torch.Tensor, **vision: torch.Tensor) -> torch.Tensor:
        """The reference's completion log-probs: the frozen model, else the policy with its adapters off."""
        if self.ref_model is not None:
            return completion_logps(self.ref_model, input_ids, attention_mask, completion_ids, self.temperature,
                                    **vision)[0]
        with self.policy.disable_adapter():
            return completion_logps(self.policy, input_ids, attention_mask, completion_ids, self.temperature,
                                    **vision)[0]

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, completion_mask: torch.Tensor,
                advantages: torch.Tensor, old_per_token_logps: torch.Tensor | None = None,
                ref_per_token_logps: torch.Tensor | None = None, dapo_normalizer: torch.Tensor | None = None,
                **inputs: Any) -> dict[str, Any]:
        """``input_ids`` / ``attention_mask``: each row's left-padded prompt then its right-padded completion (the
        last ``completion_mask.shape[1]`` columns); a batch with images brings its :data:`VISION_KEYS`.
        ``dapo_normalizer`` (per row, all alike): a micro-step's share of its generation batch's completion tokens,
        dapo's weight as TRL's (else the micro-batch's own tokens)."""
        completion_ids = input_ids[:, -completion_mask.shape[1]:]
        mask = completion_mask.float()
        vision = vision_inputs(inputs)
        logps, entropies = completion_logps(self.policy, input_ids, attention_mask, completion_ids,
                                            self.temperature, entropy=True, **vision)
        old = logps.detach() if old_per_token_logps is None else old_per_token_logps
        log_ratio = logps - old
        if self.level == "sequence":
            log_ratio = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
        coef_1 = torch.exp(log_ratio)
        coef_2 = torch.clamp(coef_1, 1 - self.epsilon_low, 1 + self.epsilon_high)
        adv = advantages.unsqueeze(1)
        per_token_loss = -torch.min(coef_1 * adv, coef_2 * adv)
        metrics: dict[str, torch.Tensor] = {}
        if self.beta != 0.0:
            diff = ref_per_token_logps - logps
            per_token_kl = torch.exp(diff) - diff - 1
            if self.use_bias_correction_kl:  # (TRL's default: the ratio's gradient counts even where it is 1)
                per_token_kl = per_token_kl * coef_1
            per_token_loss = per_token_loss + self.beta * per_token_kl
            metrics["kl"] = _masked_mean(per_token_kl.detach(), mask)
        loss, num_items = self._reduce(per_token_loss, mask, dapo_normalizer)
        metrics["entropy"] = _masked_mean(entropies.detach(), mask)
        low = ((coef_1 < 1 - self.epsilon_low) & (adv < 0)).float().detach()
        high = ((coef_1 > 1 + self.epsilon_high) & (adv > 0)).float().detach()
        metrics["clip_ratio/low_mean"] = _masked_mean(low, mask)
        metrics["clip_ratio/high_mean"] = _masked_mean(high, mask)
        metrics["clip_ratio/region_mean"] = _masked_mean(torch.maximum(low, high), mask)
        return {"loss": loss, "num_items": num_items, "metrics": metrics}

    def _reduce(self, per_token_loss: torch.Tensor, mask: torch.Tensor, dapo_normalizer: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """The micro-batch's loss as ``loss_type`` normalizes it, and its weight among the window's micro-batches
        (the trainer averages losses by these weights: TRL's division by the accumulation steps; for ``dapo`` by
        the generation batch's completion tokens per micro-step (``dapo_normalizer``, else the window's own),
        for ``bnpo`` by each micro-batch's)."""
        rows = torch.tensor(float(mask.shape[0]), device=mask.device)
        masked = per_token_loss * mask
        if not self.training and self.loss_type in ("dapo", "bnpo"):  # (evaluation: TRL's mean of the batches')
            return masked.sum() / mask.sum().clamp(min=1.0), rows
        if self.loss_type == "grpo":
            return (masked.sum(-1) / mask.sum(-1).clamp(min=1.0)).mean(), rows
        if self.loss_type == "dr_grpo":
            return masked.sum() / (mask.shape[0] * self.max_completion_length), rows
        if self.loss_type == "bnpo":  # (the micro-batch's token mean, micro-batches weighted alike)
            return masked.sum() / mask.sum().clamp(min=1.0), rows
        if dapo_normalizer is not None:
            return masked.sum() / dapo_normalizer[0], dapo_normalizer[0].detach()
        tokens = mask.sum()
        return masked.sum() / tokens.clamp(min=1.0), tokens.detach()


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    if x.shape[1] == 1:  # (sequence-level importance sampling: one value per sequence)
        return x.mean()
    return (x * mask).sum() / mask.sum().clamp(min=1.0)
