"""Score heads' files next to a model's: `heads.safetensors` (weights) + `heads.json` (hidden size and head
configs). Every vlmtrain checkpoint of a model with heads holds them, and so does a `vlmtrain export` folder:
:func:`attach_heads` puts them on a model loaded with transformers alone. :class:`HeadFiles` is the heads' side
of the checkpoint-parts protocol (model_files.py): model_files.py writes the base model, the
heads' files are written, checked and loaded here."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping

import safetensors.torch
import torch
from torch import nn

from ...errors import CheckpointError, ConfigError
from ..objectives.heads import HeadConfig, WithHeads, parse_heads

__all__ = ["HEADS_CONFIG", "HEADS_WEIGHTS", "HEAD_PARTS", "HeadFiles", "attach_heads", "check_saved_heads", "load_heads",
           "read_head_configs", "save_heads"]

HEADS_WEIGHTS = "heads.safetensors"
HEADS_CONFIG = "heads.json"


def _heads_of(model: nn.Module) -> WithHeads:
    model = getattr(model, "module", model)  # DDP
    model = getattr(model, "_orig_mod", model)  # torch.compile
    if not isinstance(model, WithHeads):
        raise TypeError(f"expected a WithHeads model, got {type(model).__name__}")
    return model


def save_heads(model: nn.Module, directory: str, tensors: Mapping[str, torch.Tensor] | None = None) -> None:
    """Write the heads' weights (`heads.safetensors`) and configs (`heads.json`) into `directory`, next to the
    base model's own files. `tensors`: the weights to write instead of the model's own (keys as
    ``model.heads.layers.state_dict()``'s, e.g. gathered from FSDP shards)."""
    model = _heads_of(model)
    os.makedirs(directory, exist_ok=True)
    if tensors is None:
        tensors = model.heads.layers.state_dict()
    tensors = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
    safetensors.torch.save_file(tensors, os.path.join(directory, HEADS_WEIGHTS), metadata={"format": "pt"})
    meta = {"hidden_size": model.hidden_size,
            "heads": {name: dataclasses.asdict(c) for name, c in model.head_configs.items()}}
    with open(os.path.join(directory, HEADS_CONFIG), "w", encoding="utf-8") as f:
        json.dump(meta, f, indent=2)
        f.write("\n")


def read_head_configs(directory: str) -> dict[str, HeadConfig]:
    """The head configs saved in `directory` (by :func:`save_heads`), e.g. to build WithHeads before loading."""
    path = os.path.join(directory, HEADS_CONFIG)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no {HEADS_CONFIG} (this checkpoint has no score heads)")
    with open(path, encoding="utf-8") as f:
        return parse_heads(json.load(f)["heads"])


def load_heads(model: nn.Module, directory: str) -> None:
    """Load the heads' weights saved by :func:`save_heads`; the saved heads must match the model's."""
    model = _heads_of(model)
    saved = read_head_configs(directory)
    if saved != model.head_configs:
        raise ValueError(f"{os.path.join(directory, HEADS_CONFIG)}: saved heads {saved} differ from the model's "
                         f"{model.head_configs}")
    state = safetensors.torch.load_file(os.path.join(directory, HEADS_WEIGHTS))
    model.heads.layers.load_state_dict(state, strict=True)


def check_saved_heads(model: nn.Module, directory: str) -> None:
    """Raise ConfigError unless the heads saved in `directory` fit `model` (a WithHeads): heads.json's
    hidden_size must be the base model's, and every tensor of heads.safetensors must have the shape its head
    config gives (a checkpoint from a different model or head set names the file and what was expected)."""
    model = _heads_of(model)
    config_path, weights_path = os.path.join(directory, HEADS_CONFIG), os.path.join(directory, HEADS_WEIGHTS)
    with open(config_path, encoding="utf-8") as f:
        saved_hidden = json.load(f).get("hidden_size")
    if saved_hidden is not None and saved_hidden != model.hidden_size:
        raise ConfigError(f"{config_path}: heads for hidden_size {saved_hidden}, but the model's hidden size is "
                          f"{model.hidden_size} (heads trained on a different model).")
    if not os.path.isfile(weights_path):
        raise ConfigError(f"{weights_path} is missing ({config_path} says there are heads {sorted(model.head_configs)}).")
    expected = {k: tuple(v.shape) for k, v in model.heads.layers.state_dict().items()}
    with safetensors.safe_open(weights_path, framework="pt") as f:
        saved = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)
    if saved != expected:
        raise ConfigError(f"{weights_path} holds {saved}; {config_path} and the model expect {expected}.")


