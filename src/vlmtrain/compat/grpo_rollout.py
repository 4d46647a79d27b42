"""GRPO's rollouts: the :class:`Generator` protocol (token ids of prompts in, completion ids out) with the policy's
own ``generate`` as the default (:class:`HFGenerate`: batched, left padding, KV cache, synchronous with training),
the place a vLLM engine plugs in; the prompt sampler that repeats each prompt ``num_generations`` times
(TRL's RepeatSampler order), and the reward functions' calls."""

from __future__ import annotations

import importlib
import logging
import math
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import torch
from torch import nn
from torch.utils.data import Sampler

from ..errors import ConfigError

logger = logging.getLogger(__name__)


class Generator(Protocol):
    """Completions for a batch of prompts: ``prompt_ids`` (one list of token ids per row, each prompt already
    repeated for its group) -> one list of completion token ids per row, each ending at its first EOS (kept) or
    at the length limit. A vLLM engine (weights synced from the policy before each call) is one of these. For a
    vision-language model's prompts it is also given ``vision=`` (compat/grpo_vision.py's ``VisionGroups``)."""

    def __call__(self, model: nn.Module, prompt_ids: list[list[int]]) -> list[list[int]]: ...


class HFGenerate:
    """The policy's own ``generate``: the rows left-padded into one batch, sampled with ``generation_config``
    (KV cache on), each completion cut after its first EOS."""

    def __init__(self, generation_config: Any, pad_token_id: int, eos_token_ids: Sequence[int]) -> None:
        self.generation_config, self.pad, self.eos = generation_config, pad_token_id, list(eos_token_ids)

    @torch.no_grad()
    def __call__(self, model: nn.Module, prompt_ids: list[list[int]]) -> list[list[int]]:
        ids, mask = pad_rows(prompt_ids, self.pad, "left", next(model.parameters()).device)
        return self.generate(model, {"input_ids": ids, "attention_mask": mask})

    def prepare(self, model: nn.Module, inputs: dict[str, Any]) -> dict[str, Any]:
        """``generate``'s keyword arguments from the padded rows (in evaluation mode, without gradients)."""
        return inputs

    @torch.no_grad()
    def generate(self, model: nn.Module, inputs: dict[str, Any]) -> list[list[int]]:
        """The completions of the left-padded rows ``inputs`` (``input_ids``, ``attention_mask``, ...), each cut
        after its first EOS; the model in evaluation mode meanwhile."""
        was_training = model.training
        model.eval()
        try:
            out = model.generate(**self.prepare(model, inputs), generation_config=self.generation_config)
        finally:
            model.train(was_training)
        completions = []
        for row in out[:, inputs["input_ids"].shape[1]:].tolist():
            end = next((i for i, t in enumerate(row) if t in self.eos), None)
            completions.append(row if end is None else row[:end + 1])
        return completions


def pad_rows(rows: list[list[int]], pad: int, side: str, device: torch.device | str = "cpu"
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Token id rows padded on ``side`` ("left": prompts, "right": completions) to the longest (at least 1, an
    empty completion still a column), and their attention mask."""
    width = max(1, max(len(r) for r in rows))

    def padded(row: list[int], fill: int) -> list[int]:
        return [fill] * (width - len(row)) + row if side == "left" else row + [fill] * (width - len(row))

    ids = torch.tensor([padded(r, pad) for r in rows], dtype=torch.long, device=device)
    mask = torch.tensor([padded([1] * len(r), 0) for r in rows], dtype=torch.long, device=device)
    return ids, mask


class GroupSampler(Sampler[int]):
    """TRL's RepeatSampler order: a seeded permutation of the prompts cut into generation batches of
    ``batch_size`` prompts (a partial last one dropped), each batch repeated ``repeat_count`` times (the
    micro-steps and iterations it feeds), each prompt ``mini_repeat_count`` times in a row (its group). With
    ``world_size`` processes each repeat of a generation batch is cut in ``world_size`` equal slices, process
    ``rank`` taking slice ``rank`` (as accelerate hands TRL's processes their batches). The permutation is
    the epoch's (:meth:`set_epoch`): the ``epoch + 1``-th of one generator seeded with ``seed``, as TRL's
    sampler draws them one epoch after another, so that a resumed run finds the same order."""

    def __init__(self, size: int, mini_repeat_count: int, batch_size: int, repeat_count: int, shuffle: bool,
                 seed: int, rank: int = 0, world_size: int = 1) -> None:
        self.size, self.mini, self.batch, self.repeat = size, mini_repeat_count, batch_size, repeat_count
        self.shuffle, self.seed, self.rank, self.world_size, self.epoch = shuffle, seed, rank, world_size, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _order(self) -> list[int]:
        if not self.shuffle:
            return list(range(self.size))
        generator = torch.Generator().manual_seed(self.seed)
        for _ in range(self.epoch):  # (the earlier epochs' draws)
            torch.randperm(self.size, generator=generator)
        return torch.randperm(self.size, generator=generator).tolist()

    def __iter__(self) -> Iterator[int]:
        order, share = self._order(), self.batch * self.mini // self.world_size
        for start in range(0, self.size - self.batch + 1, self.batch):
            rows = [index for index in order[start:start + self.batch] for _ in range(self.mini)]
            for _ in range(self.repeat):
                yield from rows[self.rank * share:(self.rank + 1) * share]

    def __len__(self) -> int:
        return (self.size // self.batch) * self.batch * self.mini * self.repeat // self.world_size


def prompt_token_ids(tokenizer: Any, rows: Sequence[dict[str, Any]]) -> list[list[int]]:
    """Each row's prompt token ids: its ``prompt_ids`` where it has them (a YAML run's `texts` prompts, laid out
    as SFT lays them out: config_grpo.prompt_row); for chat messages the chat template with the generation
    prompt; else the tokenizer's ids of the string."""
    if "prompt_ids" in rows[0]:
        return [list(r["prompt_ids"]) for r in rows]
    prompts = [r["prompt"] for r in rows]
    if isinstance(prompts[0], list):
        return [tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=True, return_dict=True)
                ["input_ids"] for p in prompts]
    return tokenizer(text=prompts)["input_ids"]


