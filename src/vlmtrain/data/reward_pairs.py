"""Reward-model pairs as TRL 1.16's RewardTrainer reads them: ``chosen`` / ``rejected`` (the whole text: an
implicit prompt) or ``prompt`` / ``chosen`` / ``rejected``, plain strings or message lists, and an optional
per-pair ``margin``. Each answer becomes one sequence, prompt included (:func:`tokenize_reward_pair`);
:class:`RewardCollator` lays a batch out as data/preference.py's pair batches are: the B chosen rows, then the B
rejected rows, right-padded."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn.utils.rnn import pad_sequence

from ..errors import ConfigError
from .preference import is_conversational

REWARD_COLUMNS = ("chosen_ids", "rejected_ids", "margin")


def tokenize_reward_pair(sample: Mapping[str, Any], tokenizer: Any) -> dict[str, list[int]]:
    """``chosen_ids`` and ``rejected_ids`` of one pair, as TRL's RewardTrainer tokenizes them: the prompt (if
    any) joined to each answer; plain text gets the EOS token appended to each answer (unless it ends with it)
    and is tokenized as one string; a conversation is rendered by the chat template (no generation prompt)."""
    for key in ("chosen", "rejected"):
        if sample.get(key) is None:
            raise ConfigError(f"a reward pair without {key!r} (it has {sorted(sample)}): each pair needs 'chosen' "
                              "and 'rejected' (and optionally 'prompt' and 'margin').")
    prompt = sample.get("prompt")
    texts = [sample["chosen"], sample["rejected"]]
    conversational = is_conversational({"prompt": prompt if prompt is not None else texts[0]})
    if conversational:
        tools = sample.get("tools")  # (as TRL: a pair's tools and chat_template_kwargs reach the template)
        kwargs = {"tools": json.loads(tools) if isinstance(tools, str) else tools,
                  **(sample.get("chat_template_kwargs") or {})}
        messages = [(prompt or []) + t for t in texts]
        ids = [tokenizer.apply_chat_template(m, tokenize=True, return_dict=True, **kwargs)["input_ids"]
               for m in messages]
    else:
        eos = tokenizer.eos_token
        texts = [(prompt or "") + (t if t.endswith(eos) else t + eos) for t in texts]
        ids = [tokenizer(text=t)["input_ids"] for t in texts]
    return {"chosen_ids": list(ids[0]), "rejected_ids": list(ids[1])}


@dataclass
class RewardCollator:
    """A batch of tokenized reward pairs as one forward: ``input_ids`` / ``attention_mask`` with the B chosen
    rows first, then the B rejected rows, right-padded with ``pad_token_id``; ``margin`` [B] when the pairs
    have one."""

    pad_token_id: int

    def __call__(self, samples: list[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
        rows = [torch.tensor(s[side], dtype=torch.long) for side in ("chosen_ids", "rejected_ids") for s in samples]
        batch = {"input_ids": pad_sequence(rows, batch_first=True, padding_value=self.pad_token_id),
                 "attention_mask": pad_sequence([torch.ones_like(r) for r in rows], batch_first=True)}
        if "margin" in samples[0]:
            batch["margin"] = torch.tensor([float(s["margin"]) for s in samples], dtype=torch.float32)
        return batch
