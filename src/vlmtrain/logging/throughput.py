"""A logging window's rates: samples and tokens per second, the time spent waiting for data, training FLOPs per
second and MFU, and how full packed rows are. The Trainer's Throughput (trainer/stats.py) counts the window's
samples and skipped samples and reaches these figures through its ``window_rates`` part, :class:`WindowRates` in
vlmtrain.Trainer (trainer/parts.py).

A batch's ``pack_stats`` (from a collator: samples, real tokens, rows, capacity, images) gives the real token
counts of packed batches and the window's ``pack_fill`` (real tokens / row capacity), ``padding_fraction`` and
``images_per_pack`` (images per row). With ``flops`` (batch -> training FLOPs, from the trainer's
``flop_counter`` part: models/speed/flops.py) also ``tflops_per_second`` per device, and ``mfu`` with ``peak_tflops``;
a window in which counting a batch failed on some rank logs neither (a warning names the cause), later windows
do again.
"""

from __future__ import annotations

import time
import warnings
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

import torch

from ..trainer.distributed import reduce_cpu, world_size


class WindowRates:
    """Tokens, FLOPs, data-wait time and packed-row layout over a logging window, and the rates they make."""

    def __init__(self, flops: Callable[[Mapping[str, Any]], float] | None = None,
                 peak_tflops: float | None = None) -> None:
        self.count_flops, self.peak_tflops = flops, peak_tflops
        self._failures: set[str] = set()
        self.reset()

    def reset(self) -> None:
        self.start = time.perf_counter()
        self.tokens = 0
        self.flops = 0.0
        self.count_failed = False  # a batch of this window could not be counted (on this rank)
        self.data_wait = 0.0
        self.excluded = 0.0
        self.layout: Counter[str] = Counter()

    def exclude(self, seconds: float) -> None:
        """Leave time spent outside training (evaluation, checkpointing) out of the rates."""
        self.excluded += seconds

    def add_batch(self, batch: Mapping[str, Any], wait_seconds: float) -> None:
        self.data_wait += wait_seconds
        if self.count_flops is not None and isinstance(batch, Mapping):
            try:
                self.flops += self.count_flops(batch)
            except Exception as e:  # noqa: BLE001 - a metric never stops training: this window's is left out
                self.count_failed = True
                cause = f"{type(e).__name__}: {e}"
                if cause not in self._failures:  # (once per cause, on the rank that met it)
                    self._failures.add(cause)
                    keys = sorted(k for k, v in batch.items() if isinstance(v, torch.Tensor))
                    warnings.warn(f"counting a batch's FLOPs failed ({cause}; the batch has {keys}): "
                                  f"tflops_per_second / mfu are left out of the logging windows where this happens",
                                  stacklevel=4)
        layout = batch.get("pack_stats") if isinstance(batch, Mapping) else None
        if isinstance(layout, Mapping):
            self.layout.update(layout)
            self.tokens += int(layout["tokens"])
            return
        ids = batch.get("input_ids") if isinstance(batch, Mapping) else None
        mask = batch.get("attention_mask") if isinstance(batch, Mapping) else None
        if isinstance(ids, torch.Tensor):
            self.tokens += int(mask.sum()) if isinstance(mask, torch.Tensor) else ids.numel()

    def compute(self, samples: int) -> dict[str, float]:
        """Rates over the window of ``samples`` (this rank's); under torch.distributed samples and tokens are
        summed over ranks, the data-wait fraction is the mean over ranks (``data_wait_fraction_max``: the slowest
        rank's) and so is ``tflops_per_second`` (each rank's own batches over this rank's time: a per-device
        rate). Every rank calls it (collectives)."""
        elapsed = max(time.perf_counter() - self.start - self.excluded, 1e-9)
        wait = min(1.0, self.data_wait / elapsed)
        samples, tokens, wait_sum, flops, failed = reduce_cpu([float(samples), float(self.tokens), wait, self.flops,
                                                               float(self.count_failed)])
        wait_max = reduce_cpu([wait], "max")[0]
        out = {"samples_per_second": round(samples / elapsed, 3),
               "data_wait_fraction": round(wait_sum / world_size(), 4)}
        if world_size() > 1:
            out["data_wait_fraction_max"] = round(wait_max, 4)
        if tokens:
            out["tokens_per_second"] = round(tokens / elapsed, 3)
        if self.count_flops is not None and not failed:  # (a window some rank could not count: left out)
            tflops = flops / world_size() / elapsed / 1e12
            out["tflops_per_second"] = float(f"{tflops:.4g}")
            if self.peak_tflops:
                out["mfu"] = float(f"{tflops / self.peak_tflops:.4g}")
        if self.layout["capacity"]:
            fill = self.layout["tokens"] / self.layout["capacity"]
            out.update(pack_fill=round(fill, 4), padding_fraction=round(1 - fill, 4),
                       images_per_pack=round(self.layout["images"] / self.layout["rows"], 3))
        return out

