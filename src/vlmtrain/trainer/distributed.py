"""torch.distributed helpers. Single-process runs see rank 0 of 1 and every collective is a no-op.

Launched by torchrun (RANK / WORLD_SIZE / LOCAL_RANK in the environment), :func:`init_from_env` starts the
process group: NCCL on GPUs, gloo on CPU. Metrics go through a gloo group on CPU tensors (:func:`metrics_group`),
so logging never allocates on a GPU or syncs an NCCL stream.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import os
import warnings
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .sharding import ShardingPlan, sharding_plan

_METRICS_GROUP = None


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def init_from_env(timeout_s: float = 600.0, cpu: bool = False) -> bool:
    """Start the default process group if torchrun launched several processes; returns whether distributed.
    NCCL on GPUs, gloo on CPU (also with ``cpu``: TrainingArguments.use_cpu)."""
    if is_distributed():
        return True
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return False
    backend = "nccl" if torch.cuda.is_available() and not cpu else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s))
    atexit.register(_free_at_exit)  # a script that ends without shutdown() still frees its groups in time
    return True


def metrics_group() -> object | None:
    """A gloo group for CPU-side reductions of logged metrics (the default group itself when it is gloo)."""
    global _METRICS_GROUP
    if not is_distributed():
        return None
    if dist.get_backend() == "gloo":
        return dist.group.WORLD
    if _METRICS_GROUP is None:
        _METRICS_GROUP = dist.new_group(backend="gloo")
    return _METRICS_GROUP


def all_reduce_sum(value: torch.Tensor) -> torch.Tensor:
    if is_distributed():
        value = value.clone()
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
    return value


def reduce_cpu(values: list[float], op: str = "sum") -> list[float]:
    """Element-wise sum (or max) of a list of floats over ranks, on CPU through the metrics group."""
    if not is_distributed() or not values:
        return values
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM, group=metrics_group())
    return t.tolist()


class NamedSums:
    """Sums over ranks of named values whose names may differ per rank (a loss one rank's window never saw, a
    skip reason only one rank met), with every rank running the same collectives whatever its own names: the
    names summed are those agreed so far (the same list on every rank, each rank sending 0 for a name it lacks),
    plus a flag that some rank has a name not yet agreed; only then are the ranks' names gathered once and the
    new ones summed too. The agreed names are kept, so a run settles on its set of names after its first
    reductions and later ones take one all-reduce. In one process: the values themselves."""

    def __init__(self) -> None:
        self.names: list[str] = []

    def reduce(self, values: dict[str, list[float]], width: int) -> dict[str, list[float]]:
        """``values``: this rank's name -> ``width`` floats; returns every agreed name (each one some rank had in
        this or an earlier call) -> its floats summed over ranks, 0 where no rank has it now: the same names on
        every rank. Every rank must call it, with the same ``width``."""
        zeros = [0.0] * width
        known = set(self.names)
        new = any(name not in known for name in values)
        flat = reduce_cpu([float(new)] + [x for name in self.names for x in values.get(name, zeros)])
        summed = flat[1:]
        if flat[0] > 0:  # some rank has a name the others have not agreed on yet: agree on the union
            union = set().union(*(set(names) for names in all_gather_objects(sorted(values))))
            added = sorted(union - known)
            summed += reduce_cpu([x for name in added for x in values.get(name, zeros)])
            self.names += added
        return {name: summed[i * width:(i + 1) * width] for i, name in enumerate(self.names)}


def all_gather_objects(obj: object) -> list[object]:
    """Every rank's ``obj`` (picklable), in rank order, through the gloo metrics group."""
    if not is_distributed():
        return [obj]
    out: list[object] = [None] * world_size()
    dist.all_gather_object(out, obj, group=metrics_group())
    return out


def broadcast_object(obj: object, src: int) -> object:
    """Rank ``src``'s ``obj`` (picklable) on every rank, through the gloo metrics group."""
    if not is_distributed():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=metrics_group())
    return box[0]


def failed_ranks(failed: bool) -> list[int]:
    """The ranks that report ``failed``: a collective every rank calls, so one rank's error (e.g. a full disk)
    reaches all of them at once instead of leaving the others waiting out ddp_timeout at the next barrier."""
    if not is_distributed():
        return [0] if failed else []
    flags = [0.0] * world_size()
    flags[rank()] = float(failed)
    return [r for r, flag in enumerate(reduce_cpu(flags)) if flag]


def barrier() -> None:
    if is_distributed():
        dist.barrier()


def shutdown(wait: bool = True) -> None:
    """End torch.distributed before the interpreter exits: wait for every rank (``wait``), destroy the process
    groups, then free them. destroy_process_group() only unregisters a group; the group object (with gloo's
    worker and transport threads) lives on while anything references it, and FSDP2's DeviceMesh stays in
    torch's DTensor caches. Freed only during interpreter teardown, a group can release tensors on a gloo
    thread after Python is gone: 'terminate called without an active exception', SIGABRT, a failed job after a
    finished run. Dropping the meshes' group references here joins those threads while Python is alive."""
    global _METRICS_GROUP
    if is_distributed():
        if wait:
            dist.barrier()
        dist.destroy_process_group()
    _METRICS_GROUP = None
    from torch.distributed.device_mesh import DeviceMesh

    for obj in gc.get_objects():
        # type(), not isinstance(): DeviceMesh's metaclass reads obj.__class__, and objects such as
        # torch.distributed.reduce_op warn (FutureWarning) on any attribute read.
        if issubclass(type(obj), DeviceMesh):
            getattr(obj, "_pg_registry", {}).clear()
    gc.collect()


def _free_at_exit() -> None:
    """For scripts that never call shutdown(): free destroyed groups before Python's teardown, and end gloo ones
    still running. An NCCL group left running stays the script's (torch warns): destroying it here could block."""
    if not is_distributed() or dist.get_backend() == "gloo":
        shutdown(wait=False)


def wrap_model(model: nn.Module, device: torch.device, fsdp: bool = False, bf16: bool = False,
               ddp_kwargs: dict[str, Any] | None = None, sharding: ShardingPlan | None = None) -> nn.Module:
    """The module the training loop calls: with several processes, sharded in place by the ``sharding`` plan
    (``fsdp``) or wrapped in DistributedDataParallel (with ``ddp_kwargs``: TrainingArguments.ddp_kwargs(), e.g.
    find_unused_parameters); else the model itself."""
    if fsdp and world_size() > 1:
        plan = sharding_plan(sharding)
        return model if plan.is_sharded(model) else plan.shard_model(model, bf16)
    if fsdp:
        warnings.warn("train.fsdp needs several processes (torchrun): training unsharded.", stacklevel=3)
    if world_size() <= 1:
        return model
    from torch.nn.parallel import DistributedDataParallel

    ids = [device.index] if device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=ids, **(ddp_kwargs or {}))


def maybe_no_sync(model: nn.Module, sync: bool) -> contextlib.AbstractContextManager:
    """DDP's no_sync() on micro-steps that do not end an accumulation window: gradients are all-reduced once."""
    if sync or not hasattr(model, "no_sync"):
        return contextlib.nullcontext()
    return model.no_sync()
