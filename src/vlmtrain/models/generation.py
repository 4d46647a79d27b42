"""Generation for the Trainer's predict_with_generate, in transformers' generate() conventions: greedy decoding
with the tokenizer's pad id, ``synced_gpus`` for FSDP ranks on different batches, and the new tokens decoded to
texts. :data:`GREEDY` is vlmtrain.Trainer's ``generation`` part (trainer/parts.py)."""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch import nn


class GreedyGeneration:
    """What the Trainer's evaluation asks of a model's generate(): new token ids, whether ranks can generate in
    step, and texts."""

    def generate(self, model: nn.Module, prompt: Mapping[str, torch.Tensor], processing_class: Any,
                 max_new_tokens: int, synced_gpus: bool = False) -> torch.Tensor:
        """Greedy generation from the batch's prompt inputs (``prompt_*`` without the prefix); returns only the
        new tokens, the pad id (``processing_class``'s tokenizer's, if any) as -100. ``synced_gpus``: every rank
        runs forward until every rank's generations are done (FSDP, ranks on different batches)."""
        tok = getattr(processing_class, "tokenizer", processing_class)  # a processor's tokenizer
        kwargs = {"max_new_tokens": max_new_tokens, "do_sample": False}
        if tok is not None and getattr(tok, "pad_token_id", None) is not None:
            kwargs["pad_token_id"] = tok.pad_token_id
        if synced_gpus:
            kwargs["synced_gpus"] = True
        out = model.generate(**prompt, **kwargs)
        new = out[:, prompt["input_ids"].shape[1]:]
        if kwargs.get("pad_token_id") is not None:
            new = new.masked_fill(new == kwargs["pad_token_id"], -100)
        return new

    def generates_in_step(self, model: nn.Module) -> bool:
        """Whether the model's generate takes `synced_gpus` (transformers' generate does): every rank then runs
        forward until every rank's generations are done, as FSDP needs (each forward is a collective)."""
        generate = getattr(model, "generate", None)
        if generate is None:
            return False
        try:
            params = inspect.signature(generate).parameters
        except (TypeError, ValueError):
            return False
        # (wrappers such as peft's pass **kwargs through to a transformers model)
        return "synced_gpus" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())

    def texts(self, processing_class: Any, generated: np.ndarray) -> list[str] | None:
        """Each row of generated ids (-100: padding) decoded without special tokens; None without a
        ``processing_class`` that decodes."""
        if not hasattr(processing_class, "decode"):
            return None
        return [processing_class.decode([t for t in row if t >= 0], skip_special_tokens=True)
                for row in generated.tolist()]


GREEDY = GreedyGeneration()
