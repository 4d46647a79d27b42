"""The meter of benchmarks/gpu_hub_vlm.py: per-batch counts made in the loader, step timestamps, the rates."""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch


def batch_stats(batch: dict[str, Any], count: Any) -> dict[str, Any]:
    """A collated batch's real (non-pad) tokens, model FLOPs (vlmtrain.models.speed.flops, vision counted) and
    fingerprint (target count, sum of target ids: the same for the same samples, padded or packed)."""
    layout = batch.get("pack_stats")
    mask = batch.get("attention_mask")
    tokens = int(layout["tokens"]) if isinstance(layout, dict) else (
        int(mask.sum()) if mask is not None else batch["input_ids"].numel())
    labels = batch["labels"]
    kept = labels[labels != -100]
    return {"tokens": tokens, "capacity": batch["input_ids"].numel(),
            "flops": float(count(batch)) if count is not None else math.nan,
            "fingerprint": (int(kept.numel()), int(kept.long().sum()))}


class Counted:
    """A collator whose batches carry their :func:`batch_stats` under ``_meter``, computed where the collator
    runs (a loader worker, on CPU tensors), so that counting never waits for the GPU; the training loop's fetch
    hook (:meth:`Meter.fetched`) takes the key out before the model sees the batch."""

    def __init__(self, collator: Any, count: Any) -> None:
        self.collator, self.count = collator, count

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["collator"], name)

    def __call__(self, rows: list[Any]) -> dict[str, Any]:
        batch = self.collator(rows)
        if isinstance(batch, dict) and "input_ids" in batch:
            batch["_meter"] = batch_stats(batch, self.count)
        return batch


@dataclass
class Meter:
    """Per contender: a timestamp at the end of every optimizer step (after a CUDA sync) and, per batch the
    training loop fetched, the seconds it waited for it and its :func:`batch_stats`, tagged with the number of
    steps done when it was fetched."""

    device: torch.device = torch.device("cpu")
    init: float | None = None  # checksum of the weights the contender started from
    trainable: int | None = None  # parameters that train
    stamps: list[float] = field(default_factory=list)
    fetches: list[tuple[int, float, int, float, int]] = field(default_factory=list)
    first_batch: tuple[int, int] | None = None
    progress: bool = False  # print every step's time on stderr (--progress)
    created: float = field(default_factory=time.perf_counter)
    profile_after: int | None = None  # profile the 2 steps after this many (--profile)
    _profiler: Any = None

    def stamp(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        self.stamps.append(time.perf_counter())
        if self.profile_after is not None:
            self._profile_step(len(self.stamps))
        if self.progress:  # (stderr: the trainers' stdout is captured)
            waited = sum(f[1] for f in self.fetches if f[0] == len(self.stamps) - 1)
            print(f"    step {len(self.stamps)} at {self.stamps[-1] - self.created:.1f}s (waited {waited:.2f}s "
                  f"for data)", file=sys.stderr, flush=True)

    def _profile_step(self, done: int) -> None:
        """Start torch.profiler after step ``profile_after``, stop it 2 steps later and print where the time went:
        the top operators by their own device time (CPU time on CPU) and how busy the device was."""
        from torch.profiler import ProfilerActivity, profile

        if done == self.profile_after:
            cuda = self.device.type == "cuda"
            self._profiler = profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else []))
            self._profiler.__enter__()
        elif done == self.profile_after + 2 and self._profiler is not None:
            self._profiler.__exit__(None, None, None)
            events, wall = self._profiler.key_averages(), self.stamps[-1] - self.stamps[-3]
            key = "self_device_time_total" if self.device.type == "cuda" else "self_cpu_time_total"
            busy = sum(getattr(e, key) for e in events) / 1e6
            print(events.table(sort_by=key, row_limit=25, max_name_column_width=60), file=sys.stderr)
            print(f"    profiled steps {done - 1}-{done}: {wall:.2f} s wall, {busy:.2f} s of operator self time on "
                  f"the {self.device.type} ({busy / wall:.0%} busy)", file=sys.stderr, flush=True)
            self._profiler = None

    def fetched(self, batch: Any, waited: float) -> None:
        stats = batch.pop("_meter", None) if isinstance(batch, dict) else None
        if stats is None:
            return
        if self.first_batch is None:
            self.first_batch = tuple(stats["fingerprint"])
        self.fetches.append((len(self.stamps), waited, stats["tokens"], stats["flops"], stats["capacity"]))

    def wrap(self, iterator: Iterator[Any]) -> Iterator[Any]:
        while True:
            start = time.perf_counter()
            try:
                batch = next(iterator)
            except StopIteration:
                return
            self.fetched(batch, time.perf_counter() - start)
            yield batch

    def window(self, warmup: int) -> dict[str, float]:
        """Rates over steps warmup+1 .. last (each step's batch: fetched after the step before it ended), the
        profiled steps and the step after them (the profiler's report) left out."""
        steps = len(self.stamps)
        if steps <= max(warmup, 1):
            raise RuntimeError(f"only {steps} steps ran; need more than --warmup {warmup} (and at least 2)")
        skip = set(range(self.profile_after + 1, self.profile_after + 4)) if self.profile_after is not None else set()
        counted = [k for k in range(max(warmup, 1) + 1, steps + 1) if k not in skip]
        wall = sum(self.stamps[k - 1] - self.stamps[k - 2] for k in counted)
        timed = [f for f in self.fetches if f[0] + 1 in counted]
        return {"steps": len(counted), "wall": wall, "tokens_per_s": sum(f[2] for f in timed) / wall,
                "flops_per_s": sum(f[3] for f in timed) / wall, "data_wait": sum(f[1] for f in timed) / wall,
                "fill": sum(f[2] for f in timed) / max(1, sum(f[4] for f in timed))}


def clock_callback(meter: Meter, base: type) -> Any:
    """A callback of the trainer's own kind (transformers' or vlmtrain's) that stamps the end of every step."""

    class Clock(base):  # type: ignore[misc, valid-type]
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
            meter.stamp()
            return control

    return Clock()
