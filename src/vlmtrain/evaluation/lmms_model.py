"""A vlmtrain checkpoint as an lmms-eval model (imports lmms_eval: load this module only through lmms.py)."""

from __future__ import annotations

import logging
from typing import Any

from lmms_eval.api.instance import Instance
from lmms_eval.api.model import lmms
from tqdm import tqdm

from vlmtrain.errors import ConfigError

logger = logging.getLogger(__name__)


class VlmtrainLMM(lmms):
    """Greedy generation from a vlmtrain checkpoint (any model kind: vlm, hub_vlm, causal_lm), loaded once
    by the kind's load_generator. generate_until takes each task's max_new_tokens and cuts the answer at its
    `until` strings; other sampling options are ignored (always greedy). Likelihood requests are refused."""

    is_simple = True

    def __init__(self, checkpoint: str, device: str | None = None, max_new_tokens: int | str = 32,
                 **_ignored: Any) -> None:
        super().__init__()
        from vlmtrain.checkpoint_paths import resolve_checkpoint
        from vlmtrain.models.kinds import kind_of_checkpoint
        from vlmtrain.trainer.model_files import has_sharded_weights

        ckpt = resolve_checkpoint(checkpoint, checkpoint)
        if has_sharded_weights(ckpt):
            raise ConfigError(f"{ckpt} holds FSDP shards: run `vlmtrain export --checkpoint {ckpt}` first.")
        kind = kind_of_checkpoint(ckpt)
        if kind.load_generator is None:
            raise ConfigError(f"model kind {kind.name!r} of {ckpt} cannot generate, so lmms-eval cannot run it.")
        if device is None:
            import torch

            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.checkpoint = ckpt
        self.max_new_tokens = int(max_new_tokens)
        self._answer = kind.load_generator(ckpt, device)

    def generate_until(self, requests: list[Instance]) -> list[str]:
        answers = []
        for request in tqdm(requests, desc="lmms-eval generate", disable=len(requests) < 2):
            context, gen_kwargs, doc_to_visual, doc_id, task, split = request.args
            visuals = doc_to_visual(self.task_dict[task][split][doc_id]) if doc_to_visual is not None else []
            visuals = [v for v in (visuals if isinstance(visuals, list) else [visuals]) if v is not None]
            max_new_tokens = int((gen_kwargs or {}).get("max_new_tokens") or self.max_new_tokens)
            text = cut_at_stop(self._answer(context, visuals, max_new_tokens), (gen_kwargs or {}).get("until"))
            answers.append(text)
            self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
        return answers

    def loglikelihood(self, requests: list[Instance]) -> list[tuple[float, bool]]:
        raise NotImplementedError("vlmtrain's lmms-eval model only generates (generate_until): tasks with "
                                  "output_type loglikelihood or multiple_choice cannot run on it.")

    def generate_until_multi_round(self, requests: list[Instance]) -> list[str]:
        raise NotImplementedError("vlmtrain's lmms-eval model answers one turn per request (generate_until): "
                                  "multi-round tasks cannot run on it.")


def cut_at_stop(text: str, until: str | list[str] | None) -> str:
    """text up to the first of the stop strings (lmms-eval's `until`), stripped."""
    for stop in [until] if isinstance(until, str) else (until or []):
        if stop:
            text = text.split(stop, 1)[0]
    return text.strip()
