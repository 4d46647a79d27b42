"""vlmtrain.GRPOTrainer on prompts with videos (a ``videos`` list or one ``video``: a file, a list of frames, or a
decoded VideoClip, as DPO's pairs take them) on tiny Qwen3-VL and Qwen2.5-VL: each group's videos decoded once and
encoded once per rollout and once per training forward (one ``get_video_features`` call over the groups), the
rollout's completions and prefill logits those of a plain generate of the rows each with its own copy of its video,
the training forward's log-probs those of the plain forward; a batch mixing video, image and text-only prompts; a
family without video support refused before the model loads."""

from __future__ import annotations

import json
import random

import pytest
import torch
from PIL import Image

import vlmtrain
from tests.test_grpo_vision import _config, _first_logits, letters_reward
from tests.test_hub_video import frames
from vlmtrain.data.video import VideoSettings, load_planned
from vlmtrain.errors import ConfigError

SETTINGS = VideoSettings(fps=1.0, min_pixels=1024, max_tokens=300)
"""Clips kept at their own small frames (32 x 32), as tests/test_dpo_video.py keeps them; at 1 frame a second
(Qwen2.5-VL: second_per_grid_ts 2, not the 1 its positions assume without it)."""
QUESTIONS = ["what moves", "what colour", "how many", "which shape"]


def clip(video, seed: int, count: int):
    """A clip of ``count`` random frames decoded as the family's plan keeps them under :data:`SETTINGS`."""
    decoded, plan = load_planned(frames(seed, count), SETTINGS, video.plan)
    decoded.size = (plan.height, plan.width)
    return decoded


def _image(seed: int) -> Image.Image:
    return Image.frombytes("RGB", (32, 32), random.Random(seed).randbytes(32 * 32 * 3))


def mixed_prompts(video) -> list[dict]:
    """A video (4 frames), an image, text only, and a video (6 frames) with an image."""
    clips = {0: [clip(video, 0, 4)], 3: [clip(video, 1, 6)]}
    images = {1: [_image(1)], 3: [_image(3)]}
    return [{"prompt": [{"role": "user", "content": q}], "videos": clips.get(i, []), "images": images.get(i, []),
             "target": "ab"[i % 2]} for i, q in enumerate(QUESTIONS)]


class GridCounter:
    """The vision tower's calls: each call's ``grid_thw`` (t > 1 here: a video's)."""

    def __init__(self, tower: torch.nn.Module) -> None:
        self.grids: list[torch.Tensor] = []
        tower.register_forward_pre_hook(
            lambda m, args, kwargs: self.grids.append(kwargs.get("grid_thw", args[1] if len(args) > 1 else None)),
            with_kwargs=True)


@pytest.fixture(scope="module", params=["qwen3_vl", "qwen2_5_vl"])
def video_run(request, tiny_hub, tmp_path_factory):
    """One greedy step of vlmtrain's GRPO with its own rollout on :func:`mixed_prompts` (2 completions each, one
    micro-batch of 8 rows): the vision tower's calls recorded, the rollout's completions and prefill logits."""
    from transformers import AutoModelForImageTextToText

    fam, path, processor = tiny_hub(request.param)
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32)
    prompts = mixed_prompts(fam.video(processor, SETTINGS))
    args = _config(vlmtrain.GRPOConfig, tmp_path_factory.mktemp("video"), max_steps=1, num_generations=2,
                   per_device_train_batch_size=8, max_completion_length=5, reward_weights=None,
                   generation_kwargs={"do_sample": False})
    trainer = vlmtrain.GRPOTrainer(model=model, reward_funcs=letters_reward, args=args, train_dataset=prompts,
                                   processing_class=processor)
    counter, prefill, recorded, generate = GridCounter(model.model.visual), _first_logits(model), [], trainer.generator
    trained: list[torch.Tensor] = []  # (the training forward's logits: the one forward with gradients)
    model.register_forward_hook(lambda m, a, out: trained.append(out.logits.detach()) if torch.is_grad_enabled()
                                else None)

    def recording(model, prompt_ids, **vision):
        out = generate(model, prompt_ids, **vision)
        recorded.append((len(counter.grids), vision["vision"], out))
        return out

    trainer.generator = recording
    trainer.train()
    return {"counter": counter, "recorded": recorded, "prefill": prefill, "prompts": prompts,
            "hub": (fam, path, processor), "trained": trained}


