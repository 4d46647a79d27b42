"""The DPO reference's log-probs computed once (``precompute_ref_log_probs``) and how a DPO checkpoint holds its
state: the model files are the policy's alone (:class:`PolicyFiles`), the precomputed log-probs ``ref_logps.pt``
beside them, so that a resumed run reads them instead of running the reference again. :class:`PolicyTrainer`
does both for vlmtrain.DPOTrainer and for a YAML config's `train.objective: dpo` alike."""

from __future__ import annotations

import dataclasses
import logging
import os
from collections import Counter
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader
from torch.utils.data import IterableDataset as TorchIterableDataset
from tqdm.auto import tqdm

from ..data.preference import REF_LOGPS_COLUMNS
from ..data.processing import SkipSample
from ..errors import ConfigError
from ..models.objectives.dpo import DPOObjective
from ..models.objectives.grpo import GRPOObjective
from ..models.objectives.reward import RewardObjective
from ..trainer import checkpoint as ckpt
from ..trainer.sharding import sharding_of
from .trainer import Trainer

logger = logging.getLogger(__name__)

REF_LOGPS_FILE = "ref_logps.pt"  # in checkpoint-<step>/: {dataset name: {"chosen": tensor, "rejected": tensor}}


def refuse_unindexable(dataset: Any, name: str) -> None:
    """precompute_ref_log_probs stores a value per pair: a stream has no pairs to attach them to."""
    datasets = dataset.values() if isinstance(dataset, Mapping) else [dataset]
    for ds in datasets:
        if ds is not None and (isinstance(ds, TorchIterableDataset) or not hasattr(ds, "__len__")
                               or not hasattr(ds, "__getitem__")):
            raise ConfigError(f"precompute_ref_log_probs=True is not supported with an IterableDataset "
                              f"({name}: {type(ds).__name__}): pass a map-style Dataset (or a list) or set "
                              "precompute_ref_log_probs=False.")


def has_ref_logps(dataset: Any) -> bool:
    if hasattr(dataset, "column_names"):
        return all(c in dataset.column_names for c in REF_LOGPS_COLUMNS)
    return len(dataset) > 0 and all(c in dataset[0] for c in REF_LOGPS_COLUMNS)


def compute_ref_logps(objective: DPOObjective, dataset: Any, collator: Any, batch_size: int, name: str,
                      disable_bar: bool) -> dict[str, torch.Tensor]:
    """The reference's summed answer log-probs of every pair of ``dataset`` (in order), in one pass with a
    progress bar; the policy in evaluation mode meanwhile (no dropout in a reference). Through the objective's
    forward, so that FSDP gathers its root unit as in a step; every rank runs the whole pass (the collectives
    match)."""
    loader = DataLoader(dataset, batch_size=batch_size, collate_fn=collator, shuffle=False)
    device, was_training = next(objective.parameters()).device, objective.training
    objective.eval()
    chosen, rejected = [], []
    try:
        for batch in tqdm(loader, desc=f"Computing reference log probs for {name} dataset", disable=disable_bar):
            batch = {k: v.to(device) for k, v in batch.items()  # (not a pair collator's skip counts)
                     if isinstance(v, torch.Tensor) and k not in REF_LOGPS_COLUMNS}
            c, r = objective(**batch, reference_only=True)["reference_logps"].float().cpu().chunk(2)
            chosen.append(c)
            rejected.append(r)
    finally:
        objective.train(was_training)
    return {"chosen": torch.cat(chosen), "rejected": torch.cat(rejected)}


def with_ref_logps(dataset: Any, logps: Mapping[str, torch.Tensor]) -> Any:
    """``dataset`` with the columns ``ref_chosen_logps`` / ``ref_rejected_logps`` (TRL's names)."""
    columns = dict(zip(REF_LOGPS_COLUMNS, (logps["chosen"].tolist(), logps["rejected"].tolist()), strict=True))
    if len(columns["ref_chosen_logps"]) != len(dataset):
        raise ConfigError(f"{len(columns['ref_chosen_logps'])} precomputed reference log-probs for "
                          f"{len(dataset)} pairs.")
    if hasattr(dataset, "add_column"):  # a datasets.Dataset
        for key, values in columns.items():
            dataset = dataset.remove_columns(key) if key in dataset.column_names else dataset
            dataset = dataset.add_column(key, values)
        return dataset
    return [{**s, **{k: v[i] for k, v in columns.items()}} for i, s in enumerate(dataset)]


def saved_ref_logps(checkpoint: str | None) -> dict[str, dict[str, torch.Tensor]]:
    """The precomputed log-probs a checkpoint holds ({} for none)."""
    path = os.path.join(checkpoint, REF_LOGPS_FILE) if checkpoint else None
    return torch.load(path, map_location="cpu", weights_only=True) if path and os.path.isfile(path) else {}


