"""transformers' own Qwen video processors as the reference for vlmtrain's (tests and scripts/make_video_fixture.py).

Where torchvision imports, :func:`reference_video_processor` is transformers' ``Qwen3VLVideoProcessor`` /
``Qwen2VLVideoProcessor`` unchanged. Where it does not (CPU CI: torchvision's PyPI wheel does not load next to
a CPU torch), ``shim=True`` runs the same transformers code with the few torchvision functions it calls
(``resize``, ``normalize``, ``grayscale_to_rgb``, ``InterpolationMode``) replaced by :class:`TorchvisionShim`,
a transcription of torchvision 0.2x's ``transforms.v2.functional`` tensor kernels for them: transformers'
frame sampling, smart_resize, grouping, fused normalization, patchify, processor token expansion and
timestamps then run as they are, and only the resize kernel's equality with torchvision rests on the
transcription (which the torchvision test and the committed fixture check).
"""

from __future__ import annotations

import enum
import importlib
import sys
import types
from typing import Any

import torch


def torchvision_available() -> bool:
    try:
        import torchvision.transforms.v2.functional  # noqa: F401
    except Exception:  # noqa: BLE001 - absent, or a wheel that does not load next to this torch
        return False
    return True


class InterpolationMode(enum.Enum):
    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


class TorchvisionShim(types.ModuleType):
    """torchvision.transforms.v2.functional's resize / normalize / grayscale_to_rgb for tensors (CPU)."""

    InterpolationMode = InterpolationMode

    def __init__(self) -> None:
        super().__init__("torchvision.transforms.v2.functional")

    @staticmethod
    def resize(image: torch.Tensor, size: list[int], interpolation: Any = InterpolationMode.BILINEAR,
               max_size: Any = None, antialias: bool | None = True) -> torch.Tensor:
        # torchvision.transforms.v2.functional._geometry.resize_image (explicit [h, w] size)
        antialias = False if antialias is None else antialias
        if interpolation in (InterpolationMode.BILINEAR, InterpolationMode.BICUBIC):
            align_corners: bool | None = False
        else:
            align_corners, antialias = None, False
        shape = image.shape
        num_channels, old_height, old_width = shape[-3:]
        new_height, new_width = int(size[0]), int(size[1])
        if (new_height, new_width) == (old_height, old_width):
            return image
        dtype = image.dtype
        acceptable = [torch.float32, torch.float64]
        if interpolation in (InterpolationMode.NEAREST, InterpolationMode.NEAREST_EXACT):
            acceptable.append(torch.uint8)
        elif image.device.type == "cpu":
            native = interpolation == InterpolationMode.BICUBIC or (
                interpolation == InterpolationMode.BILINEAR and "AVX2" in torch.backends.cpu.get_cpu_capability())
            if native:
                acceptable.append(torch.uint8)
        image = image.reshape(-1, num_channels, old_height, old_width)
        need_cast = dtype not in acceptable
        if need_cast:
            image = image.to(dtype=torch.float32)
        image = torch.nn.functional.interpolate(image, size=[new_height, new_width], mode=interpolation.value,
                                                align_corners=align_corners, antialias=antialias)
        if need_cast:
            if interpolation == InterpolationMode.BICUBIC and dtype == torch.uint8:
                image = image.clamp_(min=0, max=255)
            if dtype in (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64):
                image = image.round_()
            image = image.to(dtype=dtype)
        return image.reshape(shape[:-3] + (num_channels, new_height, new_width))

    @staticmethod
    def normalize(image: torch.Tensor, mean: Any, std: Any, inplace: bool = False) -> torch.Tensor:
        # torchvision.transforms.v2.functional._misc.normalize_image
        mean = torch.as_tensor(mean, dtype=image.dtype, device=image.device)
        std = torch.as_tensor(std, dtype=image.dtype, device=image.device)
        if mean.ndim == 1:
            mean = mean.view(-1, 1, 1)
        if std.ndim == 1:
            std = std.view(-1, 1, 1)
        image = image.sub_(mean) if inplace else image.sub(mean)
        return image.div_(std)

    @staticmethod
    def grayscale_to_rgb(image: torch.Tensor) -> torch.Tensor:
        return image if image.shape[-3] >= 3 else image.repeat(*([1] * (image.ndim - 3)), 3, 1, 1)


