"""data.source: shapes_pairs — the shapes scenes (:mod:`vlmtrain.tasks.shapes`) as preference pairs, for the
two-stage preference demo: one 64 px scene and a colour, shape or count question; ``chosen`` is the right
answer, ``rejected`` a wrong one of the same kind. With ``train.objective: sft`` the same questions come as
conversations answered right (stage 1); with dpo or reward as pairs (stage 2, and the reward-head variant)."""

from __future__ import annotations

import hashlib
import random
from typing import Any

from torch.utils.data import Dataset

from vlmtrain.data.registry import DataSource

PAIR_QTYPES = ("color", "shape", "count")
"""The question types asked: each has a wrong answer of its own kind (another colour, shape or number)."""


class ShapesPairs(Dataset):
    """Item ``i`` of :class:`~vlmtrain.tasks.shapes.ShapesVQA` (one image, :data:`PAIR_QTYPES`) as a pair:
    ``{"images", "texts": [{"user": question}], "chosen": truth, "rejected": a wrong answer, "qtype", "id"}``;
    with ``pairs=False`` the SFT sample itself (``texts: [{"user", "assistant": truth}]``). The wrong answer is
    a pure function of (seed, split, i), as the scene is."""

    def __init__(self, split: str, num_samples: int, seed: int = 0, pairs: bool = True,
                 qtypes: tuple[str, ...] = PAIR_QTYPES) -> None:
        from vlmtrain.tasks.shapes import ShapesVQA

        self.vqa = ShapesVQA(split, num_samples, seed=seed, multi_image_fraction=0.0, qtypes=list(qtypes))
        self.pairs = pairs

    def __len__(self) -> int:
        return len(self.vqa)

    def __getitem__(self, index: int) -> dict[str, Any]:
        from vlmtrain.tasks.shapes import ANSWERS

        sample = self.vqa[index]
        if not self.pairs:
            return sample
        turn = sample["texts"][0]
        digest = hashlib.sha256(f"shapes-pairs-{self.vqa.seed}-{sample['id']}".encode()).digest()
        wrong = [a for a in ANSWERS[sample["qtype"]] if a != turn["assistant"]]
        rejected = random.Random(int.from_bytes(digest[:8], "big")).choice(wrong)
        return {"images": sample["images"], "texts": [{"user": turn["user"]}], "chosen": turn["assistant"],
                "rejected": rejected, "qtype": sample["qtype"], "id": sample["id"]}


def build(cfg: Any) -> dict[str, Any]:
    """SFT (train.objective sft): training conversations and one eval set per question type (greedy exact
    match, with train.predict_with_generate); dpo / reward: training pairs and one held-out set of pairs."""
    d, pairs = cfg.data, cfg.train.objective != "sft"
    train = ShapesPairs("train", d.num_train, seed=d.seed, pairs=pairs)
    if pairs:
        return {"train_dataset": train, "eval_dataset": ShapesPairs("val", d.num_eval, seed=d.seed)}
    return {"train_dataset": train,
            "eval_dataset": {q: ShapesPairs("val", d.num_eval, seed=d.seed, pairs=False, qtypes=(q,))
                             for q in PAIR_QTYPES}}


def chance() -> dict[str, float]:
    """Random answers: exact match per question type and overall (one eval set per type), pair accuracy 0.5."""
    from vlmtrain.tasks.shapes import CHANCE

    out = {f"{q}_exact_match": CHANCE[q] for q in PAIR_QTYPES}
    out["exact_match"] = sum(CHANCE[q] for q in PAIR_QTYPES) / len(PAIR_QTYPES)
    out.update({"rewards/accuracies": 0.5, "prefers_chosen": 0.5})
    return out


def demo_report(trainer: Any, metrics: dict[str, Any]) -> str:
    """Stage 1 (sft): greedy exact match per question type; the reward-head variant: each reward head's pair
    accuracy; both beside chance. (A dpo run's report, stage 1 beside stage 2, is the DPO demo's own:
    vlmtrain/evaluation/preference_demo.py.)"""
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
