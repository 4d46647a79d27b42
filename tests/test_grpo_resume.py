"""GRPO resumes exactly: a run stopped at a checkpoint and resumed in a new GRPOTrainer (built as the first was)
ends with the weights and logged rows of the uninterrupted run. The checkpoint falls in the second epoch (the
prompt sampler's permutation and position), inside a generation buffer (``num_iterations`` 2: the buffered
completions and the old policy's log-probs come from the checkpoint) and inside a logging window (its rollout
metrics); completions are sampled (temperature 1: torch's RNG, restored); the reference is a frozen copy of the
initial policy (full fine-tune) or the policy with its adapters off (LoRA), ``beta`` 0.1."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

import vlmtrain
from tests.optional_extras import requires
from tests.test_dpo import _tokenizer
from tests.test_grpo import _prompts, length_reward, model_dir  # noqa: F401 (model_dir: the tiny Llama, a fixture)
from tests.test_resume import StopAt
from vlmtrain.compat.grpo_rollout import GroupSampler
from vlmtrain.errors import CheckpointError

STEPS, STOP = 9, 7  # 3 prompts, one a generation, each generation 2 steps: 6 steps an epoch; step 7 in epoch 2


def _stream(out) -> object:
    """The prompts as a stream (vlmtrain's StreamingDataset over a JSONL file): one shard, read in order each epoch."""
    import json

    from vlmtrain.data.sources import JsonlSource, StreamingDataset

    path = out.parent / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in _prompts(3).to_list()))
    return StreamingDataset([JsonlSource(str(path))], seed=7)


def _train(model_dir, out, lora: bool, stop: int | None = None, resume: bool | str = False,  # noqa: F811
           stream: bool = False, save: int = STOP):
    from peft import LoraConfig

    args = vlmtrain.GRPOConfig(str(out), num_generations=4, per_device_train_batch_size=4, max_completion_length=5,
                               num_iterations=2, beta=0.1, max_steps=STEPS, save_steps=save, logging_steps=2,
                               learning_rate=1e-2, weight_decay=0.1, seed=7, bf16=False, gradient_checkpointing=False,
                               report_to="none", use_cpu=True, dataloader_num_workers=0, disable_tqdm=True,
                               log_completions=True)
    trainer = vlmtrain.GRPOTrainer(model=str(model_dir), reward_funcs=length_reward, args=args,
                                   train_dataset=_stream(out) if stream else _prompts(3), processing_class=_tokenizer(),
                                   peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
                                   if lora else None, callbacks=[StopAt(stop)] if stop else None)
    trainer.train(resume_from_checkpoint=resume or None)
    weights = {k: v.detach().clone() for k, v in trainer.policy.state_dict().items()}
    return [r for r in trainer.state.log_history if "loss" in r], weights, trainer


@pytest.mark.parametrize("lora,stream,stop", [(False, False, STOP), (True, False, STOP), (False, True, STOP),
                                              (False, True, 6)],
                         ids=["full", "lora", "full-stream", "full-stream-epoch-end"])
def test_grpo_resumed_mid_buffer_ends_like_the_uninterrupted_run(model_dir, tmp_path, lora, stream,  # noqa: F811
                                                                 stop, one_thread):
    """(``stream``: the prompts from a StreamingDataset; the checkpoint holds the stream's place where the buffered
    generation batch began and the repeats of it already taken; ``stop`` 6: the checkpoint at the first epoch's end,
    the stream read to its end, and the resumed run goes on with the next epoch.)"""
    straight_logs, straight, _ = _train(model_dir, tmp_path / "straight", lora, stream=stream)
    _, stopped, _ = _train(model_dir, tmp_path / "run", lora, stop=stop, stream=stream, save=stop)
    assert os.listdir(tmp_path / "run") and (tmp_path / "run" / f"checkpoint-{stop}").is_dir()
    logs, weights, trainer = _train(model_dir, tmp_path / "run", lora, resume=True, stream=stream, save=stop)
    assert trainer.state.global_step == STEPS and trainer.state.epoch >= 1  # (a stream: the epochs done)
    assert any(not torch.equal(stopped[k], weights[k]) for k in weights)  # (the resumed run trained)
    differ = [k for k in straight if not torch.equal(straight[k], weights[k])]
    assert not differ, f"weights differ from the uninterrupted run's: {differ[:4]}"
    resumed = [r for r in logs if r["step"] > stop]
    expected = [r for r in straight_logs if r["step"] > stop]
    assert [r["step"] for r in resumed] == [r["step"] for r in expected] == [8]
    # epoch 2 begins with TRL's second permutation of the prompts (seed 7: [1, 0, 2] after [0, 1, 2]); a stream
    # with one shard: its order again
    assert {r["prompt"] for r in expected[0]["completions"]} == {_prompts(3)[0 if stream else 1]["prompt"]}
    for ours, theirs in zip(resumed, expected, strict=True):
        for key in ("loss", "kl", "entropy", "reward", "reward_std", "completions/mean_length", "completions"):
            assert ours[key] == theirs[key], key
    if lora:
        assert any("lora_A" in k for k in weights)
        checkpoint = tmp_path / "run" / f"checkpoint-{stop}"
        shutil.copy(checkpoint / "loop_state_0.pt", checkpoint / "loop_state_1.pt")  # (as if 2 processes wrote it)
        with pytest.raises(CheckpointError, match="a GRPO run resumes with the number of processes that wrote it"):
            _train(model_dir, tmp_path / "run", lora, resume=str(checkpoint))
    else:  # the reference: the initial policy, not a copy of the checkpoint's
        from transformers import AutoModelForCausalLM

        base, ref = AutoModelForCausalLM.from_pretrained(model_dir).state_dict(), trainer.ref_model.state_dict()
        assert all(torch.equal(ref[k], base[k]) for k in base)


@requires("trl", "dev")
def test_group_sampler_gives_each_rank_its_slice_of_trls_order_in_every_epoch():
    """The prompt order of epoch e is TRL's RepeatSampler's (e + 1)-th pass whatever the sampler did before (a
    resumed run's sampler starts in its epoch); under 2 processes each takes its batches as accelerate hands
    them out (batch i of the stream to process i % 2)."""
    from trl.trainer.utils import RepeatSampler

    trl = RepeatSampler(range(10), mini_repeat_count=4, batch_size=2, repeat_count=3, shuffle=True, seed=5)
    passes = [list(trl), list(trl)]
    assert passes[0] != passes[1]
    for epoch in (1, 0):
        batches = [passes[epoch][i:i + 4] for i in range(0, len(passes[epoch]), 4)]  # (4 rows a process's batch)
        for rank in (0, 1):
            sampler = GroupSampler(10, 4, 2, 3, shuffle=True, seed=5, rank=rank, world_size=2)
            sampler.set_epoch(epoch)
            assert list(sampler) == [i for b in batches[rank::2] for i in b]
            assert len(sampler) == len(passes[epoch]) // 2
