"""The Hugging Face layouts of a model's weights in a checkpoint directory: what is written, what counts as
complete, how it is loaded back. :data:`MODEL_FILES` is vlmtrain.Trainer's ``model_files`` part (trainer/parts.py; the
methods trainer/model_files.py names) and the format every reader of vlmtrain's checkpoints uses.

A model's full weights are `model.safetensors`, or shards listed in `model.safetensors.index.json` (+
`config.json`), what `save_pretrained` writes; transformers models are loaded back through their own
`from_pretrained` (which renames legacy keys some families write), other models by state-dict key. A model that
saves in parts is written through the checkpoint-parts protocol below, whose implementations live beside this file:
  - a LoRA adapter (lora_files.py) stands in for the frozen base's weights: `adapter_model.safetensors` +
    `adapter_config.json` in peft's layout, and `trainable.safetensors`; the frozen base is not written;
  - score heads (head_files.py) wrap a base written as above (full weights or an adapter):
    `heads.safetensors` + `heads.json` next to it.
Each layout loads with transformers / peft alone. Under FSDP a LoRA model is written in the same layout (its
trainable parameters gathered to rank 0); a full fine-tune keeps its weights in DCP shards (`dcp/`, keys as the
whole model names them; sharded_files.py reads them in one process) with the parts' files and the config beside
them.

Checkpoint-parts protocol: :class:`HubModelFiles` is made with one object per kind of part (:data:`PART_KINDS`,
the default), each with
  - ``owns(model)``: whether ``model`` saves in these parts;
  - ``part_files``: (config file, weights file): a checkpoint with the config lacks nothing only with the
    weights too;
  - ``save(model, directory, tensors=None)``: write the parts' files (``tensors``: their weights, e.g. gathered
    from FSDP shards; None: the model's own); ``load(model, directory)``: load them;
  - ``check(model, directory)``: raise CheckpointError unless the directory's parts fit the model (called before
    any weight is read);
  - ``replaces_base`` (True for an adapter: its files stand in for the model's own, and ``check`` is called for
    every model), else a wrapper around a base model, with ``base(model)`` (the module written as the model) and
    ``base_prefix`` / ``parts_prefix`` (where the base's and the parts' weights sit in the whole model's state
    dict: ``"base."`` / ``"heads.layers."``; ``tensors`` are keyed without ``parts_prefix``).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Iterator
from typing import Any

import safetensors.torch
import torch
from torch import nn

from ...errors import CheckpointError
from .head_files import HEAD_PARTS
from .lora_files import ADAPTER_PARTS
from .sharded_files import DCP_DIR, has_sharded_weights, read_model_weights

MODEL_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
PART_KINDS = (ADAPTER_PARTS, HEAD_PARTS)  # the kinds of parts a model may save in (the protocol above)


def _is_transformers_model(model: nn.Module) -> bool:
    return type(model).__module__.startswith("transformers.") and hasattr(model, "from_pretrained")


@contextlib.contextmanager
def _no_hf_bars() -> Iterator[None]:
    """transformers' per-shard progress bars would break the training progress bar."""
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if bars:
            hf_logging.enable_progress_bar()


