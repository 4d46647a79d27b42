"""The `reward` score head: on a pair batch (B chosen rows, then B rejected rows) its loss is the Bradley-Terry
loss of its rewards (per-pair margin, center_rewards_coefficient) beside the other heads' losses; a few steps with
LoRA on the base make it tell easy pairs apart (eval accuracy and margin); on one answer it gives the reward, in
load_for_inference().score and `vlmtrain predict` alike."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
import torch.nn.functional as F

import vlmtrain
import vlmtrain.errors
from tests.optional_extras import requires
from tests.tiny import tiny_llama
from vlmtrain import cli
from vlmtrain.data.reward_pairs import RewardCollator
from vlmtrain.models.objectives.heads import (
    WithHeads,
    compute_head_metrics,
    pair_margin_tensors,
    parse_heads,
    pool_last_token,
)

HEADS = {"reward": {"type": "reward", "center_rewards_coefficient": 0.01}, "quality": {"type": "regression"}}


@pytest.mark.parametrize("spec,key", [({"type": "reward", "num_outputs": 2}, "num_outputs"),
                                      ({"type": "regression", "center_rewards_coefficient": 0.1},
                                       "center_rewards_coefficient"),
                                      ({"type": "reward", "center_rewards_coefficient": "high"},
                                       "center_rewards_coefficient")])
def test_reward_head_config_errors_name_the_key(spec, key):
    with pytest.raises(vlmtrain.errors.ConfigError, match=f"model.heads.score.{key}"):
        parse_heads({"score": spec})


def _pair_batch() -> dict[str, torch.Tensor]:
    """3 pairs of different lengths (right-padded), margins with one NaN (a pair the reward head skips), and a
    regression label per row."""
    pairs = [{"chosen_ids": [5, 6, 7, 8], "rejected_ids": [5, 6, 9]},
             {"chosen_ids": [10, 11], "rejected_ids": [10, 12, 13, 14, 15]},
             {"chosen_ids": [20, 21, 22], "rejected_ids": [20, 23]}]
    batch = RewardCollator(pad_token_id=0)(pairs)
    batch["labels_reward"] = torch.tensor([0.5, 0.0, math.nan])
    batch["labels_quality"] = torch.tensor([1.0, 2.0, 3.0, 0.0, -1.0, 0.5])
    return batch


def test_reward_head_loss_is_bradley_terry_beside_a_regression_head():
    model = WithHeads(tiny_llama(), HEADS)
    batch = _pair_batch()
    out = model(**{k: v.clone() for k, v in batch.items()})
    with torch.no_grad():  # the rewards by hand: the head's layer on each row's last token
        hidden = model.base.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])[0]
        rewards = model.heads.layer("reward")(pool_last_token(hidden, batch["attention_mask"]))[:, 0]
    chosen, rejected = rewards[:3], rewards[3:]
    per_pair = -F.logsigmoid(chosen - rejected - torch.tensor([0.5, 0.0, 0.0])) + 0.01 * (chosen + rejected) ** 2
    assert out["loss_reward"].item() == pytest.approx(per_pair[:2].mean().item(), rel=1e-6)
    assert out["num_items_reward"].item() == 2  # (pairs with a margin; NaN: skipped)
    assert out["loss"].item() == pytest.approx(out["loss_reward"].item() + out["loss_quality"].item(), rel=1e-6)
    torch.testing.assert_close(out["logits_reward"], torch.stack([chosen, rejected], dim=-1), rtol=1e-6, atol=1e-6)
    assert out["logits_quality"].shape == (6, 1)
    metrics = compute_head_metrics(model.head_configs, {"reward": out["logits_reward"].detach().numpy()},
                                   {"reward": batch["labels_reward"].numpy()})
    assert metrics["reward_accuracy"] == pytest.approx(float((chosen > rejected)[:2].float().mean()))
    assert metrics["reward_margin"] == pytest.approx(float((chosen - rejected)[:2].mean()), rel=1e-6)


class _EasyPairs(torch.utils.data.Dataset):
    """Pairs whose chosen answer ends with token 30 and rejected answer with token 31, after random prompts."""

    def __init__(self, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.rows = []
        for _ in range(n):
            prompt = torch.randint(1, 30, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g).tolist()
            self.rows.append({"chosen_ids": prompt + [30], "rejected_ids": prompt + [31]})

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        return self.rows[i]


def _collate(samples: list[dict]) -> dict[str, torch.Tensor]:
    batch = RewardCollator(pad_token_id=0)(samples)
    batch.update(pair_margin_tensors(parse_heads(HEADS), [None] * len(samples)))  # (a margin of 0 per pair)
    batch["labels_quality"] = torch.cat([torch.ones(len(samples)), torch.zeros(len(samples))])
    return batch


@requires("peft", "lora")
def test_reward_head_with_lora_learns_easy_pairs(tmp_path):
    from peft import LoraConfig, get_peft_model

    base = get_peft_model(tiny_llama(seed=1), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    model = WithHeads(base, HEADS)
    args = vlmtrain.TrainingArguments(str(tmp_path), max_steps=8, per_device_train_batch_size=8,
                                      per_device_eval_batch_size=8, learning_rate=3e-2, weight_decay=0.1,
                                      report_to="none", use_cpu=True, save_strategy="no", disable_tqdm=True,
                                      remove_unused_columns=False, seed=0)
    trainer = vlmtrain.Trainer(model=model, args=args, data_collator=_collate, train_dataset=_EasyPairs(64, 0),
                               eval_dataset=_EasyPairs(16, 1))
    before = trainer.evaluate()
    trainer.train()
    after = trainer.evaluate()
    assert before["eval_reward_accuracy"] <= 0.5 and after["eval_reward_accuracy"] == 1.0, (before, after)
    assert after["eval_reward_margin"] > before["eval_reward_margin"]
    assert "eval_loss_quality" in after and after["eval_loss_reward"] < before["eval_loss_reward"]


@requires("peft", "lora")
def test_reward_head_scores_one_answer(tiny_hub, tmp_path):
    """A Hub VLM checkpoint with a reward head: score() and `vlmtrain predict` give the head's value on the
    sample's last token."""
    from PIL import Image
    from transformers import AutoModelForImageTextToText

    from vlmtrain.models.files.head_files import save_heads

    _, tiny, _ = tiny_hub("qwen3_vl")
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny, ckpt)
    torch.manual_seed(0)
    save_heads(WithHeads(AutoModelForImageTextToText.from_pretrained(ckpt), {"reward": {"type": "reward"}}), ckpt)
    Image.new("RGB", (32, 32), (200, 40, 40)).save(tmp_path / "red.png")
    sample = {"images": [str(tmp_path / "red.png")], "texts": [{"user": "Colour?", "assistant": "red"}], "id": "a"}
    loaded = vlmtrain.load_for_inference(str(ckpt), device="cpu")
    [row] = loaded.score([sample])
    batch = loaded.prepare()([dict(sample)])["batch"]
    inputs = {k: v for k, v in batch.items() if isinstance(v, torch.Tensor) and not k.startswith(("prompt_", "labels"))}
    with torch.no_grad():
        hidden = loaded.model.base(**inputs, output_hidden_states=True).hidden_states[-1]
        want = loaded.model.heads.layer("reward")(pool_last_token(hidden, inputs["attention_mask"]))[0, 0]
    assert row == {"id": "a", "reward": pytest.approx(float(want), abs=1e-5)}
    data, out = tmp_path / "new.jsonl", tmp_path / "scores.jsonl"
    data.write_text(json.dumps({**sample, "images": ["red.png"]}) + "\n")
    assert cli.main(["predict", "--checkpoint", str(ckpt), "--data", str(data), "--output", str(out)]) == 0
    assert json.loads(out.read_text().splitlines()[0])["reward"] == pytest.approx(row["reward"], abs=1e-5)


