"""Run by tests/test_grpo_kill.py in a process of its own: `python grpo_kill_worker.py OUT MODEL_DIR [STOP READY]`.
vlmtrain's GRPOTrainer (tests/test_grpo_resume.py's run: sampled completions, num_iterations 2, beta 0.1) trained
to step 9 with a checkpoint every 3 steps, resuming from OUT's newest checkpoint where there is one; with STOP, the
process stops at the start of step STOP, creates the file READY and blocks there until it is killed."""

from __future__ import annotations

import os
import sys
import threading

import torch


def main(out: str, model_dir: str, stop: int | None = None, ready: str | None = None) -> None:
    from datasets import Dataset

    import vlmtrain
    from tests.test_dpo import _tokenizer
    from tests.test_grpo import _prompts, length_reward

    torch.set_num_threads(1)
    if stop is not None:
        real_step = vlmtrain.GRPOTrainer.training_step

        def training_step(self, *args, **kwargs):
            if self.state.global_step + 1 == stop:
                open(ready, "w").close()
                threading.Event().wait()  # (until killed)
            return real_step(self, *args, **kwargs)

        vlmtrain.GRPOTrainer.training_step = training_step
    args = vlmtrain.GRPOConfig(out, num_generations=4, per_device_train_batch_size=4, max_completion_length=5,
                               num_iterations=2, beta=0.1, max_steps=9, save_steps=3, logging_steps=1,
                               learning_rate=1e-2, weight_decay=0.1, seed=7, bf16=False, gradient_checkpointing=False,
                               report_to="none", use_cpu=True, dataloader_num_workers=0, disable_tqdm=True)
    trainer = vlmtrain.GRPOTrainer(model=model_dir, reward_funcs=length_reward, args=args,
                                   train_dataset=Dataset.from_list(list(_prompts(3))), processing_class=_tokenizer())
    resume = any(n.startswith("checkpoint-") for n in os.listdir(out)) if os.path.isdir(out) else False
    trainer.train(resume_from_checkpoint=resume or None)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], *([int(sys.argv[3]), sys.argv[4]] if len(sys.argv) > 3 else []))