def test_each_groups_videos_encoded_once_per_rollout_and_per_forward(video_run):
    """The rollout makes one vision tower call for the 2 groups' images and one for their videos (each video once,
    not once per completion), and so does the training forward."""
    (calls, groups, _), = video_run["recorded"]
    grids = video_run["counter"].grids
    assert calls == 2 and len(grids) == 4  # (the rollout's two calls, then the training forward's)
    keys = groups.inputs(0, 8)
    assert keys["videos_video_grid_thw"].shape[0] == 2 and keys["video_grid_thw"].shape[0] == 4  # (rows: 2 each)
    for encoded in (grids[:2], grids[2:]):
        assert torch.equal(encoded[0], keys["vision_image_grid_thw"])
        assert torch.equal(encoded[1], keys["videos_video_grid_thw"])


def _plain_rows(processor, video, rows: list[dict]) -> dict:
    """The processor over the rows' prompts (left-padded), each row with its own copy of its images and videos."""
    texts = [processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "video"}] * len(r["videos"]) + [{"type": "image"}] * len(r["images"])
          + [{"type": "text", "text": r["prompt"][0]["content"]}]}], tokenize=False, add_generation_prompt=True)
        for r in rows]
    clips = [c for r in rows for c in r["videos"]]
    processor.tokenizer.padding_side = "left"
    videos = {"videos": [c.frames for c in clips], "video_metadata": [c.metadata() for c in clips]} if clips else {}
    try:
        return video.attach(processor, [c.size for c in clips])(
            text=texts, images=[im for r in rows for im in r["images"]] or None, padding=True, return_tensors="pt",
            **videos)
    finally:
        processor.tokenizer.padding_side = "right"


def test_rollout_equals_a_plain_per_row_generate(video_run):
    """The rollout's completions (each group's videos and images encoded once, the features shared by its rows)
    equal greedy generate over the 8 rows, each with its own copy of its prompt's videos and images, and so do
    the prefill's logits (features and multimodal rotary positions agree)."""
    from transformers import AutoModelForImageTextToText

    fam, path, processor = video_run["hub"]
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    rows = [r for r in video_run["prompts"] for _ in range(2)]
    plain = _plain_rows(processor, fam.video(processor, SETTINGS), rows)
    prefill = _first_logits(model)
    eos = processor.tokenizer.convert_tokens_to_ids("<|im_end|>")
    out = model.generate(**plain, max_new_tokens=5, do_sample=False, pad_token_id=processor.tokenizer.pad_token_id,
                         eos_token_id=[eos], suppress_tokens=[model.config.image_token_id, model.config.video_token_id])
    expected = []
    for row in out[:, plain["input_ids"].shape[1]:].tolist():
        end = next((i for i, t in enumerate(row) if t == eos), None)
        expected.append(row if end is None else row[:end + 1])
    (_, _, completions), = video_run["recorded"]
    assert completions == expected
    torch.testing.assert_close(video_run["prefill"][0], prefill[0], rtol=1e-5, atol=1e-6)
    assert not torch.allclose(prefill[0][0], prefill[0][6])  # (the two video prompts' rows differ)


