"""Model kinds by name (`model.kind`): one module per kind, defining KIND; one registry line each.

A kind turns a RunConfig (and what the data source built) into the model, its processing class, the
collator and the metrics; run.py composes these and never asks which kind it has.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from vlmtrain.errors import ConfigError

logger = logging.getLogger(__name__)

# model.kind -> module that defines KIND
KINDS: dict[str, str] = {
    "causal_lm": "vlmtrain.models.kinds.causal_lm",
    "vlm": "vlmtrain.models.kinds.vlm",
    "hub_vlm": "vlmtrain.models.kinds.hub_vlm",
}


@dataclass(frozen=True)
class ModelKind:
    """The functions that build each part of a run for one kind of model (torchtitan's TrainSpec idea)."""

    name: str
    build: Callable[[Any, dict[str, Any], str | None], dict[str, Any]]
    """build(cfg, source_parts, checkpoint) -> parts: model, tokenizer (the processing class),
    data_collator, compute_metrics, and for window packing padded_collator + process. With checkpoint, the
    model's weights (and saved tokenizer/processor) come from that checkpoint directory."""
    check: Callable[[Any], None] | None = None
    """check(cfg): config checks that need no model or data (raise ConfigError); run on every config."""
    validate: Callable[[Any], None] | None = None
    """validate(cfg): checks that may import transformers, run before any data is built."""
    owns_checkpoint: Callable[[dict[str, Any]], bool] | None = None
    """owns_checkpoint(config.json contents) -> True if this kind's generate() loads such a checkpoint."""
    generate: Callable[..., str] | None = None
    """generate(checkpoint, prompt, images, max_new_tokens) -> the answer text."""
    load_generator: Callable[..., Callable[..., str]] | None = None
    """load_generator(checkpoint, device) -> answer(prompt, images, max_new_tokens): generate's model loaded
    once, for many prompts (e.g. an lmms-eval run); images are paths or PIL images."""
    load_for_inference: Callable[..., dict[str, Any]] | None = None
    """load_for_inference(checkpoint, device, dtype, max_length=None, max_images=None) -> parts: model (eval mode,
    in dtype on device, with its heads), processor, process (raw sample -> item; raises SkipSample), collate
    (items -> batch) and generate(samples, max_new_tokens, skip=False) -> answers (with skip, a skipped sample's
    SkipSample in its place). What vlmtrain.load_for_inference uses."""
    pairs: Callable[[Any, Any], Any] | None = None
    """pairs(cfg, processing_class=None) -> the pair collator of `train.objective: dpo` (None: the kind has no pair
    processing yet, a ConfigError before any work): called with a raw preference pair (docs/data.md), its
    ``process`` returns ``prompt_ids`` / ``chosen_ids`` / ``rejected_ids`` (raises SkipSample), and the collator
    lays a batch out as the objective takes it (data/preference.py: B chosen rows, then B rejected ones).
    processing_class: what build returned as the tokenizer; None: loaded from cfg (e.g. for data inspect)."""
    reward_pairs: Callable[[Any, Any], Any] | None = None
    """reward_pairs(cfg, processing_class) -> the pair collator of `train.objective: reward` (None: refused before
    any work): a batch of raw preference pairs as one pair batch (the B chosen samples, then the B rejected ones)
    with each reward head's ``labels_<name>`` (one margin per pair) and no language-model targets."""
    record_check: Callable[[Any], Callable[[dict[str, Any]], Any]] | None = None
    """record_check(cfg) -> check(sample): the checks this kind's training makes on one raw sample (texts, images,
    `<image>` placeholders, head labels; raise SkipSample), with the run's limits and heads and never the model's
    weights (hub_vlm: the sample processed by its processor, too_long included). What `vlmtrain data inspect
    --config` runs."""


def get_kind(name: str) -> ModelKind:
    if name not in KINDS:
        raise ConfigError(f"model.kind={name!r} is not one of {sorted(KINDS)}.")
    return importlib.import_module(KINDS[name]).KIND


def kind_of_checkpoint(checkpoint: str) -> ModelKind:
    """The kind whose generate() loads this checkpoint (by its config.json)."""
    path = os.path.join(checkpoint, "config.json")
    adapter = os.path.join(checkpoint, "adapter_config.json")
    if not os.path.isfile(path) and os.path.isfile(adapter):  # LoRA: the adapter names its base model
        from vlmtrain.models.hub.local_paths import adapter_base

        base = adapter_base(checkpoint) or ""
        path = os.path.join(base, "config.json")
        if not os.path.isfile(path):  # a Hub id: only transformers can tell its model_type
            from transformers import AutoConfig

            from vlmtrain.models.hub.local_paths import base_not_loadable

            try:
                return _kind_of_config(AutoConfig.from_pretrained(base).to_dict())
            except OSError as err:
                raise base_not_loadable(checkpoint, base, err) from None
    if not os.path.isfile(path):
        raise ConfigError(f"{checkpoint} has no config.json: not a model checkpoint.")
    with open(path) as f:
        return _kind_of_config(json.load(f))


def _kind_of_config(config: dict[str, Any]) -> ModelKind:
    for name in KINDS:
        kind = get_kind(name)
        if kind.owns_checkpoint is not None and kind.owns_checkpoint(config):
            return kind
    return get_kind("causal_lm")


def choose_collator(cfg: Any, model: Any, vocab_size: int, padded: Any, packed: Callable[[int], Any],
                    default_pack_length: int) -> Any:
    """The packing collator (``packed(pack_length)``) if data.packing allows it and the model passes
    :func:`check_packing`, else the padding one."""
    from vlmtrain.data.packing import check_packing
    from vlmtrain.models.meta import from_rank0

    d = cfg.data
    if d.packing is False:
        return padded
    error = from_rank0(lambda: check_packing(model, vocab_size))  # (FSDP: only rank 0 has the weights)
    if error > 1e-4:
        message = (f"{type(model).__name__} does not keep packed samples apart (logits differ by {error:.2g} "
                   f"from unpacked runs): its attention ignores restarting position_ids.")
        if d.packing:
            raise ConfigError(f"data.packing=true but {message} Set data.packing: false.")
        logger.warning("%s Training with padding instead of packing.", message)
        return padded
    return packed(d.pack_length or default_pack_length)
