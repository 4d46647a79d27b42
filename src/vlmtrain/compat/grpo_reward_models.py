"""Reward models in GRPO's ``reward_funcs``, as reward functions: TRL 1.16's sequence-classification models with
one label (a path or Hub id, or a model object; each prompt + completion scored by its logit), and vlmtrain's own
checkpoints with a ``reward`` score head (the output of a ``train.objective: reward`` run, given as
``vlmtrain.load_for_inference(path)``; each prompt + completion scored as a training sample, with the row's
images). Both score in evaluation mode without gradients, in batches, on the device they were loaded on (the
policy's: ``args.device``, in a run config); each process holds its own copy."""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from torch import nn

from ..data.vision_reward_pairs import message_text, message_turns
from ..errors import ConfigError


def _name(path: str) -> str:
    """TRL's metric name of a reward model: the last part of its path or id."""
    return str(path).rstrip("/").split("/")[-1]


def _text(content: Any) -> str:
    """A message's text (a content list's text parts: a reward model reads text)."""
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    return content


def _flat(messages: list[dict]) -> list[dict]:
    return [{**m, "content": _text(m["content"])} for m in messages]


class SequenceClassifierReward:
    """A sequence-classification model with one label scoring each prompt + completion as TRL's GRPOTrainer
    does: plain strings joined, chat messages rendered by ``tokenizer``'s chat template; tokenized without special
    tokens, right-padded (the model reads the last non-pad token), the reward its logit. ``__name__`` is TRL's
    metric name (the last part of the model's path or id)."""

    def __init__(self, model: nn.Module, tokenizer: Any, device: torch.device | str, batch_size: int) -> None:
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        model.config.get_text_config().pad_token_id = tokenizer.pad_token_id  # (as TRL: the last non-pad token)
        self.model = model.to(device).eval().requires_grad_(False)
        self.tokenizer, self.device, self.batch_size = tokenizer, torch.device(device), max(1, batch_size)
        self.__name__ = _name(model.config._name_or_path) or type(model).__name__

    @torch.no_grad()
    def __call__(self, prompts: list, completions: list, **kwargs: Any) -> list[float]:
        if isinstance(prompts[0], list):
            texts = [self.tokenizer.apply_chat_template(_flat(p + c), tokenize=False)
                     for p, c in zip(prompts, completions, strict=True)]
        else:
            texts = [p + c for p, c in zip(prompts, completions, strict=True)]
        rewards: list[float] = []
        for i in range(0, len(texts), self.batch_size):
            inputs = self.tokenizer(text=texts[i:i + self.batch_size], return_tensors="pt", padding=True,
                                    padding_side="right", add_special_tokens=False).to(self.device)
            rewards += self.model(**inputs).logits[:, 0].float().tolist()
        return rewards


class HeadReward:
    """A vlmtrain checkpoint's ``reward`` score head as a reward function: ``inference`` is the checkpoint loaded
    with :func:`vlmtrain.load_for_inference` (on the device it scores on); each prompt (its user and assistant
    turns' text) + completion is a training sample (``texts`` turns, the completion the last answer; the row's
    ``images`` / ``image``), processed and scored as its ``score`` does; a sample its processing skips (too long,
    ...) is not scored (None). ``__name__``: ``name``, else the checkpoint's (its run directory's for a
    ``checkpoint-N``)."""

    def __init__(self, inference: Any, head: str, batch_size: int, name: str | None = None) -> None:
        self.inference, self.head, self.batch_size = inference, head, max(1, batch_size)
        self.inference.model.eval().requires_grad_(False)
        path = str(inference.checkpoint or "").rstrip("/")
        if os.path.basename(path).startswith("checkpoint-"):
            path = os.path.dirname(path)
        self.__name__ = name or _name(path) or head

    def __call__(self, prompts: list, completions: list, images: list | None = None, image: list | None = None,
                 **kwargs: Any) -> list[float | None]:
        samples = []
        for i, (prompt, completion) in enumerate(zip(prompts, completions, strict=True)):
            turns = _turns(prompt, message_text(completion[-1]["content"]) if isinstance(completion, list) else completion)
            row_images = list(images[i] or []) if images is not None else (
                [image[i]] if image is not None and image[i] is not None else [])
            samples.append({"images": row_images, "texts": turns})
        rows = self.inference.score(samples, batch_size=self.batch_size)
        return [row.get(self.head) for row in rows]


