"""Video samples: decoding only the chosen frames (bounded memory), the caps' arithmetic, where videos go, the
stored layouts (JSONL, WebDataset, HF datasets), bad input skipped by its own reason, `data inspect`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile

import numpy as np
import pytest
import torch
from optional_extras import requires
from PIL import Image

from vlmtrain.config import ConfigError
from vlmtrain.data.hub_collate import HubVLMCollator
from vlmtrain.data.hub_processing import HubVLMProcessor
from vlmtrain.data.processing import SkipSample
from vlmtrain.data.sources import JsonlSource, WebDatasetSource
from vlmtrain.data.tools import format_report, inspect_source, write_webdataset
from vlmtrain.data.video import VideoInfo, VideoSettings, load_video, write_video
from vlmtrain.models.families import get_family

try:
    import av
except ImportError:  # (the video extra; every test here is skipped without it)
    av = None

pytestmark = requires("av", "video")
KINDS = ("qwen3_vl", "qwen2_5_vl")
SMALL = dict(min_pixels=16 * 16, max_pixels=32 * 32, max_tokens=64)


def _frames(n: int, h: int = 48, w: int = 64) -> np.ndarray:
    """Frame t: a square at x = 3t on a background whose shade encodes t (so a frame tells its index)."""
    out = np.zeros((n, h, w, 3), np.uint8)
    for t in range(n):
        out[t] = (t * 5) % 256
        x = (3 * t) % (w - 8)
        out[t, 8:16, x:x + 8] = (250, 30, 30)
    return out


@pytest.fixture(scope="module")
def clips(tmp_path_factory):
    d = tmp_path_factory.mktemp("clips")
    return {"short": write_video(str(d / "short.mp4"), _frames(30), fps=10),
            "two": write_video(str(d / "two.mp4"), _frames(2), fps=10), "dir": str(d)}


@pytest.fixture(scope="module")
def tiny(tiny_hub):
    """family name -> (family, processor) of its tiny checkpoint."""
    return lambda name: tiny_hub(name)[::2]


def _sequential(path: str, indices: list[int]) -> dict[int, np.ndarray]:
    want, got = set(indices), {}
    with av.open(path) as container:
        for i, frame in enumerate(container.decode(video=0)):
            if i in want:
                got[i] = frame.to_ndarray(format="rgb24")
    return got


def test_decodes_the_chosen_frames_from_files_bytes_and_frame_lists(clips, tmp_path):
    settings = VideoSettings(fps=3.0, min_frames=4)
    clip = load_video(clips["short"], None, settings)
    assert clip.frames.dtype == torch.uint8 and clip.frames.shape == (len(clip.indices), 48, 64, 3)
    assert clip.indices == np.linspace(0, 29, 9).round().astype(int).tolist()  # 3 s at 3 fps, Qwen3-VL's choice
    assert clip.timestamps == pytest.approx([i / 10 for i in clip.indices]) and clip.total_frames == 30
    ref = _sequential(clips["short"], clip.indices)
    assert all(np.array_equal(clip.frames[j].numpy(), ref[i]) for j, i in enumerate(clip.indices))
    with open(clips["short"], "rb") as f:
        assert torch.equal(load_video(f.read(), None, settings).frames, clip.frames)
    # a frame list: relative paths under base_dir, bytes, PIL images; taken as sampled at video_fps
    names = []
    for t, frame in enumerate(_frames(6)):
        Image.fromarray(frame).save(tmp_path / f"f{t}.png")
        names.append(f"f{t}.png")
    listed = load_video(names, str(tmp_path), settings)
    assert listed.indices == list(range(6)) and listed.timestamps == pytest.approx([t / 3 for t in range(6)])
    assert np.array_equal(listed.frames.numpy(), _frames(6))
    as_bytes = [open(tmp_path / n, "rb").read() for n in names]
    assert torch.equal(load_video(as_bytes, None, settings).frames, listed.frames)
    assert torch.equal(load_video([Image.fromarray(f) for f in _frames(6)], None, settings).frames, listed.frames)
    # more frames than video_max_frames are thinned evenly
    assert load_video(names, str(tmp_path), VideoSettings(min_frames=2, max_frames=3)).indices == [0, 2, 5]


@pytest.mark.parametrize("codec,ext", [("mpeg4", "mp4"), ("libx264", "mp4"), ("libvpx-vp9", "webm")])
def test_seeking_finds_the_same_frames_as_decoding_everything(tmp_path, codec, ext):
    """Frames chosen far apart are reached by seeking (keyframes every 12 frames; H.264 with B-frames; WebM,
    whose frame count comes from its duration): the same pixels as decoding every frame."""
    if codec not in av.codecs_available:
        pytest.skip(f"this FFmpeg build has no {codec} encoder")
    path = write_video(str(tmp_path / f"gop.{ext}"), _frames(400, 32, 48), fps=25, codec=codec, gop=12)
    for fps in (0.5, 4.0):
        clip = load_video(path, None, VideoSettings(fps=fps, min_frames=4))
        ref = _sequential(path, clip.indices)
        assert clip.total_frames == 400 and len(clip.indices) == 16 * fps
        assert all(np.array_equal(clip.frames[j].numpy(), ref[i]) for j, i in enumerate(clip.indices))


@pytest.mark.parametrize("kind", KINDS)
def test_caps_hold_for_any_clip(tiny, kind):
    """Property check over 2,000 random clips and settings: frames within [min, max] (or all a short clip has),
    ascending and inside the clip; every frame within video_max_pixels and a multiple of patch x merge; the
    clip within max_video_tokens; and frames below video_min_pixels only when the frame count is at its floor
    (or a cap is within rounding of the floor)."""
    _, proc = tiny(kind)
    rng = np.random.default_rng(1)
    factor = 16
    for _ in range(2000):
        total = int(rng.integers(4, 20000))
        fps = float(rng.choice([1, 8, 24, 29.97, 60]))
        h, w = int(rng.integers(16, 1200)), int(rng.integers(16, 1200))
        low = int(rng.integers(2, 9))
        high = int(rng.integers(low, 300))
        max_pixels = int(rng.integers(1, 64)) * factor ** 2 + int(rng.integers(0, 255))
        min_pixels = min(max_pixels, int(rng.integers(1, 16)) * factor ** 2)
        tokens = int(rng.integers(-(-low // 2), 3000))
        settings = VideoSettings(fps=float(rng.choice([0.5, 1, 2, 4])), min_frames=low, max_frames=high,
                                 max_pixels=max_pixels, min_pixels=min_pixels, max_tokens=tokens)
        video = get_family(kind).video(proc, settings)
        info = VideoInfo(total, fps, h, w)
        try:
            plan = video.plan(info)
        except SkipSample as err:  # only where a frame's smallest size (one patch row) does not fit the caps
            assert err.reason == "video_over_token_cap", err
            smallest = factor ** 2 * max(1, round(max(h, w) / min(h, w)))  # pixels of the thinnest frame
            assert max_pixels < 2 * smallest or tokens < 2 * -(-low // 2) * smallest // factor ** 2, (info, settings)
            continue
        n = len(plan.indices)
        assert n <= high and plan.indices == sorted(plan.indices) and 0 <= plan.indices[0]
        assert plan.indices[-1] < total
        assert n >= min(low, total) - 1  # (Qwen2.5-VL floors to whole temporal patches)
        assert plan.height % factor == 0 and plan.width % factor == 0
        assert plan.height * plan.width <= max_pixels, (info, settings, plan)
        assert plan.tokens <= tokens and plan.tokens == -(-n // 2) * plan.height * plan.width // factor ** 2
        if plan.height * plan.width < min_pixels <= h * w and n > max(low, 2) + 1:
            # below the floor only once frames are at theirs, or where a cap is within rounding (whole patches
            # of a thin frame) of it (a frame smaller than video_min_pixels gives up its upscale first)
            budget = min(max_pixels, tokens // -(-n // 2) * factor ** 2)
            assert budget < 4 * min_pixels, (info, settings, plan)


def test_settings_are_checked_naming_the_key(tiny):
    with pytest.raises(ConfigError, match="data.video_fps"):
        VideoSettings(fps=0)
    with pytest.raises(ConfigError, match="video_min_frames"):
        VideoSettings(min_frames=9, max_frames=4)
    with pytest.raises(ConfigError, match="video_min_pixels"):
        VideoSettings(min_pixels=5000, max_pixels=4000)
    _, proc = tiny("qwen3_vl")
    with pytest.raises(ConfigError, match="data.max_video_tokens=1 cannot hold"):
        get_family("qwen3_vl").video(proc, VideoSettings(min_frames=4, max_tokens=1))


RSS_CHILD = r"""
import resource, sys, time
from vlmtrain.data.video import VideoSettings, load_video
import av
av.open(sys.argv[1]).close()
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t = time.perf_counter()
clip = load_video(sys.argv[1], None, VideoSettings(max_frames=int(sys.argv[2])))
took = time.perf_counter() - t
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(clip.frames.shape[0], clip.total_frames, (peak - base) / 1024, clip.frames.numel() / 2**20, took)
"""
RSS_BOUND_MB = 64
"""Peak host memory a 10-minute clip may add while its sampled frames are decoded (docs/data.md#videos)."""


def test_ten_minute_clip_decodes_within_bounded_memory(tmp_path):
    """A 10-minute 320x240 clip (2 fps: 1,200 frames, 264 MiB decoded) sampled to 32 frames: the decoding
    process's peak RSS grows by less than RSS_BOUND_MB, measured in a fresh process."""
    def frames():
        for t in range(1200):
            frame = np.full((240, 320, 3), 90, np.uint8)
            frame[100:120, (t % 300):(t % 300) + 20] = 255
            yield frame

    path = write_video(str(tmp_path / "ten_minutes.mp4"), frames(), fps=2)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run([sys.executable, "-c", RSS_CHILD, path, "32"], capture_output=True, text=True, env=env,
                         timeout=120, check=True).stdout.split()
    kept, total, grew_mb = int(out[0]), int(out[1]), float(out[2])
    assert total == 1200 and kept == 32
    full_mb = total * 240 * 320 * 3 / 2**20
    assert grew_mb < RSS_BOUND_MB < full_mb / 4, (grew_mb, full_mb)


def _sample(videos, user="What moves? <video>"):
    return {"videos": videos, "texts": [{"user": user, "assistant": "The square."}]}


def test_bad_videos_are_skipped_and_counted_by_reason(tiny, clips, tmp_path):
    fam, proc = tiny("qwen3_vl")
    hub = HubVLMProcessor(proc, fam, max_length=1024, video=VideoSettings(**SMALL))
    garbage = tmp_path / "garbage.mp4"
    garbage.write_bytes(b"\x00\x00\x00\x18ftypmp42 not a video at all" * 10)
    truncated = tmp_path / "truncated.mp4"
    truncated.write_bytes(open(clips["short"], "rb").read()[:600])
    empty = tmp_path / "sound_only.wav"  # a container without a video stream
    with av.open(str(empty), "w") as container:
        stream = container.add_stream("pcm_s16le", rate=8000)
        frame = av.AudioFrame.from_ndarray(np.zeros((1, 800), np.int16), format="s16", layout="mono")
        frame.sample_rate = 8000
        for packet in [*stream.encode(frame), *stream.encode()]:
            container.mux(packet)
    cases = {
        "video_unreadable": [_sample([str(garbage)]), _sample([str(truncated)]), _sample(["missing.mp4"])],
        "video_no_frames": [_sample([str(empty)])],
        "video_too_short": [_sample([clips["two"]])],
        "video_placeholder_mismatch": [_sample([clips["short"], clips["short"]]),
                                       _sample([], user="<video> and <video>")],
        "placeholder_in_assistant": [{"videos": [clips["short"]], "texts": [{"user": "a", "assistant": "<video>"}]}],
    }
    for reason, samples in cases.items():
        for sample in samples:
            with pytest.raises(SkipSample) as err:
                hub.process(sample)
            assert err.value.reason == reason, (reason, err.value)
    batch = HubVLMCollator(hub)([s for ss in cases.values() for s in ss] + [_sample([clips["short"]])])
    assert batch["skipped"] == {k: len(v) for k, v in cases.items()}
    assert batch["input_ids"].shape[0] == 1 and batch["video_grid_thw"].shape == (1, 3)


@pytest.mark.parametrize("kind", KINDS)
def test_videos_go_where_placeholders_put_them_else_first(tiny, clips, kind):
    fam, proc = tiny(kind)
    hub = HubVLMProcessor(proc, fam, max_length=2048, video=VideoSettings(**SMALL))
    image = Image.new("RGB", (32, 32), (10, 200, 10))
    tok = proc.tokenizer
    marks = {"image": "<|image_pad|>", "video": "<|video_pad|>"}

    def order(sample):
        text = tok.decode(hub.process(sample)["input_ids"])
        found = sorted((text.index(m), k) for k, m in marks.items() if m in text)
        words = sorted((text.index(w), w) for w in ("ALPHA", "OMEGA") if w in text)
        return [k for _, k in found], [w for _, w in words], text

    kinds, _, _ = order({"images": [image], "videos": [clips["short"]], "texts": [{"user": "ALPHA", "assistant": "x"}]})
    assert kinds == ["video", "image"]  # no placeholders: videos first, then images
    kinds, _, text = order({"images": [image], "videos": [clips["short"]],
                            "texts": [{"user": "ALPHA <image> OMEGA <video>", "assistant": "x"}]})
    assert kinds == ["image", "video"] and text.index("OMEGA") < text.index(marks["video"])
    # two turns: the video placed in the second
    text = tok.decode(hub.process({"videos": [clips["short"]], "texts": [
        {"user": "ALPHA", "assistant": "a"}, {"user": "OMEGA <video>", "assistant": "b"}]})["input_ids"])
    assert text.index("ALPHA") < text.index("OMEGA") < text.index(marks["video"])


def test_jsonl_webdataset_and_hf_layouts(tiny, clips, tmp_path):
    fam, proc = tiny("qwen2_5_vl")
    hub = HubVLMProcessor(proc, fam, max_length=1024, video=VideoSettings(**SMALL))
    frames_dir = tmp_path / "frames"
    frames_dir.mkdir()
    for t, frame in enumerate(_frames(5)):
        Image.fromarray(frame).save(frames_dir / f"{t}.png")
    os.link(clips["short"], tmp_path / "clip.mp4")
    record = {"videos": ["clip.mp4", [f"frames/{t}.png" for t in range(5)]],
              "texts": [{"user": "<video> then <video>: same?", "assistant": "No."}]}
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps(record) + "\n")
    (_, from_jsonl), = JsonlSource(str(path)).read(0, {})
    assert from_jsonl["videos"][0] == str(tmp_path / "clip.mp4")  # relative to the file
    want = hub.process(from_jsonl)
    # WebDataset: to-wds writes KEY.video.0.mp4 and KEY.video.1.{0..4}.png; reading them back processes the same
    shard, = write_webdataset([from_jsonl], str(tmp_path / "wds"))
    names = tarfile.open(shard).getnames()
    assert "000000000.video.0.mp4" in names and "000000000.video.1.4.png" in names
    (_, from_wds), = WebDatasetSource(shard).read(0, {})
    assert isinstance(from_wds["videos"][0], bytes) and len(from_wds["videos"][1]) == 5
    got = hub.process(from_wds)
    assert all(torch.equal(got[k], want[k]) for k in ("input_ids", "pixel_values_videos", "video_grid_thw"))
    # HF datasets: a `videos` column of paths
    datasets = pytest.importorskip("datasets")
    rows = datasets.Dataset.from_list([{"videos": [str(tmp_path / "clip.mp4")], "texts": record["texts"][:1]}])
    row = dict(rows[0])
    row["texts"] = [{"user": "<video> what?", "assistant": "No."}]
    assert hub.process(row)["video_grid_thw"].shape == (1, 3)


