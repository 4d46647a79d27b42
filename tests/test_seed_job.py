"""The job vlmtrain exists for, end to end: the shipped configs/qwen3vl-8b-score-heads.yaml (Qwen3-VL, LoRA, two
score heads, two-image WebDataset shards, FSDP, bf16 base, bf16 autocast, activation checkpointing, a frozen
vision tower, data-loader workers) with only its scale changed (a tiny random-init Qwen3-VL, a few steps, local
shards), on 2 gloo ranks: train -> resume -> score new data -> export --merge -> reload with transformers alone.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest
import torch
import yaml
from optional_extras import requires
from PIL import Image
from safetensors.torch import load_file

from tests.test_distributed import _losses, _run
from vlmtrain.cli import main
from vlmtrain.data.cauldron import write_cauldron_jsonl
from vlmtrain.data.tools import write_webdataset
from vlmtrain.models.families import get_family

pytestmark = [requires("peft", "lora"), pytest.mark.slow, pytest.mark.usefixtures("one_thread")]

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ROOT / "configs" / "qwen3vl-8b-score-heads.yaml"


def samples(n: int, seed: int, ids: bool = False) -> list[dict]:
    """Two-image samples in the config's format: a score-only question with both heads' labels; every third
    one also has an answer (generation and heads trained together)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        k = rng.randrange(4)
        images = [Image.new("RGB", (32 + 16 * j, 32), (60 * k, 90 + 40 * j, 200 - 50 * j)) for j in range(2)]
        turn = {"user": "Rate the second image against the first."}
        if i % 3 == 0:
            turn["assistant"] = "brighter" if k % 2 else "darker"
        sample = {"images": images, "texts": [turn], "labels": {"score": 0.5 * k, "type": k}}
        if ids:
            sample["id"] = f"new-{seed}-{i}"
        out.append(sample)
    return out


def seed_config(tmp: Path) -> dict:
    """The shipped config with its scale changed and nothing else: model, data paths, steps, batch sizes."""
    cfg = yaml.safe_load(SHIPPED.read_text())
    cfg["model"]["pretrained"] = get_family("qwen3_vl").build_tiny(str(tmp / "tiny"), seed=0)
    shards = write_webdataset(samples(48, seed=0), str(tmp / "wds"), shard_size=8)
    cfg["data"]["sources"] = [{"kind": "wds", "path": str(tmp / "wds" / f"shard-{{000000..{len(shards) - 1:06d}}}.tar")}]
    cfg["data"]["eval_file"] = write_cauldron_jsonl(samples(6, seed=1, ids=True), str(tmp / "eval"), name="val")
    cfg["train"].update(max_steps=4, per_device_train_batch_size=2, per_device_eval_batch_size=4,
                        gradient_accumulation_steps=2, warmup_steps=1, logging_steps=1, eval_steps=2, save_steps=2,
                        learning_rate=1e-2, module_learning_rates={"text": 1e-2, "vision": 0.0},
                        dataloader_num_workers=2, report_to="none", disable_tqdm=True)
    return cfg


def test_the_8b_score_head_job_trains_resumes_predicts_exports_and_reloads(tmp_path):
    from transformers import AutoModelForImageTextToText

    import vlmtrain
    from vlmtrain.config import load_run_config
    from vlmtrain.inference import load_for_inference

    shipped = yaml.safe_load(SHIPPED.read_text())
    cfg = seed_config(tmp_path)
    for section, keep in (("model", ("kind", "torch_dtype", "heads", "lora", "attn_implementation")),
                          ("train", ("fsdp", "bf16", "gradient_checkpointing", "lr_scheduler_type", "save_total_limit",
                                     "metric_for_best_model", "max_grad_norm", "weight_decay"))):
        assert {k: cfg[section].get(k) for k in keep} == {k: shipped[section].get(k) for k in keep}
    assert cfg["train"]["fsdp"] and cfg["train"]["bf16"] and cfg["model"]["torch_dtype"] == "bfloat16"

    # train 4 steps on 2 ranks (checkpoints at 2 and 4); resume a second run from checkpoint-2
    run = _run(tmp_path, cfg, "run", 2, 2)
    resumed = _run(tmp_path, cfg, "resumed", 2, 2, "--train.resume_from_checkpoint", str(run / "checkpoint-2"))
    losses = _losses(run)
    assert sorted(losses) == [1, 2, 3, 4] and all(torch.isfinite(torch.tensor(v)) for v in losses.values())
    assert [_losses(resumed)[s] for s in (3, 4)] == [losses[3], losses[4]]

    # the checkpoint holds what trains: adapter + heads + processor + state, never the frozen base
    ckpt = run / "checkpoint-4"
    names = set(os.listdir(ckpt))
    assert {"adapter_model.safetensors", "adapter_config.json", "heads.safetensors", "heads.json",
            "processor_config.json", "optimizer.pt"} <= names
    assert not names & {"model.safetensors", "dcp"}
    assert all("lora_" in key for key in load_file(str(ckpt / "adapter_model.safetensors")))

    # score new data (WebDataset shards, no labels needed) and the eval set; rows keyed by id
    new = samples(5, seed=2, ids=True)
    for sample in new[::2]:
        del sample["labels"]
    write_webdataset(new, str(tmp_path / "new"), shard_size=3)
    assert main(["predict", "--checkpoint", str(ckpt), "--data", str(tmp_path / "new" / "shard-*.tar"),
                 "--output", str(tmp_path / "new.jsonl")]) == 0
    rows = [json.loads(line) for line in open(tmp_path / "new.jsonl")]
    assert [r["id"] for r in rows] == [s["id"] for s in new]
    assert all(isinstance(r["score"], float) and r["type"] in range(4) and len(r["type_probs"]) == 4 for r in rows)

    # the same samples' scores as the run's last evaluation computed them (bf16 autocast under FSDP there,
    # float32 here: equal to bf16 precision)
    assert main(["predict", "--checkpoint", str(ckpt), "--data", cfg["data"]["eval_file"],
                 "--output", str(tmp_path / "val.jsonl")]) == 0
    scored = {r["id"]: r for r in map(json.loads, open(tmp_path / "val.jsonl"))}
    evaluated = [json.loads(line) for line in open(run / "eval_samples_step_4.jsonl")]
    assert len(evaluated) == len(scored) == 6
    for row in evaluated:
        assert scored[row["id"]]["score"] == pytest.approx(row["heads"]["score"]["predicted"], abs=0.05)

    # export --merge: transformers loads the model alone, one call adds the heads; scores equal the checkpoint's
    merged = tmp_path / "merged"
    assert main(["export", "--checkpoint", str(ckpt), "--merge", "--output-dir", str(merged)]) == 0
    model, info = AutoModelForImageTextToText.from_pretrained(merged, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    scorer = vlmtrain.attach_heads(model, str(merged)).eval()
    inference = load_for_inference(str(ckpt))
    again = load_for_inference(str(merged))
    assert set(again.head_configs) == {"score", "type"}
    want, got = inference.score(new), again.score(new)
    for a, b in zip(want, got):
        assert a["type"] == b["type"] and a["score"] == pytest.approx(b["score"], abs=1e-5)
    assert scorer.head_configs == inference.head_configs
    assert load_run_config(run / "config.yaml").train.fsdp
