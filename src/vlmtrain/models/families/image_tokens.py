"""How many patches and image tokens each image of a batch is, per Hub family (``Family.image_tokens``), for the
logged tflops_per_second: what the vision tower attends over and what the projector emits follows each family's
own cropping, tiling and pooling (the Qwen families' counts live in qwen_common and qwen2_5_vl)."""

from __future__ import annotations

from typing import Any


def idefics3(config: Any, batch: Any) -> list[tuple[int, int]]:
    """(patches, image tokens) per crop the vision tower sees: every crop of ``pixel_values`` [B, N, C, H, W]
    that is not all zeros (the model drops those, as padding); its (H / patch) x (W / patch) patches attend to
    each other, and the connector's pixel shuffle makes scale_factor^2 of them one image token."""
    pixels = batch.get("pixel_values")
    if pixels is None:
        return []
    crops = pixels.reshape(-1, *pixels.shape[-3:])
    real = int(((crops == 0).flatten(1).sum(1) != crops[0].numel()).sum()) if len(crops) else 0
    patch = config.vision_config.patch_size
    patches = (crops.shape[-2] // patch) * (crops.shape[-1] // patch)
    return [(patches, patches // config.scale_factor**2)] * real


def llava_onevision(config: Any, batch: Any) -> list[tuple[int, int]]:
    """(patches, projected features) per view the vision tower sees: a sample's only image is its base view plus
    grid crops ("anyres": how many from ``image_sizes`` and ``image_grid_pinpoints``, as the model counts them),
    each image of a several-image sample one view. Every view's (image_size / patch)^2 patches attend to each
    other and each (less the first with vision_feature_select_strategy 'default') goes through the projector;
    the pooling and unpadding after it are no matmuls."""
    from transformers.models.llava_onevision.modeling_llava_onevision import image_size_to_num_patches

    sizes = batch.get("image_sizes")
    if sizes is None:
        return []
    per_sample = batch.get("batch_num_images")
    crops_of = [n == 1 for n in per_sample.tolist() for _ in range(n)] if per_sample is not None else [True] * len(
        sizes)
    vision = config.vision_config
    patches = (vision.image_size // vision.patch_size) ** 2
    features = patches - (config.vision_feature_select_strategy == "default")
    views = sum(image_size_to_num_patches(size, config.image_grid_pinpoints, vision.image_size) if crops else 1
                for size, crops in zip(sizes.tolist(), crops_of))
    return [(patches, features)] * views


def gemma3(config: Any, batch: Any) -> list[tuple[int, int]]:
    """(patches, image tokens) per image of ``pixel_values`` [n, C, H, W]: the vision tower attends over all
    (image_size / patch)^2 patches of each; the projector average-pools them to ``mm_tokens_per_image`` tokens,
    then multiplies each by its projection weight (a bare parameter: ``matmul_parameters``)."""
    pixels = batch.get("pixel_values")
    if pixels is None:
        return []
    patch = config.vision_config.patch_size
    patches = (pixels.shape[-2] // patch) * (pixels.shape[-1] // patch)
    return [(patches, config.mm_tokens_per_image)] * pixels.reshape(-1, *pixels.shape[-3:]).shape[0]
