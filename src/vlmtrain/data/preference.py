"""Preference pairs for causal language models, as TRL 1.16's DPOTrainer reads them: a sample with ``prompt``,
``chosen`` and ``rejected`` (plain strings, or message lists rendered by the tokenizer's chat template) becomes
``prompt_ids`` / ``chosen_ids`` / ``rejected_ids`` (:func:`tokenize_pair`), and :class:`PreferenceCollator`
lays a batch of them out as one forward: the B chosen sequences, then the B rejected ones, right-padded, with a
``completion_mask`` over the answer tokens."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import ConfigError
from .pair_packing import pack_pair_rows

PAIR_COLUMNS = ("prompt_ids", "chosen_ids", "rejected_ids")
REF_LOGPS_COLUMNS = ("ref_chosen_logps", "ref_rejected_logps")  # precompute_ref_log_probs: the reference's, per pair
TRUNCATION_MODES = ("keep_start", "keep_end")


def is_conversational(sample: Mapping[str, Any]) -> bool:
    """Whether the pair's prompt is a message list (``[{"role": ..., "content": ...}, ...]``), as TRL decides."""
    prompt = sample.get("prompt")
    return isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], Mapping) and "role" in prompt[0]


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def tokenize_pair(sample: Mapping[str, Any], tokenizer: Any) -> dict[str, list[int]]:
    """``prompt_ids``, ``chosen_ids`` and ``rejected_ids`` of one pair, as TRL's DPOTrainer tokenizes it: plain
    text gets the EOS token appended to each answer (unless it ends with it) and prompt + answer tokenized as one
    string; a conversation is rendered by the chat template (the prompt with the generation prompt). The answer
    starts where the prompt's tokens and prompt + answer's diverge (a token merging across the boundary, or a
    template that renders the prompt alone differently, moves the boundary, never misaligns it)."""
    for key in ("prompt", "chosen", "rejected"):
        if sample.get(key) is None:
            raise ConfigError(f"a preference pair without {key!r} (it has {sorted(sample)}): each pair needs "
                              "'prompt', 'chosen' and 'rejected'.")
    prompt, chosen, rejected = sample["prompt"], sample["chosen"], sample["rejected"]
    if is_conversational(sample):
        def ids(messages: list, **kw: Any) -> list[int]:
            out = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, **kw)
            return list(out["input_ids"])

        prompt_ids = ids(prompt, add_generation_prompt=True)
        with_chosen, with_rejected = ids(prompt + chosen), ids(prompt + rejected)
    else:
        eos = tokenizer.eos_token
        chosen = chosen if chosen.endswith(eos) else chosen + eos
        rejected = rejected if rejected.endswith(eos) else rejected + eos
        prompt_ids = list(tokenizer(text=prompt)["input_ids"])
        with_chosen = list(tokenizer(text=prompt + chosen)["input_ids"])
        with_rejected = list(tokenizer(text=prompt + rejected)["input_ids"])
    start = min(_common_prefix(prompt_ids, with_chosen), _common_prefix(prompt_ids, with_rejected))
    return {"prompt_ids": prompt_ids[:start], "chosen_ids": with_chosen[start:],
            "rejected_ids": with_rejected[start:]}


def pair_row(prompt_ids: Sequence[int], answer_ids: Sequence[int], max_length: int | None,
             truncation_mode: str = "keep_start") -> tuple[list[int], list[int]]:
    """Prompt + answer as the model reads it, and its completion mask (1 on answer tokens), cut to
    ``max_length`` as ``truncation_mode`` says: ``keep_start`` keeps the first tokens, ``keep_end`` the last."""
    row, mask = list(prompt_ids) + list(answer_ids), [0] * len(prompt_ids) + [1] * len(answer_ids)
    if max_length is not None:
        cut = slice(None, max_length) if truncation_mode == "keep_start" else slice(-max_length, None)
        row, mask = row[cut], mask[cut]
    return row, mask


@dataclass
class PreferenceCollator:
    """A batch of tokenized pairs as one forward: ``input_ids`` / ``attention_mask`` / ``completion_mask`` with
    the B chosen rows first, then the B rejected rows (prompt + answer each, cut to ``max_length`` as
    ``truncation_mode`` says, right-padded with ``pad_token_id``); ``completion_mask`` marks the answer tokens.
    The pairs' precomputed ``ref_chosen_logps`` / ``ref_rejected_logps``, where they have them, come along.
    ``padding_free``: the 2B rows packed into one, each with its own positions (data/pair_packing.py)."""

    pad_token_id: int
    max_length: int | None = None
    truncation_mode: str = "keep_start"
    padding_free: bool = False

    def __post_init__(self) -> None:
        if self.truncation_mode not in TRUNCATION_MODES:
            raise ConfigError(f"truncation_mode={self.truncation_mode!r}: expected one of {TRUNCATION_MODES}.")

    def __call__(self, samples: list[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
        rows, masks = [], []
        for side in ("chosen_ids", "rejected_ids"):
            for s in samples:
                row, mask = pair_row(s["prompt_ids"], s[side], self.max_length, self.truncation_mode)
                rows.append(row)
                masks.append(mask)
        width = max(len(r) for r in rows)
        input_ids = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
        completion_mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, (r, m) in enumerate(zip(rows, masks)):
            input_ids[i, :len(r)] = torch.tensor(r, dtype=torch.long)
            attention_mask[i, :len(r)] = 1
            completion_mask[i, :len(m)] = torch.tensor(m, dtype=torch.long)
        batch = {"input_ids": input_ids, "attention_mask": attention_mask, "completion_mask": completion_mask}
        for key in REF_LOGPS_COLUMNS:  # (precompute_ref_log_probs: the reference's, one per pair)
            if key in samples[0]:
                batch[key] = torch.tensor([float(s[key]) for s in samples], dtype=torch.float32)
        return pack_pair_rows(batch) if self.padding_free else batch
