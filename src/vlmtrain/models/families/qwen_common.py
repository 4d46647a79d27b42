"""What Qwen3-VL and Qwen2.5-VL share: tokens, the image-only processor, the tiny tokenizer and builder.

Both families use ChatML with ``<|vision_start|><|image_pad|><|vision_end|>`` per image; the processor
expands ``<|image_pad|>`` to one token per merged patch and returns ``pixel_values`` (all patches of all
images, concatenated), ``image_grid_thw`` ([n_images, 3]) and ``mm_token_type_ids`` (1 on image tokens).

Image size: the image processor resizes each image (``smart_resize``) to sides that are multiples of
``factor = patch_size * merge_size`` with a pixel count within ``size = {"shortest_edge": min_pixels,
"longest_edge": max_pixels}``, so an image becomes at most ``max_pixels / factor**2`` image tokens.
:func:`set_image_size` sets that range from ``data.max_pixels`` / ``min_pixels`` / ``max_image_tokens``
(tokens x factor**2 pixels); by default it caps an image at :data:`DEFAULT_MAX_IMAGE_TOKENS` image tokens (or
the checkpoint's own max_pixels, if smaller). A Qwen3-VL checkpoint (patch 16, merge 2) itself allows 16.7 MP
= 16,384 tokens per image: two 1080p images would be 4,080 tokens; under the default cap they are 1,008 each.
"""

from __future__ import annotations

import functools
import os
import types
from collections.abc import Callable
from typing import Any

import torch

IM_START, IM_END, ENDOFTEXT = "<|im_start|>", "<|im_end|>", "<|endoftext|>"
VISION_START, VISION_END, IMAGE_PAD = "<|vision_start|>", "<|vision_end|>", "<|image_pad|>"
VISION_PAD, VIDEO_PAD = "<|vision_pad|>", "<|video_pad|>"
# Order fixes the ids after the 256 byte-level tokens: <|endoftext|> = 256, ...
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END, VISION_START, VISION_END, VISION_PAD, IMAGE_PAD, VIDEO_PAD)
TINY_VOCAB = 256 + len(SPECIAL_TOKENS) + 8  # a little slack, as real checkpoints have
DEFAULT_MAX_IMAGE_TOKENS = 1024
"""Image tokens per image unless data.max_pixels / max_image_tokens say otherwise."""

# Batch layout shared by both: pixels of every image concatenated in placeholder order, one grid row per image,
# the multimodal token types padded like input_ids.
QWEN_BATCH_LAYOUT = {"pixel_values": "concat", "image_grid_thw": "concat", "mm_token_type_ids": "pad"}


def image_tokens(config: Any, batch: Any) -> list[tuple[int, int]]:
    """(patches, image tokens) per image: t*h*w patches of ``image_grid_thw``, merged spatial_merge_size^2 to 1."""
    grid = batch.get("image_grid_thw")
    merge = config.vision_config.spatial_merge_size ** 2
    return [] if grid is None else [(t * h * w, t * h * w // merge) for t, h, w in grid.tolist()]


def rope_positions(module: str, class_name: str, config: Any, item: Any) -> torch.Tensor:
    """One processed sample's multimodal rotary positions [3, L] (temporal, height, width), computed for the
    sample alone by the model's own ``get_rope_index`` (class ``class_name`` of ``module``; called without
    weights, it reads only ``config``), as the model computes them for an unpacked sample. A family binds
    module and class with functools.partial (picklable, for data-loader workers)."""
    import importlib

    cls = getattr(importlib.import_module(module), class_name)
    index = types.SimpleNamespace(config=config)
    index.get_vision_position_ids = functools.partial(cls.get_vision_position_ids, index)
    ids = torch.as_tensor(item["input_ids"]).reshape(1, -1)
    token_types = torch.as_tensor(item["mm_token_type_ids"]).reshape(1, -1)
    grid = item.get("image_grid_thw")
    pos, _ = cls.get_rope_index(index, ids, mm_token_type_ids=token_types,
                                image_grid_thw=None if grid is None else torch.as_tensor(grid).reshape(-1, 3))
    return pos[:, 0]


def set_image_size(processor: Any, max_pixels: int | None = None, min_pixels: int | None = None,
                   max_image_tokens: int | None = None) -> None:
    """Set the Qwen image processor's resize range (``size``) in place: ``max_pixels`` (or ``max_image_tokens``
    x factor**2; default: the smaller of the checkpoint's own and DEFAULT_MAX_IMAGE_TOKENS x factor**2) and
    ``min_pixels`` (default: the checkpoint's own, lowered to max_pixels if above it). The processor saved
    with a checkpoint keeps the range, so inference resizes as training did."""
    from transformers.image_utils import SizeDict

    from ...errors import ConfigError

    ip = processor.image_processor
    factor = ip.patch_size * ip.merge_size
    own_min, own_max = ip.size["shortest_edge"], ip.size["longest_edge"]
    if max_image_tokens is not None:
        max_pixels = max_image_tokens * factor**2
    elif max_pixels is None:
        max_pixels = min(own_max, DEFAULT_MAX_IMAGE_TOKENS * factor**2)
    if max_pixels < factor**2:
        raise ConfigError(f"data.max_pixels / max_image_tokens: {max_pixels} pixels is less than one image token "
                          f"({factor}x{factor} = {factor**2} pixels for this checkpoint).")
    if min_pixels is None:
        min_pixels = min(own_min, max_pixels)
    elif min_pixels > max_pixels:
        raise ConfigError(f"data.min_pixels={min_pixels} is above the max_pixels of {max_pixels} "
                          f"(data.max_pixels / max_image_tokens, or the default cap).")
    ip.size = SizeDict(shortest_edge=int(min_pixels), longest_edge=int(max_pixels))


def special_token_ids() -> dict[str, int]:
    """Token -> id in the tiny tokenizer (:func:`build_tiny_tokenizer`)."""
    return {tok: 256 + i for i, tok in enumerate(SPECIAL_TOKENS)}


def build_tiny_tokenizer(chat_template: str) -> Any:
    """A byte-level tokenizer (256 byte tokens, no merges) plus Qwen's special tokens, built offline.

    Like Qwen's own: pad ``<|endoftext|>``, eos ``<|im_end|>``, no bos, ``image_token`` ``<|image_pad|>``.
    """
    from tokenizers import Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    # bytes_to_unicode order is irrelevant for a tiny model; sort so ids are deterministic.
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=ENDOFTEXT, eos_token=IM_END, bos_token=None, unk_token=None,
        extra_special_tokens={"image_token": IMAGE_PAD, "video_token": VIDEO_PAD,
                              "vision_start_token": VISION_START, "vision_end_token": VISION_END},
        padding_side="right", clean_up_tokenization_spaces=False, model_max_length=32768,
    )
    tokenizer.chat_template = chat_template
    ids = special_token_ids()
    assert all(tokenizer.convert_tokens_to_ids(t) == i for t, i in ids.items()), "special token ids moved"
    return tokenizer


def image_only_processor_class(base: type) -> type:
    """A subclass of a Qwen processor class that takes no video processor (which would need torchvision); it
    saves under the real class's name (see :class:`~vlmtrain.models.families.base.SavedAsRealClass`)."""
    from .base import saved_as_real_class


    class ImageOnlyProcessor(base):  # type: ignore[misc, valid-type]
        __doc__ = f"{base.__name__} with an image processor and a tokenizer only (no video processor)."

        def __init__(self, image_processor: Any = None, tokenizer: Any = None, chat_template: str | None = None,
                     **kwargs: Any) -> None:
            super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)

    ImageOnlyProcessor.__name__ = ImageOnlyProcessor.__qualname__ = f"ImageOnly{base.__name__}"
    return saved_as_real_class(ImageOnlyProcessor)  # saved as {base.__name__}: AutoProcessor loads the real one


