"""A run's parts under its `train.objective`: sft leaves what the model kind built; dpo wraps the kind's model
(the policy) and its reference in :class:`~vlmtrain.models.objectives.dpo.DPOObjective` and takes the kind's pair
collator. What compose.build calls, whatever the kind."""

from __future__ import annotations

import copy
from typing import Any

from vlmtrain.errors import ConfigError
from vlmtrain.models.objectives import disable_dropout
from vlmtrain.models.objectives.dpo import DPOObjective, language_model


def objective_parts(cfg: Any, kind: Any, parts: dict[str, Any]) -> dict[str, Any]:
    """``parts`` for cfg.train.objective: with dpo, ``model`` is the DPOObjective (the reference: the policy with
    its LoRA adapters switched off, else a frozen copy of the policy as built), ``policy`` the model trained,
    ``data_collator`` the kind's pair collator (``process`` its per-pair processing) and no generation metrics;
    with reward, the kind's model and the kind's reward pair collator."""
    t = cfg.train
    if t.objective == "sft":
        return parts
    if t.objective == "grpo":  # (the kind's model is the policy: GRPOTrainer wraps it with its rollout)
        return {**parts, "policy": parts["model"], "compute_metrics": None}
    if t.objective == "reward":  # (the model as built, its reward heads' loss alone: no LM targets in the batch)
        collator = kind.reward_pairs(cfg, parts["tokenizer"])
        return {**parts, "data_collator": collator, "padded_collator": collator, "compute_metrics": None}
    if kind.pairs is None:  # (RunConfig refuses it first; here for configs built in Python)
        raise ConfigError(f"train.objective={t.objective} is not supported for model.kind={kind.name} yet.")
    policy = parts["model"]
    lm = language_model(policy)  # (with score heads: the reference is the model under them)
    reference = None if hasattr(lm, "disable_adapter") else copy.deepcopy(lm)
    if t.disable_dropout:
        disable_dropout(policy, reference)
    collator = kind.pairs(cfg, parts["tokenizer"])
    objective = DPOObjective(policy, reference, beta=t.beta, loss_type=t.loss_type, loss_weights=t.loss_weights,
                             precomputed=t.precompute_ref_log_probs)
    return {**parts, "model": objective, "policy": policy, "data_collator": collator, "padded_collator": collator,
            "process": collator.process, "compute_metrics": None}