_SHIMMED: dict[str, Any] = {}


def _install_shim() -> None:
    """Point transformers' torchvision uses at the shim (once per process; only where torchvision is absent)."""
    if _SHIMMED:
        return
    from transformers import image_processing_backends, video_processing_utils
    from transformers.image_utils import PILImageResampling

    shim = TorchvisionShim()
    mapping = {PILImageResampling.NEAREST: InterpolationMode.NEAREST_EXACT, PILImageResampling.BOX: InterpolationMode.BOX,
               PILImageResampling.BILINEAR: InterpolationMode.BILINEAR,
               PILImageResampling.HAMMING: InterpolationMode.HAMMING,
               PILImageResampling.BICUBIC: InterpolationMode.BICUBIC,
               PILImageResampling.LANCZOS: InterpolationMode.LANCZOS}
    image_processing_backends.tvF = shim
    image_processing_backends.pil_torch_interpolation_mapping = mapping
    video_processing_utils.tvF = shim
    # Qwen2VL's video module imports torchvision at its top: import it once with the shim standing in.
    fake = {name: types.ModuleType(name) for name in ("torchvision", "torchvision.transforms",
                                                       "torchvision.transforms.v2")}
    fake["torchvision.transforms.v2"].functional = shim
    fake["torchvision.transforms.v2.functional"] = shim
    saved = {name: sys.modules.get(name) for name in fake}
    sys.modules.update(fake)
    try:
        importlib.import_module("transformers.models.qwen2_vl.video_processing_qwen2_vl")
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module
    _SHIMMED["shim"] = shim


def reference_video_processor(kind: str, image_processor: Any, shim: bool) -> Any:
    """transformers' video processor of ``kind`` ('qwen3_vl' / 'qwen2_5_vl') with ``image_processor``'s geometry
    and normalization (bicubic, cap_pixels_per_frame=False: the size given is the bound)."""
    if shim:
        _install_shim()
    if kind == "qwen3_vl":
        from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor as cls
    else:
        cls = importlib.import_module("transformers.models.qwen2_vl.video_processing_qwen2_vl").Qwen2VLVideoProcessor
    return cls(patch_size=image_processor.patch_size, merge_size=image_processor.merge_size,
               temporal_patch_size=getattr(image_processor, "temporal_patch_size", 2),
               image_mean=list(image_processor.image_mean), image_std=list(image_processor.image_std),
               cap_pixels_per_frame=False)


def reference_processor(kind: str, processor: Any, shim: bool) -> Any:
    """The checkpoint's real processor class (Qwen3VLProcessor / Qwen2_5_VLProcessor) with transformers' own video
    processor, built from vlmtrain's image-only ``processor``'s image processor, tokenizer and chat template."""
    import transformers

    name = "Qwen3VLProcessor" if kind == "qwen3_vl" else "Qwen2_5_VLProcessor"
    from transformers.processing_utils import ProcessorMixin

    video = reference_video_processor(kind, processor.image_processor, shim)
    check = ProcessorMixin.check_argument_for_proper_class
    if shim:  # (its class check looks the video processor up in a mapping that is a placeholder without torchvision)
        ProcessorMixin.check_argument_for_proper_class = lambda self, name, arg: None
    try:
        return getattr(transformers, name)(image_processor=processor.image_processor, tokenizer=processor.tokenizer,
                                           video_processor=video, chat_template=processor.chat_template)
    finally:
        ProcessorMixin.check_argument_for_proper_class = check
