"""`train.objective: grpo` in a run config: what the `train` section adds to the GRPO options it shares with
vlmtrain.GRPOConfig (compat/grpo_options.py; here: `reward_funcs`, and beta / loss_type / disable_dropout at TRL's
GRPO defaults), the checks made before any model or data is built, the prompts, and the run's Trainer:
vlmtrain.GRPOTrainer on the model the kind built and on the data source's prompts (:func:`build_trainer`), so
that a YAML run and a Python GRPOTrainer job are one code path."""

from __future__ import annotations

import dataclasses
import logging
import os
from collections import Counter
from collections.abc import Sequence
from typing import Any

from vlmtrain.compat.arguments import TrainingArguments
from vlmtrain.compat.grpo_options import GRPOOptions
from vlmtrain.errors import ConfigError

logger = logging.getLogger(__name__)

KINDS = ("causal_lm", "hub_vlm")
"""The model kinds whose prompts :func:`prompt_rows` lays out (hub_vlm: conversational prompts with images)."""
INTERNAL_COLUMNS = ("__key__", "__bad__", "__error__")  # (a JSONL record's bookkeeping: never a reward's kwarg)


GRPO_OPTIONS = ("reward_funcs", *(f.name for f in dataclasses.fields(GRPOOptions)
                                   if f.name not in {g.name for g in dataclasses.fields(TrainingArguments)}))
SHARED_DEFAULTS = {"beta": 0.0, "loss_type": "dapo", "disable_dropout": False}  # TRL's GRPOConfig defaults


def resolve_shared(train: Any) -> None:
    """beta, loss_type and disable_dropout at TRL's GRPO defaults where the config leaves them null."""
    for name, default in SHARED_DEFAULTS.items():
        if getattr(train, name) is None:
            setattr(train, name, default)
    if isinstance(train.loss_type, list):  # (a one-entry list, as the DPO options write it)
        if len(train.loss_type) != 1:
            raise ConfigError(f"train.loss_type={train.loss_type}: train.objective grpo takes one loss type.")
        train.loss_type = train.loss_type[0]


def check_grpo(cfg: Any) -> None:
    """What `train.objective: grpo` cannot run, refused in one line naming the key (before any model or data);
    the reward functions are imported here, and TRL's GRPOConfig checks (group sizes) made."""
    from vlmtrain.data.registry import get_source

    objective = "train.objective=grpo"
    if cfg.model.kind not in KINDS:
        raise ConfigError(f"{objective} is not supported for model.kind={cfg.model.kind} yet (model.kind: "
                          f"{', '.join(KINDS)}).")
    if not get_source(cfg.data.source).pairs:
        raise ConfigError(f"{objective} trains on prompts: data.source={cfg.data.source!r} cannot give them; use "
                          "data.source jsonl or stream (docs/data.md#grpo-prompts).")
    if cfg.data.source == "stream" and cfg.train.max_steps <= 0:
        raise ConfigError(f"train.max_steps={cfg.train.max_steps}: {objective} with data.source=stream needs "
                          "train.max_steps (a stream has no length to count epochs in).")
    refused = {"data.packing": (cfg.data.packing is True, "set data.packing: false (completions are generated "
                                "per step and padded, never packed)"),
               **{f"data.{key}": (getattr(cfg.data, key) is not None, f"remove data.{key} (nothing is packed)")
                  for key in ("pack_length", "pack_window", "max_images_per_pack", "max_patches_per_pack")},
               "train.predict_with_generate": (cfg.train.predict_with_generate, "set it to false (a GRPO evaluation "
                                               "generates on the eval prompts and reports eval_reward)"),
               "train.fsdp": (bool(cfg.train.fsdp), "remove train.fsdp (GRPO does not shard the model yet)"),
               "model.heads": (bool(cfg.model.heads), "remove model.heads (GRPO trains the language model)")}
    for key, (value, instead) in refused.items():
        if value:
            raise ConfigError(f"{key} is not available with {objective}: {instead}.")
    if not cfg.train.reward_funcs:
        raise ConfigError(f"{objective} needs train.reward_funcs: one or more 'module:function' reward functions "
                          "(docs/grpo.md).")
    reward_functions(cfg.train.reward_funcs)
    args = grpo_args(cfg.train)  # (TRL's checks: num_generations, generation_batch_size, loss_type, ...)
    if cfg.data.eval_file:
        from vlmtrain.compat.grpo_eval import check_eval_batch

        check_eval_batch(args)


