"""Model weights in a checkpoint directory: what the trainer asks of a model's files, in the format of the layer
that knows the model.

That layer fills the ``model_files`` slot (trainer/plugins.py) when ``vlmtrain`` is imported: models/model_files.py
writes Hugging Face's layouts (what save_pretrained writes, a LoRA adapter in peft's layout, score heads beside
their base, an FSDP full fine-tune's DCP shards in `dcp/`). The slot holds a class, made with the
``checkpoint_parts`` slot's kinds of parts (objects for models that save in parts: the protocol is in
models/model_files.py) and the ``read_sharded_weights`` slot's reader of DCP shards; its objects have the functions
below by name, which take the same arguments. With the slot empty a model is a plain nn.Module
(:class:`PlainModelFiles`): its state dict as `model.safetensors`, loaded back by key, never in parts.
"""

from __future__ import annotations

import os
from typing import Any

import safetensors.torch
import torch
from torch import nn

from ..errors import CheckpointError
from . import plugins

__all__ = ["CheckpointError", "has_model_files", "has_score_heads", "has_sharded_weights", "load_model_weights",
           "missing_weight_files", "save_head_files", "save_model_files", "saves_trainable_only"]

DCP_DIR = "dcp"  # inside checkpoint-<step>/: the DCP shards and .metadata (the sharding plan's, sharding.py)
MODEL_NAME = "model.safetensors"


class PlainModelFiles:
    """A plain nn.Module's files when no layer registered a format: its state dict as model.safetensors (tied
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


def _format() -> Any:
    """The registered format, made with the registered parts and DCP reader (see the module docstring)."""
    make = plugins.lookup("model_files")
    if make is None:
        return PlainModelFiles
    return make(plugins.lookup("checkpoint_parts", ()), plugins.lookup("read_sharded_weights"))


def has_sharded_weights(directory: str) -> bool:
    """True when directory holds DCP shards (an FSDP full fine-tune's checkpoint)."""
    return os.path.isfile(os.path.join(directory, DCP_DIR, ".metadata"))


def save_model_files(model: nn.Module, directory: str, processing_class: Any = None,
                     state_dict: dict[str, torch.Tensor] | None = None, max_shard_size: int | str | None = None
                     ) -> None:
    """The model's files and the tokenizer/processor files into directory; `state_dict` instead of the model's
    own (e.g. gathered FSDP shards, keyed as the whole model names them); `max_shard_size` (e.g. "2GB") splits
    full weights into shards with an index."""
    _format().save_model_files(model, directory, processing_class, state_dict, max_shard_size)


def load_model_weights(model: nn.Module, directory: str) -> None:
    """Load a checkpoint's model files (in any layout the format writes) into model, in place."""
    _format().load_model_weights(model, directory)


def missing_weight_files(directory: str) -> list[str]:
    """The model files a checkpoint lacks (none for DCP shards, whose files checkpoint.check_complete checks)."""
    return _format().missing_weight_files(directory)


def has_model_files(directory: str) -> bool:
    """True when directory holds a model in any layout the format writes, or DCP shards."""
    return _format().has_model_files(directory)


def has_score_heads(model: nn.Module) -> bool:
    """True for a model that saves in parts around a base (score heads: `.base` and `.heads`)."""
    return _format().has_score_heads(model)


def saves_trainable_only(model: nn.Module) -> bool:
    """True when the model's files hold only what trains (LoRA adapters, modules_to_save, heads), never its
    frozen base: then FSDP gathers just those (parallel/fsdp.py's gather_trainable)."""
    return _format().saves_trainable_only(model)


def save_head_files(model: nn.Module, directory: str, tensors: dict[str, torch.Tensor]) -> None:
    """The files of a parted model's other parts (score heads: heads.safetensors + heads.json); `tensors`: their
    weights keyed without the parts' prefix, e.g. gathered from FSDP shards. Only for a model with
    has_score_heads."""
    _format().save_head_files(model, directory, tensors)
