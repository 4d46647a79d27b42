"""Pairwise reward modelling (Bradley-Terry), with TRL 1.16's RewardTrainer's loss and metrics.

:func:`bradley_terry` is the per-pair loss shared by :class:`RewardObjective` (a sequence-classification model
with one output: vlmtrain.RewardTrainer) and the ``reward`` score head (models/heads.py). Both read a pair batch
as data/preference.py lays it out: the B chosen rows, then the B rejected rows."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


def bradley_terry(chosen: torch.Tensor, rejected: torch.Tensor, margin: torch.Tensor | None = None,
                  center_rewards_coefficient: float | None = None) -> torch.Tensor:
    """Per-pair loss ``-log sigmoid(r_chosen - r_rejected - margin)`` plus, with a coefficient,
    ``coefficient * (r_chosen + r_rejected)^2`` (its mean over the pairs is TRL's centering term)."""
    delta = chosen - rejected
    if margin is not None:
        delta = delta - margin.to(delta)
    loss = -F.logsigmoid(delta)
    if center_rewards_coefficient is not None:
        loss = loss + center_rewards_coefficient * (chosen + rejected) ** 2
    return loss


def reward_metrics(chosen: torch.Tensor, rejected: torch.Tensor) -> dict[str, torch.Tensor]:
    """TRL's RewardTrainer metrics of a batch of pairs: ``accuracy`` (chosen scored above rejected), ``margin``
    (mean chosen - rejected), and ``min_reward`` / ``mean_reward`` / ``max_reward`` over all its rewards."""
    rewards = torch.cat([chosen, rejected])
    return {"accuracy": (chosen > rejected).float().mean(), "margin": (chosen - rejected).mean(),
            "min_reward": rewards.min(), "mean_reward": rewards.mean(), "max_reward": rewards.max()}


class RewardObjective(nn.Module):
    """A reward model (a transformers sequence-classification model with ``num_labels=1``, or a peft model
    around one) trained on pairs: forward takes a collated pair batch (B chosen rows, then B rejected rows; an
    optional per-pair ``margin``) and returns ``loss`` (the mean Bradley-Terry loss over the pairs), ``num_items``
    (the pairs), ``logits`` (the rewards, [2B, 1]) and ``metrics`` under TRL's names."""

    def __init__(self, model: nn.Module, center_rewards_coefficient: float | None = None) -> None:
        super().__init__()
        self.model = model
        self.center_rewards_coefficient = center_rewards_coefficient

    @property
    def config(self) -> Any:
        return getattr(self.model, "config", None)

    def save_pretrained(self, directory: str, state_dict: dict[str, torch.Tensor] | None = None,
                        **kwargs: Any) -> None:
        """The reward model's files in its own layout (a transformers model, or a peft adapter)."""
        if state_dict is not None:
            state_dict = {k[len("model."):]: v for k, v in state_dict.items() if k.startswith("model.")}
        self.model.save_pretrained(directory, state_dict=state_dict, **kwargs)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, margin: torch.Tensor | None = None,
                **kwargs: Any) -> dict[str, Any]:
        kwargs.pop("num_items_in_batch", None)  # (the loss is a mean over this batch's pairs, as TRL's)
        kwargs.pop("loss_only", None)
        logits = self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **kwargs).logits
        chosen, rejected = logits.squeeze(-1).float().chunk(2)
        loss = bradley_terry(chosen, rejected, margin, self.center_rewards_coefficient).mean()
        metrics = reward_metrics(chosen.detach(), rejected.detach())
        return {"loss": loss, "num_items": torch.tensor(float(chosen.shape[0]), device=loss.device),
                "logits": logits, "metrics": metrics}
