"""The vision tower runs on every rank, on every micro-batch: a batch without an image runs it on a dummy image.

Under DDP a parameter that one rank used and another did not breaks the gradient all-reduce (gloo: "Received
data size doesn't match expected size"); under FSDP each vision block is its own unit, and a rank that skips the
tower skips its all-gathers, so the ranks' collectives no longer pair up (an error, or a hang until the
process-group timeout). The rule: no rank's data decides whether a collective runs or what it carries.

So when several processes run (``torch.distributed`` initialized, world size > 1) and a forward gets no
``pixel_values``, the vision tower and projector run on a family's smallest valid image (the ``dummy_image``
of its record, e.g. one 2 x 2 patch grid for Qwen-VL), *before* the text model, as real images do (the same
order of FSDP all-gathers; in backward, of reduce-scatters). ``0 x`` the sum of the features the language model
would receive is added to the text embeddings: every vision and projector parameter gets an exact zero gradient,
and the loss, logits and every other gradient are bitwise those of the run without it. A batch with images
computes exactly what it did. One process never runs the dummy; nor do decoding steps of ``generate`` (no rank
encodes images there). benchmarks/dummy_vision.py measures its cost.

Videos (a family with a ``dummy_video``: Qwen3-VL, Qwen2.5-VL) go through the vision tower in a call of their
own (``get_video_features``), after the images'. So that every rank makes the same calls in the same order
whatever mix of images, videos and text its batch holds, such a family's forward under several processes always
makes both: a batch without images encodes the dummy image, one without videos the dummy video (the same
smallest input, as ``get_video_features``' arguments), each adding 0 x its features. (For Qwen both calls run
the same tower: under FSDP a rank with images only would otherwise gather its vision blocks once per forward,
a rank with images and videos twice.)

The zero gradients are for the collectives only: an optimizer step where no forward on any rank had vision input
must leave the vision tower and projector as one process without the dummy leaves them (AdamW's momentum and
weight decay move a parameter whose gradient is zero, and skip one whose gradient is None). So the module that
runs the dummy carries a :class:`VisionInput` (``VISION_INPUT_ATTR``): it notes each forward with gradients that
had real vision input and names the parameters the dummy feeds; it is the model's step hook
(models/protocol.py's ``STEP_HOOK_ATTR``): on each optimizer step the ranks agree whether any had vision input and,
where none did, it sets those parameters' gradients to None before clipping and the step.

Under ``data.max_patches_per_pack`` (models/vision/vision_padding.py) the dummy is not padded to the patch budget: it
stays the family's smallest input (:func:`encoding_dummy` tells the padding hook).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import types
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from ..protocol import STEP_HOOK_ATTR

__all__ = ["VISION_INPUT_ATTR", "VisionInput", "enable_dummy_vision", "encoding_dummy", "needed", "zero_of"]

VISION_INPUT_ATTR = STEP_HOOK_ATTR
"""A module whose forward runs the dummy path carries its :class:`VisionInput` under this attribute, as its step
hook (models/protocol.py: the Trainer calls it at each optimizer step)."""

_ENCODING_DUMMY = contextvars.ContextVar("vlmtrain_encoding_dummy", default=False)


class VisionInput:
    """What the Trainer needs to give the parameters the dummy feeds no gradient on a step without vision input:
    whether a forward with gradients had real vision input since it last asked (:meth:`take`), and those
    parameters (:meth:`parameters`: the host module's parameters under ``prefixes``, names relative to it)."""

    def __init__(self, prefixes: tuple[str, ...]) -> None:
        self.prefixes = tuple(p.rstrip(".") for p in prefixes)
        self.seen = False

    def record(self, real: bool) -> None:
        """Called by each forward: ``real`` when it had vision input (counted only where gradients flow)."""
        if real and torch.is_grad_enabled():
            self.seen = True

    def take(self) -> bool:
        """Whether a forward had vision input since the last call."""
        seen, self.seen = self.seen, False
        return seen

    def clear(self) -> None:
        """Forget the forwards so far (the Trainer dropped them: training starts, or an epoch ends mid-window)."""
        self.seen = False

    def before_optimizer_step(self, host: nn.Module, any_rank: Callable[[bool], bool]) -> None:
        """A step in which no forward on any rank had vision input: the parameters the dummy input fed (zero
        gradients) get None, as one process without the dummy leaves them; AdamW's momentum and weight decay
        would move them. The ranks agree by one small all-reduce on every step, whatever their data."""
        if not any_rank(self.take()):
            for p in self.parameters(host):
                p.grad = None

    def parameters(self, host: nn.Module) -> list[nn.Parameter]:
        """``host``'s parameters the dummy feeds (trainable or not; under FSDP the sharded ones)."""
        return [p for name, p in host.named_parameters()
                if any(name == prefix or name.startswith(prefix + ".") for prefix in self.prefixes)]


def encoding_dummy() -> bool:
    """Whether the vision tower now runs on the dummy input (not on a batch's images)."""
    return _ENCODING_DUMMY.get()


@contextlib.contextmanager
def _dummy_running() -> Iterator[None]:
    token = _ENCODING_DUMMY.set(True)
    try:
        yield
    finally:
        _ENCODING_DUMMY.reset(token)


def needed() -> bool:
    """Whether a batch without images runs the dummy: several processes (the same answer on every rank)."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def zero_of(features: Any) -> torch.Tensor:
    """0 x the sum of every floating tensor in ``features`` (a tensor, or nested lists / tuples / mappings of
    them): a scalar zero whose gradient reaches every parameter that made them."""
    tensors: list[torch.Tensor] = []

    def walk(x: Any) -> None:
        if isinstance(x, torch.Tensor):
            if x.is_floating_point():
                tensors.append(x)
        elif isinstance(x, Mapping):
            for v in x.values():
                walk(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)

    walk(features)
    if not tensors:
        raise ValueError("the dummy image gave no floating-point features")
    return sum(t.float().sum() for t in tensors) * 0.0


def add_to_embeddings(embedding: nn.Module, zero: torch.Tensor) -> Any:
    """A forward hook on ``embedding`` (the text model's input embeddings) that adds ``zero`` to its output;
    returns the handle (remove it after the forward)."""

    def hook(module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
        return output + zero.to(output.dtype)

    return embedding.register_forward_hook(hook)


def _decode_step(kwargs: Mapping[str, Any]) -> bool:
    """A generation step after the prefill (a non-empty KV cache): no rank encodes images there."""
    cache = kwargs.get("past_key_values", kwargs.get("cache"))
    if cache is None:
        return False
    length = cache.get_seq_length() if hasattr(cache, "get_seq_length") else 1
    return int(length) > 0


def hub_features(model: nn.Module, inputs: Mapping[str, torch.Tensor], kind: str = "image") -> Any:
    """What a transformers VLM's language model receives from ``get_image_features(**inputs)`` (``kind``
    'video': ``get_video_features``): the projected embeddings (``pooler_output``) and, for Qwen3-VL, the
    deepstack features fed to its first layers."""
    out = getattr(model, f"get_{kind}_features")(**inputs, return_dict=True)
    return [out.pooler_output, getattr(out, "deepstack_features", None)]


def enable_dummy_vision(vlm: nn.Module, dummy_image: Callable[[Any], dict[str, torch.Tensor]],
                        dummy_video: Callable[[Any], dict[str, torch.Tensor]] | None = None,
                        fed: tuple[str, ...] = ()) -> None:
    """Give a transformers VLM model (the module with ``get_image_features``, e.g. Qwen3VLModel: a Hub VLM's
    ``model.model``) the dummy image path: under several processes, a forward without ``pixel_values`` first
    encodes ``dummy_image(config)`` (get_image_features' keyword arguments, on CPU) and adds 0 x its features
    to the text embeddings (see the module docstring). With ``dummy_video`` (get_video_features' keyword
    arguments), a forward without ``pixel_values_videos`` encodes it as well (the dummies run before the forward's
    own vision tower calls; for the collectives only their number counts: each is a whole pass of the tower).
    ``fed``: the name prefixes (relative to ``vlm``) of the parameters the dummies feed, for its
    :class:`VisionInput`. transformers' generate() may encode the images and videos itself and pass their features
    as ``mm_encoder_outputs`` ({'image': ..., 'video': ...}) without pixel values: those count as the forward's own
    (no dummy for them, so an image rank makes as many tower calls as a text-only one)."""
    own_forward = type(vlm).forward  # (the class's, called with self: a deepcopy of the model stays right)
    setattr(vlm, VISION_INPUT_ATTR, VisionInput(fed))

    @functools.wraps(own_forward)
    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        encoded = kwargs.get("mm_encoder_outputs") or {}  # (images generate() encoded itself: no pixel values)
        has_image = kwargs.get("pixel_values") is not None or encoded.get("image") is not None
        has_video = kwargs.get("pixel_values_videos") is not None or encoded.get("video") is not None
        getattr(self, VISION_INPUT_ATTR).record(has_image or has_video)
        if not needed() or _decode_step(kwargs):
            return own_forward(self, *args, **kwargs)
        no_image, no_video = not has_image, dummy_video is not None and not has_video
        if not (no_image or no_video):
            return own_forward(self, *args, **kwargs)
        embedding = self.get_input_embeddings()
        device = embedding.weight.device
        dummies = []  # (every rank makes the same number of vision tower calls: the real ones and these)
        for kind, dummy in (("image", dummy_image if no_image else None), ("video", dummy_video if no_video else None)):
            if dummy is not None:
                with _dummy_running():  # (its smallest input: no padding to data.max_patches_per_pack)
                    dummies.append(hub_features(self, {k: v.to(device) for k, v in dummy(self.config).items()},
                                                kind))
        zero = zero_of(dummies)
        if kwargs.get("inputs_embeds") is not None:  # (the embeddings were computed outside: no hook fires)
            kwargs["inputs_embeds"] = kwargs["inputs_embeds"] + zero.to(kwargs["inputs_embeds"].dtype)
            return own_forward(self, *args, **kwargs)
        handle = add_to_embeddings(embedding, zero)
        try:
            return own_forward(self, *args, **kwargs)
        finally:
            handle.remove()

    vlm.forward = types.MethodType(forward, vlm)
