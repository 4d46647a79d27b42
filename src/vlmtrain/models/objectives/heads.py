"""Score heads on a base model's last non-pad token, and the multi-loss output contract they feed.

`WithHeads(base, heads)` wraps any transformers LM / VLM (or a peft model around one). Its forward takes the
batch plus one label tensor per head (`labels_<name>`, built by :func:`head_label_tensors` from the samples'
`labels: {<name>: value}`) and returns `loss` = LM loss (if the batch has `labels`) + sum(weight * loss_<name>),
with `loss_<name>` / `num_items_<name>` per head (each head averages over the samples that have its label) and
`logits_<name>`, so the Trainer logs every loss averaged over its own items and evaluation gets head metrics.
The heads' config (`model.heads`) is :mod:`vlmtrain.models.objectives.head_config`; their files (heads.safetensors +
heads.json) are written and read by :mod:`vlmtrain.models.files.head_files`.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ...errors import ConfigError
from ..speed.lm_loss import decoder_and_head, lm_loss_sum
from .head_config import HeadConfig, parse_heads
from .head_metrics import compute_head_metrics, head_metrics
from .reward import bradley_terry
from .vision_pairs import with_pair_images

__all__ = ["HeadConfig", "ScoreHeads", "WithHeads", "check_head_labels", "compute_head_metrics", "head_label_mask",
           "head_label_tensors", "head_metrics", "pair_margin_tensors", "pair_rewards", "parse_heads", "pool_last_token"]

def pool_last_token(hidden: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """[B, L, H] -> [B, H]: each row's last position whose attention mask is 1 (left or right padding alike;
    never decided by pad id). Without a mask: the last position."""
    if attention_mask is None:
        return hidden[:, -1]
    mask = attention_mask.to(hidden.device).bool()
    positions = torch.arange(1, mask.shape[-1] + 1, device=hidden.device)
    last = (mask * positions).argmax(dim=-1)
    return hidden[torch.arange(hidden.shape[0], device=hidden.device), last]


class ScoreHeads(nn.Module):
    """One nn.Linear(hidden, num_outputs) per head; parameters stay float32 (also after `.to(bfloat16)`) and
    run outside autocast."""

    def __init__(self, hidden_size: int, head_configs: Mapping[str, HeadConfig]) -> None:
        super().__init__()
        # Keys are prefixed: a head may be called like a Module attribute ('type', 'train', ...).
        self.layers = nn.ModuleDict({f"head_{name}": nn.Linear(hidden_size, c.num_outputs)
                                     for name, c in head_configs.items()})

    def layer(self, name: str) -> nn.Linear:
        """The linear layer of head `name`."""
        return self.layers[f"head_{name}"]

    def _apply(self, fn: Any, recurse: bool = True) -> ScoreHeads:
        def keep_fp32(t: torch.Tensor) -> torch.Tensor:
            t = fn(t)
            return t.float() if t.is_floating_point() else t

        return super()._apply(keep_fp32, recurse)

    def forward(self, pooled: torch.Tensor) -> dict[str, torch.Tensor]:
        # .float() on the weights too: a mixed-precision wrapper (FSDP's param_dtype) may hand them in bf16
        with torch.autocast(pooled.device.type, enabled=False):
            return {key[len("head_"):]: F.linear(pooled.float(), layer.weight.float(), layer.bias.float())
                    for key, layer in self.layers.items()}


def head_label_mask(config: HeadConfig, labels: torch.Tensor) -> torch.Tensor:
    """[B] bool: the samples that have a label for this head (not -100 for ce, no NaN cell otherwise)."""
    if config.loss == "ce":
        return labels.reshape(-1) != -100
    return ~torch.isnan(labels.float().reshape(labels.shape[0], -1)).any(dim=-1)


def pair_rewards(logits: torch.Tensor, margins: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A reward head's (chosen, rejected) rewards [B] of a pair batch: B chosen rows, then B rejected rows."""
    if logits.shape[0] != 2 * margins.shape[0]:
        raise ValueError(f"a reward head's labels are one margin per pair of rows (B chosen rows, then B rejected "
                         f"rows): got {margins.shape[0]} for {logits.shape[0]} rows")
    chosen, rejected = logits[:, 0].chunk(2)
    return chosen, rejected


