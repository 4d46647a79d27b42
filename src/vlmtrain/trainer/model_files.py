"""Model weights in a checkpoint directory: what the trainer asks of a model's files, in the format of the layer
that knows the model.

That layer gives the Trainer its ``model_files`` part (parts.py): vlmtrain.Trainer's, models/files/model_files.py, writes
Hugging Face's layouts (what save_pretrained writes, a LoRA adapter in peft's layout, score heads beside their base,
an FSDP full fine-tune's DCP shards in `dcp/`). A part is an object with :class:`PlainModelFiles`' methods, which
take the same arguments, plus ``save_head_files(model, directory, tensors)`` where ``has_score_heads`` can be true.
The core's own is :class:`PlainModelFiles`: a model is a plain nn.Module, its state dict `model.safetensors`,
loaded back by key, never in parts.
"""

from __future__ import annotations

import os
from typing import Any

import safetensors.torch
import torch
from torch import nn

from ..errors import CheckpointError

__all__ = ["CheckpointError", "PlainModelFiles", "has_sharded_weights"]

DCP_DIR = "dcp"  # inside checkpoint-<step>/: the DCP shards and .metadata (the sharding plan's, sharding.py)
MODEL_NAME = "model.safetensors"


class PlainModelFiles:
    """A plain nn.Module's files, the core's ``model_files`` part: its state dict as model.safetensors (tied
    weights written once), loaded back by key."""

    @staticmethod
    def save_model_files(model: nn.Module, directory: str, processing_class: Any = None,
                         state_dict: dict[str, torch.Tensor] | None = None, max_shard_size: Any = None) -> None:
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, MODEL_NAME)
        if state_dict is None:
            safetensors.torch.save_model(model, path, metadata={"format": "pt"})
        else:
            unique = {t.data_ptr(): (k, t.contiguous()) for k, t in reversed(state_dict.items())}  # tied: first name
            safetensors.torch.save_file(dict(unique.values()), path, metadata={"format": "pt"})
        if processing_class is not None and hasattr(processing_class, "save_pretrained"):
            processing_class.save_pretrained(directory)

    @staticmethod
    def load_model_weights(model: nn.Module, directory: str) -> None:
        if PlainModelFiles.missing_weight_files(directory):
            raise CheckpointError(f"{directory!r} has no {MODEL_NAME}.")
        missing, unexpected = safetensors.torch.load_model(model, os.path.join(directory, MODEL_NAME), strict=False)
        if missing or unexpected:
            raise CheckpointError(f"Weights in {directory!r} do not fit {type(model).__name__}: missing "
                                  f"{sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}.")

    @staticmethod
    def missing_weight_files(directory: str) -> list[str]:
        return [] if PlainModelFiles.has_model_files(directory) else [MODEL_NAME]

    @staticmethod
    def has_model_files(directory: str) -> bool:
        return os.path.isfile(os.path.join(directory, MODEL_NAME)) or has_sharded_weights(directory)

    @staticmethod
    def has_score_heads(model: nn.Module) -> bool:
        return False

    @staticmethod
    def saves_trainable_only(model: nn.Module) -> bool:
        return False


def has_sharded_weights(directory: str) -> bool:
    """True when directory holds DCP shards (an FSDP full fine-tune's checkpoint)."""
    return os.path.isfile(os.path.join(directory, DCP_DIR, ".metadata"))