def resolve_reward_funcs(reward_funcs: Any, where: str = "reward function", processing_classes: Any = None,
                         init_kwargs: dict[str, Any] | None = None, device: torch.device | str = "cpu",
                         batch_size: int = 8, models: bool = True) -> tuple[list[Callable], list[str]]:
    """The reward functions (callables, or ``module:function`` strings imported here) and their names; ``where``
    names the setting in errors (a run config: ``train.reward_funcs``). With ``models``, an entry that is a
    model (an ``nn.Module``, a directory, a string without ``:``: a Hub id, as TRL reads it, or a
    ``vlmtrain.load_for_inference`` model with a reward head) is loaded as a reward function (compat/grpo_reward_models.py) on ``device``, scored with its ``processing_classes`` entry
    (one per reward function, or one for all; None: the model's tokenizer) in batches of ``batch_size``."""
    from .grpo_reward_models import load_reward_model

    funcs = list(reward_funcs) if isinstance(reward_funcs, list | tuple) else [reward_funcs]
    classes = (list(processing_classes) if isinstance(processing_classes, list | tuple)
               else [processing_classes] * (len(funcs) if processing_classes is None else 1))
    if len(classes) != len(funcs):
        raise ConfigError(f"The number of reward processing classes ({len(classes)}) must match the number of "
                          f"reward functions ({len(funcs)}).")
    resolved = []
    for f, processing_class in zip(funcs, classes, strict=True):
        if models and (isinstance(f, nn.Module) or hasattr(f, "head_configs")
                       or isinstance(f, str) and (os.path.isdir(f) or ":" not in f)):
            f = load_reward_model(f, processing_class, init_kwargs, device, batch_size, where)
        elif isinstance(f, str):
            f = _import_reward(f, where)
        if isinstance(f, nn.Module) or not callable(f):
            raise ConfigError(f"{where} {f!r}: vlmtrain's GRPO takes Python callables, 'module:function' strings "
                              "and reward models.")
        resolved.append(f)
    return resolved, [getattr(f, "__name__", type(f).__name__) for f in resolved]


def _import_reward(name: str, where: str) -> Callable:
    """A ``module:function`` string's function; one that does not import is a ConfigError naming it and why."""
    module, _, attr = name.partition(":")
    if not module or not attr:
        raise ConfigError(f"{where} {name!r}: not a 'module:function' string or a directory (a reward model); give "
                          "one of those.")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as err:
        raise ConfigError(f"{where}: {name!r} does not import ({type(err).__name__}: {err}); make {module!r} "
                          f"importable (on PYTHONPATH) with a function {attr!r}.") from None


def score(funcs: list[Callable], names: list[str], prompts: list, completions: list, completion_ids: list,
          columns: dict[str, list], skipped: dict[str, int], **extra: Any) -> torch.Tensor:
    """Rewards [N, F] of each function for each completion (TRL's call: ``prompts``, ``completions``,
    ``completion_ids``, the dataset's other columns as keyword arguments; None means not scored: NaN). A function
    that raises is retried per sample: a sample on which it raises is not scored by it, counted in ``skipped``
    under its name; a wrong number of rewards or a NaN reward is an error naming it."""
    rewards = torch.full((len(prompts), len(funcs)), float("nan"))
    for j, (f, name) in enumerate(zip(funcs, names, strict=True)):
        kwargs = {**columns, **extra}
        try:
            out = list(f(prompts=prompts, completions=completions, completion_ids=completion_ids, **kwargs))
        except Exception as batch_err:  # noqa: BLE001 - found per sample below: a failing sample is skipped, counted
            out, failures = [], 0
            for i in range(len(prompts)):
                try:
                    out += list(f(prompts=prompts[i:i + 1], completions=completions[i:i + 1],
                                  completion_ids=completion_ids[i:i + 1],
                                  **{k: v[i:i + 1] for k, v in columns.items()}, **extra))
                except Exception as err:  # noqa: BLE001
                    if not skipped.get(name):
                        logger.warning("reward function %r raised on a sample (%s: %s): that sample is not "
                                       "scored by it (counted in rewards/%s/skipped)", name, type(err).__name__,
                                       err, name)
                    skipped[name] = skipped.get(name, 0) + 1
                    failures += 1
                    out.append(None)
            if failures == len(prompts):  # (a broken function, not a bad sample: never a batch without rewards)
                raise RuntimeError(f"The reward function '{name}' raised on every completion of the batch "
                                   f"({type(batch_err).__name__}: {batch_err}).") from batch_err
        if len(out) != len(prompts):
            raise ValueError(f"The reward function '{name}' returned {len(out)} rewards, but {len(prompts)} were "
                             "expected (one per prompt-completion pair).")
        bad = [i for i, r in enumerate(out) if r is not None and not math.isfinite(float(r))]
        if bad:
            raise ValueError(f"The reward function '{name}' returned {out[bad[0]]} for completion {bad[0]}: rewards "
                             "must be finite numbers (None: not scored by this function).")
        rewards[:, j] = torch.tensor([float("nan") if r is None else float(r) for r in out])
    return rewards
