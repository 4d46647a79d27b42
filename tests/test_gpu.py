"""What only a CUDA machine can check (marked ``gpu``; skipped without CUDA, e.g. in CI): bf16 autocast and
packing on CUDA through a run, the CUDA RNG state in checkpoints, TrainingArguments.tf32, NCCL DDP and FSDP2
with 2 devices.
Run them on a GPU machine with `python -m pytest -q -m gpu tests/test_gpu.py`."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from vlmtrain import run
from vlmtrain.config import load_run_config
from vlmtrain.trainer.checkpoint import rng_state, set_rng_state

ROOT = Path(__file__).resolve().parents[1]
ADDITION = ROOT / "configs" / "addition-tiny.yaml"


def _losses(out: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    return {r["step"]: r["loss"] for r in rows if "loss" in r and "train_runtime" not in r}


@pytest.mark.gpu
def test_cuda_rng_state_is_saved_and_restored():
    torch.cuda.manual_seed_all(7)
    state = rng_state()
    assert "cuda" in state
    first = torch.rand(4, device="cuda")
    set_rng_state(state)
    assert torch.equal(first, torch.rand(4, device="cuda"))


@pytest.mark.gpu
@pytest.mark.parametrize("packing", [False, True])
def test_bf16_autocast_on_cuda_trains_and_resumes(tmp_path, packing):
    overrides = {"train.max_steps": 40, "train.bf16": True, "train.logging_steps": 1, "train.save_steps": 20,
                 "train.save_strategy": "steps", "train.eval_strategy": "no", "train.disable_tqdm": True,
                 "data.num_eval": 8, "data.packing": packing}
    straight = load_run_config(ADDITION, {**overrides, "train.output_dir": str(tmp_path / "straight")})
    metrics = run.train(straight)
    losses = _losses(tmp_path / "straight")
    assert metrics["global_step"] == 40 and all(math.isfinite(v) for v in losses.values())
    assert losses[40] < 0.7 * losses[1], losses  # it learns under bf16 autocast on CUDA
    resumed = load_run_config(ADDITION, {**overrides, "train.output_dir": str(tmp_path / "straight"),
                                         "train.resume_from_checkpoint": str(tmp_path / "straight" / "checkpoint-20")})
    run.train(resumed)
    again = _losses(tmp_path / "straight")  # rows after step 20 were rewritten by the resumed run
    for step in range(21, 41):  # CUDA kernels may differ in the last bits: close, not bitwise
        assert abs(again[step] - losses[step]) <= 1e-3 * abs(losses[step]) + 1e-4, (step, again[step], losses[step])


@pytest.mark.gpu(2)
@pytest.mark.parametrize("fsdp", [False, True])
def test_nccl_two_gpus_match_one_gpu(tmp_path, fsdp):
    from tests.test_distributed import LM, _run

    one = _losses(_run(tmp_path, LM, "one", nproc=1, batch=4))
    two = _losses(_run(tmp_path, LM, "two", 2, 2, *(["--train.fsdp", "true"] if fsdp else [])))
    assert sorted(one) == sorted(two)
    assert all(abs(one[s] - two[s]) <= 1e-3 * abs(one[s]) for s in one), (one, two)


@pytest.mark.gpu
@pytest.mark.parametrize("tf32,precision", [(True, "tf32"), (False, "ieee")])
def test_tf32_sets_the_cuda_matmul_precision_and_trains(tmp_path, tf32, precision):
    from tests.tiny import tiny_llama, token_samples
    from vlmtrain import Trainer, TrainingArguments

    before = torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.fp32_precision
    try:
        args = TrainingArguments(output_dir=str(tmp_path), save_strategy="no", disable_tqdm=True, max_steps=2,
                                 report_to="none", tf32=tf32)
        trainer = Trainer(tiny_llama(0), args, train_dataset=token_samples(8))
        assert torch.backends.cuda.matmul.fp32_precision == precision
        assert torch.backends.cudnn.fp32_precision == precision
        trainer.train()
        assert next(trainer.model.parameters()).device.type == "cuda"
        assert trainer.state.global_step == 2
    finally:
        torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.fp32_precision = before