class PolicyFiles:
    """A Trainer's ``model_files`` part (trainer/model_files.py) for an objective around the model it trains
    (DPO's policy, RewardTrainer's reward model): the methods that take the model take that model, so checkpoints
    hold it in its own layout (full weights or a LoRA adapter) and resume loads it back there; DPO's reference is
    never written. The rest is ``files``'."""

    def __init__(self, files: Any) -> None:
        self.files = files

    def __getattr__(self, name: str) -> Any:
        return getattr(self.files, name)

    def save_model_files(self, model: nn.Module, *args: Any, **kwargs: Any) -> None:
        self.files.save_model_files(_policy(model), *args, **kwargs)

    def save_head_files(self, model: nn.Module, *args: Any, **kwargs: Any) -> None:
        self.files.save_head_files(_policy(model), *args, **kwargs)

    def load_model_weights(self, model: nn.Module, directory: str) -> None:
        self.files.load_model_weights(_policy(model), directory)

    def has_score_heads(self, model: nn.Module) -> bool:
        return self.files.has_score_heads(_policy(model))

    def saves_trainable_only(self, model: nn.Module) -> bool:
        return self.files.saves_trainable_only(_policy(model))


class PolicySharding:
    """A Trainer's ``sharding`` part (trainer/sharding.py) for an objective around the model it trains, under
    train.fsdp: the objective is sharded whole (DPO's frozen reference a unit of its own), but checkpoints are
    the trained model's alone, as :class:`PolicyFiles` makes them without FSDP: its DCP shards and config (a full
    fine-tune: `vlmtrain export` writes them as one model.safetensors) or its gathered adapter (LoRA), never the
    reference; resume reads them back into it."""

    def __init__(self, plan: Any) -> None:
        self.plan = plan

    def __getattr__(self, name: str) -> Any:  # (is_sharded, shard_model, reshard: the whole objective)
        return getattr(self.plan, name)

    def save_checkpoint(self, model: nn.Module, *args: Any, **kwargs: Any) -> str:
        return self.plan.save_checkpoint(_policy(model), *args, **kwargs)

    def load_sharded(self, model: nn.Module, *args: Any, **kwargs: Any) -> None:
        self.plan.load_sharded(_policy(model), *args, **kwargs)

    def load_model_state(self, model: nn.Module, *args: Any, **kwargs: Any) -> None:
        self.plan.load_model_state(_policy(model), *args, **kwargs)

    def load_optimizer_state(self, model: nn.Module, *args: Any, **kwargs: Any) -> None:
        self.plan.load_optimizer_state(_policy(model), *args, **kwargs)

    def save_full_model(self, model: nn.Module, *args: Any, **kwargs: Any) -> None:
        self.plan.save_full_model(_policy(model), *args, **kwargs)


def _policy(model: nn.Module) -> nn.Module:
    if isinstance(model, RewardObjective):
        return model.model
    return model.policy if isinstance(model, DPOObjective | GRPOObjective) else model


class PolicyObjectiveTrainer(Trainer):
    """A Trainer whose model is an objective around a policy (DPO's, GRPO's): checkpoints hold the policy alone
    (:class:`PolicyFiles`, sharded by :class:`PolicySharding` under FSDP)."""

    parts = dataclasses.replace(Trainer.parts, model_files=PolicyFiles(Trainer.parts.model_files),
                                sharding=PolicySharding(Trainer.parts.sharding))

    @property
    def policy(self) -> nn.Module:
        """The model trained (the objective's policy)."""
        return self.model.policy

    @property
    def ref_model(self) -> nn.Module | None:
        """The frozen reference (None where the policy's adapters switched off give it, where none is needed, or
        where the policy itself gave the precomputed log-probs before training)."""
        return self.model.ref_model


