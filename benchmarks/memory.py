"""Peak memory per rank while building + loading the model and while training: 1 process vs 2 DDP vs 2 FSDP.

Each contender is `vlmtrain.run.build(cfg)` then `trainer.train()` on a random-init Llama of --layers x --hidden
(the addition task's tiny vocabulary, so nearly all weights sit in the blocks), as `vlmtrain train` runs it
(2 processes under torchrun, gloo). Memory is each process's peak resident set size (Linux VmHWM, reset through
/proc/self/clear_refs at the start of each phase) minus its RSS just before the model was built: CPU RSS here; on a GPU
machine the same phases would be read with torch.cuda.max_memory_allocated (not done by this script). Every
contender runs with MALLOC_MMAP_THRESHOLD_=65536, so that freed large blocks leave RSS (see measure()).

"one copy" is the model's parameter bytes. What FSDP changes (vlmtrain.models.sharding.shard_from_rank0): ranks
other than 0 build the model on the meta device and receive only their shard from rank 0, which frees each full
tensor once sent; before, every rank built the whole model (world_size copies) and then sharded it.

    python benchmarks/memory.py                       # ~270M parameters: about 3 minutes on 2 cores
    python benchmarks/memory.py --hidden 512 --layers 8 --json   # what tests/test_fsdp_memory.py runs
    python benchmarks/memory.py --dtype bfloat16      # model.torch_dtype bfloat16: bf16 parameters
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODES = {"1 process": (1, False), "2 DDP": (2, False), "2 FSDP": (2, True)}


def _rss_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


class Phase:
    """Peak RSS over a block above ``base`` (default: the RSS on entry): VmHWM reset on entry, read on exit."""

    def __init__(self, base: int | None = None) -> None:
        self.base = base

    def __enter__(self) -> Phase:
        gc.collect()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
        if self.base is None:
            self.base = _rss_bytes("VmRSS")
        return self

    def __exit__(self, *exc: object) -> None:
        self.peak = _rss_bytes("VmHWM") - self.base


def worker(args: argparse.Namespace) -> None:
    import torch

    from vlmtrain import run
    from vlmtrain.config import load_run_config
    from vlmtrain.trainer import distributed

    def config(hidden: int, layers: int, steps: int, out: str):
        return load_run_config(ROOT / "configs" / "addition-tiny.yaml", {
            "model.config": {"model_type": "llama", "hidden_size": hidden, "intermediate_size": hidden * 11 // 4,
                             "num_hidden_layers": layers, "num_attention_heads": 8, "num_key_value_heads": 8,
                             "max_position_embeddings": 32},
            "data.num_train": 512, "data.num_eval": 8, "data.packing": False,
            "train.output_dir": out, "train.max_steps": steps, "train.per_device_train_batch_size": 4,
            "train.save_strategy": "no", "train.eval_strategy": "no", "train.disable_tqdm": True,
            "train.logging_steps": steps, "train.fsdp": args.fsdp, "model.torch_dtype": args.dtype})

    torch.set_num_threads(1)
    cfg = config(args.hidden, args.layers, args.steps, args.out)
    distributed.init_from_env(cfg.train.ddp_timeout)  # the process group is not the model's memory
    # Warm-up on a one-layer model: imports, data, allocator and process-group buffers are not the model's memory.
    run.build(config(64, 1, 1, os.path.join(args.out, "warmup"))).train()
    with Phase() as load:
        trainer = run.build(cfg)
    weights = sum(p.numel() * p.element_size() for p in trainer.model.parameters())  # (DTensor: global numel)
    with Phase(base=load.base) as train:  # weights, gradients, optimizer state, activations: all of training
        trainer.train()
    result = {"rank": trainer.rank, "load_peak": load.peak, "train_peak": train.peak, "weights": weights}
    Path(args.out, f"memory_rank{trainer.rank}.json").write_text(json.dumps(result))


def measure(mode: str, args: argparse.Namespace, out: str) -> list[dict]:
    nproc, fsdp = MODES[mode]
    # A fixed mmap threshold: glibc otherwise raises it to the size of the largest freed block, after which
    # FSDP's per-block all-gather buffers come from the heap and freed ones stay in RSS (here +0.4x the weights
    # per rank); CUDA's max_memory_allocated counts live tensors only, and this makes RSS do the same.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src"), "MALLOC_MMAP_THRESHOLD_": "65536"}
    script = [str(Path(__file__).resolve()), "--worker", "--out", out, "--hidden", str(args.hidden),
              "--layers", str(args.layers), "--steps", str(args.steps), "--dtype", args.dtype] + (["--fsdp"] if fsdp else [])
    launch = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
              if nproc > 1 else [sys.executable])
    done = subprocess.run(launch + script, env=env, capture_output=True, text=True, timeout=1200)
    if done.returncode != 0:
        raise SystemExit(f"{mode} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return [json.loads(Path(out, f"memory_rank{r}.json").read_text()) for r in range(nproc)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=20)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="model.torch_dtype: the parameters' dtype (bfloat16 halves one copy)")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {list(MODES)}")
    parser.add_argument("--json", action="store_true", help="print one JSON object (mode -> per-rank results)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--fsdp", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for i, mode in enumerate(args.modes.split(",")):
            results[mode] = measure(mode, args, os.path.join(tmp, str(i)))
    if args.json:
        print(json.dumps(results))
        return
    mb = 2**20
    one = results.get("1 process", [{"weights": results[next(iter(results))][0]["weights"], "train_peak": math.nan}])[0]
    print(f"Llama {args.layers} x {args.hidden}: {one['weights'] / mb:.0f} MB of {args.dtype} weights (one copy); "
          f"peak RSS growth per rank, MB")
    print(f"  {'contender':<10} {'build+load':>24} {'sum / one copy':>15} {'training':>22} {'x 1 process':>12}")
    for mode, ranks in results.items():
        loads = " ".join(f"{r['load_peak'] / mb:.0f}" for r in ranks)
        trains = " ".join(f"{r['train_peak'] / mb:.0f}" for r in ranks)
        total = sum(r["load_peak"] for r in ranks) / one["weights"]
        worst = max(r["train_peak"] for r in ranks) / one["train_peak"]
        print(f"  {mode:<10} {loads:>24} {total:>15.2f} {trains:>22} {worst:>12.2f}")


if __name__ == "__main__":
    main()
