"""Video samples after processing, for the Qwen families (tiny checkpoints, fp32): batched and packed with image and
text-only samples, a packed batch computes exactly what the padded one does (logits at every sample's real
positions, loss, every gradient; the vision tower's included); each packed sample's multimodal positions are its
own, its video's temporal positions included; the FLOP count counts every temporal patch of a video as the
vision tower attends over it (one frame pair at a time); under several processes a batch without a video runs
the dummy video with an exact zero contribution.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from PIL import Image

from tests.test_hub_families import _image
from tests.test_hub_packing import _documents, _forward, assert_documents_match
from vlmtrain.data.hub_collate import HubVLMCollator
from vlmtrain.data.hub_processing import HubVLMProcessor
from vlmtrain.data.video import VideoSettings
from vlmtrain.models.families import get_family

FAMILIES = ("qwen3_vl", "qwen2_5_vl")


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("hub_video"))


@functools.cache
def _tiny(name: str, root: str) -> str:
    return get_family(name).build_tiny(f"{root}/{name}", seed=0)


def _parts(name: str, root: str):
    from transformers import AutoModelForImageTextToText

    family = get_family(name)
    path = _tiny(name, root)
    return family, family.load_processor(path), AutoModelForImageTextToText.from_pretrained(
        path, attn_implementation="sdpa")


def _hub(processor, family) -> HubVLMProcessor:
    """Samples up to 300 tokens; clips kept at their own small frames (video_min_pixels 32 x 32, not Qwen's 128
    tokens' worth)."""
    return HubVLMProcessor(processor, family, max_length=300, prompts=False,
                           video=VideoSettings(min_pixels=1024, max_tokens=300))


def frames(seed: int, count: int = 4, size: int = 32) -> list[Image.Image]:
    """A clip of ``count`` random frames (a list of frame images is a valid ``videos`` entry)."""
    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8), "RGB") for _ in range(count)]


def video_item(hub: HubVLMProcessor, sample: dict, clip: list[Image.Image]) -> dict:
    """``sample`` with ``clip`` as its video (videos go first in the first user turn)."""
    return {**sample, "videos": [clip]}


def _mixed(hub: HubVLMProcessor) -> list[dict]:
    """Video (4 and 6 frames; one with two turns), image, text-only and image + video samples."""
    def turns(i: int) -> list[dict]:
        return [{"user": f"What happens in {i}?", "assistant": f"Thing {i}."}] + (
            [{"user": "And then?", "assistant": "Done."}] if i % 2 else [])

    return [
        video_item(hub, {"texts": turns(0)}, frames(0)),
        {"images": [_image(1, (32, 48))], "texts": turns(1)},
        {"texts": turns(2)},
        video_item(hub, {"texts": turns(3)}, frames(3, count=6)),
        video_item(hub, {"images": [_image(4, (32, 32))], "texts": turns(4)}, frames(4, size=48)),
    ]


@pytest.mark.parametrize("name", FAMILIES)
def test_packed_video_logits_loss_and_gradients_equal_unpacked(root, name, one_thread):
    family, processor, model = _parts(name, root)
    model.eval()
    hub = _hub(processor, family)
    pack = HubVLMCollator(hub, pack_length=300, model_config=model.config, min_fill_gain=-1.0)
    samples = _mixed(hub)
    packed, padded = pack(samples), pack.without_packing()(samples)
    assert packed["input_ids"].shape[0] < len(samples) and packed["video_grid_thw"].shape == (3, 3)
    assert packed["pixel_values_videos"].shape == padded["pixel_values_videos"].shape  # (in row order there)
    logits, loss, grads = _forward(model, packed)
    ref_logits, ref_loss, ref_grads = _forward(model, padded)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
    assert grads.keys() == ref_grads.keys()
    assert any(n.startswith("model.visual.blocks") for n in grads)
    for n in grads:
        torch.testing.assert_close(grads[n], ref_grads[n], rtol=1e-5, atol=1e-5, msg=n)
    assert_documents_match(logits, packed, ref_logits, padded, len(samples))


