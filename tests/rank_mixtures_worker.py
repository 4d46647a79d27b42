"""Training runs in which each rank gets its own mixture of samples (tests/test_rank_mixtures.py): answered ones
(LM targets and head labels), score-only ones (head labels only), ones with no target at all, and bad ones the
collator skips (as a corrupt image is). Run in process as the 1-process reference, or under torchrun, where
rank r gets the samples of its own list: global sample i * W + r is rank r's i-th (sequential sampling), so a
1-process run with W times the per-device batch sees the same samples in each step.

Writes OUT/<scenario>/result.pt on rank 0 (log_history, metrics.jsonl rows, final weights, evaluation metrics) and, when
training stops with an error, OUT/<scenario>/error_<rank>.txt on each rank that raised."""

from __future__ import annotations

import json
import os
import random
import sys

import torch

from tests.tiny import VOCAB, tiny_llama
from vlmtrain import Trainer, TrainingArguments
from vlmtrain.models.objectives.heads import WithHeads, head_label_tensors, parse_heads

HEADS = {"cls": {"type": "classification", "num_outputs": 3, "weight": 0.5},
         "reg": {"type": "regression", "loss": "mse", "weight": 2.0}}
KINDS = ("answer", "score", "none", "bad")
BAD_REASON = "corrupt_image"


def sample(kind: str, index: int) -> dict:
    """A sample of one kind, its tokens and labels drawn from its global index."""
    g = torch.Generator().manual_seed(1000 + index)
    length = 3 + int(torch.randint(0, 12, (1,), generator=g))
    ids = torch.randint(1, VOCAB, (length,), generator=g).tolist()
    out = {"id": index, "input_ids": ids, "labels": {}}
    if kind in ("answer", "score"):
        out["labels"] = {"cls": int(ids[-1]) % 3, "reg": float(ids[0]) / VOCAB}
    if kind == "answer":
        out["lm_labels"] = [-100] * 2 + ids[2:]
    if kind == "bad":
        out["bad"] = True
    return out


def interleave(per_rank: list[list[str]]) -> list[dict]:
    """The global dataset whose sample i * W + r is rank r's i-th (all ranks' lists have one length)."""
    world = len(per_rank)
    return [sample(per_rank[r][i], i * world + r) for i in range(len(per_rank[0])) for r in range(world)]


class Collate:
    """Right-padded ids and mask; bad samples dropped and counted (``skipped``, ``skipped_keys``), as a real
    collator drops a corrupt image. With heads: LM `labels` only when some sample has LM targets (a score-only
    batch has none, as HubVLMCollator makes it) and head labels; without (a plain LM): `labels` always (-100
    where a sample has no target)."""

    def __init__(self, heads: bool) -> None:
        self.heads = parse_heads(HEADS) if heads else None

    def __call__(self, batch: list[dict]) -> dict:
        bad = [s for s in batch if s.get("bad")]
        batch = [s for s in batch if not s.get("bad")]
        skipped = {"skipped": {BAD_REASON: len(bad)}, "skipped_keys": [f"sample-{s['id']}" for s in bad]} if bad else {}
        if not batch:
            return skipped
        longest = max(len(s["input_ids"]) for s in batch)
        pad = [longest - len(s["input_ids"]) for s in batch]
        out = {"input_ids": torch.tensor([s["input_ids"] + [0] * p for s, p in zip(batch, pad)]),
               "attention_mask": torch.tensor([[1] * len(s["input_ids"]) + [0] * p for s, p in zip(batch, pad)])}
        if self.heads is None or any("lm_labels" in s for s in batch):
            out["labels"] = torch.tensor([s.get("lm_labels", [-100] * len(s["input_ids"])) + [-100] * p
                                          for s, p in zip(batch, pad)])
        if self.heads is not None:
            out.update(head_label_tensors(self.heads, [s["labels"] for s in batch]))
        return {**out, **skipped}


def random_mixture(seed: int, world: int, samples: int, batch: int) -> list[list[str]]:
    """Each rank's own random mixture of the four kinds; no micro-batch is all bad (a rank whose micro-batch is
    empty has every rank skip it: tests/test_rank_sync.py covers that)."""
    rng = random.Random(seed)
    per_rank = []
    for _ in range(world):
        weights = [rng.uniform(0.1, 1.0) for _ in KINDS]  # this rank's own mixture
        kinds: list[str] = []
        while len(kinds) < samples:
            chunk = rng.choices(KINDS, weights, k=batch)
            if any(k != "bad" for k in chunk):
                kinds += chunk
        per_rank.append(kinds)
    return per_rank


