"""Modality projector: pixel shuffle of the vision tower's patch grid, then a map to the decoder width."""

from __future__ import annotations

import math

import torch
from torch import nn

PROJECTOR_TYPES = ("linear", "mlp")


def pixel_shuffle(x: torch.Tensor, factor: int) -> torch.Tensor:
    """[B, g*g, D] -> [B, (g/f)^2, D*f^2]: each f x f block of neighbouring patches becomes one token.

    Row-major over the output grid; inside a token the block's patches are concatenated row-major
    (the layout nanoVLM uses), so a factor of 1 is the identity.
    """
    b, n, d = x.shape
    g = math.isqrt(n)
    if g * g != n:
        raise ValueError(f"pixel_shuffle needs a square patch grid, got {n} patches (not a perfect square).")
    if g % factor:
        raise ValueError(
            f"pixel_shuffle_factor={factor} does not divide the {g}x{g} patch grid ({n} patches); "
            f"choose a factor that divides {g}."
        )
    h = g // factor
    x = x.reshape(b, h, factor, h, factor, d)  # (row block, row in block, col block, col in block)
    x = x.permute(0, 1, 3, 2, 4, 5)
    return x.reshape(b, h * h, d * factor * factor)


def image_places(is_image: torch.Tensor, image_token_length: int) -> torch.Tensor:
    """The place (0, 1, 2, ...) of each image in its sample, in order of appearance (row-major, as the images
    are spliced in): a sample's images are one run of image tokens, ``image_token_length`` per image."""
    idx = torch.arange(is_image.shape[-1], device=is_image.device).expand_as(is_image)
    last_text = torch.where(is_image, -1, idx).cummax(-1).values
    offset = idx - last_text - 1  # position inside the run of image tokens
    return offset[is_image & (offset % image_token_length == 0)] // image_token_length


class ModalityProjector(nn.Module):
    """Pixel shuffle by ``factor`` then a linear map (``"linear"``, no bias as in nanoVLM) or a 2-layer
    GELU MLP (``"mlp"``) from ``vision_hidden * factor^2`` to ``text_hidden``.

    With ``image_index_embeddings`` > 0, ``image_index`` holds that many learned vectors (zero at init), added
    to every token of a sample's first, second, ... image (later images share the last): what tells a
    sample's images apart, where otherwise only their text positions do."""

    def __init__(self, vision_hidden: int, text_hidden: int, factor: int = 1, projector_type: str = "linear",
                 image_index_embeddings: int = 0):
        super().__init__()
        if image_index_embeddings < 0:
            raise ValueError(f"image_index_embeddings must be >= 0, got {image_index_embeddings}.")
        if factor < 1:
            raise ValueError(f"pixel_shuffle_factor must be >= 1, got {factor}.")
        if projector_type not in PROJECTOR_TYPES:
            raise ValueError(f"projector_type={projector_type!r} is not one of {PROJECTOR_TYPES}.")
        self.factor = factor
        self.projector_type = projector_type
        in_dim = vision_hidden * factor * factor
        if projector_type == "linear":
            self.proj = nn.Linear(in_dim, text_hidden, bias=False)
        else:
            self.proj = nn.Sequential(nn.Linear(in_dim, text_hidden), nn.GELU(), nn.Linear(text_hidden, text_hidden))
        # _weight: built without a random draw, so the rest of the model initialises as it would without it
        self.image_index = (nn.Embedding(image_index_embeddings, text_hidden,
                                         _weight=torch.zeros(image_index_embeddings, text_hidden))
                             if image_index_embeddings else None)

    def reset_image_index(self) -> None:
        """Zero the image-index vectors: a new model starts as one without them."""
        if self.image_index is not None:
            nn.init.zeros_(self.image_index.weight)

    def add_image_index(self, images: torch.Tensor, is_image: torch.Tensor, image_token_length: int) -> torch.Tensor:
        """[N, tokens, text_hidden] image embeddings + each image's place vector, the places read from the
        image-token mask ``is_image`` (:func:`image_places`); unchanged without image-index vectors."""
        if self.image_index is None:
            return images
        places = image_places(is_image, image_token_length).clamp(max=self.image_index.num_embeddings - 1)
        return images + self.image_index(places).unsqueeze(1).to(images.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[B, g*g, vision_hidden] -> [B, (g/f)^2, text_hidden]."""
        return self.proj(pixel_shuffle(x, self.factor))
