"""Model weights in a checkpoint directory: what is written, what counts as complete, how it is loaded back.

Three layouts, each loadable with transformers / peft alone:
  - full weights: `model.safetensors`, or shards listed in `model.safetensors.index.json` (+ `config.json`),
    what `save_pretrained` writes; transformers models are loaded back through their own `from_pretrained`
    (which renames legacy keys some families write), other models by state-dict key;
  - LoRA (peft): `adapter_model.safetensors` + `adapter_config.json` (adapters and modules_to_save), and
    `trainable.safetensors` for any other trainable base tensor; the frozen base is not written;
  - score heads (a model with `.base` and `.heads`): `heads.safetensors` + `heads.json` next to either.
Under FSDP a LoRA model is written in the same layout (its trainable parameters gathered to rank 0); a full
fine-tune keeps its weights in DCP shards (`dcp/`, read by fsdp.py, keys as the whole model names them: `base.` /
`heads.` under score heads) with `heads.safetensors` + `heads.json` and the config beside them;
:func:`export_checkpoint` writes those shards as the layouts above.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Iterator
from typing import Any

import safetensors.torch
import torch
from torch import nn

from .fsdp import DCP_DIR, has_sharded_weights, read_model_weights

# Files of a checkpoint that are training state, not the model (export leaves them out).
TRAINING_STATE = ("trainer_state.json", "optimizer.pt", "scheduler.pt", "training_args.bin")

MODEL_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
ADAPTER_NAME = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
TRAINABLE_NAME = "trainable.safetensors"
HEADS_NAME, HEADS_CONFIG = "heads.safetensors", "heads.json"
HEADS_PREFIX = "heads.layers."  # where the heads' weights sit in a WithHeads model's state dict


class CheckpointError(RuntimeError):
    """A checkpoint is missing or incomplete; the message names the directory and what is missing."""


def _split(model: nn.Module) -> tuple[nn.Module, bool]:
    """(the model under score heads or the model itself, whether there are heads)."""
    heads = isinstance(getattr(model, "base", None), nn.Module) and isinstance(getattr(model, "heads", None),
                                                                                nn.Module)
    return (model.base if heads else model), heads


def _is_peft(model: nn.Module) -> bool:
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)


def has_score_heads(model: nn.Module) -> bool:
    """True for a model wrapped with score heads (`.base` and `.heads`)."""
    return _split(model)[1]


def saves_trainable_only(model: nn.Module) -> bool:
    """True when the model's files hold only what trains (LoRA adapters, modules_to_save, heads), never its
    frozen base: then FSDP gathers just those (fsdp.gather_trainable)."""
    return _is_peft(_split(model)[0])


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


def missing_weight_files(directory: str) -> list[str]:
    """The model files a checkpoint lacks: none for full weights (single file or every shard of the index),
    an adapter, or DCP shards (whose files check_complete checks); heads.safetensors when heads.json says there are heads."""
    def there(name: str) -> bool:
        return os.path.isfile(os.path.join(directory, name))

    if there(ADAPTER_CONFIG):
        missing = [] if there(ADAPTER_NAME) else [ADAPTER_NAME]
    elif there(INDEX_NAME):
        with open(os.path.join(directory, INDEX_NAME)) as f:
            shards = sorted(set(json.load(f).get("weight_map", {}).values()))
        missing = [s for s in shards if not there(s)] if shards else [f"the shards {INDEX_NAME} lists"]
    elif there(MODEL_NAME) or os.path.isdir(os.path.join(directory, DCP_DIR)):  # dcp/: check_complete's
        missing = []
    else:
        missing = [MODEL_NAME]
    if there(HEADS_CONFIG) and not there(HEADS_NAME):
        missing.append(HEADS_NAME)
    return missing


def has_model_files(directory: str) -> bool:
    """True when directory holds a model in any layout (full, sharded, adapter, DCP)."""
    there = [n for n in (MODEL_NAME, INDEX_NAME, ADAPTER_CONFIG) if os.path.isfile(os.path.join(directory, n))]
    return bool(there) or has_sharded_weights(directory)


# -- writing ------------------------------------------------------------------------------------------------
def save_model_files(model: nn.Module, directory: str, processing_class: Any = None,
                     state_dict: dict[str, torch.Tensor] | None = None, max_shard_size: int | str | None = None
                     ) -> None:
    """The model's files (see the module docstring) and the tokenizer/processor files into directory;
    `state_dict` instead of the model's own (e.g. gathered FSDP shards); `max_shard_size` (e.g. "2GB") splits
    full weights into shards with an index."""
    os.makedirs(directory, exist_ok=True)
    base, heads = _split(model)
    head_state = None
    if heads and state_dict is not None:
        head_state = {k[len(HEADS_PREFIX):]: v for k, v in state_dict.items() if k.startswith(HEADS_PREFIX)}
        state_dict = {k[len("base."):]: v for k, v in state_dict.items() if k.startswith("base.")}
    if _is_peft(base):
        _save_adapter(base, directory, state_dict)
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
    if heads:
        from ..models.head_files import save_heads

        save_heads(model, directory, head_state)
    if processing_class is not None and hasattr(processing_class, "save_pretrained"):
        processing_class.save_pretrained(directory)


def save_head_files(model: nn.Module, directory: str, tensors: dict[str, torch.Tensor]) -> None:
    """heads.safetensors (`tensors`: the heads' weights, e.g. gathered from FSDP shards) + heads.json."""
    from ..models.head_files import save_heads

    save_heads(model, directory, tensors)


def _extra_trainable(peft_model: nn.Module) -> dict[str, torch.Tensor]:
    """Trainable parameters of a PeftModel that its adapter state dict does not hold."""
    from peft import get_peft_model_state_dict

    held = {t.data_ptr() for t in get_peft_model_state_dict(peft_model).values()}
    return {n: p.detach().contiguous() for n, p in peft_model.named_parameters()
            if p.requires_grad and p.data_ptr() not in held}


def _save_adapter(peft_model: nn.Module, directory: str, state_dict: dict[str, torch.Tensor] | None) -> None:
    """`state_dict`: the PeftModel's trainable parameters by name (gathered FSDP shards), or None for its own."""
    peft_model.save_pretrained(directory, state_dict=state_dict)
    if state_dict is None:
        extra = _extra_trainable(peft_model)
    else:  # what the adapter file does not hold (found by identity: peft keeps the tensors it is given)
        from peft import get_peft_model_state_dict

        held = {id(t) for t in get_peft_model_state_dict(peft_model, state_dict=state_dict).values()}
        extra = {k: v.contiguous() for k, v in state_dict.items() if id(v) not in held}
    if extra:
        safetensors.torch.save_file(extra, os.path.join(directory, TRAINABLE_NAME), metadata={"format": "pt"})


# -- reading ------------------------------------------------------------------------------------------------
def load_model_weights(model: nn.Module, directory: str) -> None:
    """Load a checkpoint's model files (any layout of the module docstring) into model, in place."""
    base, heads = _split(model)
    adapter = os.path.isfile(os.path.join(directory, ADAPTER_CONFIG))
    if _is_peft(base) != adapter:
        raise CheckpointError(
            f"{directory!r} holds {'a LoRA adapter' if adapter else 'full weights'} but the model "
            f"{'carries' if _is_peft(base) else 'has no'} LoRA adapters: build it with the same model.lora "
            f"as the run that wrote it" + ("." if adapter else " (or merge with vlmtrain export --merge)."))
    if heads:  # first: a checkpoint of another head set fails before any weight is read
        _check_heads(model, directory)
    if adapter:
        _load_adapter(base, directory)
    elif _is_transformers_model(base) and not has_sharded_weights(directory):
        _load_pretrained(base, directory)
    else:
        _load_by_key(base, directory, heads)
    if heads:
        from ..models.head_files import load_heads

        load_heads(model, directory)


def _check_heads(model: nn.Module, directory: str) -> None:
    """The checkpoint's heads (heads.json) are the model's, and their weights are there."""
    from ..models.head_files import read_head_configs

    if not os.path.isfile(os.path.join(directory, HEADS_NAME)):
        raise CheckpointError(f"{directory!r} has no {HEADS_NAME}, but {type(model).__name__} has score heads "
                              f"({sorted(model.head_configs)}).")
    try:
        saved = read_head_configs(directory)
    except FileNotFoundError as e:
        raise CheckpointError(str(e)) from None
    if saved != model.head_configs:
        raise CheckpointError(f"{os.path.join(directory, HEADS_CONFIG)}: the checkpoint's heads {saved} differ from "
                              f"the model's {model.head_configs} (same model.heads as the run that wrote it?).")


def _load_pretrained(base: nn.Module, directory: str) -> None:
    """Through the class's own from_pretrained (its key renaming included), then copied into base."""
    if missing_weight_files(directory):
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


def _read_full(directory: str, heads: bool = False) -> dict[str, torch.Tensor]:
    """The full weights of a checkpoint, keyed as the base model names them (`heads`: the model has score
    heads, whose own weights an FSDP checkpoint's shards hold beside the base's under `base.`)."""
    if os.path.isfile(os.path.join(directory, MODEL_NAME)):
        return safetensors.torch.load_file(os.path.join(directory, MODEL_NAME))
    if os.path.isfile(os.path.join(directory, INDEX_NAME)):
        with open(os.path.join(directory, INDEX_NAME)) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        state: dict[str, torch.Tensor] = {}
        for shard in shards:
            state.update(safetensors.torch.load_file(os.path.join(directory, shard)))
        return state
    if has_sharded_weights(directory):  # an FSDP checkpoint: gather its shards in this process
        return dcp_base_weights(read_model_weights(directory), heads, directory)
    raise CheckpointError(f"{directory!r} has no {MODEL_NAME} (nor {INDEX_NAME}, nor FSDP shards in {DCP_DIR}/).")


def dcp_base_weights(weights: dict[str, torch.Tensor], heads: bool, directory: str) -> dict[str, torch.Tensor]:
    """An FSDP checkpoint's weights without the score heads and their wrapper's `base.` prefix."""
    if any(".lora_" in k for k in weights):  # (what train.fsdp wrote for LoRA before adapters were saved)
        raise CheckpointError(f"{directory!r} holds LoRA adapters in FSDP shards: resume it under train.fsdp and "
                              "save again (checkpoints now hold the adapter in peft's layout).")
    if not heads and not any(k.startswith(HEADS_PREFIX) for k in weights):
        return weights
    return {k[len("base."):]: v for k, v in weights.items() if k.startswith("base.")}


def _load_by_key(model: nn.Module, directory: str, heads: bool = False) -> None:
    """State-dict keys as the model names them (own models, FSDP shards); tied weights missing are fine."""
    state = _read_full(directory, heads)
    missing, unexpected = model.load_state_dict(state, strict=False)
    params = dict(model.named_parameters(remove_duplicate=False))
    tied = {n for n in missing if n in params and any(params[n] is params[s] for s in state if s in params)}
    bad_missing = [n for n in missing if n not in tied and n in dict(model.state_dict())]
    if unexpected or bad_missing:
        raise CheckpointError(f"Weights in {directory!r} do not fit {type(model).__name__}: missing "
                              f"{bad_missing[:5]}, unexpected {unexpected[:5]}.")


def _load_adapter(peft_model: nn.Module, directory: str) -> None:
    from peft import get_peft_model_state_dict, set_peft_model_state_dict

    path = os.path.join(directory, ADAPTER_NAME)
    if not os.path.isfile(path):
        raise CheckpointError(f"{directory!r} has {ADAPTER_CONFIG} but no {ADAPTER_NAME}.")
    saved = safetensors.torch.load_file(path)
    shapes = {k: tuple(v.shape) for k, v in get_peft_model_state_dict(peft_model).items()}
    expected = set(shapes)
    if set(saved) != expected:
        raise CheckpointError(f"The adapter in {directory!r} does not fit the model's LoRA: missing "
                              f"{sorted(expected - set(saved))[:5]}, unexpected {sorted(set(saved) - expected)[:5]} "
                              f"(same model.lora as the run that wrote it?).")
    wrong = [k for k in sorted(saved) if tuple(saved[k].shape) != shapes[k]]
    if wrong:
        raise CheckpointError(f"{path!r}: {wrong[0]!r} has shape {tuple(saved[wrong[0]].shape)}, the model expects "
                              f"{shapes[wrong[0]]} (another model, or another model.lora.r?).")
    set_peft_model_state_dict(peft_model, saved)
    extra_path = os.path.join(directory, TRAINABLE_NAME)
    if os.path.isfile(extra_path):
        unexpected = peft_model.load_state_dict(safetensors.torch.load_file(extra_path), strict=False).unexpected_keys
        if unexpected:
            raise CheckpointError(f"{extra_path!r} holds tensors the model does not have: {unexpected[:5]}.")


# -- export -------------------------------------------------------------------------------------------------
def export_checkpoint(checkpoint: str, output_dir: str | None = None) -> str:
    """The model of a checkpoint as files transformers / peft load: an FSDP full fine-tune's shards (dcp/) become
    `model.safetensors` (keys as from_pretrained expects them) + `heads.safetensors`, with the config, processor
    and heads.json copied (output_dir default: the checkpoint itself); a checkpoint already in such a layout
    (full weights, or a LoRA adapter) has its model files copied without the training state (output_dir
    default: `<checkpoint>-export`). Returns the folder written."""
    sharded = has_sharded_weights(checkpoint)
    out = output_dir or (checkpoint if sharded else os.path.normpath(checkpoint) + "-export")
    os.makedirs(out, exist_ok=True)
    if os.path.abspath(out) != os.path.abspath(checkpoint):
        for name in os.listdir(checkpoint):  # config, processor, heads.json / adapter / weights: what loads
            src = os.path.join(checkpoint, name)
            if os.path.isfile(src) and name not in TRAINING_STATE and \
                    not name.startswith(("rng_state", "loop_state_")):
                shutil.copy2(src, os.path.join(out, name))
    if not sharded:
        return out
    weights = read_model_weights(checkpoint)
    heads = {k[len(HEADS_PREFIX):]: v.contiguous() for k, v in weights.items() if k.startswith(HEADS_PREFIX)}
    base = {k: v.contiguous() for k, v in dcp_base_weights(weights, bool(heads), checkpoint).items()}
    safetensors.torch.save_file(base, os.path.join(out, MODEL_NAME), metadata={"format": "pt"})
    if heads:
        if not os.path.isfile(os.path.join(out, HEADS_CONFIG)):
            raise CheckpointError(f"{checkpoint!r} has score heads in its shards but no {HEADS_CONFIG} saying what "
                                  "they are.")
        safetensors.torch.save_file(heads, os.path.join(out, HEADS_NAME), metadata={"format": "pt"})
    return out
