"""One optimizer step of a tiny Llama with score heads on mixed samples (answers with LM targets, score-only ones,
some without one head's label), through the Trainer: in process (1 rank) or under torchrun (tests/
test_loss_counts.py). Writes OUT/result.pt on rank 0: every parameter's gradient just before the optimizer step,
the logs, the ids of the samples each micro-batch held and how often the LM head ran."""

from __future__ import annotations

import os
import sys

import torch

from tests.tiny import VOCAB, tiny_llama
from vlmtrain import Trainer, TrainingArguments
from vlmtrain.models.objectives.heads import WithHeads, head_label_tensors, parse_heads
from vlmtrain.trainer.callbacks import TrainerCallback

HEADS = {"cls": {"type": "classification", "num_outputs": 3, "weight": 0.5},
         "reg": {"type": "regression", "loss": "mse", "weight": 2.0}}


def mixed_samples(n: int = 16, seed: int = 0) -> list[dict]:
    """By i % 4: an answer with both head labels; score-only with both; score-only without `cls`; an answer
    without `reg`. Lengths 3..14, so answers have different LM target counts."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        length = 3 + int(torch.randint(0, 12, (1,), generator=g))
        ids = torch.randint(1, VOCAB, (length,), generator=g).tolist()
        labels = {"cls": int(ids[-1]) % 3, "reg": float(ids[0]) / VOCAB}
        if i % 4 == 2:
            del labels["cls"]
        if i % 4 == 3:
            del labels["reg"]
        sample = {"id": i, "input_ids": ids, "labels": labels}
        if i % 4 in (0, 3):
            sample["lm_labels"] = [-100] * 2 + ids[2:]
        out.append(sample)
    return out


class Collate:
    """Right-padded ids and mask; `labels` only when some sample has LM targets (a score-only batch has none, as
    HubVLMCollator makes it); head labels by head_label_tensors. Records each batch's sample ids."""

    def __init__(self) -> None:
        self.heads = parse_heads(HEADS)
        self.seen: list[list[int]] = []

    def __call__(self, batch: list[dict]) -> dict[str, torch.Tensor]:
        self.seen.append([s["id"] for s in batch])
        longest = max(len(s["input_ids"]) for s in batch)
        out = {"input_ids": torch.tensor([s["input_ids"] + [0] * (longest - len(s["input_ids"])) for s in batch]),
               "attention_mask": torch.tensor([[1] * len(s["input_ids"]) + [0] * (longest - len(s["input_ids"]))
                                               for s in batch])}
        if any("lm_labels" in s for s in batch):
            out["labels"] = torch.tensor([s.get("lm_labels", [-100] * len(s["input_ids"]))
                                          + [-100] * (longest - len(s["input_ids"])) for s in batch])
        out.update(head_label_tensors(self.heads, [s["labels"] for s in batch]))
        return out


def heads_model(seed: int = 0) -> WithHeads:
    return WithHeads(tiny_llama(seed), HEADS)


class GradsBeforeStep(TrainerCallback):
    def __init__(self) -> None:
        self.grads: dict[str, torch.Tensor] = {}

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        for name, p in model.named_parameters():
            if p.grad is not None:
                g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad  # FSDP: gathered
                self.grads[name] = g.detach().clone()


def run(out: str, batch: int, accum: int, fsdp: bool = False) -> dict:
    model = heads_model()
    lm_head_calls = []
    model.base.lm_head.register_forward_hook(lambda module, inputs, output: lm_head_calls.append(1))
    collate, grads = Collate(), GradsBeforeStep()
    args = TrainingArguments(output_dir=out, max_steps=1, per_device_train_batch_size=batch,
                             gradient_accumulation_steps=accum, learning_rate=0.1, max_grad_norm=0.0,
                             logging_steps=1, save_strategy="no", disable_tqdm=True, report_to="none", seed=0,
                             ddp_timeout=60, fsdp=fsdp)
    trainer = Trainer(model, args, data_collator=collate, train_dataset=mixed_samples(), callbacks=[grads])
    trainer.train()
    result = {"grads": grads.grads, "logs": trainer.state.log_history, "batches": collate.seen,
              "lm_head_calls": len(lm_head_calls), "world_size": trainer.world_size}
    if trainer.rank == 0:
        torch.save(result, os.path.join(out, "result.pt"))
    return result


if __name__ == "__main__":
    run(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "fsdp")
