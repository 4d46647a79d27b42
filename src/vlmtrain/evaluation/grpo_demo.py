"""What `vlmtrain demo` prints after GRPO of a Hub VLM on data.source shapes_pairs (the GRPO learning demo,
configs/qwen3vl-tiny-pairs-grpo.yaml): the held-out greedy exact match of the model it started from
(model.pretrained: the SFT stage) and of the trained one (its last checkpoint), beside chance."""

from __future__ import annotations

from typing import Any

import torch


def report(metrics: dict[str, Any], stage1: str, stage2: str, held_out: Any, chance: float | None) -> str:
    """The table; adds ``stage1_exact_match`` (checkpoint ``stage1``) and ``eval_exact_match`` (``stage2``) on
    ``held_out`` (shapes_pairs' pairs: ``images``, ``texts``, the truth as ``chosen``) to ``metrics``."""
    from vlmtrain.evaluation.preference_demo import table

    metrics["stage1_exact_match"] = exact_match(stage1, held_out)
    metrics["eval_exact_match"] = exact_match(stage2, held_out)
    return (table([("greedy exact match", [metrics["stage1_exact_match"], metrics["eval_exact_match"]], chance)],
                  ["SFT", "GRPO"])
            + f"\n  ({len(held_out)} held-out questions; after SFT: {stage1}; after GRPO: {stage2})")


def exact_match(checkpoint: str, pairs: Any, batch_size: int = 50) -> float:
    """A Hub VLM checkpoint's greedy exact match on the pairs' questions."""
    from vlmtrain.models.hub.hub_loading import load_for_inference

    generate, right = load_for_inference(checkpoint, torch.device("cpu"), torch.float32)["generate"], 0
    for start in range(0, len(pairs), batch_size):
        samples = [pairs[i] for i in range(start, min(start + batch_size, len(pairs)))]
        answers = generate([{"images": s["images"], "texts": s["texts"]} for s in samples], 8)
        right += sum(a.strip() == s["chosen"] for a, s in zip(answers, samples, strict=True))
    return right / len(pairs)
