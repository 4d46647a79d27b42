"""What the dummy image costs: a text-only training step with and without it, against a step with one real image.

Under several processes a micro-batch without images runs the vision tower and projector on the family's
smallest valid image (models/vision/dummy_vision.py), so every rank runs the same collectives. This times, in one
process with the dummy path forced on or off, forward + backward (loss_only, as the Trainer calls it) of:

  text           one text-only sample, the dummy off (what one process runs)
  text + dummy   the same sample, the dummy on (what a text-only rank runs under DDP / FSDP)
  image          the same text with one real image of --image-size pixels a side (Qwen: 128 px = 16 x 16 patches of 8 px)

for a tiny random-init Qwen3-VL (the qwen3_vl family's build_tiny: vision 2 blocks of hidden 32, text 2 layers of
64), a small one (vision 4 blocks of hidden 256, text 4 layers of 256; both patch 8, merge 2; the dummy: one 2 x 2
patch grid = 1 image token) and vlmtrain's own tiny VLM (SigLIP 32 px + Llama; the dummy: one blank 32 px image,
as big as any of its images). Rounds alternate the three; the table gives medians, the dummy's cost (text + dummy - text) and a real
image's (image - text), and the patches each runs through the vision tower.

    python benchmarks/dummy_vision.py                  # CPU, one thread, about a minute
    python benchmarks/dummy_vision.py --rounds 50 --image-size 256
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from typing import Any

import numpy as np
import torch
from PIL import Image

from vlmtrain.models.vision import dummy_vision

TEXT = {"user": "Describe the picture in a few words, please.", "assistant": "A small random picture."}


def _step(model: torch.nn.Module, batch: dict[str, Any]) -> float:
    start = time.perf_counter()
    model(**batch, loss_only=True)["loss"].backward()
    elapsed = time.perf_counter() - start
    model.zero_grad(set_to_none=True)
    return elapsed


def _time(model: torch.nn.Module, contenders: dict[str, tuple[dict[str, Any], bool]], rounds: int) -> dict[str, float]:
    """Median ms of each contender's (batch, dummy on?) step, alternating, after 3 warm-up rounds."""
    times: dict[str, list[float]] = {name: [] for name in contenders}
    own_zero = getattr(model, "_dummy_image_zero", None)
    for i in range(rounds + 3):
        for name, (batch, dummy) in contenders.items():
            dummy_vision.needed = (lambda on=dummy: on)  # (Hub VLMs)
            if own_zero is not None:  # (the own VLM runs it in any training step)
                model._dummy_image_zero = own_zero if dummy else (lambda embeds: embeds.new_zeros(()))
            elapsed = _step(model, batch)
            if i >= 3:
                times[name].append(elapsed)
    dummy_vision.needed = _NEEDED
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def _image(size: int) -> Image.Image:
    rng = np.random.default_rng(0)
    return Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8), "RGB")


def _build_qwen(out_dir: str, small: bool) -> str:
    """The family's tiny Qwen3-VL, or with ``small`` one with a 4-block vision tower of hidden 256 and a 4-layer
    text model of hidden 256 (patch 8, merge 2 as the tiny one)."""
    from vlmtrain.models.families import get_family, qwen3_vl
    from vlmtrain.models.families import qwen_common as qwen
    from vlmtrain.models.families.templates.qwen3_vl import CHAT_TEMPLATE

    if not small:
        return get_family("qwen3_vl").build_tiny(out_dir, seed=0)
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [16, 8, 8], "mrope_interleaved": True}
    config = qwen.tiny_config("Qwen3VLConfig", {"hidden_size": 256, "intermediate_size": 1024, "num_hidden_layers": 4,
                                                "head_dim": 64, "rope_parameters": rope},
                              {"depth": 4, "hidden_size": 256, "intermediate_size": 1024, "num_heads": 4,
                               "out_hidden_size": 256, "num_position_embeddings": 1024,
                               "deepstack_visual_indexes": [1]})
    return qwen.build_tiny(out_dir, 0, qwen3_vl.processor_class, "Qwen3VLForConditionalGeneration", config,
                           CHAT_TEMPLATE, (0.5,) * 3, (0.5,) * 3)


