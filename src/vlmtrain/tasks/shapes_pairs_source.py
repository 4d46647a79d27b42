"""data.source: shapes_pairs (the dataset: :mod:`vlmtrain.tasks.shapes_pairs`): training and held-out sets, chance
and the demo report. Light at import, as every source module (the config reads the sources before anything is
built)."""

from __future__ import annotations

from typing import Any

from vlmtrain.data.registry import DataSource

GRPO_SEED_OFFSET = 1000
"""A GRPO run's prompts are drawn with data.seed + this: fresh scenes, not the ones stage 1 (SFT) trained on."""


def build(cfg: Any) -> dict[str, Any]:
    """SFT (train.objective sft): training conversations and one eval set per question type (greedy exact
    match, with train.predict_with_generate); dpo / reward: training pairs and one held-out set of pairs; grpo:
    training prompts (:func:`grpo_prompts`) and no eval set (the demo report measures data.num_eval held-out
    questions itself: vlmtrain/evaluation/grpo_demo.py)."""
    from vlmtrain.tasks.shapes_pairs import PAIR_QTYPES, ShapesPairs

    d, pairs = cfg.data, cfg.train.objective != "sft"
    if cfg.train.objective == "grpo":
        return {"train_dataset": grpo_prompts(ShapesPairs("train", d.num_train, seed=d.seed + GRPO_SEED_OFFSET)),
                "eval_dataset": None}
    train = ShapesPairs("train", d.num_train, seed=d.seed, pairs=pairs)
    if pairs:
        return {"train_dataset": train, "eval_dataset": ShapesPairs("val", d.num_eval, seed=d.seed)}
    return {"train_dataset": train,
            "eval_dataset": {q: ShapesPairs("val", d.num_eval, seed=d.seed, pairs=False, qtypes=(q,))
                             for q in PAIR_QTYPES}}


def grpo_prompts(pairs: Any) -> list[dict[str, Any]]:
    """The pairs' questions as GRPO prompts (docs/data.md#grpo-prompts): ``images``, ``texts`` (the question
    alone) and the right answer as ``answer``, the column the exact-match reward reads."""
    return [{k: v for k, v in {**p, "answer": p["chosen"]}.items() if k not in ("chosen", "rejected")}
            for p in pairs]


def chance() -> dict[str, float]:
    """Random answers: exact match per question type and overall (one eval set per type), pair accuracy 0.5."""
    from vlmtrain.tasks.shapes import CHANCE
    from vlmtrain.tasks.shapes_pairs import PAIR_QTYPES

    out = {f"{q}_exact_match": CHANCE[q] for q in PAIR_QTYPES}
    out["exact_match"] = sum(CHANCE[q] for q in PAIR_QTYPES) / len(PAIR_QTYPES)
    out.update({"rewards/accuracies": 0.5, "prefers_chosen": 0.5})
    return out


def demo_report(trainer: Any, metrics: dict[str, Any]) -> str:
    """Stage 1 (sft): greedy exact match per question type; the reward-head variant: each reward head's pair
    accuracy; both beside chance. (A dpo run's report, stage 1 beside stage 2, is the DPO demo's own:
    vlmtrain/evaluation/preference_demo.py.)"""
    from vlmtrain.tasks.shapes_pairs import PAIR_QTYPES

    odds = chance()
    if getattr(trainer.args, "objective", "sft") == "sft":
        rows = [(f"greedy exact match: {q}", metrics.get(f"eval_{q}_exact_match"), odds[f"{q}_exact_match"])
                for q in PAIR_QTYPES]
    else:  # (a reward head's eval_<head>_accuracy: chosen scored above rejected)
        rows = [(f"pair accuracy: {k[len('eval_'):-len('_accuracy')]} head", v, 0.5) for k, v in sorted(metrics.items())
                if k.startswith("eval_") and k.endswith("_accuracy") and k != "eval_mean_token_accuracy"]
    lines = [f"  {'held-out':<40}{'model':>9}{'chance':>9}"]
    lines += [f"  {name:<40}{value if value is not None else float('nan'):>9.3f}{odds:>9.3f}"
              for name, value, odds in rows]
    return "\n".join(lines)


SOURCE = DataSource("shapes_pairs", kinds=("hub_vlm",), build=build, pairs=True, chance=chance,
                    demo_report=demo_report)
