"""Video samples through the whole hub_vlm run, as image samples go: train with LoRA and score heads, evaluate,
``vlmtrain predict --data``, ``load_for_inference(...).score`` / ``.generate``; and resume mid-epoch exactly
(tiny Qwen3-VL, clips given as lists of frame PNGs in JSONL)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import yaml
from PIL import Image
from safetensors.torch import load_file

from vlmtrain import cli
from vlmtrain.models.families import get_family

COLORS = [(220, 40, 40), (40, 160, 40), (40, 40, 220)]


@pytest.fixture(scope="module")
def tiny_qwen(tmp_path_factory):
    return get_family("qwen3_vl").build_tiny(str(tmp_path_factory.mktemp("qwen3_vl")))


def _jsonl(tmp_path, n: int, score_only: bool = True) -> str:
    """n samples: even ones a 4-frame clip (a coloured square moving right over noise), odd ones an image; with
    ``score_only`` every other pair has no answer; head labels ``color``."""
    rng = np.random.default_rng(0)
    rows = []
    for i in range(n):
        c = i % len(COLORS)
        texts = [{"user": "Which colour?", "assistant": "rgb"[c]}] if i % 4 < 2 or not score_only else [
            {"user": "Which colour?"}]
        row = {"texts": texts, "labels": {"color": c}, "id": f"s{i}"}
        if i % 2 == 0:
            names = []
            for t in range(4):
                frame = rng.integers(0, 60, (32, 32, 3), dtype=np.uint8)
                frame[8:16, 4 + 4 * t:12 + 4 * t] = COLORS[c]
                names.append(f"v{i}_{t}.png")
                Image.fromarray(frame, "RGB").save(tmp_path / names[-1])
            row["videos"] = [names]
        else:
            Image.new("RGB", (32, 32), COLORS[c]).save(tmp_path / f"{i}.png")
            row["images"] = [f"{i}.png"]
        rows.append(row)
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _config(tmp_path, pretrained: str, model: dict | None = None, **train) -> str:
    data = _jsonl(tmp_path, 8, score_only=bool((model or {}).get("heads")))
    cfg = {"model": {"kind": "hub_vlm", "pretrained": pretrained, "torch_dtype": "float32", **(model or {})},
           "data": {"source": "jsonl", "train_file": data, "eval_file": data, "max_length": 160,
                    "video_min_pixels": 1024},  # (32 x 32: the clips stay small)
           "train": {"output_dir": str(tmp_path / "run"), "max_steps": 2, "per_device_train_batch_size": 4,
                     "per_device_eval_batch_size": 4, "logging_steps": 1, "save_steps": 2, "learning_rate": 1e-3,
                     "disable_tqdm": True, "report_to": "none", "seed": 0, **train}}
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def test_video_samples_train_with_lora_and_heads_then_eval_predict_score_generate(tiny_qwen, tmp_path, one_thread,
                                                                                  capsys):
    from vlmtrain import load_for_inference

    heads = {"color": {"type": "classification", "num_outputs": 3}}
    config = _config(tmp_path, tiny_qwen, {"lora": {"r": 4, "modules_to_save": ["projector"]}, "heads": heads})
    assert cli.main(["train", "--config", config]) == 0
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    final = next(r for r in rows if "train_loss" in r)
    assert not any(k.startswith("train_skipped") for k in final), final  # no video sample was skipped
    assert all(np.isfinite(r["loss_color"]) and np.isfinite(r["loss_lm"]) for r in rows if "loss_color" in r)
    ckpt = tmp_path / "run" / "checkpoint-2"
    capsys.readouterr()
    assert cli.main(["eval", "--config", config, "--checkpoint", str(ckpt)]) == 0
    out = capsys.readouterr().out
    metrics = json.loads(out[out.rindex("\n{\n") + 1:] if not out.startswith("{\n") else out)
    assert metrics["eval_samples"] == 8 and "eval_color_accuracy" in metrics
    assert not any(k.startswith("eval_skipped") for k in metrics), metrics

    data = str(tmp_path / "data.jsonl")
    out_file = tmp_path / "pred.jsonl"
    assert cli.main(["predict", "--checkpoint", str(ckpt), "--data", data, "--output", str(out_file)]) == 0
    predicted = [json.loads(line) for line in out_file.read_text().splitlines()]
    assert [p["id"] for p in predicted] == [f"s{i}" for i in range(8)]
    assert all("skipped" not in p and p["color"] in (0, 1, 2) for p in predicted), predicted

    inference = load_for_inference(str(ckpt))
    samples = [json.loads(line) for line in open(data)]
    for s in samples:  # (paths relative to the JSONL file; load_for_inference takes them as given)
        s["videos"] = [[str(tmp_path / f) for f in v] for v in s.get("videos", [])]
        s["images"] = [str(tmp_path / f) for f in s.get("images", [])]
    scored = inference.score(samples)
    assert [r["color"] for r in scored] == [p["color"] for p in predicted]
    for a, b in zip(scored, predicted):
        np.testing.assert_allclose(a["color_probs"], b["color_probs"], rtol=1e-5, atol=1e-6)
    video_sample = samples[0]
    answer = inference.generate(video_sample, max_new_tokens=4)
    assert answer == _greedy(inference, video_sample, 4)
    assert inference.generate("Which colour?", videos=video_sample["videos"], max_new_tokens=4) == answer


def _greedy(inference, sample: dict, max_new_tokens: int) -> str:
    """The greedy answer recomputed here: the sample's generation prompt through the same processing, the whole
    sequence re-run each step (no KV cache, no generate()), argmax until the end-of-turn token."""
    from vlmtrain.data.hub_processing import HubVLMProcessor
    from vlmtrain.data.video import VideoSettings

    family = get_family("qwen3_vl")
    hub = HubVLMProcessor(inference.processor, family, max_length=160, prompts=True,
                          video=VideoSettings(min_pixels=1024, max_tokens=160))  # (the run's data.video_*)
    item = hub.process({**sample, "texts": [{"user": sample["texts"][-1]["user"]}]})
    prompt = {k[len("prompt_"):]: v for k, v in item.items() if k.startswith("prompt_")}
    ids, types = prompt["input_ids"][None], prompt["mm_token_type_ids"][None]
    stop = inference.processor.tokenizer.convert_tokens_to_ids(family.end_of_turn)
    model, new = getattr(inference.model, "base", inference.model), []  # (the LM under the heads wrapper)
    with torch.no_grad():
        for _ in range(max_new_tokens):
            out = model(input_ids=ids, attention_mask=torch.ones_like(ids), mm_token_type_ids=types,
                        pixel_values_videos=prompt["pixel_values_videos"], video_grid_thw=prompt["video_grid_thw"])
            token = int(out.logits[0, -1].argmax())
            if token == stop:
                break
            new.append(token)
            ids, types = torch.cat([ids, torch.tensor([[token]])], 1), torch.cat([types, types.new_zeros(1, 1)], 1)
    return inference.processor.tokenizer.decode(new, skip_special_tokens=True).strip()


def test_resume_mid_epoch_with_video_samples_is_exact(tiny_qwen, tmp_path, one_thread):
    """8 samples at batch 2 (an epoch of 4 steps), packed; resumed from the straight run's checkpoint-2 (mid-epoch)
    into another directory: the weights at step 4 and the logged losses of steps 3-4 are bitwise the
    uninterrupted run's."""
    config = _config(tmp_path, tiny_qwen, max_steps=4, per_device_train_batch_size=2, data_seed=0)
    assert cli.main(["train", "--config", config]) == 0
    assert cli.main(["train", "--config", config, "--train.output_dir", str(tmp_path / "resumed"),
                     "--train.resume_from_checkpoint", str(tmp_path / "run" / "checkpoint-2")]) == 0
    runs = {}
    for name in ("run", "resumed"):
        rows = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        runs[name] = (load_file(str(tmp_path / name / "checkpoint-4" / "model.safetensors")),
                      {r["step"]: r["loss"] for r in rows if "loss" in r and r["step"] > 2})
    (straight, straight_loss), (resumed, resumed_loss) = runs["run"], runs["resumed"]
    assert straight_loss == resumed_loss and sorted(straight_loss) == [3, 4]
    assert straight.keys() == resumed.keys()
    for k in straight:
        assert torch.equal(straight[k], resumed[k]), k
