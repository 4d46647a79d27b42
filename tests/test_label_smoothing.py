"""label_smoothing_factor on every kind of model vlmtrain trains (causal_lm, the own VLM, each Hub VLM family): the
smoothed loss is computed over shifted labels (the logits at position t predict the label at t + 1), so a factor
going to 0 gives the unsmoothed loss of the same run. (The transformers-script side, a causal LM under both
Trainers, is tests/test_hf_arguments.py's test_label_smoothing_losses_equal_transformers.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from PIL import Image

from vlmtrain import run
from vlmtrain.config import load_run_config

ROOT = Path(__file__).resolve().parents[1]
FAMILIES = ["qwen3_vl", "qwen2_5_vl", "idefics3", "llava_onevision", "gemma3"]
COLORS = [(220, 40, 40), (40, 160, 40), (40, 40, 220)]
# AdamW with weight decay, two steps: the second step's loss also shows the first step's gradient.
TRAIN = {"max_steps": 2, "logging_steps": 1, "optim": "adamw_torch", "weight_decay": 0.1, "learning_rate": 1e-3,
         "eval_strategy": "no", "save_strategy": "no", "disable_tqdm": True, "report_to": "none",
         "dataloader_num_workers": 0, "per_device_train_batch_size": 4}


def _hub_config(tmp_path: Path, pretrained: str) -> Path:
    rows = []
    for i in range(8):
        Image.new("RGB", (32, 32), COLORS[i % 3]).save(tmp_path / f"{i}.png")
        rows.append({"images": [f"{i}.png"], "texts": [{"user": "Which colour?", "assistant": "rgb"[i % 3] * 3}]})
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = {"model": {"kind": "hub_vlm", "pretrained": pretrained, "torch_dtype": "float32"},
           "data": {"source": "jsonl", "train_file": str(tmp_path / "data.jsonl"), "max_length": 96},
           "train": {"output_dir": "unset"}}
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _config(kind: str, tmp_path: Path, tiny_hub) -> tuple[Path, dict]:
    """(config file, its overrides) of a 2-step run of `kind` ('causal_lm', 'vlm' or a Hub VLM family)."""
    if kind == "causal_lm":
        return ROOT / "configs" / "addition-tiny.yaml", {"data.num_train": 16, "data.num_eval": 4}
    if kind == "vlm":
        return ROOT / "configs" / "shapes-tiny.yaml", {"data.num_train": 16, "data.num_eval": 1}
    return _hub_config(tmp_path, tiny_hub(kind)[1]), {}


def _losses(path: Path, overrides: dict, out: Path, factor: float) -> list[float]:
    """The logged loss of each step, then train_loss."""
    train = {f"train.{k}": v for k, v in TRAIN.items()}
    cfg = load_run_config(path, {**overrides, **train, "train.output_dir": str(out),
                                 "train.label_smoothing_factor": factor})
    metrics = run.train(cfg)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r] + [metrics["train_loss"]]


@pytest.mark.parametrize("kind", ["causal_lm", "vlm", *FAMILIES])
def test_label_smoothing_factor_to_zero_gives_the_unsmoothed_loss(kind, tmp_path, tiny_hub, one_thread):
    path, overrides = _config(kind, tmp_path, tiny_hub)
    plain = _losses(path, overrides, tmp_path / "plain", 0.0)
    smoothed = _losses(path, overrides, tmp_path / "smoothed", 1e-9)
    assert len(plain) == 3 and plain[0] > 0
    # (the LM loss of a full logits tensor and of vlmtrain's chunked one at the targets: float rounding apart)
    assert smoothed == pytest.approx(plain, rel=1e-5)


def test_label_smoothing_with_score_heads_is_refused_before_training(tmp_path):
    """A model with score heads has one loss of its LM and its heads: smoothing the LM logits alone (transformers'
    LabelSmoother replaces the model's loss) would drop the heads' losses. Refused when the Trainer is built, and
    for a config before the model loads."""
    from tiny import tiny_llama

    from vlmtrain import Trainer, TrainingArguments
    from vlmtrain.errors import ConfigError
    from vlmtrain.models.objectives.heads import WithHeads

    model = WithHeads(tiny_llama(0), {"cls": {"type": "classification", "num_outputs": 3}})
    args = TrainingArguments(output_dir=str(tmp_path / "run"), report_to="none", label_smoothing_factor=0.1)
    with pytest.raises(ConfigError, match="label_smoothing_factor=0.1 with score heads"):
        Trainer(model=model, args=args)
    path = _hub_config(tmp_path, "not/loaded")
    with pytest.raises(ConfigError, match="train.label_smoothing_factor=0.1 with model.heads"):
        load_run_config(path, {"model.heads": {"cls": {"type": "classification", "num_outputs": 3}},
                               "train.label_smoothing_factor": 0.1})
