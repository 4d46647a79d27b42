"""FSDP2 (`train.fsdp`): parameters, gradients and optimizer state sharded over the ranks with `fully_shard`,
for models that do not fit one device. A full fine-tune's checkpoints are torch.distributed.checkpoint (DCP)
directories, each rank writing its shards (`vlmtrain export` turns one into a single `model.safetensors`).
A model with frozen weights (LoRA) saves only what trains: its trainable parameters gathered to rank 0
(:func:`gather_trainable`) in the adapter / heads layout of models/files/model_files.py, and the optimizer state as
one unsharded state dict keyed by parameter name (:func:`full_optimizer_state`), re-split over any world size
at resume.

Sharding units: the blocks the model layer names (every transformer block, the classes
transformers lists in `_no_split_modules`; models/sharding.py), then the root module (embeddings, tied heads,
norms, the VLM projector). With bf16, the blocks compute in bfloat16 from float32 master weights and reduce
gradients in float32 (FSDP's MixedPrecisionPolicy). A model that only rank 0 built with weights is sharded from
there by models/sharding.py's shard_from_rank0.

The trainer never imports this module: it calls these functions through :class:`FSDPPlan`, vlmtrain.Trainer's
``sharding`` part (trainer/parts.py). The plan writes and reads model files in the model layer's format
(models/files/model_files.py's MODEL_FILES, vlmtrain.Trainer's ``model_files`` part too).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from vlmtrain.models.files.model_files import MODEL_FILES
from vlmtrain.models.sharding import frozen_models, transformer_blocks
from vlmtrain.trainer import checkpoint as ckpt
from vlmtrain.trainer.model_files import DCP_DIR, CheckpointError, has_sharded_weights
from vlmtrain.trainer.sharding import keyed_by_name

from .lockstep import eval_in_step


def is_sharded(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def shard_model(model: nn.Module, bf16: bool = False) -> nn.Module:
    """fully_shard each of the model's blocks (every transformer block: models/sharding.py), then each frozen
    model it holds (DPO's reference: models/sharding.py's frozen_models), then the root, in place over the
    default process group."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16
              else MixedPrecisionPolicy())
    for block in transformer_blocks(model):
        fully_shard(block, mp_policy=policy)
    for frozen in frozen_models(model):
        fully_shard(frozen, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model


def reshard(model: nn.Module) -> None:
    """Every unit of ``model`` back to its shards. FSDP2 keeps the root unit (embeddings, lm_head, norms, the
    projector) gathered after a forward without backward (evaluation): an optimizer built then would hold the
    gathered copies, which no step updates and no gradient reaches."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def save_sharded(model: nn.Module, optimizer: torch.optim.Optimizer, directory: str) -> None:
    """Model and optimizer state into directory/dcp, every rank writing its own shards (a collective)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=os.path.join(directory, DCP_DIR))


def save_checkpoint(model: nn.Module, optimizer: torch.optim.Optimizer, output_dir: str, step: int,
                    files: dict[str, Any], processing_class: Any, rank: int) -> str:
    """output_dir/checkpoint-<step> of the sharded ``model`` with the trainer's ``files`` (this rank's; see
    checkpoint.write_checkpoint), atomically (a collective). LoRA (a model that saves only what trains): its
    trainable parameters and their optimizer state gathered to rank 0 and written like an unsharded LoRA
    checkpoint's, never the frozen base. A full fine-tune: each rank writes its shards of model and optimizer
    (DCP), rank 0 what from_pretrained needs besides the weights and the score heads, gathered."""
    if MODEL_FILES.saves_trainable_only(model):
        state = gather_trainable(model)
        optimizer_state = full_optimizer_state(model, optimizer)
        if rank == 0:
            files["optimizer.pt"] = optimizer_state
        return ckpt.write_checkpoint(output_dir, step, files, rank=rank,
                                     write_model=lambda d: MODEL_FILES.save_model_files(model, d, processing_class, state))
    heads = gather_params(model, "heads.layers.") if MODEL_FILES.has_score_heads(model) else None
    return ckpt.write_checkpoint(output_dir, step, files, lambda d: _save_model_config(model, d, processing_class, heads),
                                 rank=rank, write_sharded=lambda d: save_sharded(model, optimizer, d))


def _save_model_config(model: nn.Module, directory: str, processing_class: Any,
                       heads: dict[str, Any] | None) -> None:
    """What from_pretrained needs besides the weights (config.json, tokenizer/processor files), and the score
    heads (`heads`: their gathered weights) as heads.safetensors + heads.json."""
    config = getattr(model, "config", None)
    if hasattr(config, "save_pretrained"):
        config.save_pretrained(directory)
    if processing_class is not None and hasattr(processing_class, "save_pretrained"):
        processing_class.save_pretrained(directory)
    if heads is not None:
        MODEL_FILES.save_head_files(model, directory, heads)


def load_sharded(model: nn.Module, optimizer: torch.optim.Optimizer, directory: str) -> None:
    """Inverse of save_sharded (a collective); the shards are re-split if the world size changed."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optim_state}
    dcp.load(state, checkpoint_id=os.path.join(directory, DCP_DIR))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


def gather_trainable(model: nn.Module) -> dict[str, torch.Tensor]:
    """The trainable parameters (requires_grad) as full tensors on CPU, on rank 0 (other ranks get {}), keyed by
    parameter name; the frozen ones are never gathered. Every rank must call it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True,
                                                                 ignore_frozen_params=True))
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    return {k: v for k, v in state.items() if k in trainable}  # (buffers stay out: nothing trains them)


