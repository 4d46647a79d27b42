"""`train.objective: dpo` with score heads still attached (`model.heads` on a hub_vlm): the DPO loss plus each
regression / classification head's loss on the pair's chosen sequence (its last token), weighted by the head's
`weight`; a pair without a head's label leaves that head out; the heads' losses and evaluation metrics logged
under their SFT names; a `reward` head is refused before anything loads."""

from __future__ import annotations

import json

import pytest
import torch
import yaml

from tests.test_dpo_vision import _file_pairs

HEADS = {"quality": {"type": "regression", "weight": 0.5},
         "kind": {"type": "classification", "num_outputs": 3, "weight": 2.0}}


@pytest.fixture(scope="module")
def qwen3_vl(tiny_hub):
    _, path, processor = tiny_hub("qwen3_vl")
    return path, processor


def _labelled(rows: list[dict]) -> list[dict]:
    """Head labels per pair: every third pair has no `kind` label, one pair none at all."""
    out = []
    for i, row in enumerate(rows):
        labels = {"quality": 0.25 * i, **({"kind": i % 3} if i % 3 else {})}
        out.append(row if i == 1 else {**row, "labels": labels})
    return out


def _config(tmp_path, path, heads, name: str, steps: int = 2, lora: bool = False) -> str:
    rows, _ = _file_pairs(tmp_path, 6, 0)
    eval_rows, _ = _file_pairs(tmp_path, 4, 1)
    for split, data in (("train", _labelled(rows)), ("eval", _labelled(eval_rows))):
        (tmp_path / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in data))
    cfg = {"model": {"kind": "hub_vlm", "pretrained": str(path), "torch_dtype": "float32",
                     **({"heads": heads} if heads else {}),
                     **({"lora": {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}} if lora else {})},
           "data": {"source": "jsonl", "train_file": str(tmp_path / "train.jsonl"),
                    "eval_file": str(tmp_path / "eval.jsonl"), "max_length": 512},
           "train": {"output_dir": str(tmp_path / name), "objective": "dpo", "save_strategy": "no",
                     "learning_rate": 3e-3, "weight_decay": 0.1, "logging_steps": 1, "seed": 7, "report_to": "none",
                     "dataloader_num_workers": 0, "disable_tqdm": True, "per_device_train_batch_size": 3,
                     "per_device_eval_batch_size": 2, "max_steps": steps, "eval_strategy": "steps",
                     "eval_steps": steps}}
    config = tmp_path / f"{name}.yaml"
    config.write_text(yaml.safe_dump(cfg))
    return str(config)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_dpo_loss_plus_weighted_head_losses_of_the_chosen_rows(qwen3_vl, tmp_path, one_thread, lora):
    """The objective's loss is the DPO loss plus weight x each head's mean loss over the pairs that have its label,
    the head reading the chosen row's last token (computed here by hand from the same forward); the reference is
    the model under the heads (with LoRA: its adapters switched off)."""
    import torch.nn.functional as F

    from vlmtrain.compose import build
    from vlmtrain.config import load_run_config
    from vlmtrain.models.objectives.dpo import DPOObjective
    from vlmtrain.models.objectives.heads import pool_last_token
    from vlmtrain.models.objectives.vision_pairs import with_pair_images

    path, _ = qwen3_vl
    trainer = build(load_run_config(_config(tmp_path, path, HEADS, "run", lora=lora)))
    objective, collate = trainer.model, trainer.data_collator
    assert (objective.ref_model is None) == lora
    rows = [json.loads(line) for line in (tmp_path / "train.jsonl").read_text().splitlines()][:4]
    batch = collate(rows)
    batch = {k: v for k, v in batch.items() if k not in ("skipped", "skipped_keys")}
    assert batch["labels_quality"].shape == (4,) and batch["labels_kind"].tolist() == [-100, -100, 2, -100]
    out = objective(**batch)

    policy = objective.policy
    plain = DPOObjective(policy.base, objective.ref_model)
    inputs = {k: v for k, v in batch.items() if not k.startswith("labels_") and k != "completion_mask"}
    expected = plain(**{**inputs, "completion_mask": batch["completion_mask"]})["loss"]
    with torch.no_grad():
        hidden = policy.base(**with_pair_images(policy.base, {**inputs, "use_cache": False}),
                             output_hidden_states=True).hidden_states[-1]
    pooled = pool_last_token(hidden[:4], batch["attention_mask"][:4])
    quality = policy.heads.layer("quality")(pooled)[:, 0]
    labelled = ~torch.isnan(batch["labels_quality"])
    quality_loss = F.mse_loss(quality[labelled], batch["labels_quality"][labelled])
    kind_loss = F.cross_entropy(policy.heads.layer("kind")(pooled)[2:3], batch["labels_kind"][2:3])
    expected = expected + 0.5 * quality_loss + 2.0 * kind_loss
    torch.testing.assert_close(out["loss"], expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out["loss_quality"], quality_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out["loss_kind"], kind_loss, rtol=1e-5, atol=1e-6)
    assert out["num_items_quality"] == 3 and out["num_items_kind"] == 1
    assert out["logits_quality"].shape == (4, 1) and out["logits_kind"].shape == (4, 3)


