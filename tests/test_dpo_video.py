"""Preference pairs whose prompt carries a video (vlmtrain's own layout: a ``videos`` entry, as SFT samples hold
them) in vlmtrain.DPOTrainer and `train.objective: dpo`: each pair's videos decoded and encoded once (one vision
tower call for the batch's videos, one for its images), and the answers' log-probs and every gradient equal the
plain forward of the 2B rows with the videos repeated per row (fp32), padded and padding-free."""

from __future__ import annotations

import functools
import json
import random

import pytest
import torch

from tests.test_dpo_vision import _pair, logps_and_grads
from tests.test_hub_video import frames
from vlmtrain.data.video import VideoSettings, load_planned
from vlmtrain.models.objectives.dpo import answer_logps

SETTINGS = VideoSettings(min_pixels=1024, max_tokens=300)
"""Clips kept at their own small frames (32 x 32), as tests/test_hub_video.py keeps them."""


def _video_pairs(video, seed: int = 5) -> list[dict]:
    """A batch mixing a pair with a video (4 frames), a text-only pair, a pair with an image, and one with a
    video (6 frames) and an image; the videos decoded as the family's plan keeps them."""
    rng = random.Random(seed)

    def clip(s: int, count: int):
        decoded, plan = load_planned(frames(s, count), SETTINGS, video.plan)
        decoded.size = (plan.height, plan.width)
        return decoded

    return [{**_pair(rng, 0), "videos": [clip(0, 4)]}, _pair(rng, 0), _pair(rng, 1),
            {**_pair(rng, 1), "videos": [clip(1, 6)]}]


class GridCounter:
    """The vision tower's calls and the images / videos they encode (the rows of ``grid_thw``)."""

    def __init__(self, tower: torch.nn.Module) -> None:
        self.calls, self.grids = 0, 0
        tower.register_forward_pre_hook(self._count, with_kwargs=True)

    def _count(self, module, args, kwargs) -> None:
        self.calls += 1
        self.grids += int(kwargs.get("grid_thw", args[1] if len(args) > 1 else None)[:, 0].sum())


@pytest.mark.parametrize("family,padding_free", [("qwen3_vl", False), ("qwen2_5_vl", False), ("qwen3_vl", True)],
                         ids=["qwen3_vl", "qwen2_5_vl", "qwen3_vl-padding_free"])
