"""Video for Qwen3-VL and Qwen2.5-VL without torchvision: frame choice, caps, pixels, token expansion.

transformers' Qwen video processors (``Qwen3VLVideoProcessor``, and ``Qwen2VLVideoProcessor`` that Qwen2.5-VL
uses) need torchvision, whose PyPI wheel does not load next to a CPU torch. :class:`TorchQwenVideoProcessor`
computes what they compute, with torch alone:

- frame choice: Qwen3-VL ``np.linspace(0, total - 1, n).round()`` with ``n = int(total / fps * video_fps)``;
  Qwen2.5-VL ``torch.arange(0, total, total / n).int()`` with n floored to a multiple of temporal_patch_size
  (each family's ``sample_frames``), both within [video_min_frames, video_max_frames] (where float error
  makes transformers' arange yield n + 1 indices, the first n);
- frame size: the family's own ``smart_resize`` (imported from transformers) under the ``size`` the caps give;
- resize: ``torch.nn.functional.interpolate(uint8 frames, mode="bicubic", antialias=True,
  align_corners=False)``, what torchvision's ``resize`` does for uint8 tensors on CPU with BICUBIC (the
  processors' resample), and nothing when the size is unchanged;
- rescale and normalize fused as transformers does (``(x - mean * 255) / (std * 255)`` in float32);
- patches: the last frame repeated up to a multiple of temporal_patch_size, then the processors' patchify
  layout, ``pixel_values_videos`` [patches, C * temporal * patch^2] and ``video_grid_thw`` [[t, h, w]].

Token expansion stays the checkpoint's processor class's own: vlmtrain's image-only processor is copied with
this video processor attached, so ``Qwen3VLProcessor`` writes its ``<t seconds>`` timestamps (from the frame
indices and fps in the video metadata) and ``Qwen2_5_VLProcessor`` its ``second_per_grid_ts``.

Caps (:meth:`QwenVideo.plan`): each frame at most ``video_max_pixels`` (default 768 tokens' worth, the
families' published per-frame maximum and their video processors' own) and at least
``video_min_pixels`` (default 128 tokens' worth, the published minimum); a clip over ``max_video_tokens``
(its video tokens), or over the room a sample's text leaves it under ``max_length`` (all the tokens it takes:
video tokens, the template's vision start / end markers and, for Qwen3-VL, each temporal patch's
``<t seconds>`` timestamp and markers), gets smaller frames down to video_min_pixels (or the source's frame size
where video_min_pixels would upscale it), then fewer frames down to video_min_frames, then frames below
video_min_pixels; what still does not fit is skipped
(``video_over_token_cap``).
"""

from __future__ import annotations

import copy
import math
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ...data.processing import SkipSample
from ...data.video import VideoInfo, VideoSettings, linspace_indices
from ...errors import ConfigError

MAX_FRAME_TOKENS, MIN_FRAME_TOKENS = 768, 128
"""Published per-frame bounds in (patch x merge)^2 pixel units: qwen-vl-utils' VIDEO_MAX_PIXELS = 768 x 28^2
(Qwen2.5-VL) / VIDEO_MAX_TOKEN_NUM = 768 (Qwen3-VL), VIDEO_MIN_PIXELS = 128 x 28^2 / VIDEO_MIN_TOKEN_NUM = 128."""

# Token counts of Qwen3-VL's timestamp texts per tokenizer, shared by every QwenVideo of a processor: a plan tries
# each frame count and tokenizes each count's timestamps, which dominated QwenVideos built per setting (2,000 in
# the caps property test: 150-210 s, then 5 s).
_TEXT_TOKENS: weakref.WeakKeyDictionary[Any, dict[str, int]] = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class FramePlan:
    """A clip's frame choice and size: source frame indices, the frame size after the resize, the ``size``
    dict that transformers' video processor of the family would be given for it, and its video tokens."""

    indices: list[int]
    height: int
    width: int
    size: dict[str, int]
    tokens: int
    """Video tokens (what the vision tower's output fills)."""
    length: int
    """Every token the clip takes in a sample's input_ids: its video tokens, the template's vision start / end
    markers and, for Qwen3-VL, each temporal patch's timestamp text and markers (the processor's expansion)."""