def reward_functions(names: list[str]) -> list[Any]:
    """train.reward_funcs' entries: a directory is a reward model (grpo_reward_models.check_reward_model_dir:
    checked here without loading it, kept as its path for GRPOTrainer to load); a `module:function` is imported
    (grpo_rollout.resolve_reward_funcs; one that does not import is a ConfigError naming it and the import error)."""
    from vlmtrain.compat.grpo_reward_models import check_reward_model_dir
    from vlmtrain.compat.grpo_rollout import resolve_reward_funcs

    where, funcs = "train.reward_funcs", []
    for name in map(str, names):
        if os.path.isdir(name):
            check_reward_model_dir(name, where)
            funcs.append(name)
        else:
            funcs += resolve_reward_funcs([name], where=where, models=False)[0]
    return funcs


def grpo_args(train: Any) -> Any:
    """vlmtrain.GRPOConfig with the `train` section's values (TrainingArguments' and the GRPO options)."""
    from vlmtrain.compat.grpo_config import GRPOConfig

    names = [f.name for f in dataclasses.fields(TrainingArguments) if f.init]
    names += [n for n in (*GRPO_OPTIONS, *SHARED_DEFAULTS) if n != "reward_funcs"]
    return GRPOConfig(**{name: getattr(train, name) for name in names})


def prompt_row(record: dict[str, Any], tokenizer: Any, vision: bool = False) -> dict[str, Any]:
    """One raw sample as a GRPO prompt (docs/data.md#grpo-prompts): a `prompt` (a string or chat messages) is kept;
    vlmtrain's `texts` turns, the last one the question alone, become the prompt's tokens as SFT lays the
    conversation out (``prompt_ids``; their text is the ``prompt`` the reward functions get), or for a VLM
    (``vision``) chat messages, its `images` going first in the first user turn as TRL places them. The other
    columns stay (they reach the reward functions), the JSONL bookkeeping ones go. A record that is neither raises
    SkipSample (``not_a_prompt``); one with images for a text model, ``images_for_text_model``; a missing image
    file, ``missing_image``."""
    from vlmtrain.data.processing import SkipSample, skip_unreadable
    from vlmtrain.data.text import TextChatProcessor

    skip_unreadable(record)
    row = {k: v for k, v in record.items() if k not in INTERNAL_COLUMNS}
    if row.get("images") and not vision:
        raise SkipSample("images_for_text_model", f"{len(row['images'])} image(s)")
    if "images" in row and not row["images"] and not vision:  # (a WebDataset sample's empty list: no image column)
        del row["images"]
    for image in row.get("images") or []:
        if isinstance(image, str) and not os.path.isfile(image):
            raise SkipSample("missing_image", image)
    check_videos(row, vision)
    if "prompt" in row:
        if not row["prompt"] or not isinstance(row["prompt"], str | list):
            raise SkipSample("not_a_prompt", f"'prompt' is {row['prompt']!r}")
        return row
    turns = row.pop("texts", None)
    last = turns[-1] if isinstance(turns, list) and turns else None
    if not isinstance(last, dict) or not isinstance(last.get("user"), str) or last.get("assistant"):
        raise SkipSample("not_a_prompt", "no 'prompt', and no 'texts' turns whose last one is the question alone "
                         "({'user': ...})")
    if vision:  # (the chat messages TRL's VLM layout takes: the processor's template renders them)
        messages = [m for t in turns[:-1] for m in ({"role": "user", "content": t["user"]},
                                                     {"role": "assistant", "content": t["assistant"]})]
        return {**row, "prompt": [*messages, {"role": "user", "content": last["user"]}]}
    chat = TextChatProcessor(tokenizer, max_length=1 << 30)
    ids = chat.process({"texts": [*turns[:-1], {"user": last["user"], "assistant": ""}]})["prompt_input_ids"]
    return {**row, "prompt": tokenizer.decode(ids, skip_special_tokens=True), "prompt_ids": ids}


