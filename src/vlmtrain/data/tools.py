"""`vlmtrain data to-wds` and `vlmtrain data inspect`: write a source as WebDataset shards, or describe one."""

from __future__ import annotations

import io
import json
import os
import tarfile
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

from PIL import Image

from vlmtrain.data.registry import COMMAND_LINE_SOURCES
from vlmtrain.data.sources import KEY, JsonlSource, WebDatasetSource, is_counts_only


def open_source(spec: str) -> Any:
    """A source from a command-line spec: ``shapes[:N]``, a ``.jsonl`` path/glob, ``.tar`` shards
    (path, glob or brace range), or an HF ``load_from_disk`` directory."""
    for prefix, open_registered in COMMAND_LINE_SOURCES.items():  # a higher layer's (e.g. shapes[:N])
        if spec.startswith(prefix):
            return open_registered(spec)
    if ".jsonl" in spec:
        return JsonlSource(spec)
    if ".tar" in spec:
        return WebDatasetSource(spec)
    if os.path.isdir(spec):
        from vlmtrain.data.hf import hf_source

        return hf_source({"path": spec})
    raise ValueError(f"cannot tell what kind of source {spec!r} is: expected shapes[:N], *.jsonl, *.tar "
                     f"shards or a datasets.load_from_disk directory")


def progress(samples: Iterable[Any], what: str) -> Iterable[Any]:
    """``samples`` with a tqdm counter on stderr."""
    from tqdm import tqdm

    return tqdm(samples, desc=what, unit=" samples")


def _image_bytes(image: Any) -> tuple[bytes, str]:
    """(bytes, extension) of an image given as a PIL image, bytes or a path."""
    if isinstance(image, Image.Image):
        buf = io.BytesIO()
        image.save(buf, format="PNG")
        return buf.getvalue(), "png"
    if isinstance(image, (bytes, bytearray)):
        return bytes(image), _sniff(bytes(image))
    with open(image, "rb") as f:
        data = f.read()
    return data, _sniff(data)


def _video_members(videos: Any) -> list[tuple[str, bytes]]:
    """(member name after the key, bytes) of a sample's videos: ``video.N.<ext>`` for a file (its extension;
    bytes: mp4), ``video.N.M.<ext>`` for frame M of a frame list (docs/data.md#videos)."""
    if videos is None:
        return []
    out = []
    for i, video in enumerate(videos if isinstance(videos, (list, tuple)) else [videos]):
        if isinstance(video, (list, tuple)):
            for j, frame in enumerate(video):
                data, ext = _image_bytes(frame)
                out.append((f"video.{i}.{j}.{ext}", data))
        elif isinstance(video, (bytes, bytearray)):
            out.append((f"video.{i}.mp4", bytes(video)))
        else:
            with open(video, "rb") as f:
                out.append((f"video.{i}.{os.path.splitext(video)[1].lstrip('.').lower() or 'mp4'}", f.read()))
    return out


def _sniff(data: bytes) -> str:
    return "jpg" if data[:3] == b"\xff\xd8\xff" else "webp" if data[8:12] == b"WEBP" else "png"


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mtime = 0  # reproducible shards
    tar.addfile(info, io.BytesIO(data))


def write_webdataset(samples: Iterable[dict[str, Any]], out_dir: str, shard_size: int = 1000,
                     prefix: str = "shard") -> list[str]:
    """Write samples as ``<out_dir>/<prefix>-NNNNNN.tar`` with ``shard_size`` samples each (DESIGN.md
    layout: ``KEY.json`` + ``KEY.0.png`` ...). Returns the shard paths. Keys are sample numbers."""
    if shard_size < 1:
        raise ValueError(f"shard_size must be >= 1, got {shard_size}")
    os.makedirs(out_dir, exist_ok=True)
    paths: list[str] = []
    tar = None
    try:
        for n, sample in enumerate(s for s in samples if not is_counts_only(s)):
            if n % shard_size == 0:
                if tar is not None:
                    tar.close()
                paths.append(os.path.join(out_dir, f"{prefix}-{len(paths):06d}.tar"))
                tar = tarfile.open(paths[-1], "w")
            key = f"{n:09d}"
            record = {k: v for k, v in sample.items() if k not in ("images", "videos", KEY)
                      and not k.startswith("__") and _jsonable(v)}
            _add(tar, f"{key}.json", json.dumps(record).encode())
            for i, image in enumerate(sample.get("images") or []):
                data, ext = _image_bytes(image)
                _add(tar, f"{key}.{i}.{ext}", data)
            for name, data in _video_members(sample.get("videos")):
                _add(tar, f"{key}.{name}", data)
    finally:
        if tar is not None:
            tar.close()
    return paths


