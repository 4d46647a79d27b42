"""kill -9 of a GRPO run mid-training, then resume: the run restarts from its newest checkpoint (inside a
generation buffer) and ends with the weights and metrics.jsonl rows (each step once) of an uninterrupted run, as
tests/test_kill_resume.py shows for the SFT path. Each attempt is a process of its own, forked with its imports
done (tests/preloaded.py); the run stops itself where it is killed (tests/grpo_kill_worker.py), so where the kill
lands does not depend on the machine's speed."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests import preloaded
from tests.test_grpo import model_dir  # noqa: F401 (the tiny Llama, a fixture)

ROOT = Path(__file__).resolve().parents[1]
WORKER = str(ROOT / "tests" / "grpo_kill_worker.py")


def _run(out: Path, model_dir: Path, *stop: str):  # noqa: F811
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}"}
    log = out.parent / f"{out.name}-{len(list(out.parent.glob(f'{out.name}-*.log')))}.log"
    return preloaded.start("tests.preloaded:run_script", [WORKER, str(out), str(model_dir), *stop], env, log)


def _rows(run: Path) -> list[dict]:
    """metrics.jsonl without wall-clock values (rates, runtime)."""
    return [{k: v for k, v in json.loads(line).items() if not k.endswith(("_per_second", "_fraction", "runtime"))}
            for line in open(run / "metrics.jsonl")]


@pytest.mark.slow
def test_grpo_killed_mid_training_resumes_like_an_uninterrupted_run(tmp_path, model_dir):  # noqa: F811
    straight, out, ready = tmp_path / "straight", tmp_path / "killed", tmp_path / "stopped"
    proc = _run(straight, model_dir)
    killed = _run(out, model_dir, "5", str(ready))  # stops at the start of step 5: checkpoint-3 the newest
    deadline = time.monotonic() + 300  # (a bound on a hang)
    try:
        while not ready.exists():
            assert killed.is_alive(), f"the run ended before its stop: {preloaded.output(killed)}"
            assert time.monotonic() < deadline, "the run never reached its stop"
            time.sleep(0.01)
    finally:
        os.killpg(killed.pid, signal.SIGKILL)
        killed.join(timeout=60)
    assert sorted(n for n in os.listdir(out) if n.startswith("checkpoint-")) == ["checkpoint-3"]
    assert any(json.loads(line)["step"] == 4 for line in open(out / "metrics.jsonl"))  # (rows after it, undone)
    proc.join(timeout=300)
    assert proc.exitcode == 0, preloaded.output(proc)
    resumed = _run(out, model_dir)
    resumed.join(timeout=300)
    assert resumed.exitcode == 0, preloaded.output(resumed)

    final = [load_file(str(run / "checkpoint-9" / "model.safetensors")) for run in (straight, out)]
    assert set(final[0]) == set(final[1])
    assert all(torch.equal(final[0][k], final[1][k]) for k in final[0])
    rows, expected = _rows(out), _rows(straight)
    assert [r["step"] for r in rows if "loss" in r] == list(range(1, 10))
    assert rows == expected
