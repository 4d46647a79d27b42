"""Where videos sit in stored samples: WebDataset members ``KEY.video.N.<container>`` / ``KEY.video.N.M.<image>``
and JSONL paths relative to the file (see docs/data.md#videos). Imports nothing of vlmtrain (the sources use it)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

VIDEO_EXTENSIONS = ("mp4", "webm", "mov", "avi", "mkv")
"""File extensions read as video containers."""


def video_members(group: list[tuple[str, bytes]], image_extensions: Sequence[str]) -> list[Any] | None:
    """The videos of a WebDataset key's members: ``video.N.<container>`` (a file's bytes) or ``video.N.M.<image>``
    (frame M of video N), in index order; None if an index is given twice (or as both a file and frames)."""
    files: dict[int, bytes] = {}
    frames: dict[int, dict[int, bytes]] = {}
    for ext, data in group:
        parts = ext.lower().split(".")
        if parts[0] != "video" or not all(p.isdigit() for p in parts[1:-1]):
            continue
        if len(parts) == 3 and parts[2] in VIDEO_EXTENSIONS:
            if int(parts[1]) in files:
                return None
            files[int(parts[1])] = data
        elif len(parts) == 4 and parts[3] in image_extensions:
            one = frames.setdefault(int(parts[1]), {})
            if int(parts[2]) in one:
                return None
            one[int(parts[2])] = data
    if set(files) & set(frames):
        return None
    videos = {**files, **{i: [f[j] for j in sorted(f)] for i, f in frames.items()}}
    return [videos[i] for i in sorted(videos)]


def resolve_videos(videos: Any, base: str) -> Any:
    """A JSONL record's ``videos`` with relative paths (of files and of frame images) made absolute under
    ``base`` (the file's folder); a single video (a path) becomes a list of one."""
    def one(v: Any) -> Any:
        if isinstance(v, str):
            return os.path.join(base, v)
        if isinstance(v, (list, tuple)):
            return [os.path.join(base, f) if isinstance(f, str) else f for f in v]
        return v
    if isinstance(videos, (list, tuple)):
        return [one(v) for v in videos]
    return [one(videos)]
