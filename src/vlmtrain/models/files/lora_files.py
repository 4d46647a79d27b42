"""A LoRA model's files (peft's layout): `adapter_model.safetensors` + `adapter_config.json` (adapters and
modules_to_save) and `trainable.safetensors` for any other trainable base tensor; the frozen base is never
written. :data:`ADAPTER_PARTS` is LoRA's side of the checkpoint-parts protocol (model_files.py):
the adapter stands in for the base model's own files (``replaces_base``), one of model_files.PART_KINDS."""

from __future__ import annotations

import os

import safetensors.torch
import torch
from torch import nn

from ...errors import CheckpointError

ADAPTER_NAME = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
TRAINABLE_NAME = "trainable.safetensors"


def is_peft(model: nn.Module) -> bool:
    """True for a peft model (False without peft installed)."""
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)


class AdapterFiles:
    """The LoRA adapter's files in place of a frozen base model's weights (see the module docstring)."""

    replaces_base = True
    part_files = (ADAPTER_CONFIG, ADAPTER_NAME)

    @staticmethod
    def owns(model: nn.Module) -> bool:
        """True for a model carrying peft adapters."""
        return is_peft(model)

    @staticmethod
    def check(model: nn.Module, directory: str) -> None:
        """A checkpoint holds an adapter exactly when the model carries LoRA adapters."""
        adapter = os.path.isfile(os.path.join(directory, ADAPTER_CONFIG))
        if is_peft(model) != adapter:
            raise CheckpointError(
                f"{directory!r} holds {'a LoRA adapter' if adapter else 'full weights'} but the model "
                f"{'carries' if is_peft(model) else 'has no'} LoRA adapters: build it with the same model.lora "
                f"as the run that wrote it" + ("." if adapter else " (or merge with vlmtrain export --merge)."))

    @staticmethod
    def save(peft_model: nn.Module, directory: str, state_dict: dict[str, torch.Tensor] | None = None) -> None:
        """`state_dict`: the PeftModel's trainable parameters by name (gathered FSDP shards), or None for its
        own."""
        peft_model.save_pretrained(directory, state_dict=state_dict)
        if state_dict is None:
            extra = _extra_trainable(peft_model)
        else:  # what the adapter file does not hold (found by identity: peft keeps the tensors it is given)
            from peft import get_peft_model_state_dict

            held = {id(t) for t in get_peft_model_state_dict(peft_model, state_dict=state_dict).values()}
            extra = {k: v.contiguous() for k, v in state_dict.items() if id(v) not in held}
        if extra:
            safetensors.torch.save_file(extra, os.path.join(directory, TRAINABLE_NAME), metadata={"format": "pt"})

    @staticmethod
    def load(peft_model: nn.Module, directory: str) -> None:
        """The adapter (its keys and shapes checked against the model's LoRA) and trainable.safetensors."""
        saved = _read_adapter(peft_model, directory)
        from peft import set_peft_model_state_dict

        set_peft_model_state_dict(peft_model, saved)
        extra_path = os.path.join(directory, TRAINABLE_NAME)
        if os.path.isfile(extra_path):
            extra = safetensors.torch.load_file(extra_path)
            unexpected = peft_model.load_state_dict(extra, strict=False).unexpected_keys
            if unexpected:
                raise CheckpointError(f"{extra_path!r} holds tensors the model does not have: {unexpected[:5]}.")


ADAPTER_PARTS = AdapterFiles()


def _extra_trainable(peft_model: nn.Module) -> dict[str, torch.Tensor]:
    """Trainable parameters of a PeftModel that its adapter state dict does not hold."""
    from peft import get_peft_model_state_dict

    held = {t.data_ptr() for t in get_peft_model_state_dict(peft_model).values()}
    return {n: p.detach().contiguous() for n, p in peft_model.named_parameters()
            if p.requires_grad and p.data_ptr() not in held}


def _read_adapter(peft_model: nn.Module, directory: str) -> dict[str, torch.Tensor]:
    """adapter_model.safetensors, whose keys and shapes must be the model's LoRA's."""
    from peft import get_peft_model_state_dict

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
    return saved