def _color_pairs():
    """TRL's layout with images: a prompt with an image part, chosen the image's colour, rejected another."""
    from datasets import Dataset
    from PIL import Image

    colors = {"red": (200, 40, 40), "green": (40, 160, 40), "blue": (40, 40, 200)}
    rows = []
    for i, (name, rgb) in enumerate(list(colors.items()) * 2):
        wrong = next(n for n in colors if n != name)
        rows.append({"images": [Image.new("RGB", (32, 32), rgb)],
                     "prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Colour?"}]}],
                     "chosen": [{"role": "assistant", "content": [{"type": "text", "text": name}]}],
                     "rejected": [{"role": "assistant", "content": [{"type": "text", "text": wrong}]}],
                     "margin": 0.5 * (i % 2)})
    return Dataset.from_list(rows)


def test_reward_trainer_on_a_vlm_trains_a_reward_head(tiny_hub, tmp_path):
    """RewardTrainer given a Hub VLM and its processor (TRL's takes none): pairs with images as pair batches for
    a reward head; the loss is the Bradley-Terry loss of the head's rewards (margin, centring); the saved
    checkpoint scores one answer."""
    from transformers import AutoModelForImageTextToText

    _, tiny, processor = tiny_hub("qwen3_vl")
    pairs = _color_pairs()
    args = vlmtrain.RewardConfig(str(tmp_path / "rm"), center_rewards_coefficient=0.01, per_device_train_batch_size=2,
                                 per_device_eval_batch_size=2, max_steps=2, logging_steps=1, learning_rate=1e-2,
                                 weight_decay=0.1, bf16=False, gradient_checkpointing=False, report_to="none",
                                 use_cpu=True, save_strategy="no", disable_tqdm=True)
    trainer = vlmtrain.RewardTrainer(model=AutoModelForImageTextToText.from_pretrained(tiny), args=args,
                                     train_dataset=pairs, eval_dataset=pairs, processing_class=processor)
    batch = trainer.data_collator([pairs[0], pairs[1]])
    inputs = {k: v for k, v in batch.items() if isinstance(v, torch.Tensor)}
    assert inputs["labels_reward"].tolist() == [0.0, 0.5] and inputs["input_ids"].shape[0] == 4
    texts = processor.tokenizer.batch_decode(inputs["input_ids"], skip_special_tokens=True)
    assert [t.split()[-1] for t in texts] == ["red", "green", "green", "red"]  # (chosen rows, then rejected)
    model = trainer.model
    out = model(**dict(inputs))
    from vlmtrain.data.vision_reward_pairs import VisionPairCollator

    plain = VisionPairCollator(trainer.data_collator.processor, one_vision_pass=False)([pairs[0], pairs[1]])
    base_inputs = {k: v for k, v in plain.items() if isinstance(v, torch.Tensor) and k != "labels_reward"}
    with torch.no_grad():
        hidden = model.base(**base_inputs, output_hidden_states=True).hidden_states[-1]
        rewards = model.heads.layer("reward")(pool_last_token(hidden, base_inputs["attention_mask"]))[:, 0]
    chosen, rejected = rewards[:2], rewards[2:]
    want = (-F.logsigmoid(chosen - rejected - torch.tensor([0.0, 0.5])) + 0.01 * (chosen + rejected) ** 2).mean()
    assert out["loss_reward"].item() == pytest.approx(want.item(), rel=1e-6)
    assert out["loss"].item() == pytest.approx(want.item(), rel=1e-6)  # (no LM loss: the head's alone)
    trainer.train()
    assert [e["step"] for e in trainer.state.log_history if "loss_reward" in e] == [1, 2]
    metrics = trainer.evaluate()
    assert {"eval_loss_reward", "eval_reward_accuracy", "eval_reward_margin", "eval_num_tokens"} <= set(metrics)
    trainer.save_model(str(tmp_path / "final"))
    [row] = vlmtrain.load_for_inference(str(tmp_path / "final"), device="cpu").score(
        [{"images": [pairs[0]["images"][0]], "texts": [{"user": "Colour?", "assistant": "red"}]}])
    assert set(row) == {"reward"} and math.isfinite(row["reward"])


