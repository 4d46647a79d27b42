"""Direct Preference Optimization for causal language models, with TRL 1.16's DPOTrainer's losses and metrics.

:class:`DPOObjective` wraps the policy and its reference. Its forward takes a collated pair batch (the B chosen
sequences, then the B rejected ones, with a ``completion_mask``: data/preference.py), runs the policy once over
all 2B rows and the reference without gradients, sums each answer's token log-probs and returns ``loss`` (a mean
over the pairs), ``num_items`` (the pairs: how the trainer weights micro-batches and ranks) and ``metrics`` under
TRL's names (``rewards/chosen``, ``logps/rejected``, ...). A pair batch with images (data/preference_vision.py)
has each pair's images encoded once, by the policy and once by the reference (vision_pairs.py). A padding-free
batch (DPOConfig's ``padding_free``: the 2B sequences packed into one row with ``sequence_index``,
data/pair_packing.py) computes the logits only at the answer positions and sums each answer's log-probs by it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ...errors import ConfigError
from ..sharding import gathered
from .heads import head_loss_sum, pool_last_token
from .vision_pairs import with_pair_images

LOSS_TYPES = ("sigmoid", "ipo", "hinge", "sft")  # (sft: TRL's NLL of the chosen answers, beside a DPO loss)
REF_KEYS = ("ref_chosen_logps", "ref_rejected_logps")


def answer_logps(logits: torch.Tensor, input_ids: torch.Tensor, completion_mask: torch.Tensor) -> torch.Tensor:
    """Per-row sum of the log-probs of the answer tokens (position t's logits predict token t + 1)."""
    mask = completion_mask[:, 1:].bool()
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    token_logp = logp.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    return torch.where(mask, token_logp, 0.0).sum(dim=1)


def dpo_losses(chosen_scores: torch.Tensor, rejected_scores: torch.Tensor, answer_lengths: torch.Tensor,
               beta: float, loss_type: str) -> torch.Tensor:
    """Per-pair loss of one TRL loss type from the policy-over-reference log-ratios of each answer. IPO, as TRL,
    averages each answer's log-ratio over its tokens (``answer_lengths``: the 2B rows' answer token counts)
    before the squared loss."""
    delta = chosen_scores - rejected_scores
    if loss_type == "sigmoid":
        return -F.logsigmoid(beta * delta)
    if loss_type == "hinge":
        return torch.relu(1 - beta * delta)
    if loss_type == "ipo":
        chosen_len, rejected_len = answer_lengths.clamp(min=1.0).chunk(2)
        return (chosen_scores / chosen_len - rejected_scores / rejected_len - 1 / (2 * beta)) ** 2
    raise ConfigError(f"loss_type={loss_type!r}: vlmtrain's DPO has {LOSS_TYPES}.")


def language_model(policy: nn.Module) -> nn.Module:
    """The model whose log-probs DPO takes: the policy, or the base under its score heads (models/objectives/heads.py)."""
    return policy.base if hasattr(policy, "head_configs") else policy


def _logits(model: nn.Module, inputs: dict[str, Any], hidden: list[torch.Tensor] | None = None) -> torch.Tensor:
    """``model``'s logits over the 2B rows; a pair batch with images encodes them once (vision_pairs.py). With
    ``hidden`` (a list), the final hidden states are appended to it (score heads read them)."""
    inputs = with_pair_images(model, inputs)
    if hidden is None:
        return model(**inputs).logits
    out = model(**inputs, output_hidden_states=True)
    hidden.append(out.hidden_states[-1])
    return out.logits


def _answer_tokens(model: nn.Module, inputs: dict[str, Any], completion_mask: torch.Tensor,
                   sequence_index: torch.Tensor | None, hidden: list[torch.Tensor] | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The logits that predict the answer tokens [K, V], those tokens [K] and their rows (0..2B-1) [K]. A
    padding-free batch (one packed row with ``sequence_index``: data/pair_packing.py) computes logits only at
    these positions (``logits_to_keep``); a padded batch computes all and picks them (``hidden``: see _logits)."""
    input_ids = inputs["input_ids"]
    if sequence_index is None:
        mask = completion_mask[:, 1:].bool()
        rows = torch.arange(mask.shape[0], device=mask.device)[:, None].expand_as(mask)
        return _logits(model, inputs, hidden)[:, :-1][mask], input_ids[:, 1:][mask], rows[mask]
    if hidden is not None:
        raise ConfigError("DPO with score heads takes padded pair batches (a head reads each chosen row's last "
                          "token): turn padding_free off.")
    keep = completion_mask[0, 1:].nonzero().squeeze(-1)  # (position p predicts token p + 1)
    logits = _logits(model, {**inputs, "logits_to_keep": keep})[0]
    return logits, input_ids[0, keep + 1], sequence_index[0, keep + 1]


def pair_logps(model: nn.Module, batch: dict[str, Any]) -> torch.Tensor:
    """The summed answer log-probs [2B] of a collated pair batch's rows (chosen, then rejected) under ``model``:
    padded or padding-free, each pair's images encoded once."""
    inputs = {k: v for k, v in batch.items() if k not in ("completion_mask", "sequence_index", *REF_KEYS)}
    sequence_index = batch.get("sequence_index")
    logits, targets, rows = _answer_tokens(model, {"use_cache": False, **inputs}, batch["completion_mask"],
                                           sequence_index)
    return _row_sums(_token_logps(logits, targets), rows, _n_rows(batch["input_ids"], sequence_index))


def _row_sums(values: torch.Tensor, rows: torch.Tensor, n_rows: int) -> torch.Tensor:
    return values.new_zeros(n_rows).index_add(0, rows, values)


def _n_rows(input_ids: torch.Tensor, sequence_index: torch.Tensor | None) -> int:
    return input_ids.shape[0] if sequence_index is None else int(sequence_index.max()) + 1


class DPOObjective(nn.Module):
    """The DPO objective over a policy and its reference: a frozen ``ref_model``, or (``ref_model=None`` and a
    peft policy) the policy with its adapters switched off. ``loss_type`` and ``loss_weights`` as TRL's: the
    loss is the weighted sum of each type's mean over the pairs. With ``precomputed`` every batch brings the
    reference's answer log-probs (``ref_chosen_logps`` / ``ref_rejected_logps``, from :meth:`reference_logps`
    run once before training) and the reference does not run in forward; without ``ref_model`` or adapters the
    policy itself, before it trains, is then the reference."""

    def __init__(self, policy: nn.Module, ref_model: nn.Module | None, beta: float = 0.1,
                 loss_type: Sequence[str] = ("sigmoid",), loss_weights: Sequence[float] | None = None,
                 precomputed: bool = False) -> None:
        super().__init__()
        if ref_model is None and not hasattr(language_model(policy), "disable_adapter") and not precomputed:
            raise ConfigError("DPO needs a reference: pass ref_model, or a peft model whose adapters switched off "
                              "give the reference, or precompute its log-probs (precomputed=True).")
        self.precomputed = precomputed
        self.policy = policy
        self.head_configs = dict(getattr(policy, "head_configs", {}))
        if self.head_configs:  # (evaluation reports the heads' metrics, as for SFT: trainer/evaluation.py)
            self.head_metrics = policy.head_metrics
        self.ref_model = ref_model
        if ref_model is not None:
            ref_model.requires_grad_(False)
            ref_model.eval()
        self.beta = beta
        self.loss_type = list(loss_type)
        self.loss_weights = list(loss_weights) if loss_weights is not None else [1.0] * len(self.loss_type)
        for name in self.loss_type:
            if name not in LOSS_TYPES:
                raise ConfigError(f"loss_type={name!r}: vlmtrain's DPO has {LOSS_TYPES}.")

    def train(self, mode: bool = True) -> DPOObjective:
        super().train(mode)
        if self.ref_model is not None:
            self.ref_model.eval()  # the reference stays in evaluation mode (no dropout) while the policy trains
        return self

    def frozen_models(self) -> list[nn.Module]:
        """The reference, if it is a model of its own: FSDP shards it as a unit of its own (models/sharding.py)."""
        return [self.ref_model] if self.ref_model is not None else []

    def save_pretrained(self, directory: str, state_dict: dict[str, torch.Tensor] | None = None,
                        **kwargs: Any) -> None:
        """The policy's files alone (in its own layout: a transformers model, or a peft adapter); the reference
        is not saved."""
        if state_dict is not None:
            state_dict = {k[len("policy."):]: v for k, v in state_dict.items() if k.startswith("policy.")}
        self.policy.save_pretrained(directory, state_dict=state_dict, **kwargs)

    def reference_logps(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                        completion_mask: torch.Tensor | None = None, sequence_index: torch.Tensor | None = None,
                        **kwargs: Any) -> torch.Tensor:
        """The reference's summed answer log-probs of each row of a collated pair batch (chosen rows, then
        rejected; padded, or padding-free with ``sequence_index``), without gradients."""
        batch = {"input_ids": input_ids, "completion_mask": completion_mask, "attention_mask": attention_mask,
                 "sequence_index": sequence_index, **kwargs}
        with torch.no_grad():
            if self.ref_model is not None:
                with gathered(self.ref_model):  # (FSDP: its own unit, gathered once on every rank)
                    return pair_logps(self.ref_model, batch)
            lm = language_model(self.policy)
            if not hasattr(lm, "disable_adapter"):  # (precomputing: the policy has not trained yet)
                return pair_logps(lm, batch)
            with lm.disable_adapter():  # (peft: the base model)
                return pair_logps(lm, batch)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                completion_mask: torch.Tensor | None = None, sequence_index: torch.Tensor | None = None,
                **kwargs: Any) -> dict[str, Any]:
        if completion_mask is None:
            raise ValueError("DPOObjective needs a pair batch's completion_mask (the answer tokens).")
        if kwargs.pop("reference_only", False):  # (precompute_ref_log_probs' pass: a forward, gathered under FSDP)
            return {"reference_logps": self.reference_logps(input_ids, attention_mask, completion_mask,
                                                             sequence_index, **kwargs)}
        kwargs.pop("num_items_in_batch", None)
        kwargs.pop("loss_only", None)
        ref_chosen, ref_rejected = kwargs.pop("ref_chosen_logps", None), kwargs.pop("ref_rejected_logps", None)
        head_labels = {name: kwargs.pop(f"labels_{name}") for name in self.head_configs if f"labels_{name}" in kwargs}
        inputs = {"input_ids": input_ids, "attention_mask": attention_mask, "use_cache": False, **kwargs}
        n_rows = _n_rows(input_ids, sequence_index)
        hidden: list[torch.Tensor] | None = [] if self.head_configs else None
        logits, targets, rows = _answer_tokens(language_model(self.policy), inputs, completion_mask, sequence_index,
                                               hidden)
        token_logps = _token_logps(logits, targets)
        logps = _row_sums(token_logps, rows, n_rows)
        if self.precomputed:
            if ref_chosen is None or ref_rejected is None:
                raise ConfigError("precompute_ref_log_probs: this batch has no ref_chosen_logps / "
                                  "ref_rejected_logps (its dataset was not precomputed).")
            ref_logps = torch.cat([ref_chosen, ref_rejected]).to(logps)
        else:
            ref_logps = self.reference_logps(input_ids, attention_mask, completion_mask, sequence_index, **kwargs)
        chosen_logps, rejected_logps = logps.chunk(2)
        chosen_ratio, rejected_ratio = (logps - ref_logps).chunk(2)
        lengths = torch.bincount(rows, minlength=n_rows).float()
        losses = {name: -token_logps[rows < chosen_logps.shape[0]].mean() if name == "sft"  # (TRL: per chosen token)
                  else dpo_losses(chosen_ratio, rejected_ratio, lengths, self.beta, name).mean()
                  for name in set(self.loss_type)}
        loss = sum(weight * losses[name] for name, weight in zip(self.loss_type, self.loss_weights, strict=True))
        pairs = chosen_logps.shape[0]
        heads = self._heads(hidden[0][:pairs], attention_mask[:pairs], head_labels) if hidden else {}
        loss = loss + sum(self.head_configs[k[len("loss_"):]].weight * v for k, v in heads.items()
                          if k.startswith("loss_"))
        return {"loss": loss, "num_items": torch.tensor(float(pairs), device=loss.device), **heads,
                "metrics": self._metrics(logits.detach(), targets, rows < pairs, chosen_logps.detach(),
                                         rejected_logps.detach(), chosen_ratio.detach(), rejected_ratio.detach())}

    def _heads(self, hidden: torch.Tensor, attention_mask: torch.Tensor | None,
               labels: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The score heads on the B chosen rows' last tokens: ``logits_<name>`` [B, outputs] and, for a head with
        labels (``labels_<name>``: one per pair, missing ones left out), ``loss_<name>`` (its mean over the pairs
        that have one, as in SFT) and ``num_items_<name>``."""
        out: dict[str, torch.Tensor] = {}
        for name, logits in self.policy.heads(pool_last_token(hidden, attention_mask)).items():
            out[f"logits_{name}"] = logits
            if name in labels:
                total, count = head_loss_sum(self.head_configs[name], logits, labels[name])
                out[f"loss_{name}"], out[f"num_items_{name}"] = total / count.clamp(min=1), count.float()
        return out

    def _metrics(self, logits: torch.Tensor, targets: torch.Tensor, chosen: torch.Tensor,
                 chosen_logps: torch.Tensor, rejected_logps: torch.Tensor, chosen_ratio: torch.Tensor,
                 rejected_ratio: torch.Tensor) -> dict[str, torch.Tensor]:
        """TRL's DPO metrics of this micro-batch: per-pair means, and per-token means over its answer tokens
        (``logits`` [K, V] predict the answer tokens ``targets``; ``chosen``: which are the chosen answers')."""
        logits = logits.float()
        logp = torch.log_softmax(logits, dim=-1)
        entropy = -(logp.exp() * logp).sum(-1)
        mean_logits = logits.mean(-1)
        top1 = logits.argmax(-1) == targets
        chosen_rewards, rejected_rewards = self.beta * chosen_ratio, self.beta * rejected_ratio

        def token_mean(values: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
            return values[m].float().sum() / m.sum().clamp(min=1)

        everything = torch.ones_like(chosen)
        return {
            "rewards/chosen": chosen_rewards.mean(),
            "rewards/rejected": rejected_rewards.mean(),
            "rewards/accuracies": (chosen_rewards > rejected_rewards).float().mean(),
            "rewards/margins": (chosen_rewards - rejected_rewards).mean(),
            "logps/chosen": chosen_logps.mean(),
            "logps/rejected": rejected_logps.mean(),
            "logits/chosen": token_mean(mean_logits, chosen),
            "logits/rejected": token_mean(mean_logits, ~chosen),
            "entropy": token_mean(entropy, everything),
            "mean_token_accuracy": token_mean(top1, chosen),
        }


def _token_logps(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Each answer token's log-prob under its logits ([K, V], [K] -> [K])."""
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
