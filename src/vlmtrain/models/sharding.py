"""How a model is cut for FSDP (train.fsdp), which depends on its structure: the blocks sharded one by one (what
parallel/fsdp.py shards first), and the sharding of a model that only rank 0
built with weights (the others hold a meta-device skeleton: models/meta.py's sharded_build)."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The modules FSDP shards one by one: instances of any class a submodule names in `_no_split_modules`."""
    names: set[str] = set()
    for module in model.modules():
        names.update(getattr(module, "_no_split_modules", None) or [])
    blocks = [m for m in model.modules() if type(m).__name__ in names and m is not model]
    # A block nested in another block is sharded with its parent.
    nested = {id(c) for b in blocks for c in b.modules() if c is not b}
    return [b for b in blocks if id(b) not in nested]


FROZEN_MODELS_ATTR = "frozen_models"
"""A model holding whole frozen models beside the one it trains (DPO's reference: models/objectives/dpo.py)
names them with a ``frozen_models()`` method; FSDP shards each as a unit of its own (parallel/fsdp.py)."""


def frozen_models(model: nn.Module) -> list[nn.Module]:
    """The frozen models ``model`` holds (its ``frozen_models()``; none by default). Left to the root unit, their
    embeddings, LM head and vision stem would be gathered with the trained model's for the whole step; as units
    of their own they are gathered only while they run."""
    found = getattr(model, FROZEN_MODELS_ATTR, None)
    return [m for m in found() if m is not None] if callable(found) else []


@contextlib.contextmanager
def gathered(model: nn.Module) -> Iterator[None]:
    """While active, ``model``'s own FSDP unit (a frozen model's: :func:`frozen_models`) is gathered, for what it
    runs outside its forward (a VLM's get_image_features before it: objectives/vision_pairs.py), and sharded again
    after. Every rank gathers it once whatever its batch holds, so the collectives match. A model that is not an
    FSDP unit: nothing happens."""
    unshard, reshard = getattr(model, "unshard", None), getattr(model, "reshard", None)
    if unshard is None or reshard is None:
        yield
        return
    unshard()
    try:
        yield
    finally:
        reshard()


def meta_skeleton(model: nn.Module) -> nn.Module:
    """A structural copy of ``model`` whose parameters and buffers are on the meta device (no data copied;
    tied parameters stay tied)."""
    memo: dict[int, Any] = {}
    for tensor in [*model.parameters(), *model.buffers()]:
        meta = tensor.detach().to("meta")
        memo[id(tensor)] = nn.Parameter(meta, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else meta
    return copy.deepcopy(model, memo)


def shard_from_rank0(model: nn.Module, shard_model: Callable[[nn.Module], Any],
                     device: torch.device) -> nn.Module:
    """Shard a model that only rank 0 holds with weights (the others built it on the meta device): every rank
    shards a meta skeleton (``shard_model``: parallel/fsdp.py's, with the run's bf16), then receives
    its shard of each tensor from rank 0, smallest first, while rank 0 frees each full tensor once it is sent.
    Rank 0's peak stays one copy of the weights, the others' their shard (where every rank loading the full
    model costs world_size copies). A collective: every rank calls it."""
    import torch.distributed as dist
    from torch.distributed.tensor import distribute_tensor

    rank = dist.get_rank()
    skeleton = meta_skeleton(model) if rank == 0 else model
    shard_model(skeleton)
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
