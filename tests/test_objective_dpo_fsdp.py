"""`train.objective: dpo` with `train.fsdp` from a YAML config, on 2 gloo ranks (tests/preloaded.py's launch: the
ranks forked with their imports done, torchrun's rank environment; ddp_timeout 30, so a collective one rank
misses fails fast instead of hanging): rank 0 trains on pairs with images, rank 1 on text-only pairs, and the
per-step losses and metrics and the final weights equal one process's over the same global batches. A full
fine-tune's reference is a frozen copy sharded like the policy; with model.lora it is the model with its adapters
switched off. data.packing (each micro-batch's pairs in one row) trains the same under FSDP."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest
import torch
import yaml
from PIL import Image

from tests import preloaded
from tests.test_dpo_vision import METRICS

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "",
       "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
WORDS = ["red", "blue", "green", "square", "circle", "two", "three", "a", "the", "big"]
ADAM_EPSILON = 1e-3  # (as tests/rank_preference_worker.py: bounds Adam's magnification of the ranks' float noise)


def _rows(tmp_path: Path, n: int) -> list[dict]:
    """vlmtrain's pair layout, of different lengths: the even pairs with one or two images (rank 0's share under
    sequential sampling on 2 ranks), the odd ones text-only (rank 1's)."""
    rng = random.Random(4)
    rows = []
    for i in range(n):
        def words(lo: int, hi: int) -> str:
            return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))

        images = []
        for k in range(rng.choice([1, 2]) if i % 2 == 0 else 0):
            images.append(str(tmp_path / f"{i}-{k}.png"))
            Image.new("RGB", rng.choice([(32, 32), (48, 32)]), tuple(rng.randrange(256) for _ in range(3))).save(images[-1])
        rows.append({"images": images, "texts": [{"user": words(1, 6)}], "chosen": words(1, 5),
                     "rejected": words(1, 5)})
    return rows


def _config(tmp_path: Path, model: str, lora: bool, packing: bool, precompute: bool) -> Path:
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _rows(tmp_path, 8)))
    lora_spec = {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}
    cfg = {"model": {"kind": "hub_vlm", "pretrained": model, "torch_dtype": "float32",
                     **({"lora": lora_spec} if lora else {})},
           "data": {"source": "jsonl", "train_file": str(tmp_path / "train.jsonl"), "max_length": 512, "packing": packing},
           "train": {"objective": "dpo", "precompute_ref_log_probs": precompute, "max_steps": 2, "optim": "adamw_torch", "learning_rate": 1e-2,
                     "weight_decay": 0.1, "adam_epsilon": ADAM_EPSILON, "lr_scheduler_type": "constant",
                     "logging_steps": 1, "seed": 7, "report_to": "none", "save_strategy": "steps", "save_steps": 2,
                     "train_sampling_strategy": "sequential", "dataloader_num_workers": 0, "disable_tqdm": True,
                     "ddp_timeout": 30}}
    path = tmp_path / "dpo.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _train(config: Path, out: Path, nproc: int) -> list[dict]:
    """`vlmtrain train` on ``nproc`` ranks (FSDP when 2) over global batches of 4 pairs; the logged steps."""
    out.mkdir()
    overrides = ["--train.output_dir", str(out / "run"), "--train.per_device_train_batch_size", str(4 // nproc)]
    if nproc > 1:
        overrides += ["--train.fsdp", "true"]
    codes, output = preloaded.launch("vlmtrain.cli:main", ["train", "--config", str(config), *overrides], ENV, nproc,
                                     out, timeout=300)
    assert codes == [0] * nproc, output
    lines = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    return [r for r in lines if "loss" in r]


def _weights(checkpoint: Path, lora: bool) -> dict[str, torch.Tensor]:
    """A checkpoint's trained weights: its adapter (LoRA), its model.safetensors, or (a full fine-tune under FSDP)
    the model part of its DCP shards, read whole."""
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    if lora or not (checkpoint / "dcp").is_dir():
        return load_file(str(checkpoint / ("adapter_model.safetensors" if lora else "model.safetensors")))
    dcp_to_torch_save(str(checkpoint / "dcp"), str(checkpoint.parent / "whole.pt"))
    return torch.load(checkpoint.parent / "whole.pt", weights_only=False)["model"]


@pytest.mark.parametrize("lora,packing,precompute", [(False, False, False), (True, True, False), (False, False, True)],
                         ids=["full", "lora-packed", "full-precompute"])
def test_yaml_dpo_under_fsdp_equals_one_process(tiny_hub, tmp_path, lora, packing, precompute):
    """Per-step loss and per-pair metrics (rel 1e-5) and the checkpoint's weights (the policy alone: DCP shards of
    a full fine-tune, the gathered adapter with LoRA) equal one process's; data.packing packs each rank's pairs
    into one row."""
    _, model, _ = tiny_hub("qwen3_vl")
    config = _config(tmp_path, model, lora, packing, precompute)
    two, one = _train(config, tmp_path / "two", 2), _train(config, tmp_path / "one", 1)
    assert len(two) == len(one) == 2
    for step, (a, b) in enumerate(zip(two, one), 1):
        for key in METRICS[:7]:  # (the per-pair ones: the token means are per micro-batch, in TRL too)
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-6), (step, key)
    assert two[-1]["rewards/margins"] != pytest.approx(0.0, abs=1e-5)  # (the policy moved off its reference)
    ours, theirs = (_weights(tmp_path / n / "run" / "checkpoint-2", lora) for n in ("two", "one"))
    assert ours.keys() == theirs.keys()  # (the policy alone: no reference weights in the checkpoint)
    for name, value in theirs.items():
        torch.testing.assert_close(ours[name], value, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
