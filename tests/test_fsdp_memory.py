"""FSDP builds the model for sharding without world_size full copies (ranks other than 0 build it on the meta
device and receive only their shard from rank 0) and trains in about half a process's memory
(benchmarks/memory.py: 1 process vs 2 gloo FSDP ranks, peak RSS)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_fsdp_ranks_never_hold_the_whole_model_and_train_in_half_the_memory(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "memory.py"), "--hidden", "768", "--layers", "12",
                           "--modes", "1 process,2 FSDP", "--json"], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    (single,), (rank0, rank1) = results["1 process"], results["2 FSDP"]
    weights = rank0["weights"]  # ~331 MB of fp32 parameters
    # Measured here: rank 0 1.01x, rank 1 0.50x (before: every rank built the full model, 1.00x each).
    assert rank1["load_peak"] <= 0.6 * weights, (rank1, weights)  # its shard + one tensor in flight
    assert rank0["load_peak"] <= 1.1 * weights, (rank0, weights)  # the one full copy, freed as it is sent
    assert rank0["load_peak"] + rank1["load_peak"] <= 1.6 * weights
    # Training (weights, gradients, AdamW state, activations): measured 0.56x of one process on each rank.
    for rank in (rank0, rank1):
        assert rank["train_peak"] <= 0.6 * single["train_peak"], (rank, single)
