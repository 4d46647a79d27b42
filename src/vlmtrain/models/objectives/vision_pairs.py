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

from ...data.preference_vision import VISION_PREFIX


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


def with_pair_images(model: nn.Module, inputs: Mapping[str, Any]) -> dict[str, Any]:
    """``inputs`` for ``model``'s forward over the 2B rows: the ``vision_*`` pixel inputs encoded once by
    ``model.get_image_features`` and given per row as ``mm_encoder_outputs``; a batch without images as it is
    (minus the bookkeeping keys)."""
    out = {k: v for k, v in inputs.items() if not k.startswith(VISION_PREFIX) and k != "image_token_index"}
    encoder = {k[len(VISION_PREFIX):]: v for k, v in inputs.items() if k.startswith(VISION_PREFIX)}
    if not encoder:
        return out
    index = inputs["image_token_index"]
    encoded = model.get_image_features(**encoder, return_dict=True)
    encoded.pooler_output = _pick(encoded.pooler_output, index)
    if getattr(encoded, "deepstack_features", None) is not None:  # (Qwen3-VL: per layer, per image)
        encoded.deepstack_features = [_pick(layer, index) for layer in encoded.deepstack_features]
    out["mm_encoder_outputs"] = {"image": encoded}
    return out
