"""One vision pass per preference pair: the images of a pair batch (data/preference_vision.py) are encoded once,
and each of the 2B rows (chosen and rejected) gets its prompt's features.

A transformers VLM's forward takes features computed outside it as ``mm_encoder_outputs={"image": <the output
of get_image_features>}`` (no pixel values) and scatters them over the image placeholder tokens in order; so
:func:`with_pair_images` calls ``get_image_features`` on the B prompts' pixel inputs, flattens the features to
one row per feature token, picks the rows' tokens by the batch's ``image_token_index`` (a chosen row and its
rejected row pick the same ones: their gradients meet in the one encoding) and hands them over in the layout
the forward reads (Qwen3-VL's deepstack features likewise). The language model still gets each row's own
``image_grid_thw`` from the batch, for Qwen's multimodal rotary positions.

Several processes: a rank whose batch has no image makes no call here and the model's forward runs its dummy
image (models/dummy_vision.py); a rank with images makes this one call, and its forward, which sees
``mm_encoder_outputs`` as its own images, runs no dummy image (a family with a dummy video runs that one on
every rank alike). Every rank thus makes the same vision tower calls in the same order (the images' first,
then the text model's), for the policy and for the reference.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ...data.preference_vision import VIDEO_PREFIX, VISION_PREFIX


def _flat(features: Any) -> torch.Tensor:
    """Features of all images as [tokens, hidden] in placeholder order (a tensor per image, or one tensor)."""
    if isinstance(features, torch.Tensor):
        return features.reshape(-1, features.shape[-1])
    return torch.cat([f.reshape(-1, f.shape[-1]) for f in features], dim=0)


def _pick(features: Any, index: torch.Tensor) -> Any:
    """The rows' feature tokens, in the container the forward reads: a sequence it concatenates, or a tensor of
    the same rank (Gemma 3 counts [images, tokens, hidden] features as images x tokens)."""
    picked = _flat(features).index_select(0, index)
    if not isinstance(features, torch.Tensor):
        return (picked,)
    return picked.reshape((1,) * (features.dim() - 2) + tuple(picked.shape))


def _encoded(features: Any, index: torch.Tensor) -> Any:
    """``features`` (an encoder's output) with the rows' feature tokens picked by ``index``."""
    features.pooler_output = _pick(features.pooler_output, index)
    if getattr(features, "deepstack_features", None) is not None:  # (Qwen3-VL: per layer, per image)
        features.deepstack_features = [_pick(layer, index) for layer in features.deepstack_features]
    return features


def with_pair_images(model: nn.Module, inputs: Mapping[str, Any]) -> dict[str, Any]:
    """``inputs`` for ``model``'s forward over the 2B rows: the ``vision_*`` pixel inputs encoded once by
    ``model.get_image_features`` (the ``videos_*`` ones by ``model.get_video_features``) and given per row as
    ``mm_encoder_outputs``; a batch without images or videos as it is (minus the bookkeeping keys)."""
    out = {k: v for k, v in inputs.items() if not k.startswith((VISION_PREFIX, VIDEO_PREFIX))
           and k not in ("image_token_index", "video_token_index")}
    encoded = {}
    for kind, prefix, encode in (("image", VISION_PREFIX, "get_image_features"),
                                 ("video", VIDEO_PREFIX, "get_video_features")):
        encoder = {k[len(prefix):]: v for k, v in inputs.items() if k.startswith(prefix)}
        if encoder:
            features = getattr(model, encode)(**encoder, return_dict=True)
            encoded[kind] = _encoded(features, inputs[f"{kind}_token_index"])
    if encoded:
        out["mm_encoder_outputs"] = encoded
    return out
