"""One process of tests/test_fsdp_eval.py: `python fsdp_eval_worker.py OUT_DIR`, alone or under torchrun.

A tiny Llama with two score heads (tests/test_heads.py) is evaluated, in batches of 2, on 13 samples (some with
LM targets, some head labels missing), on 11 score-only samples with generation, and on a 1-sample set; under torchrun (2 ranks) the model is first sharded with FSDP2 as
Trainer.train does. Each rank writes OUT_DIR/rank<R>.json: the metrics, per-sample outputs, and the model's
forward calls (and rows) per evaluation, counted by a forward pre-hook.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import torch
from test_heads import HEADS, Collate, samples
from tiny import tiny_llama

from vlmtrain import Trainer, TrainingArguments
from vlmtrain.models.objectives.heads import WithHeads
from vlmtrain.parallel import fsdp


class PromptCollate(Collate):
    """Collate plus the left-padded prompts generation needs (the whole input as the prompt)."""

    def __call__(self, batch: list[dict]) -> dict[str, torch.Tensor]:
        out = super().__call__(batch)
        left = Collate(self.head_configs, side="left")(batch)
        out.update(prompt_input_ids=left["input_ids"], prompt_attention_mask=left["attention_mask"])
        return out


def plain(value):
    if isinstance(value, np.ndarray):
        return value.tolist()
    return value


def main(out_dir: str) -> None:
    torch.set_num_threads(1)
    model = WithHeads(tiny_llama(3), HEADS)
    data = samples(13, seed=3)
    args = TrainingArguments(output_dir=out_dir, fsdp=True, per_device_eval_batch_size=2, disable_tqdm=True,
                             report_to="none", save_strategy="no", generation_max_new_tokens=3)
    trainer = Trainer(model, args, eval_dataset=data, data_collator=PromptCollate(model.head_configs))
    if trainer.world_size > 1:
        fsdp.shard_model(trainer.model)  # as train() does under train.fsdp
    calls: list[int] = []
    trainer.model.register_forward_pre_hook(lambda m, a, kw: calls.append(int(kw["input_ids"].shape[0])),
                                            with_kwargs=True)
    # Score-only samples, every head label present: `loss` (weighted by each batch's items) does not depend on
    # how samples are grouped into batches, as it does when some batches carry LM targets.
    scores = [{"input_ids": s["input_ids"], "labels": {"cls": s["input_ids"][-1] % 3, "reg": s["input_ids"][0] / 48}}
              for s in samples(11, seed=4)]
    result = {"rank": trainer.rank}
    for name, generate, dataset in (("mixed", False, data), ("scores", True, scores), ("one", False, data[:1])):
        trainer.args.predict_with_generate = generate
        calls.clear()
        metrics = trainer.evaluate(dataset)
        result[name] = {"metrics": metrics, "forwards": len(calls), "rows": sum(calls)}
        out = trainer.predict(dataset)
        result[name]["heads"] = {k: plain(v) for k, v in (out.heads or {}).items()}
        result[name]["predictions"] = plain(out.predictions) if generate else None
    with open(os.path.join(out_dir, f"rank{trainer.rank}.json"), "w") as f:
        json.dump(result, f)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
