"""What a score head is (`model.heads`): its HeadConfig, and the parsing that checks each key. Light (no torch),
shared by the heads (heads.py) and their metrics (head_metrics.py)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ...errors import ConfigError

HEAD_TYPES = ("classification", "regression", "reward")
HEAD_LOSSES = {"classification": ("ce", "bce"), "regression": ("mse", "huber"), "reward": ("bradley_terry",)}


@dataclass
class HeadConfig:
    """One score head: a linear layer on the pooled last-token hidden state."""

    type: str = "classification"
    """`classification` (labels: a class index for `ce`, a 0/1 list of num_outputs for `bce`), `regression`, or
    `reward` (one output, trained on pairs with the Bradley-Terry loss; its label is the pair's margin)."""
    num_outputs: int = 1
    """Classes (ce), independent labels (bce) or regressed values."""
    loss: str = ""
    """ce | bce (classification), mse | huber (regression), bradley_terry (reward); empty: the first one."""
    weight: float = 1.0
    """Factor of this head's loss in the total `loss`."""
    center_rewards_coefficient: float | None = None
    """reward heads: adds ``coefficient * mean((r_chosen + r_rejected)^2)`` to the loss (TRL's name; 0.01 is the
    value TRL recommends), for rewards centred on 0."""


def parse_heads(spec: Mapping[str, Any] | None) -> dict[str, HeadConfig]:
    """`model.heads` ({name: {type, num_outputs, loss, weight}}) as HeadConfigs, with defaults filled in;
    a ConfigError names the bad key (`model.heads.<name>.<key>`) and what was expected."""
    if spec is None:
        return {}
    if not isinstance(spec, Mapping):
        raise ConfigError(f"model.heads: expected a mapping of head name -> options, got {type(spec).__name__}")
    fields = [f.name for f in dataclasses.fields(HeadConfig)]
    heads = {}
    for name, options in spec.items():
        where = f"model.heads.{name}"
        if not isinstance(name, str) or not name.isidentifier():
            raise ConfigError(f"{where}: a head name must be an identifier (it becomes loss_<name>, labels_<name>)")
        if isinstance(options, HeadConfig):
            options = dataclasses.asdict(options)
        if not isinstance(options, Mapping):
            raise ConfigError(f"{where}: expected a mapping with keys {fields}, got {type(options).__name__}")
        for key in options:
            if key not in fields:
                raise ConfigError(f"{where}.{key}: unknown key; expected one of {fields}")
        kind = options.get("type", "classification")
        if kind not in HEAD_TYPES:
            raise ConfigError(f"{where}.type: {kind!r} is not a head type; expected one of {list(HEAD_TYPES)}")
        loss = options.get("loss") or HEAD_LOSSES[kind][0]
        if loss not in HEAD_LOSSES[kind]:
            raise ConfigError(f"{where}.loss: {loss!r} is not a loss for a {kind} head; expected one of "
                              f"{list(HEAD_LOSSES[kind])}")
        default_outputs = None if kind == "classification" else 1
        num = options.get("num_outputs", default_outputs)
        if num is None:
            raise ConfigError(f"{where}.num_outputs: a classification head needs its number of classes")
        if isinstance(num, bool) or not isinstance(num, int) or num < 1 or (loss == "ce" and num < 2):
            raise ConfigError(f"{where}.num_outputs: expected an integer >= {2 if loss == 'ce' else 1}, got {num!r}")
        if kind == "reward" and num != 1:
            raise ConfigError(f"{where}.num_outputs: a reward head has one output (the reward), got {num!r}")
        weight = _finite(options.get("weight", 1.0), f"{where}.weight")
        center = options.get("center_rewards_coefficient")
        if center is not None:
            if kind != "reward":
                raise ConfigError(f"{where}.center_rewards_coefficient: only reward heads have it (this one is "
                                  f"{kind}); remove it.")
            center = _finite(center, f"{where}.center_rewards_coefficient")
        heads[name] = HeadConfig(type=kind, num_outputs=num, loss=loss, weight=weight,
                                 center_rewards_coefficient=center)
    return heads


def _finite(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(f"{where}: expected a finite number, got {value!r}")
    return float(value)