def qwen(image_size: int, rounds: int, small: bool) -> tuple[dict[str, float], int, int]:
    """(ms per contender, dummy patches, real image patches) for the tiny (or small) Qwen3-VL."""
    from vlmtrain.data.hub_collate import HubVLMCollator
    from vlmtrain.data.hub_processing import HubVLMProcessor
    from vlmtrain.models.families import get_family
    from vlmtrain.models.hub.hub_loading import load_model

    family = get_family("qwen3_vl")
    with tempfile.TemporaryDirectory() as tmp:
        path = _build_qwen(tmp, small)
        model = load_model(path).train()
        processor = family.load_processor(path)
    family.image_size(processor, image_size * image_size, None, None)  # (the image keeps its size)
    hub = HubVLMProcessor(processor, family, max_length=1 << 16, max_images=1, prompts=False)
    collate = HubVLMCollator(hub, label_collate=lambda raw: {})

    def batch(images: list[Image.Image]) -> dict[str, Any]:
        out = collate([hub.process({"images": images, "texts": [TEXT]})])
        return {k: v for k, v in out.items() if isinstance(v, torch.Tensor)}

    text, image = batch([]), batch([_image(image_size)])
    ms = _time(model, {"text": (text, False), "text + dummy": (text, True), "image": (image, False)}, rounds)
    dummy = family.dummy_image(model.config)["image_grid_thw"].prod().item()
    return ms, int(dummy), int(image["image_grid_thw"].prod().item())


def own_vlm(rounds: int) -> tuple[dict[str, float], int, int]:
    """(ms per contender, dummy patches, real image patches) for vlmtrain's own tiny VLM."""
    from vlmtrain.models.own_vlm.vlm import VisionLanguageModel, VLMConfig

    torch.manual_seed(0)
    vision = {"model_type": "siglip_vision_model", "image_size": 32, "patch_size": 8, "hidden_size": 32,
              "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2}
    text = {"model_type": "llama", "vocab_size": 128, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
    config = VLMConfig(vision_config=vision, text_config=text, pixel_shuffle_factor=2, image_token_id=127)
    model = VisionLanguageModel(config).train()
    length = config.image_token_length
    ids = torch.randint(0, 120, (1, 40))
    with_image = torch.cat([torch.full((1, length), 127), ids], dim=1)
    text_batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
    image_batch = {"input_ids": with_image, "attention_mask": torch.ones_like(with_image),
                   "labels": with_image.masked_fill(with_image == 127, -100), "pixel_values": torch.randn(1, 3, 32, 32)}
    # ("text": the step without the dummy, which the own VLM runs in one process's training too)
    ms = _time(model, {"text": (text_batch, False), "text + dummy": (text_batch, True),
                       "image": (image_batch, False)}, rounds)
    patches = (32 // 8) ** 2
    return ms, patches, patches


_NEEDED = dummy_vision.needed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--image-size", type=int, default=128, help="the real image's side in pixels (Qwen)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, CPU, float32, one thread; medians of {args.rounds} forward + backward")
    runs = (("tiny Qwen3-VL", lambda: qwen(args.image_size, args.rounds, small=False)),
            ("small Qwen3-VL", lambda: qwen(args.image_size, args.rounds, small=True)),
            ("own tiny VLM", lambda: own_vlm(args.rounds)))
    for name, measure in runs:
        ms, dummy_patches, image_patches = measure()
        dummy, image = ms["text + dummy"] - ms["text"], ms["image"] - ms["text"]
        print(f"{name}: text {ms['text']:.2f} ms, text + dummy {ms['text + dummy']:.2f} ms, "
              f"image {ms['image']:.2f} ms")
        print(f"  dummy +{dummy:.2f} ms ({100 * dummy / ms['text']:.0f}% of a text-only step, {dummy_patches} "
              f"patches); one real image +{image:.2f} ms ({image_patches} patches); dummy / image "
              f"{dummy / image:.2f}" if image > 0 else "")


if __name__ == "__main__":
    main()