def head_loss_sum(config: HeadConfig, logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed loss over the samples that have a label, their count): 0 and 0 without any, still in the graph.
    A reward head's samples are pairs, its labels their margins (models/objectives/reward.py's loss)."""
    valid = head_label_mask(config, labels.to(logits.device))
    if config.type == "reward":
        margins = labels.to(logits.device).float().reshape(-1)
        chosen, rejected = pair_rewards(logits, margins)
        total = bradley_terry(chosen, rejected, torch.where(valid, margins, 0.0), config.center_rewards_coefficient)
    elif config.loss == "ce":
        labels = labels.to(logits.device).long().reshape(-1)
        total = F.cross_entropy(logits, labels.masked_fill(~valid, 0), reduction="none")
    else:
        labels = labels.to(logits.device).float().reshape(logits.shape[0], -1)
        target = torch.where(valid[:, None], labels, torch.zeros_like(labels))
        if config.loss == "bce":
            cells = F.binary_cross_entropy_with_logits(logits, target, reduction="none")
        elif config.loss == "mse":
            cells = F.mse_loss(logits, target, reduction="none")
        else:
            cells = F.huber_loss(logits, target, reduction="none")
        total = cells.mean(dim=-1)
    return torch.where(valid, total, torch.zeros_like(total)).sum(), valid.sum()


def head_loss(config: HeadConfig, logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean loss over the samples that have a label, their count). Missing: -100 (ce) or NaN (others).
    With no labelled sample the loss is 0 (still part of the graph) and the count 0."""
    total, count = head_loss_sum(config, logits, labels)
    return total / count.clamp(min=1), count


def _total(totals: Mapping[str, Any], key: str, local: torch.Tensor) -> torch.Tensor:
    """A loss's item total from `num_items_in_batch` (at least 1: a loss without items adds 0)."""
    if key not in totals:
        raise KeyError(f"num_items_in_batch has no count for {key!r} (it has {sorted(totals)}): pass the totals of "
                       "WithHeads.count_items")
    return torch.as_tensor(totals[key], device=local.device).float().clamp(min=1)


def _inner_model(base: nn.Module) -> nn.Module:
    getter = getattr(base, "get_base_model", None)  # a peft PeftModel
    return getter() if callable(getter) else base


