"""What `vlmtrain demo` prints after DPO of a Hub VLM (train.objective dpo, model.kind hub_vlm): on the held-out
pairs, the preference accuracy and greedy exact match of the model it started from (model.pretrained: stage 1)
and of the trained one (its last checkpoint: stage 2), beside the data source's chance values."""

from __future__ import annotations

from typing import Any

import torch


def report(trainer: Any, metrics: dict[str, Any], stage1: str, stage2: str, chance: dict[str, float]) -> str:
    """The table; adds ``eval_exact_match``, ``eval_<qtype>_exact_match`` (pairs with a ``qtype``) and
    ``eval_prefers_chosen`` of stage 2 (checkpoint ``stage2``), and the same as ``stage1_*`` of ``stage1``, to
    ``metrics``."""
    pairs = trainer.eval_dataset
    for prefix, checkpoint in (("stage1", stage1), ("eval", stage2)):
        metrics.update(measure(checkpoint, pairs, trainer.data_collator, prefix))
    qtypes = sorted({k[len("stage1_"):-len("_exact_match")] for k in metrics
                     if k.startswith("stage1_") and k.endswith("_exact_match")} - {""})
    rows = [("preference accuracy (eval_rewards/accuracies)", [None, metrics.get("eval_rewards/accuracies")],
             chance.get("rewards/accuracies", 0.5)),
            ("prefers chosen (log-probs)", [metrics["stage1_prefers_chosen"], metrics["eval_prefers_chosen"]], 0.5),
            ("greedy exact match", [metrics["stage1_exact_match"], metrics["eval_exact_match"]],
             chance.get("exact_match"))]
    rows += [(f"  {q}", [metrics[f"stage1_{q}_exact_match"], metrics[f"eval_{q}_exact_match"]],
              chance.get(f"{q}_exact_match")) for q in qtypes]
    return (table(rows, ["stage 1", "stage 2"]) + f"\n  ({len(pairs)} held-out pairs; stage 1: {stage1}; "
            "eval_rewards/accuracies is DPO's, against stage 1 as the reference)")


def measure(checkpoint: str, pairs: Any, collator: Any, prefix: str, batch_size: int = 50) -> dict[str, float]:
    """A Hub VLM checkpoint's greedy exact match on the held-out pairs' questions (``<prefix>_exact_match``, and
    per ``qtype`` where the pairs have one) and how often it gives the chosen answer the higher log-prob
    (``<prefix>_prefers_chosen``); ``collator``: the run's pair collator (data/hub_pairs.py)."""
    from vlmtrain.models.hub.hub_loading import load_for_inference
    from vlmtrain.models.objectives.dpo import pair_logps

    parts = load_for_inference(checkpoint, torch.device("cpu"), torch.float32)
    right: dict[str, list[bool]] = {}
    prefers: list[bool] = []
    for start in range(0, len(pairs), batch_size):
        samples = [pairs[i] for i in range(start, min(start + batch_size, len(pairs)))]
        answers = parts["generate"]([{"images": s["images"], "texts": s["texts"]} for s in samples], 8)
        for sample, answer in zip(samples, answers):
            right.setdefault(sample.get("qtype", ""), []).append(answer.strip() == sample["chosen"])
        batch = {k: v for k, v in collator(samples).items() if isinstance(v, torch.Tensor)}
        with torch.no_grad():
            chosen, rejected = pair_logps(parts["model"], batch).chunk(2)
        prefers += (chosen > rejected).tolist()
    every = [r for group in right.values() for r in group]
    return {f"{prefix}_exact_match": sum(every) / len(every), f"{prefix}_prefers_chosen": sum(prefers) / len(prefers),
            **{f"{prefix}_{q}_exact_match": sum(r) / len(r) for q, r in right.items() if q}}


def table(rows: list[tuple[str, list[Any], float | None]], columns: list[str]) -> str:
    """Rows of (name, values, chance) under ``columns`` and a chance column; None prints as '-'."""
    def cell(value: Any) -> str:
        return f"{value:>9.3f}" if isinstance(value, float) else f"{'-':>9}"

    lines = [f"  {'held-out':<46}" + "".join(f"{c:>9}" for c in columns) + f"{'chance':>9}"]
    lines += [f"  {name:<46}" + "".join(cell(v) for v in values) + cell(odds) for name, values, odds in rows]
    return "\n".join(lines)
