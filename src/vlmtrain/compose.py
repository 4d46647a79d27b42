"""A Trainer from a RunConfig: the data source's data, the model kind's model and processing (under FSDP built
once on rank 0 and sharded), packing windows, and a checkpoint's weights. What run, prediction and tests build.

Heavy modules (torch, transformers, the Trainer, data sources) are imported inside the functions, so a
bad config fails in the time it takes to read YAML.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

from vlmtrain.config import RunConfig
from vlmtrain.errors import ConfigError
from vlmtrain.memory import plan_checkpointing, plan_token_budget


def build(cfg: RunConfig, checkpoint: str | None = None) -> Any:
    """Build the data (cfg.data.source), the model and its processing (cfg.model.kind, initialized under
    cfg.train.seed) and a Trainer; with checkpoint, the model weights are loaded from that directory."""
    from vlmtrain.compat.trainer import Trainer
    from vlmtrain.config_objective import objective_trainer
    from vlmtrain.data.registry import get_source
    from vlmtrain.models.hub.local_paths import check_local_model
    from vlmtrain.models.kinds import get_kind
    from vlmtrain.models.objectives.parts import objective_parts
    from vlmtrain.models.speed.fused_elementwise import check_fuse_args
    from vlmtrain.models.speed.liger import check_liger_args

    if cfg.model.pretrained:  # a missing local directory names the key, not transformers' "Repo id must be"
        check_local_model(cfg.model.pretrained, "model.pretrained")
    cfg = plan_checkpointing(cfg)  # activation_checkpointing_kwargs mode: auto (the budget's plan needs the mode)
    cfg = plan_token_budget(cfg)  # data.pack_length: auto, or a budget that cannot fit: before any data or weights
    check_liger_args(cfg.train)  # (the speed settings alone: before any data or weights)
    check_fuse_args(cfg.train)
    kind = get_kind(cfg.model.kind)
    if kind.validate is not None:
        kind.validate(cfg)  # e.g. an unknown model_type fails before any data is built
    data = get_source(cfg.data.source).build(cfg)
    with _model_init(cfg, checkpoint) as sharded_build:
        parts = kind.build(cfg, data, checkpoint)
    parts = objective_parts(cfg, kind, parts)  # (dpo: the policy and its reference, the pair collator)
    if sharded_build:  # FSDP: only rank 0 built the weights; every rank gets its shard of them
        from vlmtrain.inference import default_device
        from vlmtrain.models.sharding import shard_from_rank0
        from vlmtrain.parallel import fsdp

        shard = functools.partial(fsdp.shard_model, bf16=cfg.train.bf16)
        parts["model"] = shard_from_rank0(parts["model"], shard, default_device())
    if cfg.data.pack_window and getattr(parts["data_collator"], "pack_length", None):
        _window_packing(cfg, parts)
    if checkpoint is not None:
        # (dpo: into the policy; the reference stays the model as configured)
        Trainer.parts.model_files.load_model_weights(parts.get("policy", parts["model"]), checkpoint)

    make_trainer = objective_trainer(cfg.train.objective)
    if make_trainer is not None:  # (grpo: vlmtrain.GRPOTrainer, its rollouts from the policy)
        return make_trainer(cfg, parts)
    # The kinds' and sources' metrics score generated answers (exact match). Without generation evaluation
    # keeps only the losses (and head outputs): never the B x L x vocab logits of the whole eval set.
    metrics = parts["compute_metrics"] if cfg.train.predict_with_generate else None
    if "policy" in parts:  # dpo: checkpoints hold the policy (and precomputed reference log-probs)
        from vlmtrain.compat.dpo_reference import PolicyTrainer as Trainer
    return Trainer(parts["model"], cfg.train, data_collator=parts["data_collator"],
                   train_dataset=parts["train_dataset"],
                   eval_dataset=parts["eval_dataset"] if cfg.data.num_eval > 0 else None,
                   processing_class=parts["tokenizer"], compute_metrics=metrics)


def _window_packing(cfg: RunConfig, parts: dict[str, Any]) -> None:
    """data.pack_window: train on rows packed from windows of consecutive samples (PackedDataset)."""
    from vlmtrain.data.pack_stream import PackedDataset, RowCollator
    from vlmtrain.data.sources import IndexedSource, StreamingDataset
    from vlmtrain.data.step_data import follows_step

    d, train = cfg.data, parts["train_dataset"]
    if follows_step(train):  # a stream has no sampler to give each sample its step
        raise ConfigError(f"data.pack_window streams the training samples, but {type(train).__name__} follows the "
                          "training step (a curriculum such as data.side_warmup_steps), which a stream cannot give it: "
                          "set data.pack_window: null, or turn the curriculum off.")
    if not isinstance(train, StreamingDataset):  # map-style: the same samples as a stream of shuffled blocks
        train = StreamingDataset([IndexedSource(train, name=d.source)], seed=d.seed)
    collator = parts["data_collator"]
    own_rows = getattr(collator, "collate_rows", None)  # a collator that lays packed rows out itself (hub_vlm)
    tokenizer = getattr(parts["tokenizer"], "tokenizer", parts["tokenizer"])  # (a processor's tokenizer)
    parts["train_dataset"] = PackedDataset(train, parts["process"], collator.pack_length, tokenizer.pad_token_id,
                                           window=d.pack_window, max_images_per_pack=d.max_images_per_pack,
                                           keep_items=own_rows is not None,
                                           max_patches_per_pack=d.max_patches_per_pack)
    parts["data_collator"] = RowCollator(parts["padded_collator"], collate=own_rows)


@contextlib.contextmanager
def _model_init(cfg: RunConfig, checkpoint: str | None) -> Iterator[bool]:
    """Yields whether the model is built for sharding from rank 0 (train.fsdp under torchrun): then ranks other
    than 0 build it on the meta device, structure without weights (see vlmtrain.models.meta)."""
    from vlmtrain.trainer import distributed

    sharded = bool(cfg.train.fsdp and checkpoint is None and distributed.init_from_env(cfg.train.ddp_timeout)
                   and distributed.world_size() > 1)
    from vlmtrain.models.meta import sharded_build

    if not sharded:
        yield False
        return
    with sharded_build(skeleton=distributed.rank() != 0):
        yield True
