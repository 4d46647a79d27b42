"""train.async_eval under 2 ranks (torchrun's rank environment; tests/preloaded.py): rank 0 waits for an evaluation process (mid-run with async_eval_when_full:
wait, and at the end of training) and every other rank waits at the same point, not inside a collective, so a
wait longer than ddp_timeout ends well (2 gloo processes)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
import yaml

from tests import preloaded

ROOT = Path(__file__).resolve().parents[1]
# A rank left inside a collective for EVAL_S fails the job. (ddp_timeout is low, but not so low that a loaded
# CI machine's slow checkpoint write on rank 0 times out rank 1 in the save's own collective: 4 s did once.)
DDP_TIMEOUT_S = 8
EVAL_S = 12
# The final-evaluation test has no evaluation to outwait: a timeout that a loaded 2-core machine never reaches in a
# healthy run, still short enough that a rank left alone in evaluate() fails the job in seconds.
FINAL_EVAL_TIMEOUT_S = 30


def _two_ranks(tmp_path: Path, env: dict[str, str], *args: str) -> None:
    """tests/async_eval_ranks_worker.py as 2 ranks (torchrun's rank environment, no launcher), forked with their
    imports done (tests/preloaded.py)."""
    logs = tmp_path / "logs"
    logs.mkdir()
    codes, output = preloaded.launch("tests.preloaded:run_script", [str(ROOT / "tests" / "async_eval_ranks_worker.py"),
                                     *args], env, 2, logs, timeout=240)
    assert codes == [0, 0], output


@pytest.mark.slow
def test_every_rank_waits_with_rank_0_for_evaluations_longer_than_ddp_timeout(tmp_path):
    # Steps 1..3, a checkpoint each, one evaluation at a time. checkpoint-1's evaluation takes EVAL_S: at step 2's
    # save rank 0 waits for it (when_full: wait) while step 3 is next. checkpoint-3's takes EVAL_S too: train()
    # waits for it at the end, and the script's next collective follows.
    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}"}
    _two_ranks(tmp_path, env, str(out), "3", "1,3", str(EVAL_S), str(DDP_TIMEOUT_S))
    ranks = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]
    assert [r["global_step"] for r in ranks] == [3, 3] and ranks[0]["everyone"] == [3, 3]
    for key, value in ranks[0]["weights"].items():
        assert torch.equal(value, ranks[1]["weights"][key]), key
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    arrived = {r["step"]: (r["eval_fake_step"], r["eval_arrived_step"]) for r in rows if r.get("eval_async")}
    assert arrived == {1: (1, 2), 2: (2, 3), 3: (3, 3)}  # checkpoint-1's waited for at step 2, 3's at the end


def _evaluator(eval_loss: bool) -> list[str]:
    """An evaluation command that at once writes a result naming its step, with an eval_loss or without one."""
    metrics = "{'eval_fake_step': int(step)" + (", 'eval_loss': 0.125}" if eval_loss else "}")
    script = f"import json, sys\nout, step = sys.argv[1:3]\nopen(out, 'w').write(json.dumps({{'metrics': {metrics}}}))\n"
    return [sys.executable, "-c", script, "{result_file}", "{step}"]


@pytest.mark.slow
@pytest.mark.parametrize("async_loss", [True, False], ids=["reused", "evaluated"])
def test_every_rank_decides_the_final_evaluation_alike(tmp_path, async_loss):
    """run.train with an eval set and async_eval under 2 ranks: rank 0 alone logs the asynchronous evaluations,
    so whether the last step's (with an eval_loss) spares the final evaluate() is rank 0's decision, which every
    rank takes. (Before: rank 1 ran evaluate() alone and the job died after ddp_timeout.)"""
    from test_async_eval import LM

    out = tmp_path / "run"
    cfg = json.loads(json.dumps(LM))
    cfg["train"].update(output_dir=str(out), max_steps=2, save_steps=2, per_device_eval_batch_size=4,
                        ddp_timeout=FINAL_EVAL_TIMEOUT_S, async_eval_command=_evaluator(async_loss))
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}"}
    _two_ranks(tmp_path, env, "--config", str(path), str(out))
    ranks = [torch.load(out / f"metrics{r}.pt", weights_only=False) for r in range(2)]
    untimed = [{k: v for k, v in m.items() if not k.endswith(("_runtime", "_per_second"))} for m in ranks]
    assert untimed[0] == untimed[1] and "eval_loss" in untimed[0]
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert [r["eval_fake_step"] for r in rows if r.get("eval_async")] == [2]
    evaluated = [r for r in rows if "eval_loss" in r and not r.get("eval_async")]
    if async_loss:  # the asynchronous result is the final one: no second evaluation
        assert ranks[0]["eval_loss"] == 0.125 and evaluated == []
    else:
        assert len(evaluated) == 1 and ranks[0]["eval_loss"] == evaluated[0]["eval_loss"] != 0.125
