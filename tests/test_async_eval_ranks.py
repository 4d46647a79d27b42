"""train.async_eval under torchrun: rank 0 waits for an evaluation process (mid-run with async_eval_when_full:
wait, and at the end of training) and every other rank waits at the same point, not inside a collective, so a
wait longer than ddp_timeout ends well (2 gloo processes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
# A rank left inside a collective for EVAL_S fails the job. (ddp_timeout is low, but not so low that a loaded
# CI machine's slow checkpoint write on rank 0 times out rank 1 in the save's own collective: 4 s did once.)
DDP_TIMEOUT_S = 8
EVAL_S = 12


@pytest.mark.slow
def test_every_rank_waits_with_rank_0_for_evaluations_longer_than_ddp_timeout(tmp_path):
    # Steps 1..3, a checkpoint each, one evaluation at a time. checkpoint-1's evaluation takes EVAL_S: at step 2's
    # save rank 0 waits for it (when_full: wait) while step 3 is next. checkpoint-3's takes EVAL_S too: train()
    # waits for it at the end, and the script's next collective follows.
    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(ROOT / "tests" / "async_eval_ranks_worker.py"), str(out), "3", "1,3", str(EVAL_S), str(DDP_TIMEOUT_S)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    ranks = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]
    assert [r["global_step"] for r in ranks] == [3, 3] and ranks[0]["everyone"] == [3, 3]
    for key, value in ranks[0]["weights"].items():
        assert torch.equal(value, ranks[1]["weights"][key]), key
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    arrived = {r["step"]: (r["eval_fake_step"], r["eval_arrived_step"]) for r in rows if r.get("eval_async")}
    assert arrived == {1: (1, 2), 2: (2, 3), 3: (3, 3)}  # checkpoint-1's waited for at step 2, 3's at the end
