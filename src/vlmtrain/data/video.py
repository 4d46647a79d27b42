"""Video clips for Hub VLMs: the sampling settings, decoding only the sampled frames, the frame choice.

A sample's ``videos`` entry is a video file (path, or bytes from a WebDataset member) or a list of frame images
(paths, bytes or PIL images). :func:`load_video` turns one into a :class:`VideoClip`: the frames kept, as one
uint8 tensor ``[T, H, W, 3]`` (RGB, channels last: what PyAV decodes to and what transformers' video
processors take), the timestamp of each in seconds, and the source's frame rate and frame count.

Memory is bounded by the frames kept, never by the clip's length: the container is probed for its frame count
and rate without decoding, the frame indices are chosen first (:meth:`VideoSettings.indices`, or a family's own
chooser that also applies its token cap), and decoding seeks to each chosen frame (from the keyframe before
it) and converts only the chosen frames to arrays. A frame list is taken as frames already sampled at
``data.video_fps``; only more than ``video_max_frames`` of them are thinned.

Settings (``data.video_*``, one place; null = the family's default, see docs/hub-vlms.md):
``video_fps`` frames sampled per second of video, ``video_min_frames`` / ``video_max_frames``,
``video_max_pixels`` / ``video_min_pixels`` per frame and ``max_video_tokens`` for the whole clip (frames are
downscaled, then fewer frames taken, until it fits).

Bad input raises :class:`~vlmtrain.data.processing.SkipSample`: ``video_unreadable`` (a file PyAV cannot open
or decode), ``video_no_frames`` (nothing decodable), ``video_too_short`` (fewer frames than
``video_min_frames``).
"""

from __future__ import annotations

import io
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from vlmtrain.data.processing import SkipSample
from vlmtrain.errors import ConfigError

DEFAULT_FPS = 2.0
"""Qwen-VL's published sampling rate (qwen-vl-utils' FPS, transformers' Qwen3VLVideoProcessor.fps)."""
DEFAULT_MIN_FRAMES, DEFAULT_MAX_FRAMES = 4, 768
"""Qwen-VL's published frame bounds (qwen-vl-utils' FPS_MIN_FRAMES / FPS_MAX_FRAMES)."""
VIDEO_KEYS = ("video_fps", "video_min_frames", "video_max_frames", "video_max_pixels", "video_min_pixels",
              "max_video_tokens")
"""The data.* keys of video sampling (see :meth:`VideoSettings.from_data`)."""