def check_videos(row: dict[str, Any], vision: bool) -> None:
    """A prompt's videos (decoded when its group is rolled out): SkipSample for videos to a text model
    (``videos_for_text_model``) or a video file, or frame file, that does not exist (``video_unreadable``)."""
    from vlmtrain.data.hub_messages import sample_videos
    from vlmtrain.data.processing import SkipSample

    videos = sample_videos(row)
    if videos and not vision:
        raise SkipSample("videos_for_text_model", f"{len(videos)} video(s)")
    for spec in videos:
        for file in spec if isinstance(spec, list | tuple) else [spec]:
            if isinstance(file, str) and not os.path.isfile(file):
                raise SkipSample("video_unreadable", f"{file}: no such file")


class PromptRows(Sequence):
    """GRPO prompts whose images (paths in a JSONL file) are opened when a row is read, not all at once."""

    def __init__(self, rows: list[dict[str, Any]]) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, Any]:  # type: ignore[override]
        from vlmtrain.data.processing import load_image

        row = self.rows[index]
        return {**row, "images": [load_image(i) for i in row["images"]]} if row.get("images") else row


def prompt_rows(records: list[dict[str, Any]] | None, tokenizer: Any, key: str, vision: bool = False) -> Any:
    """The prompts of a data source's raw samples (:func:`prompt_row`, a :class:`PromptRows`); bad ones are left
    out, counted in one warning (none left: a ConfigError naming ``key``)."""
    from vlmtrain.data.processing import SkipSample

    if records is None:
        return None
    rows, skipped = [], Counter[str]()
    for record in records:
        try:
            rows.append(prompt_row(record, tokenizer, vision))
        except SkipSample as err:
            skipped[err.reason] += 1
    if skipped:
        logger.warning("GRPO: %d of %d prompts of %s skipped: %s", sum(skipped.values()), len(records), key,
                       dict(skipped))
    if not rows:
        raise ConfigError(f"{key}: none of its {len(records)} samples is a GRPO prompt ({dict(skipped)}); see "
                          "docs/data.md#grpo-prompts.")
    if any("videos" in r or "video" in r for r in rows):  # (every row a videos column, as a dataset's rows have)
        rows = [r if "videos" in r or "video" in r else {**r, "videos": []} for r in rows]
    return PromptRows(rows)


def prompt_check(cfg: Any) -> Any:
    """What `vlmtrain data inspect --config` runs on each sample of a GRPO run: the prompt (SkipSample for a bad
    one) and, under ``tokens``, its tokens as the run tokenizes them (a VLM's: its processor's, images expanded)."""
    if cfg.model.kind == "hub_vlm":
        return _vision_prompt_check(cfg)
    from vlmtrain.compat.grpo_rollout import prompt_token_ids
    from vlmtrain.models.kinds.causal_lm import tokenizer_for

    tokenizer = tokenizer_for(cfg)

    def check(sample: dict[str, Any]) -> dict[str, Any]:
        row = prompt_row(sample, tokenizer)
        return {**row, "tokens": {"prompt": tokenizer.convert_ids_to_tokens(prompt_token_ids(tokenizer, [row])[0])}}

    return check