def _turns(prompt: str | list[dict], completion: str) -> list[dict[str, str]]:
    """vlmtrain's ``texts`` turns of a prompt (a string: one user turn; messages: as a reward pair's prompt becomes
    its turns, data/vision_reward_pairs.message_turns) answered by ``completion``."""
    turns = [{"user": prompt}] if isinstance(prompt, str) else message_turns(prompt)
    turns[-1]["assistant"] = completion
    return turns


def reward_head(path: str) -> str | None:
    """The name of the first ``reward`` score head of a vlmtrain checkpoint (or a run directory's newest
    checkpoint) at ``path``; None where there is none."""
    from ..checkpoint_paths import resolve_checkpoint

    try:
        checkpoint = resolve_checkpoint(path, path)
    except ConfigError:
        return None
    heads_file = os.path.join(checkpoint, "heads.json")
    if not os.path.isfile(heads_file):
        return None
    with open(heads_file) as f:
        heads = json.load(f).get("heads", {})
    return next((name for name, spec in heads.items() if spec.get("type") == "reward"), None)


def check_reward_model_dir(path: str, where: str) -> str | None:
    """What a directory in reward_funcs holds, checked without loading it: a vlmtrain checkpoint with a ``reward``
    head (its name is returned), or a sequence-classification model with one label (None); anything else is one
    ConfigError naming the entry and what was expected."""
    head = reward_head(path)
    if head is not None:
        return head
    config_file = os.path.join(path, "config.json")
    config = {}
    if os.path.isfile(config_file):
        with open(config_file) as f:
            config = json.load(f)
    architectures = config.get("architectures") or []
    labels = len(config.get("id2label") or {}) or config.get("num_labels", 2)  # (transformers' default: 2)
    if not any(a.endswith("ForSequenceClassification") for a in architectures) or labels != 1:
        found = f"{', '.join(architectures) or 'no model'} with {labels} labels" if architectures else "no model"
        raise ConfigError(f"{where} {path!r}: a reward model directory holds a sequence-classification model with "
                          f"one label (config.json: *ForSequenceClassification, num_labels 1) or a vlmtrain checkpoint "
                          f"with a reward head (train.objective: reward); found {found}.")
    return None


def load_reward_model(entry: Any, processing_class: Any, init_kwargs: dict[str, Any] | None,
                      device: torch.device | str, batch_size: int, where: str) -> Any:
    """A reward_funcs entry that is a model as a reward function: a :func:`vlmtrain.load_for_inference` model with
    a reward head (:class:`HeadReward`), else a sequence-classification model (an object, or a path or Hub id
    loaded with one label as TRL loads it: :class:`SequenceClassifierReward` on ``device``), scored with
    ``processing_class`` (default: the model's tokenizer). A checkpoint directory with a reward head is refused:
    the caller loads it (load_for_inference is above this layer)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    if hasattr(entry, "head_configs") and hasattr(entry, "score"):  # (an InferenceModel)
        head = next((n for n, c in entry.head_configs.items() if c.type == "reward"), None)
        if head is None:
            raise ConfigError(f"{where} {entry.checkpoint!r} has no reward head (its heads: "
                              f"{sorted(entry.head_configs)}): train one with train.objective: reward.")
        return HeadReward(entry, head, batch_size)
    if isinstance(entry, str):
        if os.path.isdir(entry) and check_reward_model_dir(entry, where) is not None:
            raise ConfigError(f"{where} {entry!r} is a vlmtrain checkpoint with a reward head: pass "
                              f"vlmtrain.load_for_inference({entry!r}) in reward_funcs.")
        entry = AutoModelForSequenceClassification.from_pretrained(entry, num_labels=1, **(init_kwargs or {}))
    if not hasattr(entry, "config"):
        raise ConfigError(f"{where} {type(entry).__name__}: a reward model is a transformers sequence-classification "
                          "model (with a config); wrap other modules in a function.")
    if processing_class is None:
        processing_class = AutoTokenizer.from_pretrained(entry.config._name_or_path)
    return SequenceClassifierReward(entry, processing_class, device, batch_size)
