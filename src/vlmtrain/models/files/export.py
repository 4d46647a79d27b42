"""`vlmtrain export`: a checkpoint's model as files transformers / peft load alone (an FSDP full fine-tune's
DCP shards become `model.safetensors` + `heads.safetensors`)."""

from __future__ import annotations

import os
import shutil

import safetensors.torch
import torch

from ...errors import CheckpointError
from .head_files import HEADS_CONFIG, HEADS_WEIGHTS
from .sharded_files import has_sharded_weights, read_model_weights

# Files of a checkpoint that are training state, not the model (export leaves them out).
TRAINING_STATE = ("trainer_state.json", "optimizer.pt", "scheduler.pt", "training_args.bin")
MODEL_NAME = "model.safetensors"
HEADS_PREFIX, BASE_PREFIX = "heads.layers.", "base."  # a WithHeads model's state-dict keys


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
    base = {k: v.contiguous() for k, v in _base_weights(weights, bool(heads), checkpoint).items()}
    safetensors.torch.save_file(base, os.path.join(out, MODEL_NAME), metadata={"format": "pt"})
    if heads:
        if not os.path.isfile(os.path.join(out, HEADS_CONFIG)):
            raise CheckpointError(f"{checkpoint!r} has score heads in its shards but no {HEADS_CONFIG} saying what "
                                  "they are.")
        safetensors.torch.save_file(heads, os.path.join(out, HEADS_WEIGHTS), metadata={"format": "pt"})
    return out


def _base_weights(weights: dict[str, torch.Tensor], heads: bool, directory: str) -> dict[str, torch.Tensor]:
    """An FSDP checkpoint's weights without the score heads and their wrapper's `base.` prefix."""
    if any(".lora_" in k for k in weights):  # (what train.fsdp wrote for LoRA before adapters were saved)
        raise CheckpointError(f"{directory!r} holds LoRA adapters in FSDP shards: resume it under train.fsdp and "
                              "save again (checkpoints now hold the adapter in peft's layout).")
    if not heads:
        return weights
    return {k[len(BASE_PREFIX):]: v for k, v in weights.items() if k.startswith(BASE_PREFIX)}