def _strip(state: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """The entries of ``state`` under ``prefix``, keyed without it."""
    return {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}


class HubModelFiles:
    """The trainer's model-files format (trainer/model_files.py) for Hugging Face models, peft adapters, score
    heads and plain modules alike, made with the kinds of parts a model may save in and the reader of DCP
    shards."""

    def __init__(self, part_kinds: tuple[Any, ...] = PART_KINDS,
                 read_sharded: Callable[[str], dict[str, torch.Tensor]] | None = read_model_weights) -> None:
        self.part_kinds, self.read_sharded = tuple(part_kinds), read_sharded

    def _part_kinds(self, replacing: bool = False) -> list[Any]:
        """The kinds of parts (the protocol above) that wrap a base model, or with ``replacing`` those whose files
        stand in for the base's (an adapter)."""
        return [p for p in self.part_kinds if getattr(p, "replaces_base", False) == replacing]

    def _parts(self, model: nn.Module) -> tuple[nn.Module, Any]:
        """(the module saved in the model layouts, the parts' protocol object if the model saves in parts, else
        None)."""
        parts = next((p for p in self._part_kinds() if p.owns(model)), None)
        return (model if parts is None else parts.base(model)), parts

    def _adapter(self, base: nn.Module) -> Any:
        """The parts whose files stand in for ``base``'s own (its LoRA adapter), or None."""
        return next((p for p in self._part_kinds(replacing=True) if p.owns(base)), None)

    def has_score_heads(self, model: nn.Module) -> bool:
        """True for a model that saves in parts (score heads: `.base` and `.heads`; see the module docstring)."""
        return self._parts(model)[1] is not None

    def saves_trainable_only(self, model: nn.Module) -> bool:
        """True when the model's files hold only what trains (LoRA adapters, modules_to_save, heads), never its
        frozen base: then FSDP gathers just those (the sharding plan's gather_trainable)."""
        return self._adapter(self._parts(model)[0]) is not None

    def missing_weight_files(self, directory: str) -> list[str]:
        """The model files a checkpoint lacks: none for full weights (single file or every shard of the index),
        an adapter, or DCP shards (whose files the trainer's check_complete checks); a part's weights file
        (heads.safetensors) when its config file (heads.json) says there are such parts."""
        def there(name: str) -> bool:
            return os.path.isfile(os.path.join(directory, name))

        adapters = [p.part_files for p in self._part_kinds(replacing=True) if there(p.part_files[0])]
        if adapters:
            missing = [] if there(adapters[0][1]) else [adapters[0][1]]
        elif there(INDEX_NAME):
            with open(os.path.join(directory, INDEX_NAME)) as f:
                shards = sorted(set(json.load(f).get("weight_map", {}).values()))
            missing = [s for s in shards if not there(s)] if shards else [f"the shards {INDEX_NAME} lists"]
        elif there(MODEL_NAME) or os.path.isdir(os.path.join(directory, DCP_DIR)):  # dcp/: check_complete's
            missing = []
        else:
            missing = [MODEL_NAME]
        for parts in self._part_kinds():
            config, weights = parts.part_files
            if there(config) and not there(weights):
                missing.append(weights)
        return missing

    def has_model_files(self, directory: str) -> bool:
        """True when directory holds a model in any layout (full, sharded, adapter, DCP)."""
        names = (MODEL_NAME, INDEX_NAME, *(p.part_files[0] for p in self._part_kinds(replacing=True)))
        there = [n for n in names if os.path.isfile(os.path.join(directory, n))]
        return bool(there) or has_sharded_weights(directory)

    # -- writing --------------------------------------------------------------------------------------------
    def save_model_files(self, model: nn.Module, directory: str, processing_class: Any = None,
                         state_dict: dict[str, torch.Tensor] | None = None, max_shard_size: int | str | None = None
                         ) -> None:
        """The model's files (see the module docstring) and the tokenizer/processor files into directory;
        `state_dict` instead of the model's own (e.g. gathered FSDP shards); `max_shard_size` (e.g. "2GB") splits
        full weights into shards with an index."""
        os.makedirs(directory, exist_ok=True)
        base, parts = self._parts(model)
        part_state = None
        if parts is not None and state_dict is not None:
            part_state = _strip(state_dict, parts.parts_prefix)
            state_dict = _strip(state_dict, parts.base_prefix)
        self._save_base(base, directory, state_dict, max_shard_size)
        if parts is not None:
            parts.save(model, directory, part_state)
        if processing_class is not None and hasattr(processing_class, "save_pretrained"):
            processing_class.save_pretrained(directory)

    def _save_base(self, base: nn.Module, directory: str, state_dict: dict[str, torch.Tensor] | None,
                   max_shard_size: int | str | None) -> None:
        """The base model's files: its adapter's, what save_pretrained writes, or model.safetensors."""
        adapter = self._adapter(base)
        if adapter is not None:
            adapter.save(base, directory, state_dict)
        elif hasattr(base, "save_pretrained"):
            kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
            with _no_hf_bars():
                base.save_pretrained(directory, state_dict=state_dict, **kwargs)
        elif state_dict is not None:
            seen, unique = set(), {}
            for key, value in state_dict.items():  # tied weights are one tensor: keep its first name
                if value.data_ptr() not in seen:
                    seen.add(value.data_ptr())
                    unique[key] = value.contiguous()
            safetensors.torch.save_file(unique, os.path.join(directory, MODEL_NAME), metadata={"format": "pt"})
        else:
            safetensors.torch.save_model(base, os.path.join(directory, MODEL_NAME), metadata={"format": "pt"})

    def save_head_files(self, model: nn.Module, directory: str, tensors: dict[str, torch.Tensor]) -> None:
        """The files of a parted model's other parts (score heads: heads.safetensors + heads.json); `tensors`: their
        weights keyed without the parts' prefix, e.g. gathered from FSDP shards."""
        self._parts(model)[1].save(model, directory, tensors)

    # -- reading --------------------------------------------------------------------------------------------
    def load_model_weights(self, model: nn.Module, directory: str) -> None:
        """Load a checkpoint's model files (any layout of the module docstring) into model, in place."""
        base, parts = self._parts(model)
        for kind in self._part_kinds(replacing=True):  # an adapter in the checkpoint exactly when the model carries one
            kind.check(base, directory)
        if parts is not None:  # first: a checkpoint of other parts (another head set) fails before any weight is read
            parts.check(model, directory)
        adapter = self._adapter(base)
        if adapter is not None:
            adapter.load(base, directory)
        elif _is_transformers_model(base) and not has_sharded_weights(directory):
            self._load_pretrained(base, directory)
        else:
            self._load_by_key(base, directory, None if parts is None else parts.base_prefix)
        if parts is not None:
            parts.load(model, directory)

    def _load_pretrained(self, base: nn.Module, directory: str) -> None:
        """Through the class's own from_pretrained (its key renaming included), then copied into base."""
        if self.missing_weight_files(directory):
            raise CheckpointError(f"{directory!r} has no model weights ({MODEL_NAME} or {INDEX_NAME}).")
        dtype = next(base.parameters()).dtype
        with _no_hf_bars():
            loaded, info = type(base).from_pretrained(directory, config=base.config, dtype=dtype,
                                                      output_loading_info=True)
        bad = {k: sorted(info.get(k) or [])[:5] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
        if any(bad.values()):
            raise CheckpointError(f"Weights in {directory!r} do not fit {type(base).__name__}: " +
                                  ", ".join(f"{k.split('_')[0]} {v}" for k, v in bad.items()) + ".")
        base.load_state_dict(loaded.state_dict())

    def _read_full(self, directory: str, base_prefix: str | None = None) -> dict[str, torch.Tensor]:
        """The full weights of a checkpoint, keyed as the base model names them (`base_prefix`: the model saves in
        parts, and an FSDP checkpoint's shards hold the base's weights under this prefix, beside the other parts')."""
        if os.path.isfile(os.path.join(directory, MODEL_NAME)):
            return safetensors.torch.load_file(os.path.join(directory, MODEL_NAME))
        if os.path.isfile(os.path.join(directory, INDEX_NAME)):
            with open(os.path.join(directory, INDEX_NAME)) as f:
                shards = sorted(set(json.load(f)["weight_map"].values()))
            state: dict[str, torch.Tensor] = {}
            for shard in shards:
                state.update(safetensors.torch.load_file(os.path.join(directory, shard)))
            return state
        if has_sharded_weights(directory) and self.read_sharded is not None:  # FSDP's shards, in this process
            return self.dcp_base_weights(self.read_sharded(directory), base_prefix, directory)
        raise CheckpointError(f"{directory!r} has no {MODEL_NAME} (nor {INDEX_NAME}, nor FSDP shards in {DCP_DIR}/).")

    def dcp_base_weights(self, weights: dict[str, torch.Tensor], base_prefix: str | None,
                         directory: str) -> dict[str, torch.Tensor]:
        """An FSDP checkpoint's weights without a parted model's other parts (score heads) and its base prefix
        (`base_prefix`: the model's; None: the model saves in one part, but the checkpoint may hold parts)."""
        if any(".lora_" in k for k in weights):  # (what train.fsdp wrote for LoRA before adapters were saved)
            raise CheckpointError(f"{directory!r} holds LoRA adapters in FSDP shards: resume it under train.fsdp and "
                                  "save again (checkpoints now hold the adapter in peft's layout).")
        if base_prefix is None:
            found = [p for p in self._part_kinds() if any(k.startswith(p.parts_prefix) for k in weights)]
            if not found:
                return weights
            base_prefix = found[0].base_prefix
        return _strip(weights, base_prefix)

    def _load_by_key(self, model: nn.Module, directory: str, base_prefix: str | None = None) -> None:
        """State-dict keys as the model names them (own models, FSDP shards); tied weights missing are fine."""
        state = self._read_full(directory, base_prefix)
        missing, unexpected = model.load_state_dict(state, strict=False)
        params = dict(model.named_parameters(remove_duplicate=False))
        tied = {n for n in missing if n in params and any(params[n] is params[s] for s in state if s in params)}
        bad_missing = [n for n in missing if n not in tied and n in dict(model.state_dict())]
        if unexpected or bad_missing:
            raise CheckpointError(f"Weights in {directory!r} do not fit {type(model).__name__}: missing "
                                  f"{bad_missing[:5]}, unexpected {unexpected[:5]}.")


MODEL_FILES = HubModelFiles()  # the format vlmtrain writes and reads checkpoints in (vlmtrain.Trainer's part)
