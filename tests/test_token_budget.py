"""Token-budget micro-batches for Hub VLMs: data.packing + data.pack_window + per_device_train_batch_size 1 give one
row of data.pack_length tokens per step, and data.max_patches_per_pack pads the vision tower to a fixed number of
patches (models/vision/vision_padding.py).

On a tiny Qwen3-VL through run.build: every step is [1, T] with T = pack_length and the vision tower sees exactly
max_patches_per_pack patches; rows never exceed T tokens or the patch budget; every sample lands whole in exactly
one row; a row's per-document logits, loss and gradients equal its samples' padded (sdpa and varlen_torch); a
mid-window stop and resume gives the same rows; the blank padding images change no logit or gradient (Qwen3-VL,
Qwen2.5-VL); budgets that cannot hold a sample are errors naming the setting.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from tests.test_hub_packing import (
    _collators,
    _config,
    _documents,
    _forward,
    _parts,
    _sample,
    _tiny,
    assert_documents_match,
)
from vlmtrain.config import ConfigError, load_run_config
from vlmtrain.models.vision.vision_padding import blank_grids, pad_vision_patches

T, P = 300, 192  # tokens per row; vision patches per step (3 images x 64 patches at most)
BUDGET = {"pack_length": T, "pack_window": 6, "max_patches_per_pack": P, "max_images": 3, "max_image_tokens": 16}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("budget"))


def _build(root, tmp_path, overrides=None, **data):
    from vlmtrain import run

    config = _config(tmp_path, _tiny("qwen3_vl", root), **{**BUDGET, **data})
    return run.build(load_run_config(config, {"train.per_device_train_batch_size": 1, **(overrides or {})}))


def _loader(trainer):
    return StatefulDataLoader(trainer.train_dataset, batch_size=1, num_workers=0, collate_fn=trainer.data_collator)


def _vision_inputs(model) -> list[int]:
    seen: list[int] = []
    model.model.visual.patch_embed.register_forward_hook(lambda m, args, out: seen.append(args[0].shape[0]))
    return seen


def test_every_step_is_one_row_of_T_tokens_holding_whole_samples(root, tmp_path, one_thread):
    trainer = _build(root, tmp_path)
    raw = [json.loads(line) for line in open(tmp_path / "data.jsonl")]
    for r in raw:
        r["images"] = [str(tmp_path / p) for p in r["images"]]
    expected = sorted(tuple(trainer.train_dataset.process(r)["input_ids"].tolist()) for r in raw)
    found, patches, seen = [], [], _vision_inputs(trainer.model)
    for batch in _loader(trainer):
        assert batch["input_ids"].shape == (1, T) and batch["position_ids"].shape == (4, 1, T)
        stats = batch["pack_stats"]
        assert stats["rows"] == 1 and stats["capacity"] == T and stats["tokens"] <= T
        grid = batch.get("image_grid_thw")  # (a row of text-only samples has none: no vision tower call)
        patches.append(0 if grid is None else int(grid.prod(-1).sum()))
        docs = _documents(batch)
        ids = batch["input_ids"].reshape(-1)
        real = [(a, n) for a, n in docs if a + n < T or batch["labels"].reshape(-1)[a:a + n].ne(-100).any()]
        found += [tuple(ids[a:a + n].tolist()) for a, n in real]  # (the row's tail padding left out)
        assert sum(n for _, n in real) == stats["tokens"]
        with torch.no_grad():
            trainer.model(**{k: v for k, v in batch.items() if isinstance(v, torch.Tensor)}, use_cache=False)
    assert sorted(found) == expected  # every sample once, whole, never across rows
    assert max(patches) <= P and len(patches) >= 2
    assert seen == [P] * sum(p > 0 for p in patches)  # the vision tower's input: the same shape every step


def test_the_dummy_image_and_video_are_not_padded_to_the_patch_budget(root, tmp_path, monkeypatch, one_thread):
    """Under several ranks (the dummy path forced on here) a row without images or videos encodes the family's
    dummy instead, before its own images: the dummy stays its smallest input (4 patches), never padded to
    max_patches_per_pack, which would double the vision work of image-only token-budget training; the row's own
    images still fill exactly P."""
    from vlmtrain.models.families import get_family
    from vlmtrain.models.vision import dummy_vision

    monkeypatch.setattr(dummy_vision, "needed", lambda: True)
    trainer = _build(root, tmp_path)
    family, seen, expected = get_family("qwen3_vl"), _vision_inputs(trainer.model), []
    smallest = int(family.dummy_image(trainer.model.config)["pixel_values"].shape[0])
    for batch in _loader(trainer):
        # a text-only row: the dummy image and the dummy video; a row with images: the dummy video, then P
        expected += [smallest, smallest] if batch.get("image_grid_thw") is None else [smallest, P]
        with torch.no_grad():
            trainer.model(**{k: v for k, v in batch.items() if isinstance(v, torch.Tensor)}, use_cache=False)
    assert smallest == 4 and P in expected and seen == expected


@pytest.mark.parametrize("attn", ["sdpa", "varlen_torch"])
def test_a_rows_documents_compute_what_its_samples_do_padded(root, tmp_path, attn, one_thread):
    trainer = _build(root, tmp_path, {"model.attn_implementation": attn})
    model = trainer.model
    model.eval()
    row = next(iter(trainer.train_dataset))
    items = row["items"]
    assert len(items) >= 2
    packed = trainer.data_collator([row])
    padded = trainer.data_collator.without_packing()(items)  # (processed items pass through)
    seen = _vision_inputs(model)
    logits, loss, grads = _forward(model, packed)
    ref_logits, ref_loss, ref_grads = _forward(model, padded)
    assert seen[0] == P and packed["input_ids"].shape == (1, T)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
    for n in grads:
        torch.testing.assert_close(grads[n], ref_grads[n], rtol=1e-5, atol=1e-5, msg=n)
    assert_documents_match(logits, packed, ref_logits, padded, len(items))


def test_stop_and_resume_mid_window_gives_the_same_rows(root, tmp_path, one_thread):
    full = list(_loader(_build(root, tmp_path)))
    first = _loader(_build(root, tmp_path))
    it = iter(first)
    head = [next(it), next(it)]
    state = first.state_dict()
    assert state["dataset_state"]["rows_done"] > 0  # inside a window: re-packed, its first rows skipped
    resumed = _loader(_build(root, tmp_path))
    resumed.load_state_dict(state)
    rows = head + list(resumed)
    assert len(rows) == len(full)
    for a, b in zip(rows, full):
        assert a.keys() == b.keys()
        for key in (k for k, v in a.items() if isinstance(v, torch.Tensor)):
            assert torch.equal(a[key], b[key]), key


@pytest.mark.parametrize("name", ["qwen3_vl", "qwen2_5_vl"])
def test_blank_padding_images_change_no_logit_or_gradient(root, name, one_thread):
    family, processor, model = _parts(name, root)
    model.eval()
    _, pad = _collators(family, processor, model, pack_length=400)
    batch = pad([_sample(n, seed=i) for i, n in enumerate((2, 0, 3, 1))])
    ref_logits, ref_loss, ref_grads = _forward(model, batch)
    seen = _vision_inputs(model)
    pad_vision_patches(model, 1200)
    logits, loss, grads = _forward(model, batch)
    assert seen == [1200] and int(batch["image_grid_thw"].prod(-1).sum()) < 1200
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
    assert grads.keys() == ref_grads.keys()
    for n in grads:
        torch.testing.assert_close(grads[n], ref_grads[n], rtol=1e-5, atol=1e-5, msg=n)


def test_blank_grids_hold_the_padding_in_small_whole_blocks():
    grids = blank_grids(2052, merge=2)
    assert sum(t * h * w for t, h, w in grids) == 2052
    assert all(h % 2 == 0 and w % 2 == 0 and h * w <= 1024 for _, h, w in grids)


def test_budgets_that_cannot_hold_a_sample_are_errors_naming_the_setting(root, tmp_path):
    from vlmtrain.models.kinds import get_kind

    with pytest.raises(ConfigError, match="pack_length=100 is below data.max_length=300"):
        _build(root, tmp_path, pack_length=100)
    with pytest.raises(ConfigError, match=r"data.max_patches_per_pack=190 must be a multiple of .* 4"):
        get_kind("hub_vlm").validate(load_run_config(_config(tmp_path, _tiny("qwen3_vl", root),
                                                             **{**BUDGET, "max_patches_per_pack": 190})))
    with pytest.raises(ConfigError, match=r"data.max_patches_per_pack=128 is smaller than one sample can be: "
                                          r"data.max_images=3 images of up to 64 patches each"):
        _build(root, tmp_path, max_patches_per_pack=128)
    with pytest.raises(ConfigError, match=r"data.max_patches_per_pack=192 is a packing setting, .* "
                                          r"data.packing: true \(got False\)"):
        load_run_config(_config(tmp_path, _tiny("qwen3_vl", root), **{**BUDGET, "packing": False, "pack_window": None,
                                                                    "pack_length": None}))
    with pytest.raises(ConfigError, match="set one"):
        load_run_config(_config(tmp_path, _tiny("qwen3_vl", root), **{**BUDGET, "max_images_per_pack": 2}))
    with pytest.raises(ConfigError, match="use data.max_images_per_pack"):
        get_kind("hub_vlm").validate(load_run_config(_config(tmp_path, _tiny("idefics3", root),
                                                             **{**BUDGET, "max_image_tokens": None})))
    ds = _build(root, tmp_path).train_dataset
    ds.max_patches_per_pack = 8  # (below a 32 x 32 px image's 16: the stream's own check, naming the sample)
    with pytest.raises(ValueError, match=r"sample .* has \d+ vision patches, more than "
                                         r"data.max_patches_per_pack=8: one sample must fit one packed row"):
        next(iter(ds))


class _Stream:
    """Processed items as a stream with a position (what PackedDataset needs of its stream)."""

    def __init__(self, items):
        self.items, self.at = items, 0

    def __iter__(self):
        while self.at < len(self.items):
            self.at += 1
            yield self.items[self.at - 1]

    def state_dict(self):
        return {"at": self.at}

    def load_state_dict(self, state):
        self.at = state["at"]


def test_the_window_packer_keeps_every_row_within_the_patch_budget():
    """Where patches, not tokens, run out first: no row holds more than max_patches_per_pack patches (the
    knapsack's second resource), every sample is placed whole, and a sample over the budget is named."""
    from vlmtrain.data.pack_stream import PackedDataset
    from vlmtrain.data.packing import vision_patches

    gen = torch.Generator().manual_seed(0)
    items = [{"input_ids": torch.zeros(int(torch.randint(10, 60, (1,), generator=gen))),
              "image_grid_thw": torch.tensor([[1, 2 * int(torch.randint(1, 5, (1,), generator=gen)), 8]]),
              "__key__": f"s{i}"} for i in range(40)]
    ds = PackedDataset(_Stream(items), lambda it: it, 1000, None, window=40, keep_items=True,
                       max_patches_per_pack=96)
    rows = [row["items"] for row in ds]
    assert sorted(it["__key__"] for row in rows for it in row) == sorted(it["__key__"] for it in items)
    assert max(sum(vision_patches(it) for it in row) for row in rows) <= 96
    assert max(sum(len(it["input_ids"]) for it in row) for row in rows) < 400  # (tokens never bound here)
    ds = PackedDataset(_Stream(items), lambda it: it, 1000, None, window=40, keep_items=True,
                       max_patches_per_pack=60)
    with pytest.raises(ValueError, match=r"sample s\d+ has 64 vision patches, more than data.max_patches_per_pack=60"):
        list(ds)


def test_per_batch_packing_caps_each_rows_patches_too(root, one_thread):
    """data.max_patches_per_pack without a window: the collator's own knapsack (each batch's samples) keeps every
    row within the patch budget, and a sample over it is an error."""
    from tests.test_hub_packing import _samples
    from vlmtrain.data.hub_collate import HubVLMCollator
    from vlmtrain.data.hub_processing import HubVLMProcessor
    from vlmtrain.data.packing import vision_patches

    family, processor, model = _parts("qwen3_vl", root)
    hub = HubVLMProcessor(processor, family, max_length=400, prompts=False)
    samples = _samples()
    most = max(vision_patches(hub.process(s)) for s in samples)
    collate = HubVLMCollator(hub, pack_length=400, model_config=model.config, min_fill_gain=-1.0,
                             max_patches_per_pack=most)
    batch = collate(samples)
    rows = batch["input_ids"].shape[0]
    assert rows > HubVLMCollator(hub, pack_length=400, model_config=model.config,
                                 min_fill_gain=-1.0)(samples)["input_ids"].shape[0]  # (the cap binds here)
    image = batch["input_ids"] == model.config.image_token_id  # 4 patches per image token
    assert (image.sum(1) * 4 <= most).all() and batch["pack_stats"]["samples"] == len(samples)
    collate.max_patches_per_pack = most - 4
    # (the window packer's check and text, data/packing.py's check_fits_row; the packer also names the sample)
    with pytest.raises(ValueError, match=f"^a sample has {most} vision patches, more than "
                                         f"data.max_patches_per_pack={most - 4}: one sample must fit one packed row.$"):
        collate(samples)


@pytest.mark.parametrize("window", [6, None])
def test_video_patches_count_against_max_patches_per_pack_like_images(root, tmp_path, window):
    """data.max_patches_per_pack holds for videos as for images, window-packed or not: a clip is planned into the
    patches its sample's images leave, and a sample with no room left for its clip is skipped and counted by its
    id (too_many_patches), never an error mid-training."""
    from PIL import Image

    from vlmtrain import run
    from vlmtrain.data.video import write_video

    config = _config(tmp_path, _tiny("qwen3_vl", root), **{**BUDGET, "pack_window": window, "video_min_pixels": 256})
    # 3 temporal patches of 6 x 8 tokens (4 patches each): 576 patches at its own size, 3x the budget
    write_video(str(tmp_path / "clip.mp4"), [np.full((96, 128, 3), 8 * t, np.uint8) for t in range(30)], fps=10)
    for j in range(3):  # 3 images of 64 patches (max_image_tokens 16): the whole budget
        Image.new("RGB", (256, 256), (40 * j, 90, 200)).save(tmp_path / f"big{j}.png")
    lines = (tmp_path / "data.jsonl").read_text().splitlines()
    lines += [json.dumps({"videos": ["clip.mp4"], "texts": [{"user": "<video> What changes?", "assistant": "Light."}]}),
              json.dumps({"videos": ["clip.mp4"], "images": [f"big{j}.png" for j in range(3)],
                          "texts": [{"user": "<video> And these?", "assistant": "Three."}]})]
    (tmp_path / "data.jsonl").write_text("\n".join(lines) + "\n")
    trainer = run.build(load_run_config(config, {"train.per_device_train_batch_size": 1}))
    skipped, keys, video_patches = {}, [], []
    for batch in _loader(trainer):
        for reason, n in batch["skipped"].items():
            skipped[reason] = skipped.get(reason, 0) + n
        keys += batch["skipped_keys"]
        grids = [batch.get(k) for k in ("image_grid_thw", "video_grid_thw")]
        assert sum(int(g.prod(-1).sum()) for g in grids if g is not None) <= P
        if batch.get("video_grid_thw") is not None:
            video_patches.append(int(batch["video_grid_thw"].prod(-1).sum()))
    assert skipped == {"too_many_patches": 1}
    assert keys == [f"{tmp_path / 'data.jsonl'}:{len(lines)} (too_many_patches)"]
    assert len(video_patches) == 1 and 0 < video_patches[0] <= P  # the clip alone: fitted into the budget
