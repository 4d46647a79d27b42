"""data.source: addition — 'a+b=' -> 'c', tokenized character by character, for a causal LM."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vlmtrain.data.registry import DataSource
from vlmtrain.errors import ConfigError


@dataclass
class AdditionOptions:
    """The addition task's own `data.*` keys."""

    num_digits: int = 2
    """Digits per operand (addition)."""


def build(cfg: Any) -> dict[str, Any]:
    from vlmtrain.tasks.addition import build_addition

    d = cfg.data
    return build_addition(num_train=d.num_train, num_eval=d.num_eval, num_digits=d.num_digits, seed=d.seed)


def check_options(data: Any) -> None:
    if data.num_digits < 1:
        raise ConfigError(f"data.num_digits must be >= 1, got {data.num_digits}.")


def check(cfg: Any) -> None:
    if cfg.model.tokenizer is not None:
        raise ConfigError("model.tokenizer must be unset (null) with data.source='addition': that source "
                          "builds and uses its own tokenizer.")


SOURCE = DataSource("addition", kinds=("causal_lm",), build=build, options=AdditionOptions,
                    check_options=check_options, check=check)
