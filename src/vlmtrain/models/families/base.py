"""The record a Hub VLM family provides: what vlmtrain needs to know that the model's own code does not say.

The model's processor and code do token expansion and pixel handling; a family only adds a training chat
template (with ``{% generation %}`` markers), how each processor output is batched, which parameter names
make up the ``vision`` / ``projector`` / ``text`` groups, how to bound its image size (where the checkpoint
does not fix it), its smallest valid image (what the vision tower runs on, adding zero, when a rank's batch has
none) and a builder of a tiny random-init checkpoint for offline tests.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

# How one processor output key is batched over samples:
#   "pad"        [L] per sample -> [B, L_max], padded like input_ids (value from Family.pad_values, default 0)
#   "concat"     [N_i, ...] per sample -> [sum N_i, ...], concatenated in sample (= placeholder) order
#   "pad_images" [N_i, ...] per sample -> [B, max N_i, ...], zero-padded per sample
#   "stack"      [...] per sample -> [B, ...]
#   a callable   list of per-sample tensors -> the batched tensor (for layouts none of the above fits)
Layout = Literal["pad", "concat", "pad_images", "stack"] | Callable[[list[torch.Tensor]], torch.Tensor]


@dataclass(frozen=True)
class Family:
    """One Hub VLM family (e.g. Qwen3-VL): the record vlmtrain keeps per family, one module per family."""

    name: str
    """Short name, e.g. 'qwen3_vl'."""
    model_types: tuple[str, ...]
    """config.json model_type values this family handles."""
    training_template: str
    """The checkpoint's chat template with {% generation %}...{% endgeneration %} around each assistant
    reply (and its end-of-turn token); markers removed it must render byte-identically to the original."""
    end_of_turn: str
    """The token that ends an assistant turn (a stop token for generation), e.g. '<|im_end|>'."""
    batch_layout: Mapping[str, Layout]
    """Processor output key -> how it is batched (see Layout). input_ids, attention_mask and labels are
    always 'pad' and need not be listed."""
    module_groups: Mapping[str, tuple[str, ...]]
    """'vision' / 'projector' / 'text' -> parameter-name prefixes in the transformers model."""
    text_module: str
    """Dotted name of the language model inside the transformers model (LoRA's default targets live here)."""
    load_processor: Callable[[str], Any]
    """Hub id or directory -> an image-only processor (image processor + tokenizer + chat template; never a
    video processor, so torchvision is not needed)."""
    build_tiny: Callable[..., str]
    """build_tiny(out_dir, seed=0) -> out_dir: writes a tiny random-init model and its processor with
    save_pretrained, offline (tests, the demo, benchmarks)."""
    image_tokens: Callable[[Any, Mapping[str, Any]], list[tuple[int, int]]] | None = None
    """image_tokens(model config, batch) -> (patches the vision tower attends over, tokens the projector emits)
    per image of the batch (a crop or tile counts as an image when the vision tower sees it alone), for the
    logged tflops_per_second (models/speed/flops.py); with ``windowed_attention``, a third value per image: its
    query-key pairs in one windowed layer. None: not counted (no tflops for this family)."""
    windowed_attention: Callable[[Any], tuple[str, ...]] | None = None
    """windowed_attention(model config) -> names of the vision attention modules that attend within windows of an
    image rather than over all of it (Qwen2.5-VL), for the FLOP count. None: every vision layer attends over the
    whole image."""
    matmul_parameters: tuple[str, ...] = ()
    """Parameters applied as a matmul weight outside nn.Linear / nn.Conv modules (Gemma 3's projector weight),
    for the FLOP count."""
    image_size: Callable[[Any, int | None, int | None, int | None], None] | None = None
    """image_size(processor, max_pixels, min_pixels, max_image_tokens) bounds, in place, how large the
    processor resizes each image (``data.max_pixels`` / ``min_pixels`` / ``max_image_tokens``; None: the
    family's default). None: this family's image size is fixed by the checkpoint (a fixed view size or a
    bounded tiling) and those keys do not apply."""
    rope_positions: Callable[[Any, Mapping[str, Any]], torch.Tensor] | None = None
    """rope_positions(model config, one processed sample) -> that sample's multimodal rotary positions [3, L],
    as the model computes them for the sample alone (Qwen's ``get_rope_index``). Packing concatenates them per
    row under a text-position row that restarts at 0 per sample (position_ids [4, rows, L]). None: the model
    takes ordinary 1-D positions, restarting per packed sample."""
    packing_unsupported: str | None = None
    """Why this family's samples cannot be packed (data.packing: true is then a ConfigError with this reason);
    None: they can."""
    pad_values: Mapping[str, int | float] = field(default_factory=dict)
    """Padding value per 'pad' key (input_ids: the tokenizer's pad id is used; labels: -100; others 0)."""
    dummy_image: Callable[[Any], dict[str, torch.Tensor]] | None = None
    """dummy_image(model config) -> the family's smallest valid image input, as ``get_image_features``' keyword
    arguments (CPU tensors): what the vision tower and projector run on, with a zero contribution, when a
    micro-batch has no image and several processes train, so every rank runs the same collectives
    (models/vision/dummy_vision.py). None: the vision tower runs only on real images (one process only: not safe
    under DDP / FSDP with text-only micro-batches)."""
    dummy_video: Callable[[Any], dict[str, torch.Tensor]] | None = None
    """dummy_video(model config) -> the family's smallest valid video input, as ``get_video_features``' keyword
    arguments, for a family whose model encodes videos in a vision tower call of their own: under several
    processes a micro-batch without a video encodes it (models/vision/dummy_vision.py), so every rank makes the same
    vision tower calls whatever mix of images, videos and text it holds. None: the family takes no videos."""
    unused_parameters: Callable[[Any], tuple[str, ...]] | None = None
    """unused_parameters(model config) -> name prefixes of parameters no forward of the model ever uses (e.g. a
    vision tower's final norm when the model takes an earlier layer's output): frozen at load, since they never
    get a gradient and DDP (without ``ddp_find_unused_parameters``) refuses a trainable parameter that gets
    none. None: every parameter is used."""
    video: Callable[[Any, Any], Any] | None = None
    """video(processor, settings) -> this checkpoint's video support for ``data.video_*`` settings
    (:class:`~vlmtrain.data.video.VideoSettings`): an object with ``choose(info)`` (the frame indices to decode),
    ``plan(info)`` (frames, size and video tokens) and ``attach(processor)`` (a copy of the processor that
    expands video tokens and makes the video pixels), as :class:`~vlmtrain.models.families.qwen_video.QwenVideo`.
    None: the family refuses video (a sample with videos is skipped as ``video_unsupported``, naming it)."""
    extra: Mapping[str, Any] = field(default_factory=dict)
    """Anything else a family needs to say (documented in its module)."""


def pad_crops_and_concat(per_sample: list[torch.Tensor]) -> torch.Tensor:
    """A Layout for images cut into crops: [n_i, crops_i, C, H, W] per sample -> [sum n_i, max crops, C, H, W],
    crops zero-padded, images concatenated in sample order (LLaVA-OneVision's processor's batched output)."""
    per_sample = [t for t in per_sample if t is not None and t.numel() > 0]
    crops = max(t.shape[1] for t in per_sample)
    padded = [torch.nn.functional.pad(t, (0, 0) * (t.dim() - 2) + (0, crops - t.shape[1])) for t in per_sample]
    return torch.cat(padded, dim=0)