def test_one_video_pass_logps_and_gradients_equal_the_plain_forward(tiny_hub, family, padding_free, one_thread):
    from transformers import AutoModelForImageTextToText

    from vlmtrain.data.preference_vision import VisionPreferenceCollator, render_pair
    from vlmtrain.models.objectives.dpo import pair_logps

    fam, path, processor = tiny_hub(family)
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    video = fam.video(processor, SETTINGS)
    pairs = _video_pairs(video)
    rope = functools.partial(fam.rope_positions, model.config)
    batch = VisionPreferenceCollator(processor, video=video)(pairs)
    ours_batch = VisionPreferenceCollator(processor, padding_free=True, rope_positions=rope, video=video)(pairs) \
        if padding_free else batch
    texts = [render_pair(p, processor) for p in pairs]
    rows = [t[0] + t[1] for t in texts] + [t[0] + t[2] for t in texts]
    clips = [c for p in pairs for c in p.get("videos", [])] * 2  # (each row its own copy of its prompt's videos)
    plain = video.attach(processor, [c.size for c in clips])(
        text=rows, images=[p["images"] for p in pairs] * 2, videos=[c.frames for c in clips],
        video_metadata=[c.metadata() for c in clips], padding=True, return_tensors="pt", add_special_tokens=False)
    width = batch["input_ids"].shape[1]
    assert torch.equal(plain["input_ids"][:, :width], batch["input_ids"])  # (the same rows, right-padded)
    assert batch["videos_pixel_values_videos"].shape[0] * 2 == plain["pixel_values_videos"].shape[0]
    assert torch.equal(batch["video_grid_thw"], plain["video_grid_thw"])  # (each row's own, for its positions)
    counter = GridCounter(model.model.visual)
    weights = torch.tensor([1.0, -1.0, 0.5, 2.0, -0.3, 1.0, 0.7, -2.0])  # (a gradient through every row)

    ours, our_grads = logps_and_grads(model, weights, lambda: pair_logps(model, ours_batch))
    ours_encoded = counter.calls, counter.grids
    counter.calls = counter.grids = 0
    theirs, their_grads = logps_and_grads(model, weights, lambda: answer_logps(
        model(**plain, use_cache=False).logits[:, :width], batch["input_ids"], batch["completion_mask"]))
    assert ours_encoded == (2, counter.grids // 2)  # (one call for the videos, one for the images: each once)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    assert ours.abs().min() > 1.0  # (every row has answer tokens)
    assert our_grads.keys() == their_grads.keys() and any(".visual" in n for n in our_grads)
    for name, grad in their_grads.items():  # (the chosen and rejected rows' gradients meet in one encoding)
        scale = grad.abs().max().item()
        assert (our_grads[name] - grad).abs().max().item() <= 1e-5 * scale + 1e-8, name


def _frame_files(tmp_path, seed: int, count: int) -> list[str]:
    paths = []
    for k, image in enumerate(frames(seed, count)):
        paths.append(str(tmp_path / f"v{seed}-{k}.png"))
        image.save(paths[-1])
    return paths


def test_dpo_trainer_trains_on_video_pairs_encoding_each_video_once(tiny_hub, tmp_path, one_thread):
    """vlmtrain.DPOTrainer on a Qwen3-VL with pairs whose prompts carry videos (lists of frame images), images or
    neither: each step one vision call for the batch's videos (and one for its images) in the policy and in the
    reference, each video encoded once per model."""
    from datasets import Dataset

    import vlmtrain

    _, path, processor = tiny_hub("qwen3_vl")
    rng = random.Random(2)
    pairs = [{**_pair(rng, 0), "videos": [frames(0, 4)]}, _pair(rng, 1),
             {**_pair(rng, 0), "videos": [frames(1, 4)]}, {**_pair(rng, 0), "videos": [frames(2, 4)]}]
    args = vlmtrain.DPOConfig(str(tmp_path), max_steps=2, logging_steps=1, per_device_train_batch_size=2,
                              learning_rate=3e-3, bf16=False, gradient_checkpointing=False, report_to="none",
                              save_strategy="no", use_cpu=True, disable_tqdm=True, dataloader_num_workers=0,
                              train_sampling_strategy="sequential")
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32)
    trainer = vlmtrain.DPOTrainer(model=model, args=args, train_dataset=Dataset.from_list(pairs),
                                  processing_class=processor)
    counters = {"policy": GridCounter(model.model.visual), "ref": GridCounter(trainer.ref_model.model.visual)}
    trainer.train()
    logs = [e for e in trainer.state.log_history if "loss" in e]
    assert logs[0]["loss"] == pytest.approx(0.6931472, rel=1e-5)  # (log 2: policy = reference)
    assert logs[1]["loss"] != pytest.approx(logs[0]["loss"], abs=1e-6)
    batch = trainer.data_collator(pairs[:2])
    videos = int(batch["videos_video_grid_thw"][:, 0].sum())  # (the first batch's one video, once)
    for who, counter in counters.items():  # steps: video + image calls, then the video call
        assert counter.calls == 3, who
        assert counter.grids == videos + 1 + int(trainer.data_collator(pairs[2:])["videos_video_grid_thw"][:, 0].sum())