def _reward_yaml(tmp_path, pretrained: str) -> str:
    """A hub_vlm run with a reward head on pairs with images from a JSONL: vlmtrain's own layout (a margin as
    `labels: {reward: m}`) and TRL's (a `margin` column) mixed; the chosen answer names the image's colour."""
    import yaml
    from PIL import Image

    colours = {"red": (220, 40, 40), "green": (40, 160, 40)}
    rows = []
    for i in range(8):
        right, wrong = ("red", "green") if i % 2 else ("green", "red")
        Image.new("RGB", (32, 32), colours[right]).save(tmp_path / f"{i}.png")
        if i % 4 < 2:
            rows.append({"images": [f"{i}.png"], "texts": [{"user": "Which colour?"}], "chosen": right,
                         "rejected": wrong, "labels": {"reward": 0.5}})
        else:
            rows.append({"images": [f"{i}.png"], "prompt": [{"role": "user", "content": "Which colour?"}],
                         "chosen": [{"role": "assistant", "content": right}],
                         "rejected": [{"role": "assistant", "content": wrong}], "margin": 0.5})
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = {"model": {"kind": "hub_vlm", "pretrained": pretrained, "heads": {"reward": {"type": "reward"}}},
           "data": {"source": "jsonl", "train_file": str(data), "eval_file": str(data), "max_length": 128},
           "train": {"output_dir": str(tmp_path / "run"), "objective": "reward", "max_steps": 2,
                     "per_device_train_batch_size": 4, "per_device_eval_batch_size": 4, "logging_steps": 1,
                     "save_steps": 2, "learning_rate": 1e-3, "weight_decay": 0.1, "disable_tqdm": True,
                     "report_to": "none", "dataloader_num_workers": 0}}
    path = tmp_path / "reward.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def test_reward_head_trains_from_yaml_pairs(tiny_hub, tmp_path, one_thread):
    """train.objective reward: a Hub VLM's reward head learns from pairs with images in a JSONL (both layouts):
    each step's loss is the head's Bradley-Terry loss alone (no language-model loss), evaluation logs
    eval_reward_accuracy / eval_reward_margin; a setting it cannot train is one ConfigError naming it."""
    from vlmtrain.config import load_run_config

    config = _reward_yaml(tmp_path, tiny_hub("qwen3_vl")[1])
    with pytest.raises(vlmtrain.errors.ConfigError, match="model.heads has none"):
        load_run_config(config, {"model.heads": {"q": {"type": "regression"}}})
    with pytest.raises(vlmtrain.errors.ConfigError, match="train.objective=reward is not supported for "
                                                          "model.kind=causal_lm"):
        load_run_config(config, {"model.kind": "causal_lm", "model.heads": None})
    assert cli.main(["train", "--config", config]) == 0
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "loss" in r]
    assert len(train) == 2 and all("loss_lm" not in r for r in train)
    for r in train:
        assert r["loss"] == pytest.approx(r["loss_reward"], rel=1e-5) and r["loss"] > 0
    final = [r for r in rows if "eval_reward_accuracy" in r][-1]
    assert 0.0 <= final["eval_reward_accuracy"] <= 1.0 and math.isfinite(final["eval_reward_margin"])
    assert (tmp_path / "run" / "checkpoint-2" / "heads.safetensors").is_file()


