"""Patch embeddings as one matmul: a Conv3d whose kernel equals its stride is a Linear over flattened patches.

Qwen2.5-VL and Qwen3-VL embed each ``temporal_patch_size x patch_size x patch_size`` patch with an
``nn.Conv3d`` whose stride equals its kernel, applied to patches that are exactly one kernel each. That is
a matrix product of the flattened patches with the flattened kernel, but the convolution kernels do not
know it: on PyTorch 2.9 Conv3d runs 4-20x slower and takes more memory in bf16 than the same matmul (pytorch
issues #166122, #166643, #174051). :func:`linear_patch_embeddings` turns every such Conv3d of a model into a
:class:`LinearPatchConv3d` in place: the same module (same parameters, same state-dict keys and shapes, still
an ``nn.Conv3d`` for peft and FSDP), whose forward is that matmul. Checkpoints and exports are unchanged and
load with transformers' ``from_pretrained``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class LinearPatchConv3d(nn.Conv3d):
    """An ``nn.Conv3d`` with stride == kernel size (no padding, dilation 1, one group) computed as
    ``F.linear`` over the flattened non-overlapping patches: the convolution's result up to float rounding,
    with the convolution's parameters and state dict."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 - nn.Conv3d's name
        unbatched = input.dim() == 4
        x = input.unsqueeze(0) if unbatched else input
        n, c = x.shape[:2]
        (kd, kh, kw), (d, h, w) = self.kernel_size, x.shape[2:]
        od, oh, ow = d // kd, h // kh, w // kw  # a stride-k convolution drops a remainder shorter than k
        if (od * kd, oh * kh, ow * kw) != (d, h, w):
            x = x[:, :, :od * kd, :oh * kh, :ow * kw]
        patches = (x.reshape(n, c, od, kd, oh, kh, ow, kw).permute(0, 2, 4, 6, 1, 3, 5, 7)
                   .reshape(n * od * oh * ow, c * kd * kh * kw))
        out = F.linear(patches, self.weight.reshape(self.out_channels, -1), self.bias)
        out = out.reshape(n, od, oh, ow, self.out_channels).permute(0, 4, 1, 2, 3)
        return out.squeeze(0) if unbatched else out


def is_patch_conv(module: nn.Module) -> bool:
    """True for a plain ``nn.Conv3d`` that is a matmul over non-overlapping patches (stride == kernel size,
    no padding, dilation 1, one group)."""
    return (type(module) is nn.Conv3d and tuple(module.stride) == tuple(module.kernel_size)
            and module.padding in ((0, 0, 0), "valid") and tuple(module.dilation) == (1, 1, 1)
            and module.groups == 1)


def linear_patch_embeddings(model: nn.Module) -> int:
    """Make every patch-embedding ``nn.Conv3d`` of ``model`` (see :func:`is_patch_conv`) a
    :class:`LinearPatchConv3d`, in place (parameters untouched); returns how many were changed."""
    changed = 0
    for module in model.modules():
        if is_patch_conv(module):
            module.__class__ = LinearPatchConv3d
            changed += 1
    return changed