@pytest.mark.parametrize("name", FAMILIES)
def test_packed_positions_are_each_samples_own_with_the_videos_temporal_positions(root, name):
    family, processor, model = _parts(name, root)
    hub = _hub(processor, family)
    items = [s if "input_ids" in s else hub.process(s) for s in _mixed(hub)]
    pack = HubVLMCollator(hub, pack_length=600, model_config=model.config, min_fill_gain=-1.0)
    packed = pack(items)
    pos = packed["position_ids"].flatten(1)  # [4, rows * 600]: documents never cross a row's end
    ids = packed["input_ids"].flatten()
    assert pos.shape[0] == 4
    found = 0
    for at, n in _documents(packed):  # each sample's rope positions are its own get_rope_index's
        item = next((it for it in items if len(it["input_ids"]) == n and torch.equal(it["input_ids"], ids[at:at + n])),
                    None)
        if item is None:  # (a row's padding)
            continue
        found += 1
        own, _ = model.model.get_rope_index(item["input_ids"][None], mm_token_type_ids=item["mm_token_type_ids"][None],
                                            image_grid_thw=item.get("image_grid_thw"),
                                            video_grid_thw=item.get("video_grid_thw"),
                                            second_per_grid_ts=item.get("second_per_grid_ts"))
        assert torch.equal(pos[1:, at:at + n], own[:, 0]) and torch.equal(pos[0, at:at + n], torch.arange(n))
        if "video_grid_thw" in item:  # a clip of t temporal patches spans t temporal positions in its tokens
            video = item["mm_token_type_ids"] == 2
            t = int(item["video_grid_thw"][0, 0])
            temporal = own[0, 0][video]
            if name == "qwen2_5_vl":  # one run: positions spaced by second_per_grid_ts * tokens_per_second
                step = int(item["second_per_grid_ts"][0] * model.config.vision_config.tokens_per_second)
                assert step > 1 and sorted(set((temporal - temporal[0]).tolist())) == [i * step for i in range(t)]
            else:  # Qwen3-VL: a run per temporal patch, after its timestamp text
                assert len(set(temporal.tolist())) == t
    assert found == len(items)


@pytest.mark.parametrize("name", FAMILIES)
def test_flops_count_each_temporal_patch_of_a_video_as_a_frame(root, name):
    """The logged FLOP count (the model's counter, as the trainer builds it) of a clip of 3 temporal patches of
    4 x 6 patches equals that of 3 images of 4 x 6 patches, and is above the text alone."""
    from vlmtrain.models.hub.hub_loading import load_model
    from vlmtrain.models.speed.flops import flop_counter

    count = flop_counter(load_model(_tiny(name, root)).train())
    ids = {"input_ids": torch.ones(1, 40, dtype=torch.long), "attention_mask": torch.ones(1, 40, dtype=torch.long)}
    video = count({**ids, "video_grid_thw": torch.tensor([[3, 4, 6]]), "image_grid_thw": torch.tensor([[1, 4, 4]])})
    images = count({**ids, "image_grid_thw": torch.tensor([[1, 4, 4]] + [[1, 4, 6]] * 3)})
    assert video == images > count({**ids, "image_grid_thw": torch.tensor([[1, 4, 4]])}) > count(ids) > 0


@pytest.mark.parametrize("name", FAMILIES)
def test_every_batch_mix_makes_the_same_vision_tower_calls_adding_exactly_zero(root, monkeypatch, name, one_thread):
    """With the dummy path forced on (as under several processes): a text-only, image-only, video-only and an
    image + video batch each call the vision tower twice (images, then videos: real or dummy), so ranks with any
    mix stay in step under FSDP; the loss and every gradient are bitwise the plain forward's, and every vision
    parameter gets a gradient (zero where the batch has neither images nor videos)."""
    from vlmtrain.models.hub.hub_loading import load_model
    from vlmtrain.models.vision import dummy_vision

    family = get_family(name)
    model = load_model(_tiny(name, root)).train()
    hub = _hub(family.load_processor(_tiny(name, root)), family)
    collate = HubVLMCollator(hub, label_collate=lambda raw: {})
    turn = [{"user": "Hi there", "assistant": "Yes."}]
    mixes = {"text": [{"texts": turn}], "image": [{"images": [_image(0, (32, 32))], "texts": turn}],
             "video": [video_item(hub, {"texts": turn}, frames(1))],
             "both": [video_item(hub, {"images": [_image(2, (32, 32))], "texts": turn}, frames(2))]}
    calls = []
    hook = model.model.visual.register_forward_hook(lambda *a: calls.append(1))
    vision = family.module_groups["vision"]
    for mix, samples in mixes.items():
        batch = {k: v for k, v in collate(samples).items() if isinstance(v, torch.Tensor)}
        runs = {}
        for on in (False, True):
            monkeypatch.setattr(dummy_vision, "needed", lambda on=on: on)
            model.zero_grad(set_to_none=True)
            calls.clear()
            out = model(**batch, loss_only=True)
            out["loss"].backward()
            runs[on] = out["loss"].detach(), {n: p.grad for n, p in model.named_parameters()}, len(calls)
        assert runs[True][2] == 2, (mix, runs[True][2])
        assert runs[False][2] == {"text": 0, "image": 1, "video": 1, "both": 2}[mix]
        assert torch.equal(runs[False][0], runs[True][0]), mix
        for n, grad in runs[False][1].items():
            if grad is not None:
                assert torch.equal(grad, runs[True][1][n]), (mix, n)
            elif n.startswith(vision):
                assert runs[True][1][n] is not None and not runs[True][1][n].any(), (mix, n)
        tower = [n for n in runs[True][1] if n.startswith(vision)]
        assert tower and all(runs[True][1][n] is not None for n in tower), mix
    hook.remove()