@pytest.mark.parametrize("family", ["qwen3_vl", "idefics3"])
def test_reward_pairs_encode_each_pairs_images_once(tiny_hub, tmp_path, family):
    """A VLM reward pair batch (RewardTrainer's, the YAML objective's collator) carries each pair's images once: one
    vision tower call per batch over each pair's images once (the plain batch: each image twice, in the chosen
    and the rejected row), with the rewards and loss of the plain forward (fp32, 1e-5) and its gradients (1e-4 of
    each tensor's largest: the plain batch sums two encodings' gradients per image, in another order)."""
    from transformers import AutoModelForImageTextToText

    from vlmtrain.data.vision_reward_pairs import VisionPairCollator

    _, tiny, processor = tiny_hub(family)
    pairs = _color_pairs()
    args = vlmtrain.RewardConfig(str(tmp_path / "rm"), bf16=False, report_to="none", use_cpu=True)
    model = AutoModelForImageTextToText.from_pretrained(tiny, dtype=torch.float32)
    trainer = vlmtrain.RewardTrainer(model=model, args=args, train_dataset=pairs, processing_class=processor)
    tower = model.model.visual if family == "qwen3_vl" else model.model.vision_model
    calls = []
    tower.register_forward_pre_hook(lambda *a: calls.append(1))
    three = [pairs[0], pairs[1], pairs[2]]
    batches = {"once": trainer.data_collator(three),
               "plain": VisionPairCollator(trainer.data_collator.processor, one_vision_pass=False)(three)}
    outs, grads = {}, {}
    for name, batch in batches.items():
        calls.clear()
        trainer.model.zero_grad()
        outs[name] = trainer.model(**{k: v for k, v in batch.items() if isinstance(v, torch.Tensor)})
        outs[name]["loss"].backward()
        grads[name] = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
        assert len(calls) == 1, name
    if family == "qwen3_vl":  # (the rows of grid_thw: the images encoded)
        assert batches["once"]["vision_image_grid_thw"].shape[0] == 3
        assert batches["plain"]["image_grid_thw"].shape[0] == 6
    torch.testing.assert_close(outs["once"]["logits_reward"], outs["plain"]["logits_reward"], rtol=1e-5, atol=1e-6)
    assert outs["once"]["loss"].item() == pytest.approx(outs["plain"]["loss"].item(), rel=1e-5)
    assert grads["once"].keys() == grads["plain"].keys()
    for name, grad in grads["plain"].items():  # (the plain batch sums each image's two encodings' gradients)
        assert (grads["once"][name] - grad).abs().max().item() <= 1e-4 * grad.abs().max().item() + 1e-8, name
