"""Run by tests/test_rank_preference.py, alone or under torchrun: `python rank_preference_worker.py OUT VLM_DIR
REWARD_DIR CASE...`. Per case (tests/test_rank_preference.py's CASES): vlmtrain's DPOTrainer (a tiny Qwen3-VL,
pairs with and without images) or RewardTrainer (a tiny Llama), trained 2 steps with AdamW (DPO: then evaluated); the policy's
parameters gathered whole (FSDP shards included) and written by rank 0 with the logged rows to
OUT/<case>-<world size>.pt. One process group serves every case."""

from __future__ import annotations

import os
import random
import sys

import torch

# case -> (trainer, per-device pairs at world size 2, gradient accumulation, fsdp, lora)
CASES = {
    "dpo-ddp-lora": ("dpo", 1, 2, False, True),
    "dpo-fsdp-full": ("dpo", 2, 1, True, False),
    "reward-ddp": ("reward", 2, 2, False, False),
}
ADAM_EPSILON = 1e-3
"""Adam divides each gradient by its running magnitude: on a gradient near 0 (below ~1e-7) the ranks' other
summation order (float noise, ~1e-9) becomes a step of a good part of the learning rate (1.4e-4 seen with the
default 1e-8). An epsilon of 1e-3 bounds that magnification; the weight decay still moves every parameter that
gets a gradient, zero included."""
IMAGES = [1, 0, 2, 0, 0, 1, 0, 0]
"""Images per train pair: under 2 ranks rank 0 gets the even pairs, rank 1 the odd ones, so a micro-batch has
images on one rank and none on the other (pairs 0-3), then on the other rank (4-5), then on none (6-7 with one
pair per rank)."""


def vision_pairs() -> list[dict]:
    """The DPO pairs (:data:`IMAGES`), of different lengths, in TRL's vision layout."""
    from PIL import Image

    words = ["red", "blue", "green", "square", "circle", "two", "three", "a", "the", "big"]
    rng = random.Random(5)
    out = []
    for n in IMAGES:
        def text(lo: int, hi: int) -> str:
            return " ".join(rng.choice(words) for _ in range(rng.randint(lo, hi)))

        images = [Image.new("RGB", rng.choice([(32, 32), (48, 32)]), tuple(rng.randrange(256) for _ in range(3)))
                  for _ in range(n)]
        out.append({"images": images,
                    "prompt": [{"role": "user", "content": [{"type": "image"}] * n
                                + [{"type": "text", "text": text(1, 6)}]}],
                    "chosen": [{"role": "assistant", "content": [{"type": "text", "text": text(1, 5)}]}],
                    "rejected": [{"role": "assistant", "content": [{"type": "text", "text": text(1, 5)}]}]})
    return out


def _policy_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter whole (a collective under FSDP: every rank calls it)."""
    return {name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for name, p in model.named_parameters()}


def run(case: str, vlm_dir: str, reward_dir: str, out: str) -> None:
    from datasets import Dataset

    import vlmtrain

    kind, batch, accumulation, fsdp, lora = CASES[case]
    world = int(os.environ.get("WORLD_SIZE", "1"))
    options = dict(per_device_train_batch_size=batch * 2 // world, gradient_accumulation_steps=accumulation,
                   max_steps=2, optim="adamw_torch", learning_rate=1e-2, weight_decay=0.1, adam_epsilon=ADAM_EPSILON,
                   lr_scheduler_type="constant", logging_steps=1, seed=7, bf16=False, gradient_checkpointing=False,
                   report_to="none", save_strategy="no", eval_strategy="no", train_sampling_strategy="sequential",
                   use_cpu=True, dataloader_num_workers=0, disable_tqdm=True, ddp_timeout=30,
                   fsdp=fsdp and world > 1)
    output_dir = os.path.join(out, f"{case}-{world}")
    if kind == "dpo":
        from transformers import AutoModelForImageTextToText

        from vlmtrain.models.families import get_family

        model = AutoModelForImageTextToText.from_pretrained(vlm_dir, dtype=torch.float32)
        peft_config = None
        if lora:
            from peft import LoraConfig

            peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["qkv", "q_proj", "v_proj"])
        trainer = vlmtrain.DPOTrainer(model=model, args=vlmtrain.DPOConfig(output_dir, max_length=None, **options),
                                      train_dataset=Dataset.from_list(vision_pairs()),
                                      eval_dataset=Dataset.from_list(vision_pairs()[:4]),
                                      processing_class=get_family("qwen3_vl").load_processor(vlm_dir),
                                      peft_config=peft_config)
        policy = trainer.policy
    else:
        from transformers import AutoModelForSequenceClassification

        from tests.test_dpo import _tokenizer
        from tests.test_reward import _pairs

        model = AutoModelForSequenceClassification.from_pretrained(reward_dir, dtype=torch.float32)
        trainer = vlmtrain.RewardTrainer(model=model, args=vlmtrain.RewardConfig(output_dir, max_length=16,
                                                                                 **options),
                                         train_dataset=_pairs(16, 0, "explicit", margin=True, longest=6),
                                         processing_class=_tokenizer())
        policy = model
    initial = _policy_weights(policy)
    ref = getattr(trainer, "ref_model", None)  # (DPO's frozen copy; None: the adapters off)
    gathered: list[str] = []  # the reference's parameters still gathered after a DPO forward (before backward)
    if ref is not None:
        trainer.model.register_forward_hook(lambda *_: gathered.extend(
            n for n, p in ref.named_parameters() if not hasattr(p, "full_tensor")))
    result = trainer.train()
    evaluation = trainer.evaluate() if kind == "dpo" else {}
    weights = _policy_weights(policy)
    reference = None if ref is None else {
        "sharded": all(hasattr(p, "full_tensor") for p in ref.parameters()), "weights": _policy_weights(ref),
        "gathered": sorted(set(gathered))}
    if trainer.rank == 0:
        torch.save({"initial": initial, "weights": weights, "global_step": result.global_step,
                    "logs": trainer.state.log_history, "reference": reference,
                    "eval": evaluation},
                   os.path.join(out, f"{case}-{world}.pt"))


def main(out: str, vlm_dir: str, reward_dir: str, cases: list[str]) -> None:
    from vlmtrain.trainer import distributed

    torch.set_num_threads(1)
    for case in cases:
        run(case, vlm_dir, reward_dir, out)
    distributed.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:])