class PolicyTrainer(PolicyObjectiveTrainer):
    """A Trainer of a :class:`DPOObjective`: the policy alone in checkpoints and, with
    ``args.precompute_ref_log_probs``, the reference's log-probs of the train and eval pairs, computed once when
    ``train()`` starts (or read from the checkpoint it resumes) and given to the objective as the pairs'
    ``ref_chosen_logps`` / ``ref_rejected_logps``. vlmtrain.DPOTrainer's base, and the Trainer of a YAML config's
    `train.objective: dpo`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._ref_logps: dict[str, dict] = {}  # precompute_ref_log_probs: per dataset name, saved in checkpoints
        super().__init__(*args, **kwargs)

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> Any:
        """Trainer.train. A resumed run is built as the first was (``model`` the original model: the reference
        is rebuilt from it) and takes the policy, optimizer, scheduler, RNG and data position from the checkpoint;
        with precompute_ref_log_probs the reference's log-probs come from the checkpoint too, else from one pass
        here, before the policy trains."""
        if self.args.precompute_ref_log_probs:
            requested = self.args.resume_from_checkpoint if resume_from_checkpoint is None else resume_from_checkpoint
            self._precompute(self._checkpoint_path(requested))
        return super().train(resume_from_checkpoint, *args, **kwargs)

    def evaluate(self, eval_dataset: Any = None, ignore_keys: list[str] | None = None,
                 metric_key_prefix: str = "eval") -> dict[str, float]:
        """Trainer.evaluate; with precompute_ref_log_probs the eval pairs get the reference's log-probs first."""
        if self.args.precompute_ref_log_probs and eval_dataset is None:
            self._precompute(None, splits=("eval",))
        return super().evaluate(eval_dataset, ignore_keys, metric_key_prefix)

    def _checkpoint_path(self, resume: str | bool | None) -> str | None:
        if not ckpt.resume_requested(resume):
            return None
        if resume is True or str(resume).lower() in ("true", "latest"):
            return ckpt.latest_checkpoint(self.args.output_dir)
        return str(resume)

    def _precompute(self, checkpoint: str | None, splits: tuple[str, ...] = ("train", "eval")) -> None:
        """The reference's log-probs of the train and eval pairs: from ``checkpoint`` where it holds them, else
        computed (once: a second train() reuses them)."""
        saved = saved_ref_logps(checkpoint)
        if "train" in splits:
            self.train_dataset = self._with_ref_logps(self.train_dataset, "train", saved=saved)
        if "eval" in splits and isinstance(self.eval_dataset, Mapping):
            self.eval_dataset = {name: self._with_ref_logps(ds, f"eval_{name}", saved=saved)
                                 for name, ds in self.eval_dataset.items()}
        elif "eval" in splits and self.eval_dataset is not None:
            self.eval_dataset = self._with_ref_logps(self.eval_dataset, "eval", saved=saved)

    def _with_ref_logps(self, dataset: Any, name: str, saved: Mapping[str, dict] | None = None,
                        store: bool = True) -> Any:
        if has_ref_logps(dataset):
            return dataset
        dataset = self._trainable_pairs(dataset, name)
        logps = (saved or {}).get(name)
        if logps is None or len(logps["chosen"]) != len(dataset):
            if (self.state.global_step > 0 and self.model.ref_model is None
                    and not hasattr(self.policy, "disable_adapter")):
                raise ConfigError(f"precompute_ref_log_probs: the {name} pairs have no reference log-probs and the "
                                  "policy, their reference before training, has trained: pass this dataset as "
                                  "eval_dataset when building the trainer, pass ref_model, or set "
                                  "precompute_ref_log_probs=False.")
            train = name == "train"
            size = self.args.precompute_ref_batch_size or (self.args.per_device_train_batch_size if train
                                                           else self.args.per_device_eval_batch_size)
            logps = compute_ref_logps(self.model, dataset, self.data_collator, size, name,
                                      disable_bar=self.args.disable_tqdm or self.rank != 0)
            plan = sharding_of(self.model, self.parts.sharding)
            if plan is not None:  # (FSDP keeps the root unit gathered after a forward: before the optimizer sees it)
                plan.reshard(self.model)
        if store:
            self._ref_logps[name] = logps
        return with_ref_logps(dataset, logps)

    def _trainable_pairs(self, dataset: Any, name: str) -> Any:
        """Raw pairs (processed per batch by their collator: a YAML run's, or pairs with images) that the
        collator would skip are left out first (its ``check``), counted in one warning, so that each pair kept
        gets its own reference log-probs and every batch holds only pairs that train. A ``datasets.Dataset``
        stays one (its images are not kept decoded)."""
        check = getattr(self.data_collator, "check", None)
        if check is None:
            return dataset
        kept, skipped = [], Counter[str]()
        for i, sample in enumerate(dataset):
            try:
                check(sample)
                kept.append(i)
            except SkipSample as err:
                skipped[err.reason] += 1
        if not skipped:
            return dataset
        logger.warning("DPO: %d of %d %s pairs skipped: %s", sum(skipped.values()), len(dataset), name,
                       dict(skipped))
        return dataset.select(kept) if hasattr(dataset, "select") else [dataset[i] for i in kept]

    def _checkpoint_files(self, sharded: bool) -> dict[str, Any]:
        files = super()._checkpoint_files(sharded)
        if self.rank == 0 and self._ref_logps:  # resume reads them instead of running the reference again
            files[REF_LOGPS_FILE] = self._ref_logps
        return files
