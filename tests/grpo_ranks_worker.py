"""Run by tests/test_grpo_ranks.py, alone or as torchrun's ranks: `python grpo_ranks_worker.py OUT MODEL_DIR
VLM_DIR CASE...`. Per case (:data:`CASES`): vlmtrain's GRPOTrainer on a tiny Llama (or, ``vision``, a tiny Qwen3-VL
whose even prompts have an image, or with ``vision="video"`` a video: under 2 ranks rank 0's, rank 1's text only),
its completions scripted per prompt (:class:`ScriptedCompletions`, through the Generator protocol), trained 3 steps
with AdamW with weight decay (with ``log_completions``), then evaluated on :func:`eval_prompts` (5 groups in eval
batches of one group: rank 0 evaluates 3 batches, rank 1 2; in the vision cases rank 0's prompts all have an image
or a video, rank 1's none); rank 0 writes the policy's weights, the logged rows and the evaluation's metrics to
OUT/<case>-<world size>.pt, each rank the number of eval batches it generated for (and of those with an image or a
video) to OUT/<case>-<world size>-evals-<rank>.txt. One process group serves every case.

The prompts come in order (``shuffle_dataset=False``), one group per rank per generation: the ranks' prompts and
completions differ in length, rank 1's first group is all truncated (``mask_truncated_completions``: no loss token
on that rank), rank 0's second group gets equal rewards (zero advantage)."""

from __future__ import annotations

import os
import random
import sys

import torch

# case -> GRPOConfig options (per-device batch and accumulation given for 2 ranks; one process takes twice the batch)
CASES = {
    "dapo-batch-scaled": dict(loss_type="dapo", beta=0.1, scale_rewards="batch", mask_truncated_completions=True,
                              per_device_train_batch_size=4, gradient_accumulation_steps=1),
    "grpo-accum-mu2": dict(loss_type="grpo", beta=0.0, num_iterations=2, mask_truncated_completions=True,
                           per_device_train_batch_size=2, gradient_accumulation_steps=2),
    "vision-images-on-rank-0": dict(loss_type="dapo", beta=0.0, per_device_train_batch_size=4,
                                    gradient_accumulation_steps=1, vision=True),
    # groups of 4 cut by the ranks' slices (3 prompts, 6 rows a rank: rank 1's start in the second group's middle)
    "vision-group-across-ranks": dict(loss_type="dapo", beta=0.1, per_device_train_batch_size=6,
                                      gradient_accumulation_steps=1, vision=True),
    # the prompts from a stream (StreamingDataset over a JSONL file): every rank reads it whole, takes its slice
    "stream-dapo-accum-mu2": dict(loss_type="dapo", beta=0.1, num_iterations=2, mask_truncated_completions=True,
                                  per_device_train_batch_size=2, gradient_accumulation_steps=2, stream=True),
    # rank 0's prompts have a video, rank 1's text only (its forwards run the dummy video and image)
    "video-on-rank-0": dict(loss_type="dapo", beta=0.1, per_device_train_batch_size=4, gradient_accumulation_steps=1,
                            vision="video"),
}
ADAM_EPSILON = 1e-3
"""(As tests/rank_preference_worker.py: Adam magnifies the ranks' other summation order on a near-zero gradient;
1e-3 bounds that, the weight decay still moves every parameter.)"""
LIMIT = 6
GROUP = 4  # num_generations
EVAL_PROMPTS = 5  # (eval batches of one group: 5 batches, 3 on rank 0 and 2 on rank 1)
# each prompt's behaviour, in dataset order: with one group per rank per generation, rank 0 gets the even prompts
KINDS = ["short", "truncated", "equal", "long", "short", "long", "long", "short"]
WORDS = ["w1", "w2", "w3", "w4", "w5", "w6", "w7", "w8"]


def prompts() -> list[dict]:
    rng = random.Random(3)
    return [{"prompt": " ".join(rng.choice(WORDS) for _ in range(2 + 3 * (i % 2) + rng.randint(0, 2))), "kind": k}
            for i, k in enumerate(KINDS)]


class ScriptedCompletions:
    """A Generator: each row's completion a function of its prompt's kind, the call and its place in its group (a
    rank's rows are its slice of the generation batch), so that two ranks and one process get the same completions
    for a group, a group cut by the ranks' slices too. ``short``: 1-3
    tokens; ``long``: 3-6; ``truncated``: LIMIT tokens without EOS; ``equal``: 3 tokens, all ending in EOS."""

    def __init__(self, kinds: dict[tuple[int, ...], str], eos: int) -> None:
        self.kinds, self.eos, self.calls, self.eval_calls, self.eval_image_calls = kinds, eos, 0, 0, 0

    def __call__(self, model, prompt_ids, **vision):
        self.calls += model.training
        self.eval_calls += not model.training
        groups = vision.get("vision")  # (a VLM's eval batch: whether its prompt has an image)
        self.eval_image_calls += not model.training and groups is not None and (
            any(groups.images) or any(groups.videos.tokens))
        call = self.calls if model.training else "eval"  # (an eval batch's: whichever process evaluates it)
        first = int(os.environ.get("RANK", "0")) * len(prompt_ids)  # (this rank's first row in the generation)
        out = []
        for i, ids in enumerate(prompt_ids):
            key = tuple(ids)
            rng = random.Random(f"{key}-{call}-{(first + i) % GROUP + 1}")
            kind = self.kinds.get(key, "long")  # (a VLM's prompt ids: its image placeholders expanded)
            n = {"short": rng.randint(1, 3), "long": rng.randint(3, LIMIT), "truncated": LIMIT, "equal": 3}[kind]
            row = [rng.randrange(4, 16) for _ in range(n)]
            if kind == "equal" or (kind != "truncated" and (n < LIMIT and rng.random() < 0.7)):
                row[-1] = self.eos
            out.append(row)
        return out


