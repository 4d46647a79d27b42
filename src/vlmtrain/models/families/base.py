"""The record a Hub VLM family provides: what vlmtrain needs to know that the model's own code does not say.

The model's processor and code do token expansion and pixel handling; a family only adds a training chat
template (with ``{% generation %}`` markers), how each processor output is batched, which parameter names
make up the ``vision`` / ``projector`` / ``text`` groups, how to bound its image size (where the checkpoint
does not fix it), and a builder of a tiny random-init checkpoint for offline tests.
"""

from __future__ import annotations

import os
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
    logged tflops_per_second (trainer/flops.py); with ``windowed_attention``, a third value per image: its
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
    extra: Mapping[str, Any] = field(default_factory=dict)
    """Anything else a family needs to say (documented in its module)."""


class SavedAsRealClass:
    """Mixin for vlmtrain's image-only processor subclasses: ``save_pretrained`` names the transformers class
    they derive from (e.g. ``Qwen3VLProcessor``) in processor_config.json and tokenizer_config.json, so
    ``transformers.AutoProcessor.from_pretrained(dir)`` builds the real processor (its video processor needs
    torchvision installed) instead of falling back to a bare tokenizer. vlmtrain's own loaders
    (``Family.load_processor``) still build the image-only class, without torchvision."""

    saved_class_name: str = ""
    """The transformers processor class written into the saved files."""

    def to_dict(self) -> dict[str, Any]:
        out = super().to_dict()  # type: ignore[misc]
        out["processor_class"] = self.saved_class_name
        return out

    source: str | None = None
    """Where the processor was loaded from (a directory or Hub id; set by the family's load_processor): its
    video_preprocessor_config.json, if it has one, is copied along on save, so the real class finds its video
    processor's settings."""

    def save_pretrained(self, save_directory: str, *args: Any, **kwargs: Any) -> Any:
        files = super().save_pretrained(save_directory, *args, **kwargs)  # type: ignore[misc]
        _rename_processor_class(os.path.join(save_directory, "tokenizer_config.json"), self.saved_class_name)
        video = _video_config(self.source) if self.source else None
        target = os.path.join(save_directory, VIDEO_CONFIG)
        if video is not None and os.path.abspath(video) != os.path.abspath(target):
            import shutil

            shutil.copyfile(video, target)
        return files


VIDEO_CONFIG = "video_preprocessor_config.json"


def _video_config(source: str) -> str | None:
    """The video processor config file of a checkpoint directory or Hub id, if it has one."""
    if os.path.isdir(source):
        path = os.path.join(source, VIDEO_CONFIG)
        return path if os.path.isfile(path) else None
    try:
        from huggingface_hub import hf_hub_download

        return hf_hub_download(source, VIDEO_CONFIG)
    except Exception:  # noqa: BLE001 - optional on the Hub (and no network offline)
        return None


def saved_as_real_class(cls: type) -> type:
    """``cls`` (a subclass of a transformers processor class) saving under its first transformers base's name."""
    real = next(b for b in cls.__mro__[1:] if b.__module__.startswith("transformers."))
    return type(cls.__name__, (SavedAsRealClass, cls), {"saved_class_name": real.__name__,
                                                       "__doc__": cls.__doc__, "__module__": cls.__module__})


def _rename_processor_class(path: str, name: str) -> None:
    import json

    if not os.path.isfile(path):
        return
    with open(path, encoding="utf-8") as f:
        config = json.load(f)
    if config.get("processor_class") not in (None, name):
        config["processor_class"] = name
        with open(path, "w", encoding="utf-8") as f:
            json.dump(config, f, indent=2, ensure_ascii=False)
            f.write("\n")
