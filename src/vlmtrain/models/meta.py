"""Model structure without weights, for FSDP ranks other than 0 (they receive their shards from rank 0, see
:func:`vlmtrain.models.sharding.shard_from_rank0`). Inside :func:`sharded_build`, every model kind builds its
model under :func:`model_init` on the meta device (processors and collators stay real), and a pretrained model
is built from its config alone, since ``from_pretrained`` refuses the meta device."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch
from transformers import AutoConfig

T = TypeVar("T")
_CONFIG_ONLY = ("dtype", "torch_dtype", "attn_implementation", "config")


_SHARDED_BUILD = False  # every rank: the model is being built to be sharded from rank 0
_SKELETON = False  # this rank builds meta-device skeletons


@contextlib.contextmanager
def sharded_build(skeleton: bool) -> Iterator[None]:
    """Every rank builds the model kind's parts inside this block; models built under :func:`model_init` are
    meta-device skeletons where ``skeleton`` (ranks other than 0)."""
    global _SHARDED_BUILD, _SKELETON
    previous = _SHARDED_BUILD, _SKELETON
    _SHARDED_BUILD, _SKELETON = True, skeleton
    try:
        yield
    finally:
        _SHARDED_BUILD, _SKELETON = previous


def from_rank0(compute: Callable[[], T]) -> T:
    """``compute()``; in a sharded build rank 0's result on every rank (a collective: every rank calls it), for
    decisions that need the weights, e.g. whether the model keeps packed samples apart."""
    if not _SHARDED_BUILD:
        return compute()
    import torch.distributed as dist

    result = [None if _SKELETON else compute()]
    dist.broadcast_object_list(result, src=0)
    return result[0]


def model_init() -> contextlib.AbstractContextManager:
    """What a model kind builds its model (with heads and adapters) in: the meta device inside
    :func:`sharded_build` on ranks other than 0, else nothing."""
    return torch.device("meta") if _SKELETON else contextlib.nullcontext()


def building_on_meta() -> bool:
    """Whether models built now get meta tensors (inside a ``torch.device("meta")`` block)."""
    return torch.get_default_device().type == "meta"


def from_pretrained(cls: Any, name: str, **kwargs: Any) -> Any:
    """``cls.from_pretrained(name, **kwargs)``; on the meta device the same architecture from its config
    (``kwargs`` other than dtype / attn_implementation / config override config fields, as there)."""
    if not building_on_meta():
        return cls.from_pretrained(name, **kwargs)
    config = kwargs.get("config")
    if config is None:
        overrides = {k: v for k, v in kwargs.items() if k not in _CONFIG_ONLY}
        config = AutoConfig.from_pretrained(name, **overrides)
    dtype = kwargs.get("dtype", kwargs.get("torch_dtype"))
    extra = {k: v for k, v in (("dtype", dtype), ("attn_implementation", kwargs.get("attn_implementation")))
             if v is not None}
    return cls.from_config(config, **extra)
