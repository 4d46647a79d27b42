"""Evaluation under train.fsdp (2 gloo ranks): each rank evaluates its share of the eval set, ranks run forward in
step (a rank whose share is done runs a stand-in batch whose results are dropped), and the metrics and
per-sample outputs equal one process's; load_best_model_at_end loads the best checkpoint into the shards (and
`vlmtrain train` reports the loaded model's metrics)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from tests import preloaded

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "",
       "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT / "tests")])}
TIMING = ("runtime", "samples_per_second", "steps_per_second", "model_preparation_time")


def _launch(nproc: int, script: str, out: Path, *args: str) -> list[dict]:
    """tests/<script> in one process or as ``nproc`` ranks (torchrun's rank environment, no launcher), forked with
    their imports done (tests/preloaded.py); each rank's rank<r>.json."""
    out.mkdir()
    argv = [str(ROOT / "tests" / script), str(out), *args]
    codes, output = preloaded.launch("tests.preloaded:run_script", argv, ENV, nproc, out, timeout=600)
    assert codes == [0] * nproc, output
    return [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]


def _without_padding(rows: list[list[int]]) -> list[list[int]]:
    return [[t for t in row if t != -100] for row in rows]


@pytest.mark.slow
def test_fsdp_evaluation_splits_the_eval_set_and_matches_one_process(tmp_path):
    (one,) = _launch(1, "fsdp_eval_worker.py", tmp_path / "one")
    ranks = _launch(2, "fsdp_eval_worker.py", tmp_path / "two")
    assert [r["rank"] for r in ranks] == [0, 1]
    for name in ("mixed", "scores", "one"):
        reference = one[name]
        for got in ranks:  # every rank ends with the whole set's results
            metrics, expected = got[name]["metrics"], reference["metrics"]
            assert sorted(metrics) == sorted(expected)
            for key, value in expected.items():
                if key.endswith(TIMING) or value != value:  # timings; NaN (a correlation over 1 sample)
                    continue
                if name == "mixed" and key == "eval_loss":
                    # the sum of LM and head losses is weighted by each batch's LM targets, so it depends on
                    # which samples share a batch (2 ranks batch samples 0 2 | 4 6 ..., 1 process 0 1 | 2 3 ...)
                    continue
                assert metrics[key] == pytest.approx(value, rel=1e-5, abs=1e-6), (name, key)
            for head, rows in reference["heads"].items():  # per-sample outputs, in dataset order
                np.testing.assert_allclose(got[name]["heads"][head], rows, atol=1e-5, err_msg=f"{name} {head}")
        assert ranks[0][name]["metrics"]["eval_samples"] == len(reference["heads"]["cls"])
    generated = _without_padding(one["scores"]["predictions"])
    assert len(generated) == 11 and all(_without_padding(r["scores"]["predictions"]) == generated for r in ranks)
    # Each rank ran forward on its share only. 13 samples in batches of 2: one process runs 7 batches; rank 0
    # reads samples 0 2 ... 12 (4 batches, 7 rows), rank 1 samples 1 3 ... 11 (3 batches, 6 rows) and then runs
    # its last batch again as a stand-in (2 rows, dropped). A 1-sample set: rank 1 runs rank 0's batch.
    assert one["mixed"]["forwards"] == 7 and one["mixed"]["rows"] == 13
    assert [(r["mixed"]["forwards"], r["mixed"]["rows"]) for r in ranks] == [(4, 7), (4, 6 + 2)]
    assert [(r["scores"]["forwards"], r["scores"]["rows"]) for r in ranks] == [(3, 6), (3, 5)]
    assert [(r["one"]["forwards"], r["one"]["rows"]) for r in ranks] == [(1, 1), (1, 1)]


@pytest.mark.slow
def test_load_best_model_at_end_under_fsdp_loads_the_best_checkpoint_into_the_shards(tmp_path):
    """Eval and save every step, the highest eval loss counting as best (an early checkpoint): after train()
    the sharded model evaluates to the best checkpoint's logged eval_loss, for a full fine-tune (DCP shards)
    and for LoRA + score heads. The loader also takes files (model.safetensors; adapter + heads files),
    cutting full tensors into each rank's shards, and DCP shards of another checkpoint."""
    (result,) = _launch(2, "fsdp_best_worker.py", tmp_path / "runs")
    for name, expected_files in (("full", {"model.safetensors"}),
                                 ("lora", {"adapter_model.safetensors", "heads.safetensors"})):
        run = result[name]
        logged = {int(step): loss for step, loss in run["logged"].items()}
        best = max(logged, key=logged.get)
        assert sorted(logged) == [1, 2, 3, 4] and run["best_step"] == best < 4, (name, logged)
        assert run["best_checkpoint"] == f"checkpoint-{best}"
        assert abs(logged[best] - logged[4]) > 1e-4, (name, logged)  # the last step's model evaluates otherwise
        assert run["after_train"] == pytest.approx(logged[best], abs=1e-6), name
        assert expected_files <= set(run["files"])
        assert run["last_loaded"] == pytest.approx(logged[4], abs=1e-6), name
        assert run["files_loaded"] == pytest.approx(logged[best], abs=1e-6), name


def test_train_reports_the_metrics_of_the_best_model_it_loaded_at_the_end(tmp_path, one_thread):
    """run.train (vlmtrain train) ends with the evaluation of the model it returns: with
    load_best_model_at_end, the best step's (reused from the log), not the last step's."""
    import yaml

    from tests.test_async_eval import LM
    from vlmtrain import run
    from vlmtrain.config import load_run_config

    cfg = json.loads(json.dumps(LM))
    cfg["train"].update(output_dir=str(tmp_path / "run"), async_eval=False, max_steps=3, eval_strategy="steps",
                        eval_steps=1, save_steps=1, load_best_model_at_end=True, metric_for_best_model="loss",
                        greater_is_better=True)
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    metrics = run.train(load_run_config(tmp_path / "cfg.yaml"))
    logged = {r["step"]: r["eval_loss"] for r in map(json.loads, open(tmp_path / "run" / "metrics.jsonl"))
              if "eval_loss" in r}
    best = max(logged, key=logged.get)
    assert best < 3 and logged[best] != logged[3], logged
    assert metrics["eval_loss"] == logged[best]
