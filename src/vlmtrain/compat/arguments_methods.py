"""What transformers' TrainingArguments tells a script about the process it runs in (GPUs, ranks, who saves and
logs) and how it serializes itself (to_dict, to_json_string, to_sanitized_dict). The trainer reads none of it
(it reads `device`, defined with the fields); :func:`add_to` puts these on vlmtrain's TrainingArguments when
``vlmtrain`` is imported (vlmtrain.compat.arguments). The values come from torchrun's environment and
torch.distributed, never accelerate."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from dataclasses import fields
from datetime import timedelta
from enum import Enum
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


def _dist() -> Any:
    """vlmtrain.trainer.distributed, imported when a property asks (it imports torch, which reading the
    arguments' fields for the config's --help does not need)."""
    from ..trainer import distributed

    return distributed


def _env_int(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


class ArgumentsMethods:
    """transformers' derived properties of TrainingArguments; under torchrun (several processes) they follow
    torch.distributed once the process group is up, and torchrun's RANK / WORLD_SIZE / LOCAL_RANK before."""

    device: torch.device
    use_cpu: bool
    ddp_timeout: int
    per_device_train_batch_size: int
    per_device_eval_batch_size: int
    log_on_each_node: bool
    save_on_each_node: bool
    log_level: str
    log_level_replica: str

    @property
    def n_gpu(self) -> int:
        """GPUs this process uses: 1 on a GPU, 0 on the CPU. (transformers counts every visible GPU of a single
        process, which it then drives with nn.DataParallel; vlmtrain uses one GPU per process: launch torchrun.)"""
        return int(self.device.type == "cuda")

    @property
    def world_size(self) -> int:
        """Number of processes training together."""
        return _dist().world_size() if _dist().is_distributed() else _env_int("WORLD_SIZE", 1)

    @property
    def process_index(self) -> int:
        """This process's global rank."""
        return _dist().rank() if _dist().is_distributed() else _env_int("RANK", 0)

    @property
    def local_process_index(self) -> int:
        """This process's rank on its node."""
        return _env_int("LOCAL_RANK", 0)

    @property
    def should_log(self) -> bool:
        """Whether this process logs (transformers' rule: local rank 0 with log_on_each_node, else rank 0).
        vlmtrain's own metrics are reduced over ranks and written by rank 0 in any case."""
        return (self.local_process_index if self.log_on_each_node else self.process_index) == 0

    @property
    def should_save(self) -> bool:
        """Whether this process writes models and checkpoints: rank 0."""
        return (self.local_process_index if self.save_on_each_node else self.process_index) == 0

    @property
    def train_batch_size(self) -> int:
        """Samples per training micro-batch of this process."""
        return self.per_device_train_batch_size * max(1, self.n_gpu)

    @property
    def eval_batch_size(self) -> int:
        """Samples per evaluation batch of this process."""
        return self.per_device_eval_batch_size * max(1, self.n_gpu)

    @property
    def ddp_timeout_delta(self) -> timedelta:
        """ddp_timeout as the timedelta torch.distributed.init_process_group takes."""
        return timedelta(seconds=self.ddp_timeout)

    @property
    def parallel_mode(self) -> Any:
        """transformers' ParallelMode: DISTRIBUTED under torchrun with several processes, else NOT_PARALLEL
        (vlmtrain never drives several GPUs from one process)."""
        from transformers.training_args import ParallelMode

        return ParallelMode.DISTRIBUTED if self.world_size > 1 else ParallelMode.NOT_PARALLEL

    def get_process_log_level(self) -> int:
        """transformers' rule: log_level on the process that logs (should_log), log_level_replica on the others;
        'passive' keeps transformers' current verbosity."""
        from transformers.training_args import trainer_log_levels
        from transformers.utils import logging as hf_logging

        main, replica = trainer_log_levels[self.log_level], trainer_log_levels[self.log_level_replica]
        main = hf_logging.get_verbosity() if main == -1 else main
        replica = hf_logging.get_verbosity() if replica == -1 else replica
        return main if self.should_log else replica

    @contextlib.contextmanager
    def main_process_first(self, local: bool = True, desc: str = "work") -> Iterator[None]:
        """Run the block on the main process (of each node with local=True) first, the other processes after it
        (e.g. a datasets .map() that caches its result). Under torchrun it starts the process group if the
        Trainer has not yet (as transformers does when its arguments are built)."""
        if self.world_size <= 1:
            yield
            return
        _dist().init_from_env(self.ddp_timeout, cpu=self.use_cpu)
        is_main = (self.local_process_index if local else self.process_index) == 0
        try:
            if not is_main:
                _dist().barrier()
            yield
        finally:
            if is_main:
                _dist().barrier()

    # -- serialization, as transformers ------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """The fields as a dict with enums as their values, torch.dtype (under a `dtype` key of a dict field)
        as its name and tokens hidden, as transformers' to_dict."""
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.init}  # type: ignore[arg-type]
        for k, v in d.items():
            if isinstance(v, Enum):
                d[k] = v.value
            elif isinstance(v, list) and v and isinstance(v[0], Enum):
                d[k] = [x.value for x in v]
            elif isinstance(v, dict):
                d[k] = _dtypes_to_str(dict(v))
            if k.endswith("_token"):
                d[k] = f"<{k.upper()}>"
        return d

    def to_json_string(self) -> str:
        """to_dict() as indented JSON."""
        return json.dumps(self.to_dict(), indent=2)

    def to_sanitized_dict(self) -> dict[str, Any]:
        """to_dict() plus train/eval batch sizes, every value a bool, int, float, str or tensor (others as str):
        TensorBoard's hparams."""
        d = {**self.to_dict(), "train_batch_size": self.train_batch_size, "eval_batch_size": self.eval_batch_size}
        import torch

        valid = (bool, int, float, str, torch.Tensor)
        return {k: v if type(v) in valid else str(v) for k, v in d.items()}


def _dtypes_to_str(d: dict[str, Any]) -> dict[str, Any]:
    """transformers' _dict_dtype_to_str: a `dtype` key holding a torch.dtype becomes 'float32' etc., nested."""
    if d.get("dtype") is not None and not isinstance(d["dtype"], str):
        d["dtype"] = str(d["dtype"]).split(".")[1]
    for key, value in d.items():
        if isinstance(value, dict):
            d[key] = _dtypes_to_str(dict(value))
    return d


def add_to(cls: type) -> None:
    """Put ArgumentsMethods' properties and methods on ``cls`` (vlmtrain's TrainingArguments), as if it were one
    of its bases: a name ``cls`` defines itself is kept, and a subclass's own definitions still win."""
    for name, value in vars(ArgumentsMethods).items():
        if not name.startswith("__") and name not in vars(cls):
            setattr(cls, name, value)