def _jsonable(value: Any) -> bool:
    try:
        json.dumps(value)
        return True
    except TypeError:
        return False


def inspect_source(spec: str, processor: Any = None, limit: int | None = None,
                   check: Callable[[dict[str, Any]], Any] | None = None, examples: int = 20,
                   video: Any = None) -> dict[str, Any]:
    """Counts, image-count and text-length histograms and bad samples of a source (first ``limit``): by reason,
    and the first ``examples`` as ``name (reason: detail)``, named as training names them (``file:line``,
    ``shard:key``, ``<name>:<index>``).

    Each sample goes through ``check`` (default: the checks a Hub VLM's training makes before its processor,
    :func:`~vlmtrain.data.hub_messages.check_record`: texts, `<image>` placeholders against the images, images
    readable, ``labels`` a dict; a run's own check, with its heads and limits, comes from ``vlmtrain data
    inspect --config``), then through ``processor.process`` when given (lengths are then tokens, else characters
    of the conversation). Per video: the frames chosen, their timestamps and (with a family's ``video``
    support: its ``plan``) the video tokens and frame size; ``video``: a family's video support (``plan``,
    ``choose``, ``settings``) or :class:`~vlmtrain.data.video.VideoSettings` (frames and timestamps only;
    default: the default settings).
    """
    from vlmtrain.data.hub_messages import check_record
    from vlmtrain.data.pairs import check_pair, is_pair
    from vlmtrain.data.processing import SkipSample, sample_name

    source = open_source(spec)
    records = (sample for shard in range(len(source.shards)) for _, sample in source.read(shard, {}))
    images, lengths, bad, problems = Counter(), [], Counter(), []
    videos: list[dict[str, Any]] = []
    pairs: list[dict[str, Any]] = []
    samples = 0
    for sample in progress(records, "inspect"):
        if limit is not None and samples >= limit:
            break
        samples += 1
        try:
            result = (check or (check_pair if is_pair(sample) else check_record))(sample)
            videos += describe_videos(sample, video)
            if isinstance(result, dict) and "tokens" in result:  # a pair as a DPO run tokenizes it (pair_check)
                tokens = result["tokens"]
                pairs += [{"sample": sample_name(sample), **tokens}] if len(pairs) < examples else []
                lengths.append(len(tokens["prompt"]) + max((len(v) for k, v in tokens.items() if k != "prompt"),
                                                           default=0))  # (a GRPO prompt: its tokens alone)
            elif processor is not None:
                lengths.append(len(processor.process(sample)["input_ids"]))
            elif is_pair(sample):
                lengths.append(len(str(sample.get("prompt") or sample.get("texts")))
                               + max(len(str(sample["chosen"])), len(str(sample["rejected"]))))
            else:
                lengths.append(sum(len(t.get("user") or "") + len(t.get("assistant") or "")
                                   for t in sample.get("texts") or [] if isinstance(t, dict)))
            images[len(sample.get("images") or [])] += 1
        except SkipSample as err:
            bad[err.reason] += 1
            if len(problems) < examples:
                problems.append(f"{sample_name(sample)} ({err})")
    return {"source": spec, "shards": len(source.shards), "samples": samples, "bad": dict(bad),
            "problems": problems, "images_per_sample": dict(sorted(images.items())), "lengths": _histogram(lengths),
            "videos": videos, "pairs": pairs}


