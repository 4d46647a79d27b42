"""the_cauldron conversations for a plain causal LM: tokens with an exact answer-only loss mask.

Per turn the user text and a newline are the prompt, the assistant text plus eos the target (one BOS in
front when the tokenizer has one). Pieces are tokenised on their own and concatenated, so the mask is
exact whatever the tokenizer. Samples with images are skipped (counted): a text model cannot see them.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from vlmtrain.data.collate import pad_sequences
from vlmtrain.data.processing import IGNORE_INDEX, SkipSample, process_or_skip, skip_unreadable


class TextChatProcessor:
    """Turns a the_cauldron text sample into ``input_ids``, ``labels`` and the generation prompt
    ``prompt_input_ids`` (everything before the last answer). Longer than ``max_length``: skipped."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, max_length: int = 512) -> None:
        if tokenizer.eos_token_id is None or tokenizer.pad_token_id is None:
            raise ValueError("a causal LM on text data needs a tokenizer with eos and pad tokens")
        self.tokenizer, self.max_length = tokenizer, max_length

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def process(self, sample: Mapping[str, Any]) -> dict[str, Any]:
        skip_unreadable(sample)
        if sample.get("images"):
            raise SkipSample("images_for_text_model", f"{len(sample['images'])} image(s)")
        texts = sample.get("texts")
        if not isinstance(texts, list) or not texts:
            raise SkipSample("empty_conversation")
        bos = self.tokenizer.bos_token_id
        ids, labels = ([bos], [IGNORE_INDEX]) if bos is not None else ([], [])
        prompt: list[int] = []
        for turn in texts:
            if not isinstance(turn, Mapping) or not isinstance(turn.get("user"), str) \
                    or not isinstance(turn.get("assistant"), str):
                raise SkipSample("malformed_text", f"turn {turn!r}")
            user = self._encode(turn["user"] + "\n")
            answer = self._encode(turn["assistant"]) + [self.tokenizer.eos_token_id]
            prompt = ids + user
            ids, labels = prompt + answer, labels + [IGNORE_INDEX] * len(user) + answer
        if len(ids) > self.max_length:
            raise SkipSample("too_long", f"{len(ids)} tokens > max_length {self.max_length}")
        return {"input_ids": ids, "labels": labels, "prompt_input_ids": prompt}


class TextCollator:
    """Processes raw text samples (bad ones skipped and counted, as VLMCollator does) and pads them;
    with ``pack_length``, training batches are packed by ``PackingCollator`` instead."""

    # Takes whole samples (it reads texts): vlmtrain.Trainer never trims their columns, whatever
    # remove_unused_columns says (vlmtrain/compat/columns.py).
    keeps_columns = True

    def __init__(self, processor: TextChatProcessor, pack_length: int | None = None) -> None:
        self.processor, self.pack_length = processor, pack_length
        self.pad_token_id = int(processor.tokenizer.pad_token_id)
        self.skipped: Counter[str] = Counter()

    def without_packing(self) -> TextCollator:
        return self if self.pack_length is None else TextCollator(self.processor)

    def _process(self, sample: Any, skipped: Counter[str], keys: list[str]) -> dict[str, Any] | None:
        return process_or_skip(self.processor.process, sample, self.skipped, skipped, keys)

    def pad(self, items: list[dict[str, Any]]) -> dict[str, Any]:
        def tensors(key: str) -> list[torch.Tensor]:
            return [torch.as_tensor(it[key], dtype=torch.long) for it in items]

        ids, prompts = tensors("input_ids"), tensors("prompt_input_ids")
        return {"input_ids": pad_sequences(ids, self.pad_token_id),
                "attention_mask": pad_sequences([torch.ones_like(t) for t in ids], 0),
                "labels": pad_sequences(tensors("labels"), IGNORE_INDEX),
                "prompt_input_ids": pad_sequences(prompts, self.pad_token_id, side="left"),
                "prompt_attention_mask": pad_sequences([torch.ones_like(t) for t in prompts], 0, side="left")}

    def __call__(self, samples: list[Any]) -> dict[str, Any]:
        from vlmtrain.data.packing import PackingCollator

        skipped: Counter[str] = Counter()
        keys: list[str] = []
        items = [it for it in (self._process(s, skipped, keys) for s in samples) if it is not None]
        bookkeeping = {"skipped": dict(+skipped), "skipped_keys": keys}
        if not items:
            return bookkeeping
        if self.pack_length is None:
            return {**self.pad(items), **bookkeeping}
        packed = PackingCollator(self.pack_length, self.pad_token_id, padding_collator=self.pad)(items)
        return {**packed, **bookkeeping}
