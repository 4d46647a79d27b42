"""Shipped Hub VLM configs build and train at tiny scale offline; token-normalized loss for a Hub VLM; seed 000's
job (Qwen3-VL + two score heads on two-image WebDataset shards) end to end at tiny scale, with exact resume."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from PIL import Image
from safetensors.torch import load_file

from vlmtrain import TrainerCallback, run
from vlmtrain.config import RunConfig, load_run_config
from vlmtrain.data.cauldron import write_cauldron_jsonl
from vlmtrain.data.tools import write_webdataset
from vlmtrain.models.families import get_family
from vlmtrain.models.objectives.heads import parse_heads

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = sorted((ROOT / "configs").glob("*.yaml"))
HUB_CONFIGS = [p for p in SHIPPED if (yaml.safe_load(p.read_text())["model"] or {}).get("kind") == "hub_vlm"]
SEED_CONFIG = ROOT / "configs" / "qwen3vl-8b-score-heads.yaml"

# A Hub id's family, found in its name (lower case, '-', '_' and '.' removed): (family, build_tiny kwargs).
# Longer names first: 'smolvlm2' (model_type smolvlm) before 'smolvlm' (SmolVLM v1 is idefics3).
HUB_FAMILIES: list[tuple[str, str, dict[str, Any]]] = [
    ("qwen3vl", "qwen3_vl", {}),
    ("qwen25vl", "qwen2_5_vl", {}),
    ("smolvlm2", "smolvlm", {"model_type": "smolvlm"}),
    ("smolvlm", "idefics3", {}),
    ("idefics3", "idefics3", {}),
    ("llavaonevision", "llava_onevision", {}),
    ("gemma3", "gemma3", {}),
]


def family_of_hub_id(hub_id: str) -> tuple[str, dict[str, Any]]:
    flat = "".join(c for c in hub_id.lower() if c not in "-_./")  # (a run's checkpoint-N: its run directory's name)
    for needle, family, kwargs in HUB_FAMILIES:
        if needle in flat:
            return family, kwargs
    raise AssertionError(f"no tiny stand-in for {hub_id!r}: add its family to HUB_FAMILIES")


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    """family -> a tiny random-init checkpoint directory of that family, built once per module."""
    built: dict[str, str] = {}

    def get(family: str, **kwargs: Any) -> str:
        if family not in built:
            out = str(tmp_path_factory.mktemp(f"tiny-{family}"))
            built[family] = get_family(family).build_tiny(out, seed=0, **kwargs)
        return built[family]

    return get


# -- tiny data of the shipped configs' shape --------------------------------------------------------
def head_label(spec: Any, i: int) -> Any:
    if spec.type == "regression":
        value = round(0.25 * (i % 5), 2)
        return value if spec.num_outputs == 1 else [value] * spec.num_outputs
    if spec.loss == "bce":
        return [float((i + k) % 2) for k in range(spec.num_outputs)]
    return i % spec.num_outputs


def two_image_samples(n: int, heads: dict[str, Any], answers: bool, seed: int = 0) -> list[dict[str, Any]]:
    """n samples of two 32 px images each; head labels for every head; an assistant reply when ``answers``
    (generative), none when not (score-only, as seed 000's)."""
    out = []
    for i in range(n):
        k = (i * 7 + seed) % 4
        images = [Image.new("RGB", (32, 32), (60 * k, 90 + 40 * j, 200 - 50 * j)) for j in range(2)]
        turn: dict[str, Any] = {"user": "How does the second image compare with the first?"}
        if answers:
            turn["assistant"] = " ".join(["brighter"] * (1 + i % 3))
        sample: dict[str, Any] = {"images": images, "texts": [turn]}
        if heads:
            sample["labels"] = {name: head_label(spec, i + k) for name, spec in heads.items()}
        out.append(sample)
    return out


def tiny_data_overrides(cfg: RunConfig, tmp: Path, n_train: int = 12) -> dict[str, Any]:
    """data.* overrides that replace a config's files with tiny local ones of the same shape (a synthetic
    source, which needs no files, is only made small)."""
    if cfg.data.source not in ("jsonl", "stream"):
        return {"data.num_train": min(cfg.data.num_train, 16), "data.num_eval": min(cfg.data.num_eval, 4)}
    heads = parse_heads(cfg.model.heads)
    answers = not heads
    evalf = write_cauldron_jsonl(two_image_samples(4, heads, answers, seed=1), str(tmp / "eval"), name="eval")
    over: dict[str, Any] = {"data.eval_file": evalf if cfg.data.eval_file else None, "data.num_eval": 4}
    train = two_image_samples(n_train, heads, answers)
    if cfg.data.source == "jsonl":
        over["data.train_file"] = write_cauldron_jsonl(train, str(tmp / "train"), name="train")
    else:
        shards = write_webdataset(train, str(tmp / "wds"), shard_size=4)
        jsonl = write_cauldron_jsonl(train, str(tmp / "train"), name="train")
        brace = str(tmp / "wds" / f"shard-{{000000..{len(shards) - 1:06d}}}.tar")
        over["data.sources"] = [{**spec, "path": brace if spec["kind"] == "wds" else jsonl}
                                for spec in cfg.data.sources]
    return over


def tiny_overrides(cfg: RunConfig, tmp: Path, tiny_checkpoint: Any, max_steps: int = 2) -> dict[str, Any]:
    family, kwargs = family_of_hub_id(cfg.model.pretrained)
    t = cfg.train
    return {
        "model.pretrained": tiny_checkpoint(family, **kwargs), "model.torch_dtype": "float32",
        **tiny_data_overrides(cfg, tmp),
        "train.bf16": False, "train.fsdp": False, "train.max_steps": max_steps, "train.output_dir": str(tmp / "run"),
        "train.per_device_train_batch_size": min(t.per_device_train_batch_size, 2),
        "train.per_device_eval_batch_size": min(t.per_device_eval_batch_size, 4),
        "train.gradient_accumulation_steps": min(t.gradient_accumulation_steps, 2),
        "train.generation_max_new_tokens": min(t.generation_max_new_tokens, 4),
        "train.logging_steps": 1, "train.dataloader_num_workers": 0, "train.report_to": "none",
        "train.disable_tqdm": True, "train.warmup_steps": 0, "train.warmup_ratio": 0.0,
        **({"train.num_generations": 2} if t.objective == "grpo" else {}),  # (groups that fit a batch of 2)
    }


def read_metrics(output_dir: str | Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(training rows, evaluation rows) of a run's metrics.jsonl."""
    with open(Path(output_dir) / "metrics.jsonl") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [r for r in rows if "loss" in r], [r for r in rows if "eval_loss" in r]


def finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


# -- (a) every shipped hub_vlm config trains at tiny scale --------------------------------------------------
def test_the_hub_configs_are_shipped():
    names = {p.name for p in HUB_CONFIGS}
    assert {"qwen3vl-8b-score-heads.yaml", "smolvlm-sft.yaml"} <= names
    seed = load_run_config(SEED_CONFIG)
    assert seed.model.pretrained == "Qwen/Qwen3-VL-8B-Instruct" and seed.model.torch_dtype == "bfloat16"
    assert len(parse_heads(seed.model.heads)) == 2 and seed.data.source == "stream"
    assert [s["kind"] for s in seed.data.sources] == ["wds"] and seed.data.max_images >= 2
    t = seed.train
    assert t.bf16 and t.fsdp and t.gradient_checkpointing and t.gradient_accumulation_steps > 1


@pytest.mark.parametrize("path", HUB_CONFIGS, ids=lambda p: p.name)
def test_shipped_hub_config_trains_at_tiny_scale(path, tmp_path, tiny_checkpoint, one_thread):
    shipped = load_run_config(path)
    cfg = load_run_config(path, tiny_overrides(shipped, tmp_path, tiny_checkpoint))
    # what makes the config the one shipped stays: heads, LoRA, learning rates, checkpointing, generation
    assert (cfg.model.heads, cfg.model.lora) == (shipped.model.heads, shipped.model.lora)
    assert cfg.train.gradient_checkpointing == shipped.train.gradient_checkpointing
    assert cfg.train.module_learning_rates == shipped.train.module_learning_rates
    metrics = run.train(cfg)
    assert metrics["global_step"] == 2
    train_rows, eval_rows = read_metrics(cfg.train.output_dir)
    assert [r["step"] for r in train_rows] == [1, 2]
    heads = parse_heads(cfg.model.heads)
    for row in train_rows:
        assert finite(row["loss"])
        for name in heads:
            assert finite(row.get(f"loss_{name}")), f"loss_{name} missing or not finite in {row}"
    if cfg.train.objective == "grpo":  # (no eval set: shapes_pairs' demo report measures the held-out questions)
        assert all(finite(row["reward"]) for row in train_rows)
        return
    assert finite(metrics["eval_loss"])
    for name, spec in heads.items():
        assert finite(metrics.get(f"eval_loss_{name}"))
        metric = "accuracy" if spec.type in ("classification", "reward") else "mae"  # (reward: pair accuracy)
        assert finite(metrics.get(f"eval_{name}_{metric}"))
    if cfg.train.predict_with_generate:
        assert 0.0 <= metrics["eval_exact_match"] <= 1.0


# -- (b) token-normalized loss for a Hub VLM: 1 x batch 8 == 4 x batch 2 --------------------------------
class GradRecorder(TrainerCallback):
    def __init__(self) -> None:
        self.grads: list[dict[str, torch.Tensor]] = []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kw):
        self.grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})