def test_training_forward_equals_the_plain_forward_of_the_rows(video_run):
    """The training forward's logits at the completions (each group's videos and images encoded once, the
    features shared by its rows, each row's video_grid_thw / second_per_grid_ts for its positions) equal the plain
    forward of the 8 rows, prompt and completion, each with its own copy of its videos and images."""
    from transformers import AutoModelForImageTextToText

    from vlmtrain.compat.grpo_rollout import pad_rows

    fam, path, processor = video_run["hub"]
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    plain = _plain_rows(processor, fam.video(processor, SETTINGS), [r for r in video_run["prompts"] for _ in range(2)])
    (_, _, completions), = video_run["recorded"]
    c_ids, c_mask = pad_rows(completions, processor.tokenizer.pad_token_id, "right")
    inputs = {**plain, "input_ids": torch.cat([plain["input_ids"], c_ids], 1),
              "attention_mask": torch.cat([plain["attention_mask"], c_mask], 1),
              "mm_token_type_ids": torch.cat([plain["mm_token_type_ids"], torch.zeros_like(c_ids)], 1)}
    with torch.no_grad():
        logits = model(**inputs, logits_to_keep=c_ids.shape[1] + 1, use_cache=False).logits
    (ours,) = video_run["trained"]
    torch.testing.assert_close(ours, logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen2_5_vl"])
def test_training_forward_logps_equal_the_plain_forward(tiny_hub, tmp_path, family):
    """The completion log-probs of a slice of rows that cuts a group (one ``video`` given as a file, decoded under
    the settings; then a group with a VideoClip and an image) equal those of the plain forward of the rows, each
    with its own copy of its video and images (Qwen2.5-VL's second_per_grid_ts per row)."""
    import numpy as np
    from transformers import AutoModelForImageTextToText

    from vlmtrain.compat.grpo_rollout import pad_rows
    from vlmtrain.compat.grpo_vision import encode_groups
    from vlmtrain.data.video import write_video
    from vlmtrain.models.objectives.grpo import completion_logps

    fam, path, processor = tiny_hub(family)
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    video = fam.video(processor, SETTINGS)
    file = write_video(str(tmp_path / "clip.mp4"), [np.asarray(f) for f in frames(2, 8)], fps=4)
    first = {"prompt": [{"role": "user", "content": "what moves"}], "video": file}
    second = mixed_prompts(video)[3]
    rows = [first] * 2 + [second] * 3
    groups = encode_groups(processor, rows, model.config.image_token_id, video=video)
    assert groups.row_group == [0, 0, 1, 1, 1]
    ids, mask = pad_rows(groups.row_prompt_ids(), processor.tokenizer.pad_token_id, "left")
    completions = torch.tensor([[64, 65, 66, 67]] * 5)
    vision = {**groups.inputs(0, 5), **groups.token_rows(ids.shape[1], 4)}
    assert vision["videos_video_grid_thw"].shape[0] == 2  # (each group's video once, not 5 times)
    inputs = (torch.cat([ids, completions], 1), torch.cat([mask, torch.ones_like(completions)], 1), completions)
    with torch.no_grad():
        ours = completion_logps(model, *inputs, 1.0, **vision)[0]
    decoded, plan = load_planned(file, SETTINGS, video.plan)
    decoded.size = (plan.height, plan.width)
    plain_rows = [{**first, "videos": [decoded], "images": []}] * 2 + [second] * 3
    plain = _plain_rows(processor, video, plain_rows)
    assert torch.equal(plain["input_ids"], ids)
    extra = {k: plain[k] for k in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw",
                                   "second_per_grid_ts") if k in plain}
    assert ("second_per_grid_ts" in extra) == (family == "qwen2_5_vl")
    types = torch.cat([plain["mm_token_type_ids"], torch.zeros_like(completions)], 1)
    with torch.no_grad():
        expected = completion_logps(model, *inputs, 1.0, mm_token_type_ids=types, **extra)[0]
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-6)


def test_videos_on_a_family_without_video_support_refused_before_loading(tmp_path):
    """A Gemma 3 checkpoint (its config alone: no weights to load) with video prompts: one line naming the
    family, before the model loads."""
    (tmp_path / "gemma").mkdir()
    (tmp_path / "gemma" / "config.json").write_text(json.dumps({"model_type": "gemma3"}))
    args = _config(vlmtrain.GRPOConfig, tmp_path / "out", reward_weights=None)
    rows = [{"prompt": [{"role": "user", "content": "what moves?"}], "video": "clip.mp4"}] * 2
    with pytest.raises(ConfigError, match="'video' column.*gemma3 family has no video support"):
        vlmtrain.GRPOTrainer(model=str(tmp_path / "gemma"), reward_funcs=letters_reward, args=args,
                             train_dataset=rows)