def test_inspect_reports_frames_timestamps_and_tokens(tiny, clips, tmp_path):
    fam, proc = tiny("qwen3_vl")
    path = tmp_path / "v.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [
        _sample([clips["short"]]), _sample([clips["two"]]), {"texts": [{"user": "hi", "assistant": "yo"}]}]) + "\n")
    video = fam.video(proc, VideoSettings(**SMALL))
    report = inspect_source(str(path), video=video)
    assert report["bad"] == {"video_too_short": 1}
    (entry,) = report["videos"]
    plan = video.plan(VideoInfo(30, 10.0, 48, 64))
    assert entry["indices"] == plan.indices and entry["tokens"] == plan.tokens
    assert entry["timestamps"] == pytest.approx([i / 10 for i in plan.indices], abs=1e-3)
    text = format_report(report)
    assert f"{len(plan.indices)} of 30 frames (10 fps)" in text and f"{plan.tokens} tokens" in text
    # without a model: the default settings' frames and timestamps, no token count
    plain = inspect_source(str(path))["videos"][0]
    assert plain["frames"] == 6 and "tokens" not in plain  # 3 s at 2 fps


def test_video_settings_for_a_family_without_video_are_an_error(tmp_path):
    from vlmtrain.config import DataConfig
    from vlmtrain.data.hub_processing import check_video_settings

    check_video_settings(get_family("idefics3"), DataConfig())  # defaults: fine
    with pytest.raises(ConfigError, match="data.video_fps .* idefics3"):
        check_video_settings(get_family("idefics3"), DataConfig(video_fps=1.0))
    check_video_settings(get_family("qwen3_vl"), DataConfig(video_fps=1.0))
    with pytest.raises(ConfigError, match="data.max_video_tokens"):
        DataConfig(max_video_tokens=0)


def test_frames_never_above_the_checkpoints_own_max_frames(tiny, tmp_path):
    """A checkpoint whose video_preprocessor_config.json says max_frames 6 caps data.video_max_frames (768)."""
    fam, proc = tiny("qwen3_vl")
    (tmp_path / "video_preprocessor_config.json").write_text(json.dumps({"max_frames": 6, "fps": 2}))
    proc.source, before = str(tmp_path), getattr(proc, "source", None)
    try:
        video = fam.video(proc, VideoSettings())
    finally:
        proc.source = before
    assert video.settings.max_frames == 6
    assert len(video.plan(VideoInfo(3000, 10.0, 64, 64)).indices) == 6
