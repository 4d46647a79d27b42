"""Under DDP a batch whose samples were all bad on ONE rank must not leave the other ranks waiting in the
gradient all-reduce: every rank skips that micro-batch (2 gloo processes, the bad batch on rank 1 only)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests import preloaded
from vlmtrain.trainer.stats import RANK_SYNC_REASON

ROOT = Path(__file__).resolve().parents[1]


def _torchrun(tmp_path: Path, name: str, bad_rank: int, bad_call: int, accum: int) -> list[dict]:
    out = tmp_path / name
    out.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}"}
    # Before the fix rank 0 waited in the all-reduce until ddp_timeout (60 s) and the job failed. (The ranks:
    # torchrun's rank environment, forked with their imports done, tests/preloaded.py; no launcher.)
    codes, output = preloaded.launch("tests.preloaded:run_script", [
        str(ROOT / "tests" / "rank_sync_worker.py"), str(out), str(bad_rank), str(bad_call), str(accum)], env, 2,
        out, timeout=240)
    assert codes == [0, 0], output
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


@pytest.mark.slow
@pytest.mark.parametrize("accum", [1, 2])
def test_an_empty_batch_on_one_rank_is_skipped_by_every_rank(tmp_path, accum):
    ranks = _torchrun(tmp_path, "bad", bad_rank=1, bad_call=3, accum=accum)
    for r in ranks:
        assert r["global_step"] == 6
    for key, value in ranks[0]["weights"].items():  # the ranks stayed in step: identical weights
        assert torch.equal(value, ranks[1]["weights"][key]), key
    # Counted: rank 1's bad samples by their reason, rank 0's good ones (dropped to stay in step) by theirs.
    assert ranks[1]["skipped"] == {"corrupt_image": 4}
    assert ranks[0]["skipped"] == {RANK_SYNC_REASON: 4}
    assert ranks[1]["metrics"]["train_skipped_corrupt_image"] == 4

    # Skipping the micro-batch on every rank is what training saw: a run whose bad batch sits on rank 0
    # instead skips the same micro-step, so it ends with the same weights (once: each run is a torchrun launch).
    if accum == 1:
        return
    mirrored = _torchrun(tmp_path, "mirrored", bad_rank=0, bad_call=3, accum=accum)
    for key, value in ranks[0]["weights"].items():
        assert torch.allclose(value, mirrored[0]["weights"][key], atol=1e-6), key