def test_hub_vlm_accumulation_matches_one_big_batch(tmp_path, tiny_checkpoint, one_thread):
    # 8 samples whose answers have very different lengths (1 to 22 words): a mean of per-micro-batch means
    # would weigh the short ones up; normalizing by the step's target tokens gives the big batch's gradient.
    samples = []
    for i in range(8):
        image = Image.new("RGB", (32, 32), (30 * i, 120, 200))
        answer = " ".join(["red", "square", "left"] * (1 + 3 * (i % 4)))[: 4 + 25 * (i % 5)]
        samples.append({"images": [image], "texts": [{"user": "Describe the image.", "assistant": answer}]})
    data = write_cauldron_jsonl(samples, str(tmp_path / "data"), name="train")
    base = {"model": {"kind": "hub_vlm", "pretrained": tiny_checkpoint("qwen3_vl")},
            "data": {"source": "jsonl", "train_file": data, "num_eval": 0},
            "train": {"max_steps": 1, "optim": "sgd", "learning_rate": 1e-3, "max_grad_norm": 0.0,
                      "logging_steps": 1, "save_strategy": "no", "disable_tqdm": True, "report_to": "none",
                      "seed": 0}}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(base))
    results = []
    for bs, accum in [(8, 1), (2, 4)]:
        cfg = load_run_config(path, {"train.per_device_train_batch_size": bs,
                                     "train.gradient_accumulation_steps": accum,
                                     "train.output_dir": str(tmp_path / f"{bs}x{accum}")})
        trainer = run.build(cfg)
        recorder = GradRecorder()
        trainer.add_callback(recorder)
        trainer.train()
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        results.append((recorder.grads, losses))
    (g1, l1), (g2, l2) = results
    assert len(g1) == len(g2) == 1 and len(l1) == len(l2) == 1
    assert g1[0].keys() == g2[0].keys() and len(g1[0]) > 10
    for name in g1[0]:
        torch.testing.assert_close(g1[0][name], g2[0][name], atol=1e-6, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}")
    assert l1[0] == pytest.approx(l2[0], rel=1e-5)