def _vision_prompt_check(cfg: Any) -> Any:
    from vlmtrain.compat.grpo_vision import encode_groups
    from vlmtrain.models.families import family_of

    family = family_of(cfg.model.pretrained, key="model.pretrained")
    processor = family.load_processor(cfg.model.pretrained)
    video = _video_support(cfg, family, processor)

    def check(sample: dict[str, Any]) -> dict[str, Any]:
        row = PromptRows([prompt_row(sample, processor, vision=True)])[0]
        ids = encode_groups(processor, [row], -1, video=video).prompt_ids[0]
        return {**row, "tokens": {"prompt": processor.tokenizer.convert_ids_to_tokens(ids)}}

    return check


def _video_support(cfg: Any, family: Any, processor: Any) -> Any:
    """The family's video support under the config's ``data.video_*`` settings (None: a family without it)."""
    from vlmtrain.data.video import VideoSettings

    return None if family.video is None else family.video(processor, VideoSettings.from_data(cfg.data))


def build_trainer(cfg: Any, parts: dict[str, Any]) -> Any:
    """vlmtrain.GRPOTrainer on the kind's model and tokenizer, the source's prompts and the configured reward
    functions."""
    from vlmtrain.compat.grpo import GRPOTrainer

    tokenizer = parts["tokenizer"]
    vision = cfg.model.kind == "hub_vlm"
    if cfg.data.source == "stream":
        train = stream_prompts(cfg, parts["train_dataset"], tokenizer, vision)
    else:
        train = prompt_rows(parts["train_dataset"], tokenizer, "data.train_file", vision)
    evals = prompt_rows(parts["eval_dataset"], tokenizer, "data.eval_file", vision) if cfg.data.num_eval > 0 else None
    args = grpo_args(cfg.train)
    trainer = GRPOTrainer(parts["model"], [_head_reward(f, args) for f in reward_functions(cfg.train.reward_funcs)],
                          args=args, train_dataset=train, eval_dataset=evals or None, processing_class=tokenizer)
    if trainer.video_support is not None:  # (the clips decoded under data.video_*, as SFT and DPO decode them)
        from vlmtrain.models.families import get_family

        trainer.video_support = _video_support(cfg, get_family(parts["model"].config.model_type), tokenizer)
    return trainer


def _head_reward(entry: Any, args: Any) -> Any:
    """A train.reward_funcs directory holding a vlmtrain checkpoint with a reward head, loaded on the policy's
    device and named after the entry (GRPOTrainer loads the other reward models itself); other entries as they
    are."""
    from vlmtrain.compat.grpo_reward_models import HeadReward, reward_head
    from vlmtrain.inference import load_for_inference

    head = reward_head(entry) if isinstance(entry, str) else None
    if head is None:
        return entry
    return HeadReward(load_for_inference(entry, device=args.device), head, args.per_device_train_batch_size,
                      name=entry.rstrip("/").split("/")[-1])


def stream_prompts(cfg: Any, stream: Any, tokenizer: Any, vision: bool) -> Any:
    """data.source: stream's records as GRPO prompts (:func:`prompt_row`; compat/grpo_stream.PromptStream: read
    whole by every process, bad ones counted; train.shuffle_dataset false: its shards in order). Each source
    is read first up to its first prompt: one without any is a ConfigError naming it (data.sources[i])."""
    import functools

    from vlmtrain.compat.grpo_stream import PromptStream
    from vlmtrain.data.sources import StreamingDataset
    from vlmtrain.data.streams import make_source

    convert = functools.partial(prompt_row, tokenizer=tokenizer, vision=vision)
    for i, spec in enumerate(cfg.data.sources):
        try:
            source = make_source(spec, cfg.data.seed)
        except Exception:  # noqa: BLE001 - left out of the stream already, with its reason logged
            continue
        alone = StreamingDataset([source], seed=cfg.data.seed, filters=stream.filters)
        next(iter(PromptStream(alone, convert, name=f"data.sources[{i}]")))
    return PromptStream(stream, convert, name="data.sources")