def test_head_weight_zero_trains_as_plain_dpo_and_logs_the_heads(qwen3_vl, tmp_path, one_thread):
    """Heads of weight 0: the base's final weights equal the run without heads (AdamW with weight decay), and
    metrics.jsonl holds each head's loss_<name> in training and its evaluation metrics (eval_<name>_*)."""
    from vlmtrain import cli
    from vlmtrain.models.hub.hub_loading import load_model

    path, _ = qwen3_vl
    zero = {name: {**spec, "weight": 0.0} for name, spec in HEADS.items()}
    weights = {}
    for name, heads in (("heads", zero), ("plain", None)):
        config = _config(tmp_path, path, heads, name)
        assert cli.main(["train", "--config", config, "--train.save_strategy", "steps", "--train.save_steps", "2"]) == 0
        model = load_model(str(tmp_path / name / "checkpoint-2"), "float32")
        weights[name] = {k: v for k, v in model.state_dict().items()}
    initial = load_model(str(path), "float32").state_dict()
    moved = [k for k in weights["plain"] if not torch.equal(weights["plain"][k], initial[k])]
    assert moved
    for k in weights["plain"]:  # (the gradient clip's norm sums the heads' zero gradients too: float noise)
        torch.testing.assert_close(weights["heads"][k], weights["plain"][k], rtol=1e-5, atol=1e-6)
    lines = [json.loads(line) for line in (tmp_path / "heads" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in lines if "loss" in r]
    assert train and all("loss_quality" in r for r in train) and any("loss_kind" in r for r in train)
    final = [r for r in lines if "eval_loss" in r][-1]
    assert "eval_quality_mae" in final and "eval_kind_accuracy" in final, sorted(final)
    assert "eval_rewards/accuracies" in final


def test_a_reward_head_with_objective_dpo_is_refused_before_anything_loads(tmp_path):
    from vlmtrain.config import load_run_config
    from vlmtrain.errors import ConfigError

    config = _config(tmp_path, tmp_path / "no-model", {"score": {"type": "reward"}}, "run")
    with pytest.raises(ConfigError, match=r"model.heads.score.*train.objective: reward"):
        load_run_config(config)


def test_score_heads_with_packed_pairs_are_refused_before_anything_loads(tmp_path):
    """A head reads each chosen row's last token; a packed pair batch is one row: refused, naming both keys."""
    from vlmtrain.config import load_run_config
    from vlmtrain.errors import ConfigError

    config = _config(tmp_path, tmp_path / "no-model", {"quality": {"type": "regression"}}, "run")
    with pytest.raises(ConfigError, match=r"model.heads with data.packing: true"):
        load_run_config(config, {"data.packing": True})
    load_run_config(config)  # (the same heads unpacked: accepted)
