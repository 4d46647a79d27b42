"""hub_vlm through the CLI: train with score heads + LoRA, then eval / predict / generate from its checkpoint."""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from PIL import Image

from vlmtrain import cli
from vlmtrain.config import ConfigError, load_run_config
from vlmtrain.models.families import get_family

COLORS = [(220, 40, 40), (40, 160, 40), (40, 40, 220)]


@pytest.fixture(scope="module")
def tiny_qwen(tmp_path_factory):
    return get_family("qwen3_vl").build_tiny(str(tmp_path_factory.mktemp("qwen3_vl")))


def _jsonl(tmp_path, n):
    rows = []
    for i in range(n):
        c = i % len(COLORS)
        Image.new("RGB", (32, 32), COLORS[c]).save(tmp_path / f"{i}.png")
        texts = [{"user": "Which colour?", "assistant": "rgb"[c]}] if i % 2 else [{"user": "Which colour?"}]
        rows.append({"images": [f"{i}.png"], "texts": texts, "labels": {"color": c, "level": float(c)}})
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _config(tmp_path, pretrained, **model):
    data = _jsonl(tmp_path, 8)
    cfg = {"model": {"kind": "hub_vlm", "pretrained": pretrained,
                     "heads": {"color": {"type": "classification", "num_outputs": 3},
                               "level": {"type": "regression", "loss": "huber", "weight": 0.5}}, **model},
           "data": {"source": "jsonl", "train_file": data, "eval_file": data, "max_length": 64},
           "train": {"output_dir": str(tmp_path / "run"), "max_steps": 2, "per_device_train_batch_size": 4,
                     "per_device_eval_batch_size": 4, "logging_steps": 1, "save_steps": 2,
                     "learning_rate": 1e-3, "disable_tqdm": True}}
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def test_heads_and_lora_train_eval_predict_generate(tiny_qwen, tmp_path, one_thread, capsys):
    config = _config(tmp_path, tiny_qwen, lora={"r": 4})
    assert cli.main(["train", "--config", config]) == 0
    ckpt = tmp_path / "run" / "checkpoint-2"
    assert (ckpt / "adapter_model.safetensors").is_file() and (ckpt / "heads.safetensors").is_file()
    assert not (ckpt / "model.safetensors").exists()  # the frozen base is not copied into checkpoints
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if "loss" in r and "eval_loss" not in r]
    assert all({"loss_color", "loss_level", "loss_lm"} <= set(r) for r in train_rows)
    capsys.readouterr()
    assert cli.main(["eval", "--config", config, "--checkpoint", str(ckpt)]) == 0
    out = capsys.readouterr().out  # (log lines, then the metrics as indented JSON)
    metrics = json.loads(out[out.rindex("\n{\n") + 1:] if not out.startswith("{\n") else out)
    for key in ("eval_loss_color", "eval_loss_level", "eval_color_accuracy", "eval_color_f1", "eval_level_mae",
                "eval_level_rmse", "eval_level_pearson", "eval_level_spearman"):
        assert key in metrics, key
    assert cli.main(["predict", "--config", config, "--checkpoint", str(tmp_path / "run")]) == 0
    predictions = [json.loads(line) for line in (tmp_path / "run" / "predictions.jsonl").read_text().splitlines()]
    assert [p["index"] for p in predictions] == list(range(8))
    assert all(p["color"] in (0, 1, 2) and len(p["color_probs"]) == 3 and isinstance(p["level"], float)
               for p in predictions)
    # generate: two steps move a LoRA adapter too little to change a greedy answer, so the adapter is seeded
    # with large random B matrices; the answer must be the greedy decode of base + that adapter.
    _seed_adapter(ckpt)
    image = tmp_path / "0.png"
    expected = _greedy_answer(tiny_qwen, ckpt, image, "Which colour?", 3)
    assert expected and expected != _greedy_answer(tiny_qwen, None, image, "Which colour?", 3)  # the adapter counts
    capsys.readouterr()
    assert cli.main(["generate", "--checkpoint", str(ckpt), "--image", str(image),
                     "--prompt", "Which colour?", "--max-new-tokens", "3"]) == 0
    out = capsys.readouterr().out
    assert out == f"{expected}\n" or out.endswith(f"\n{expected}\n"), (out, expected)  # (after any log lines)


def _seed_adapter(ckpt) -> None:
    from safetensors.torch import load_file, save_file

    path = str(ckpt / "adapter_model.safetensors")
    weights, gen = load_file(path), torch.Generator().manual_seed(0)
    save_file({k: torch.randn(v.shape, generator=gen) if "lora_B" in k else v for k, v in weights.items()}, path)


