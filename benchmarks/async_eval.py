"""Training time that asynchronous evaluation hides: the same run with no evaluation, with inline evaluation of
each checkpoint (eval_strategy) and with async evaluation (train.async_eval: each checkpoint evaluated by
`vlmtrain eval` in another process), side by side in one script.

"steps" is the wall time from the start of training to the end of its last step; "total" adds what comes
after (async: waiting for the last evaluations). The evaluation process competes with training for the CPU
cores here; on a cluster (async_eval_launcher: submitit) it runs elsewhere.

    python benchmarks/async_eval.py                 # ~2-3 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))


def config(out: str, args: argparse.Namespace, mode: str) -> dict:
    train = {"output_dir": out, "max_steps": args.steps, "learning_rate": 1e-3, "logging_steps": args.save_steps,
             "save_strategy": "steps", "save_steps": args.save_steps, "disable_tqdm": True, "seed": 0,
             "per_device_train_batch_size": 8, "per_device_eval_batch_size": 32,
             "eval_strategy": "steps" if mode == "inline" else "no", "eval_steps": args.save_steps,
             "async_eval": mode == "async", "async_eval_max_pending": 2}
    return {"model": {"kind": "causal_lm", "config": {
                "model_type": "llama", "hidden_size": 256, "intermediate_size": 704, "num_hidden_layers": 4,
                "num_attention_heads": 8, "num_key_value_heads": 8, "max_position_embeddings": 64}},
            "data": {"source": "addition", "num_train": 20000, "num_eval": args.num_eval, "packing": False},
            "train": train}


def measure(mode: str, args: argparse.Namespace, tmp: str) -> tuple[float, float]:
    from vlmtrain import run
    from vlmtrain.config import load_run_config, save_run_config
    from vlmtrain.trainer.callbacks import TrainerCallback

    out = os.path.join(tmp, mode)
    path = os.path.join(tmp, f"{mode}.yaml")
    Path(path).write_text(yaml.safe_dump(config(out, args, mode)))
    cfg = load_run_config(path)
    clock: dict[str, float] = {}

    class StepClock(TrainerCallback):
        def on_step_end(self, a, state, control, **kwargs):
            if state.global_step == state.max_steps:
                clock["steps"] = time.perf_counter()

    trainer = run.build(cfg)
    save_run_config(cfg, out)  # what vlmtrain train writes; the async evaluations read it
    trainer.add_callback(StepClock())
    start = time.perf_counter()
    trainer.train()
    return clock["steps"] - start, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--save-steps", type=int, default=40)
    parser.add_argument("--num-eval", type=int, default=2000)
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in ("none", "inline", "async"):
            results[mode] = measure(mode, args, tmp)
    base = results["none"][0]
    evals = args.steps // args.save_steps
    print(f"{args.steps} steps, {evals} checkpoints evaluated ({args.num_eval} eval samples each); seconds")
    print(f"  {'evaluation':<10} {'steps':>8} {'x none':>8} {'total':>8}")
    for mode, (steps, total) in results.items():
        print(f"  {mode:<10} {steps:8.1f} {steps / base:8.2f} {total:8.1f}")
    hidden = results["inline"][0] - results["async"][0]
    print(f"  async hides {hidden:.1f} s of the {results['inline'][0] - base:.1f} s inline evaluation adds to the "
          f"steps ({hidden / evals:.2f} s per checkpoint)")


if __name__ == "__main__":
    main()
