"""A logging window's rates: samples and tokens per second, the time spent waiting for data, training FLOPs per
second and MFU, and how full packed rows are (:class:`WindowRates`); and :class:`Throughput`, which counts the
window's samples and skipped samples (and the run's), checks the share of bad ones and reaches these figures:
vlmtrain.Trainer's ``window_stats`` part (trainer/parts.py).

A batch's ``pack_stats`` (from a collator: samples, real tokens, rows, capacity, images) gives the real token
counts of packed batches and the window's ``pack_fill`` (real tokens / row capacity), ``padding_fraction`` and
``images_per_pack`` (images per row). With ``flops`` (batch -> training FLOPs, from the trainer's
``flop_counter`` part: models/speed/flops.py) also ``tflops_per_second`` per device, and ``mfu`` with ``peak_tflops``;
a window in which counting a batch failed on some rank logs neither (a warning names the cause), later windows
do again.
"""

from __future__ import annotations

import hashlib
import time
import warnings
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

import torch

from ..errors import DataError, warn_caller
from ..trainer.distributed import NamedSums, all_gather_objects, reduce_cpu, world_size
from ..trainer.stats import RANK_SYNC_REASON, batch_samples, skipped_counts


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


class Throughput:
    """Samples and skipped samples over a logging window (skipped also in total, with the run's distinct bad
    samples, kept in checkpoints; too many bad ones stop training), and the window's rates that ``make_rates``
    (:class:`WindowRates`: samples, tokens and FLOPs per second, data wait, pack fill) makes with ``flops`` (batch
    -> training FLOPs, the ``flop_counter`` part's) and ``peak_tflops``. Without ``make_rates``, only the skipped
    samples are logged. vlmtrain.Trainer's ``window_stats`` part (trainer/parts.py)."""

    def __init__(self, flops: Callable[[Mapping[str, Any]], float] | None = None, peak_tflops: float | None = None,
                 make_rates: Callable[[Any, float | None], Any] | None = WindowRates) -> None:
        self.skipped_total: Counter[str] = Counter()  # (this rank's)
        # Digests of the names of the bad samples skipped (this rank's, the whole run): a sample read again
        # (each epoch) is skipped and counted again, but it is one bad sample.
        self.bad_samples: set[int] = set()
        self._names = NamedSums()
        self.rates = None if make_rates is None else make_rates(flops, peak_tflops)
        self.reset()

    def reset(self) -> None:
        self.samples = 0
        self.skipped: Counter[str] = Counter()
        self.bad_keys: list[str] = []
        if self.rates is not None:
            self.rates.reset()

    def exclude(self, seconds: float) -> None:
        """Leave time spent outside training (evaluation, checkpointing) out of the rates."""
        if self.rates is not None:
            self.rates.exclude(seconds)

    def add_batch(self, batch: Mapping[str, Any], wait_seconds: float) -> None:
        if self.rates is not None:
            self.rates.add_batch(batch, wait_seconds)
        skipped = skipped_counts(batch)
        self.skipped.update(skipped)
        self.skipped_total.update(skipped)
        keys = batch.get("skipped_keys") if isinstance(batch, Mapping) else None
        self.bad_samples.update(_digest(key) for key in keys or ())
        if keys and len(self.bad_keys) < 5:
            self.bad_keys += list(keys)[: 5 - len(self.bad_keys)]
        self.samples += batch_samples(batch) if isinstance(batch, Mapping) else 0

    def over_ranks(self) -> tuple[Counter[str], int]:
        """This window's skipped samples by reason and its samples, summed over ranks (one collective: every rank
        calls it at the same point, whatever reasons it met)."""
        mine = {f"skipped:{reason}": [float(n)] for reason, n in self.skipped.items()}
        summed = self._names.reduce({**mine, "samples": [float(self.samples)]}, 1)
        skipped = Counter({k[len("skipped:"):]: int(v[0]) for k, v in summed.items() if k != "samples" and v[0] > 0})
        return skipped, int(summed["samples"][0])

    def check_bad_fraction(self, limit: float, window: tuple[Counter[str], int] | None = None) -> None:
        """Raise if more than ``limit`` of this window's samples over all ranks (``window``: :meth:`over_ranks`,
        reduced here if not given) were skipped as bad (filtered ones aside): on every rank at once, with the
        same message. Every rank calls it at the same point."""
        if limit >= 1:
            return
        skipped, samples = window if window is not None else self.over_ranks()
        bad = sum(n for reason, n in skipped.items() if not reason.startswith("filtered") and reason != RANK_SYNC_REASON)
        if bad and bad > limit * (bad + samples):
            examples = [k for keys in all_gather_objects(self.bad_keys) for k in keys][:5]  # (rank order)
            raise DataError(
                f"{bad} of the last {bad + samples} training samples were bad ({dict(sorted(skipped.items()))}), "
                f"more than max_bad_sample_fraction={limit}. Examples: {', '.join(examples) or 'n/a'}. Fix the "
                f"data (e.g. `vlmtrain data inspect`) or raise max_bad_sample_fraction.")

    def compute(self, window: tuple[Counter[str], int] | None = None) -> dict[str, float]:
        """The window's rates and skipped samples by reason, over all ranks (``window``: :meth:`over_ranks`,
        reduced here if not given). Every rank calls it (collectives)."""
        skipped, _ = window if window is not None else self.over_ranks()
        out = {} if self.rates is None else self.rates.compute(self.samples)
        out.update({f"skipped_{reason}": n for reason, n in sorted(skipped.items())})
        return out

    def bad_samples_over_ranks(self) -> int:
        """How many distinct bad samples the run skipped (by name; resumes included), over ranks: a sample that
        two ranks read in different epochs counts once. Every rank calls it (a collective)."""
        return len(set().union(*all_gather_objects(sorted(self.bad_samples))))

    def state_dict(self) -> dict[str, Any]:
        """The run's counts a checkpoint keeps (this rank's): skips by reason, and the bad samples' digests."""
        return {"skipped": dict(self.skipped_total), "bad_samples": sorted(self.bad_samples)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.skipped_total.update(state.get("skipped", {}))
        self.bad_samples.update(state.get("bad_samples", ()))

    def run_totals(self, warn: bool) -> dict[str, float]:
        """The run's skipped samples by reason (resumes included) and its distinct bad samples, over ranks, as
        ``train_skipped_<reason>`` and ``train_bad_samples`` ({} when none was skipped); ``warn``: also the summary
        line as a warning (rank 0). Every rank calls it (collectives)."""
        skipped = self.total_over_ranks()
        bad = self.bad_samples_over_ranks()
        if not skipped:
            return {}
        if warn:
            warn_caller(skip_summary(skipped, bad))
        return {**{f"train_skipped_{reason}": n for reason, n in sorted(skipped.items())}, "train_bad_samples": bad}

    def total_over_ranks(self) -> Counter[str]:
        """The run's skipped samples by reason (``skipped_total``, resumes included), summed over ranks."""
        summed = NamedSums().reduce({reason: [float(n)] for reason, n in self.skipped_total.items()}, 1)
        return Counter({reason: int(v[0]) for reason, v in sorted(summed.items()) if v[0] > 0})


def skip_summary(skipped: Mapping[str, int], bad_samples: int) -> str:
    """The end-of-training line on skipped samples: the distinct bad samples and the skips (every read of a bad
    sample is a skip: once per epoch; filtered samples and rank-sync drops are skips, not bad samples)."""
    reads = dict(sorted(skipped.items()))
    line = f"{sum(reads.values())} training samples were skipped: {reads}"
    if not bad_samples or bad_samples == sum(reads.values()):  # (each skip its own sample: nothing to add)
        return line
    noun = "sample" if bad_samples == 1 else "samples"
    return f"{line} ({bad_samples} distinct bad {noun}: one is skipped at every read, e.g. each epoch)"


def _digest(name: str) -> int:
    """A stable 64-bit digest of a sample's name (``file:line (reason)``): the same in every process and run."""
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little")