def _greedy_answer(base: str, adapter, image, prompt: str, max_new_tokens: int) -> str:
    """The greedy answer decoded here: base model (+ the LoRA adapter in ``adapter``) loaded with transformers
    and peft, the prompt from the processor's own chat template, the whole sequence recomputed each step (no
    KV cache, no generate()), argmax until the end-of-turn token."""
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(base, dtype=torch.float32)
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter))
    model.eval()
    processor = get_family("qwen3_vl").load_processor(base)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": prompt}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    inputs = processor(text=[text], images=[Image.open(image).convert("RGB")], return_tensors="pt")
    stop = processor.tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids, types, new = inputs["input_ids"], inputs["mm_token_type_ids"], []  # (types: 1 on image tokens)
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), mm_token_type_ids=types,
                           pixel_values=inputs["pixel_values"], image_grid_thw=inputs["image_grid_thw"]).logits
            token = int(logits[0, -1].argmax())
            if token == stop:
                break
            new.append(token)
            ids, types = torch.cat([ids, torch.tensor([[token]])], 1), torch.cat([types, types.new_zeros(1, 1)], 1)
    return processor.tokenizer.decode(new, skip_special_tokens=True).strip()


def test_bad_hub_configs_fail_before_any_work(tiny_qwen, tmp_path):
    config = _config(tmp_path, tiny_qwen)
    with pytest.raises(ConfigError, match="model.heads.color"):
        load_run_config(config, {"model.heads": {"color": {"type": "classification", "loss": "dice"}}})
    with pytest.raises(ConfigError, match="data.packing=true with model.heads: score heads pool"):
        load_run_config(config, {"data.packing": True})
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "config.json").write_text(json.dumps({"model_type": "bert"}))
    from vlmtrain import run

    with pytest.raises(ConfigError, match="'bert' is not a supported Hub VLM family; supported: gemma3"):
        run.build(load_run_config(config, {"model.pretrained": str(tmp_path / "other")}))


@pytest.mark.parametrize("generate", [False, True])
def test_generation_prompts_only_in_evaluation_batches(tiny_qwen, tmp_path, generate):
    """A generation prompt is a second processor call per sample: training batches never carry one; evaluation
    and prediction batches do when evaluation generates (train.predict_with_generate)."""
    from vlmtrain import run

    cfg = load_run_config(_config(tmp_path, tiny_qwen), {"train.predict_with_generate": generate})
    trainer = run.build(cfg)
    samples = [trainer.train_dataset[i] for i in range(4)]
    train_batch = trainer.data_collator(samples)
    eval_batch = trainer.data_collator.without_packing()(samples)
    assert not any(k.startswith("prompt_") for k in train_batch)
    assert any(k.startswith("prompt_") for k in eval_batch) == generate
    for key, value in train_batch.items():  # the rest of the batch is the same
        same = torch.equal(value, eval_batch[key]) if isinstance(value, torch.Tensor) else value == eval_batch[key]
        assert same, key


def test_generation_keeps_the_heads_predictions_and_metrics(tiny_qwen, tmp_path, one_thread):
    """With train.predict_with_generate a model with score heads still reports every head metric (the same
    values as evaluating without generation) next to the generation's exact match, and predict returns the
    heads' outputs per sample beside the generated answers."""
    import numpy as np

    from vlmtrain import run

    config = _config(tmp_path, tiny_qwen)
    plain = run.build(load_run_config(config))
    expected, heads = plain.evaluate(), plain.predict(plain.eval_dataset).heads
    trainer = run.build(load_run_config(config, {"train.predict_with_generate": True,
                                                 "train.generation_max_new_tokens": 2}))
    metrics = trainer.evaluate()
    head_keys = [k for k in expected if k.startswith(("eval_color_", "eval_level_", "eval_loss"))]
    assert {"eval_color_accuracy", "eval_level_mae", "eval_loss_color"} <= set(head_keys)
    for key in head_keys:
        assert metrics[key] == pytest.approx(expected[key], rel=1e-5, abs=1e-6), key
    assert "eval_exact_match" in metrics
    out = trainer.predict(trainer.eval_dataset)
    assert sorted(out.heads) == ["color", "level"]
    for name, rows in heads.items():
        np.testing.assert_allclose(out.heads[name], rows, atol=1e-5)
    assert len(out.texts) == 8 and out.predictions.shape[0] == 8 and out.predictions.dtype.kind == "i"