class WithHeads(nn.Module):
    """A base model (transformers LM/VLM, or a peft model around one) plus score heads on its last non-pad
    token's final hidden state.

    forward(**batch, num_items_in_batch=None): the base gets the batch without the head labels (`labels_<name>`).
    Returned dict: `loss`, `num_items` (the LM target count if the batch has LM targets, else the batch size),
    `loss_lm`/`num_items_lm` and `logits` (the base's LM logits) when the batch has `labels`, per head
    `loss_<name>` and `num_items_<name>` (only when the batch has `labels_<name>`; each head averages over the
    samples that have its label) and `logits_<name>` [B, num_outputs].

    `loss` is `loss_lm + sum(weight * loss_<name>)`, each a mean over this batch's items; with
    `num_items_in_batch` ({"lm": N, "<head>": N, ...}, what :meth:`count_items` counted, summed by the Trainer
    over an accumulation window and all ranks) each term is instead this batch's summed loss divided by its own
    total N, so that a window's gradients add up to the one big batch's. `loss_<name>` stay this batch's means.

    A batch without `labels` (score-only samples) computes no LM logits at all: the base's decoder runs without
    its LM head (whose trainable weights get a zero gradient, so every rank's backward reaches the same
    parameters under DDP / FSDP). With `loss_only=True` (the Trainer passes it in training and in evaluation
    that keeps no LM logits) and a base that :func:`~vlmtrain.models.speed.lm_loss.decoder_and_head` knows, the LM
    head runs only at the target positions, in chunks (models/speed/lm_loss.py), and no `logits` are returned.
    """

    vlmtrain_accepts_loss_only = True

    def __init__(self, base: nn.Module, heads: Mapping[str, Any], hidden_size: int | None = None) -> None:
        super().__init__()
        self.base = base
        self.head_configs = parse_heads({k: dataclasses.asdict(v) if isinstance(v, HeadConfig) else v
                                         for k, v in heads.items()})
        if not self.head_configs:
            raise ConfigError("model.heads: WithHeads needs at least one head")
        if hidden_size is None:
            config = getattr(base, "config", None)
            text = config.get_text_config() if hasattr(config, "get_text_config") else config
            hidden_size = getattr(text, "hidden_size", None)
            if hidden_size is None:
                raise ValueError(f"WithHeads: cannot read hidden_size from {type(base).__name__}'s config; "
                                 "pass hidden_size=")
        self.hidden_size = hidden_size
        self.heads = ScoreHeads(hidden_size, self.head_configs)
        accepted = inspect.signature(_inner_model(base).forward).parameters
        self._base_accepts = set(accepted)

    @property
    def config(self) -> Any:
        return getattr(self.base, "config", None)

    @property
    def head_label_columns(self) -> list[str]:
        """The batch keys of the heads' labels (``labels_<name>``): forward takes them as keywords, so a dataset's
        columns of these names are inputs (remove_unused_columns keeps them, vlmtrain/compat/columns.py)."""
        return [f"labels_{name}" for name in self.head_configs]

    @property
    def vlmtrain_target_logits_module(self) -> str | None:
        """The LM head's name when training applies it only at targets (models/speed/flops.py counts it so)."""
        parts = decoder_and_head(_inner_model(self.base))
        return None if parts is None else next((n for n, m in self.named_modules() if m is parts[1]), None)

    def count_items(self, batch: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        """How many items each loss of `batch` averages over, from its labels alone (no forward): `lm` the
        shifted LM targets (labels[:, 1:] != -100), each head the samples with its label. Every key is always
        there (0 when absent), so ranks reduce the same keys. The Trainer sums these over an accumulation window
        and all ranks and passes the totals back to forward as `num_items_in_batch`."""
        labels = batch.get("labels")
        counts = {"lm": (labels[..., 1:] != -100).sum() if isinstance(labels, torch.Tensor) else torch.tensor(0)}
        for name, config in self.head_configs.items():
            head = batch.get(f"labels_{name}")
            counts[name] = head_label_mask(config, head).sum() if isinstance(head, torch.Tensor) else torch.tensor(0)
        return counts

    def forward(self, num_items_in_batch: Mapping[str, torch.Tensor] | None = None, loss_only: bool = False,
                **batch: Any) -> dict[str, torch.Tensor]:
        totals = num_items_in_batch
        head_labels = {name: batch.pop(f"labels_{name}") for name in self.head_configs if f"labels_{name}" in batch}
        lm_labels = batch.pop("labels", None)
        if "use_cache" in self._base_accepts:
            batch.setdefault("use_cache", False)
        result: dict[str, torch.Tensor] = {}
        parts = decoder_and_head(_inner_model(self.base)) if lm_labels is not None and loss_only else None
        if "image_token_index" in batch:  # (a pair batch with each pair's images once: encoded once here)
            batch = with_pair_images(_inner_model(self.base), batch)
        if lm_labels is None:  # score-only: no LM logits
            hidden, loss = self._hidden_without_lm_head(batch)
        elif parts is not None:  # LM logits only at the targets, in chunks (models/speed/lm_loss.py)
            batch.pop("logits_to_keep", None)
            hidden = parts[0](**batch)[0]
            loss_sum, n_lm = lm_loss_sum(hidden, parts[1], lm_labels)
            n_lm = n_lm.float()
        else:
            out = self.base(**batch, output_hidden_states=True)
            hidden, result["logits"] = out.hidden_states[-1], out.logits
            loss_sum, n_lm = self.lm_loss_sum(out.logits, lm_labels)
        if lm_labels is not None:
            loss_lm = loss_sum / n_lm.clamp(min=1)
            result.update(loss_lm=loss_lm, num_items_lm=n_lm)
            loss = loss_lm if totals is None else loss_sum / _total(totals, "lm", n_lm)
        pooled = pool_last_token(hidden, batch.get("attention_mask"))
        num_items = torch.tensor(float(hidden.shape[0]), device=hidden.device)
        if lm_labels is not None:
            num_items = torch.where(n_lm > 0, n_lm, num_items)
        for name, logits in self.heads(pooled).items():
            if name in head_labels:
                config = self.head_configs[name]
                total, count = head_loss_sum(config, logits, head_labels[name])
                value = total / count.clamp(min=1)
                result[f"loss_{name}"], result[f"num_items_{name}"] = value, count.float()
                loss = loss + config.weight * (value if totals is None else total / _total(totals, name, count))
                if config.type == "reward":  # one row per pair, beside its margin: [B, 2] (chosen, rejected)
                    logits = torch.stack(pair_rewards(logits, head_labels[name]), dim=-1)
            result[f"logits_{name}"] = logits
        result.update(loss=loss, num_items=num_items)
        return result

    def _hidden_without_lm_head(self, batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """(final hidden states [B, L, H], a zero loss) of the base's decoder, without its LM head: transformers'
        `base_model` of the model under peft (LoRA layers sit inside it). The zero loss is 0 x the LM head's
        trainable weights, which DDP (without find_unused_parameters) and FSDP's reduce-scatter need on every
        rank alike. A base without a separate decoder keeps its LM head, on the last position only."""
        inner = _inner_model(self.base)
        decoder = getattr(inner, "base_model", inner)
        if decoder is inner or not isinstance(decoder, nn.Module):
            if "logits_to_keep" in self._base_accepts:
                batch.setdefault("logits_to_keep", 1)
            hidden = self.base(**batch, output_hidden_states=True).hidden_states[-1]
            return hidden, hidden.new_zeros((), dtype=torch.float32)
        batch.pop("logits_to_keep", None)
        hidden = decoder(**batch)[0]
        head = inner.get_output_embeddings() if hasattr(inner, "get_output_embeddings") else None
        trained = [p for p in head.parameters() if p.requires_grad] if isinstance(head, nn.Module) else []
        zero = sum((p.flatten()[0].float() * 0.0 for p in trained), hidden.new_zeros((), dtype=torch.float32))
        return hidden, zero

    @staticmethod
    def lm_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Summed next-token cross-entropy over the shifted targets (labels != -100), and their count."""
        labels = labels.to(logits.device)[:, 1:]
        logits = logits[:, :-1].float()
        valid = labels != -100
        total = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.masked_fill(~valid, 0).reshape(-1),
                                reduction="none")
        return (total * valid.reshape(-1)).sum(), valid.sum().float()

    @staticmethod
    def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Mean next-token cross-entropy over the shifted targets (labels != -100), and their count; 0 and 0
        for a batch without targets (score-only samples), never NaN."""
        total, count = WithHeads.lm_loss_sum(logits, labels)
        return total / count.clamp(min=1), count

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """The base model's generate (heads take no part)."""
        return self.base.generate(*args, **kwargs)

    def head_metrics(self, predictions: Mapping[str, np.ndarray],
                     labels: Mapping[str, np.ndarray]) -> dict[str, float]:
        """Evaluation metrics per head, `<name>_<metric>` (see :func:`compute_head_metrics`); the Trainer's
        evaluation calls this for models that have it, with `logits_<name>` / `labels_<name>` arrays by name."""
        return compute_head_metrics(self.head_configs, predictions, labels)


def head_label_tensors(head_configs: Mapping[str, HeadConfig],
                       raw: list[Mapping[str, Any] | None]) -> dict[str, torch.Tensor]:
    """`labels_<name>` tensors for a batch from each sample's `labels` dict (None: no labels). Missing values
    are -100 (ce, long [B]) or NaN (bce: float [B, num_outputs]; regression: float [B], or [B, num_outputs]).
    Values are assumed checked by :func:`check_head_labels`."""
    out = {}
    for name, c in head_configs.items():
        if c.type == "reward":  # (its label is a pair's margin: pair_margin_tensors, on pair batches only)
            continue
        values = [(r or {}).get(name) for r in raw]
        if c.loss == "ce":
            out[f"labels_{name}"] = torch.tensor([-100 if v is None else int(v) for v in values], dtype=torch.long)
            continue
        rows = []
        for v in values:
            if v is None:
                rows.append([math.nan] * c.num_outputs)
            else:
                rows.append([float(x) for x in v] if isinstance(v, (list, tuple)) else [float(v)] * c.num_outputs)
        t = torch.tensor(rows, dtype=torch.float32).reshape(len(raw), c.num_outputs)
        out[f"labels_{name}"] = t[:, 0] if c.type == "regression" and c.num_outputs == 1 else t
    return out


def pair_margin_tensors(head_configs: Mapping[str, HeadConfig],
                        raw: list[Mapping[str, Any] | None]) -> dict[str, torch.Tensor]:
    """`labels_<name>` of each reward head for a batch of pairs, from each pair's `labels: {<name>: margin}`:
    float [B], 0 where a pair has no margin. Their presence is what makes a reward head compute its loss on the
    batch (rows: the B chosen, then the B rejected)."""
    return {f"labels_{name}": torch.tensor([float((r or {}).get(name) or 0.0) for r in raw], dtype=torch.float32)
            for name, c in head_configs.items() if c.type == "reward"}


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def check_head_labels(head_configs: Mapping[str, HeadConfig], raw: Mapping[str, Any] | None) -> None:
    """Raise SkipSample('bad_head_label') for a sample whose `labels` has a value of the wrong type or out of
    range for its head. None (or a missing name) is a missing label, which that head skips; names that are not
    heads are ignored (data may carry more labels than a model uses)."""
    from ...data.processing import SkipSample

    if raw is None:
        return
    if not isinstance(raw, Mapping):
        raise SkipSample("bad_head_label", f"`labels` must be a mapping {{head: value}}, got {type(raw).__name__}")
    for name, c in head_configs.items():
        v = raw.get(name)
        if v is None:
            continue
        bad = f"labels.{name}={v!r}"
        if c.type == "reward":
            if not _number(v) or not math.isfinite(v):
                raise SkipSample("bad_head_label", f"{bad}: expected a pair's margin, a finite number")
        elif c.loss == "ce":
            if not _number(v) or not float(v).is_integer() or not 0 <= v < c.num_outputs:
                raise SkipSample("bad_head_label", f"{bad}: expected a class index in 0..{c.num_outputs - 1}")
        elif c.loss == "bce":
            cells = v if isinstance(v, (list, tuple)) else [v] if c.num_outputs == 1 else None
            if cells is None or len(cells) != c.num_outputs or not all(_number(x) and 0 <= x <= 1 for x in cells):
                raise SkipSample("bad_head_label", f"{bad}: expected {c.num_outputs} value(s) in [0, 1]")
        else:
            cells = v if isinstance(v, (list, tuple)) else [v] if c.num_outputs == 1 else None
            if cells is None or len(cells) != c.num_outputs or not all(_number(x) and math.isfinite(x) for x in cells):
                raise SkipSample("bad_head_label", f"{bad}: expected {c.num_outputs} finite number(s)")
