"""Per-step overhead of vlmtrain.Trainer against a bare PyTorch loop and transformers.Trainer.

The three variants train the same tiny random-init Llama (same init seed) on the same random token
sequences (fixed length: no padding), with the same batch size, step count, AdamW (lr, no weight decay),
linear schedule without warmup, gradient clipping at 1.0, fp32 and no gradient accumulation:

  bare          a plain loop: forward, backward, clip_grad_norm_, optimizer.step, scheduler.step, zero_grad
                (DataLoader with the same collator; loss.item() only at logging steps; the model's KV cache
                off, as transformers.Trainer sets it: a training forward needs none; --no-cache turns it
                off for vlmtrain too)
  vlmtrain      vlmtrain.Trainer (save_strategy="no", eval_strategy="no", disable_tqdm=True)
  transformers  transformers.Trainer (same settings, report_to="none", use_cpu=True)

Each run records a timestamp at the end of every optimizer step (a callback's on_step_end for the trainers,
the loop itself for the bare one), both wall-clock (perf_counter) and process CPU time (process_time, which
other processes on a shared machine disturb less: with --threads 1 it is the better gauge of overhead). The
step time of a run is (t[steps] - t[warmup]) / (steps - warmup): the first `--warmup` steps and all setup are
left out, logging steps are in. Variants run interleaved (the order rotates every round: a b c, b c a,
c a b, ...) and the tables show medians over the rounds, the relative spread ((max - min) / median) and two
ratios: of the medians, and the median (with its interquartile range) of the ratios taken within each round
(adjacent runs, so it cancels the slow drifts of a shared machine best; the goal check uses it).

All three read the batches in the same order (the dataset serves its rows in a fixed order whatever index
the sampler asks for, so each sampler still does its own shuffle but cannot change the data), which makes
the runs numerically comparable: the script prints each variant's last logged training loss and the loss
of the trained model on a fixed probe batch, and checks that they agree.

    python benchmarks/overhead.py                        # defaults: 2-3 minutes on 2 busy cores
    python benchmarks/overhead.py --steps 200 --repeats 9 --hidden 128 --threads 2
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import math
import os
import statistics
import sys
import tempfile
import time
import warnings

import torch
import transformers
from torch.utils.data import DataLoader, Dataset
from transformers import LlamaConfig, LlamaForCausalLM

import vlmtrain
from vlmtrain.data.collate import DefaultCollator

VARIANTS = ("bare", "vlmtrain", "transformers")
LR = 1e-3
MAX_GRAD_NORM = 1.0
MODEL_SEED = 0
DATA_SEED = 1234
TRAINER_SEED = 42


# -- model and data -----------------------------------------------------------------------------------------
def make_model(opts: argparse.Namespace) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=opts.vocab, hidden_size=opts.hidden, intermediate_size=4 * opts.hidden,
        num_hidden_layers=opts.layers, num_attention_heads=4, num_key_value_heads=4,
        max_position_embeddings=opts.seq_len, tie_word_embeddings=False, attn_implementation="sdpa")
    config.use_cache = not opts.no_cache
    torch.manual_seed(MODEL_SEED)
    return LlamaForCausalLM(config).float()


class InOrderTokens(Dataset):
    """Random token rows served in a fixed order whatever index is asked for: every variant's sampler does
    its usual work, yet all of them train on the same sequence of batches."""

    def __init__(self, rows: torch.Tensor) -> None:
        self.rows = rows
        self.served = 0

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        row = self.rows[self.served % len(self.rows)]
        self.served += 1
        return {"input_ids": row, "labels": row}


def make_rows(opts: argparse.Namespace) -> torch.Tensor:
    g = torch.Generator().manual_seed(DATA_SEED)
    # One epoch holds exactly `steps` batches: no epoch boundary inside a run.
    return torch.randint(0, opts.vocab, (opts.steps * opts.batch_size, opts.seq_len), generator=g)


def probe_loss(model: torch.nn.Module, opts: argparse.Namespace) -> float:
    g = torch.Generator().manual_seed(DATA_SEED + 1)
    ids = torch.randint(0, opts.vocab, (opts.batch_size, opts.seq_len), generator=g)
    model.eval()
    with torch.no_grad():
        return float(model(input_ids=ids, labels=ids).loss)


def linear_lambda(total: int):
    return lambda step: max(0.0, (total - step) / max(1, total))


# -- the three variants: each returns ((wall, cpu) timestamps at each step end, last logged loss, model) ---------
Run = tuple[list[tuple[float, float]], float, torch.nn.Module]


def run_bare(opts: argparse.Namespace, out_dir: str) -> Run:
    model = make_model(opts)
    model.config.use_cache = False  # a training loop needs no KV cache (transformers.Trainer sets this too)
    torch.manual_seed(TRAINER_SEED)
    loader = DataLoader(InOrderTokens(make_rows(opts)), batch_size=opts.batch_size, shuffle=True,
                        collate_fn=DefaultCollator())
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, linear_lambda(opts.steps))
    stamps, last_loss, running, since_log = [], math.nan, torch.zeros(()), 0
    model.train()
    for step, batch in enumerate(loader, start=1):
        loss = model(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        running += loss.detach()
        since_log += 1
        stamps.append((time.perf_counter(), time.process_time()))
        if step % opts.logging_steps == 0:
            last_loss = running.item() / since_log
            running.zero_()
            since_log = 0
            print({"loss": last_loss, "learning_rate": scheduler.get_last_lr()[0], "step": step}, flush=True)
        if step >= opts.steps:
            break
    return stamps, last_loss, model


class _VlmStamps(vlmtrain.TrainerCallback):
    def __init__(self) -> None:
        self.stamps: list[tuple[float, float]] = []

    def on_step_end(self, args, state, control, **kwargs):
        self.stamps.append((time.perf_counter(), time.process_time()))


class _HfStamps(transformers.TrainerCallback):
    def __init__(self) -> None:
        self.stamps: list[tuple[float, float]] = []

    def on_step_end(self, args, state, control, **kwargs):
        self.stamps.append((time.perf_counter(), time.process_time()))


def _last_loss(log_history: list[dict]) -> float:
    return next((float(h["loss"]) for h in reversed(log_history) if "loss" in h), math.nan)


def run_vlmtrain(opts: argparse.Namespace, out_dir: str) -> Run:
    model = make_model(opts)
    args = vlmtrain.TrainingArguments(
        output_dir=out_dir, max_steps=opts.steps, per_device_train_batch_size=opts.batch_size,
        learning_rate=LR, weight_decay=0.0, lr_scheduler_type="linear", warmup_steps=0,
        max_grad_norm=MAX_GRAD_NORM, gradient_accumulation_steps=1, logging_steps=opts.logging_steps,
        save_strategy="no", eval_strategy="no", disable_tqdm=True, report_to="none", seed=TRAINER_SEED)
    timer = _VlmStamps()
    trainer = vlmtrain.Trainer(model=model, args=args, data_collator=DefaultCollator(),
                               train_dataset=InOrderTokens(make_rows(opts)), callbacks=[timer])
    trainer.train()
    return timer.stamps, _last_loss(trainer.state.log_history), model


def run_transformers(opts: argparse.Namespace, out_dir: str) -> Run:
    model = make_model(opts)
    args = transformers.TrainingArguments(
        output_dir=out_dir, max_steps=opts.steps, per_device_train_batch_size=opts.batch_size,
        learning_rate=LR, weight_decay=0.0, lr_scheduler_type="linear", warmup_steps=0,
        max_grad_norm=MAX_GRAD_NORM, gradient_accumulation_steps=1, logging_steps=opts.logging_steps,
        save_strategy="no", eval_strategy="no", disable_tqdm=True, report_to="none", seed=TRAINER_SEED,
        use_cpu=True, optim="adamw_torch", bf16=False, fp16=False)
    timer = _HfStamps()
    trainer = transformers.Trainer(model=model, args=args, data_collator=DefaultCollator(),
                                   train_dataset=InOrderTokens(make_rows(opts)), callbacks=[timer])
    trainer.train()
    return timer.stamps, _last_loss(trainer.state.log_history), model


RUNNERS = {"bare": run_bare, "vlmtrain": run_vlmtrain, "transformers": run_transformers}


def timed_run(name: str, opts: argparse.Namespace) -> dict:
    torch.set_num_threads(opts.threads)
    gc.collect()
    sink = io.StringIO()  # the log lines of all three variants go here, not to the terminal
    with tempfile.TemporaryDirectory(prefix=f"overhead-{name}-") as out_dir, contextlib.redirect_stdout(sink):
        stamps, last_loss, model = RUNNERS[name](opts, out_dir)
    if len(stamps) != opts.steps:
        raise RuntimeError(f"{name}: {len(stamps)} optimizer steps recorded, expected {opts.steps}.")
    if torch.get_num_threads() != opts.threads:
        raise RuntimeError(f"{name} changed torch's thread count to {torch.get_num_threads()}.")
    w = opts.warmup
    wall, cpu = ((stamps[-1][i] - stamps[w - 1][i]) / (opts.steps - w) for i in (0, 1))
    return {"wall": wall, "cpu": cpu, "last_loss": last_loss, "probe_loss": probe_loss(model, opts)}


# -- report ------------------------------------------------------------------------------------------------
CLOCKS = {"wall": "wall-clock (perf_counter)", "cpu": "process CPU time (process_time)"}


def spread(values: list[float]) -> float:
    return (max(values) - min(values)) / statistics.median(values)


def paired(results: dict[str, list[dict]], clock: str, a: str, b: str) -> tuple[float, float, float]:
    """a's step time / b's step time in the same round: (median, first quartile, third quartile) over rounds."""
    ratios = [x[clock] / y[clock] for x, y in zip(results[a], results[b])]
    q1, _, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else (ratios[0],) * 3
    return statistics.median(ratios), q1, q3


def report_clock(results: dict[str, list[dict]], clock: str) -> tuple[float, float]:
    med = {v: statistics.median(r[clock] for r in results[v]) for v in VARIANTS}
    print(f"\n{CLOCKS[clock]}, ms per optimizer step over {len(results['bare'])} rounds")
    print(f"  {'variant':<14}{'median':>9}{'min':>9}{'max':>9}{'spread':>9}{'x bare':>9}")
    for v in VARIANTS:
        times = [r[clock] * 1e3 for r in results[v]]
        print(f"  {v:<14}{med[v] * 1e3:>9.3f}{min(times):>9.3f}{max(times):>9.3f}{spread(times):>9.1%}"
              f"{med[v] / med['bare']:>9.3f}")
    print(f"  {'ratio':<26}{'of medians':>12}{'per-round: median':>20}{'IQR':>16}")
    for a, b in (("vlmtrain", "bare"), ("vlmtrain", "transformers"), ("transformers", "bare")):
        m, q1, q3 = paired(results, clock, a, b)
        print(f"  {a + '/' + b:<26}{med[a] / med[b]:>12.3f}{m:>20.3f}{f'{q1:.3f}-{q3:.3f}':>16}")
    return paired(results, clock, "vlmtrain", "bare")[0], paired(results, clock, "vlmtrain", "transformers")[0]


def report(results: dict[str, list[dict]], opts: argparse.Namespace) -> bool:
    for clock in CLOCKS:
        vb, vt = report_clock(results, clock)
        print(f"  goal vlmtrain/bare <= 1.03: {'met' if vb <= 1.03 else 'NOT met'} ({vb:.3f}); "
              f"vlmtrain below transformers: {'yes' if vt < 1 else 'NO'} ({vt:.3f})")

    # Same work: every run of every variant must end at (nearly) the same losses.
    print(f"\nfinal losses (last round)\n  {'variant':<14}{'last logged':>14}{'probe batch':>14}")
    for v in VARIANTS:
        print(f"  {v:<14}{results[v][-1]['last_loss']:>14.6f}{results[v][-1]['probe_loss']:>14.6f}")
    probes = [r["probe_loss"] for v in VARIANTS for r in results[v]]
    logged = [r["last_loss"] for v in VARIANTS for r in results[v]]
    ok = all(max(x) - min(x) <= 1e-3 * abs(min(x)) for x in (probes, logged))
    print(f"same-work check, losses within 0.1% across all {len(probes)} runs: {'ok' if ok else 'FAILED'} "
          f"(probe {min(probes):.6f}..{max(probes):.6f}, last logged {min(logged):.6f}..{max(logged):.6f})")
    return ok


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--steps", type=int, default=100, help="optimizer steps per run")
    p.add_argument("--warmup", type=int, default=5, help="leading steps left out of the timing")
    p.add_argument("--repeats", type=int, default=21, help="interleaved rounds (each runs every variant once)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--logging-steps", type=int, default=10)
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads for every variant")
    p.add_argument("--no-cache", action="store_true",
                   help="build the model with config.use_cache=False for every variant (by default only the bare "
                        "loop turns the KV cache off, and transformers.Trainer does so itself)")
    opts = p.parse_args(argv)
    if not 1 <= opts.warmup < opts.steps:
        p.error("--warmup must be in [1, steps)")

    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    torch.set_num_threads(opts.threads)
    n_params = sum(p.numel() for p in make_model(opts).parameters())
    print(f"torch {torch.__version__}  transformers {transformers.__version__}  vlmtrain {vlmtrain.__version__}  "
          f"python {sys.version.split()[0]}  torch threads {torch.get_num_threads()}  cpus {os.cpu_count()}  "
          f"load average {os.getloadavg()[0]:.2f}")
    print(f"Llama: hidden {opts.hidden}, {opts.layers} layers, vocab {opts.vocab}, {n_params / 1e6:.2f}M params, "
          f"fp32 | batch {opts.batch_size} x seq {opts.seq_len} | {opts.steps} steps (timed from step "
          f"{opts.warmup + 1}), logging every {opts.logging_steps} | {opts.repeats} rounds | model built with "
          f"use_cache={not opts.no_cache}")

    for name in VARIANTS:  # one short untimed run each: imports, allocator and kernel warm-up
        timed_run(name, argparse.Namespace(**{**vars(opts), "steps": opts.warmup + 3}))

    results: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    for r in range(opts.repeats):
        order = VARIANTS[r % 3:] + VARIANTS[:r % 3]
        row = []
        for name in order:
            res = timed_run(name, opts)
            results[name].append(res)
            row.append(f"{name} {res['wall'] * 1e3:.2f}/{res['cpu'] * 1e3:.2f}")
        print(f"round {r + 1}/{opts.repeats} (ms/step wall/cpu): " + ", ".join(row), flush=True)
    ok = report(results, opts)
    print(f"load average at the end {os.getloadavg()[0]:.2f}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
