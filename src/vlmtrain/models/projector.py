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


class ModalityProjector(nn.Module):
    """Pixel shuffle by ``factor`` then a linear map (``"linear"``, no bias as in nanoVLM) or a 2-layer
    GELU MLP (``"mlp"``) from ``vision_hidden * factor^2`` to ``text_hidden``."""

    def __init__(self, vision_hidden: int, text_hidden: int, factor: int = 1, projector_type: str = "linear"):
        super().__init__()
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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[B, g*g, vision_hidden] -> [B, (g/f)^2, text_hidden]."""
        return self.proj(pixel_shuffle(x, self.factor))