# -- (c) seed 000 at tiny scale: two heads, two-image WDS shards, eval, exact resume ---------------------------
CLS_HEAD = "type"  # seed 000's names: a regression `score` and a classification `type`
SEED_HEADS = {"score": {"type": "regression", "num_outputs": 1, "loss": "mse", "weight": 1.0},
              CLS_HEAD: {"type": "classification", "num_outputs": 4, "loss": "ce", "weight": 1.0}}


def seed_overrides(tiny_checkpoint: Any, output_dir: Path, data_dir: Path) -> dict[str, Any]:
    shipped = load_run_config(SEED_CONFIG)
    over = tiny_overrides(shipped, data_dir, tiny_checkpoint, max_steps=3)
    over.update({"model.heads": SEED_HEADS, "train.output_dir": str(output_dir), "train.eval_strategy": "steps",
                 "train.eval_steps": 3, "train.save_strategy": "steps", "train.save_steps": 2,
                 "train.learning_rate": 1e-3})
    return over


def _seed_samples_have_both_labels(data_dir: Path) -> None:
    import tarfile

    shards = sorted((data_dir / "wds").glob("shard-*.tar"))
    assert len(shards) == 3
    with tarfile.open(shards[0]) as tar:
        names = tar.getnames()
        record = json.loads(tar.extractfile(names[0]).read())
    assert names[:3] == ["000000000.json", "000000000.0.png", "000000000.1.png"]
    assert set(record["labels"]) == {"score", CLS_HEAD} and "assistant" not in record["texts"][0]