def describe_videos(sample: dict[str, Any], video: Any = None) -> list[dict[str, Any]]:
    """Per video of ``sample``: its frames chosen (source indices), their timestamps in seconds, the source's
    frame count and rate, and with a family's ``video`` support the frame size and video tokens (see
    :func:`inspect_source`). Raises SkipSample for a video that cannot be used."""
    from vlmtrain.data.hub_messages import sample_videos
    from vlmtrain.data.processing import sample_name
    from vlmtrain.data.video import VideoSettings, load_planned

    specs = sample_videos(sample)
    if not specs:
        return []
    settings = video if isinstance(video, VideoSettings) else getattr(video, "settings", None) or VideoSettings()
    out = []
    for i, spec in enumerate(specs):
        clip, plan = load_planned(spec, settings, getattr(video, "plan", None))
        entry = {"sample": sample_name(sample), "video": i, "source_frames": clip.total_frames,
                 "source_fps": round(clip.fps, 3), "frames": len(clip.indices), "indices": clip.indices,
                 "timestamps": [round(t, 3) for t in clip.timestamps]}
        if plan is not None:
            entry.update(size=[plan.height, plan.width], tokens=plan.tokens)
        out.append(entry)
    return out


def _histogram(values: list[int], bins: int = 8) -> dict[str, int]:
    if not values:
        return {}
    lo, hi = min(values), max(values)
    width = max(1, -(-(hi - lo + 1) // bins))
    counts = Counter((v - lo) // width for v in values)
    return {f"{lo + b * width}-{lo + (b + 1) * width - 1}": counts[b] for b in range(bins) if lo + b * width <= hi}


def format_report(report: dict[str, Any]) -> str:
    lines = [f"{report['source']}: {report['samples']} samples in {report['shards']} shard(s)",
             f"  bad samples: {report['bad'] or 'none'}",
             *(f"    {problem}" for problem in report.get("problems", [])),
             *([f"    ... and {more} more"] if (more := sum(report["bad"].values()) - len(report.get("problems", [])))
               > 0 else []),
             "  images per sample: " + ", ".join(f"{k}: {v}" for k, v in report["images_per_sample"].items())]
    total = max(1, sum(report["lengths"].values()))
    shown = report.get("pairs") or []
    unit = "tokens: prompt + longer answer" if any("chosen" in p for p in shown) else "tokens: prompt"
    lines.append(f"  text length ({unit if shown else 'characters'}):")
    for label, n in report["lengths"].items():
        lines.append(f"    {label:>12} {n:>7} {'#' * round(40 * n / total)}")
    for pair in shown:  # (a DPO or GRPO run's config: each pair's / prompt's tokens, the first `examples`)
        lines.append(f"  {'pair' if 'chosen' in pair else 'prompt'} {pair['sample']}:")
        lines += [f"    {side} ({len(pair[side])}): {' '.join(pair[side])}" for side in pair if side != "sample"]
    videos = report.get("videos") or []
    if videos:
        lines.append(f"  videos: {len(videos)} (frames chosen, their timestamps in seconds, video tokens)")
    for v in videos[:VIDEOS_LISTED]:
        stamps = ", ".join(f"{t:g}" for t in v["timestamps"][:8]) + (", ..." if len(v["timestamps"]) > 8 else "")
        tokens = f", {v['tokens']} tokens at {v['size'][1]}x{v['size'][0]}" if "tokens" in v else ""
        lines.append(f"    {v['sample']} video {v['video']}: {v['frames']} of {v['source_frames']} frames "
                     f"({v['source_fps']:g} fps) at [{stamps}] s{tokens}")
    if len(videos) > VIDEOS_LISTED:
        lines.append(f"    ... {len(videos) - VIDEOS_LISTED} more")
    return "\n".join(lines)


VIDEOS_LISTED = 20
"""Videos `vlmtrain data inspect` lists one per line (all of them are in inspect_source's report)."""
