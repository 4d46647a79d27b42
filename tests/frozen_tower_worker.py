"""Run under torchrun by tests/test_frozen_modules.py: `vlmtrain train`'s build of a config (a Hub VLM), trained,
then every parameter gathered whole (FSDP shards included) and written by rank 0 to OUT/weights.pt."""

from __future__ import annotations

import os
import sys

import torch

from vlmtrain.config import load_run_config
from vlmtrain.run import build
from vlmtrain.trainer import distributed


def main(config: str, out: str) -> None:
    trainer = build(load_run_config(config))
    result = trainer.train()
    weights = {}
    for name, p in trainer.model.named_parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p  # (a collective under FSDP: every rank)
        weights[name] = (full.detach().clone(), p.requires_grad)
    if trainer.rank == 0:
        torch.save({"weights": weights, "global_step": result.global_step}, os.path.join(out, "weights.pt"))
    distributed.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
