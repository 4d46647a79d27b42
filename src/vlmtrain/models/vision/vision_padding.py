"""data.max_patches_per_pack: a Qwen-VL vision tower's input padded to a fixed number of patches, so that with
token-budget micro-batches (one packed row per step) the vision tower sees the same shape every step.

The padding is one or more blank images appended after the batch's real ones (zero patches; grids of at most
:data:`CHUNK` patches, so their attention costs little): the tower attends within each image (one call per image
or one variable-length call, models/vision/vision_attention.py), so the real images' outputs do not depend on them,
and their outputs are cut off before the language model sees them (nothing of theirs reaches the loss, so they
add nothing to any gradient). The batch itself is unchanged: its ``image_grid_thw`` names the real images only,
so the logged FLOPs never count the padding. The dummy image or video of a rank without any
(models/vision/dummy_vision.py) is not padded: it stays the family's smallest input (padded, it would double the vision work of a step).
"""

from __future__ import annotations

from typing import Any

import torch

from .dummy_vision import encoding_dummy

PADDED_ATTR = "_vlmtrain_vision_patch_multiple"
"""Set on a vision tower whose input is padded (the multiple)."""

CHUNK = 32
"""A blank image is at most CHUNK x CHUNK patches."""


def pad_vision_patches(model: torch.nn.Module, multiple: int) -> None:
    """Pad the input of ``model``'s Qwen-VL vision tower (``model.model.visual``) to a multiple of ``multiple``
    patches (with one packed row per micro-batch: exactly ``multiple``), in place, by forward hooks."""
    visual = _vision_tower(model)
    merge = visual.spatial_merge_size
    if multiple < 1 or multiple % (merge * merge):
        raise ValueError(f"the vision patch multiple must be a positive multiple of spatial_merge_size^2 = "
                         f"{merge * merge} (an image is whole merge x merge blocks), got {multiple}")
    if getattr(visual, PADDED_ATTR, None) is not None:
        raise ValueError(f"the vision tower's input is already padded to a multiple of "
                         f"{getattr(visual, PADDED_ATTR)} patches")
    setattr(visual, PADDED_ATTR, multiple)
    visual.register_forward_pre_hook(_pad_inputs, with_kwargs=True)
    visual.register_forward_hook(_cut_outputs)


def _vision_tower(model: torch.nn.Module) -> Any:
    inner = getattr(model, "model", model)
    visual = getattr(inner, "visual", None)
    if visual is None or not hasattr(visual, "spatial_merge_size"):
        raise ValueError(f"{type(model).__name__} has no Qwen-VL vision tower (model.visual) whose input could be "
                         f"padded")
    return visual


def blank_grids(patches: int, merge: int) -> list[tuple[int, int, int]]:
    """(t, h, w) grids of blank images that hold ``patches`` patches (a multiple of merge^2), each at most
    CHUNK x CHUNK patches, h and w multiples of ``merge``."""
    side = CHUNK - CHUNK % merge
    grids = [(1, side, side)] * (patches // (side * side))
    rest = patches % (side * side)
    if rest:
        grids.append((1, merge, rest // merge))
    return grids


def _pad_inputs(visual: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    args, kwargs = list(args), dict(kwargs)
    hidden = args[0] if args else kwargs["hidden_states"]
    grid = args[1] if len(args) > 1 else kwargs["grid_thw"]
    multiple = getattr(visual, PADDED_ATTR)
    real = hidden.shape[0]
    # (the dummy image / video of a rank without any: its smallest input, the same on every rank that runs it)
    missing = 0 if encoding_dummy() else -real % multiple
    visual._vlmtrain_real_patches = real
    if missing:
        grids = blank_grids(missing, visual.spatial_merge_size)
        hidden = torch.cat([hidden, hidden.new_zeros(missing, *hidden.shape[1:])])
        grid = torch.cat([grid, torch.tensor(grids, dtype=grid.dtype, device=grid.device)])
    if args:
        args[0] = hidden
    else:
        kwargs["hidden_states"] = hidden
    if len(args) > 1:
        args[1] = grid
    else:
        kwargs["grid_thw"] = grid
    return tuple(args), kwargs


def _cut_outputs(visual: Any, args: tuple, output: Any) -> Any:
    real = visual._vlmtrain_real_patches
    merged = real // visual.spatial_merge_size ** 2
    if output.last_hidden_state is not None:
        output.last_hidden_state = output.last_hidden_state[:real]
    output.pooler_output = output.pooler_output[:merged]
    if getattr(output, "deepstack_features", None) is not None:
        output.deepstack_features = [f[:merged] for f in output.deepstack_features]
    return output