def test_seed_000_two_heads_two_images_eval_and_exact_resume(tmp_path, tiny_checkpoint, one_thread):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    over = seed_overrides(tiny_checkpoint, straight, tmp_path / "data")
    _seed_samples_have_both_labels(tmp_path / "data")
    metrics = run.train(load_run_config(SEED_CONFIG, over))
    assert metrics["global_step"] == 3
    train_rows, eval_rows = read_metrics(straight)
    assert [r["step"] for r in train_rows] == [1, 2, 3] and [r["step"] for r in eval_rows] == [3]
    for row in train_rows:
        assert finite(row["loss_score"]) and finite(row[f"loss_{CLS_HEAD}"]), row
    ev = eval_rows[0]
    assert finite(ev["eval_loss_score"]) and finite(ev[f"eval_loss_{CLS_HEAD}"])
    assert 0.0 <= ev[f"eval_{CLS_HEAD}_accuracy"] <= 1.0 and ev["eval_score_mae"] >= 0.0
    assert {f"eval_{CLS_HEAD}_f1", "eval_score_rmse", "eval_score_pearson", "eval_score_spearman"} <= set(ev)

    # Resume from checkpoint-2 in another directory: step 3 and the final trainable weights are the same.
    assert (straight / "checkpoint-2").is_dir() and (straight / "checkpoint-3").is_dir()
    over2 = {**over, "train.output_dir": str(resumed),
             "train.resume_from_checkpoint": str(straight / "checkpoint-2")}
    assert run.train(load_run_config(SEED_CONFIG, over2))["global_step"] == 3
    resumed_rows, _ = read_metrics(resumed)
    assert [r["step"] for r in resumed_rows] == [3]
    for key in ("loss", "loss_score", f"loss_{CLS_HEAD}"):
        assert resumed_rows[0][key] == train_rows[-1][key], key
    files = sorted(f.name for f in (straight / "checkpoint-3").glob("*.safetensors"))
    assert files and files == sorted(f.name for f in (resumed / "checkpoint-3").glob("*.safetensors"))
    for name in files:
        a, b = load_file(str(straight / "checkpoint-3" / name)), load_file(str(resumed / "checkpoint-3" / name))
        assert a.keys() == b.keys() and a
        for key in a:
            assert torch.equal(a[key], b[key]), f"{name}:{key} differs after resume"
    assert os.path.isfile(straight / "checkpoint-3" / "heads.safetensors")


def test_seed_000_score_only_run_logs_no_nan(tmp_path, tiny_checkpoint, one_thread):
    """Score-only samples (no assistant turn) carry no language targets: no row may log a NaN loss for it."""
    over = seed_overrides(tiny_checkpoint, tmp_path / "run", tmp_path / "data")
    over.update({"train.max_steps": 1, "train.eval_steps": 1, "train.save_strategy": "no"})
    run.train(load_run_config(SEED_CONFIG, over))
    train_rows, eval_rows = read_metrics(tmp_path / "run")
    assert train_rows and eval_rows
    for row in train_rows + eval_rows:
        nan = [k for k, v in row.items() if not (isinstance(v, (int, float)) and math.isfinite(v))
               and k not in ("epoch",)]
        assert not nan, f"step {row['step']} logs non-finite {nan}"
