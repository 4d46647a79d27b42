"""Preference pairs in the data layer: one pair is one sample, in either of two layouts (docs/data.md).

- vlmtrain's own, the_cauldron schema with two answers: ``{"images": [...], "texts": [{"user": ..., "assistant":
  ...}, ..., {"user": ...}], "chosen": ..., "rejected": ...}``: the last turn holds the question alone, ``chosen``
  and ``rejected`` its two answers (strings).
- TRL's DPOTrainer layout: ``{"prompt": ..., "chosen": ..., "rejected": ...}`` (strings, or message lists),
  optional ``images``: read unchanged.

:func:`check_pair` is what every kind checks first (a bad pair is a counted skip, never a wrong loss);
:class:`TextPairProcessor` turns a text pair into a causal LM's ``prompt_ids`` / ``chosen_ids`` / ``rejected_ids``
and :class:`PairCollator` processes and lays out a batch of raw pairs (data/preference.py's layout)."""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

from vlmtrain.data.preference import REF_LOGPS_COLUMNS, PreferenceCollator, tokenize_pair
from vlmtrain.data.processing import SkipSample, process_or_skip

ANSWERS = ("chosen", "rejected")


def is_pair(sample: Mapping[str, Any]) -> bool:
    """Whether a raw sample is meant as a preference pair (it has a ``chosen`` or a ``rejected`` field)."""
    return any(key in sample for key in ANSWERS)


def check_pair(sample: Mapping[str, Any]) -> None:
    """A SkipSample for a record that is no usable pair: an answer missing, both answers the same, no prompt
    (TRL's layout) or turns that are not the_cauldron's with the question alone last (the own layout)."""
    for key in ANSWERS:
        if sample.get(key) is None:
            raise SkipSample("not_a_pair", f"no {key!r} (a pair has 'chosen' and 'rejected')")
    if sample["chosen"] == sample["rejected"]:
        raise SkipSample("identical_answers", "'chosen' and 'rejected' are the same")
    if "prompt" in sample:
        if sample["prompt"] is None:
            raise SkipSample("not_a_pair", "'prompt' is null")
        return
    texts = sample.get("texts")
    if not isinstance(texts, list) or not texts:
        raise SkipSample("not_a_pair", "no 'prompt' and no 'texts' turns")
    last = texts[-1]
    if not isinstance(last, Mapping) or not isinstance(last.get("user"), str) or last.get("assistant") is not None:
        raise SkipSample("malformed_text", f"the last turn {last!r} must hold the question alone: {{'user': ...}} "
                         "(its answers are 'chosen' and 'rejected')")
    if not all(isinstance(sample[key], str) for key in ANSWERS):
        raise SkipSample("malformed_text", "'chosen' and 'rejected' must be strings with 'texts' turns")


class TextPairProcessor:
    """A text pair as a causal LM trains on it: TRL's layout tokenized as TRL's DPOTrainer does
    (data/preference.py's tokenize_pair); the own layout as SFT lays out a conversation (data/text.py: BOS, each
    user text and a newline, each answer and EOS), the prompt up to the last question, each answer with its EOS.
    With ``truncation_mode`` keep_start a pair whose prompt alone fills ``max_length`` is skipped
    (``prompt_fills_max_length``); the collator cuts the rest."""

    def __init__(self, tokenizer: Any, max_length: int | None, truncation_mode: str = "keep_start") -> None:
        from vlmtrain.data.text import TextChatProcessor

        self.tokenizer, self.max_length, self.truncation_mode = tokenizer, max_length, truncation_mode
        self.chat = TextChatProcessor(tokenizer, max_length=sys.maxsize)  # (cutting is the collator's job)

    def process(self, sample: Mapping[str, Any]) -> dict[str, list[int]]:
        check_pair(sample)
        if sample.get("images"):
            raise SkipSample("images_for_text_model", f"{len(sample['images'])} image(s)")
        item = tokenize_pair(sample, self.tokenizer) if "prompt" in sample else self._conversation(sample)
        if (self.truncation_mode == "keep_start" and self.max_length is not None
                and len(item["prompt_ids"]) >= self.max_length):
            raise SkipSample("prompt_fills_max_length", f"{len(item['prompt_ids'])} prompt tokens >= max_length "
                             f"{self.max_length}: no answer token would be left")
        return item

    def _conversation(self, sample: Mapping[str, Any]) -> dict[str, list[int]]:
        turns = sample["texts"]
        sides = [self.chat.process({"texts": [*turns[:-1], {"user": turns[-1]["user"], "assistant": sample[key]}]})
                 for key in ANSWERS]
        prompt = sides[0]["prompt_input_ids"]
        return {"prompt_ids": prompt, "chosen_ids": sides[0]["input_ids"][len(prompt):],
                "rejected_ids": sides[1]["input_ids"][len(prompt):]}


class PairCollator:
    """Raw preference pairs -> one batch: each processed by ``process`` (a bad pair skipped and counted, as
    every vlmtrain collator skips), then laid out by data/preference.py's PreferenceCollator (the B chosen rows,
    then the B rejected rows, cut to ``max_length`` as ``truncation_mode`` says; ``padding_free``: packed into one
    row, data/pair_packing.py)."""

    # Takes whole samples: vlmtrain.Trainer never trims their columns (vlmtrain/compat/columns.py).
    keeps_columns = True

    def __init__(self, process: Callable[[Any], dict[str, Any]], pad_token_id: int, max_length: int | None,
                 truncation_mode: str = "keep_start", tokenizer: Any = None, padding_free: bool = False) -> None:
        self.process, self.tokenizer = process, tokenizer  # (the tokenizer names the tokens pair_check shows)
        self.layout = PreferenceCollator(pad_token_id, max_length, truncation_mode, padding_free)
        self.skipped: Counter[str] = Counter()

    def __call__(self, samples: list[Any]) -> dict[str, Any]:
        skipped: Counter[str] = Counter()
        keys: list[str] = []
        items = []
        for sample in samples:
            item = process_or_skip(self.process, sample, self.skipped, skipped, keys)
            if item is not None:
                items.append(carry_ref_logps(item, sample))
        bookkeeping = {"skipped": dict(+skipped), "skipped_keys": keys}
        return {**self.layout(items), **bookkeeping} if items else bookkeeping

    def check(self, sample: Mapping[str, Any]) -> None:
        """A SkipSample where ``sample`` would not train (what precompute_ref_log_probs leaves out first)."""
        self.process(sample)


def carry_ref_logps(item: dict[str, Any], sample: Mapping[str, Any]) -> dict[str, Any]:
    """A processed pair with its raw sample's precomputed ``ref_chosen_logps`` / ``ref_rejected_logps``
    (precompute_ref_log_probs: the reference's log-probs travel with their pair through shuffling and batching)."""
    return {**item, **{k: sample[k] for k in REF_LOGPS_COLUMNS if k in sample}}


def pair_check(collator: PairCollator) -> Callable[[Mapping[str, Any]], dict[str, Any]]:
    """What `vlmtrain data inspect --config` runs on each sample of a DPO run: the pair's processing (SkipSample
    for a bad one), its token ids and, under ``tokens``, the prompt's, chosen's and rejected's tokens."""
    def check(sample: Mapping[str, Any]) -> dict[str, Any]:
        item = collator.process(sample)
        if hasattr(collator, "token_ids"):  # (pairs with images: the ids their batch row holds)
            item = {**item, **collator.token_ids(item)}
        names = collator.tokenizer.convert_ids_to_tokens
        return {**item, "tokens": {side: names(item[f"{side}_ids"]) for side in ("prompt", *ANSWERS)}}

    return check
