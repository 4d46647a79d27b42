"""What `vlmtrain demo` prints for data.source shapes_pairs: for stage 2 (train.objective dpo) the held-out
preference accuracy and greedy exact match of the stage-1 model (model.pretrained) and of the trained one, beside
chance; for stage 1 (sft) the exact match per question type; for the reward-head variant the pair accuracy."""

from __future__ import annotations

from typing import Any

import torch

from vlmtrain.tasks.shapes_pairs import PAIR_QTYPES, chance


def report(trainer: Any, metrics: dict[str, Any]) -> str:
    """The demo's table; a dpo run also adds ``eval_exact_match``, ``eval_<type>_exact_match`` and
    ``eval_prefers_chosen`` (stage 2) and ``stage1_*`` (the same of model.pretrained) to ``metrics``."""
    objective = getattr(trainer.args, "objective", "sft")
    odds = chance()
    if objective == "reward":
        return _rows([(f"pair accuracy: {name} head (chosen scored above rejected)",
                       [metrics.get(f"eval_{name}_accuracy")], 0.5) for name in _reward_heads(trainer)], ["model"])
    if objective == "sft":
        return _rows([(f"greedy exact match: {q}", [metrics.get(f"eval_{q}_exact_match")], odds[f"{q}_exact_match"])
                      for q in PAIR_QTYPES], ["model"])
    from vlmtrain.models.hub_loading import run_config_section

    out = trainer.args.output_dir
    stages = {"stage1": run_config_section(out, "model")["pretrained"], "eval": out}
    for prefix, checkpoint in stages.items():
        metrics.update(measure(checkpoint, trainer.eval_dataset, trainer.data_collator, prefix))
    rows = [("preference accuracy (eval_rewards/accuracies)", [None, metrics.get("eval_rewards/accuracies")],
             odds["rewards/accuracies"]),
            ("prefers chosen (log-probs)", [metrics["stage1_prefers_chosen"], metrics["eval_prefers_chosen"]], 0.5),
            ("greedy exact match", [metrics["stage1_exact_match"], metrics["eval_exact_match"]], odds["exact_match"])]
    rows += [(f"  {q}", [metrics[f"stage1_{q}_exact_match"], metrics[f"eval_{q}_exact_match"]],
              odds[f"{q}_exact_match"]) for q in PAIR_QTYPES]
    return (_rows(rows, ["stage 1", "stage 2"]) + f"\n  ({len(trainer.eval_dataset)} held-out pairs; stage 1: "
            f"{stages['stage1']}; eval_rewards/accuracies is DPO's, against stage 1 as the reference)")


def measure(checkpoint: str, pairs: Any, collator: Any, prefix: str, batch_size: int = 50) -> dict[str, float]:
    """A checkpoint's greedy exact match on the held-out pairs' questions (``<prefix>_exact_match``, and per
    type) and how often it gives the chosen answer the higher log-prob (``<prefix>_prefers_chosen``);
    ``collator``: the run's pair collator (data/hub_pairs.py), which lays out a batch of pairs."""
    from vlmtrain import load_for_inference
    from vlmtrain.models.objectives.dpo import pair_logps

    model = load_for_inference(checkpoint, "cpu", "float32")
    right: dict[str, list[bool]] = {q: [] for q in PAIR_QTYPES}
    prefers = []
    for start in range(0, len(pairs), batch_size):
        samples = [pairs[i] for i in range(start, min(start + batch_size, len(pairs)))]
        answers = model.generate([{"images": s["images"], "texts": s["texts"]} for s in samples], max_new_tokens=8)
        for sample, answer in zip(samples, answers):
            right[sample["qtype"]].append(answer.strip() == sample["chosen"])
        batch = {k: v for k, v in collator(samples).items() if isinstance(v, torch.Tensor)}
        with torch.no_grad():
            chosen, rejected = pair_logps(model.model, batch).chunk(2)
        prefers += (chosen > rejected).tolist()
    every = [r for q in PAIR_QTYPES for r in right[q]]
    return {f"{prefix}_exact_match": sum(every) / len(every), f"{prefix}_prefers_chosen": sum(prefers) / len(prefers),
            **{f"{prefix}_{q}_exact_match": sum(right[q]) / max(len(right[q]), 1) for q in PAIR_QTYPES}}


def _reward_heads(trainer: Any) -> list[str]:
    from vlmtrain.models.head_config import parse_heads
    from vlmtrain.models.hub_loading import run_config_section

    heads = parse_heads(run_config_section(trainer.args.output_dir, "model").get("heads"))
    return [name for name, head in heads.items() if head.type == "reward"]


def _rows(rows: list[tuple[str, list[Any], float]], columns: list[str]) -> str:
    def cell(value: Any) -> str:
        return f"{value:>9.3f}" if isinstance(value, float) else f"{'-':>9}"

    lines = [f"  {'held-out':<46}" + "".join(f"{c:>9}" for c in columns) + f"{'chance':>9}"]
    lines += [f"  {name:<46}" + "".join(cell(v) for v in values) + cell(odds) for name, values, odds in rows]
    return "\n".join(lines)

