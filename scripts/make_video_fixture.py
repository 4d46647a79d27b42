"""Write tests/fixtures/video_processing.pt: transformers' own Qwen video processors' output for fixed frames.

Run once where torchvision imports (e.g. the GPU machine; it is not installed in CPU CI, where its PyPI wheel does
not load next to a CPU torch), from the repository root:

    PYTHONPATH=src python scripts/make_video_fixture.py

It builds the tiny Qwen3-VL and Qwen2.5-VL checkpoints (patch 8, merge 2, temporal 2; their image processors'
mean / std), makes deterministic frames (tests/test_video_processing.py's ``clip_frames``), and for each
family and setting gives transformers' ``Qwen3VLVideoProcessor`` / ``Qwen2VLVideoProcessor`` (torchvision
resize, bicubic, antialias) the frames, their metadata and the ``size`` vlmtrain's plan derives from the
settings, then saves ``pixel_values_videos`` and ``video_grid_thw``. tests/test_video_processing.py's
``test_equals_committed_fixture`` compares vlmtrain's torch-only processing with it, on every machine.
"""

from __future__ import annotations

import os
import sys
import tempfile

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))

from test_video_processing import FIXTURE, clip_frames  # noqa: E402
from video_reference import reference_video_processor, torchvision_available  # noqa: E402

from vlmtrain.data.video import VideoClip, VideoSettings  # noqa: E402
from vlmtrain.models.families import get_family  # noqa: E402

FRAMES = (9, 40, 56)  # frames, height, width
SETTINGS = [  # downscale, odd frame count and token cap, upscale, about native size
    (8, dict(min_pixels=16 * 16, max_pixels=32 * 32)),
    (9, dict(min_pixels=16 * 16, max_pixels=32 * 24, max_tokens=12)),
    (6, dict(min_pixels=64 * 48, max_pixels=80 * 64)),
    (5, dict(min_pixels=16 * 16, max_pixels=40 * 56, fps=1.0, min_frames=2)),
]


def main() -> None:
    if not torchvision_available():
        sys.exit("torchvision does not import here: this fixture must come from transformers' own video processors")
    import torchvision

    frames = torch.from_numpy(clip_frames(*FRAMES))
    out: dict = {"frames_shape": FRAMES, "torch": torch.__version__, "torchvision": torchvision.__version__}
    import transformers

    out["transformers"] = transformers.__version__
    for kind in ("qwen3_vl", "qwen2_5_vl"):
        family = get_family(kind)
        processor = family.load_processor(family.build_tiny(tempfile.mkdtemp()))
        reference = reference_video_processor(kind, processor.image_processor, shim=False)
        entries = []
        for num, settings in SETTINGS:
            video = family.video(processor, VideoSettings(**settings))
            clip = VideoClip(frames[:num], list(range(num)), 10.0, num)
            fit = video._fit(num, FRAMES[1], FRAMES[2], False) or video._fit(num, FRAMES[1], FRAMES[2], True)
            size = fit[0]
            result = reference(clip.frames, video_metadata=[clip.metadata()], size=size, do_sample_frames=False,
                               return_tensors="pt")
            entries.append({"settings": settings, "num_frames": num, "size": size,
                            "video_grid_thw": result["video_grid_thw"][0].tolist(),
                            "pixel_values_videos": result["pixel_values_videos"]})
            print(kind, settings, size, entries[-1]["video_grid_thw"])
        out[kind] = entries
    os.makedirs(os.path.dirname(FIXTURE), exist_ok=True)
    torch.save(out, FIXTURE)
    print("wrote", FIXTURE, os.path.getsize(FIXTURE), "bytes")


if __name__ == "__main__":
    main()