def load_image_only_processor(path: str, processor_class: type) -> Any:
    """Image processor (PIL backend, never torchvision) + tokenizer + the checkpoint's chat template.

    ``path`` is a Hub id or a local directory; AutoProcessor is not used (on a checkpoint without a video
    processor it returns a bare tokenizer, and with one it needs torchvision).
    """
    from transformers import AutoImageProcessor, AutoTokenizer

    image_processor = AutoImageProcessor.from_pretrained(path, backend="pil")
    tokenizer = AutoTokenizer.from_pretrained(path)
    # The processor's own template file first (what the model card uses), then the tokenizer's.
    template = _processor_chat_template(path) or getattr(tokenizer, "chat_template", None)
    if template is None:
        from ...errors import ConfigError

        raise ConfigError(f"{path}: no chat template found (tokenizer_config.json / chat_template.jinja / "
                          f"chat_template.json); a Hub VLM checkpoint needs its chat template.")
    processor = processor_class(image_processor=image_processor, tokenizer=tokenizer, chat_template=template)
    processor.source = path  # (its video processor settings go along when saved: SavedAsRealClass)
    return processor


def _processor_chat_template(path: str) -> str | None:
    """The chat template a processor saved on its own (chat_template.jinja or chat_template.json)."""
    import json

    for name in ("chat_template.jinja", "chat_template.json"):
        local = os.path.join(path, name)
        if not os.path.isdir(path):
            try:
                from huggingface_hub import hf_hub_download

                local = hf_hub_download(path, name)
            except Exception:  # noqa: BLE001 - the file is optional on the Hub
                continue
        if os.path.isfile(local):
            with open(local) as f:
                text = f.read()
            return json.loads(text)["chat_template"] if name.endswith(".json") else text
    return None


def save_tiny(out_dir: str, model_class: type, config: Any, processor: Any, seed: int) -> str:
    """Random-init ``model_class(config)`` with ``seed``, then save model and processor to ``out_dir``."""
    torch.manual_seed(seed)
    model = model_class(config).eval()
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir)
    processor.image_processor.save_pretrained(out_dir)
    processor.tokenizer.save_pretrained(out_dir)
    with open(os.path.join(out_dir, "chat_template.jinja"), "w") as f:
        f.write(processor.tokenizer.chat_template)
    return out_dir


def tiny_image_processor(patch_size: int, merge_size: int, mean: tuple[float, ...], std: tuple[float, ...]) -> Any:
    """A PIL Qwen image processor for tiny images: a 32 px image -> (32 / patch)^2 / merge^2 tokens."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    factor = patch_size * merge_size
    return Qwen2VLImageProcessorPil(
        patch_size=patch_size, merge_size=merge_size, temporal_patch_size=2, image_mean=list(mean),
        image_std=list(std), size={"shortest_edge": factor * factor, "longest_edge": 4 * factor * factor * 4},
    )


def text_ids(vocab_size: int = TINY_VOCAB) -> dict[str, int]:
    """The special-token ids every tiny Qwen config sets explicitly (so no real-model id leaks in)."""
    ids = special_token_ids()
    return {"image_token_id": ids[IMAGE_PAD], "video_token_id": ids[VIDEO_PAD],
            "vision_start_token_id": ids[VISION_START], "vision_end_token_id": ids[VISION_END],
            "pad_token_id": ids[ENDOFTEXT], "eos_token_id": ids[IM_END], "bos_token_id": ids[ENDOFTEXT],
            "vocab_size": vocab_size}


TinyBuilder = Callable[..., str]
