"""The DPOTrainer's reference log-probs computed once (``precompute_ref_log_probs``) and how a DPO checkpoint
holds its state: the model files are the policy's alone (:class:`PolicyFiles`), the precomputed log-probs
``ref_logps.pt`` beside them, so that a resumed run reads them instead of running the reference again."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader
from torch.utils.data import IterableDataset as TorchIterableDataset
from tqdm.auto import tqdm

from ..data.preference import REF_LOGPS_COLUMNS
from ..errors import ConfigError
from ..models.objectives.dpo import DPOObjective

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
    progress bar; the policy in evaluation mode meanwhile (no dropout in a reference)."""
    loader = DataLoader(dataset, batch_size=batch_size, collate_fn=collator, shuffle=False)
    device, was_training = next(objective.parameters()).device, objective.training
    objective.eval()
    chosen, rejected = [], []
    try:
        for batch in tqdm(loader, desc=f"Computing reference log probs for {name} dataset", disable=disable_bar):
            batch = {k: v.to(device) for k, v in batch.items() if k not in REF_LOGPS_COLUMNS}
            c, r = objective.reference_logps(**batch).float().cpu().chunk(2)
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
    """A Trainer's ``model_files`` part (trainer/model_files.py) for the DPO objective: the methods that take the
    model take the objective's policy, so checkpoints hold the policy in its own layout (full weights or a LoRA
    adapter) and resume loads it back there; the reference is never written. The rest is ``files``'."""

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


def _policy(model: nn.Module) -> nn.Module:
    return model.policy if isinstance(model, DPOObjective) else model
