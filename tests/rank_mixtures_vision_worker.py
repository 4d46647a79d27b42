"""Run by tests/test_rank_mixtures_vision.py, alone or under torchrun: `python rank_mixtures_vision_worker.py OUT
CONFIG...`. Per config (a run's YAML): `vlmtrain train`'s build (sharded when train.fsdp), train, evaluate;
the parameters before and after training gathered whole (FSDP shards included) and written by rank 0 to
OUT/<config's stem>.pt with the log history, the metrics.jsonl rows and the evaluation's metrics. A config whose
stem holds "eval-first" is evaluated before training too. One process group serves every config."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

from vlmtrain.config import load_run_config
from vlmtrain.run import build
from vlmtrain.trainer import distributed


def _weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter whole (a collective under FSDP: every rank calls it)."""
    out = {}
    for name, p in model.named_parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[name.removeprefix("module.")] = full.detach().clone()
    return out


def run(config: str, out: str) -> None:
    trainer = build(load_run_config(config))
    initial = _weights(trainer.model)
    if "eval-first" in Path(config).stem:
        trainer.evaluate()
    result = trainer.train()
    metrics = trainer.evaluate()
    weights = _weights(trainer.model)
    if trainer.rank == 0:
        with open(os.path.join(trainer.args.output_dir, "metrics.jsonl")) as f:
            rows = [json.loads(line) for line in f]
        torch.save({"initial": initial, "weights": weights, "global_step": result.global_step,
                    "eval_loss": metrics["eval_loss"], "eval": metrics, "logs": trainer.state.log_history,
                    "rows": rows}, os.path.join(out, f"{Path(config).stem}.pt"))


def main(out: str, configs: list[str]) -> None:
    torch.set_num_threads(1)
    for config in configs:
        run(config, out)
    distributed.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
