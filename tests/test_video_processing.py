"""Qwen3-VL / Qwen2.5-VL video processing without torchvision equals transformers' own video processors.

Three checks (tests/video_reference.py describes the reference):
- here, on every CPU: transformers' Qwen video processor and processor code, with torchvision's resize /
  normalize transcribed onto torch (the shim), against vlmtrain's: frame choice, pixel_values_videos (bitwise),
  video_grid_thw, second_per_grid_ts, the expanded input_ids (Qwen3-VL's timestamps) and the labels;
- wherever torchvision imports (the GPU machine): the same against transformers' code unchanged;
- a fixture generated once by transformers' own processors (scripts/make_video_fixture.py), when committed.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from optional_extras import requires
from video_reference import reference_processor, reference_video_processor, torchvision_available

from vlmtrain.data.hub_processing import HubVLMProcessor
from vlmtrain.data.processing import SkipSample
from vlmtrain.data.video import VideoInfo, VideoSettings, load_video, write_video
from vlmtrain.models.families import get_family

pytestmark = requires("av", "video")
KINDS = ("qwen3_vl", "qwen2_5_vl")
FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "video_processing.pt")


@pytest.fixture(scope="module")
def tiny(tiny_hub):
    """family name -> (family, processor) of its tiny checkpoint."""
    return lambda name: tiny_hub(name)[::2]


def clip_frames(num: int, height: int, width: int, seed: int = 0) -> np.ndarray:
    """Frames with detail at every scale (noise over gradients and a moving square): resizes that differ show."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    frames = []
    for t in range(num):
        base = np.stack([(x * 255 // max(1, width - 1)), (y * 255 // max(1, height - 1)),
                         np.full_like(x, (t * 37) % 256)], axis=-1).astype(np.int32)
        base += rng.integers(-40, 40, size=base.shape)
        s = max(2, min(height, width) // 4)
        top, left = (t * 3) % (height - s), (t * 5) % (width - s)
        base[top:top + s, left:left + s] = (250, 20, 20)
        frames.append(np.clip(base, 0, 255).astype(np.uint8))
    return np.stack(frames)


@pytest.fixture(scope="module")
def video_file(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("clips") / "clip.mp4")
    return write_video(path, clip_frames(31, 72, 100), fps=10)


CASES = [  # settings; each resizes (up or down) and covers odd frame counts and the token cap
    dict(min_pixels=32 * 32, max_pixels=64 * 64, max_tokens=400),
    dict(min_pixels=16 * 16, max_pixels=48 * 40, max_tokens=60, fps=3.0),
    dict(min_pixels=128 * 96, max_pixels=160 * 128, max_tokens=4000, fps=1.3, min_frames=3),
]


def _compare(tiny, kind, video_file, case, shim):
    fam, proc = tiny(kind)
    settings = VideoSettings(**case)
    hub = HubVLMProcessor(proc, fam, max_length=4096, video=settings)
    sample = {"videos": [video_file], "texts": [{"user": "Which way? <video>", "assistant": "Left."}]}
    ours = hub.process(sample)

    clip = load_video(video_file, None, settings, hub.video.choose)
    plan = hub.video.plan(clip.info)
    reference = reference_processor(kind, proc, shim)
    messages = [{"role": "user", "content": [{"type": "text", "text": "Which way? "},
                                             {"type": "video", "video": clip.frames}]},
                {"role": "assistant", "content": [{"type": "text", "text": "Left."}]}]
    theirs = reference.apply_chat_template(
        messages, chat_template=fam.training_template, tokenize=True, return_dict=True, return_tensors="pt",
        return_assistant_tokens_mask=True,
        processor_kwargs={"video_metadata": [clip.metadata()], "size": plan.size, "do_sample_frames": False})
    assert torch.equal(ours["input_ids"], theirs["input_ids"][0])
    assert torch.equal(ours["labels"] >= 0, theirs["assistant_masks"][0].bool())
    assert torch.equal(ours["video_grid_thw"], theirs["video_grid_thw"])
    assert ours["pixel_values_videos"].dtype == theirs["pixel_values_videos"].dtype == torch.float32
    assert torch.equal(ours["pixel_values_videos"], theirs["pixel_values_videos"])  # bitwise
    if kind == "qwen2_5_vl":
        assert torch.equal(ours["second_per_grid_ts"], torch.as_tensor(theirs["second_per_grid_ts"]))
    else:
        text = proc.tokenizer.decode(ours["input_ids"])
        assert text.count(" seconds>") == int(ours["video_grid_thw"][0, 0])  # Qwen3-VL's timestamps
    # the plan's token count is what the processor expanded
    assert int((ours["input_ids"] == proc.tokenizer.convert_tokens_to_ids("<|video_pad|>")).sum()) == plan.tokens
    assert clip_span(ours["input_ids"], proc.tokenizer) == plan.length  # and every token the clip takes
    return ours, plan


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("case", range(len(CASES)))
def test_equals_transformers_video_processor_code(tiny, kind, video_file, case):
    """transformers' code with torchvision's two kernels transcribed (runs everywhere)."""
    _compare(tiny, kind, video_file, CASES[case], shim=not torchvision_available())


@pytest.mark.skipif(not torchvision_available(), reason="torchvision does not import here (CPU CI); the GPU "
                    "machine runs it")
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("case", range(len(CASES)))
def test_equals_transformers_with_torchvision(tiny, kind, video_file, case):
    """transformers' own video processors, torchvision and all, where torchvision imports."""
    _compare(tiny, kind, video_file, CASES[case], shim=False)


@pytest.mark.skipif(not os.path.isfile(FIXTURE), reason="tests/fixtures/video_processing.pt not generated yet: "
                    "run scripts/make_video_fixture.py where torchvision imports")
@pytest.mark.parametrize("kind", KINDS)
def test_equals_committed_fixture(tiny, kind):
    """Outputs of transformers' own video processor (torchvision resize), saved by scripts/make_video_fixture.py."""
    fixture = torch.load(FIXTURE, weights_only=False)
    _, proc = tiny(kind)
    frames = torch.from_numpy(clip_frames(*fixture["frames_shape"]))
    for entry in fixture[kind]:
        video = get_family(kind).video(proc, VideoSettings(**entry["settings"]))
        patches, grid = video.processor().process(frames[: entry["num_frames"]])
        assert grid == entry["video_grid_thw"]
        assert torch.equal(patches, entry["pixel_values_videos"]), entry["settings"]


@pytest.mark.parametrize("kind", KINDS)
def test_frame_choice_equals_transformers_sample_frames(tiny, kind):
    """Without a token cap the frames vlmtrain decodes are those transformers' sample_frames picks, over many
    clip lengths, frame rates and settings (but the extra index float error adds to Qwen2-VL's arange)."""
    _, proc = tiny(kind)
    rng = np.random.default_rng(0)
    ref = reference_video_processor(kind, proc.image_processor, shim=not torchvision_available())
    from transformers.video_utils import VideoMetadata

    arange_extra = 0
    for _ in range(300):
        total, fps = int(rng.integers(4, 4000)), float(rng.choice([5, 10, 23.976, 24, 25, 29.97, 30, 60]))
        want_fps = float(rng.choice([0.5, 1, 2, 3]))
        low = int(rng.integers(2, 9))
        high = int(rng.integers(low, 200))
        settings = VideoSettings(fps=want_fps, min_frames=low, max_frames=high)
        video = get_family(kind).video(proc, settings)
        ours = video.sample(VideoInfo(total, fps, 64, 64))
        meta = VideoMetadata(total_num_frames=total, fps=fps)
        if kind == "qwen3_vl":
            ref.min_frames, ref.max_frames = low, high
            theirs = ref.sample_frames(meta, fps=want_fps)
        else:
            theirs = ref.sample_frames(meta, temporal_patch_size=2, min_frames=low, max_frames=high, fps=want_fps)
        theirs = [int(i) for i in theirs]
        if kind == "qwen2_5_vl" and len(theirs) % 2:  # transformers' arange: n + 1 indices by float error
            assert len(ours) == len(theirs) - 1
            arange_extra += 1
        assert ours == theirs[:len(ours)], (total, fps, settings)
    assert arange_extra < 10


def test_other_families_refuse_video_naming_the_family(tiny, video_file):
    fam, proc = tiny("idefics3")
    hub = HubVLMProcessor(proc, fam)
    with pytest.raises(SkipSample) as err:
        hub.process({"videos": [video_file], "texts": [{"user": "<video> what?", "assistant": "x"}]})
    assert err.value.reason == "video_unsupported" and "idefics3" in err.value.detail


def clip_span(ids: torch.Tensor, tokenizer) -> int:
    """Tokens the one clip of a sample without images takes in its input_ids: from its first <|vision_start|> to
    its last <|vision_end|> (the template's markers, Qwen3-VL's timestamps and per-frame markers, video tokens)."""
    starts = (ids == tokenizer.convert_tokens_to_ids("<|vision_start|>")).nonzero().reshape(-1)
    ends = (ids == tokenizer.convert_tokens_to_ids("<|vision_end|>")).nonzero().reshape(-1)
    return int(ends[-1]) - int(starts[0]) + 1


FIT_CASES = [  # (frames, height, width, the file's fps, max_length, whether every frame fits at its own size): a
    (240, 48, 64, 10.0, 600, False),  # long clip; one of tiny frames (that the default video_min_pixels upscales)
    (40, 32, 48, 10.0, 256, True),
]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("case", range(len(FIT_CASES)))
def test_a_clip_is_planned_into_what_max_length_leaves_counting_every_token_the_processor_adds(
        tiny, kind, case, tmp_path_factory):
    """A clip that can fit is never too_long: its plan counts the tokens the family's processor inserts (Qwen3-VL's
    timestamps, the vision start / end markers) and fits the clip into what max_length leaves after the text;
    the processed sample is the plan for exactly that room, and the plan's count is the processor's."""
    frames, height, width, fps, max_length, all_fit = FIT_CASES[case]
    path = str(tmp_path_factory.mktemp("fit") / "clip.mp4")
    write_video(path, clip_frames(frames, height, width, seed=case), fps=fps)
    fam, proc = tiny(kind)
    hub = HubVLMProcessor(proc, fam, max_length=max_length)  # default settings: max_video_tokens is max_length
    item = hub.process({"videos": [path], "texts": [{"user": "What happens? <video>", "assistant": "It moves."}]})
    ids = item["input_ids"]
    assert len(ids) <= max_length
    span = clip_span(ids, proc.tokenizer)
    plan = hub.video.plan(VideoInfo(frames, fps, height, width), room=max_length - (len(ids) - span))
    assert plan.length == span
    patch = proc.image_processor.patch_size
    t, h, w = item["video_grid_thw"][0].tolist()
    assert (t, h * patch, w * patch) == (-(-len(plan.indices) // 2), plan.height, plan.width)
    if all_fit:  # the upscale to video_min_pixels gives way before any frame does
        assert plan.indices == hub.video.sample(VideoInfo(frames, fps, height, width))
        assert plan.height * plan.width >= height * width
