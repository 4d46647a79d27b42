"""the_cauldron-schema JSONL files: ``{"images": [paths relative to the file], "texts": [{"user", "assistant"}]}``
per line, written from any dataset of samples with PIL images and read back (images loaded or left as paths)."""

from __future__ import annotations

import json
import os
from typing import Any

from PIL import Image


def write_cauldron_jsonl(dataset: Any, out_dir: str, name: str = "data") -> str:
    """Write ``dataset``'s samples (PIL images) as ``out_dir/<name>.jsonl`` plus PNGs in ``out_dir/images/``.

    Each line is the sample with ``images`` replaced by paths relative to the JSONL file. Returns
    the JSONL path.
    """
    img_dir = os.path.join(out_dir, "images")
    os.makedirs(img_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{name}.jsonl")
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        for i in range(len(dataset)):
            sample = dict(dataset[i])
            stem = f"{name}-{sample.get('id', i)}"
            rel = []
            for k, img in enumerate(sample["images"]):
                rel_path = f"images/{stem}-{k}.png"
                img.save(os.path.join(out_dir, rel_path))
                rel.append(rel_path)
            sample["images"] = rel
            f.write(json.dumps(sample) + "\n")
    os.replace(tmp, path)
    return path


def read_cauldron_jsonl(path: str, load_images: bool = True) -> list[dict[str, Any]]:
    """Load a cauldron-style JSONL file; image paths are resolved against the file's folder.

    With ``load_images`` images come back as RGB PIL images (a missing or unreadable file raises);
    without, as absolute paths, opened later by the processor, which skips and counts a sample whose
    image is missing or corrupt instead of failing the run. ``scene`` entries (if any) come back as
    tuples. A line that is not a JSON object raises a ValueError naming the file and line.
    """
    root = os.path.dirname(os.path.abspath(path))
    samples = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                sample = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{number}: not valid JSON ({err.msg}).") from None
            if not isinstance(sample, dict):
                raise ValueError(f"{path}:{number}: expected a JSON object, got {type(sample).__name__}.")
            paths = [p if os.path.isabs(p) else os.path.join(root, p) for p in sample.get("images") or []]
            if load_images:
                sample["images"] = [_open_rgb(p) for p in paths]
            else:
                sample["images"] = paths
            if sample.get("videos") is not None:
                from vlmtrain.data.video_layout import resolve_videos

                sample["videos"] = resolve_videos(sample["videos"], root)
            if "scene" in sample:
                sample["scene"] = [[tuple(o) for o in scene] for scene in sample["scene"]]
            samples.append(sample)
    return samples


def _open_rgb(path: str) -> Image.Image:
    with Image.open(path) as img:
        return img.convert("RGB")
