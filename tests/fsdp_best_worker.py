"""One rank of tests/test_fsdp_eval.py's load_best_model_at_end test: `torchrun ... fsdp_best_worker.py OUT_DIR`.

Two runs under train.fsdp, evaluated and saved at every step with load_best_model_at_end and the *highest*
eval loss as the best metric (so an early checkpoint is best): a full fine-tune of a tiny Llama and a LoRA +
score heads model. After train() each model is evaluated; then its weights are written as files
(Trainer.save_model: model.safetensors, or adapter + heads files), the last checkpoint is loaded over them and
evaluated, and the files are loaded back with setup.load_model_state and evaluated. Rank 0 writes
OUT_DIR/rank0.json with the logged and measured eval losses.
"""

from __future__ import annotations

import json
import os
import sys

import torch
from test_heads import HEADS, Collate, samples
from tiny import tiny_llama

from vlmtrain import Trainer, TrainingArguments
from vlmtrain.models.hub.lora import apply_lora
from vlmtrain.models.objectives.heads import WithHeads
from vlmtrain.parallel import fsdp
from vlmtrain.trainer.setup import load_model_state


def lm_samples() -> list[dict]:
    """Every sample with LM targets (and head labels, for the heads model)."""
    out = []
    for s in samples(24, seed=5):
        ids = s["input_ids"]
        out.append({"input_ids": ids, "lm_labels": [-100] + ids[1:],
                    "labels": {"cls": ids[-1] % 3, "reg": ids[0] / 48}})
    return out


def lora_heads_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return apply_lora(WithHeads(tiny_llama(1), HEADS), {"r": 4}, "model", {})


def save_files(trainer: Trainer, name: str, directory: str) -> None:
    """The sharded model written as files (rank 0): model.safetensors, or the adapter and heads files of an
    unsharded copy holding the gathered weights."""
    if name == "full":
        trainer.save_model(directory)
        return
    state = fsdp.full_state_dict(trainer.model)
    if trainer.rank == 0:
        copy = lora_heads_model()
        copy.load_state_dict(state)
        Trainer.parts.model_files.save_model_files(copy, directory)


def run(name: str, model: torch.nn.Module, out_dir: str) -> dict:
    data = lm_samples()
    args = TrainingArguments(output_dir=os.path.join(out_dir, name), fsdp=True, max_steps=4, learning_rate=2e-2,
                             per_device_train_batch_size=4, per_device_eval_batch_size=4, eval_strategy="steps",
                             eval_steps=1, save_steps=1, load_best_model_at_end=True, metric_for_best_model="loss",
                             greater_is_better=True, disable_tqdm=True, report_to="none", seed=0)
    heads = getattr(model, "head_configs", None) or {}
    trainer = Trainer(model, args, train_dataset=data[:16], eval_dataset=data[16:], data_collator=Collate(heads))
    trainer.train()
    logged = {row["step"]: row["eval_loss"] for row in trainer.state.log_history if "eval_loss" in row}
    result = {"best_step": trainer.state.best_global_step, "logged": logged,
              "best_checkpoint": os.path.basename(trainer.state.best_model_checkpoint),
              "after_train": trainer.evaluate()["eval_loss"]}
    files = os.path.join(out_dir, name, "best-files")
    save_files(trainer, name, files)
    torch.distributed.barrier()
    result["files"] = sorted(os.listdir(files))
    load_model_state(trainer.model, os.path.join(out_dir, name, "checkpoint-4"), trainer.parts)  # DCP shards
    result["last_loaded"] = trainer.evaluate()["eval_loss"]
    load_model_state(trainer.model, files, trainer.parts)  # full tensors, cut into this rank's shards
    result["files_loaded"] = trainer.evaluate()["eval_loss"]
    return result


def main(out_dir: str) -> None:
    torch.set_num_threads(1)
    result = {"full": run("full", tiny_llama(0), out_dir)}
    result["lora"] = run("lora", lora_heads_model(), out_dir)
    if torch.distributed.get_rank() == 0:
        with open(os.path.join(out_dir, "rank0.json"), "w") as f:
            json.dump(result, f)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