class QwenVideo:
    """The video side of one Qwen checkpoint: ``kind`` 'qwen3_vl' or 'qwen2_5_vl', the vision geometry and
    normalization (from the processor's image processor, which the checkpoint's video processor shares), its
    tokenizer (Qwen3-VL's timestamp texts are counted with it) and the
    :class:`~vlmtrain.data.video.VideoSettings`, resolved against the checkpoint's limits."""

    def __init__(self, kind: str, processor: Any, settings: VideoSettings) -> None:
        if kind not in ("qwen3_vl", "qwen2_5_vl"):
            raise ValueError(f"unknown Qwen video kind {kind!r}")
        self.kind = kind
        image_processor = processor.image_processor
        self.tokenizer = getattr(processor, "tokenizer", None)
        self._text_tokens: dict[str, int] = {} if self.tokenizer is None else _TEXT_TOKENS.setdefault(self.tokenizer, {})
        self.patch_size = int(image_processor.patch_size)
        self.merge_size = int(image_processor.merge_size)
        self.temporal_patch_size = int(getattr(image_processor, "temporal_patch_size", 2) or 2)
        self.image_mean = list(image_processor.image_mean)
        self.image_std = list(image_processor.image_std)
        self.rescale_factor = float(getattr(image_processor, "rescale_factor", 1 / 255))
        self.factor = self.patch_size * self.merge_size
        unit = self.factor ** 2
        self.max_pixels = settings.max_pixels or MAX_FRAME_TOKENS * unit
        if self.max_pixels < unit:
            raise ConfigError(f"data.video_max_pixels={self.max_pixels} is less than one video token "
                              f"({self.factor}x{self.factor} = {unit} pixels for this checkpoint).")
        self.min_pixels = min(settings.min_pixels or MIN_FRAME_TOKENS * unit, self.max_pixels)
        self.settings = settings
        self.max_tokens = settings.max_tokens
        least = math.ceil(max(settings.min_frames, self.temporal_patch_size) / self.temporal_patch_size)
        if self.max_tokens is not None and self.max_tokens < least:
            raise ConfigError(f"data.max_video_tokens={self.max_tokens} cannot hold data.video_min_frames="
                              f"{settings.min_frames} frames even at one token per {self.temporal_patch_size} "
                              f"frames (at least {least}).")

    # -- frame choice ---------------------------------------------------------------------------------
    def sample(self, info: VideoInfo, num_frames: int | None = None) -> list[int]:
        """The family's frame indices (its ``sample_frames``): at ``video_fps`` within the frame bounds, or
        ``num_frames`` of them when given (a cap asked for fewer)."""
        s, total, tp = self.settings, info.total_frames, self.temporal_patch_size
        if self.kind == "qwen3_vl":
            n = s.num_frames(total, info.fps) if num_frames is None else num_frames
            return linspace_indices(total, n)
        if num_frames is not None:
            n = round(num_frames / tp) * tp
        else:
            most = math.floor(min(s.max_frames, total) / tp) * tp
            n = min(max(total / info.fps * s.fps, s.min_frames), most, total)
            n = math.floor(n / tp) * tp
        if n < 1:
            raise SkipSample("video_too_short", f"{total} frames: fewer than temporal_patch_size={tp} to sample")
        # (transformers' arange can yield n + 1 indices by float error, one above max_frames: the first n are kept)
        return torch.arange(0, total, total / n).int()[:n].tolist()

    # -- frame size -----------------------------------------------------------------------------------
    def size_for(self, num_frames: int, max_pixels: int, min_pixels: int) -> dict[str, int]:
        """The ``size`` of the family's video processor that bounds each of ``num_frames`` frames to
        [min_pixels, max_pixels]: per frame for Qwen2.5-VL; for Qwen3-VL, whose bound is over all frames
        (``t_bar x h x w``, t_bar = frames rounded to the temporal patch), per-frame x min(frames, t_bar)."""
        if self.kind == "qwen2_5_vl":
            return {"shortest_edge": min_pixels, "longest_edge": max_pixels}
        t_bar = round(num_frames / self.temporal_patch_size) * self.temporal_patch_size
        return {"shortest_edge": min_pixels * num_frames, "longest_edge": max_pixels * max(1, min(num_frames, t_bar))}

    def resized(self, num_frames: int, height: int, width: int, size: dict[str, int]) -> tuple[int, int]:
        """(height, width) of the frames after the family's ``smart_resize`` under ``size``."""
        if self.kind == "qwen2_5_vl":
            from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

            return smart_resize(height, width, factor=self.factor, min_pixels=size["shortest_edge"],
                                max_pixels=size["longest_edge"])
        from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize as smart_resize3

        if num_frames < self.temporal_patch_size:
            raise SkipSample("video_too_short", f"{num_frames} frame(s): Qwen3-VL needs at least "
                             f"temporal_patch_size={self.temporal_patch_size}")
        return smart_resize3(num_frames, height, width, temporal_factor=self.temporal_patch_size,
                             factor=self.factor, min_pixels=size["shortest_edge"], max_pixels=size["longest_edge"])

    def tokens(self, num_frames: int, height: int, width: int) -> int:
        """Video tokens of ``num_frames`` frames of height x width (after the resize)."""
        groups = -(-num_frames // self.temporal_patch_size)
        return groups * (height // self.factor) * (width // self.factor)

    def markers(self, indices: list[int], fps: float) -> int:
        """The tokens a clip of the frames ``indices`` (of a source at ``fps``) takes besides its video tokens:
        the template's ``<|vision_start|>``/``<|vision_end|>`` around its ``<|video_pad|>`` (which the video tokens
        replace) and, for Qwen3-VL, per temporal patch ``<t seconds>`` and its own start / end markers, as
        ``Qwen3VLProcessor.replace_video_token`` writes them (t: the patch's mean frame time, one decimal)."""
        if self.kind == "qwen2_5_vl":
            return 2
        tp = self.temporal_patch_size
        padded = list(indices) + [indices[-1]] * (-len(indices) % tp)  # (_calculate_timestamps' padding)
        times = [(padded[i] / fps + padded[i + tp - 1] / fps) / 2 for i in range(0, len(padded), tp)]
        return 2 + sum(self._count(f"<{t:.1f} seconds>") + 2 for t in times)

    def _count(self, text: str) -> int:
        """Tokens of ``text`` alone (the processor's text between special tokens is tokenized on its own)."""
        if text not in self._text_tokens:
            if self.tokenizer is None:
                raise ValueError("QwenVideo needs the processor's tokenizer to count Qwen3-VL's timestamps")
            self._text_tokens[text] = len(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        return self._text_tokens[text]

    def _fit(self, num_frames: int, height: int, width: int, below_min: bool, cap: int | None
             ) -> tuple[dict[str, int], int, int] | None:
        """The size for ``num_frames`` frames under the per-frame cap and ``cap`` video tokens for the clip
        (frames no smaller than video_min_pixels, or than their own size where that is smaller, unless
        ``below_min``), or None if none fits. The bound handed to smart_resize starts at the caps and steps down
        one token's pixels while whole patches of a thin frame still overshoot them."""
        unit = self.factor ** 2
        groups = -(-num_frames // self.temporal_patch_size)
        most = self.max_pixels
        if cap is not None:
            if cap < groups:
                return None
            most = min(most, (cap // groups) * unit)
        # (an upscale to video_min_pixels gives way before any frame does)
        floor = unit if below_min else max(unit, min(self.min_pixels, height * width))
        while most >= floor:
            size = self.size_for(num_frames, most, min(self.min_pixels, most))
            try:
                h, w = self.resized(num_frames, height, width, size)
            except ValueError as err:  # smart_resize: an aspect ratio above 200
                raise SkipSample("bad_aspect_ratio", str(err)) from err
            if h * w <= self.max_pixels and (cap is None or self.tokens(num_frames, h, w) <= cap):
                return size, h, w
            most = (most - 1) // unit * unit  # (the next whole token below)
        return None

    def plan(self, info: VideoInfo, room: int | None = None, tokens: int | None = None) -> FramePlan:
        """Frames and size for a clip: the family's choice at video_fps, its frames downscaled (to
        video_min_pixels), then fewer of them (to video_min_frames), then smaller than video_min_pixels,
        until the clip's video tokens are within max_video_tokens (and ``tokens``: what data.max_patches_per_pack
        leaves it) and all its tokens (:attr:`FramePlan.length`) within ``room`` (what a sample's text leaves it
        under max_length; None: no such bound); SkipSample(video_over_token_cap) if nothing fits."""
        indices = self.sample(info)
        counts = [len(indices)]
        step = 1 if self.kind == "qwen3_vl" else self.temporal_patch_size
        least = max(min(self.settings.min_frames, len(indices)), self.temporal_patch_size)
        counts += list(range(len(indices) - step, least - 1, -step))
        for below_min in (False, True):
            for n in (counts if not below_min else counts[-1:]):
                chosen = indices if n == len(indices) else self.sample(info, n)
                markers = self.markers(chosen, info.fps)
                caps = [c for c in (self.max_tokens, tokens, None if room is None else room - markers) if c is not None]
                cap = min(caps) if caps else None
                fit = self._fit(len(chosen), info.height, info.width, below_min, cap)
                if fit is not None:
                    size, h, w = fit
                    count = self.tokens(len(chosen), h, w)
                    return FramePlan(chosen, h, w, size, count, count + markers)
        within = (f"data.max_video_tokens={self.max_tokens}" + ("" if tokens is None else f", the {tokens} video "
                  f"tokens data.max_patches_per_pack leaves it") + ("" if room is None else
                                                                    f", the {room} tokens max_length leaves it"))
        raise SkipSample("video_over_token_cap", f"{info.total_frames} frames of {info.width}x{info.height}: "
                         f"no frame count >= {least} and size fits {within}")

    def smallest(self) -> tuple[Any, FramePlan]:
        """The smallest clip (temporal_patch_size blank frames of one token's size, at 1 fps) and its plan: what
        stands in for a sample's clips while the room its text leaves them is measured."""
        from ...data.video import VideoClip

        tp, f = self.temporal_patch_size, self.factor
        indices = list(range(tp))
        clip = VideoClip(torch.zeros(tp, f, f, 3, dtype=torch.uint8), indices, 1.0, tp, size=(f, f))
        tokens = self.tokens(tp, f, f)
        return clip, FramePlan(indices, f, f, self.size_for(tp, f * f, f * f), tokens, tokens + self.markers(indices, 1.0))

    def choose(self, info: VideoInfo) -> list[int]:
        """The chooser for :func:`~vlmtrain.data.video.load_video`: the plan's frame indices."""
        return self.plan(info).indices

    # -- processing -----------------------------------------------------------------------------------
    def processor(self, sizes: list[tuple[int, int] | None] | None = None) -> TorchQwenVideoProcessor:
        return TorchQwenVideoProcessor(self, sizes)

    def attach(self, processor: Any, sizes: list[tuple[int, int] | None] | None = None) -> Any:
        """A shallow copy of ``processor`` (vlmtrain's image-only Qwen processor) with this video processor, so
        the processor class's own code expands video tokens; ``processor`` itself is left without one (what is
        saved with a checkpoint names the real class, whose own video processor then loads). ``sizes``: the
        (height, width) each video of the call is resized to (its plan's; None: fitted to the settings)."""
        with_video = copy.copy(processor)
        with_video.video_processor = self.processor(sizes)
        return with_video


class TorchQwenVideoProcessor:
    """Stands in for transformers' Qwen video processor inside the checkpoint's processor: called with frames
    (uint8 [T, H, W, 3] each) and their ``video_metadata``, it returns ``pixel_values_videos``,
    ``video_grid_thw`` and the metadata, computed as transformers' processor does (module docstring); ``sizes``:
    per video of a call, the (height, width) its plan resizes it to (None: fitted to the settings)."""

    def __init__(self, video: QwenVideo, sizes: list[tuple[int, int] | None] | None = None) -> None:
        self.video, self.sizes = video, sizes
        self.patch_size, self.merge_size = video.patch_size, video.merge_size
        self.temporal_patch_size = video.temporal_patch_size

    def __call__(self, videos: Any, video_metadata: Any = None, return_metadata: bool = True,
                 **kwargs: Any) -> Any:
        from transformers.feature_extraction_utils import BatchFeature
        from transformers.video_utils import make_batched_videos

        videos = make_batched_videos(videos)
        metadata = list(_flatten(video_metadata)) if video_metadata is not None else [None] * len(videos)
        if len(metadata) != len(videos):
            raise ValueError(f"{len(videos)} videos but {len(metadata)} video_metadata entries")
        sizes = self.sizes if self.sizes is not None else [None] * len(videos)
        if len(sizes) != len(videos):
            raise ValueError(f"{len(videos)} videos but {len(sizes)} planned sizes")
        pixels, grids = [], []
        for frames, size in zip(videos, sizes):
            frames = torch.as_tensor(np.asarray(frames)) if not isinstance(frames, torch.Tensor) else frames
            patches, grid = self.process(frames, size)
            pixels.append(patches)
            grids.append(grid)
        data = {"pixel_values_videos": torch.cat(pixels, dim=0), "video_grid_thw": torch.tensor(grids)}
        if return_metadata:
            data["video_metadata"] = metadata
        return BatchFeature(data=data)

    def process(self, frames: torch.Tensor, size: tuple[int, int] | None = None) -> tuple[torch.Tensor, list[int]]:
        """uint8 frames [T, H, W, 3] -> (patches [t*h*w, C*temporal*patch^2] float32, [t, h, w]); ``size``: the
        (height, width) to resize to (default: fitted to the settings' caps)."""
        v = self.video
        num_frames, height, width = int(frames.shape[0]), int(frames.shape[1]), int(frames.shape[2])
        if size is None:
            fit = (v._fit(num_frames, height, width, False, v.max_tokens)
                   or v._fit(num_frames, height, width, True, v.max_tokens))
            if fit is None:
                raise SkipSample("video_over_token_cap", f"{num_frames} frames of {width}x{height}")
            size = fit[1:]
        h, w = size
        x = frames.permute(0, 3, 1, 2).contiguous()  # [T, C, H, W], as transformers lays videos out
        x = resize_like_torchvision(x, h, w)
        mean = torch.tensor(v.image_mean) * (1.0 / v.rescale_factor)
        std = torch.tensor(v.image_std) * (1.0 / v.rescale_factor)
        x = x.to(torch.float32).sub_(mean.view(-1, 1, 1)).div_(std.view(-1, 1, 1))
        return patchify(x, v.patch_size, v.merge_size, v.temporal_patch_size)


def resize_like_torchvision(frames: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """torchvision.transforms.v2.functional.resize of uint8 frames [..., C, H, W] with BICUBIC and antialias on
    CPU: the input unchanged at its own size, else torch's native uint8 bicubic interpolation with antialias
    (align_corners=False); on another device, in float32, clamped to [0, 255] and rounded back to uint8."""
    if tuple(frames.shape[-2:]) == (height, width):
        return frames
    shape = frames.shape
    x = frames.reshape(-1, *shape[-3:])
    native = x.device.type == "cpu" and x.dtype == torch.uint8
    y = torch.nn.functional.interpolate(x if native else x.to(torch.float32), size=[height, width], mode="bicubic",
                                        align_corners=False, antialias=True)
    if not native and frames.dtype == torch.uint8:
        y = y.clamp_(0, 255).round_().to(torch.uint8)
    return y.reshape(*shape[:-2], height, width)


def patchify(frames: torch.Tensor, patch_size: int, merge_size: int, temporal_patch_size: int
             ) -> tuple[torch.Tensor, list[int]]:
    """Frames [T, C, H, W] -> (patches [t*h*w, C*temporal*patch^2], [t, h, w]) in the Qwen processors' order:
    the last frame repeated up to a multiple of temporal_patch_size; patches merge-block by merge-block."""
    num_frames, channel, height, width = frames.shape
    if pad := -num_frames % temporal_patch_size:
        frames = torch.cat((frames, frames[-1:].expand(pad, -1, -1, -1)), dim=0)
        num_frames += pad
    t, h, w = num_frames // temporal_patch_size, height // patch_size, width // patch_size
    patches = frames.reshape(t, temporal_patch_size, channel, h // merge_size, merge_size, patch_size,
                             w // merge_size, merge_size, patch_size)
    patches = patches.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return patches.reshape(t * h * w, channel * temporal_patch_size * patch_size ** 2), [t, h, w]


def _flatten(metadata: Any) -> Any:
    if isinstance(metadata, (list, tuple)):
        for m in metadata:
            yield from _flatten(m)
    else:
        yield metadata
