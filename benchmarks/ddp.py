"""Scaling of 1 vs 2 DDP (and FSDP2) processes (gloo, CPU) on the same global batch, through `vlmtrain train --nproc`.

Trains the tiny addition LM (configs/addition-tiny.yaml, its model and data) for --steps steps at a global batch
of --global-batch samples, once with 1 process (batch B, --threads threads) and once with 2 processes (batch
B/2 each, --threads/2 threads each, so both runs use the same cores), and prints training samples per second
(as logged: summed over ranks, logging steps after the first left out) and the ratio.

On this 2-core machine the honest expectation is ~1x: two processes share the same two cores and add an
all-reduce per step. On GPUs each process has its own device and the ratio approaches the process count,
minus the all-reduce time (overlapped with backward by DDP).

    python benchmarks/ddp.py                 # about 1 minute
    python benchmarks/ddp.py --steps 200 --global-batch 512
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(nproc: int, args: argparse.Namespace, out: str, *extra: str) -> float:
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, args.threads // nproc)), "PYTHONPATH": str(ROOT / "src")}
    cmd = [sys.executable, "-m", "vlmtrain", "train", "--config", str(ROOT / "configs" / "addition-tiny.yaml"),
           "--nproc", str(nproc), "--train.output_dir", out, "--train.max_steps", str(args.steps),
           "--train.per_device_train_batch_size", str(args.global_batch // nproc), "--train.logging_steps", "10",
           "--train.eval_strategy", "no", "--train.save_strategy", "no", "--train.disable_tqdm", "true",
           "--data.num_eval", "8", *extra]
    subprocess.run(cmd, env=env, check=True, capture_output=True)
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    rates = [r["samples_per_second"] for r in rows if "samples_per_second" in r and "loss" in r]
    return statistics.median(rates[1:] or rates)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--global-batch", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2, help="CPU threads in all (split across processes)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        one = run(1, args, os.path.join(tmp, "one"))
        two = run(2, args, os.path.join(tmp, "two"))
        fsdp = run(2, args, os.path.join(tmp, "fsdp"), "--train.fsdp", "true")
    print(f"tiny addition LM, global batch {args.global_batch}, {args.steps} steps, {args.threads} threads in all")
    print(f"  1 process:   {one:9.0f} samples/s")
    print(f"  2 processes: {two:9.0f} samples/s   ({two / one:.2f}x)  DDP")
    print(f"  2 processes: {fsdp:9.0f} samples/s   ({fsdp / one:.2f}x)  FSDP2 (all-gathers and reduce-scatters "
          "every block: the price of not holding the whole model)")


if __name__ == "__main__":
    main()