def video_reward(completions, target, **kwargs):
    return [float(t in c[0]["content"]) + 0.1 * (len(c[0]["content"]) % 3) for c, t in zip(completions, target,
                                                                                            strict=True)]


def test_grpo_from_yaml_on_video_prompts_equals_grpo_trainer(tiny_hub, tmp_path, one_thread, capsys):
    """`train.objective: grpo` on a tiny Qwen3-VL with JSONL prompts whose videos are frame files (paths relative to
    the file; vlmtrain's `texts` layout and TRL's messages), one with an image too, the first text-only (without a
    videos key: the rows get an empty one, so the run still knows videos come): `vlmtrain data
    inspect --config` shows each prompt's tokens with the video placeholders expanded, and the run (data.video_*
    settings applied) takes the steps vlmtrain.GRPOTrainer takes on the same prompts with the clips decoded under
    the same settings (loss, rewards, KL, entropy: rel 1e-5)."""
    import yaml
    from transformers import AutoModelForImageTextToText

    from tests.test_objective_grpo import _jsonl, _metrics, assert_steps_equal_python
    from vlmtrain import cli

    fam, path, processor = tiny_hub("qwen3_vl")
    video = fam.video(processor, SETTINGS)
    rows, python_rows = [], []
    for i, question in enumerate(QUESTIONS):
        files = []
        for k, frame in enumerate(frames(10 + i, 4) if i else []):
            frame.save(tmp_path / f"v{i}-{k}.png")
            files.append(f"v{i}-{k}.png")
        images = [_image(i)] if i == 3 else []
        for k, image in enumerate(images):
            image.save(tmp_path / f"im{i}-{k}.png")
        record = {**({"videos": [files]} if files else {}),  # (the first, text-only, has no videos key at all)
                  "images": [f"im{i}-{k}.png" for k in range(len(images))], "target": "ab"[i % 2]}
        rows.append({**record, "texts": [{"user": question}]} if i % 2 else
                    {**record, "prompt": [{"role": "user", "content": question}]})
        python_rows.append({"prompt": [{"role": "user", "content": question}], "target": "ab"[i % 2],
                            "videos": [clip(video, 10 + i, 4)] if files else [],
                            "images": [Image.open(tmp_path / f"im{i}-{k}.png").convert("RGB")
                                       for k in range(len(images))]})
    train = {"num_generations": 2, "per_device_train_batch_size": 4, "max_completion_length": 4, "max_steps": 2,
             "learning_rate": 3e-3, "weight_decay": 0.1, "logging_steps": 1, "seed": 7, "report_to": "none",
             "dataloader_num_workers": 0, "disable_tqdm": True, "beta": 0.1, "shuffle_dataset": False}
    config = {"model": {"kind": "hub_vlm", "pretrained": str(path)},
              "data": {"source": "jsonl", "train_file": _jsonl(tmp_path / "video.jsonl", rows), "video_fps": 1.0,
                       "video_min_pixels": 1024, "max_video_tokens": 300},
              "train": {"output_dir": str(tmp_path / "run"), "objective": "grpo", "save_strategy": "no",
                        "reward_funcs": ["tests.test_grpo_video:video_reward"], **train}}
    (tmp_path / "video.yaml").write_text(yaml.safe_dump(config))
    assert cli.main(["data", "inspect", str(tmp_path / "video.jsonl"), "--config", str(tmp_path / "video.yaml")]) == 0
    shown = [line for line in capsys.readouterr().out.splitlines() if line.strip().startswith("prompt (")]
    expected = [int(r["processed"]["input_ids"].eq(processor.tokenizer.convert_tokens_to_ids("<|video_pad|>")).sum())
                for r in [{"processed": _plain_rows(processor, video, [p])} for p in python_rows]]
    assert expected[0] == 0 and expected[1] > 0
    assert [line.count("<|video_pad|>") for line in shown] == expected  # (the same expansion as the run's)
    assert cli.main(["train", "--config", str(tmp_path / "video.yaml")]) == 0
    ours = [r for r in _metrics(tmp_path / "run") if "loss" in r]
    assert_steps_equal_python({"yaml": ours}, AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32), processor,
                              python_rows, video_reward, train, tmp_path)