def full_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer state unsharded on CPU, keyed by parameter name, on rank 0 ({} elsewhere); a collective.
    Only trainable parameters have state: small next to the model when most of it is frozen."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    return get_optimizer_state_dict(model, optimizer,
                                    options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Load an optimizer state written by :func:`full_optimizer_state` (keyed by parameter name) into a sharded
    or unsharded model's optimizer, or one written by ``optimizer.state_dict()`` (keyed by position) into a
    sharded one's. Under FSDP every rank calls it with the same state (a collective)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    if not keyed_by_name(state):
        if not is_sharded(model):
            optimizer.load_state_dict(state)
            return
        # positions -> names: the optimizer was built over the same parameters, in the same order
        names = {id(p): n for n, p in model.named_parameters()}
        order = [names[id(p)] for g in optimizer.param_groups for p in g["params"]]
        state = {"state": {order[i]: v for i, v in state["state"].items()},
                 "param_groups": [{**g, "params": [order[i] for i in g["params"]]} for g in state["param_groups"]]}
    set_optimizer_state_dict(model, optimizer, state, options=StateDictOptions(full_state_dict=True))


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's weights on CPU, on rank 0 (other ranks get {}); every rank must call it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def gather_params(model: nn.Module, prefix: str) -> dict[str, torch.Tensor]:
    """The parameters whose names start with `prefix` (e.g. the score heads, "heads."), as full CPU tensors on
    every rank. A collective: every rank calls it."""
    out = {}
    for name, param in model.named_parameters():
        if name.startswith(prefix):
            full = param.full_tensor() if hasattr(param, "full_tensor") else param
            out[name[len(prefix):]] = full.detach().cpu().clone()  # (its own storage, not the gather buffer's)
    return out


def save_full_model(model: nn.Module, directory: str, processing_class: Any, rank: int) -> None:
    """Gather the sharded model and write it like an unsharded one (rank 0 writes; every rank must call). With
    LoRA only the trainable parameters are gathered: the files hold the adapter, never the frozen base."""
    state = gather_trainable(model) if MODEL_FILES.saves_trainable_only(model) else full_state_dict(model)
    if rank == 0:
        MODEL_FILES.save_model_files(model, directory, processing_class, state_dict=state)


def load_model_state(model: nn.Module, directory: str) -> None:
    """Load the model weights of a checkpoint directory into the sharded ``model``, in place (a collective):

    - DCP shards holding model weights (`dcp/`): each rank reads its own shards (the model part only; the
      shards are re-split if the world size changed);
    - files (`model.safetensors`, an adapter, `heads.safetensors`, ...): the same loader as an unsharded
      model, each full tensor cut into this rank's shard as it is loaded.
    """
    saved = _dcp_model_keys(directory)
    if saved:
        _load_dcp_model(model, directory, saved)
        return
    with _full_tensors_into_shards(model):
        MODEL_FILES.load_model_weights(model, directory)


def _dcp_model_keys(directory: str) -> set[str]:
    """The model weights' names in a checkpoint's DCP shards (none when it has no `dcp/`)."""
    if not has_sharded_weights(directory):
        return set()
    import torch.distributed.checkpoint as dcp

    metadata = dcp.FileSystemReader(os.path.join(directory, DCP_DIR)).read_metadata()
    return {key[len("model."):] for key in metadata.state_dict_metadata if key.startswith("model.")}


def _load_dcp_model(model: nn.Module, directory: str, saved: set[str]) -> None:
    """The model part of DCP shards into a sharded model (a collective). Weights the shards lack are kept as
    they are, if frozen (e.g. a base model that was not saved); a trainable one missing is an error."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
    )

    state = get_model_state_dict(model)
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    missing = sorted(k for k in state if k not in saved and k in trainable)
    if missing:
        raise CheckpointError(f"{os.path.join(directory, DCP_DIR)} lacks trained weights of "
                              f"{type(model).__name__}: {missing[:5]} (a checkpoint of another model?).")
    state = {k: v for k, v in state.items() if k in saved}
    dcp.load({"model": state}, checkpoint_id=os.path.join(directory, DCP_DIR))
    set_model_state_dict(model, state, options=StateDictOptions(strict=False))


@contextlib.contextmanager
def _full_tensors_into_shards(model: nn.Module) -> Iterator[None]:
    """While active, ``load_state_dict`` on any part of a sharded model takes full tensors: each one is cut into
    this rank's shard of the parameter it loads into (every rank read the same file: no communication)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    def to_shard(module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        for name, param in module._parameters.items():  # (FSDP's own hook, which runs first, resharded them)
            value = state_dict.get(prefix + name)
            if isinstance(param, DTensor) and isinstance(value, torch.Tensor) and not isinstance(value, DTensor):
                value = value.to(device=param.device, dtype=param.dtype)
                state_dict[prefix + name] = distribute_tensor(value, param.device_mesh, param.placements,
                                                              src_data_rank=None)

    handles = [m._register_load_state_dict_pre_hook(to_shard, with_module=True) for m in model.modules()
               if m._parameters]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


class FSDPPlan:
    """The trainer's :class:`~vlmtrain.trainer.sharding.ShardingPlan` for train.fsdp: FSDP2's ``fully_shard``
    and DCP checkpoints, the functions of this module. vlmtrain.Trainer's ``sharding`` part
    (compat/trainer.py)."""

    is_sharded = staticmethod(is_sharded)
    shard_model = staticmethod(shard_model)
    reshard = staticmethod(reshard)
    save_checkpoint = staticmethod(save_checkpoint)
    load_sharded = staticmethod(load_sharded)
    load_model_state = staticmethod(load_model_state)
    load_optimizer_state = staticmethod(load_optimizer_state)
    save_full_model = staticmethod(save_full_model)
    eval_in_step = staticmethod(eval_in_step)  # (lockstep.py)


FSDP_PLAN = FSDPPlan()  # vlmtrain.Trainer's sharding part (compat/trainer.py)
