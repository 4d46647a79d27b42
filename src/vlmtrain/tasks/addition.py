"""Two-digit addition ("37+48=" -> "85"): a toy task that proves the trainer actually learns.

Train and eval use disjoint operand pairs, so eval exact match measures generalization, not memory.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import torch
from torch.utils.data import Dataset
from transformers import PreTrainedTokenizerBase

from vlmtrain.data.metrics import exact_match_metric
from vlmtrain.data.tokenizers import build_char_tokenizer

IGNORE_INDEX = -100
ADDITION_CHARS = "0123456789+="

Pair = tuple[int, int]


def split_pairs(num_digits: int = 2, num_eval: int = 500, seed: int = 0) -> tuple[list[Pair], list[Pair]]:
    """Split all ``num_digits``-digit operand pairs into disjoint (train, eval) lists.

    (a, b) and (b, a) always land in the same split: otherwise the model could "generalize" to an
    eval pair by having memorized its mirror image. The eval list holds at least ``num_eval`` pairs
    (a few more when the last held-out unordered pair contributes two orderings).
    """
    if num_digits < 1:
        raise ValueError(f"num_digits must be >= 1, got {num_digits}")
    lo, hi = (10 ** (num_digits - 1) if num_digits > 1 else 0), 10**num_digits - 1
    keys = [(a, b) for a in range(lo, hi + 1) for b in range(a, hi + 1)]
    total = (hi - lo + 1) ** 2
    if not 0 < num_eval < total:
        raise ValueError(f"num_eval must be in [1, {total - 1}] for num_digits={num_digits}, got {num_eval}")
    random.Random(seed).shuffle(keys)
    eval_pairs: list[Pair] = []
    n_keys = 0
    while len(eval_pairs) < num_eval:
        a, b = keys[n_keys]
        eval_pairs.extend([(a, b)] if a == b else [(a, b), (b, a)])
        n_keys += 1
    train_pairs = [p for a, b in keys[n_keys:] for p in ([(a, b)] if a == b else [(a, b), (b, a)])]
    return train_pairs, eval_pairs


class AdditionDataset(Dataset):
    """Map-style dataset of addition problems, tokenized character by character.

    Each item is ``{"input_ids", "labels", "prompt_input_ids"}`` (lists of ints): input_ids is
    ``<s> a + b = sum </s>``; labels equal input_ids with ``<s>`` and the prompt set to -100, so the
    loss covers only the answer and ``</s>`` (HF convention: unshifted, the model shifts).
    prompt_input_ids is ``<s> a + b =``, the generation prompt.

    With ``num_samples`` set, items cycle through successive seeded shuffles of ``pairs`` (every pair
    is seen about equally often); without it, the dataset is exactly ``pairs`` in the given order.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        pairs: Sequence[Pair],
        num_samples: int | None = None,
        seed: int = 0,
    ) -> None:
        if not pairs:
            raise ValueError("AdditionDataset needs at least one pair")
        self.tokenizer = tokenizer
        self.pairs: list[Pair] = list(pairs)
        if num_samples is None:
            self.samples = list(self.pairs)
        else:
            rng = random.Random(seed)
            self.samples = []
            while len(self.samples) < num_samples:
                epoch = list(self.pairs)
                rng.shuffle(epoch)
                self.samples.extend(epoch)
            del self.samples[num_samples:]
        # Char -> id once, instead of running the tokenizer pipeline per item.
        self._ids = {ch: tokenizer.convert_tokens_to_ids(ch) for ch in ADDITION_CHARS}

    def __len__(self) -> int:
        return len(self.samples)

    def _encode(self, text: str) -> list[int]:
        return [self._ids[ch] for ch in text]

    def __getitem__(self, idx: int) -> dict[str, list[int]]:
        a, b = self.samples[idx]
        prompt = [self.tokenizer.bos_token_id, *self._encode(f"{a}+{b}=")]
        answer = [*self._encode(str(a + b)), self.tokenizer.eos_token_id]
        return {
            "input_ids": prompt + answer,
            "labels": [IGNORE_INDEX] * len(prompt) + answer,
            "prompt_input_ids": list(prompt),
        }


def _pad(seqs: list[list[int]], value: int, left: bool) -> torch.Tensor:
    width = max(len(s) for s in seqs)
    rows = [[value] * (width - len(s)) + s if left else s + [value] * (width - len(s)) for s in seqs]
    return torch.tensor(rows, dtype=torch.long)


class AdditionCollator:
    """Pads a list of AdditionDataset items into tensors.

    Training keys (``input_ids``, ``attention_mask``, ``labels``) are right-padded; the generation
    prompt (``prompt_input_ids``, ``prompt_attention_mask``) is left-padded so that new tokens are
    appended directly after every prompt in the batch.
    """

    # Takes whole samples (the prompt_* fields are not forward arguments): vlmtrain.Trainer never trims their columns, whatever
    # remove_unused_columns says (vlmtrain/compat/columns.py).
    keeps_columns = True

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        if tokenizer.pad_token_id is None:
            raise ValueError("AdditionCollator needs a tokenizer with a pad token")
        self.pad_token_id = int(tokenizer.pad_token_id)

    def __call__(self, items: list[dict[str, list[int]]]) -> dict[str, torch.Tensor]:
        ids = [it["input_ids"] for it in items]
        prompts = [it["prompt_input_ids"] for it in items]
        return {
            "input_ids": _pad(ids, self.pad_token_id, left=False),
            "attention_mask": _pad([[1] * len(s) for s in ids], 0, left=False),
            "labels": _pad([it["labels"] for it in items], IGNORE_INDEX, left=False),
            "prompt_input_ids": _pad(prompts, self.pad_token_id, left=True),
            "prompt_attention_mask": _pad([[1] * len(s) for s in prompts], 0, left=True),
        }


def build_addition(num_train: int = 20000, num_eval: int = 500, num_digits: int = 2, seed: int = 0) -> dict:
    """Everything a Trainer needs for the addition task.

    Returns ``tokenizer``, ``train_dataset`` (``num_train`` samples over the train pairs),
    ``eval_dataset`` (``num_eval`` distinct held-out pairs), ``data_collator`` and ``compute_metrics``.
    """
    tokenizer = build_char_tokenizer(ADDITION_CHARS)
    train_pairs, eval_pairs = split_pairs(num_digits=num_digits, num_eval=num_eval, seed=seed)
    return {
        "tokenizer": tokenizer,
        "train_dataset": AdditionDataset(tokenizer, train_pairs, num_samples=num_train, seed=seed),
        "eval_dataset": AdditionDataset(tokenizer, eval_pairs[:num_eval]),
        "data_collator": AdditionCollator(tokenizer),
        "compute_metrics": exact_match_metric(tokenizer),
    }