@dataclass(frozen=True)
class VideoSettings:
    """How a clip is sampled and bounded (the ``data.video_*`` keys; None: the family's default)."""

    fps: float = DEFAULT_FPS
    """Frames sampled per second of video (data.video_fps)."""
    min_frames: int = DEFAULT_MIN_FRAMES
    """Fewest frames taken from a clip; a clip with fewer frames is skipped (video_too_short)."""
    max_frames: int = DEFAULT_MAX_FRAMES
    """Most frames taken from a clip (never above the checkpoint's own max_frames)."""
    max_pixels: int | None = None
    """Pixels per frame after the resize, at most (data.video_max_pixels; None: the family's default)."""
    min_pixels: int | None = None
    """Pixels per frame after the resize, at least, unless max_video_tokens needs smaller frames
    (data.video_min_pixels; None: the family's default)."""
    max_tokens: int | None = None
    """Video tokens of the whole clip, at most (data.max_video_tokens; None: data.max_length)."""

    def __post_init__(self) -> None:
        if not (self.fps > 0):
            raise ConfigError(f"data.video_fps must be > 0, got {self.fps!r}.")
        if self.min_frames < 1 or self.max_frames < self.min_frames:
            raise ConfigError(f"data.video_min_frames / video_max_frames must satisfy 1 <= min <= max, got "
                              f"{self.min_frames} / {self.max_frames}.")
        for name in ("max_pixels", "min_pixels", "max_tokens"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                key = "max_video_tokens" if name == "max_tokens" else f"video_{name}"
                raise ConfigError(f"data.{key} must be a positive integer or null, got {value!r}.")
        if self.min_pixels is not None and self.max_pixels is not None and self.min_pixels > self.max_pixels:
            raise ConfigError(f"data.video_min_pixels={self.min_pixels} is above data.video_max_pixels="
                              f"{self.max_pixels}.")

    @classmethod
    def from_data(cls, data: Any) -> VideoSettings:
        """The settings of a ``data`` config section (its ``video_*`` / ``max_video_tokens`` keys; the
        clip's token budget defaults to ``data.max_length``: a longer clip could never fit a sample)."""
        def get(key: str, default: Any) -> Any:
            value = getattr(data, key, None)
            return default if value is None else value

        return cls(fps=float(get("video_fps", DEFAULT_FPS)), min_frames=int(get("video_min_frames",
                   DEFAULT_MIN_FRAMES)), max_frames=int(get("video_max_frames", DEFAULT_MAX_FRAMES)),
                   max_pixels=get("video_max_pixels", None), min_pixels=get("video_min_pixels", None),
                   max_tokens=get("max_video_tokens", getattr(data, "max_length", None)))

    def num_frames(self, total_frames: int, fps: float) -> int:
        """Frames to take from a clip of ``total_frames`` at ``fps``: ``video_fps`` per second of it, within
        [min_frames, max_frames] and never more than it has (Qwen3-VL's rule; transformers'
        ``Qwen3VLVideoProcessor.sample_frames``)."""
        n = int(total_frames / fps * self.fps)
        return min(max(n, self.min_frames), self.max_frames, total_frames)

    def indices(self, info: VideoInfo) -> list[int]:
        """The default frame choice: :meth:`num_frames` frames spread evenly from the first to the last
        (``np.linspace(0, total - 1, n).round()``, Qwen3-VL's)."""
        return linspace_indices(info.total_frames, self.num_frames(info.total_frames, info.fps))


def linspace_indices(total_frames: int, num_frames: int) -> list[int]:
    """``num_frames`` indices evenly from 0 to ``total_frames - 1`` (rounded), as Qwen3-VL samples."""
    return np.linspace(0, total_frames - 1, num_frames).round().astype(int).tolist()


@dataclass(frozen=True)
class VideoInfo:
    """What a clip is, known before decoding it: frame count, frame rate (frames per second), frame size."""

    total_frames: int
    fps: float
    height: int
    width: int


@dataclass
class VideoClip:
    """The frames kept from one video, ready for a family's video processing.

    ``frames`` is uint8 ``[T, H, W, 3]`` (RGB, channels last), ``indices`` the source frame index of each,
    ``timestamps`` their times in seconds (``index / fps``), ``fps`` the source's frame rate and
    ``total_frames`` its frame count (for a frame list: ``data.video_fps`` and the list's length)."""

    frames: torch.Tensor
    indices: list[int]
    fps: float
    total_frames: int
    timestamps: list[float] = field(default_factory=list)
    source: str = ""
    """The path (or '<bytes>' / '<frames>') the clip came from, for messages and `data inspect`."""
    size: tuple[int, int] | None = None
    """(height, width) the family's plan resizes the frames to (None: its video processor fits them itself)."""

    def __post_init__(self) -> None:
        if not self.timestamps:
            self.timestamps = [i / self.fps for i in self.indices]

    @property
    def info(self) -> VideoInfo:
        return VideoInfo(self.total_frames, self.fps, int(self.frames.shape[1]), int(self.frames.shape[2]))

    def metadata(self) -> Any:
        """transformers' ``VideoMetadata`` of the clip: the source's frame count and rate and the kept frames'
        indices (what Qwen3-VL's timestamps and Qwen2.5-VL's second_per_grid_ts are computed from)."""
        from transformers.video_utils import VideoMetadata

        return VideoMetadata(total_num_frames=self.total_frames, fps=self.fps, height=int(self.frames.shape[1]),
                             width=int(self.frames.shape[2]), duration=self.total_frames / self.fps,
                             frames_indices=list(self.indices))


Chooser = Callable[[VideoInfo], list[int]]
"""info -> the frame indices to keep (ascending); raises SkipSample if the clip cannot be used."""


def is_frame_list(spec: Any) -> bool:
    """True for a video given as a list of frame images (paths, bytes or PIL images)."""
    return isinstance(spec, (list, tuple))


def load_video(spec: Any, base_dir: str | None, settings: VideoSettings, choose: Chooser | None = None) -> VideoClip:
    """Decode the frames ``choose`` picks (default :meth:`VideoSettings.indices`) from a video file path, its
    bytes, or a list of frame images; relative paths are relative to ``base_dir``. Raises SkipSample
    (``video_unreadable``, ``video_no_frames``, ``video_too_short``)."""
    choose = choose or settings.indices
    if is_frame_list(spec):
        return _load_frames(list(spec), base_dir, settings, choose)
    if isinstance(spec, str):
        path = spec if base_dir is None or os.path.isabs(spec) else os.path.join(base_dir, spec)
        if not os.path.isfile(path):
            raise SkipSample("video_unreadable", f"{spec}: no such file")
        return _decode(path, spec, settings, choose)
    if isinstance(spec, (bytes, bytearray, memoryview)):
        return _decode(io.BytesIO(bytes(spec)), "<bytes>", settings, choose)
    raise SkipSample("video_unreadable", f"a video is a path, bytes or a list of frames, got {type(spec).__name__}")


def load_planned(spec: Any, settings: VideoSettings, plan: Callable[[VideoInfo], Any] | None = None
                 ) -> tuple[VideoClip, Any]:
    """:func:`load_video` of the frames ``plan(info)`` keeps (an object with ``indices``, e.g. a family's frame
    plan; default: :meth:`VideoSettings.indices`), and that plan (None without ``plan``); the last one made
    where fewer frames decode than the header says."""
    plans: list[Any] = []

    def choose(info: VideoInfo) -> list[int]:
        if plan is None:
            return settings.indices(info)
        plans.append(plan(info))
        return plans[-1].indices

    clip = load_video(spec, None, settings, choose)
    return clip, (plans[-1] if plans else None)


def _check_length(total: int, settings: VideoSettings, what: str) -> None:
    if total < 1:
        raise SkipSample("video_no_frames", f"{what}: no decodable frames")
    if total < settings.min_frames:
        raise SkipSample("video_too_short", f"{what}: {total} frames < data.video_min_frames="
                         f"{settings.min_frames}")


def _load_frames(frames: list[Any], base_dir: str | None, settings: VideoSettings, choose: Chooser) -> VideoClip:
    from vlmtrain.data.processing import load_image

    _check_length(len(frames), settings, "frame list")
    first = load_image(_frame_path(frames[0], base_dir))
    info = VideoInfo(len(frames), settings.fps, first.height, first.width)
    indices = choose(info)
    arrays = []
    for i in indices:
        image = first if i == 0 else load_image(_frame_path(frames[i], base_dir))
        if image.size != first.size:
            raise SkipSample("video_unreadable", f"frame list: frame {i} is {image.size[0]}x{image.size[1]}, "
                             f"frame 0 {first.size[0]}x{first.size[1]} (a clip's frames share one size)")
        arrays.append(np.asarray(image.convert("RGB")))
    return VideoClip(torch.from_numpy(np.stack(arrays)), indices, settings.fps, len(frames), source="<frames>")


def _frame_path(frame: Any, base_dir: str | None) -> Any:
    if isinstance(frame, str) and base_dir is not None and not os.path.isabs(frame):
        return os.path.join(base_dir, frame)
    return frame


def probe(container: Any) -> tuple[Any, VideoInfo]:
    """The first video stream of an open PyAV container and its :class:`VideoInfo`, from the container's
    headers (no decoding): the frame count is the stream's own, else duration x rate."""
    if not container.streams.video:
        raise SkipSample("video_no_frames", "the file has no video stream")
    stream = container.streams.video[0]
    rate = stream.average_rate or stream.guessed_rate or stream.base_rate
    fps = float(rate) if rate else 0.0
    total = int(stream.frames or 0)
    if total <= 0 and fps > 0:
        if stream.duration is not None and stream.time_base is not None:
            seconds = float(stream.duration * stream.time_base)
        elif container.duration is not None:
            seconds = container.duration / 1_000_000
        else:
            seconds = 0.0
        total = int(round(seconds * fps))
    if fps <= 0:
        raise SkipSample("video_unreadable", "the video stream has no frame rate")
    return stream, VideoInfo(total, fps, int(stream.codec_context.height), int(stream.codec_context.width))


SEEK_GAP_SECONDS = 2.0
"""Chosen frames further apart than this are reached by seeking (to the keyframe before the next one) rather
than by decoding every frame between them."""


def _decode(file: Any, name: str, settings: VideoSettings, choose: Chooser) -> VideoClip:
    try:
        import av
    except ImportError as err:  # pragma: no cover - the optional extra
        raise ConfigError("video samples need PyAV: pip install 'vlmtrain[video]' (or pip install av)") from err
    try:
        container = av.open(file)
    except (av.FFmpegError, OSError, ValueError) as err:
        raise SkipSample("video_unreadable", f"{name}: {err}"[:200]) from err
    try:
        stream, info = probe(container)
        _check_length(info.total_frames, settings, name)
        indices = choose(info)
        frames, got = _decode_indices(container, stream, info, indices)
    except av.FFmpegError as err:
        raise SkipSample("video_unreadable", f"{name}: {err}"[:200]) from err
    finally:
        container.close()
    if got < len(indices):  # a truncated file, or a header frame count above what decodes
        if got == 0:
            raise SkipSample("video_no_frames", f"{name}: no frame decodes")
        if got < settings.min_frames:
            raise SkipSample("video_too_short", f"{name}: {got} decodable frames < data.video_min_frames="
                             f"{settings.min_frames}")
        # Fewer frames decode than the header says: choose again among those that did (decoding again).
        return _decode(_reopen(file), name, settings, _capped(choose, got))
    return VideoClip(torch.from_numpy(frames), indices, info.fps, info.total_frames, source=name)


def _reopen(file: Any) -> Any:
    if isinstance(file, io.BytesIO):
        file.seek(0)
    return file


def _capped(choose: Chooser, total: int) -> Chooser:
    def chooser(info: VideoInfo) -> list[int]:
        return choose(VideoInfo(min(total, info.total_frames), info.fps, info.height, info.width))
    return chooser


def _decode_indices(container: Any, stream: Any, info: VideoInfo, indices: Sequence[int]) -> tuple[Any, int]:
    """The frames at ``indices`` (ascending), found by presentation time, as one uint8 array [T, H, W, 3] filled
    in place, and how many were found; frames between them are decoded (or skipped by a seek) and dropped at
    once, so memory holds the kept frames only (and one array of them, never a list and its stacked copy)."""
    stream.thread_type = "AUTO"
    time_base = float(stream.time_base)
    start = stream.start_time or 0
    gap = max(1, int(SEEK_GAP_SECONDS * info.fps))
    out: Any = None
    wanted = list(indices)
    position = -1  # index of the last frame decoded
    frames: Any = None
    k = 0
    while k < len(wanted):
        target = wanted[k]
        if frames is None or target - position > gap:
            pts = start + int(round(target / info.fps / time_base))
            container.seek(max(pts, start), backward=True, any_frame=False, stream=stream)
            frames = container.decode(stream)
        while position < target:
            frame = next(frames, None)
            if frame is None:
                return out, k  # the file ends (truncated, or fewer frames than its header says)
            if frame.pts is None:
                position += 1
            else:
                position = int(round((frame.pts - start) * time_base * info.fps))
        array = None
        while k < len(wanted) and wanted[k] <= position:  # (the same frame for indices that round onto it)
            array = frame.to_ndarray(format="rgb24") if array is None else array
            if out is None:
                out = np.empty((len(wanted), *array.shape), np.uint8)
            out[k] = array
            k += 1
    return out, k


def write_video(path: str, frames: Any, fps: float, codec: str = "mpeg4", gop: int | None = None) -> str:
    """Encode RGB uint8 frames (an iterable of [H, W, 3] arrays, even H and W) into a video file with PyAV, one
    at a time (test clips, synthetic video tasks); ``gop``: frames between keyframes (the codec's default)."""
    import fractions

    import av

    container = av.open(path, "w")
    try:
        stream = None
        for frame in frames:
            frame = np.ascontiguousarray(frame, dtype=np.uint8)
            if stream is None:
                stream = container.add_stream(codec, rate=fractions.Fraction(fps).limit_denominator(1001))
                stream.height, stream.width = int(frame.shape[0]), int(frame.shape[1])
                stream.pix_fmt = "yuv420p"
                if gop is not None:
                    stream.codec_context.gop_size = gop
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        if stream is not None:
            for packet in stream.encode():
                container.mux(packet)
    finally:
        container.close()
    return path
