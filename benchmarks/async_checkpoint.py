"""Training time hidden per checkpoint by train.async_checkpoint: the same run with no saves, synchronous saves
and asynchronous saves.

Trains a random-init Llama of some tens of MB (default: hidden 384, 4 layers, vocab 4096, 10.8M parameters, a
43 MB model.safetensors and a ~130 MB checkpoint with AdamW's state) for --steps steps, saving every
--save-steps (save_total_limit 2), in rounds that rotate the order of the three variants. Per variant it takes
the time the training loop stood still for checkpoints (sync: the whole write; async: copying the state to
CPU, waiting for the previous save, moving a written one into place; the wait for the run's last save after
its last step, which nothing can hide, is printed apart) and the wall time of train(). Printed per save, as
medians over rounds:

  stalled   the loop's standstill, sync vs async
  hidden    sync - async stall, and its fraction of the sync stall (1.0: the save is free for the loop)
  wall      train() with no saves, sync and async saves; (sync - none) / saves is what a synchronous save
            costs the run, (sync - async) / saves what async hides. On a busy machine this is noisy, and the
            writer thread only hides time when a core is free for it.

    python benchmarks/async_checkpoint.py                  # ~12 minutes on 2 busy cores (load ~7)
    python benchmarks/async_checkpoint.py --rounds 5 --hidden 512
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import statistics
import tempfile
import time
import warnings

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from vlmtrain import Trainer, TrainingArguments


class TimedTrainer(Trainer):
    """Adds up the time the training loop stands still for checkpoints: in _save_checkpoint (sync: the whole
    write; async: the CPU copy, and waiting for the previous save) and, for async saves, in publishing a written
    checkpoint at a step end and in waiting for the last one at the end of training."""

    stall = 0.0
    final_wait = 0.0  # (async) the last save, written after the last step: nothing left to hide it behind

    def _timed(self, method, *args):
        start = time.perf_counter()
        try:
            return method(*args)
        finally:
            self.stall += time.perf_counter() - start

    def _save_checkpoint(self) -> str:
        return self._timed(super()._save_checkpoint)

    def _publish_written_checkpoint(self) -> None:
        return self._timed(super()._publish_written_checkpoint)

    def _wait_for_checkpoint(self) -> None:
        start = time.perf_counter()
        self._timed(super()._wait_for_checkpoint)
        self.final_wait = time.perf_counter() - start


def build_model(args: argparse.Namespace) -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=3 * args.hidden,
        num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64, num_key_value_heads=args.hidden // 64,
        max_position_embeddings=args.seq_len, use_cache=False))


def data(args: argparse.Namespace) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    rows = torch.randint(1, args.vocab, (args.steps * args.batch_size, args.seq_len), generator=g)
    return [{"input_ids": r.tolist(), "labels": r.tolist(), "attention_mask": [1] * args.seq_len} for r in rows]


def run(variant: str, args: argparse.Namespace, samples: list[dict]) -> tuple[float, float, int]:
    """(train() seconds, seconds stalled for saves except the final wait for the last one, saves) of one run."""
    with tempfile.TemporaryDirectory(dir=args.dir) as out:
        targs = TrainingArguments(
            output_dir=out, max_steps=args.steps, per_device_train_batch_size=args.batch_size, learning_rate=1e-3,
            logging_steps=args.steps, save_strategy="no" if variant == "none" else "steps",
            save_steps=args.save_steps, save_total_limit=2, async_checkpoint=variant == "async", disable_tqdm=True)
        trainer = TimedTrainer(build_model(args), targs, train_dataset=samples)
        start = time.perf_counter()
        with contextlib.redirect_stdout(io.StringIO()):  # the printed log lines
            trainer.train()
        seconds = time.perf_counter() - start
    saves = 0 if variant == "none" else args.steps // args.save_steps
    if variant == "async":
        print(f"    (async: {trainer.final_wait:.2f} s waiting for the last save after the last step)")
    return seconds, trainer.stall - trainer.final_wait, saves


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--save-steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=384)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the training loop")
    parser.add_argument("--dir", default=None, help="where the runs write (default: the system's temp dir)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    model = build_model(args)
    params = sum(p.numel() for p in model.parameters())
    print(f"model: {params / 1e6:.1f}M parameters, {params * 4 / 2**20:.0f} MiB fp32 (checkpoint ~3x with AdamW); "
          f"{args.steps} steps, a save every {args.save_steps}, {args.rounds} rounds")
    samples = data(args)
    variants = ["none", "sync", "async"]
    results: dict[str, list[tuple[float, float, int]]] = {v: [] for v in variants}
    for r in range(args.rounds):
        for v in variants[r % 3:] + variants[:r % 3]:
            results[v].append(run(v, args, samples))
            seconds, stall, _ = results[v][-1]
            print(f"  round {r + 1} {v:5s}: train() {seconds:7.2f} s, stalled for checkpoints {stall:6.2f} s",
                  flush=True)

    med = {v: statistics.median(s for s, _, _ in results[v]) for v in variants}
    stall = {v: statistics.median(s for _, s, _ in results[v]) / max(results[v][0][2], 1) for v in variants}
    saves = results["sync"][0][2]
    print(f"\nper save ({saves} saves per run, medians over {args.rounds} rounds):")
    print(f"  training loop stalled:  sync {stall['sync']:.3f} s, async {stall['async']:.3f} s")
    print(f"  training time hidden:   {stall['sync'] - stall['async']:.3f} s "
          f"= {(stall['sync'] - stall['async']) / stall['sync']:.2f} of the synchronous stall")
    cost, hidden = (med["sync"] - med["none"]) / saves, (med["sync"] - med["async"]) / saves
    print(f"  wall clock of train():  none {med['none']:.2f} s, sync {med['sync']:.2f} s, async {med['async']:.2f} s "
          f"-> cost per sync save {cost:.3f} s, hidden per save {hidden:.3f} s (noisy on a shared machine: the "
          f"writer thread needs a free core)")

if __name__ == "__main__":
    main()
