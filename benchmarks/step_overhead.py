"""The demo's step: vlmtrain.Trainer against a bare PyTorch loop, and where the whole demo's time goes.

Part 1 (steps): the demo config's model (configs/shapes-tiny.yaml unless --config) trained from the same
initial weights on the same collated batches (collated once, before any timing: data costs nothing here) by

  bare      forward, loss.backward(), clip_grad_norm_, AdamW.step, LambdaLR.step (the config's schedule),
            zero_grad; loss.item() only at logging steps
  vlmtrain  vlmtrain.Trainer with the config's TrainingArguments (no evaluation, no checkpoints, no progress
            bar), fed the same batches in the same order

Each run stamps wall-clock and process CPU time at the end of every optimizer step; a run's step time is the
mean over steps --warmup+1 .. --steps. Variants alternate (bare, vlmtrain, vlmtrain, bare, ...) and the ratio is
the median of the per-round ratios. Both must end at the same probe loss (within 0.1%) or the script exits 1.

Part 2 (--split): the whole demo (run.demo, as `vlmtrain demo` runs it) with its wall time split into building,
data wait, forward+backward, optimizer (clip + AdamW), the loop's own bookkeeping (schedule, logging,
callbacks, throughput/FLOP counting), evaluation during training, checkpointing, and the final evaluation and
report. Exclusive times: a nested call counts once, under its innermost category.

    python benchmarks/step_overhead.py                      # part 1: 150 steps x 4 rounds, ~2 min on 2 cores
    python benchmarks/step_overhead.py --split              # part 1, then the whole demo (~10 min)
    python benchmarks/step_overhead.py --split-only --split-set train.max_steps=1000
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import io
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from typing import Any

import torch
from torch.utils.data import Dataset

import vlmtrain
from vlmtrain import run
from vlmtrain.config import load_run_config
from vlmtrain.trainer.optim import create_scheduler

PROBE_TOLERANCE = 1e-3


# -- part 1: per-step cost -----------------------------------------------------------------------------------
class InOrder(Dataset):
    """Pre-collated batches served in a fixed order whatever index the sampler asks for."""

    def __init__(self, batches: list[dict[str, Any]]) -> None:
        self.batches, self.served = batches, 0

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, index: int) -> dict[str, Any]:
        batch = self.batches[self.served % len(self.batches)]
        self.served += 1
        return batch


def unwrap(items: list[dict[str, Any]]) -> dict[str, Any]:
    return items[0]  # batch size 1 of a pre-collated batch


def load_cfg(opts: argparse.Namespace, out_dir: str, **extra: Any):
    overrides = {"train.output_dir": out_dir, **dict(kv.split("=", 1) for kv in opts.set), **extra}
    return load_run_config(opts.config, overrides)


def collate_batches(opts: argparse.Namespace) -> tuple[torch.nn.Module, list[dict[str, Any]], list[dict[str, Any]],
                                                      dict[str, Any], Any]:
    """The demo's initial model, `steps` training batches as its Trainer collates them, the same batches as model
    inputs (what Trainer._prepare_inputs passes to forward: what the bare loop trains on), the model inputs of a
    probe batch, and the config."""
    with tempfile.TemporaryDirectory(prefix="step-overhead-") as out:
        cfg = load_cfg(opts, out, **{"train.max_steps": opts.steps, "data.num_eval": 0,
                                     "train.eval_strategy": "no", "train.save_strategy": "no"})
        trainer = run.build(cfg)
        loader = trainer.get_train_dataloader()
        batches = []
        for batch in loader:
            batches.append(batch)
            if len(batches) == opts.steps + 1:
                break
        probe = trainer._prepare_inputs(batches.pop())
        return trainer.model, batches, [trainer._prepare_inputs(b) for b in batches], probe, cfg


def probe_loss(model: torch.nn.Module, probe: dict[str, Any]) -> float:
    model.eval()
    with torch.no_grad():
        return float(model(**probe)["loss"])


def run_bare(model: torch.nn.Module, batches: list[dict[str, Any]], cfg: Any) -> list[tuple[float, float]]:
    args = cfg.train
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2),
                                  eps=args.adam_epsilon, weight_decay=args.weight_decay)
    scheduler = create_scheduler(optimizer, args, len(batches))  # the same LambdaLR as the Trainer's
    stamps, running = [], torch.zeros(())
    model.train()
    for step, inputs in enumerate(batches, start=1):
        loss = model(**inputs)["loss"]
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        running += loss.detach()
        if step % args.logging_steps == 0:
            running.item()
            running.zero_()
        stamps.append((time.perf_counter(), time.process_time()))
    return stamps


class _Stamps(vlmtrain.TrainerCallback):
    def __init__(self) -> None:
        self.stamps: list[tuple[float, float]] = []

    def on_step_end(self, args, state, control, **kwargs):
        self.stamps.append((time.perf_counter(), time.process_time()))


def run_vlmtrain(model: torch.nn.Module, batches: list[dict[str, Any]], cfg: Any) -> list[tuple[float, float]]:
    stamps = _Stamps()
    with tempfile.TemporaryDirectory(prefix="step-overhead-") as out:
        args = copy.deepcopy(cfg.train)
        args.output_dir, args.per_device_train_batch_size, args.disable_tqdm = out, 1, True
        args.max_steps, args.eval_strategy, args.save_strategy = len(batches), "no", "no"
        trainer = vlmtrain.Trainer(model, args, data_collator=unwrap, train_dataset=InOrder(batches),
                                   callbacks=[stamps])
        with contextlib.redirect_stdout(io.StringIO()):
            trainer.train()
    return stamps.stamps


def step_times(stamps: list[tuple[float, float]], warmup: int) -> tuple[float, float]:
    (w0, c0), (w1, c1) = stamps[warmup - 1], stamps[-1]
    n = len(stamps) - warmup
    return (w1 - w0) / n * 1e3, (c1 - c0) / n * 1e3


def part_steps(opts: argparse.Namespace) -> bool:
    model0, batches, inputs, probe, cfg = collate_batches(opts)
    shapes = batches[0]["input_ids"].shape
    print(f"{opts.config}: {sum(p.numel() for p in model0.parameters()) / 1e6:.2f}M params, batch {tuple(shapes)} "
          f"tokens, {batches[0]['pixel_values'].shape[0] if 'pixel_values' in batches[0] else 0} images; "
          f"{opts.steps} steps (timed from {opts.warmup + 1}), {opts.rounds} rounds, torch threads "
          f"{torch.get_num_threads()}")
    times: dict[str, list[tuple[float, float]]] = defaultdict(list)
    probes: dict[str, list[float]] = defaultdict(list)
    for r in range(opts.rounds):
        order = ("bare", "vlmtrain") if r % 2 == 0 else ("vlmtrain", "bare")
        for name in order:
            model = copy.deepcopy(model0)
            torch.manual_seed(0)
            stamps = run_bare(model, inputs, cfg) if name == "bare" else run_vlmtrain(model, batches, cfg)
            if len(stamps) != opts.steps:
                raise SystemExit(f"{name} ran {len(stamps)} steps, expected {opts.steps}")
            times[name].append(step_times(stamps, opts.warmup))
            probes[name].append(probe_loss(model, probe))
        print(f"  round {r + 1}: " + "  ".join(f"{n} {times[n][-1][0]:.2f} ms" for n in order), flush=True)
    print("\nms per step (median over rounds)      wall     cpu")
    for name in ("bare", "vlmtrain"):
        print(f"  {name:<34}{statistics.median(t[0] for t in times[name]):>8.2f}"
              f"{statistics.median(t[1] for t in times[name]):>8.2f}")
    ratios = {clock: statistics.median(v[clock] / b[clock] for v, b in zip(times["vlmtrain"], times["bare"]))
              for clock in (0, 1)}
    print(f"  vlmtrain / bare (median of per-round ratios): wall {ratios[0]:.3f}x, cpu {ratios[1]:.3f}x "
          f"(goal <= 1.05x)")
    values = [v for name in probes for v in probes[name]]
    same = max(values) - min(values) <= PROBE_TOLERANCE * abs(statistics.mean(values))
    print(f"same-work check, probe losses {min(values):.6f}..{max(values):.6f}: {'ok' if same else 'DIFFER'}")
    return same


# -- part 2: the whole demo, split -----------------------------------------------------------------------------
class Split:
    """Exclusive wall time per category: a timed call inside another counts only under its own category."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self._stack: list[list[float]] = []  # per open call: [children's seconds]

    def wrap(self, obj: Any, attr: str, category: str | Any) -> None:
        """Time obj.attr under `category` (or under category() at call time, if it is callable)."""
        fn = getattr(obj, attr)

        @functools.wraps(fn)
        def timed(*a: Any, **kw: Any) -> Any:
            self._stack.append([0.0])
            start = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                elapsed = time.perf_counter() - start
                children = self._stack.pop()[0]
                name = category() if callable(category) else category
                self.seconds[name] += elapsed - children
                if self._stack:
                    self._stack[-1][0] += elapsed

        setattr(obj, attr, timed)

    def add(self, category: str, seconds: float) -> None:
        self.seconds[category] += seconds
        if self._stack:
            self._stack[-1][0] += seconds