def length_reward(completion_ids, **kwargs):
    return [float(len(c) % 3) + 0.5 * float(4 in c) for c in completion_ids]


def vision_prompts() -> list[dict]:
    """Conversational prompts, the even ones with an image (TRL's layout: an ``images`` column)."""
    from PIL import Image

    rng = random.Random(4)
    return [{"prompt": [{"role": "user", "content": " ".join(rng.choice(["red", "two", "how", "many", "blue"])
                                                             for _ in range(rng.randint(1, 4)))}],
             "images": [Image.new("RGB", (32, 32), tuple(rng.randrange(256) for _ in range(3)))] * (1 - i % 2)}
            for i in range(8)]


def _stream(rows: list[dict], out: str, case: str):
    """The prompts as vlmtrain's StreamingDataset over a JSONL file (one file per process: none reads another's)."""
    import json

    from vlmtrain.data.sources import JsonlSource, StreamingDataset

    path = os.path.join(out, f"{case}-{os.environ.get('WORLD_SIZE', '1')}-{os.environ.get('RANK', '0')}.jsonl")
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return StreamingDataset([JsonlSource(path)], seed=7)


def eval_prompts(rows: list[dict], seed: int, vision: bool) -> list[dict]:
    """5 of ``rows``; for a VLM, the image on the prompts that TRL's seeded eval order (a permutation seeded with
    ``seed``) puts at even places: with one group per eval batch, dealt round-robin, those are rank 0's."""
    rows = [dict(r) for r in rows[:EVAL_PROMPTS]]
    if vision:
        key = "videos" if vision == "video" else "images"
        media = next(r[key] for r in rows if r[key])
        for place, index in enumerate(torch.randperm(len(rows), generator=torch.Generator().manual_seed(seed))):
            rows[index][key] = media if place % 2 == 0 else []
    return rows


def video_prompts(processor) -> list[dict]:
    """:func:`vision_prompts` with a video (4 random frames, decoded small as tests/test_grpo_video.py decodes
    them) in the even prompts instead of an image."""
    from tests.test_grpo_video import SETTINGS, clip
    from vlmtrain.models.families import get_family

    video = get_family("qwen3_vl").video(processor, SETTINGS)
    return [{"prompt": row["prompt"], "videos": [clip(video, i, 4)] * (1 - i % 2)}
            for i, row in enumerate(vision_prompts())]


def run(case: str, model_dir: str, vlm_dir: str, out: str) -> None:
    from datasets import Dataset

    import vlmtrain
    from tests.test_dpo import _tokenizer

    options = dict(CASES[case])
    vision, stream = options.pop("vision", False), options.pop("stream", False)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    options["per_device_train_batch_size"] = options["per_device_train_batch_size"] * 2 // world
    args = vlmtrain.GRPOConfig(
        os.path.join(out, f"{case}-{world}"), num_generations=GROUP, max_completion_length=LIMIT, max_steps=3,
        shuffle_dataset=False, optim="adamw_torch", learning_rate=1e-2, weight_decay=0.1, adam_epsilon=ADAM_EPSILON,
        lr_scheduler_type="constant", logging_steps=1, seed=7, bf16=False, gradient_checkpointing=False,
        report_to="none", save_strategy="no", use_cpu=True, dataloader_num_workers=0, disable_tqdm=True,
        ddp_timeout=30, log_completions=True, per_device_eval_batch_size=GROUP, **options)
    if vision:
        from transformers import AutoModelForImageTextToText

        from vlmtrain.models.families import get_family

        model = AutoModelForImageTextToText.from_pretrained(vlm_dir, dtype=torch.float32)
        processor = get_family("qwen3_vl").load_processor(vlm_dir)
        rows, kinds, eos, tokenizer = vision_prompts(), {}, processor.tokenizer.convert_tokens_to_ids("<|im_end|>"), processor
        rows = video_prompts(processor) if vision == "video" else rows
    else:
        model, tokenizer, rows = model_dir, _tokenizer(), prompts()
        kinds = {tuple(tokenizer(r["prompt"])["input_ids"]): r["kind"] for r in rows}
        assert len(kinds) == len(rows), "two prompts alike"
        eos = tokenizer.eos_token_id
    generator = ScriptedCompletions(kinds, eos)
    dataset = list if vision == "video" else Dataset.from_list  # (decoded VideoClips stay Python objects)
    trainer = vlmtrain.GRPOTrainer(model=model, reward_funcs=length_reward, args=args,
                                   train_dataset=_stream(rows, out, case) if stream else dataset(rows),
                                   processing_class=tokenizer, eval_dataset=dataset(eval_prompts(rows, args.seed, vision)),
                                   generator=generator)
    result = trainer.train()
    evaluation = trainer.evaluate()
    with open(os.path.join(out, f"{case}-{world}-evals-{trainer.rank}.txt"), "w") as f:
        f.write(f"{generator.eval_calls} {generator.eval_image_calls}")
    if trainer.rank == 0:
        torch.save({"weights": {k: v.detach().clone() for k, v in trainer.policy.state_dict().items()},
                    "global_step": result.global_step, "logs": trainer.state.log_history, "eval": evaluation},
                   os.path.join(out, f"{case}-{world}.pt"))


def main(out: str, model_dir: str, vlm_dir: str, cases: list[str]) -> None:
    from vlmtrain.trainer import distributed

    torch.set_num_threads(1)
    for case in cases:
        run(case, model_dir, vlm_dir, out)
    distributed.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:])
