"""Reward functions for GRPO with TRL's signature (``prompts``, ``completions`` and the prompt's other columns as
keyword arguments -> one float per completion), to name in a config's `train.reward_funcs` as
`vlmtrain.evaluation.rewards:<name>` or to pass to vlmtrain.GRPOTrainer."""

from __future__ import annotations

from typing import Any


def _text(completion: Any) -> str:
    """A completion's text: a string, or a conversational completion's last message's content."""
    if isinstance(completion, list):
        return str(completion[-1].get("content", "")) if completion else ""
    return str(completion)


def exact_answer(completions: list[Any], answer: list[Any], **kwargs: Any) -> list[float]:
    """1.0 where a completion's text, stripped, equals its prompt's `answer` column (stripped), else 0.0."""
    return [float(_text(c).strip() == str(a).strip()) for c, a in zip(completions, answer, strict=True)]