def part_split(opts: argparse.Namespace) -> None:
    split, phase = Split(), {"training": True}
    real_build = run.build

    class _Instrument(vlmtrain.TrainerCallback):
        """Wraps what only exists once train() has set up (optimizer, scheduler, throughput meter)."""

        def __init__(self, trainer: Any) -> None:
            self.trainer = trainer

        def on_train_begin(self, args, state, control, **kwargs):
            t = self.trainer
            split.wrap(t.optimizer, "step", "optimizer")
            # (not lr_scheduler.step: a scheduler's state_dict is its __dict__, and a wrapper there cannot be pickled)
            split.wrap(torch.nn.utils, "clip_grad_norm_", "optimizer")
            add_batch = t._throughput.add_batch

            def add_batch_timed(batch: Any, wait: float) -> None:
                split.add("data wait", wait)
                add_batch(batch, wait)

            t._throughput.add_batch = add_batch_timed

        def on_train_end(self, args, state, control, **kwargs):
            phase["training"] = False

    def build(cfg: Any, checkpoint: str | None = None) -> Any:
        start = time.perf_counter()
        trainer = real_build(cfg, checkpoint)
        split.add("build", time.perf_counter() - start)
        split.wrap(trainer, "training_step", "forward+backward")
        split.wrap(trainer, "_optimizer_step", "loop bookkeeping")
        split.wrap(trainer, "_save_checkpoint", "checkpointing")
        for name in ("evaluate", "predict"):
            split.wrap(trainer, name, lambda: "evaluation in training" if phase["training"]
                       else "final evaluation + report")
        trainer.add_callback(_Instrument(trainer))
        return trainer

    real_clip, real_report = torch.nn.utils.clip_grad_norm_, run._write_report
    run.build = build
    split.wrap(run, "_write_report", "final evaluation + report")
    try:
        with tempfile.TemporaryDirectory(prefix="step-overhead-demo-") as out:
            overrides = dict(kv.split("=", 1) for kv in opts.split_set)
            start = time.perf_counter()
            run_demo(opts, out, overrides)
            total = time.perf_counter() - start
    finally:
        run.build, run._write_report, torch.nn.utils.clip_grad_norm_ = real_build, real_report, real_clip
    accounted = sum(split.seconds.values())
    print(f"\nthe demo's {total:.1f} s of wall time (exclusive; torch threads {torch.get_num_threads()}):")
    order = ["build", "data wait", "forward+backward", "optimizer", "loop bookkeeping", "evaluation in training",
             "checkpointing", "final evaluation + report"]
    for name in order:
        print(f"  {name:<28}{split.seconds[name]:>8.1f} s  {split.seconds[name] / total:>6.1%}")
    print(f"  {'the rest (loop, printing)':<28}{total - accounted:>8.1f} s  {(total - accounted) / total:>6.1%}")


