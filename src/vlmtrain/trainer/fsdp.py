"""FSDP2 (`train.fsdp`): parameters, gradients and optimizer state sharded over the ranks with `fully_shard`,
for models that do not fit one device. Checkpoints are torch.distributed.checkpoint (DCP) directories, each rank
writing its shards; :func:`export_checkpoint` turns one into a single `model.safetensors`.

Sharding units: every transformer block (the classes transformers lists in `_no_split_modules`), then the root
module (embeddings, tied heads, norms, the VLM projector). With bf16, the blocks compute in bfloat16 from float32
master weights and reduce gradients in float32 (FSDP's MixedPrecisionPolicy).
"""

from __future__ import annotations

import os
import shutil
import warnings
from typing import Any

import torch
from torch import nn

DCP_DIR = "dcp"  # inside checkpoint-<step>/: the DCP shards and .metadata


def is_sharded(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The modules FSDP shards one by one: instances of any class a submodule names in `_no_split_modules`."""
    names: set[str] = set()
    for module in model.modules():
        names.update(getattr(module, "_no_split_modules", None) or [])
    blocks = [m for m in model.modules() if type(m).__name__ in names and m is not model]
    # A block nested in another block is sharded with its parent.
    nested = {id(c) for b in blocks for c in b.modules() if c is not b}
    return [b for b in blocks if id(b) not in nested]


def shard_model(model: nn.Module, bf16: bool = False) -> nn.Module:
    """fully_shard each transformer block, then the root, in place over the default process group."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16
              else MixedPrecisionPolicy())
    for block in transformer_blocks(model):
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model


def meta_skeleton(model: nn.Module) -> nn.Module:
    """A structural copy of ``model`` whose parameters and buffers are on the meta device (no data copied;
    tied parameters stay tied)."""
    import copy

    memo: dict[int, Any] = {}
    for tensor in [*model.parameters(), *model.buffers()]:
        meta = tensor.detach().to("meta")
        memo[id(tensor)] = nn.Parameter(meta, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else meta
    return copy.deepcopy(model, memo)


def shard_from_rank0(model: nn.Module, bf16: bool, device: torch.device) -> nn.Module:
    """Shard a model that only rank 0 holds with weights (the others built it on the meta device): every rank
    shards a meta skeleton (:func:`shard_model`), then receives its shard of each tensor from rank 0, smallest
    first, while rank 0 frees each full tensor once it is sent. Rank 0's peak stays one copy of the weights,
    the others' their shard (where every rank loading the full model costs world_size copies).
    A collective: every rank calls it."""
    import torch.distributed as dist
    from torch.distributed.tensor import distribute_tensor

    rank = dist.get_rank()
    skeleton = meta_skeleton(model) if rank == 0 else model
    shard_model(skeleton, bf16)
    owners: dict[int, list[tuple[nn.Module, str]]] = {}  # a tied parameter is replaced everywhere it sits
    for module in skeleton.modules():
        for name, param in module._parameters.items():
            if param is not None:
                owners.setdefault(id(param), []).append((module, name))
    params = dict(skeleton.named_parameters())
    source = dict(model.named_parameters()) if rank == 0 else {}
    with torch.no_grad():
        for name in sorted(params, key=lambda n: params[n].numel()):
            meta = params[name]
            full = (source[name].detach().to(device) if rank == 0
                    else torch.empty(meta.shape, dtype=meta.dtype, device=device))
            shard = nn.Parameter(distribute_tensor(full, meta.device_mesh, meta.placements, src_data_rank=0),
                                 meta.requires_grad)
            for module, attr in owners[id(meta)]:
                module._parameters[attr] = shard
            del full
            if rank == 0:
                source[name].data = torch.empty(0, dtype=meta.dtype)  # rank 0's full copy of it goes
        full_buffers = dict(model.named_buffers(remove_duplicate=False)) if rank == 0 else {}
        received: dict[int, torch.Tensor] = {}  # a buffer shared by modules stays shared
        for prefix, module in skeleton.named_modules(remove_duplicate=False):
            for name, buffer in list(module._buffers.items()):
                if buffer is None:
                    continue
                if id(buffer) not in received:
                    value = (full_buffers[f"{prefix}.{name}" if prefix else name].to(device) if rank == 0
                             else torch.empty(buffer.shape, dtype=buffer.dtype, device=device))
                    dist.broadcast(value, src=0)  # not sharded (e.g. rotary inv_freq, in no state dict)
                    received[id(buffer)] = value
                module._buffers[name] = received[id(buffer)]
    return skeleton


def save_sharded(model: nn.Module, optimizer: torch.optim.Optimizer, directory: str) -> None:
    """Model and optimizer state into directory/dcp, every rank writing its own shards (a collective)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=os.path.join(directory, DCP_DIR))


def load_sharded(model: nn.Module, optimizer: torch.optim.Optimizer, directory: str) -> None:
    """Inverse of save_sharded (a collective); the shards are re-split if the world size changed."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optim_state}
    dcp.load(state, checkpoint_id=os.path.join(directory, DCP_DIR))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's weights on CPU, on rank 0 (other ranks get {}); every rank must call it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def has_sharded_weights(directory: str) -> bool:
    return os.path.isfile(os.path.join(directory, DCP_DIR, ".metadata"))


def read_model_weights(directory: str) -> dict[str, torch.Tensor]:
    """The model's full weights from a DCP checkpoint, in one process (no process group needed)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    path = os.path.join(directory, DCP_DIR)
    metadata = dcp.FileSystemReader(path).read_metadata()
    state = {"model": {key[len("model."):]: torch.empty(meta.size, dtype=meta.properties.dtype)
                       for key, meta in metadata.state_dict_metadata.items()
                       if key.startswith("model.") and isinstance(meta, TensorStorageMetadata)}}
    if not state["model"]:
        raise FileNotFoundError(f"{path} holds no model weights.")
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, checkpoint_id=path, no_dist=True)
    return state["model"]


def export_checkpoint(checkpoint: str, output_dir: str | None = None) -> str:
    """Write the model of a sharded (DCP) checkpoint as one `model.safetensors` (+ config and tokenizer files,
    copied) into output_dir (default: the checkpoint itself). Returns the safetensors path."""
    from safetensors.torch import save_file

    if not has_sharded_weights(checkpoint):
        raise FileNotFoundError(f"{checkpoint!r} is not a sharded checkpoint (no {DCP_DIR}/.metadata): its "
                                "model.safetensors is already the whole model.")
    out = output_dir or checkpoint
    os.makedirs(out, exist_ok=True)
    if os.path.abspath(out) != os.path.abspath(checkpoint):
        for name in os.listdir(checkpoint):  # config.json, tokenizer files, ...: what from_pretrained reads
            src = os.path.join(checkpoint, name)
            if os.path.isfile(src) and name.endswith((".json", ".txt", ".model", ".jinja")) and \
                    name != "trainer_state.json":
                shutil.copy2(src, os.path.join(out, name))
    weights = {k: v.contiguous() for k, v in read_model_weights(checkpoint).items()}
    path = os.path.join(out, "model.safetensors")
    save_file(weights, path, metadata={"format": "pt"})
    return path


def save_full_model(model: nn.Module, directory: str, processing_class: Any, rank: int) -> None:
    """Gather the sharded model and write it like an unsharded one (rank 0 writes; every rank must call)."""
    from .checkpoint import save_model_files

    state = full_state_dict(model)
    if rank == 0:
        save_model_files(model, directory, processing_class, state_dict=state)