def attach_heads(model: nn.Module, directory: str) -> WithHeads:
    """The score heads saved in `directory` (heads.json + heads.safetensors, as every vlmtrain checkpoint and
    `vlmtrain export --merge` folder holds them) put on `model`: returns ``WithHeads(model, heads)`` with the
    saved weights, on the model's device (heads float32), in the model's train/eval mode.

    After ``vlmtrain export --merge``::

        model = AutoModelForImageTextToText.from_pretrained(out_dir)
        scorer = vlmtrain.attach_heads(model, out_dir)
        out = scorer(**batch)   # out["logits_<head>"]: [batch, num_outputs], read on each row's last
                                # attention-mask-1 token (see WithHeads; batch from the processor, no labels)

    A head set or model that does not fit (hidden size, shapes) is a ConfigError naming the file."""
    wrapped = WithHeads(model, read_head_configs(directory))
    check_saved_heads(wrapped, directory)
    load_heads(wrapped, directory)
    params = next(model.parameters(), None)
    if params is not None:
        wrapped.heads.to(params.device)
    return wrapped.train(model.training)



class HeadFiles:
    """The score heads' side of the checkpoint-parts protocol (model_files.py; ``import
    vlmtrain`` writes with :data:`HEAD_PARTS` among model_files.PART_KINDS): a WithHeads model's base is saved
    in model_files.py's layouts, its heads in heads.safetensors + heads.json, which the methods below write, check
    and load."""

    replaces_base = False
    base_prefix = "base."
    parts_prefix = "heads.layers."
    part_files = (HEADS_CONFIG, HEADS_WEIGHTS)

    @staticmethod
    def owns(model: nn.Module) -> bool:
        """True for a model wrapped with score heads (`.base` and `.heads`)."""
        return isinstance(getattr(model, "base", None), nn.Module) and isinstance(getattr(model, "heads", None),
                                                                                   nn.Module)

    @staticmethod
    def base(model: nn.Module) -> nn.Module:
        """The module saved as the model: the base (or the peft model around it)."""
        return model.base

    @staticmethod
    def save(model: nn.Module, directory: str, tensors: Mapping[str, torch.Tensor] | None = None) -> None:
        """heads.safetensors + heads.json (`tensors`: the heads' weights keyed without parts_prefix)."""
        save_heads(model, directory, tensors)

    @staticmethod
    def check(model: nn.Module, directory: str) -> None:
        """The checkpoint's heads (heads.json) are the model's, and their weights are there."""
        if not os.path.isfile(os.path.join(directory, HEADS_WEIGHTS)):
            raise CheckpointError(f"{directory!r} has no {HEADS_WEIGHTS}, but {type(model).__name__} has score "
                                  f"heads ({sorted(model.head_configs)}).")
        try:
            saved = read_head_configs(directory)
        except FileNotFoundError as e:
            raise CheckpointError(str(e)) from None
        if saved != model.head_configs:
            raise CheckpointError(f"{os.path.join(directory, HEADS_CONFIG)}: the checkpoint's heads {saved} differ "
                                  f"from the model's {model.head_configs} (same model.heads as the run that wrote "
                                  f"it?).")

    @staticmethod
    def load(model: nn.Module, directory: str) -> None:
        """The heads' weights (heads.safetensors)."""
        load_heads(model, directory)


HEAD_PARTS = HeadFiles()