def run_demo(opts: argparse.Namespace, out: str, overrides: dict[str, str]) -> None:
    """run.demo with extra config overrides (e.g. train.max_steps), printing what `vlmtrain demo` prints."""
    if not overrides:
        run.demo(output_dir=out, config=opts.config)
        return
    real_load = run.load_run_config

    def load(path: Any, extra: dict[str, Any] | None = None) -> Any:
        return real_load(path, {**(extra or {}), **overrides})

    run.load_run_config = load
    try:
        run.demo(output_dir=out, config=opts.config)
    finally:
        run.load_run_config = real_load


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default=str(run.find_demo_config()))
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override (part 1)")
    p.add_argument("--split", action="store_true", help="also run the whole demo and split its wall time")
    p.add_argument("--split-only", action="store_true", help="only the demo's split")
    p.add_argument("--split-set", action="append", default=[], metavar="KEY=VALUE",
                   help="config override for the demo run, e.g. train.max_steps=1000")
    opts = p.parse_args(argv)
    if opts.threads:
        torch.set_num_threads(opts.threads)
    print(f"torch {torch.__version__}  vlmtrain {vlmtrain.__version__}  cpus {os.cpu_count()}  "
          f"load average {os.getloadavg()[0]:.2f}")
    ok = True
    if not opts.split_only:
        ok = part_steps(opts)
    if opts.split or opts.split_only:
        part_split(opts)
    print(f"load average at the end {os.getloadavg()[0]:.2f}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