OPTIMIZERS = {"sgd": {"optim": "sgd", "learning_rate": 0.02},
              "adamw": {"optim": "adamw_torch", "learning_rate": 0.01, "weight_decay": 0.1}}


def scenario(name: str) -> dict:
    """Each rank's samples (train and eval), the model and the arguments of a named case (2 ranks; random3_*: 3);
    a name ending in -adamw trains with AdamW and weight decay (else SGD)."""
    name, adamw, _ = name.partition("-adamw")
    base = {"model": "heads", "batch": 2, "accum": 1, "steps": 4, "logging_steps": 2, "eval": None, "args": {},
            "optimizer": OPTIMIZERS["adamw" if adamw else "sgd"]}
    if name == "score_only_window":  # rank 1 has no LM target in the first logging window (steps 1-2)
        return {**base, "train": [["answer", "score", "answer", "answer", "score", "answer", "answer", "answer"],
                                  ["score", "score", "score", "score", "answer", "score", "answer", "score"]],
                "eval": [["answer", "score", "answer", "score"], ["score", "score", "score", "score"]]}
    if name in ("bad_on_rank1", "too_many_bad"):  # rank 1: 2 of 4 samples bad, the two ranks: 2 of 8
        limit = 0.4 if name == "bad_on_rank1" else 0.2
        return {**base, "steps": 2, "train": [["answer", "score", "answer", "answer"], ["bad", "score", "answer", "bad"]],
                "args": {"max_bad_sample_fraction": limit}}
    if name == "no_target_window":  # a plain LM; rank 1's whole first accumulation window has no target
        return {**base, "model": "lm", "accum": 2, "steps": 3, "logging_steps": 1,
                "train": [["answer"] * 12, ["none"] * 4 + ["answer"] * 8]}
    if name.startswith(("random_", "random3_")):  # random3_<seed>: 3 ranks
        seed, world = int(name.split("_")[1]), 3 if name.startswith("random3_") else 2
        return {**base, "accum": 2, "train": random_mixture(seed, world, 16, 2),
                "eval": random_mixture(seed + 100, world, 6, 2), "args": {"max_bad_sample_fraction": 1.0}}
    raise ValueError(f"unknown scenario {name!r}")


def run(out: str, name: str) -> dict:
    """Trains (and evaluates) the scenario on this process's ranks; the 1-process reference when not under
    torchrun (the same global samples, W times the per-device batch)."""
    case = scenario(name)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    scale = len(case["train"]) // world  # 1 process: the ranks' batches side by side
    torch.manual_seed(0)
    model = WithHeads(tiny_llama(0), HEADS) if case["model"] == "heads" else tiny_llama(0)
    args = TrainingArguments(
        output_dir=out, max_steps=case["steps"], per_device_train_batch_size=case["batch"] * scale,
        per_device_eval_batch_size=case["batch"] * scale, gradient_accumulation_steps=case["accum"],
        train_sampling_strategy="sequential", **case["optimizer"], max_grad_norm=0.0,
        logging_steps=case["logging_steps"], save_strategy="no", disable_tqdm=True, report_to="none", seed=0,
        ddp_timeout=60, use_cpu=True, **case["args"])
    trainer = Trainer(model, args, data_collator=Collate(case["model"] == "heads"),
                      train_dataset=interleave(case["train"]))
    result: dict = {"world_size": trainer.world_size}
    try:
        trainer.train()
    except RuntimeError as e:
        if "max_bad_sample_fraction" not in str(e):
            raise
        with open(os.path.join(out, f"error_{trainer.rank}.txt"), "w") as f:
            f.write(str(e))
        return result
    if case["eval"] is not None:
        result["eval"] = trainer.evaluate(interleave(case["eval"]))
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))] if trainer.rank == 0 else []
    result.update(logs=trainer.state.log_history, rows=rows,
                  weights={k: v.detach().clone() for k, v in trainer.model.state_dict().items()})
    if trainer.rank == 0:
        torch.save(result, os.path.join(out, "result.pt"))
    return result


if __name__ == "__main__":
    for name in sys.argv[2].split(","):  # several scenarios, one after the other in one process group
        os.makedirs(os.path.join(sys.argv[1], name), exist_ok=True)
        run(os.path.join(sys.argv[1], name), name)