def test_yaml_dpo_on_video_pairs(tiny_hub, tmp_path, one_thread):
    """`train.objective: dpo` on a hub_vlm with JSONL pairs in vlmtrain's layout whose prompts carry videos
    (frame files): the pair collator lays a batch out as vlmtrain.DPOTrainer's collator with the same video
    support does (each clip decoded once per pair, data.video_* settings), and a run trains on them."""
    import yaml

    from vlmtrain import cli
    from vlmtrain.config import load_run_config
    from vlmtrain.data.preference_vision import VisionPreferenceCollator
    from vlmtrain.models.kinds import get_kind

    fam, path, processor = tiny_hub("qwen3_vl")
    rows = [{"videos": [_frame_files(tmp_path, s, 4)], "texts": [{"user": f"what moves in clip {s}?"}],
             "chosen": "the red square", "rejected": "a blue circle"} for s in range(3)]
    rows.append({"texts": [{"user": "two and two?"}], "chosen": "four", "rejected": "five"})
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = {"model": {"kind": "hub_vlm", "pretrained": str(path), "torch_dtype": "float32"},
           "data": {"source": "jsonl", "train_file": str(tmp_path / "train.jsonl"), "max_length": 512,
                    "video_min_pixels": 1024, "max_video_tokens": 300},
           "train": {"output_dir": str(tmp_path / "run"), "objective": "dpo", "save_strategy": "no",
                     "learning_rate": 3e-3, "logging_steps": 1, "seed": 7, "report_to": "none", "max_steps": 2,
                     "dataloader_num_workers": 0, "disable_tqdm": True, "per_device_train_batch_size": 2}}
    (tmp_path / "dpo.yaml").write_text(yaml.safe_dump(cfg))
    collate = get_kind("hub_vlm").pairs(load_run_config(str(tmp_path / "dpo.yaml")), processor)
    batch = collate([{**rows[0], "videos": [_frame_files(tmp_path, 0, 4)]}, rows[3]])
    theirs = VisionPreferenceCollator(processor, 512, video=fam.video(processor, SETTINGS))(
        [{"prompt": [{"role": "user", "content": "what moves in clip 0?"}],
          "chosen": [{"role": "assistant", "content": "the red square"}],
          "rejected": [{"role": "assistant", "content": "a blue circle"}], "videos": [frames(0, 4)]},
         {"prompt": [{"role": "user", "content": "two and two?"}],
          "chosen": [{"role": "assistant", "content": "four"}],
          "rejected": [{"role": "assistant", "content": "five"}]}])
    assert batch["skipped"] == {} and set(theirs) <= set(batch)
    for key, value in theirs.items():
        torch.testing.assert_close(batch[key], value, msg=key)
    assert cli.main(["train", "--config", str(tmp_path / "dpo.yaml")]) == 0
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in lines if "loss" in r]
    assert len(losses) == 2 and losses[0] == pytest.approx(0.6931472, rel=1e-5)


def test_reward_trainer_takes_video_pairs(tiny_hub, tmp_path, one_thread):
    """vlmtrain.RewardTrainer on a Qwen3-VL: a pair's videos go with each of its chosen and rejected samples
    (processed as SFT processes a sample with a video), and the reward head trains on them."""
    from transformers import AutoModelForImageTextToText

    import vlmtrain

    _, path, processor = tiny_hub("qwen3_vl")
    pairs = [{"prompt": [{"role": "user", "content": f"what moves in clip {s}?"}],
              "chosen": [{"role": "assistant", "content": "the red square"}],
              "rejected": [{"role": "assistant", "content": "a blue circle"}], "videos": [frames(s, 4)]}
             for s in range(2)]
    args = vlmtrain.RewardConfig(str(tmp_path / "rm"), per_device_train_batch_size=2, max_steps=1, logging_steps=1,
                                 bf16=False, gradient_checkpointing=False, report_to="none", use_cpu=True,
                                 save_strategy="no", disable_tqdm=True)
    trainer = vlmtrain.RewardTrainer(model=AutoModelForImageTextToText.from_pretrained(path), args=args,
                                     train_dataset=pairs, processing_class=processor)
    batch = trainer.data_collator(pairs)
    assert batch["input_ids"].shape[0] == 4 and batch["video_grid_thw"].shape[0] == 4  # (each sample its video)
    trainer.train()
    assert [e["step"] for e in trainer.state.log_history if "loss_reward" in e] == [1]
