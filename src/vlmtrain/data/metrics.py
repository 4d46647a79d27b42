"""Metrics for generated text, shared by every source whose eval answers are generated."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from transformers import PreTrainedTokenizerBase

IGNORE_INDEX = -100


def exact_match_metric(tokenizer: PreTrainedTokenizerBase,
                       eos_token_id: int | None = None) -> Callable[[Any], dict[str, float]]:
    """compute_metrics for generated answers: fraction whose decoded text equals the label text.

    ``p.predictions`` holds generated new-token ids ([N, T], right-padded with -100); each is cut
    at its first eos (``eos_token_id`` when given, else the tokenizer's). ``p.label_ids`` holds the training
    labels; the tokens != -100 (minus specials) of the LAST answer (labels split at eos) are the reference:
    generation answers a multi-turn
    conversation's last question, so only that answer is scored.
    """
    eos_id = tokenizer.eos_token_id if eos_token_id is None else eos_token_id  # (a Hub VLM's end of turn)
    drop = {IGNORE_INDEX, tokenizer.pad_token_id}

    def decode(row: Sequence[int], stop_at_eos: bool) -> str:
        toks: list[int] = []
        for t in row:
            t = int(t)
            if stop_at_eos and t == eos_id:
                break
            if t not in drop and t >= 0:
                toks.append(t)
        return tokenizer.decode(toks, skip_special_tokens=True).strip()

    def last_answer(row: Sequence[int]) -> str:
        answers, current = [], []
        for t in row:
            t = int(t)
            if t == eos_id:
                answers, current = answers + [current], []
            elif t != IGNORE_INDEX:
                current.append(t)
        answers = [a for a in answers + [current] if a]
        return decode(answers[-1] if answers else [], False)

    def compute(p: Any) -> dict[str, float]:
        preds = p.predictions[0] if isinstance(p.predictions, tuple) else p.predictions
        preds, labels = np.asarray(preds), np.asarray(p.label_ids)
        if len(preds) != len(labels):
            raise ValueError(f"{len(preds)} predictions but {len(labels)} labels")
        if len(preds) == 0:
            return {"exact_match": 0.0}
        hits = sum(decode(pr, True) == last_answer(lb) for pr, lb in zip(preds, labels))
        return {"exact_match": hits / len(preds)}

    return compute
