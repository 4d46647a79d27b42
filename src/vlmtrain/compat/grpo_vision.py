"""GRPO for vision-language models (TRL 1.16's layout: conversational ``prompt`` messages and an ``images`` list, or
one ``image``, per row), each group's images encoded once, on every Hub VLM family (models/families/).

A generation batch holds each prompt ``num_generations`` times in a row (its group). :func:`encode_groups` renders
each group's prompt once with the processor's chat template (image parts placed as TRL's
``prepare_multimodal_messages`` places them) and runs the processor over it with its images: the prompt's token
ids (image placeholders expanded), its per-token keys and its image inputs per processor key. The rollout and the
training forward both read these, so they see the same tokens and the same multimodal rotary positions, and their
log-probs agree.

One vision pass per group is DPO's mechanism (models/objectives/vision_pairs.py): the batch gives the image inputs
of the groups it holds once (``vision_<key>``), batched as the family's processor batches samples
(``Family.batch_layout``: Qwen's patches concatenated, Idefics3's crops padded per sample, LLaVA-OneVision's tiles,
Gemma 3's images), and ``image_token_index`` (each row's placeholder token -> its group's feature token);
``with_pair_images`` encodes them in one ``get_image_features`` call and hands each row its group's features as
``mm_encoder_outputs``. :class:`VisionGenerate` does it once per rollout and gives the features to ``generate``
over all the rows (a plain generate of the rows, each with its own copy of its images, gives the same
completions: the features are memoized, not the KV cache, so Qwen's multimodal rotary positions (``rope_deltas``)
are computed per row as ``generate`` always computes them); the training forward does it once per micro-batch
(with gradients: the vision tower and projector train), over the groups that micro-batch holds
(:meth:`VisionGroups.inputs`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..data.hub_packing import pad_images
from ..data.preference_vision import ROW_IMAGE_KEYS, ROW_TOKEN_KEYS, VISION_PREFIX, decode_clips, video_call
from ..data.preference_vision import _images_of as sample_images
from ..data.preference_vision import _with_image_parts as with_image_parts
from ..errors import ConfigError
from ..models.families import REGISTRY, Family, Layout, get_family
from ..models.objectives.vision_pairs import with_pair_images
from .grpo_rollout import HFGenerate, pad_rows
from .grpo_video import VIDEO_KEYS, GroupVideos, feature_token_index, same_videos


def check_vision_dataset(sample: Mapping[str, Any]) -> None:
    """TRL 1.16's rule for a dataset with images (or videos: grpo_video.py), refused in one line before the model
    loads: conversational prompts."""
    if not isinstance(sample["prompt"], list):
        raise ConfigError("GRPO with images needs conversational prompts (lists of chat messages, as TRL requires): "
                          "give 'prompt' as [{'role': 'user', 'content': ...}] and let the trainer apply the chat "
                          "template.")


def check_vision_model(model: nn.Module) -> Family:
    """The Hub VLM family of a model GRPO takes images on (its record says how each group's pixel inputs batch);
    a ConfigError naming the supported model types for another model."""
    model_type = getattr(model.config, "model_type", None)
    if model_type not in REGISTRY:
        raise ConfigError(f"GRPO with images: the model is a {model_type!r}; vlmtrain's GRPO takes images on the Hub "
                          f"VLM families' models ({', '.join(sorted(REGISTRY))}).")
    return get_family(model_type)


def _batched(how: Layout | None, values: list[torch.Tensor]) -> torch.Tensor:
    """The groups' tensors of one image key batched as the family's processor batches its samples' (an undeclared
    key: concatenated, Qwen's per-patch layout)."""
    if callable(how):
        return how(values)
    if how == "pad_images":
        return pad_images(values, values[0])
    return torch.stack(values) if how == "stack" else torch.cat(values)


@dataclass
class VisionGroups:
    """The groups of a generation batch's rows, each prompt processed once: ``prompt_ids`` (image placeholders
    expanded), ``token_types`` (its per-token processor outputs: Qwen's ``mm_token_type_ids``, Gemma 3's
    ``token_type_ids``), ``images`` (its image inputs per processor key as one sample's, {} without images),
    ``image_tokens`` (its placeholder count); ``row_group``: each row's group; ``layout``: how the family batches
    each image key (``Family.batch_layout``); ``videos``: each group's videos (grpo_video.py)."""

    prompt_ids: list[list[int]]
    token_types: list[dict[str, list[int]]]
    images: list[dict[str, torch.Tensor]]
    image_tokens: list[int]
    row_group: list[int]
    layout: Mapping[str, Layout] = field(default_factory=dict)
    videos: GroupVideos = field(default_factory=GroupVideos)

    def row_prompt_ids(self) -> list[list[int]]:
        """The prompt ids of every row (its group's)."""
        return [self.prompt_ids[g] for g in self.row_group]

    def token_rows(self, width: int, completion_width: int) -> dict[str, torch.Tensor]:
        """The per-token keys of the rows: each prompt's left-padded to ``width``, 0 on the completions."""
        keys = dict.fromkeys(k for types in self.token_types for k in types)
        return {k: torch.tensor([[0] * (width - len(self.prompt_ids[g]))
                                 + self.token_types[g].get(k, [0] * len(self.prompt_ids[g])) + [0] * completion_width
                                 for g in self.row_group], dtype=torch.long) for k in keys}

    def inputs(self, start: int, end: int, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
        """The vision keys of rows ``start:end`` (whole groups or not): the image inputs of the groups they hold,
        once, batched by the family's layout (``vision_*``), each row's placeholder tokens -> those groups' feature
        tokens (``image_token_index``) and each row's images' per-image keys the language model reads (Qwen's
        ``image_grid_thw``, for its rotary positions); the same for their videos (:meth:`GroupVideos.inputs`); {}
        without either."""
        rows = self.row_group[start:end]
        out = self.videos.inputs(rows)
        groups, index = feature_token_index(rows, self.image_tokens)
        if groups:
            out.update({VISION_PREFIX + k: _batched(self.layout.get(k), [self.images[g][k] for g in groups])
                        for k in self.images[groups[0]]})
            out["image_token_index"] = index
            for key in ROW_IMAGE_KEYS:
                if key in self.images[groups[0]]:
                    out[key] = torch.cat([self.images[g][key] for g in rows if self.image_tokens[g]])
        return {k: v.to(device) for k, v in out.items()}


def encode_groups(processor: Any, rows: Sequence[Mapping[str, Any]], image_token_id: int,
                  layout: Mapping[str, Layout] | None = None, video: Any = None) -> VisionGroups:
    """Each group's prompt rendered and processed once with its images (and videos, decoded once: ``video``, the
    family's video support). The sampler repeats a prompt ``num_generations`` times in a row, but a process's slice
    of a generation batch, or an eval batch, may cut a group at either end: a group is a run of rows with the same
    prompt, images and videos (two prompts alike that follow each other share one encoding, which changes
    nothing). ``layout``: the family's ``batch_layout`` (a key
    batched per sample, not concatenated, loses the processor's leading batch dimension of 1 here)."""
    layout = dict(layout or {})
    out = VisionGroups([], [], [], [], [], layout)
    for i, row in enumerate(rows):
        if i and row["prompt"] == rows[i - 1]["prompt"] and sample_images(row) == sample_images(rows[i - 1]) \
                and same_videos(row, rows[i - 1]):
            out.row_group.append(out.row_group[-1])
            continue
        out.row_group.append(len(out.prompt_ids))
        images, clips = sample_images(row), decode_clips(row, video, "a GRPO prompt with videos")
        messages = with_image_parts(row["prompt"], len(images), len(clips))
        text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        # (nested, one list per text: LLaVA-OneVision expands a prompt's several images as one sample's, not tiled;
        # the template already holds the special tokens: Gemma 3's tokenizer would add a second BOS)
        call, videos = video_call(processor, video, clips)
        processed = call(text=[text], images=[images] if images else None, return_tensors="pt",
                         add_special_tokens=False, **videos)
        ids = processed["input_ids"][0].tolist()
        out.prompt_ids.append(ids)
        out.token_types.append({k: processed[k][0].tolist() for k in ROW_TOKEN_KEYS if k in processed})
        image_keys = [k for k in processed if k not in ("input_ids", "attention_mask", *ROW_TOKEN_KEYS, *VIDEO_KEYS)]
        out.images.append({k: processed[k] if layout.get(k, "concat") == "concat" or callable(layout[k])
                           else processed[k][0] for k in image_keys} if images else {})
        out.image_tokens.append(sum(t == image_token_id for t in ids))
        out.videos.add(processor, processed)
    return out


def rows_of(batch: Mapping[str, Any], start: int, end: int) -> dict[str, Any]:
    """Rows ``start:end`` of a rolled-out batch: its per-row tensors sliced, and where it holds images
    (``vision``: its :class:`VisionGroups`) the vision keys of those rows."""
    out = {k: v[start:end] for k, v in batch.items() if k != "vision"}
    if "vision" in batch:
        out.update(batch["vision"].inputs(start, end, batch["input_ids"].device))
    return out


class VisionGenerate(HFGenerate):
    """The policy's own ``generate`` for prompts with images (the default generator of a VLM): every row
    left-padded into one batch, each group's images encoded once (one vision tower call per rollout) and their
    features given to each of its rows, sampled with ``generation_config``, each completion cut after its first
    EOS. A custom generator for a VLM is called the same way: ``generator(model, prompt_ids, vision=groups)``
    (``groups``: the :class:`VisionGroups` of the rows)."""

    @torch.no_grad()
    def __call__(self, model: nn.Module, prompt_ids: list[list[int]], vision: VisionGroups) -> list[list[int]]:
        device = next(model.parameters()).device
        ids, mask = pad_rows(prompt_ids, self.pad, "left", device)
        tokens = {k: v.to(device) for k, v in vision.token_rows(ids.shape[1], 0).items()}
        return self.generate(model, {"input_ids": ids, "attention_mask": mask, **tokens,
                                     **vision.inputs(0, len(prompt_ids), device)})

    def prepare(self, model: nn.Module, inputs: dict[str, Any]) -> dict[str, Any]:
        """The groups' images encoded once, each row given its group's features (``mm_encoder_outputs``)."""
        return with_pair_images(model, inputs)
